"""Actual execution: which blocks run, what the controllers cost, and latency against the Dense twin.

Everything here is measured on the running model, never assumed from its architecture:
blocks executed are counted by forward hooks, FLOPs by PyTorch's FLOP counter (matrix products and
attention; element-wise work such as the gate nonlinearity is not counted), latency by interleaved
timed runs on the same device and batch.

The counter knows a formula per operator, and this torch has none for two that the families run: the
CPU's fused attention (CUDA's flash and efficient attention are counted) and the grouped matrix product
of transformers' MoE experts. Without them a CPU audit left out every attention product and an MoE audit
every expert, so the controllers' share came out larger than it is (0.45% instead of 0.41% for the
demo). Both are counted here, with the formulas of the kernels they stand for; any other matrix-product,
convolution or attention operator the forward runs without a formula is listed in the report
(`uncounted_ops`) rather than silently counted as 0.
"""

from __future__ import annotations

import math
import re
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import partial

import numpy as np
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, flop_registry, sdpa_flop_count

from fca.engine.families import family_of
from fca.engine.sites import find_sites, forward_pre_hooks, unwrapped


def model_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks in execution order, as its family (`fca.engine.families`) names them."""
    model = unwrapped(model)
    return list(family_of(model).blocks(model))


def _tokens_in(args: tuple, kwargs: dict) -> int:
    x = args[0] if args else next(iter(kwargs.values()))
    return int(x.shape[0] * x.shape[1]) if x.dim() >= 3 else int(x.shape[0])


@torch.no_grad()
def blocks_executed(model: nn.Module, input_ids: torch.Tensor) -> dict:
    """Count, with forward hooks, how many tokens each block processed in one forward. A compiled model is
    counted on its original module: a graph compiled before the hooks were added does not call them
    (torch does not guard on module hooks), and counted 0 tokens in every block."""
    model = unwrapped(model)
    blocks = model_blocks(model)
    processed = [0] * len(blocks)

    def count(i: int, module: nn.Module, args: tuple, kwargs: dict) -> None:
        processed[i] += _tokens_in(args, kwargs)

    with forward_pre_hooks((b, partial(count, i)) for i, b in enumerate(blocks)):
        model(input_ids)
    tokens = int(input_ids.numel())
    return {
        "num_blocks": len(blocks),
        "tokens": tokens,
        "tokens_per_block": processed,
        "blocks_executed_per_token": sum(processed) / tokens,
        "blocks_executed_fraction": sum(processed) / (tokens * len(blocks)),
    }


class ExecutionTally:
    """The tokens each block runs under each condition of a replay run, per evaluated sequence, counted by
    forward pre-hooks on the blocks (what the family's `tokens_per_sequence` reads from each call): condition
    name -> [n, L] (L blocks). A compiled model's graphs do not call hooks added after compiling, and a block
    whose calls say nothing of their sequences cannot be counted: then there are no figures (`counts` None)."""

    def __init__(self, model: nn.Module, names: Sequence[str], n: int) -> None:
        original = unwrapped(model)
        self.blocks = model_blocks(original) if original is model else []
        self.read = family_of(original).tokens_per_sequence
        self.tokens = {name: np.zeros((n, len(self.blocks)), dtype=np.int64) for name in names}
        self.readable = bool(self.blocks)
        self.last: np.ndarray | None = None  # [rows, L] of the last forward counted

    @contextmanager
    def counting(self, rows: int) -> Iterator[None]:
        """Count one forward of a batch of `rows` sequences into `last` ([rows, L]; zeros for a block not called)."""
        self.last = None
        if not self.readable:
            yield
            return
        calls: list[list[torch.Tensor]] = [[] for _ in self.blocks]

        def count(i: int, module: nn.Module, args: tuple, kwargs: dict) -> None:
            per_sequence = self.read(module, args, kwargs)
            if per_sequence is None or per_sequence.shape != (rows,):
                self.readable = False
            else:
                calls[i].append(per_sequence)

        with forward_pre_hooks((b, partial(count, i)) for i, b in enumerate(self.blocks)):
            yield
        if self.readable:
            last = np.zeros((rows, len(self.blocks)), dtype=np.int64)
            for i, counted in enumerate(calls):
                for per_sequence in counted:
                    last[:, i] += per_sequence.cpu().numpy()
            self.last = last

    def add(self, name: str, index: Sequence[int], counted: np.ndarray | None) -> None:
        """Credit `counted` [len(index), L] to condition `name` at the run's positions `index`."""
        if counted is not None and name in self.tokens:
            self.tokens[name][list(index)] += counted

    @property
    def counts(self) -> dict[str, np.ndarray] | None:
        return self.tokens if self.readable else None


def _cpu_attention_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    """The CPU's fused attention: the two products of attention, as torch counts CUDA's fused kernels."""
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _grouped_mm_flop(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """One product per group: `a` [M, K] by `b` [G, K, N] (tokens sorted by expert, each expert's weights),
    or [G, M, K] by [G, K, N], or [G, M, K] by [K, N_total]: 2 * K per output element. [M, K_total] by
    [K_total, N] (groups split K) gives [G, M, N], each group with its own share of K_total."""
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    return 2 * math.prod(out_shape) * a_shape[-1]


MISSING_FORMULAS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention_flop,
    torch.ops.aten._grouped_mm: _grouped_mm_flop,
}
# Operators whose cost the share would miss without a formula (element-wise work is left out by design).
HEAVY_OPERATOR = re.compile(r"mm|matmul|conv|attention|einsum|linear")


class _OperatorsRun(TorchDispatchMode):
    """Every operator a forward runs, as dispatched (after composite ones such as `linear` are split)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.add(func.overloadpacket)
        return func(*args, **(kwargs or {}))


@torch.no_grad()
def controller_flops(model: nn.Module, input_ids: torch.Tensor) -> dict:
    """FLOPs of one forward, the share spent inside controller sites, and the heavy operators that ran
    without a formula (`uncounted_ops`; their FLOPs are missing from both counts). A compiled model is
    counted on its original module (the same operators), whose module names are the site names."""
    model = unwrapped(model)
    counted = {**flop_registry, **MISSING_FORMULAS}
    # The counter's module tracker hooks the backward of every tensor a module is handed that requires grad;
    # under no_grad a view of a parameter (DBRX hands its experts views of their weights) requires grad and
    # has no grad function, and the tracker failed on it ("Expected gradient function to be set"). Nothing
    # here is differentiated: the parameters stop requiring grad for the count, and are restored after.
    trained = [p for p in model.parameters() if p.requires_grad]
    try:
        for p in trained:
            p.requires_grad_(False)
        with (
            FlopCounterMode(display=False, depth=None, custom_mapping=MISSING_FORMULAS) as counter,
            _OperatorsRun() as ran,
        ):
            model(input_ids)
    finally:
        for p in trained:
            p.requires_grad_(True)
    per_module = counter.get_flop_counts()
    root = type(model).__name__
    total = int(counter.get_total_flops())
    in_sites = sum(sum(per_module.get(f"{root}.{name}", {}).values()) for name in find_sites(model))
    uncounted = sorted(str(op) for op in ran.seen if op not in counted and HEAVY_OPERATOR.search(str(op)))
    return {
        "total_flops": total,
        "controller_flops": int(in_sites),
        "controller_flops_share": in_sites / total if total else 0.0,
        "flops_per_token": total / input_ids.numel(),
        "uncounted_ops": uncounted,
    }


def synchronize(device: torch.device | None) -> None:
    """Wait for the work queued on a CUDA `device` (a no-op elsewhere): CUDA calls return once their
    kernels are queued, so a clock read without this times the queueing, not the work."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def latency_ratio(model: nn.Module, dense: nn.Module, input_ids: torch.Tensor, runs: int = 7, warmup: int = 2) -> dict:
    """Median of per-pair ratios (model / dense) over interleaved timed forwards of the same batch."""
    device = input_ids.device
    pairs: list[tuple[float, float]] = []
    for i in range(warmup + runs):
        times = []
        for m in (model, dense) if i % 2 == 0 else (dense, model):  # alternate who goes first
            synchronize(device)
            start = time.perf_counter()
            m(input_ids)
            synchronize(device)
            times.append(time.perf_counter() - start)
        if i >= warmup:
            pairs.append((times[0], times[1]) if i % 2 == 0 else (times[1], times[0]))
    ratios = [a / b for a, b in pairs]
    return {
        "latency_ratio_vs_dense": statistics.median(ratios),
        "model_ms_median": 1e3 * statistics.median(a for a, _ in pairs),
        "dense_ms_median": 1e3 * statistics.median(b for _, b in pairs),
        "runs": runs,
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "batch_shape": list(input_ids.shape),
        "device": str(device),
    }


def execution_audit(model: nn.Module, input_ids: torch.Tensor, dense: nn.Module | None = None, runs: int = 7) -> dict:
    family = family_of(model)
    report = {**blocks_executed(model, input_ids), **controller_flops(model, input_ids)}
    if family.expert_paths:  # conditional execution happens at expert level: count the experts run
        from fca.engine.models.hf_moe import expert_execution

        report["experts"] = expert_execution(
            model, input_ids, family.expert_paths, family.execution_note, family.expert_selection
        )
    if family.execution_note:
        report["note"] = family.execution_note
    if dense is not None:
        dense_flops = controller_flops(dense, input_ids)["total_flops"]
        report["dense_flops_per_token"] = dense_flops / input_ids.numel()
        report["flops_ratio_vs_dense"] = report["total_flops"] / dense_flops if dense_flops else None
        report.update(latency_ratio(model, dense, input_ids, runs=runs))
    else:
        report["latency_ratio_vs_dense"] = None
    return report
