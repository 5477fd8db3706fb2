"""Families declared outside FCA: in a Python file the user names, or by an installed package.

A **family file** is a Python module that declares one or more `Family` records (`fca.engine.family`):

    FAMILY = Family("my_moe", load=load_my_moe, blocks=..., expert_paths=(...))     # one family
    FAMILIES = [Family("a", load=...), Family("b", load=...)]                      # or several

It may instead (or as well) call `fca.engine.families.register_family(...)`: every family registered
while the file runs counts as declared by it. `load_family_file(path)` runs the file (it is user code:
only ever on request, from `--family FILE`, `FCA_FAMILIES` or a call) and registers what it declares;
the same unchanged file is run once per process. A bad file is one `ModelLoadError` line naming it.

An **installed package** declares families under the entry-point group `fca.families`; each entry
point names a `Family`, a list of them, or a module following the family-file convention:

    [project.entry-points."fca.families"]
    my_moe = "my_package.fca_family:FAMILY"

Installed families join the registry on its first lookup, beside the built-in ones: installing the
package is the consent to run its code. `FCA_FAMILY_ENTRY_POINTS=0` leaves them out.

Precedence, for one model_type: a family registered explicitly (a family file, `register_family`)
replaces an installed one, which replaces a built-in one; the last file given wins among files.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import threading
import traceback
from collections.abc import Callable, Iterable
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from types import ModuleType

from fca.engine.family import Family
from fca.tables.errors import ModelLoadError

ENTRY_POINT_GROUP = "fca.families"
ENTRY_POINTS_ENV = "FCA_FAMILY_ENTRY_POINTS"  # "0": installed families are left out
CONVENTION = "define FAMILY = Family(...) or FAMILIES = [Family(...), ...], or call register_family(...)"

_LOCK = threading.RLock()
# resolved path -> ((mtime_ns, size), the families it declared): an unchanged file is not run again.
_FILES: dict[Path, tuple[tuple[int, int], tuple[Family, ...]]] = {}
# model_type -> (a family declared outside FCA, where: "path/to/family.py", "entry point x of package y").
_SOURCES: dict[str, tuple[Family, str]] = {}


def load_family_file(path: str | Path) -> tuple[Family, ...]:
    """Run a family file and register the families it declares (replacing installed or built-in families
    of the same model_type); -> those families. ModelLoadError (one line naming the file) when the file
    is missing, does not run, or declares no family or something other than a `Family`."""
    from fca.engine.families import _FAMILIES, register_family, registered_families

    shown = str(path)
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelLoadError(f"{shown}: no such family file")
    if not path.is_file():
        raise ModelLoadError(f"{shown}: not a file (a family file is a Python file, e.g. my_family.py)")
    if path.suffix != ".py":
        raise ModelLoadError(f"{shown}: not a Python file (.py); a family file is a Python module that {CONVENTION}")
    resolved = path.resolve()
    stat = resolved.stat()
    stamp = (stat.st_mtime_ns, stat.st_size)
    # Built-in and installed families first (outside the lock, which the registry's first lookup in another
    # thread would otherwise wait on), so that what the file registers replaces them.
    registered_families()
    with _LOCK:
        known = _FILES.get(resolved)
        if known is not None and known[0] == stamp:
            families = known[1]  # (registered again, in case another file replaced one since: the last one given wins)
        else:
            before = dict(_FAMILIES)
            module = _run(resolved, shown)
            declared = _declared(module, shown)
            declared += [f for t, f in _FAMILIES.items() if before.get(t) is not f]  # (_checked drops repeats)
            families = _checked(declared, shown)
            _FILES[resolved] = (stamp, families)
        for family in families:
            register_family(family)
            _SOURCES[family.model_type] = (family, shown)
        return families


def load_family_files(paths: Iterable[str | Path]) -> tuple[Family, ...]:
    """`load_family_file` on each path in order (a later file's family replaces an earlier one's)."""
    return tuple(family for path in paths for family in load_family_file(path))


def loaded_family_files() -> list[str]:
    """The family files loaded in this process (resolved paths), so that worker processes load them too."""
    with _LOCK:
        return [str(p) for p in _FILES]


def family_source(model_type: str) -> str | None:
    """Where the registered family of `model_type` was declared (a file, an entry point); None: built in
    or registered from Python."""
    from fca.engine.families import family_for_type

    family, source = _SOURCES.get(model_type, (None, None))
    return source if family is not None and family_for_type(model_type) is family else None


def _run(path: Path, shown: str) -> ModuleType:
    """Import the file as a module of its own (a unique name, so two files called family.py do not collide)."""
    name = "fca_family_file_" + hashlib.sha256(str(path).encode()).hexdigest()[:16]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ModelLoadError(f"{shown}: cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (dataclasses and pickling look the module up by name while it runs)
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as err:
        sys.modules.pop(name, None)
        if isinstance(err, SyntaxError):
            raise ModelLoadError(f"{shown}, line {err.lineno}: syntax error: {err.msg}") from None
        line = _line_in(err, path)
        where = f"{shown}, line {line}" if line else shown
        said = (str(err).splitlines() or [""])[0]
        raise ModelLoadError(
            f"{where}: running it raised {type(err).__name__}" + (f": {said}" if said else "")
        ) from None
    return module


def _line_in(err: BaseException, path: Path) -> int | None:
    """The line of `path` the error passed through last (the user's line, not the library's)."""
    lines = [frame.lineno for frame in traceback.extract_tb(err.__traceback__) if Path(frame.filename) == path]
    return lines[-1] if lines else None


def _declared(module: ModuleType, shown: str) -> list:
    """What a module declares by the convention: FAMILY (one), FAMILIES (a list or tuple)."""
    declared = []
    if hasattr(module, "FAMILY"):
        declared.append(module.FAMILY)
    if hasattr(module, "FAMILIES"):
        many = module.FAMILIES
        if not isinstance(many, (list, tuple)):
            raise ModelLoadError(
                f"{shown}: FAMILIES is a {type(many).__name__}, not a list or tuple of Family (one family: FAMILY = ...)"
            )
        declared.extend(many)
    return declared


def _checked(declared: list, shown: str) -> tuple[Family, ...]:
    """The declared families, each a well-formed `Family`, no model_type twice; in order, without repeats."""
    families: list[Family] = []
    for family in declared:
        if not isinstance(family, Family):
            raise ModelLoadError(
                f"{shown}: declares a {type(family).__name__} ({family!r:.60}), not a Family (fca.engine.family.Family)"
            )
        if any(family is f for f in families):
            continue
        if not isinstance(family.model_type, str) or not family.model_type:
            raise ModelLoadError(f"{shown}: a family's model_type must be a non-empty name, not {family.model_type!r}")
        if any(f.model_type == family.model_type for f in families):
            raise ModelLoadError(f"{shown}: declares two families of model_type {family.model_type!r}")
        for field in ("load", "blocks", "definitions", "routers", "expert_selection"):
            value = getattr(family, field)
            if not (callable(value) or (field == "load" and value is None)):
                raise ModelLoadError(
                    f"{shown}: family {family.model_type!r}: {field} must be a function, not {type(value).__name__}"
                )
        paths = family.expert_paths
        if not isinstance(paths, tuple) or not all(isinstance(p, str) and p for p in paths):
            raise ModelLoadError(
                f"{shown}: family {family.model_type!r}: expert_paths must be a tuple of module paths, not {paths!r}"
            )
        families.append(family)
    if not families:
        raise ModelLoadError(f"{shown}: declares no family ({CONVENTION})")
    return tuple(families)


def entry_point_families(
    select: Callable[..., Iterable[EntryPoint]] = entry_points,
) -> tuple[list[Family], bool]:
    """(the families installed packages declare under the entry-point group `fca.families`, whether that is
    all of them): none when FCA_FAMILY_ENTRY_POINTS=0; an entry point whose module is being imported right
    now (it looked a family up as it loads, before any other lookup) is left for a later call. Each family
    is recorded with its entry point as its source. A model_type declared by two entry points, or one that
    fails to load, is one ModelLoadError line naming them."""
    if os.environ.get(ENTRY_POINTS_ENV, "").strip() == "0":
        return [], True
    found: dict[str, tuple[Family, str]] = {}
    complete = True
    for point in sorted(select(group=ENTRY_POINT_GROUP), key=lambda p: p.name):
        importing = sys.modules.get(point.module)
        if importing is not None and getattr(getattr(importing, "__spec__", None), "_initializing", False):
            complete = False
            continue
        package = point.dist.name if point.dist is not None else "an unknown package"
        shown = f"entry point {point.name} = {point.value} of {package} (group {ENTRY_POINT_GROUP})"
        try:
            value = point.load()
        except (Exception, SystemExit) as err:
            said = (str(err).splitlines() or [""])[0]
            raise ModelLoadError(
                f"{shown}: loading it raised {type(err).__name__}"
                + (f": {said}" if said else "")
                + f"; uninstall {package} or set {ENTRY_POINTS_ENV}=0 to leave installed families out"
            ) from None
        if isinstance(value, ModuleType):
            declared = _declared(value, shown)
        elif isinstance(value, (list, tuple)):
            declared = list(value)
        else:
            declared = [value]
        for family in _checked(declared, shown):
            if family.model_type in found and found[family.model_type][0] is not family:
                raise ModelLoadError(
                    f"{shown}: model_type {family.model_type!r} is declared by {found[family.model_type][1]} too"
                )
            found[family.model_type] = (family, shown)
    for model_type, (family, shown) in found.items():  # (no lock: a file being loaded may be waiting on this)
        _SOURCES.setdefault(model_type, (family, shown))
    return [family for family, _ in found.values()], complete
