"""Logits of the public MUDDPythia code on FCA's random checkpoints, kept as a test reference.

FCA's MUDDPythia is its own implementation; `tests/test_muddpythia.py` compares it with the logits
the release code (Caiyun-AI/MUDDFormer, `pytorch/muddpythia/`) computes on the same checkpoints,
stored in `tests/reference/muddpythia_release_logits.npz`. To make that file again from a local
clone of the release (it needs `einops` and `transformers`; the release code is imported, not copied):

    python -m tests.muddpythia_reference --release PATH/TO/MUDDFormer/pytorch/muddpythia

Each case is a config (the release's own field names), a weight seed and token ids; the weights are
`fca.testing.write_random_checkpoint(config, seed)`, so the file holds logits only.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from fca.engine.models.muddpythia import MUDDPythiaConfig
from fca.testing import write_random_checkpoint

REFERENCE = Path(__file__).parent / "reference" / "muddpythia_release_logits.npz"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

_SMALL = dict(vocab_size=97, dim=64, n_layer=4, n_head=4, intermediate_size=256, block_size=64)
# The release's 1.4B switches, then variations the release code runs (it fails on `sepln: false` with
# dense connections, and on `dense: false` with `sepln: true`, so neither is a case).
CASES = {
    "release_1p4b_switches": dict(use_qk_norm=True, expand_last=True, round64=True, rotary_pct=0.25),
    "serial_residual_half_rotary": dict(use_parallel_residual=False, rotary_pct=0.5),
    "full_rotary_no_expand": dict(use_qk_norm=True, rotary_pct=1.0),
    "dense_twin": dict(use_qk_norm=True, rotary_pct=0.25, dense=False, dynamic_dense=False, sepln=False),
}
WEIGHT_SEED = 3


def case_config(name: str) -> MUDDPythiaConfig:
    return MUDDPythiaConfig(**_SMALL, **CASES[name])


def case_ids() -> torch.Tensor:
    """[2, 24] token ids shared by every case."""
    return torch.randint(0, _SMALL["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(1))


def write_case_checkpoint(name: str, directory: Path) -> Path:
    return write_random_checkpoint(directory / name, case_config(name), seed=WEIGHT_SEED)


def release_logits(release_dir: Path, checkpoint: Path, dtype: torch.dtype) -> np.ndarray:
    """[2, 24, V] float32 logits of the release code on `checkpoint`."""
    import json

    from safetensors.torch import load_file

    sys.path.insert(0, str(release_dir))
    modeling = importlib.import_module("modeling_muddpythia")
    configuration = importlib.import_module("configuration_muddpythia")
    config = json.loads((checkpoint / "config.json").read_text())
    model = modeling.MUDDPythia(configuration.MUDDPythiaConfig(**config)).eval()
    missing, unexpected = model.load_state_dict(load_file(checkpoint / "model.safetensors"), strict=False)
    # The release builds decoding caches, and static dense weights even when dense is off.
    missing = [k for k in missing if not k.startswith(("dense_bs.", "layer_cache.")) and ".kv_cache." not in k]
    if missing or unexpected:
        raise SystemExit(f"{checkpoint}: the release does not take these weights: {missing or unexpected}")
    model = model.to(dtype)
    ids = case_ids()
    model.setup_caches(ids.shape[0], ids.shape[1], dtype=dtype)
    with torch.no_grad():
        return model(ids, return_tensor=True).float().numpy()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--release", type=Path, required=True, help="the release's pytorch/muddpythia folder")
    args = parser.parse_args(argv)
    arrays = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in CASES:
            checkpoint = write_case_checkpoint(name, Path(tmp))
            for dtype_name, dtype in DTYPES.items():
                arrays[f"{name}/{dtype_name}"] = release_logits(args.release, checkpoint, dtype)
    REFERENCE.parent.mkdir(exist_ok=True)
    np.savez_compressed(REFERENCE, **arrays)
    print(f"{REFERENCE}: {len(arrays)} logit arrays, {REFERENCE.stat().st_size:,} bytes")


if __name__ == "__main__":
    main()
