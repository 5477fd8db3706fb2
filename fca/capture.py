"""Record passes: collect every site's coefficients, in memory (`capture`) or into a cache on disk
(`build_cache`, streaming: a writer thread turns each batch into Parquet while the next one runs)."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from . import data
from .loading import fingerprint_state, load_model, read_config
from .sites import capture_tensors, find_sites, site_specs
from .store import (
    CacheWriter,
    cache_plan,
    cache_schema,
    coefficient_arrow_type,
    file_sha256,
    record_batch,
)


def as_input_ids(input_ids, model: nn.Module) -> torch.Tensor:
    """Token ids [B, T] as a long tensor on the model's device."""
    device = next(model.parameters()).device
    ids = torch.as_tensor(np.asarray(input_ids) if not isinstance(input_ids, torch.Tensor) else input_ids)
    if ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, positions], got shape {tuple(ids.shape)}")
    return ids.to(device=device, dtype=torch.long)


def capture(model: nn.Module, input_ids) -> dict[str, np.ndarray]:
    """Site name -> coefficients [B, T, K_s] float32, in execution order."""
    if not find_sites(model):
        raise ValueError(f"{type(model).__name__} has no controller sites to capture")
    _, coefficients = capture_tensors(model, as_input_ids(input_ids, model))
    return {name: c.float().cpu().numpy() for name, c in coefficients.items()}


# ---------------------------------------------------------------------------------------------
# Cache builder: windows -> record passes -> Parquet parts, streamed.

TARGET_PART_BYTES = 128 * 2**20  # raw bytes per part file before compression


def bytes_per_token(specs, coefficient_bytes: int = 4) -> int:
    """Raw bytes one row occupies: four int32 keys, the float32 live NLL, and every site's channels."""
    return 4 * 4 + 4 + coefficient_bytes * sum(s.num_channels for s in specs.values())


def _library_versions() -> dict:
    import pyarrow
    import transformers

    return {"fca": "0.1.0", "torch": torch.__version__, "pyarrow": pyarrow.__version__, "transformers": transformers.__version__, "numpy": np.__version__}


@torch.no_grad()
def record_windows(model: nn.Module, windows: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One record pass over windows [b, T + 1] (on the model's device).

    Returns per-token live NLL [b, T] and site -> coefficients [b, T, K_s], still on the device.
    """
    logits, coefficients = capture_tensors(model, windows[:, :-1])
    return token_nll(logits, windows[:, 1:]), coefficients


def token_nll(logits: torch.Tensor, targets: torch.Tensor, rows_per_chunk: int = 512) -> torch.Tensor:
    """Per-token NLL [b, T] from logits [b, T, V]. In chunks of rows: the log-softmax temporaries stay a
    few MB instead of the size of the logits (allocating those cost more than the arithmetic)."""
    flat, flat_targets = logits.flatten(0, 1), targets.flatten()
    parts = [F.cross_entropy(chunk.float(), t, reduction="none") for chunk, t in zip(flat.split(rows_per_chunk), flat_targets.split(rows_per_chunk))]
    return torch.cat(parts).view(targets.shape)


class _HostCopies:
    """Device -> host copies that do not stall the GPU: pinned buffers and non-blocking copies, whose
    completion a writer thread waits for (on CPU the tensors are used as they are)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def start(self, tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], object]:
        if not self.cuda:
            return tensors, None
        host = {}
        for name, t in tensors.items():
            buf = torch.empty(t.shape, dtype=torch.float32, pin_memory=True)
            buf.copy_(t, non_blocking=True)
            host[name] = buf
        event = torch.cuda.Event()
        event.record()
        return host, event


class _BackgroundWriter:
    """Runs `write(*item)` on a thread, at most two items waiting, so memory stays bounded. The first
    error is raised in the caller's thread at the next `submit` or at `close`."""

    def __init__(self, write: Callable[..., None]) -> None:
        self.pending: queue.Queue = queue.Queue(maxsize=2)
        self.failure: list[BaseException] = []
        self.write = write
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while (item := self.pending.get()) is not None:
            if self.failure:
                continue
            try:
                self.write(*item)
            except BaseException as err:
                self.failure.append(err)

    def submit(self, *item) -> None:
        if self.failure:
            raise self.failure[0]
        self.pending.put(item)

    def close(self, raise_errors: bool = True) -> None:
        self.pending.put(None)
        self.thread.join()
        if raise_errors and self.failure:
            raise self.failure[0]


def build_cache(
    model_dir: str | Path,
    corpus: str | Path,
    split: str,
    out: str | Path,
    num_seqs: int | None = 256,
    seq_len: int | None = None,
    batch_size: int = 16,
    device: str = "auto",
    dtype: torch.dtype | None = None,
    split_seed: int = 0,
    text_column: str = "text",
    coefficient_dtype: str = "float32",
    overwrite: bool = False,
    progress: Callable[[int, int], None] | None = None,
    show_progress: bool = True,
) -> Path:
    """Record every site's coefficients on `num_seqs` windows of one split and write them as a cache.

    Memory does not grow with `num_seqs`: one batch is in flight while the previous one is written.
    Deterministic: the same model, corpus, split seed and sizes give the same cache contents.
    """
    model_dir = Path(model_dir)
    model = load_model(model_dir, device=device, dtype=dtype)
    specs = site_specs(model)
    if not specs:
        raise ValueError(f"{model_dir}: the model has no controller sites (a Dense twin cannot be cached)")
    config = read_config(model_dir)
    T = seq_len or int(config.get("max_seq_len", config.get("block_size", 1024)))
    tokenizer = data.load_tokenizer(model_dir)
    windows = data.split_windows(corpus, split, tokenizer, T, split_seed, num_seqs, text_column)  # [N, T + 1]
    N = len(windows)
    row_bytes = bytes_per_token(specs, 2 if coefficient_dtype == "float16" else 4)
    plan = cache_plan(
        specs, T, N,
        model={"path": model_dir.name, "model_type": config.get("model_type"), "fingerprint": fingerprint_state(model),
               "config": config, "dtype": str(next(model.parameters()).dtype).replace("torch.", "")},
        corpus={"name": Path(corpus).name, "fingerprint": file_sha256(Path(corpus)) if Path(corpus).is_file() else None,
                "split": split, "split_seed": split_seed, "text_column": text_column},
        coefficient_dtype=coefficient_dtype,
        tokenizer={"fingerprint": file_sha256(model_dir / "tokenizer.json"), "vocab_size": tokenizer.get_vocab_size()},
        raw_bytes_per_token=row_bytes,
    )
    if show_progress:
        from tqdm.auto import tqdm

        tqdm.write(f"{out}: {N} sequences x {T} tokens x {row_bytes} B = {row_bytes * N * T / 1e6:.1f} MB raw "
                   f"(about {0.85 * row_bytes * N * T / 1e6:.1f} MB as Parquet)")
    return write_cache(model, windows, out, plan, batch_size, overwrite=overwrite, progress=progress, show_progress=show_progress,
                       desc=f"cache {split}")


def write_cache(
    model: nn.Module,
    windows: np.ndarray,
    out: str | Path,
    plan: dict,
    batch_size: int = 16,
    overwrite: bool = False,
    progress: Callable[[int, int], None] | None = None,
    show_progress: bool = False,
    desc: str = "cache",
) -> Path:
    """Record passes over `windows` [N, T + 1], written part by part by a background thread.

    `plan` is the manifest draft (it must hold `sites`, `seq_len`, `num_seqs`, `coefficient_dtype`).
    """
    from tqdm.auto import tqdm

    specs = site_specs(model)
    N, T = len(windows), windows.shape[1] - 1
    row_bytes = bytes_per_token(specs, 2 if plan.get("coefficient_dtype") == "float16" else 4)
    seqs_per_part = max(batch_size, TARGET_PART_BYTES // (row_bytes * T) // batch_size * batch_size)
    schema = cache_schema(specs, coefficient_arrow_type(plan.get("coefficient_dtype", "float32")))
    writer = CacheWriter(out, plan, schema, seqs_per_part, overwrite=overwrite)
    start = writer.done_seqs
    device_ = next(model.parameters()).device
    copies = _HostCopies(device_)
    def write_batch(lo: int, hi: int, host: dict[str, torch.Tensor], event) -> None:
        if event is not None:
            event.synchronize()  # the non-blocking device -> host copies have landed
        nll = host.pop("__nll__").numpy()
        writer.write(record_batch(schema, np.arange(lo, hi), windows[lo:hi, :-1], windows[lo:hi, 1:], nll, {k: v.numpy() for k, v in host.items()}), hi - lo)

    # On CUDA a writer thread turns batch n into Parquet while the GPU runs batch n + 1. On CPU such a
    # thread would only take a core from the forward pass, so batches are written inline.
    background = _BackgroundWriter(write_batch) if device_.type == "cuda" else None
    bar = tqdm(total=N, initial=start, unit="seq", desc=desc, disable=not show_progress)
    try:
        for lo in range(start, N, batch_size):
            hi = min(N, lo + batch_size)
            batch = torch.from_numpy(windows[lo:hi]).to(device_)
            nll, coefficients = record_windows(model, batch)
            coefficients = {k: v.float() for k, v in coefficients.items()}
            coefficients["__nll__"] = nll
            host, event = copies.start(coefficients)
            host = {k: v.cpu() for k, v in host.items()}
            if background is not None:
                background.submit(lo, hi, host, event)
            else:
                write_batch(lo, hi, host, event)
            bar.update(hi - lo)
            if progress is not None:
                progress(hi, N)
        if background is not None:
            background.close()
    except BaseException:
        if background is not None:
            background.close(raise_errors=False)
        writer.abort()
        raise
    finally:
        bar.close()
    return writer.finish({"created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "library_versions": _library_versions()})
