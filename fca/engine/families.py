"""Model families: what FCA needs to know about an architecture beyond its controller sites.

A `Family` says how to load a model directory, where its Dense twin is, which modules are its blocks
(the execution audit hooks them), what its coefficients are, which definitions its audit report
carries, and whether conditional execution happens at expert level. Families are found by
`model.config.model_type` in one registry (`register_family`), or declared by the model itself as an
attribute `fca_family`, so a custom model states every field in one place:

    class MyModel(nn.Module):
        fca_family = Family("my_model", blocks=lambda m: list(m.blocks), coefficient_kind="gate values")

A model with neither gets `Family(<its model_type or class name>)`: blocks are the longest
`nn.ModuleList`, no definitions, no expert level, no loader.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from fca.tables.catalog import DENSE_TWINS, DenseTwin


def longest_module_list(model: nn.Module) -> list[nn.Module]:
    """The blocks of a model that names none: the longest `nn.ModuleList` in its module tree."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        raise ValueError(f"{type(model).__name__}: cannot find its blocks (declare a Family with `blocks`)")
    return list(max(lists, key=len))


def default_blocks(model: nn.Module) -> list[nn.Module]:
    """The block list `attach_sites(..., blocks=PATH)` recorded on the model, else the longest ModuleList."""
    adapted = getattr(model, "fca_blocks", None)  # set by fca.engine.adapters.attach_sites
    return list(adapted()) if callable(adapted) else longest_module_list(model)


def no_definitions(model: nn.Module) -> dict:
    return {}


@dataclass(frozen=True)
class Family:
    """One model family. Only `model_type` is required; every other field has a neutral default.

    - `load(path)`: a model directory -> the model on CPU in float32 (None: in-memory models only).
    - `dense_twin`: how the Dense twin's config differs (`fca.tables.catalog.DenseTwin`); None: no twin.
    - `blocks(model)`: the repeated blocks in execution order.
    - `definitions(model)`: extra entries for the audit report's `definitions`.
    - `coefficient_kind`: what the recorded coefficients are, in words.
    - `expert_paths`: module globs of the experts modules when execution is conditional at expert level
      (the execution audit then counts the experts each token runs); () otherwise.
    - `execution_note`: a sentence the execution audit carries ("" for none).
    """

    model_type: str
    load: Callable[[Path], nn.Module] | None = None
    dense_twin: DenseTwin | None = None
    blocks: Callable[[nn.Module], list[nn.Module]] = default_blocks
    definitions: Callable[[nn.Module], dict] = no_definitions
    coefficient_kind: str = ""
    expert_paths: tuple[str, ...] = ()
    execution_note: str = ""


# model_type -> Family. The built-in families register when `fca.engine.models` is imported.
_FAMILIES: dict[str, Family] = {}


def register_family(family: Family) -> Family:
    """Register (or replace) the family of `family.model_type`; its Dense twin joins the catalog's table,
    so the dashboard finds twins of this family too. Returns `family`."""
    _FAMILIES[family.model_type] = family
    if family.dense_twin is not None:
        DENSE_TWINS[family.model_type] = family.dense_twin
    return family


def _builtins() -> None:
    from fca.engine import models  # noqa: F401  (registers the built-in families)


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
    return family_for_type(model_type) or Family(model_type or type(model).__name__)
