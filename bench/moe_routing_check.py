"""Routing agreement of a mixture of experts on a device: the figures replay reports there, against the
experts each condition's logits select, computed apart from the library in NumPy.

    python -m bench.moe_routing_check --device cuda [--dtype bfloat16] [--json PATH]
    python -m bench.moe_routing_check --cost [--device cuda]   (the tally's cost: replay with it / without)

A small random Mixtral (8 experts, top-2) is cached and replayed on the device: Correct must be exact,
and for conditions of distinct logits (cross_input, token_shuffle, interpolate:0.5) `same_experts` and
`expert_overlap`, read at the experts modules, must equal the NumPy count (router by router where no
choice was tied; in bfloat16 a few are, and NumPy breaks ties otherwise than torch.topk: the counts may
differ by the share of tokens whose own or fed top-k was a tie, counted in NumPy). Exits 1 when a figure
differs; prints the figures either way.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

import fca
from bench.output import emit
from fca.jobs.runs import run_replay
from fca.tables.conditions import condition_coefficients, derangement, parse_condition
from fca.tables.profiles import calibration_profiles
from fca.tables.store import open_cache

UNTIED = ("cross_input", "token_shuffle", "interpolate:0.5")
EXPERTS, TOP_K, SEQS, SEQ_LEN, BATCH = 8, 2, 16, 64, 4


def tiny_mixtral(device: str, dtype: torch.dtype) -> torch.nn.Module:
    import transformers

    from fca.engine.models.hf_moe import adapt_moe

    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K, max_position_embeddings=128,
    )  # fmt: skip
    return adapt_moe(transformers.AutoModelForCausalLM.from_config(config).eval()).to(device=device, dtype=dtype)


def numpy_agreement(own: np.ndarray, fed: np.ndarray, k: int) -> tuple[float, float, float]:
    """own, fed: [n, T, E] logits -> (share of tokens with the same top-k set, mean share of the k kept, share
    of tokens whose own or fed choice was a tie at the k-th expert)."""
    fed = np.broadcast_to(fed, own.shape)
    top = lambda x: np.sort(np.argsort(-x, axis=-1, kind="stable")[..., :k], axis=-1)  # noqa: E731
    tied = lambda x: np.sort(x, axis=-1)[..., -k] == np.sort(x, axis=-1)[..., -k - 1]  # noqa: E731
    a, b = top(own), top(fed)
    kept = (a[..., :, None] == b[..., None, :]).any(-1).sum(-1)  # [n, T]
    return float((kept == k).mean()), float((kept / k).mean()), float((tied(own) | tied(fed)).mean())


def as_fed(values: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """Coefficients as a router of that dtype is fed them, as float32."""
    return torch.from_numpy(np.array(values, dtype=np.float32)).to(dtype).float().numpy()


def check(device: str, dtype: str) -> dict:
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    model = tiny_mixtral(device, torch_dtype)
    rng = np.random.default_rng(0)
    windows = rng.integers(3, 300, size=(2 * SEQS, SEQ_LEN + 1))  # [N, T + 1]
    with tempfile.TemporaryDirectory(prefix="fca-moe-check-") as work:
        storage = "bfloat16" if dtype == "bfloat16" else "float32"  # (a bfloat16 model's values, bit for bit)
        kw = dict(batch_size=BATCH, coefficient_dtype=storage)
        evaluated = fca.build_cache(model, windows[:SEQS], Path(work) / "eval", split="eval", **kw)
        calibration = fca.build_cache(model, windows[SEQS:], Path(work) / "cal", split="calibration", **kw)
        conditions = [*UNTIED, "global_mean"]
        record = run_replay(model, evaluated, calibration, conditions, num_seqs=SEQS, batch_size=BATCH, save=False)
        cache, profiles = open_cache(evaluated), calibration_profiles(open_cache(calibration))
        rows = cache.read_seqs(list(range(SEQS)))
        own = {site: rows[site] for site in cache.sites}
        partner = cache.coefficients([int(p) for p in derangement(SEQS, 0)])
    routing = record["results"]["routing"]
    routers = list(routing["routers"])
    out = {
        "device": record["device"],
        "dtype": dtype,
        "max_abs_logit_diff": record["results"]["exactness"]["max_abs_logit_diff"],
        "fidelity": record["results"]["exactness"]["fidelity"]["verdict"],
        "routers": len(routers),
        "conditions": {},
    }
    failures = []
    for name in UNTIED:
        fed = condition_coefficients(parse_condition(name), own, list(range(SEQS)), profiles, partner)
        fed = {s: as_fed(fed[s], torch_dtype) for s in routers}  # (rounded as the routers are fed them)
        expected = [numpy_agreement(as_fed(own[s], torch_dtype), fed[s], TOP_K) for s in routers]
        row = routing["conditions"][name]
        reported_overlap = row["expert_overlap"]
        out["conditions"][name] = {
            "same_experts": row["same_experts"],
            "numpy_same_experts": float(np.mean([e[0] for e in expected])),
            "expert_overlap": reported_overlap,
            "numpy_expert_overlap": float(np.mean([e[1] for e in expected])),
            "tied": float(np.mean([e[2] for e in expected])),
        }
        # NumPy breaks ties otherwise than torch.topk: only tied tokens (bfloat16 rounding makes a few) may
        # count otherwise, each by one token's share at most.
        slack = max(e[2] for e in expected) + 1e-12
        for figure in ("same_experts", "expert_overlap"):
            if abs(row[figure] - out["conditions"][name][f"numpy_{figure}"]) > slack:
                failures.append(
                    f"{name}: {figure} {row[figure]} vs {out['conditions'][name][f'numpy_{figure}']} (ties {slack:.3g})"
                )
        if slack <= 1e-12 and not np.allclose(row["same_experts_per_router"], [e[0] for e in expected], atol=1e-12):
            failures.append(f"{name}: same_experts per router {row['same_experts_per_router']} != {expected}")
    if out["max_abs_logit_diff"] != 0.0:
        failures.append(f"Correct replay not exact: {out['max_abs_logit_diff']}")
    out["failures"] = failures
    return out


def tally_cost(device: str, dtype: str, rounds: int = 3) -> dict:
    """What the routing tally costs a replay: the same run (four conditions, checks on) timed with the
    tally and without it (`routers={}`), interleaved, on a model of 64 experts, top-8 (OLMoE's routing),
    at 16 x 256 tokens; the median of the per-round ratios."""
    import time

    import transformers

    from fca.engine.models.hf_moe import adapt_moe
    from fca.engine.replay import run_conditions

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=300, hidden_size=256, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=64, num_experts_per_tok=8, max_position_embeddings=512,
    )  # fmt: skip
    model = adapt_moe(transformers.AutoModelForCausalLM.from_config(config).eval()).to(device=device, dtype=torch_dtype)
    windows = np.random.default_rng(0).integers(3, 300, size=(32, 257))
    storage = "bfloat16" if dtype == "bfloat16" else "float32"
    with tempfile.TemporaryDirectory(prefix="fca-moe-cost-") as work:
        kw = dict(batch_size=8, coefficient_dtype=storage)
        evaluated = open_cache(fca.build_cache(model, windows[:16], Path(work) / "eval", split="eval", **kw))
        profiles = calibration_profiles(
            open_cache(fca.build_cache(model, windows[16:], Path(work) / "cal", split="calibration", **kw))
        )
        conditions = [
            parse_condition(c) for c in ("correct", "cross_input", "token_shuffle", "static_layer", "global_mean")
        ]

        def seconds(routers) -> float:
            if device.startswith("cuda"):
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            run_conditions(model, evaluated, conditions, profiles, batch_size=8, routers=routers)
            if device.startswith("cuda"):
                torch.cuda.synchronize(device)
            return time.perf_counter() - start

        seconds(None)  # (warm-up)
        ratios, plain = [], []
        for _ in range(rounds):
            without = seconds({})
            ratios.append(seconds(None) / without)
            plain.append(without)
    return {
        "device": device,
        "dtype": dtype,
        "shape": "4 layers, 64 experts top-8, 16 x 256 tokens, 5 conditions",
        "replay_with_routing_over_without": float(np.median(ratios)),
        "ratios": ratios,
        "replay_without_routing_s": float(np.median(plain)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--cost", action="store_true", help="time a replay with the routing tally and without it")
    parser.add_argument("--json")
    args = parser.parse_args()
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if args.cost:
        emit(tally_cost(device, args.dtype), args.json)
        return
    result = check(device, args.dtype)
    emit(result, args.json)
    sys.exit(1 if result["failures"] else 0)


if __name__ == "__main__":
    main()
