"""MUDDPythia at the 1.4B shapes on CPU: parameters, live vs capture vs replay throughput, cache size.

A random-weight model with the sizes of the released MUDDPythia-1.4B config (no download needed)
runs a few short windows through `fca.capture` and `fca.replay`. It stands in for the real-scale
recipe of docs/muddpythia.md until a GPU and the real checkpoint are at hand.

    python -m bench.muddpythia_scale [--batch 2] [--seq-len 128] [--threads 2] [--rounds 2] [--json PATH]
    python -m bench.muddpythia_scale --device cuda --dtype bfloat16 --batch 8 --seq-len 1024 --stream-seqs 64

`--stream-seqs N [M ...]` also builds real caches of N (M, ...) random windows through the streaming
writer (pinned buffers and writer threads on CUDA) into a temporary directory, each timed against plain
forwards over the same windows, with the default number of writer threads or each of `--stream-writers`.
The `stream_*` keys are the first build's; `stream_runs` holds every build's (with `stream_stages_s`:
where its time went), and for a bfloat16 model one more build of the largest count stored losslessly in
16 bits.
A short build pays the last part's encoding after the last forward; a longer one shows the steady rate.

Memory: about 8 GB (1.42 B float32 parameters; 7.9 GB peak RSS measured). Runtime on 2 CPU cores: about 1.5 min.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import fca
from fca.engine.execution import synchronize
from fca.engine.models.muddpythia import MUDDPythiaConfig
from fca.testing import build_random_model

# The released MUDDPythia-1.4B config.json (Caiyun-AI/MUDDFormer, pytorch/muddpythia/config_1p4b.json):
# the fields that set the shapes and the computation.
MUDDPYTHIA_1P4B = dict(
    vocab_size=50432,
    dim=2048,
    n_layer=24,
    n_head=16,
    intermediate_size=8192,
    block_size=2048,
    rope_base=10000,
    rotary_pct=0.25,
    norm_eps=1e-5,
    use_qk_norm=True,
    use_parallel_residual=True,
    use_linear_bias=True,
    dense=True,
    dynamic_dense=True,
    dense_type="qkvr",
    sepln=True,
    expand_last=True,
    round64=True,
    bos_token_id=0,
    eos_token_id=0,
)


def timed(fn, device: torch.device | None = None) -> tuple[float, object]:
    """Seconds `fn` takes, to the end of what it queued on `device`, and its result."""
    synchronize(device)
    start = time.perf_counter()
    out = fn()
    synchronize(device)
    return time.perf_counter() - start, out


def stream_cache(
    model: torch.nn.Module,
    vocab: int,
    num_seqs: int,
    seq_len: int,
    batch: int,
    seed: int,
    coefficient_dtype: str = "float32",
    workers: int | None = None,
) -> dict:
    """Build a cache of random windows through the real writer; time it against plain forwards."""
    from fca.engine.capture import default_writers, write_cache
    from fca.engine.sites import site_specs
    from fca.tables.schema import cache_plan
    from fca.tables.store import open_cache
    from fca.tables.timings import Timings

    windows = np.random.default_rng(seed).integers(0, vocab, (num_seqs, seq_len + 1))
    plan = cache_plan(
        site_specs(model),
        seq_len,
        num_seqs,
        model={"path": "random-1.4b", "fingerprint": "random"},
        corpus={"split": "random"},
        coefficient_dtype=coefficient_dtype,
    )
    device = next(model.parameters()).device
    out = Path(tempfile.mkdtemp(prefix="fca-mudd-")) / "cache"
    try:

        def forwards() -> None:
            with torch.no_grad():
                for i in range(0, num_seqs, batch):
                    model(torch.from_numpy(windows[i : i + batch, :-1]).to(device))

        forward_s, _ = timed(forwards, device)
        stages = Timings()
        build_s, _ = timed(
            lambda: write_cache(
                model,
                windows,
                out,
                plan,
                batch,
                overwrite=True,
                workers=workers,
                timings=stages,
            ),
            device,
        )
        size = open_cache(out).manifest.total_bytes
    finally:
        shutil.rmtree(out.parent, ignore_errors=True)
    return {
        "stream_seqs": num_seqs,
        "stream_coefficient_dtype": coefficient_dtype,
        "stream_writers": workers or default_writers(device),
        "stream_build_over_forward": build_s / forward_s,
        "stream_tokens_per_s": num_seqs * seq_len / build_s,
        "stream_cache_mb": size / 1e6,
        "stream_bytes_per_token_on_disk": size / (num_seqs * seq_len),
        "stream_forward_s": round(forward_s, 4),
        "stream_build_s": round(build_s, 4),
        # Where the build's time went, summed per stage over its threads (fca.tables.timings).
        "stream_stages_s": stages.rounded(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2, help="interleaved live/capture rounds (best of each)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the figures as JSON here")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument(
        "--stream-seqs", type=int, nargs="*", default=[], help="also stream caches of these many random windows"
    )
    parser.add_argument(
        "--stream-writers",
        type=int,
        nargs="*",
        default=[],
        help="writer threads per streamed build (default: the build's)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    config = MUDDPythiaConfig(**MUDDPYTHIA_1P4B)
    build_s, model = timed(lambda: build_random_model(config, seed=args.seed))
    model = model.to(device=args.device, dtype=getattr(torch, args.dtype)).eval()
    params = sum(p.numel() for p in model.parameters())
    controller_params = sum(p.numel() for p in model.dynamic_dense.parameters()) + sum(
        p.numel() for p in model.dense_bs.parameters()
    )
    ids = torch.randint(
        0, config.vocab_size, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(args.seed)
    ).to(args.device)
    tokens = ids.numel()

    with torch.no_grad():
        live = model(ids)  # warm-up at full size: the first call pays for allocations
    # Interleaved rounds, best of each: the CPU is shared, so the minimum is the least noisy figure.
    coefficients = fca.capture(model, ids)  # host float32 arrays, as a cache read gives them
    on_device = {
        k: torch.from_numpy(v).to(device=args.device, dtype=getattr(torch, args.dtype)) for k, v in coefficients.items()
    }
    fca.replay(model, ids, coefficients)  # warm-up of the replay path (pinned buffers, copy stream)
    times: dict[str, list[float]] = {"live": [], "capture": [], "replay_host": [], "replay_device": []}
    for _ in range(args.rounds):
        with torch.no_grad():
            times["live"].append(timed(lambda: model(ids), ids.device)[0])
        times["capture"].append(timed(lambda: fca.capture(model, ids), ids.device)[0])
        times["replay_host"].append(timed(lambda: fca.replay(model, ids, coefficients), ids.device)[0])
        times["replay_device"].append(timed(lambda: fca.replay(model, ids, on_device), ids.device)[0])
    live_s, capture_s = min(times["live"]), min(times["capture"])
    replay_s, replay_device_s = min(times["replay_host"]), min(times["replay_device"])
    replayed = fca.replay(model, ids, coefficients)

    coefficient_bytes = sum(c.nbytes for c in coefficients.values())
    figures = {
        "config": f"MUDDPythia-1.4B shapes, random weights, {args.dtype}, {args.device}",
        "parameters": params,
        "controller_parameters": controller_params,
        "sites": len(coefficients),
        "coefficients_per_token": sum(c.shape[-1] for c in coefficients.values()),
        "bytes_per_token_float32": coefficient_bytes / tokens,
        "windows": [args.batch, args.seq_len],
        "threads": args.threads,
        "build_s": round(build_s, 2),
        "tokens_per_s_live": tokens / live_s,
        "tokens_per_s_capture": tokens / capture_s,
        "tokens_per_s_replay": tokens / replay_s,
        "capture_ratio": capture_s / live_s,
        "replay_ratio": replay_s / live_s,  # host float32 arrays in, as from a cache: copy and cast included
        "replay_ratio_coefficients_on_device": replay_device_s / live_s,
        "replay_max_abs_logit_diff": (replayed - live).abs().max().item(),
        "cache_bytes_for_256x1024_float32": coefficient_bytes / tokens * 256 * 1024,
    }
    if args.stream_seqs:
        writers = args.stream_writers or [None]
        runs = [(n, "float32", w) for n in args.stream_seqs for w in writers]
        if args.dtype == "bfloat16":
            runs.append((max(args.stream_seqs), "bfloat16", writers[-1]))
        streamed = [
            stream_cache(model, config.vocab_size, n, args.seq_len, args.batch, args.seed, dtype, w)
            for n, dtype, w in runs
        ]
        figures.update(streamed[0])
        figures["stream_runs"] = streamed
    for key, value in figures.items():
        print(f"{key:34s} {value:,.4g}" if isinstance(value, float) else f"{key:34s} {value}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
