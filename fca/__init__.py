"""FCA: Frozen-Controller Auditing of dynamic neural networks."""

from .loading import load_model

__all__ = ["load_model"]
from .capture import capture
from .replay import replay
from .store import open_cache

__all__ += ["capture", "replay", "open_cache"]
