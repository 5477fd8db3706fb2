"""Random-weight models and checkpoints for tests, benches and Dense twins: no training, deterministic
in the seed. Kept out of the model files, which describe architectures only (jobs layer: it builds on
`fca.engine`, and nothing in the library imports it)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from fca.engine.checkpoints import read_config
from fca.engine.models.muddpythia import MUDDPythia, MUDDPythiaConfig, dense_twin_config


def random_state_dict(config: MUDDPythiaConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random float32 weights under the public key names, deterministic in `seed`.

    Every parameter is perturbed (norm scales and biases included) so that tests exercise them; the
    static dense weights start near "take the newest hidden state" so activations stay tame.
    """
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in MUDDPythia(config).state_dict().items()}
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for key in sorted(shapes):
        shape, noise = shapes[key], lambda std: torch.randn(shapes[key], generator=gen) * std  # noqa: B023
        if key.startswith("dense_bs."):
            value = noise(0.1)
            value[:, -1] += 1.0
        elif key.startswith("dynamic_dense."):
            value = noise(1.0 / math.sqrt(shape[1]))
        elif "norm" in key and key.endswith(".weight"):  # LayerNorm and qk-norm scales
            value = 1.0 + noise(0.1)
        else:
            value = noise(0.02)
        state[key] = value.contiguous()
    return state


def build_random_model(config: MUDDPythiaConfig, seed: int = 0) -> MUDDPythia:
    """A random-weight model in float32 on CPU, without writing a checkpoint."""
    with torch.device("meta"):
        model = MUDDPythia(config)
    model.load_state_dict(random_state_dict(config, seed), strict=True, assign=True)
    return model.eval()


def write_random_checkpoint(
    directory: str | Path,
    config: MUDDPythiaConfig,
    seed: int = 0,
    fmt: str = "safetensors",
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write config.json and random weights in the public format.

    fmt: "safetensors" (model.safetensors), "sharded" (two shards + model.safetensors.index.json) or
    "bin" (pytorch_model.bin, a plain state dict).
    """
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config.to_json_file(directory / "config.json")
    state = {k: v.to(dtype) for k, v in random_state_dict(config, seed).items()}
    if fmt == "safetensors":
        save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    elif fmt == "sharded":
        keys = sorted(state)
        shards = {
            "model-00001-of-00002.safetensors": keys[: len(keys) // 2],
            "model-00002-of-00002.safetensors": keys[len(keys) // 2 :],
        }
        for name, names in shards.items():
            save_file({k: state[k] for k in names}, directory / name, metadata={"format": "pt"})
        weight_map = {k: name for name, names in shards.items() for k in names}
        total = sum(v.numel() * v.element_size() for v in state.values())
        (directory / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        )
    elif fmt == "bin":
        torch.save(state, directory / "pytorch_model.bin")
    else:
        raise ValueError(f"fmt must be 'safetensors', 'sharded' or 'bin', not {fmt!r}")
    return directory


def write_dense_twin_checkpoint(
    model_dir: str | Path, out: str | Path, seed: int = 0, dtype: torch.dtype = torch.bfloat16
) -> Path:
    """A random-weight Dense twin of the MUDDPythia checkpoint in `model_dir`, for the latency ratio.

    Latency depends on the shapes only, so the twin needs no training; its tokenizer.json (if any) is
    copied so the directory is a complete model directory.
    """
    import shutil

    model_dir = Path(model_dir)
    twin = dense_twin_config(MUDDPythiaConfig.from_dict(read_config(model_dir)))
    out = write_random_checkpoint(out, twin, seed=seed, dtype=dtype)
    if (model_dir / "tokenizer.json").is_file():
        shutil.copyfile(model_dir / "tokenizer.json", out / "tokenizer.json")
    return out
