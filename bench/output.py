"""What a bench prints: its figures as indented JSON on stdout, and the same text at `--json PATH`."""

from __future__ import annotations

import json
from pathlib import Path


def emit(figures: dict, json_path: str | None) -> None:
    text = json.dumps(figures, indent=1)
    print(text)
    if json_path:
        Path(json_path).write_text(text)
