"""Family files for a long-running process (the dashboard): each file loaded on its own, so that one bad
file is reported while the others still load (the CLI instead stops at the first, see `fca.cli`)."""

from __future__ import annotations

from collections.abc import Iterable

from fca.engine.families import registered_families
from fca.engine.user_families import load_family_file
from fca.tables.errors import ModelLoadError


def load_each_family_file(paths: Iterable[str]) -> tuple[list[tuple[str, str]], list[str]]:
    """Run each family file (`fca.engine.user_families.load_family_file`; an unchanged file is not run
    again); -> ([(model_type, path)] declared, [one-line error per bad file])."""
    declared, errors = [], []
    for path in paths:
        try:
            declared += [(family.model_type, path) for family in load_family_file(path)]
        except ModelLoadError as err:
            errors.append(str(err))
    return declared, errors


def import_transformers() -> None:
    """Import the part of transformers every built-in family builds on (its model classes, about two thirds
    of `load_builtin_families`' time on a first call), so that a caller can say it is under way."""
    import transformers.modeling_utils  # noqa: F401


def load_builtin_families() -> None:
    """Import the built-in families' model code (transformers, mostly), as the first model lookup would:
    the slowest step of a first model load, done apart so that a caller can say it is under way."""
    registered_families()
