"""Record passes: collect every site's coefficients, in memory (`capture`) or into a cache on disk
(`build_cache_from_corpus`, streaming: writer threads turn batches into Parquet while the next one runs)."""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fca.engine.sites import as_input_ids, capture_tensors, model_class_name, vocab_rows
from fca.tables.errors import CacheError
from fca.tables.schema import COEFFICIENT_BYTES, cache_schema, coefficient_arrow_type, record_batch, spec_from_json
from fca.tables.timings import Timings
from fca.tables.writer import CacheWriter


def capture(model: nn.Module, input_ids) -> dict[str, np.ndarray]:
    """Site name -> coefficients [B, T, K_s] float32, in execution order."""
    _, coefficients = capture_tensors(model, as_input_ids(input_ids, model))
    return {name: c.float().cpu().numpy() for name, c in coefficients.items()}


# ---------------------------------------------------------------------------------------------
# Cache builder: windows -> record passes -> Parquet parts, streamed.

# Raw bytes per part file before compression. Parts are the unit the writer threads share out, so a
# few tens of MB keeps them balanced on a build of a few hundred MB while files stay a sensible size.
TARGET_PART_BYTES = 32 * 2**20
# A CUDA build of fewer than SPREAD_PARTS target parts is cut into this many smaller ones, so that every
# writer thread has work (default_writers is at most this).
SPREAD_PARTS = 8
# A part holds at least this many times the bytes of its moments sidecar, whose per-position sums take
# 8 x T x C bytes whatever the part's size: at the target size alone, a MUDDPythia-1.4B part (8 x 1,024
# tokens, C = 1,221) carried a 10 MB sidecar beside 37 MB of Parquet, and a Qwen3-MoE-30B-A3B part (one
# sequence, C = 6,144) a 50 MB sidecar for 25 MB of coefficients.
MOMENTS_SHARE = 8
NLL_KEY = "__nll__"


def num_slots(specs) -> int:
    """C: the channels of all sites, side by side."""
    return sum(s.num_channels for s in specs.values())


ROW_KEY_BYTES = sum(f.type.byte_width for f in cache_schema({}))  # the key columns and live NLL of a row


def check_embedded_ids(model: nn.Module, windows: np.ndarray, out: str | Path) -> None:
    """Refuse windows [N, T + 1] holding ids the model's embedding does not have (a model whose embedding
    is not known is not checked here): they would fail deep inside the model, on a GPU as a device assert."""
    vocab = vocab_rows(model)
    if vocab is not None and (windows.min() < 0 or windows.max() >= vocab):
        raise ValueError(
            f"{out}: token ids from {windows.min()} to {windows.max()}, but {model_class_name(model)} embeds ids in "
            f"[0, {vocab}): the tokenizer (or the windows) do not belong to this model"
        )


def bytes_per_token(specs, coefficient_bytes: int = 4) -> int:
    """Raw bytes one row occupies: its keys and live NLL (ROW_KEY_BYTES), and every site's channels."""
    return ROW_KEY_BYTES + coefficient_bytes * num_slots(specs)


def seqs_per_part(
    row_bytes: int, seq_len: int, batch_size: int, spread_over: int | None = None, num_slots: int = 0
) -> int:
    """Sequences per part file: about TARGET_PART_BYTES raw, and at least MOMENTS_SHARE times the part's
    moments sidecar (`num_slots`: the C channels of all sites); a multiple of the batch size so that part
    boundaries fall between record batches (a resumed build redoes whole batches, as a fresh one).
    `spread_over`: the build's number of sequences, for a build whose parts are written by several
    threads or actors (`spreads_parts`): its parts are then also small enough for it to have
    SPREAD_PARTS of them where batches allow, since a cache smaller than one target part would otherwise
    be encoded by one writer while the others wait. Never the number of writers: the layout is the same
    for any number of them."""
    seq_bytes = row_bytes * seq_len
    by_target = TARGET_PART_BYTES // seq_bytes // batch_size * batch_size
    by_moments = -(-MOMENTS_SHARE * 8 * seq_len * num_slots // seq_bytes)  # ceil, then up to whole batches
    by_size = max(batch_size, by_target, -(-by_moments // batch_size) * batch_size)
    if spread_over is None:
        return by_size
    share = -(-spread_over // SPREAD_PARTS)  # ceil(num_seqs / SPREAD_PARTS), then up to whole batches
    return min(by_size, max(batch_size, -(-share // batch_size) * batch_size))


def spreads_parts(device_type: str) -> bool:
    """Whether a build on this device spreads a small cache over SPREAD_PARTS parts: on CUDA, where writer
    threads (or actors) encode beside the GPU. On a CPU one writer works inline, and more parts would only
    add their fixed costs (8 parts instead of 1 made a demo build 2.5% slower on 2 cores). Both engines
    decide the same way, so their parts stay byte for byte the same."""
    return device_type == "cuda"


def build_writer(
    out: str | Path, plan: dict, batch_size: int, device_type: str, part_seqs: int | None, show_progress: bool, **kwargs
) -> CacheWriter:
    """The `CacheWriter` (`kwargs`: its options) of a build of `plan` on `device_type`, in parts of `part_seqs`
    sequences (None: `seqs_per_part`): both engines open their writer here, so that their parts are the same
    byte for byte. A build cleared instead of resumed says why when `show_progress`."""
    from tqdm.auto import tqdm

    coefficient_dtype = plan.get("coefficient_dtype", "float32")
    specs = {name: spec_from_json(d) for name, d in plan["sites"].items()}
    schema = cache_schema(specs, coefficient_arrow_type(coefficient_dtype))
    row_bytes = bytes_per_token(specs, COEFFICIENT_BYTES[coefficient_dtype])
    spread = plan["num_seqs"] if spreads_parts(device_type) else None
    part_seqs = part_seqs or seqs_per_part(row_bytes, plan["seq_len"], batch_size, spread, num_slots(specs))
    check_part_seqs(part_seqs, batch_size)
    writer = CacheWriter(out, plan, schema, part_seqs, **kwargs)
    if writer.started_over and show_progress:
        tqdm.write(writer.started_over, file=sys.stderr)
    return writer


def check_part_seqs(part_seqs: int, batch_size: int) -> None:
    """Part boundaries must fall between batches: a part is recorded in batches from its first sequence, so
    any other size would change batch composition (and the bits) between a fresh and a resumed build."""
    if part_seqs < 1 or part_seqs % batch_size:
        raise ValueError(f"sequences per part ({part_seqs}) must be a positive multiple of the batch ({batch_size})")


def default_writers(device: torch.device) -> int:
    """Writer threads for a build: on CUDA the host cores are idle while the GPU computes, so several,
    leaving two cores to the forward's launching thread and the collector (at most SPREAD_PARTS; on one
    H200's 16 host cores, 8 writers encoded 1.6x as fast as 4); on CPU one, inline, since the forward pass
    needs every core."""
    return min(SPREAD_PARTS, max(2, (os.cpu_count() or 1) - 2)) if device.type == "cuda" else 1


def finish_stamp() -> dict:
    """What a finished cache's manifest says of its making: creation time and library versions."""
    import pyarrow
    import transformers

    import fca

    versions = {module.__name__: module.__version__ for module in (fca, torch, pyarrow, transformers, np)}
    return {"created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "library_versions": versions}


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
    parts = [
        F.cross_entropy(chunk.float(), t, reduction="none")
        for chunk, t in zip(flat.split(rows_per_chunk), flat_targets.split(rows_per_chunk))
    ]
    return torch.cat(parts).view(targets.shape)


class HostCopies:
    """Device -> host copies that do not stall the GPU: two sets of pinned buffers, reused in turn
    (double buffering), filled by non-blocking copies whose completion an event reports.

    `start` waits only when both sets are still in flight (not yet `release`d by the writer side); the
    writer waits on the event, copies the values out and releases the set. On CPU the tensors are
    used as they are (no copy, no slot)."""

    def __init__(self, device: torch.device, slots: int = 2) -> None:
        self.device, self.cuda = device, device.type == "cuda"
        self.free: queue.Queue = queue.Queue()
        for slot in range(slots):
            self.free.put(slot)
        self.buffers: list[dict[str, torch.Tensor]] = [{} for _ in range(slots)]
        # Per slot, the host tensors of its last batch and what they were made for ((name, dtype, shape)
        # each): every batch but a part's last has the same shapes, and making ~3 views per site costs the
        # host a few microseconds each, per batch.
        self.views: list[tuple | None] = [None] * slots

    def _buffer(self, slot: int, name: str, t: torch.Tensor) -> torch.Tensor:
        """A pinned host tensor shaped like `t`: a view of the slot's buffer, grown when too small."""
        buf = self.buffers[slot].get(name)
        if buf is None or buf.dtype != t.dtype or buf.numel() < t.numel():
            with torch.cuda.device(self.device):  # pinned by the build's GPU, not by cuda:0's context
                buf = self.buffers[slot][name] = torch.empty(t.numel(), dtype=t.dtype, pin_memory=True)
        return buf[: t.numel()].view(t.shape)

    def start(
        self, tensors: dict[str, torch.Tensor], timings: Timings
    ) -> tuple[dict[str, torch.Tensor], object, int | None]:
        """-> (host tensors, event or None, slot or None). Host tensors are valid once the event completes."""
        if not self.cuda:
            return tensors, None, None
        with timings("slot_wait"):  # the forward waits on the host: both sets still being taken out
            slot = self.free.get()  # blocks only while both sets are in flight
        made_for = tuple((name, t.dtype, t.shape) for name, t in tensors.items())
        if self.views[slot] is not None and self.views[slot][0] == made_for:
            host = self.views[slot][1]
        else:
            host = {name: self._buffer(slot, name, t) for name, t in tensors.items()}
            self.views[slot] = (made_for, host)
        for name, t in tensors.items():
            host[name].copy_(t, non_blocking=True)
        event = torch.cuda.Event()
        # On the stream the copies were queued on: a bare record() uses the current device's, which for a
        # build on cuda:1 is cuda:0's idle stream, and the event would complete before the copies land.
        event.record(torch.cuda.current_stream(self.device))
        return host, event, slot

    def release(self, slot: int | None) -> None:
        if slot is not None:
            self.free.put(slot)


class _BackgroundWriter:
    """Runs `write(*item)` on a thread of CUDA `device`, at most two items waiting, so memory stays bounded.
    The first error is raised in the caller's thread at the next `submit` or at `close`; after it, items
    are passed to `discard(*item)` instead (so that, e.g., their pinned buffers are released)."""

    def __init__(self, write: Callable[..., None], discard: Callable[..., None], device: torch.device) -> None:
        self.pending: queue.Queue = queue.Queue(maxsize=2)
        self.failure: list[BaseException] = []
        self.write = write
        self.discard = discard
        self.device = device
        self.thread = threading.Thread(target=self._loop, name="fca-cache-collector", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        # A new thread's current device is cuda:0: its first CUDA call (an event's wait) would make a
        # context there, for a build on cuda:1.
        torch.cuda.set_device(self.device)
        while (item := self.pending.get()) is not None:
            try:
                if self.failure:
                    self.discard(*item)
                    continue
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


def _storage_tensor(t: torch.Tensor, coefficient_dtype: str, site: str) -> torch.Tensor:
    """A site's coefficients [b, T, K] in the stored type, converted on their device (so a 16-bit cache
    also halves the device -> host copy). bfloat16 storage keeps the raw bits (as int16), and only of
    bfloat16 values: it is lossless or refused."""
    if coefficient_dtype == "bfloat16":
        if t.dtype != torch.bfloat16:
            raise CacheError(
                f"site {site}: bfloat16 storage keeps bfloat16 coefficients bit for bit, but this site "
                f"computes {str(t.dtype).replace('torch.', '')} (store float32, or float16 if rounding is "
                "acceptable)"
            )
        return t.view(torch.int16)
    return t.half() if coefficient_dtype == "float16" else t.float()


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
    workers: int | None = None,
    part_seqs: int | None = None,
    timings: Timings | None = None,
) -> Path:
    """Record passes over `windows` [N, T + 1], written part by part by `workers` writer threads.

    `plan` is the manifest draft (it must hold `sites`, `seq_len`, `num_seqs`, `coefficient_dtype`).
    `workers`: writer threads (None: `default_writers`; 1 writes in the forward's thread on CPU).
    The cache's contents do not depend on `workers`. A resumed build redoes the incomplete parts.
    `timings`: filled with the seconds each stage took (fca.tables.timings), for benches.
    `part_seqs`: sequences per part file (None: `seqs_per_part`); a multiple of `batch_size`.

    On CUDA the coefficients go to two reused sets of pinned host buffers by non-blocking copies; a
    collector thread waits for each copy, takes the values out and hands them to the writer, so the
    forward pass waits on the host only when both buffer sets are still in flight.
    """
    from tqdm.auto import tqdm

    N = len(windows)
    if N < 1 or batch_size < 1:
        raise ValueError(
            f"{out}: a build needs at least one window and a batch of at least one (got {N}, {batch_size})"
        )
    check_embedded_ids(model, windows, out)  # before anything is written
    coefficient_dtype = plan.get("coefficient_dtype", "float32")
    parameter = next(model.parameters())
    device_ = parameter.device
    if coefficient_dtype == "bfloat16" and parameter.dtype != torch.bfloat16:
        raise CacheError(
            f"{out}: bfloat16 coefficient storage is for bfloat16 models (lossless); this model is "
            f"{str(parameter.dtype).replace('torch.', '')} (store float32, or float16 if rounding is "
            "acceptable)"
        )
    workers = default_writers(device_) if workers is None else max(1, int(workers))
    options = {"overwrite": overwrite, "workers": workers, "timings": timings}
    writer = build_writer(out, plan, batch_size, device_.type, part_seqs, show_progress, **options)
    done = writer.done_seqs
    if done and desc:  # a resumed build says so, beside the sequences its earlier run had written
        desc = f"{desc} (resumed: {done} done before)"

    def step(n: int) -> None:
        nonlocal done
        done += n
        bar.update(n)
        if progress is not None:
            progress(done, N)

    with tqdm(total=N, initial=done, unit="seq", desc=desc, disable=not show_progress) as bar:
        record_pending(model, windows, writer, batch_size, coefficient_dtype, step)
    return writer.finish(finish_stamp())


def record_pending(
    model: nn.Module,
    windows: np.ndarray,
    writer: CacheWriter,
    batch_size: int,
    coefficient_dtype: str = "float32",
    step: Callable[[int], None] | None = None,
) -> None:
    """Record passes over the writer's pending parts of `windows` [N, T + 1], in batches of `batch_size`
    from each part's first sequence (so batch composition is that of a single-process build), handed
    to `writer`. Does not finish the writer (a shard writer's caller closes it); aborts it on error.
    `step(n)` is called after each batch of n sequences."""
    schema, timings = writer.schema, writer.timings
    device_ = next(model.parameters()).device
    copies = HostCopies(device_)

    def write_batch(lo: int, hi: int, host: dict[str, torch.Tensor], event, slot) -> None:
        try:
            if event is not None:
                with timings("copy_wait"):  # the GPU has not finished this batch and its copies
                    event.synchronize()  # the non-blocking device -> host copies have landed
            with timings("collect"):
                arrays = {k: v.numpy() for k, v in host.items()}
                if slot is not None:  # pinned buffers are reused for batch n + 2: take the values out first
                    arrays = {k: a.copy() for k, a in arrays.items()}
        finally:
            copies.release(slot)
        with timings("collect"):
            nll = arrays.pop(NLL_KEY)
            rows = record_batch(schema, np.arange(lo, hi), windows[lo:hi, :-1], windows[lo:hi, 1:], nll, arrays)
        writer.write(rows, hi - lo)

    # On CUDA a collector thread takes batch n off the pinned buffers (and, with one writer, encodes it)
    # while the GPU runs batch n + 1. On CPU the batch is handed over inline: with one writer it is
    # encoded in this thread, since a writer thread would only take a core from the forward pass.
    background = (
        _BackgroundWriter(write_batch, discard=lambda lo, hi, host, event, slot: copies.release(slot), device=device_)
        if device_.type == "cuda"
        else None
    )
    try:
        for first, last in writer.pending_ranges():
            for lo in range(first, last, batch_size):
                hi = min(last, lo + batch_size)
                with timings("record"):  # on CUDA, the time to queue the pass (the GPU runs behind)
                    batch = torch.from_numpy(windows[lo:hi]).to(device_)
                    nll, coefficients = record_windows(model, batch)
                    tensors = {k: _storage_tensor(v, coefficient_dtype, k) for k, v in coefficients.items()}
                    tensors[NLL_KEY] = nll.float()
                host, event, slot = copies.start(tensors, timings)
                if background is not None:
                    with timings("submit_wait"):  # the collector is two batches behind
                        background.submit(lo, hi, host, event, slot)
                else:
                    write_batch(lo, hi, host, event, slot)
                if step is not None:
                    step(hi - lo)
        if background is not None:
            background.close()
    except BaseException:
        if background is not None:
            background.close(raise_errors=False)
        writer.abort()
        raise
