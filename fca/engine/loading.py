"""Load and save model directories. Device, dtype and eval mode are applied once, here.

A model directory holds `config.json` (its `model_type` names the family, see `fca.engine.families`),
the weights (`model.safetensors`, a sharded safetensors index, or a `pytorch_model.bin` read with
`weights_only=True`) and, beside them, `tokenizer.json`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from torch import nn

from fca.engine.families import family_for_type, registered_families
from fca.tables.errors import ModelLoadError


def read_config(path: Path) -> dict:
    config_path = path / "config.json"
    if not path.exists():
        raise ModelLoadError(f"{path}: model directory not found")
    if not config_path.is_file():
        raise ModelLoadError(f"{config_path}: missing (a model directory needs config.json)")
    try:
        return json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ModelLoadError(f"{config_path}: not valid JSON ({err})") from None


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """Weights from safetensors (single or sharded) or a `weights_only` torch pickle."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    single, index, pickle = (
        path / "model.safetensors",
        path / "model.safetensors.index.json",
        path / "pytorch_model.bin",
    )
    try:
        if single.is_file():
            return load_file(single)
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            state: dict[str, torch.Tensor] = {}
            for shard in shards:
                state.update(load_file(path / shard))
            return state
        if pickle.is_file():
            state = torch.load(pickle, map_location="cpu", weights_only=True)
            return state.get("model", state) if isinstance(state, dict) else state
    except (SafetensorError, OSError, RuntimeError, KeyError, json.JSONDecodeError, EOFError) as err:
        bad = single if single.is_file() else index if index.is_file() else pickle
        raise ModelLoadError(f"{bad}: unreadable weights ({str(err).splitlines()[0]})") from None
    raise ModelLoadError(f"{path}: no weights (model.safetensors, model.safetensors.index.json or pytorch_model.bin)")


def load_strict(model: nn.Module, state: dict[str, torch.Tensor], where: Path, assign: bool = False) -> nn.Module:
    """`load_state_dict(strict=True)` with a one-line error naming the missing, extra or misshapen keys.

    `assign=True` adopts the given tensors instead of copying into the model's own, so a model built on
    the meta device is never allocated twice (needed for billion-parameter checkpoints).
    """
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    misshapen = [
        f"{k} {tuple(state[k].shape)} != {tuple(v.shape)}"
        for k, v in expected.items()
        if k in state and state[k].shape != v.shape
    ]
    problems = []
    if missing:
        problems.append(f"missing keys {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if unexpected:
        problems.append(f"unexpected keys {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")
    if misshapen:
        problems.append(f"misshapen {misshapen[:3]}")
    if problems:
        raise ModelLoadError(f"{where}: weights do not fit the config: {'; '.join(problems)}")
    model.load_state_dict({k: v.to(expected[k].dtype) for k, v in state.items()}, strict=True, assign=assign)
    return model


def load_model(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> nn.Module:
    """Any registered family with a loader, detected from `config.json`; returned in eval mode on `device`."""
    path = Path(path)
    model_type = read_config(path).get("model_type")
    family = family_for_type(model_type)
    if family is None or family.load is None:
        known = sorted(t for t, f in registered_families().items() if f.load is not None)
        raise ModelLoadError(
            f"{path / 'config.json'}: unsupported model_type {model_type!r} (known: {', '.join(known)})"
        )
    model = family.load(path)
    if dtype is not None:
        model = model.to(dtype)
    model = model.to(resolve_device(device)).eval()
    model.fca_path = str(path)
    return model


def resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError("device 'cuda' asked for, but no CUDA device is available")
    return torch.device(device)


def fingerprint_state(model: nn.Module) -> str:
    """sha256 over the weights (names, dtypes, shapes and bytes, in name order): the model's identity."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().to("cpu").contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def save_model(model: nn.Module, out: str | Path, tokenizer=None, extra_files: dict[str, str] | None = None) -> Path:
    """Write config.json, model.safetensors, tokenizer.json and any extra text files, atomically:
    everything goes to a temporary sibling directory that is renamed into place."""
    import shutil

    from safetensors.torch import save_file

    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.config.to_json_file(tmp / "config.json")
    save_file(
        {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()},
        tmp / "model.safetensors",
        metadata={"format": "pt"},
    )
    if tokenizer is not None:
        tokenizer.save(str(tmp / "tokenizer.json"))
    for name, text in (extra_files or {}).items():
        (tmp / name).write_text(text)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out
