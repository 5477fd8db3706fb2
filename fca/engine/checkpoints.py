"""Reading a model directory's files: `config.json` and the weights, checked against the model they
are loaded into. What every family's loader uses (`fca.engine.models`); `fca.engine.loading` picks the
family and applies device and dtype.

Weights come from `model.safetensors`, a sharded safetensors index, or a `pytorch_model.bin` read with
`weights_only=True`.
"""

from __future__ import annotations

import json
import pickle as _pickle
import warnings
from pathlib import Path

import torch
from torch import nn

from fca.tables.catalog import WEIGHT_FILES
from fca.tables.errors import ModelLoadError
from fca.tables.jsonfile import read_json


def read_config(path: Path) -> dict:
    config_path = path / "config.json"
    if not path.exists():
        raise ModelLoadError(f"{path}: model directory not found")
    if not path.is_dir():  # (it was "<file>/config.json: missing")
        raise ModelLoadError(f"{path}: a file, not a model directory")
    if not config_path.is_file():
        raise ModelLoadError(f"{config_path}: missing (a model directory needs config.json)")
    config = read_json(config_path, ModelLoadError)
    if not isinstance(config, dict):
        raise ModelLoadError(f"{config_path}: a JSON {type(config).__name__}, not an object of settings")
    return config


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """Weights from safetensors (single or sharded) or a `weights_only` torch pickle."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    single, index, pickle = (path / name for name in WEIGHT_FILES)
    try:
        if single.is_file():
            _check_readable(single)
            return load_file(single)
        if index.is_file():
            return _read_shards(path, index, weight_map(index))
        if pickle.is_file():
            _check_readable(pickle)
            with warnings.catch_warnings():  # (torch's note on a pickle's protocol, before it refuses or reads it)
                warnings.filterwarnings("ignore", "Detected pickle protocol", UserWarning)
                state = torch.load(pickle, map_location="cpu", weights_only=True)
            state = state.get("model", state) if isinstance(state, dict) else state
            if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
                raise ModelLoadError(
                    f"{pickle}: holds a {type(state).__name__}, not a state dict of tensors (name -> tensor)"
                )
            return state
    except (SafetensorError, OSError, RuntimeError, KeyError, json.JSONDecodeError, EOFError) as err:
        bad = single if single.is_file() else index if index.is_file() else pickle
        raise ModelLoadError(f"{bad}: unreadable weights ({str(err).splitlines()[0]})") from None
    except _pickle.UnpicklingError as err:  # a whole pickled module (refused by weights_only) or not a pickle
        raise ModelLoadError(
            f"{pickle}: not a weights-only state dict ({str(err).splitlines()[0][:120]}); save model.state_dict()"
        ) from None
    raise ModelLoadError(f"{path}: no weights (model.safetensors, model.safetensors.index.json or pytorch_model.bin)")


def check_safetensors_files(path: Path) -> None:
    """Refuse a model directory whose safetensors files are truncated or not safetensors at all, naming the
    file: a loader that reads them itself (transformers) reports only "incomplete metadata". Only each
    file's header is read (and checked against the file's length)."""
    from safetensors import SafetensorError, safe_open

    if (path / INDEX).is_file():
        weight_map(path / INDEX)  # its shards: files of this folder
    for file in sorted(path.glob("*.safetensors")):
        _check_readable(file)
        try:
            with safe_open(str(file), framework="pt"):
                pass
        except SafetensorError as err:
            raise ModelLoadError(f"{file}: unreadable weights ({str(err).splitlines()[0]})") from None


INDEX = WEIGHT_FILES[1]


def weight_map(index: Path) -> dict[str, str]:
    """A sharded checkpoint's `weight_map` (weight name -> shard file), each shard a file of the index's own
    folder: a model folder comes from someone else, and a shard named `../x` or `/x` would read any file."""
    value = read_json(index, ModelLoadError)
    mapping = value.get("weight_map") if isinstance(value, dict) else None
    if not isinstance(mapping, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in mapping.items()):
        raise ModelLoadError(f"{index}: no 'weight_map' of weight names to shard files")
    folder = index.parent.resolve()
    for shard in sorted(set(mapping.values())):
        if not shard or (folder / shard).resolve().parent != folder:
            raise ModelLoadError(f"{index}: names the shard {shard[:80]!r}, which is not a file of its own folder")
    return mapping


def _check_readable(file: Path) -> None:
    """Refuse a weights file this process may not open, with the system's reason: safetensors reports a
    file without read permission as "No such file or directory"."""
    try:
        file.open("rb").close()
    except OSError as err:
        raise ModelLoadError(f"{file}: unreadable weights ({err.strerror or err})") from None


def _read_shards(path: Path, index: Path, weight_map: dict[str, str]) -> dict[str, torch.Tensor]:
    """The weights a sharded checkpoint's index maps, each read from the shard the index names: a key
    the index puts in one shard and a shard that lacks it, or a shard holding a key the index does not
    put there (a stale or hand-merged shard), is refused rather than resolved by file order."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        _check_readable(path / shard)
        tensors = load_file(path / shard)
        wanted = {k for k, s in weight_map.items() if s == shard}
        lacking, stray = sorted(wanted - set(tensors)), sorted(set(tensors) - wanted)
        if lacking:
            raise ModelLoadError(f"{path / shard}: lacks {', '.join(lacking[:3])}, which {index.name} puts in it")
        if stray:
            raise ModelLoadError(
                f"{path / shard}: holds {', '.join(stray[:3])}, which {index.name} does not put in it "
                "(a stale or mixed-up shard)"
            )
        state.update(tensors)
    return state


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
        problems.append(f"misshapen {misshapen[:3]}{f' ... ({len(misshapen)} in all)' if len(misshapen) > 3 else ''}")
    # A weight of an integer or boolean type would be cast to the model's floats without a word (truncated).
    not_floats = [
        k for k, v in state.items() if k in expected and expected[k].is_floating_point() and not v.is_floating_point()
    ]
    if not_floats:
        problems.append(f"weights that are not floating point {not_floats[:5]}{' ...' if len(not_floats) > 5 else ''}")
    if problems:
        raise ModelLoadError(f"{where}: weights do not fit the config: {'; '.join(problems)}")
    model.load_state_dict({k: v.to(expected[k].dtype) for k, v in state.items()}, strict=True, assign=assign)
    return model
