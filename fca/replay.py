"""Replay: run the frozen model with given coefficients (controllers removed), score conditions."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from .capture import as_input_ids, token_nll
from .conditions import Condition, condition_coefficients, derangement
from .errors import Cancelled, ExactnessError  # noqa: F401  (ExactnessError re-exported)
from .profiles import Profiles
from .sites import find_sites, model_logits, site_modes, tensor_provider
from .store import Cache


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



# ---------------------------------------------------------------------------------------------
# Replay runner: score conditions on the sequences of a cache.

@dataclass
class ReplayResults:
    seqs: list[int]
    per_seq_nll: dict[str, np.ndarray]  # condition name -> [n] mean NLL of each sequence
    conditions: dict[str, Condition]
    max_abs_logit_diff: float = 0.0  # correct replay vs live, same batch composition
    nll_live: float = float("nan")
    nll_correct: float = float("nan")
    cached_live_nll_max_diff: float = 0.0  # live NLL now vs the NLL stored in the cache
    extras: dict = field(default_factory=dict)

    def nll(self, name: str) -> float:
        return float(self.per_seq_nll[name].mean())


def _nll_per_seq(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """logits [b, T, V], targets [b, T] -> mean NLL per sequence [b] (float64)."""
    return token_nll(logits, targets).double().mean(1)


def _stack_conditions(parts: list[dict[str, np.ndarray]], b: int, T: int) -> dict[str, np.ndarray]:
    """Concatenate several conditions' coefficients along the batch axis -> site -> [len(parts) * b, T, K]."""
    out = {}
    for name in parts[0]:
        K = parts[0][name].shape[-1]
        out[name] = np.concatenate([np.broadcast_to(p[name], (b, T, K)) for p in parts], axis=0)
    return out


@torch.no_grad()
def run_conditions(
    model: nn.Module,
    cache: Cache,
    conditions: Sequence[Condition],
    profiles: Profiles | None = None,
    seqs: Sequence[int] | None = None,
    batch_size: int = 16,
    cross_seed: int = 0,
    max_logit_bytes: int = 1 << 30,
    check_exactness: bool = True,
    progress: Callable[[int, int], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> ReplayResults:
    """Per-sequence NLL of every condition on `seqs` (default: all) of `cache`.

    Each batch first runs live and as Correct replay with the same batch composition (the exactness
    check); then the conditions run, several stacked into one forward while the logits fit in
    `max_logit_bytes`. The controllers never run during replay.
    """
    seqs = list(range(cache.num_seqs)) if seqs is None else [int(s) for s in seqs]
    names = [c.name for c in conditions]
    if len(set(names)) != len(names):
        raise ValueError(f"conditions repeat: {names}")
    partner = derangement(len(seqs), cross_seed) if any(c.kind == "cross_input" for c in conditions) else None
    device = next(model.parameters()).device
    T = cache.seq_len
    vocab = int(cache.manifest.get("tokenizer", {}).get("vocab_size") or 0) or 50_000
    per_pass = max(1, max_logit_bytes // max(1, batch_size * T * vocab * 4))
    per_seq = {name: np.zeros(len(seqs)) for name in names}
    live_nll = np.zeros(len(seqs))
    correct_nll = np.zeros(len(seqs))
    max_diff, cached_diff = 0.0, 0.0
    for lo in range(0, len(seqs), batch_size):
        if should_stop is not None and should_stop():
            raise Cancelled("replay cancelled")
        index = list(range(lo, min(len(seqs), lo + batch_size)))
        batch_seqs = [seqs[i] for i in index]
        own = cache.read_seqs(batch_seqs)
        ids = torch.from_numpy(own["token"].astype(np.int64)).to(device)
        targets = torch.from_numpy(own["target"].astype(np.int64)).to(device)
        coefficients = {name: own[name] for name in cache.sites}
        b = len(index)
        if check_exactness:
            live = model_logits(model(ids))
            correct = replay(model, ids, coefficients)
            max_diff = max(max_diff, float((live.float() - correct.float()).abs().max()))
            live_seq = _nll_per_seq(live, targets)
            live_nll[index] = live_seq.cpu().numpy()
            correct_nll[index] = _nll_per_seq(correct, targets).cpu().numpy()
            cached_diff = max(cached_diff, float(np.abs(own["live_nll"].astype(np.float64).mean(1) - live_nll[index]).max()))
        other = cache.coefficients([seqs[partner[i]] for i in index]) if partner is not None else None
        # The exactness pass has already scored plain Correct replay on this very batch: reuse it.
        plain_correct = [c for c in conditions if check_exactness and c == Condition("correct", seed=c.seed)]
        for c in plain_correct:
            per_seq[c.name][index] = correct_nll[index]
        to_run = [c for c in conditions if c not in plain_correct]
        for start in range(0, len(to_run), per_pass):
            group = to_run[start : start + per_pass]
            parts = [condition_coefficients(c, coefficients, index, profiles, other) for c in group]
            stacked = _stack_conditions(parts, b, T)
            logits = replay(model, ids.repeat(len(group), 1), stacked)  # [len(group) * b, T, V]
            nll = _nll_per_seq(logits, targets.repeat(len(group), 1)).cpu().numpy().reshape(len(group), b)
            for c, row in zip(group, nll):
                per_seq[c.name][index] = row
        if progress is not None:
            progress(index[-1] + 1, len(seqs))
    return ReplayResults(
        seqs=seqs, per_seq_nll=per_seq, conditions={c.name: c for c in conditions},
        max_abs_logit_diff=max_diff, nll_live=float(live_nll.mean()), nll_correct=float(correct_nll.mean()),
        cached_live_nll_max_diff=cached_diff,
    )
