"""Figures as files for slides and papers: SVG, and PNG at 2x and 3x, rendered on this machine.

plotly's own export (kaleido) drives the local Chromium with the plotly.js that ships with plotly and
MathJax turned off, so rendering requests nothing from the network; one renderer is kept for the server's
life (the first figure takes about 4 s to start it, each later one about 0.25 s on 2 cores).
"""

from __future__ import annotations

import threading
from pathlib import Path

import plotly
import plotly.graph_objects as go

WIDTH = 1100  # px: a 16:9 slide's figure at 1x; scale 2 and 3 multiply it
FORMATS = {"SVG": ("svg", 1), "PNG 2x": ("png", 2), "PNG 3x": ("png", 3)}
MIME = {"svg": "image/svg+xml", "png": "image/png"}
PLOTLY_JS = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"

_lock = threading.Lock()


def renderer_options() -> dict:
    """What the renderer loads: plotly.js from this installation, no MathJax (its default comes from a CDN)."""
    return {"plotlyjs": PLOTLY_JS.as_uri(), "mathjax": False}


def _started() -> None:
    import kaleido

    kaleido.start_sync_server(silence_warnings=True, **renderer_options())


def image_bytes(fig: go.Figure, fmt: str, scale: int = 1, width: int = WIDTH) -> bytes:
    """`fig` rendered as `fmt` ("svg" or "png") at `width` x `scale` pixels (its own height x `scale`)."""
    import kaleido

    height = fig.layout.height or 450
    with _lock:  # one renderer, one figure at a time
        _started()
        return kaleido.calc_fig_sync(fig.to_dict(), opts=dict(format=fmt, width=width, height=height, scale=scale))
