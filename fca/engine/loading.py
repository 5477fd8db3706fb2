"""Load and save model directories. Device, dtype and eval mode are applied once, here.

A model directory holds `config.json` (its `model_type` names the family, see `fca.engine.families`),
the weights (`model.safetensors`, a sharded safetensors index, or a `pytorch_model.bin` read with
`weights_only=True`; both read by `fca.engine.checkpoints`) and, beside them, `tokenizer.json`.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch
from torch import nn

from fca.engine.checkpoints import read_config
from fca.engine.families import Family, family_for_type, registered_families
from fca.engine.sites import unwrapped
from fca.engine.user_families import family_source
from fca.tables.errors import ModelLoadError


def load_model(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> nn.Module:
    """Any registered family with a loader, detected from `config.json`, or a transformers mixture of experts
    recognised by its modules (`fca.engine.models.hf_structure`); returned in eval mode on `device`."""
    path = Path(path)
    model_type = read_config(path).get("model_type")
    family = family_for_type(model_type)
    if family is None:
        from fca.engine.models import hf_structure

        if hf_structure.is_transformers_type(model_type):  # a transformers MoE, recognised by its modules
            family = Family(model_type, load=hf_structure.load_structural)
    if family is not None and family.load is None:
        source = family_source(model_type)
        raise ModelLoadError(
            f"{path / 'config.json'}: the family of model_type {model_type!r}"
            + (f" (declared in {source})" if source else "")
            + " has no load function: give it one (Family(..., load=...)) to load its directories"
        )
    if family is None:
        known = sorted(t for t, f in registered_families().items() if f.load is not None)
        raise ModelLoadError(
            f"{path / 'config.json'}: unsupported model_type {model_type!r} (known: {', '.join(known)}); declare its "
            "family in a Python file (FAMILY = fca.Family(...) with a load function that calls fca.attach_sites) "
            "and pass it to any command with --family FILE, as the README's 'Your own model from the shell' "
            "shows; in Python, fca.load_family_file(FILE) or fca.register_family does the same"
        )
    try:
        model = family.load(path)
    except ModelLoadError:
        raise
    except (TypeError, ValueError, RuntimeError, AttributeError, KeyError, ZeroDivisionError) as err:
        # A config whose values cannot make the model (a size as a string, a negative length, heads that
        # do not divide the width): the file and the reason, not a traceback from deep in the model.
        raise ModelLoadError(f"{path / 'config.json'}: cannot build a {model_type} model from it ({err})") from None
    if dtype is not None:
        model = cast_weights(model, dtype)
    model = model.to(resolve_device(device)).eval()
    model.fca_path = str(path)
    return model


def cast_weights(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Parameters and saved buffers to `dtype`; a floating buffer the checkpoint does not hold (a rotary
    inverse-frequency table, computed at construction) keeps its dtype, as transformers' own
    `from_pretrained(dtype=...)` leaves it. `model.to(dtype)` had rounded Mixtral's rotary frequencies to
    bfloat16: other router logits than the model its users run (4.7 radians off at position 4,095), and
    the same weights fingerprint, so nothing told the two apart."""
    derived = {
        (module, name): buffer
        for module in model.modules()
        for name, buffer in module._buffers.items()
        if name in module._non_persistent_buffers_set and buffer is not None and buffer.is_floating_point()
    }
    model = model.to(dtype)
    for (module, name), buffer in derived.items():
        module._buffers[name] = buffer
    return model


def resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError(f"device {str(device)!r} asked for, but no CUDA device is available")
    try:
        return torch.device(device)
    except RuntimeError:
        raise ModelLoadError(f"unknown device {str(device)!r}: use auto, cpu, cuda or cuda:N") from None


def fingerprint_state(model: nn.Module) -> str:
    """sha256 over the weights (names, dtypes, shapes and bytes, in name order): the model's identity.
    A compiled model's is its original module's (`unwrapped`), without the wrapper's `_orig_mod.` prefix."""
    digest = hashlib.sha256()
    for name, tensor in sorted(unwrapped(model).state_dict().items()):
        t = tensor.detach().to("cpu").contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


# What `save_model` writes into a model directory: all that replacing one may delete.
MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "training_log.json")


def is_model_file(name: str) -> bool:
    return name in MODEL_FILES


def save_model(model: nn.Module, out: str | Path, tokenizer=None, extra_files: dict[str, str] | None = None) -> Path:
    """Write config.json, model.safetensors, tokenizer.json and any extra text files, atomically:
    everything goes to a temporary sibling directory that is renamed into place. An existing `out` is
    replaced only when it is a model directory (or empty): never a cache or another folder."""
    import shutil

    from safetensors.torch import save_file

    from fca.tables.outputs import check_replaceable, created_file_mode

    out = Path(out)
    check_replaceable(out, "model", is_model_file, "config.json", overwrite=True)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.config.to_json_file(tmp / "config.json")
    save_file(
        # (a compiled model's weights under the original names, which its loader reads)
        {k: v.detach().cpu().contiguous() for k, v in unwrapped(model).state_dict().items()},
        tmp / "model.safetensors",
        metadata={"format": "pt"},
    )
    os.chmod(tmp / "model.safetensors", created_file_mode())  # (safetensors writes it 0600, unlike config.json)
    if tokenizer is not None:
        tokenizer.save(str(tmp / "tokenizer.json"))
    for name, text in (extra_files or {}).items():
        (tmp / name).write_text(text)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out
