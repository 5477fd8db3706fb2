"""FCA: Frozen-Controller Auditing of dynamic neural networks.

Three layers, imports pointing down only (a test checks it):
    fca.tables  torch-free: cache store and manifest, statistics, profiles, conditions, reports, studies
    fca.engine  torch: controller sites, model families, record passes, replay, execution audit
    fca.jobs    what users run: build caches, audits, replay runs, benches, training, the demo
`fca.cli` and the dashboard (`app/`) sit on top.

The public API (`load_model`, `capture`, `replay`, `open_cache`) is loaded on first use, so tools that
only read caches and reports (the dashboard's first page, say) never pay for importing torch.
"""

import importlib

# name -> module that defines it
_API = {"load_model": "fca.engine.loading", "capture": "fca.engine.capture", "replay": "fca.engine.replay",
        "open_cache": "fca.tables.store"}
__all__ = list(_API)


def __getattr__(name: str):
    if name in _API:
        value = getattr(importlib.import_module(_API[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
