"""Replay: run the frozen model with given coefficients (controllers removed), score conditions."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

from .capture import as_input_ids
from .sites import find_sites, model_logits, site_modes, tensor_provider


def _as_tensor(values, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.as_tensor(np.asarray(values) if not isinstance(values, torch.Tensor) else values).to(device=device, dtype=dtype)


@torch.no_grad()
def replay(model: nn.Module, input_ids, coefficients: Mapping[str, object], only: set[str] | None = None) -> torch.Tensor:
    """Logits [B, T, V] of the frozen model fed `coefficients` (site -> array broadcastable to [B, T, K_s]).

    Every site is replayed unless `only` names a subset (the rest run live). The replayed
    controllers are never called.
    """
    ids = as_input_ids(input_ids, model)
    param = next(model.parameters())
    sites = find_sites(model)
    chosen = set(sites) if only is None else set(only)
    missing = sorted(chosen - set(coefficients))
    if missing:
        raise KeyError(f"no coefficients given for site(s) {missing}")
    tensors = {name: _as_tensor(coefficients[name], param.device, param.dtype) for name in chosen}
    with site_modes(model, "replay", provider=tensor_provider(tensors), only=chosen):
        return model_logits(model(ids))
