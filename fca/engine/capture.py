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

from fca.engine.sites import as_input_ids, capture_tensors, find_sites, model_class_name, site_specs, vocab_rows
from fca.tables.errors import CacheError
from fca.tables.schema import COEFFICIENT_BYTES, cache_schema, coefficient_arrow_type, record_batch
from fca.tables.timings import Timings
from fca.tables.writer import CacheWriter


def capture(model: nn.Module, input_ids) -> dict[str, np.ndarray]:
    """Site name -> coefficients [B, T, K_s] float32, in execution order."""
    if not find_sites(model):
        raise ValueError(f"{model_class_name(model)} has no controller sites to capture")
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


ROW_KEY_BYTES = 4 * 4 + 4  # four int32 keys and the float32 live NLL


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

    versions = {
        "fca": fca.__version__,
        "torch": torch.__version__,
        "pyarrow": pyarrow.__version__,
        "transformers": transformers.__version__,
        "numpy": np.__version__,
    }
    return {"created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "library_versions": versions}


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
    used as they are (no copy, no slot).

    For a writer whose processes map shared memory (`CacheWriter.shares_memory`), each set is one block of
    that memory (on CUDA pinned in place, so the copies stay asynchronous), and on CPU the values are
    copied into it too: the writer process takes them from there, and the set is released when it has
    (`layouts[slot]` says where each tensor lies)."""

    def __init__(self, device: torch.device, writer: CacheWriter | None = None, slots: int = 2) -> None:
        self.device, self.cuda = device, device.type == "cuda"
        self.shared = writer if writer is not None and writer.shares_memory else None
        self.free: queue.Queue = queue.Queue()
        for slot in range(slots):
            self.free.put(slot)
        self.buffers: list[dict[str, torch.Tensor]] = [{} for _ in range(slots)]
        self.blocks: list[tuple | None] = [None] * slots  # shared: (block id, mapping, its bytes, pinned)
        self.layouts: list[tuple | None] = [None] * slots  # shared: (block id, name -> (offset, dtype, shape))
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

    def _shared_buffers(self, slot: int, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Host tensors shaped like `tensors`, side by side (64-byte aligned) in the slot's shared block,
        which is replaced by a larger one when too small."""
        layout, size = {}, 0
        for name, t in tensors.items():
            layout[name] = (size, str(t.dtype).removeprefix("torch."), tuple(t.shape))
            size += -(-t.numel() * t.element_size() // 64) * 64
        held = self.blocks[slot]
        if held is None or len(held[1]) < size:
            self._drop_block(slot)
            block, mapping = self.shared.shared_block(max(size, 64))
            flat = torch.frombuffer(mapping, dtype=torch.uint8)  # [bytes]
            held = self.blocks[slot] = (block, mapping, flat, self.cuda and _pin_in_place(flat, self.device))
        self.layouts[slot] = (held[0], layout)
        return {  # each tensor's bytes of the block, seen as its dtype and shape (e.g. [b, T, K])
            name: held[2][offset : offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            for (name, t), (offset, _, _) in zip(tensors.items(), layout.values())
        }

    def _drop_block(self, slot: int) -> None:
        held, self.blocks[slot] = self.blocks[slot], None
        if held is not None and held[3]:
            # A slot handed back after an error was never waited for: its copies may still be landing.
            with torch.cuda.device(self.device):  # (the build's GPU, not cuda:0's context)
                torch.cuda.synchronize(self.device)
                status = int(torch.cuda.cudart().cudaHostUnregister(held[2].data_ptr()))
            if status != 0:  # else a later kernel launch would raise it as its own failure
                _take_last_cuda_error(self.device)

    def start(
        self, tensors: dict[str, torch.Tensor], timings: Timings
    ) -> tuple[dict[str, torch.Tensor], object, int | None]:
        """-> (host tensors, event or None, slot or None). Host tensors are valid once the event completes."""
        if not self.cuda and self.shared is None:
            return tensors, None, None
        with timings("slot_wait"):  # the forward waits on the host: both sets still being taken out
            slot = self.free.get()  # blocks only while both sets are in flight
        made_for = tuple((name, t.dtype, t.shape) for name, t in tensors.items())
        if self.views[slot] is not None and self.views[slot][0] == made_for:
            host = self.views[slot][1]
        else:
            if self.shared is not None:
                host = self._shared_buffers(slot, tensors)
            else:
                host = {name: self._buffer(slot, name, t) for name, t in tensors.items()}
            self.views[slot] = (made_for, host)
        for name, t in tensors.items():
            host[name].copy_(t, non_blocking=self.cuda)
        if not self.cuda:
            return host, None, slot
        event = torch.cuda.Event()
        # On the stream the copies were queued on: a bare record() uses the current device's, which for a
        # build on cuda:1 is cuda:0's idle stream, and the event would complete before the copies land.
        event.record(torch.cuda.current_stream(self.device))
        return host, event, slot

    def release(self, slot: int | None) -> None:
        if slot is not None:
            self.free.put(slot)

    def releaser(self, slot: int) -> Callable[[], None]:
        """`release(slot)`, for whoever calls it first, once."""
        taken = []

        def release() -> None:
            if not taken:
                taken.append(slot)
                self.free.put(slot)

        return release

    def close(self, raise_errors: bool = True) -> None:
        """Unpin and drop the shared blocks (a writer process may still be reading one: its mapping stays).
        Every block is dropped even when one fails; on the way out of an error (`raise_errors=False`) a
        failure here (a CUDA error outliving the one being raised, say) does not hide that one."""
        self.views = [None] * len(self.views)
        failures = []
        for slot in range(len(self.blocks)):
            try:
                self._drop_block(slot)
            except Exception as e:
                failures.append(e)
        if failures and raise_errors:
            raise failures[0]


def hand_over(writer: CacheWriter, copies: HostCopies, windows: np.ndarray, lo: int, hi: int, event, slot: int) -> None:
    """Sequences [lo, hi) of `windows` [N, T + 1], whose values `copies` put in the shared block of `slot`:
    once their copies have landed (`event`), a writer process is told where they are, and the slot is
    released when it has copied them out."""
    free = copies.releaser(slot)
    try:
        if event is not None:
            with writer.timings("copy_wait"):  # the GPU has not finished this batch and its copies
                event.synchronize()
    except BaseException:
        free()
        raise
    with writer.timings("collect"):
        block, layout = copies.layouts[slot]
        sites_at = {name: at for name, at in layout.items() if name != NLL_KEY}
        writer.write_shared(lo, hi - lo, windows[lo:hi], block, layout[NLL_KEY], sites_at, free)


_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every device's context, not one


def _pin_in_place(flat: torch.Tensor, device: torch.device) -> bool:
    """Page-lock host memory torch did not allocate (a shared block), so that copies into it are
    asynchronous; False if CUDA refuses (the copies are then synchronous, the values the same)."""
    with torch.cuda.device(device):
        try:
            status = int(torch.cuda.cudart().cudaHostRegister(flat.data_ptr(), flat.numel(), _HOST_REGISTER_PORTABLE))
        except Exception:
            return False
        if status != 0:
            _take_last_cuda_error(device)
        return status == 0


def _take_last_cuda_error(device: torch.device) -> None:
    """A refused cudaHostRegister stays this thread's last CUDA error, which torch reads after its next
    kernel launch and raises as that kernel's failure. One throwaway launch takes it: torch clears the
    error as it raises."""
    try:
        torch.zeros(1, device=device).add_(1)
        torch.cuda.synchronize(device)
    except RuntimeError:
        pass


class _BackgroundWriter:
    """Runs `write(*item)` on a thread, at most two items waiting, so memory stays bounded. The first
    error is raised in the caller's thread at the next `submit` or at `close`; after it, items are
    passed to `discard(*item)` instead (so that, e.g., their pinned buffers are released)."""

    def __init__(
        self, write: Callable[..., None], discard: Callable[..., None] | None = None, device: torch.device | None = None
    ) -> None:
        self.pending: queue.Queue = queue.Queue(maxsize=2)
        self.failure: list[BaseException] = []
        self.write = write
        self.discard = discard
        self.device = device
        self.thread = threading.Thread(target=self._loop, name="fca-cache-collector", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        if self.device is not None and self.device.type == "cuda":
            # A new thread's current device is cuda:0: its first CUDA call (an event's wait) would make a
            # context there, for a build on cuda:1.
            torch.cuda.set_device(self.device)
        while (item := self.pending.get()) is not None:
            try:
                if self.failure:
                    if self.discard is not None:
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
    writer_processes: bool = False,
) -> Path:
    """Record passes over `windows` [N, T + 1], written part by part by `workers` writer threads.

    `plan` is the manifest draft (it must hold `sites`, `seq_len`, `num_seqs`, `coefficient_dtype`).
    `workers`: writer threads (None: `default_writers`; 1 writes in the forward's thread on CPU).
    The cache's contents do not depend on `workers`. A resumed build redoes the incomplete parts.
    `timings`: filled with the seconds each stage took (fca.tables.timings), for benches.
    `part_seqs`: sequences per part file (None: `seqs_per_part`); a multiple of `batch_size`.
    `writer_processes`: the writers are processes (`fca.tables.writer_processes`), for a forward pass the
    writer threads would slow by holding the interpreter lock (a small model on a GPU); the same cache.

    On CUDA the coefficients go to two reused sets of pinned host buffers by non-blocking copies; a
    collector thread waits for each copy, takes the values out and hands them to the writer, so the
    forward pass waits on the host only when both buffer sets are still in flight.
    """
    from tqdm.auto import tqdm

    specs = site_specs(model)
    N, T = len(windows), windows.shape[1] - 1
    if N < 1 or batch_size < 1:
        raise ValueError(
            f"{out}: a build needs at least one window and a batch of at least one (got {N}, {batch_size})"
        )
    check_embedded_ids(model, windows, out)  # before anything is written
    coefficient_dtype = plan.get("coefficient_dtype", "float32")
    schema = cache_schema(specs, coefficient_arrow_type(coefficient_dtype))
    parameter = next(model.parameters())
    device_ = parameter.device
    if coefficient_dtype == "bfloat16" and parameter.dtype != torch.bfloat16:
        raise CacheError(
            f"{out}: bfloat16 coefficient storage is for bfloat16 models (lossless); this model is "
            f"{str(parameter.dtype).replace('torch.', '')} (store float32, or float16 if rounding is "
            "acceptable)"
        )
    row_bytes = bytes_per_token(specs, COEFFICIENT_BYTES[coefficient_dtype])
    workers = default_writers(device_) if workers is None else max(1, int(workers))
    spread = N if spreads_parts(device_.type) else None
    part_seqs = part_seqs or seqs_per_part(row_bytes, T, batch_size, spread, num_slots(specs))
    check_part_seqs(part_seqs, batch_size)
    writer = CacheWriter(
        out, plan, schema, part_seqs, overwrite=overwrite, workers=workers, timings=timings, processes=writer_processes
    )
    if writer.started_over and show_progress:
        tqdm.write(writer.started_over, file=sys.stderr)
    done = writer.done_seqs
    if done and desc:  # a resumed build says so, beside the sequences its earlier run had written
        desc = f"{desc} (resumed: {done} done before)"
    bar = tqdm(total=N, initial=done, unit="seq", desc=desc, disable=not show_progress)

    def step(n: int) -> None:
        nonlocal done
        done += n
        bar.update(n)
        if progress is not None:
            progress(done, N)

    try:
        record_pending(model, windows, writer, batch_size, coefficient_dtype, step)
    finally:
        bar.close()
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
    copies = HostCopies(device_, writer)

    def write_batch(lo: int, hi: int, host: dict[str, torch.Tensor], event, slot) -> None:
        if copies.shared is not None:
            return hand_over(writer, copies, windows, lo, hi, event, slot)
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
        copies.close()  # (inside: a late CUDA error surfacing here still aborts the writer and its lock)
    except BaseException:
        try:
            if background is not None:
                background.close(raise_errors=False)
            writer.abort()
        finally:  # the pinned blocks are let go even when the clean-up itself fails or is interrupted
            copies.close(raise_errors=False)
        raise
