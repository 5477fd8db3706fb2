"""FCA: Frozen-Controller Auditing of dynamic neural networks.

The public API (`load_model`, `capture`, `replay`, `open_cache`) is loaded on first use, so tools that
only read caches and reports (the dashboard's first page, say) never pay for importing torch.
"""

import importlib
import sys
import types

# name -> submodule that defines it
_API = {"load_model": "loading", "capture": "capture", "replay": "replay", "open_cache": "store"}
__all__ = list(_API)


class _Package(types.ModuleType):
    """`fca.capture` and `fca.replay` are functions, though submodules of the same names exist.

    Importing a submodule makes Python set it as an attribute of its package; we keep the API
    functions in those two names instead (the submodules stay reachable as `sys.modules["fca.replay"]`
    and through `from fca.replay import ...`)."""

    def __getattr__(self, name: str):
        if name in _API:
            value = getattr(importlib.import_module(f"{__name__}.{_API[name]}"), name)
            types.ModuleType.__setattr__(self, name, value)
            return value
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

    def __setattr__(self, name: str, value) -> None:
        if name in _API and isinstance(value, types.ModuleType):
            # The import system announcing a submodule: drop any cached function so __getattr__
            # serves it again, and do not let the module shadow it.
            self.__dict__.pop(name, None)
            return
        types.ModuleType.__setattr__(self, name, value)


sys.modules[__name__].__class__ = _Package
