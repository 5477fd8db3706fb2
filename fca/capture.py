"""Record pass: run the live model once and collect every site's coefficients as float32 arrays."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from .sites import capture_tensors, find_sites


def as_input_ids(input_ids, model: nn.Module) -> torch.Tensor:
    """Token ids [B, T] as a long tensor on the model's device."""
    device = next(model.parameters()).device
    ids = torch.as_tensor(np.asarray(input_ids) if not isinstance(input_ids, torch.Tensor) else input_ids)
    if ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, positions], got shape {tuple(ids.shape)}")
    return ids.to(device=device, dtype=torch.long)


def capture(model: nn.Module, input_ids) -> dict[str, np.ndarray]:
    """Site name -> coefficients [B, T, K_s] float32, in execution order."""
    if not find_sites(model):
        raise ValueError(f"{type(model).__name__} has no controller sites to capture")
    _, coefficients = capture_tensors(model, as_input_ids(input_ids, model))
    return {name: c.float().cpu().numpy() for name, c in coefficients.items()}
