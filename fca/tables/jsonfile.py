"""The one reader of JSON files from disk (manifests, reports, runs, studies, model configs, weight indexes):
caches, reports and runs travel between people, so each file is read with a size limit and a nesting limit,
and anything else is a one-line error naming the file, of the caller's error class."""

from __future__ import annotations

import json
import os
from pathlib import Path

MAX_JSON_BYTES = 256 * 2**20  # a manifest of 10^5 parts is ~25 MB; anything far larger is no file of ours
MAX_JSON_DEPTH = 64  # FCA's own files nest under 10 levels; a model config a few more


def read_json(
    path: str | Path,
    error: type[Exception] = ValueError,
    max_bytes: int = MAX_JSON_BYTES,
    constants: bool = True,
) -> object:
    """The JSON value in `path`, or `error` with one line naming the file: missing, not a regular file (a
    device or a pipe is never read), larger than `max_bytes` (only that much is read), not UTF-8 JSON, or
    nested deeper than MAX_JSON_DEPTH. `constants=False` refuses NaN and Infinity, which are not JSON."""
    path = Path(path)
    try:
        if not path.is_file():
            raise error(f"{path}: {'not a regular file' if path.exists() else 'no such file'}")
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            # (read(n) allocates n bytes at once: the file's own size, not the limit, and never past the limit)
            data = f.read(min(size, max_bytes) + 1)
    except OSError as err:
        raise error(f"{path}: unreadable ({err.strerror or err})") from None
    if len(data) > max_bytes:
        raise error(f"{path}: larger than {max_bytes:,} bytes, more than a JSON file of FCA's holds")
    return parse_json(data, str(path), error, constants)


def read_json_object(path: str | Path) -> dict | None:
    """A JSON object from `path`; None when it is missing, unreadable or not an object."""
    try:
        value = read_json(path)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def parse_json(data: bytes | str, where: str, error: type[Exception] = ValueError, constants: bool = True) -> object:
    """`data` parsed as `read_json` does, errors naming `where`."""
    try:
        value = json.loads(data, parse_constant=None if constants else _no_constant)
    except RecursionError:  # (json's parser recurses per level: `[` x 10^6 would be a traceback)
        raise error(f"{where}: not valid JSON (nested deeper than {MAX_JSON_DEPTH} levels)") from None
    except NotJSON as err:
        raise error(f"{where}: {err}") from None
    except (UnicodeDecodeError, ValueError) as err:  # (json.JSONDecodeError is a ValueError)
        raise error(f"{where}: not valid JSON ({str(err).splitlines()[0][:200]})") from None
    if _depth(value) > MAX_JSON_DEPTH:
        raise error(f"{where}: not valid JSON (nested deeper than {MAX_JSON_DEPTH} levels)")
    return value


def _depth(value: object) -> int:
    """Nesting depth of a parsed JSON value (a scalar is 0), without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth + 1)
        if deepest > MAX_JSON_DEPTH:
            return deepest
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return deepest


class NotJSON(ValueError):
    """NaN or Infinity, which Python's json reads and JSON does not have."""


def _no_constant(name: str) -> float:
    # FCA writes null where a figure is undefined: NaN or Infinity in a file was written by hand.
    raise NotJSON(f"{name} is not JSON; FCA writes null where a figure is undefined")
