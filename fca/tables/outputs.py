"""A command's output files (reports, studies, corpora): written through a temporary file renamed into
place, and never over a file that is not an earlier output of the same kind, so that a mistyped path
(the cache's `manifest.json`, a model's `config.json`, the command's own input) loses nothing."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fca.tables.jsonfile import parse_json, read_json_object


class OutputError(ValueError):
    """An output path that cannot be written; the message is one line naming it."""


def write_output(path: str | Path, text: str, kind: str, is_earlier: Callable[[str], bool]) -> Path:
    """Write `text` to `path`. An existing file is replaced only when `is_earlier(its text)` says it is an
    earlier `kind` (e.g. "audit report (JSON)"); a directory, or any other file, is refused."""
    path = check_output(path, kind, is_earlier)
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write_text(path, text)


def strict_json(obj: object, indent: int | None = 1) -> str:
    """JSON that strict readers (jq, JavaScript, DuckDB) accept: a float that is not finite (the undefined
    CI of a run of too few sequences) is written as null, where Python's json would write NaN."""

    def finite(value: object) -> object:
        if type(value).__module__ == "numpy" and hasattr(value, "item"):  # a numpy scalar: as Python's
            value = value.item()
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {k: finite(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [finite(v) for v in value]
        return value

    return json.dumps(finite(obj), indent=indent, allow_nan=False)


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write `text` to a temporary file beside `path` (named for this process) and rename it into place:
    readers see the old file or the new one, never half of one, and a failure leaves nothing behind."""
    return write_together([(Path(path), text)])[0]


def created_file_mode() -> int:
    """The permission bits `open(path, "w")` gives a new file under this process's umask: 0o666 & ~umask.
    Read from /proc where it is there: `os.umask` can only be read by setting it, process-wide, under the
    feet of threads creating files meanwhile."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


def write_together(outputs: list[tuple[Path, str]]) -> list[Path]:
    """Several files written as one: each to a temporary file beside it, and only when every one is written
    are they renamed into place, so a full disk leaves the earlier files, never a new one beside an old or
    half-written one (an audit's new JSON beside no Markdown). An OSError names the file it could not write."""
    staged: list[tuple[Path, Path]] = []
    try:
        for path, text in outputs:
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            staged.append((tmp, path))
            try:
                tmp.write_text(text, encoding="utf-8")
            except OSError as err:  # (ENOSPC from a write names no file: "[Errno 28] No space left on device")
                raise OSError(err.errno, err.strerror or str(err), str(path)) from None
        for tmp, path in staged:
            tmp.replace(path)
    finally:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)  # (gone already when the rename succeeded)
    return [path for path, _ in outputs]


# An earlier output is read to recognise it; anything larger is not one of ours.
EARLIER_MAX_BYTES = 64 * 2**20


def enclosing_cache(path: str | Path) -> Path | None:
    """The cache folder `path` lies inside (the nearest folder above it holding a cache's manifest.json), or None."""
    for folder in Path(path).absolute().parents:
        raw = read_json_object(folder / "manifest.json")
        if raw is not None and {"schema_version", "sites", "parts"} <= raw.keys():
            return folder
    return None


def check_not_in_cache(path: str | Path, kind: str) -> None:
    """Refuse an output inside a cache folder: Parquet readers of the folder then fail on it (a report named
    part-00099.parquet), and a rebuild with --overwrite deletes what it counts as the cache's."""
    cache = enclosing_cache(path)
    if cache is not None:
        raise OutputError(f"{path}: inside the cache {cache}; write the {kind} beside the cache, not in it")


def check_output(path: str | Path, kind: str, is_earlier: Callable[[str], bool]) -> Path:
    """`write_output`'s refusals alone, for a command to make before its work rather than after."""
    path = Path(path)
    check_not_in_cache(path, kind)
    if path.is_dir():
        raise OutputError(f"{path}: is a directory; give a file path for the {kind}")
    if path.exists() and not path.is_file():  # a device or a pipe: never read to the end, never replaced
        raise OutputError(f"{path}: is not a regular file; give a file path for the {kind}")
    if path.exists():
        try:
            small = path.stat().st_size <= EARLIER_MAX_BYTES
            earlier = small and is_earlier(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError):
            earlier = False
        if not earlier:
            raise OutputError(
                f"{path}: exists and is not an earlier {kind}; not replaced (remove it or choose another path)"
            )
    check_writable_folder(path, kind)
    return path


def check_writable_folder(path: Path, kind: str) -> None:
    """Refuse `path` when a folder above it is a file (else "[Errno 17] File exists" of that file, from making
    the folders, after the work whose output it is), or the folder it would be written (or made) in is not writable."""
    above = next((p for p in Path(path).parents if p.exists() and not p.is_dir()), None)
    if above is not None:
        raise OutputError(f"{path}: {above} is a file, so no folder can be made below it")
    folder = next((p for p in path.absolute().parents if p.exists()), None)
    if folder is not None and not os.access(folder, os.W_OK):
        raise OutputError(f"{path}: its folder {folder} is not writable; choose another path for the {kind}")


@dataclass(frozen=True)
class RenderedPair:
    """The JSON and Markdown files of one result (an audit report, a study), each optional: both paths are
    checked before either is written, and each replaces only an earlier file of its kind."""

    kind: str  # e.g. "audit report"
    json_earlier: Callable[[str], bool]
    markdown_earlier: Callable[[str], bool]

    def check(self, json_path: str | Path | None, markdown_path: str | Path | None) -> None:
        if None not in (json_path, markdown_path) and Path(json_path).resolve() == Path(markdown_path).resolve():
            # (one file for both: the Markdown would replace the JSON)
            raise OutputError(f"{markdown_path}: given for both the JSON and the Markdown; give each its own path")
        if json_path is not None:
            check_output(json_path, f"{self.kind} (JSON)", self.json_earlier)
        if markdown_path is not None:
            check_output(markdown_path, f"{self.kind} (Markdown)", self.markdown_earlier)

    def write(
        self,
        json_path: str | Path | None,
        json_text: Callable[[], str],
        markdown_path: str | Path | None,
        markdown_text: Callable[[], str],
    ) -> None:
        self.check(json_path, markdown_path)
        pairs = ((json_path, json_text), (markdown_path, markdown_text))
        outputs = [(Path(p), text()) for p, text in pairs if p is not None]
        for path, _ in outputs:
            path.parent.mkdir(parents=True, exist_ok=True)
        write_together(outputs)  # both or neither: never a new JSON beside an old (or no) Markdown


def json_with(key: str) -> Callable[[str], bool]:
    """`is_earlier` for JSON outputs: a JSON object holding `key` (e.g. "fca_report_version")."""

    def earlier(text: str) -> bool:
        try:
            value = parse_json(text, "output")
        except ValueError:
            return False
        return isinstance(value, dict) and key in value

    return earlier


def starts_with(prefix: str) -> Callable[[str], bool]:
    """`is_earlier` for text outputs whose first line we write (e.g. "# FCA audit:")."""
    return lambda text: text.startswith(prefix)


# Said where an existing output is refused: the CLI flag and the Python argument that replace it.
OVERWRITE_HINT = "--overwrite, or overwrite=True from Python, replaces it"


# What a marker file of ours holds at least (a JSON object with these keys): a folder whose marker is another
# tool's file of the same name (a manifest.json of a web app, say) is not ours to replace.
MARKER_KEYS = {"manifest.json": ("schema_version", "sites"), "config.json": ("model_type",), "plan.json": ("plan",)}


def _is_ours(marker: Path) -> bool:
    value = read_json_object(marker)
    return value is not None and all(key in value for key in MARKER_KEYS.get(marker.name, ()))


def check_replaceable(path: str | Path, kind: str, owns: Callable[[str], bool], marker: str, overwrite: bool) -> None:
    """Refuse a destination folder that exists, unless `overwrite` is given and it is empty or an earlier
    `kind`: a folder holding `marker` (a cache's manifest.json, a model's config.json) and nothing but
    entries `owns(name)` says such a folder holds. So --overwrite replaces that, never a model, a corpus,
    a file, a project that happens to hold a `config.json`, or notes kept beside a cache's parts."""
    path = Path(path)
    if path.name in ("", ".", ".."):
        raise OutputError(
            f"{str(path) or '(empty)'}: give the {kind} a folder of its own, not the current or parent one"
        )
    check_not_in_cache(path, kind)
    if not path.exists() and not path.is_symlink():
        # (a folder above that is a file, or a read-only mount, was found only when the lock was made)
        check_writable_folder(path, kind)
        return
    if not overwrite:
        raise OutputError(f"{path}: already exists ({OVERWRITE_HINT})")
    if path.is_symlink():
        raise OutputError(f"{path}: is a symbolic link; not replaced (give the folder itself, or another path)")
    if not path.is_dir():
        raise OutputError(f"{path}: is a file, not a {kind} folder; not replaced")
    entries = sorted(entry.name for entry in path.iterdir())
    if entries and marker not in entries:
        raise OutputError(f"{path}: is not a {kind} (no {marker}); --overwrite replaces only a {kind}, so it is kept")
    foreign = [name for name in entries if not owns(name)]
    if foreign:
        raise OutputError(
            f"{path}: holds {', '.join(foreign[:3])}{' ...' if len(foreign) > 3 else ''}, which no {kind} holds; "
            f"--overwrite would delete it, so the folder is kept (move those out, or choose another path)"
        )
    if entries and not _is_ours(path / marker):
        raise OutputError(
            f"{path}: its {marker} is not one FCA writes for a {kind}; --overwrite replaces only a {kind}, so it is kept"
        )
