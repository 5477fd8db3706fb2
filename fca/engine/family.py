"""What a model family is: the `Family` record and its neutral defaults. The registry that finds a
model's family, with the built-in ones, is `fca.engine.families`; the built-in families are defined
beside their architectures (`fca.engine.models`) and import only this.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from fca.engine.sites import model_class_name
from fca.tables.catalog import DenseTwin


def default_blocks(model: nn.Module) -> list[nn.Module]:
    """The block list `attach_sites(..., blocks=PATH)` recorded on the model, else the longest `nn.ModuleList`
    in its module tree."""
    adapted = getattr(model, "fca_blocks", None)  # set by fca.engine.adapters.attach_sites
    if callable(adapted):
        return list(adapted())
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        raise ValueError(f"{model_class_name(model)}: cannot find its blocks (declare a Family with `blocks`)")
    return list(max(lists, key=len))


ExpertSelection = Callable[[nn.Module, tuple, dict], tuple[torch.Tensor, "torch.Tensor | None"]]


def transformers_expert_selection(
    experts: nn.Module, args: tuple, kwargs: dict
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The selection an experts module is handed, read from its call: transformers' MoE layers call
    `experts(hidden [N, D], top_k_index [N, k], top_k_weights [N, k])`. Returns (index [N, k], weights
    [N, k] or None); an index >= the module's `num_experts` is an empty slot (no expert runs)."""
    index = args[1] if len(args) > 1 else kwargs.get("top_k_index")
    weights = args[2] if len(args) > 2 else kwargs.get("top_k_weights")
    if not isinstance(index, torch.Tensor):
        raise ValueError(
            f"{type(experts).__name__}: not called as experts(hidden, top_k_index, top_k_weights); its family "
            "must say how to read the experts it runs (Family.expert_selection)"
        )
    return index, weights if isinstance(weights, torch.Tensor) else None


def whole_sequences(block: nn.Module, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The tokens of each sequence a block is called with, [B]: every position of its input [B, T, ...];
    None when its first input is not such a tensor (nothing to read the sequences from)."""
    x = args[0] if args else next(iter(kwargs.values()), None)
    if not isinstance(x, torch.Tensor) or x.dim() < 3:
        return None
    return torch.full((x.shape[0],), x.shape[1], dtype=torch.long, device=x.device)


def no_entries(model: nn.Module) -> dict:
    """The neutral `definitions` and `routers`: none."""
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
      (the execution audit counts the experts each token runs, and replays read routing there); ()
      otherwise. Each must be a module the model calls once per forward with its tokens flattened,
      [N, ...], handed the selection `expert_selection` reads, with a `num_experts` attribute, as
      transformers' MoE layers do (a list of experts the model indexes is never called: refused).
    - `execution_note`: a sentence the execution audit carries ("" for none).
    - `routers(model)`: the sites whose coefficients choose the experts each token runs, however they
      choose (softmax or sigmoid top-k, group-limited, hash, capacity-limited): site name -> k, the experts
      per token. Replays then report each condition's routing agreement (`fca.engine.routing`), read from
      what the experts modules of `expert_paths` are handed (a router without them gets no figure, and the
      report says why). {} (the default): no such sites.
    - `expert_selection(experts, args, kwargs)`: the (index [N, k], weights [N, k] or None) an experts module
      matching `expert_paths` is handed in its call, read by a forward pre-hook: what the model actually
      dispatched. The default reads transformers' `experts(hidden, top_k_index, top_k_weights)`.
    - `tokens_per_sequence(block, args, kwargs)`: how many tokens of each sequence of the batch a block (one
      of `blocks`) is called with, [B], read from its call by a forward pre-hook: what each replay condition
      runs. The default: every position of an input [B, T, ...]; a family whose blocks run on some tokens
      only says how to read them. None: not readable from this call (no per-condition figures).
    """

    model_type: str
    load: Callable[[Path], nn.Module] | None = None
    dense_twin: DenseTwin | None = None
    blocks: Callable[[nn.Module], list[nn.Module]] = default_blocks
    definitions: Callable[[nn.Module], dict] = no_entries
    coefficient_kind: str = ""
    expert_paths: tuple[str, ...] = ()
    execution_note: str = ""
    routers: Callable[[nn.Module], dict] = no_entries
    expert_selection: ExpertSelection = transformers_expert_selection
    tokens_per_sequence: Callable[[nn.Module, tuple, dict], torch.Tensor | None] = whole_sequences
