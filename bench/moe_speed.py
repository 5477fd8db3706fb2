"""Record and replay cost on mixture-of-experts models, as ratios to a plain forward, measured in one run.

    python -m bench.moe_speed [--types olmoe deepseek_v3 qwen3_next] [--repeats 9] [--threads 2]

For each type: a random model of the OLMoE-like shape below is saved, loaded back twice (once by
transformers alone, the plain forward; once by `fca.load_model`, with its routers as sites) and timed on
the same token ids, interleaved, each pass under `torch.no_grad`:

    plain      transformers' own model, nothing attached
    hooks      the plain model with hand-written forward hooks that copy each router's output (the
               least any recorder can do)
    record     FCA's model recording every site's coefficients (what a cache build captures per batch)
    replay     FCA's model replaying them (Correct), routers not called

Each ratio is the median over repeats of (pass time / plain time of the same repeat). Correct replay is
checked to reproduce the recorded logits bit for bit before anything is timed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

SHAPE = dict(
    num_hidden_layers=4,
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=256,
    shared_expert_intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=4,
    num_experts=8,
    num_local_experts=8,
    n_routed_experts=8,
    num_experts_per_tok=2,
    vocab_size=1024,
    max_position_embeddings=512,
)
BATCH, SEQ_LEN = 4, 256


def saved_model(model_type: str, directory: Path) -> None:
    """A random model of `model_type` at SHAPE (the config keys it has), saved to `directory`."""
    from bench.moe_coverage import tiny_config

    config = tiny_config(model_type)
    for key, value in SHAPE.items():
        if hasattr(config, key):
            setattr(config, key, value)
    layer_types = getattr(config, "layer_types", None)
    if isinstance(layer_types, list):  # per-layer lists follow the number of layers
        config.layer_types = (layer_types * SHAPE["num_hidden_layers"])[: SHAPE["num_hidden_layers"]]
    kinds = getattr(config, "mlp_layer_types", None)
    if isinstance(kinds, list):
        config.mlp_layer_types = [kinds[0]] * SHAPE["num_hidden_layers"]
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(directory)


def _timed(run) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def measure(model_type: str, repeats: int, work: Path) -> dict:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    import fca
    from fca.engine.sites import find_sites, site_modes

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    directory = work / model_type
    saved_model(model_type, directory)
    plain = AutoModelForCausalLM.from_pretrained(directory).eval()
    loaded = fca.load_model(directory)
    sites = find_sites(loaded)
    routers = [plain.get_submodule(name) for name in sites]  # the same paths in the plain model
    ids = torch.randint(3, SHAPE["vocab_size"], (BATCH, SEQ_LEN), generator=torch.Generator().manual_seed(0))

    copies: list[torch.Tensor] = []

    def copy_output(module, args, output):
        copies.append((output[0] if isinstance(output, tuple) else output).detach().clone())

    sink: dict[str, torch.Tensor] = {}

    def run_plain():
        plain(ids)

    def run_hooks():
        copies.clear()
        handles = [r.register_forward_hook(copy_output) for r in routers]
        try:
            plain(ids)
        finally:
            for h in handles:
                h.remove()

    def run_record():
        with site_modes(loaded, "record", sink=sink):
            loaded(ids)

    def run_replay():
        with site_modes(loaded, "replay", provider=lambda site, B, T: sink[site.site_name]):
            loaded(ids)

    with torch.no_grad():
        with site_modes(loaded, "record", sink=sink):
            live = loaded(ids).logits
        with site_modes(loaded, "replay", provider=lambda site, B, T: sink[site.site_name]):
            replayed = loaded(ids).logits
        if not torch.equal(live, replayed):
            raise SystemExit(f"{model_type}: Correct replay differs from the live pass; nothing timed")
        passes = {"plain": run_plain, "hooks": run_hooks, "record": run_record, "replay": run_replay}
        for run in passes.values():  # warm up each path once
            run()
        ratios: dict[str, list[float]] = {name: [] for name in passes if name != "plain"}
        for _ in range(repeats):
            times = {name: _timed(run) for name, run in passes.items()}
            for name in ratios:
                ratios[name].append(times[name] / times["plain"])
    return {
        "model_type": model_type,
        "sites": len(sites),
        **{f"{name}_ratio": statistics.median(values) for name, values in ratios.items()},
        **{f"{name}_range": (min(values), max(values)) for name, values in ratios.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--types", nargs="+", default=["olmoe", "deepseek_v3", "qwen3_next"])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    print(f"batch {BATCH} x {SEQ_LEN} tokens, {args.threads} threads, median over {args.repeats} interleaved repeats")
    print(f"{'type':<14}{'sites':>6}  {'hooks/plain':>16}  {'record/plain':>16}  {'replay/plain':>16}")
    with tempfile.TemporaryDirectory() as work:
        for model_type in args.types:
            row = measure(model_type, args.repeats, Path(work))
            cells = "  ".join(
                f"{row[f'{n}_ratio']:.3f} ({row[f'{n}_range'][0]:.2f}-{row[f'{n}_range'][1]:.2f})"
                for n in ("hooks", "record", "replay")
            )
            print(f"{model_type:<14}{row['sites']:>6}  {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
