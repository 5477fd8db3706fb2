"""Routing agreement: how much of a top-k router's choice a replay condition keeps.

A condition's penalty says what reassigning a mixture of experts' router coefficients costs in NLL; it
does not say how much routing changed. Under replay the router is removed, and each MoE layer runs the
top-k experts of the coefficients it is fed, so which experts run under a condition follows from its
coefficients alone: compared with the experts the token's own (cached) coefficients select.

Selection mirrors the routers' (`fca.engine.models.hf_moe.TopKRouting`): the coefficients cast to the
dtype the site is fed in, a float32 softmax, `torch.topk`. A condition that gives every expert the same
value (a global mean) leaves the choice to `torch.topk`'s tie-breaking; such tokens are counted as tied,
so an agreement decided by ties is not read as the router's. Ties are broken as on the CPU; another
device may break them otherwise (untied choices are the same everywhere).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

# Per-sequence figures of `routing_agreement`, in the order reports give them.
ROUTING_FIGURES = ("same_experts", "expert_overlap", "tied")


def top_k_selection(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Router coefficients [b, T, E] -> the experts selected, as a mask [b, T, E], and whether the k-th
    choice was tied with the next one [b, T] (then `torch.topk`'s order, not the values, decided)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [b, T, E]
    E = probs.shape[-1]
    values, index = torch.topk(probs, min(k + 1, E), dim=-1)  # [b, T, k + 1]
    selected = torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, index[..., :k], True)
    tied = values[..., k - 1] == values[..., k] if k < E else torch.zeros(probs.shape[:-1], dtype=torch.bool)
    return selected, tied


def routing_agreement(own: np.ndarray, assigned: np.ndarray, k: int, dtype: torch.dtype) -> dict[str, np.ndarray]:
    """Per sequence [b]: `same_experts`, the share of tokens whose k experts under `assigned` are the set
    their own coefficients select; `expert_overlap`, the mean share of those k experts kept; `tied`, the
    share of tokens whose choice under `assigned` was decided by a tie.

    own: [b, T, E] the tokens' cached coefficients; assigned: a condition's, broadcastable to [b, T, E];
    dtype: the dtype the site is fed in replay (a bfloat16 model's router sees its values rounded)."""
    # (copies: cached arrays may be read-only, and torch wants writable memory)
    own_t = torch.from_numpy(np.array(own, dtype=np.float32)).to(dtype)
    given = torch.from_numpy(np.array(assigned, dtype=np.float32)).to(dtype).expand(own_t.shape)
    live, _ = top_k_selection(own_t, k)
    chosen, tied = top_k_selection(given, k)
    kept = (live & chosen).sum(-1)  # [b, T] experts in both selections
    return {
        "same_experts": (kept == k).double().mean(1).numpy(),
        "expert_overlap": (kept.double() / k).mean(1).numpy(),
        "tied": tied.double().mean(1).numpy(),
    }


class RoutingTally:
    """Routing agreement of each condition of a run, per sequence and router site, filled batch by batch.

    routers: site -> experts chosen per token (the family's `routers`); names: the run's conditions; n: its
    sequences. `figures[condition][figure]` is [n, S], S the routers in `routers`' order."""

    def __init__(self, routers: Mapping[str, int], names, n: int) -> None:
        self.routers = dict(routers)
        self.figures = {
            name: {figure: np.zeros((n, len(self.routers))) for figure in ROUTING_FIGURES} for name in names
        }

    def add(
        self,
        name: str,
        index: list[int],
        own: Mapping[str, np.ndarray],
        assigned: Mapping[str, np.ndarray],
        dtypes: Mapping[str, torch.dtype],
    ) -> None:
        """Score condition `name` on the sequences at positions `index`. own, assigned: site -> [b, T, E];
        dtypes: site -> the dtype replay feeds it."""
        for column, (site, k) in enumerate(self.routers.items()):
            scores = routing_agreement(own[site], assigned[site], k, dtypes[site])
            for figure, values in scores.items():
                self.figures[name][figure][index, column] = values
