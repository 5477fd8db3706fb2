"""Model families: what FCA needs to know about an architecture beyond its controller sites.

A `Family` says how to load a model directory, where its Dense twin is, which modules are its blocks
(the execution audit hooks them), what its coefficients are, which definitions its audit report
carries, and whether conditional execution happens at expert level. Families are found by
`model.config.model_type` in one registry (`register_family`), or declared by the model itself as an
attribute `fca_family`, so a custom model states every field in one place:

    class MyModel(nn.Module):
        fca_family = Family("my_model", blocks=lambda m: list(m.blocks), coefficient_kind="gate values")

Families declared outside FCA, in a family file (`--family FILE`) or by an installed package (entry-point
group `fca.families`), are loaded by `fca.engine.user_families`.

A model with neither gets `Family(<its model_type or class name>)`: blocks are the longest
`nn.ModuleList`, no definitions, no expert level, no loader.
"""

from __future__ import annotations

import threading

from torch import nn

from fca.engine.family import Family
from fca.engine.sites import model_class_name
from fca.tables.catalog import DENSE_TWINS

__all__ = ["Family", "register_family", "registered_families", "family_for_type", "family_of"]


# model_type -> Family. The built-in families (`fca.engine.models.BUILTIN_FAMILIES`) and those installed
# packages declare (`fca.engine.user_families`) join on the first lookup, under those registered before
# it: a registered family replaces an installed one, which replaces a built-in one.
_FAMILIES: dict[str, Family] = {}
_BUILTINS_LOCK = threading.RLock()
_builtins_loaded = False
_builtins_loading = False
_registered_first: set[str] | None = None  # the model_types registered before the first lookup


def register_family(family: Family) -> Family:
    """Register (or replace) the family of `family.model_type`; its Dense twin joins the catalog's table,
    so the dashboard finds twins of this family too. Returns `family`."""
    _FAMILIES[family.model_type] = family
    if family.dense_twin is not None:
        DENSE_TWINS[family.model_type] = family.dense_twin
    return family


def _builtins() -> None:
    global _builtins_loaded, _builtins_loading, _registered_first
    if _builtins_loaded:
        return
    with _BUILTINS_LOCK:  # (a second thread waits until every built-in family is in)
        # An installed package's module may look a family up as it loads (to build on a built-in one):
        # that lookup, in this thread, sees the built-ins and does not load the packages again.
        if _builtins_loaded or _builtins_loading:
            return
        _builtins_loading = True
        try:
            from fca.engine.models import BUILTIN_FAMILIES
            from fca.engine.user_families import entry_point_families

            if _registered_first is None:
                _registered_first = set(_FAMILIES)
                for family in BUILTIN_FAMILIES:
                    if family.model_type not in _registered_first:
                        register_family(family)
            # (a broken package raises here, at every lookup, until fixed; one whose module is still being
            # imported, having looked a family up as it loads, joins at the next lookup)
            families, complete = entry_point_families()
            for family in families:
                if family.model_type not in _registered_first:
                    register_family(family)
            _builtins_loaded = complete
        finally:
            _builtins_loading = False


def registered_families() -> dict[str, Family]:
    """Every registered family, built-in ones included, by model_type."""
    _builtins()
    return dict(_FAMILIES)


def family_for_type(model_type: str | None) -> Family | None:
    """The registered family of a `model_type`, or None."""
    _builtins()
    return _FAMILIES.get(model_type) if model_type is not None else None


def family_of(model: nn.Module) -> Family:
    """The model's family: the one it declares (`fca_family`), else the one registered for
    `model.config.model_type`, else a default family (see the module docstring)."""
    declared = getattr(model, "fca_family", None)
    if isinstance(declared, Family):
        return declared
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return family_for_type(model_type) or Family(model_type or model_class_name(model))
