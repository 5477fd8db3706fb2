"""A command's output files (reports, studies, corpora): written through a temporary file renamed into
place, and never over a file that is not an earlier output of the same kind, so that a mistyped path
(the cache's `manifest.json`, a model's `config.json`, the command's own input) loses nothing."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path


class OutputError(ValueError):
    """An output path that cannot be written; the message is one line naming it."""


def write_output(path: str | Path, text: str, kind: str, is_earlier: Callable[[str], bool]) -> Path:
    """Write `text` to `path`. An existing file is replaced only when `is_earlier(its text)` says it is an
    earlier `kind` (e.g. "audit report (JSON)"); a directory, or any other file, is refused."""
    path = check_output(path, kind, is_earlier)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)  # (gone already when the rename succeeded)
    return path


def check_output(path: str | Path, kind: str, is_earlier: Callable[[str], bool]) -> Path:
    """`write_output`'s refusals alone, for a command to make before its work rather than after."""
    path = Path(path)
    if path.is_dir():
        raise OutputError(f"{path}: is a directory; give a file path for the {kind}")
    if path.exists():
        try:
            earlier = is_earlier(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError):
            earlier = False
        if not earlier:
            raise OutputError(
                f"{path}: exists and is not an earlier {kind}; not replaced (remove it or choose another path)"
            )
    return path


def json_with(key: str) -> Callable[[str], bool]:
    """`is_earlier` for JSON outputs: a JSON object holding `key` (e.g. "fca_report_version")."""

    def earlier(text: str) -> bool:
        try:
            value = json.loads(text)
        except ValueError:
            return False
        return isinstance(value, dict) and key in value

    return earlier


def starts_with(prefix: str) -> Callable[[str], bool]:
    """`is_earlier` for text outputs whose first line we write (e.g. "# FCA audit:")."""
    return lambda text: text.startswith(prefix)


def check_replaceable(path: str | Path, kind: str, marker: str, overwrite: bool, flag: str = "--overwrite") -> None:
    """Refuse a destination folder that exists, unless `overwrite` is given and it is empty or an earlier
    `kind` (a folder holding `marker`, e.g. a cache's manifest.json): --overwrite replaces that, never a
    model, a corpus, a file or whatever else the mistyped path holds."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        return
    if not overwrite:
        raise OutputError(f"{path}: already exists (pass {flag} to replace it)")
    if not path.is_dir() or path.is_symlink():
        raise OutputError(f"{path}: is a file, not a {kind} folder; not replaced")
    if not (path / marker).is_file() and any(path.iterdir()):
        raise OutputError(f"{path}: is not a {kind} (no {marker}); {flag} replaces only a {kind}, so it is kept")
