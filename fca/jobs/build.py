"""Build coefficient caches: record passes of a model over token windows, written as a Parquet cache."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from fca.engine.capture import ROW_KEY_BYTES, bytes_per_token, check_embedded_ids, check_part_seqs, write_cache
from fca.engine.checkpoints import read_config
from fca.engine.environment import current_environment, model_dtype_name
from fca.engine.loading import fingerprint_state, load_model
from fca.engine.sites import model_class_name, model_logits, site_specs, vocab_rows
from fca.tables import data
from fca.tables.errors import CacheError
from fca.tables.schema import COEFFICIENT_BYTES, cache_plan, file_sha256
from fca.tables.writer import build_lock, check_cache_destination

PARQUET_SHARE = 0.855  # Parquet bytes / raw coefficient bytes (`fca bench`, demo model)


@dataclass(frozen=True)
class BuildSpec:
    """What a corpus build computes (the same for a single-process build and every Ray worker): the model,
    the corpus split, the sizes and dtypes; the cache's contents follow from it."""

    model_dir: str | Path
    corpus: str | Path
    split: str
    num_seqs: int | None = 256
    seq_len: int | None = None
    batch_size: int = 16
    device: str = "auto"
    dtype: torch.dtype | None = None
    split_seed: int = 0
    text_column: str = "text"
    coefficient_dtype: str = "float32"
    part_seqs: int | None = None  # sequences per part file (None: `seqs_per_part`)

    def __post_init__(self) -> None:  # what the files need not be read for, refused before they are
        if self.num_seqs is not None and self.num_seqs < 1 or self.batch_size < 1:
            raise ValueError(
                f"a build needs at least one sequence and a batch of at least one (got {self.num_seqs}, "
                f"{self.batch_size})"
            )
        if self.part_seqs is not None:
            check_part_seqs(self.part_seqs, self.batch_size)


def build_cache_from_corpus(
    model_dir: str | Path,
    corpus: str | Path,
    split: str,
    out: str | Path,
    overwrite: bool = False,
    progress: Callable[[int, int], None] | None = None,
    show_progress: bool = True,
    workers: int | None = None,
    **settings,
) -> Path | str:
    """Record every site's coefficients on `num_seqs` windows of one split and write them as a cache;
    `settings`: the other fields of `BuildSpec`.

    Memory does not grow with `num_seqs`: one batch is in flight while the previous one is written.
    Deterministic: the same model, corpus, split seed and sizes give the same cache contents.
    `out` may be a pyarrow filesystem URI (s3://..., file://...): parts are committed there as they are
    written, and a stopped build resumes from them; the return value is then the URI.
    """
    spec = BuildSpec(model_dir, corpus, split, **settings)
    # What the writer would refuse, refused before the model and corpus are loaded.
    check_cache_destination(out, overwrite)
    build_lock(out).check_free()  # another build writing it: said now, not after loading
    model, windows, plan = prepare_corpus_build(spec)
    if show_progress:
        from tqdm.auto import tqdm

        N, T, row_bytes = plan["num_seqs"], plan["seq_len"], plan["raw_bytes_per_token"]
        # The coefficients take about PARQUET_SHARE of their raw bytes as Parquet; the keys, sorted and
        # zstd-compressed, next to nothing.
        parquet = PARQUET_SHARE * (row_bytes - ROW_KEY_BYTES) * N * T
        tqdm.write(
            f"{out}: {N} sequences x {T} tokens x {row_bytes} B = {megabytes(row_bytes * N * T)} raw "
            f"(about {megabytes(parquet)} as Parquet)"
        )
    return write_cache(
        model,
        windows,
        out,
        plan,
        spec.batch_size,
        overwrite=overwrite,
        progress=progress,
        show_progress=show_progress,
        desc=f"cache {split}",
        workers=workers,
        part_seqs=spec.part_seqs,
    )


def megabytes(size: float) -> str:
    """A size in MB with the decimals it needs ("0.0 MB as Parquet" was said of a small cache)."""
    return f"{size / 1e6:.1f} MB" if size >= 1e6 else f"{size / 1e6:.3f} MB"


def prepare_corpus_build(spec: BuildSpec) -> tuple[nn.Module, np.ndarray, dict]:
    """The loaded model, the split's token windows [N, T + 1] and the manifest draft of a corpus build
    (shared by the single-process build and each worker of a distributed one)."""
    model_dir = Path(spec.model_dir)
    if spec.coefficient_dtype == "bfloat16" and spec.dtype != torch.bfloat16:  # (families load float32 unless asked)
        loaded = str(spec.dtype or torch.float32).replace("torch.", "")
        raise CacheError(
            f"{model_dir}: bfloat16 coefficient storage is for bfloat16 models (lossless), and this build loads "
            f"the model in {loaded} (load it with --dtype bfloat16, or store float32, or float16 if rounding is "
            "acceptable)"
        )
    config = read_config(model_dir)
    context = config.get("max_seq_len", config.get("block_size", config.get("max_position_embeddings")))
    T = spec.seq_len or int(context or 1024)
    if context is not None and T > int(context):  # refused before a writer leaves anything on disk
        raise ValueError(f"{model_dir}: windows of {T} tokens exceed the model's context of {context}")
    tokenizer = data.load_tokenizer(model_dir)
    # Found (or refused, naming the tokenizer) before the corpus is read.
    eos = data.end_of_document(tokenizer, str(model_dir / "tokenizer.json"), config.get("eos_token_id"))
    model = load_model(model_dir, device=spec.device, dtype=spec.dtype)
    specs = site_specs(model)
    if not specs:
        raise ValueError(f"{model_dir}: the model has no controller sites (a Dense twin cannot be cached)")
    corpus = Path(spec.corpus)
    windows = data.split_windows(
        corpus, spec.split, tokenizer, T, spec.split_seed, spec.num_seqs, spec.text_column, eos
    )  # [N, T + 1]
    plan = manifest_draft(
        model,
        windows,
        spec.batch_size,
        spec.coefficient_dtype,
        model_record={"path": model_dir.name, "model_type": config.get("model_type"), "config": config},
        corpus={
            "name": corpus.name,
            "fingerprint": file_sha256(corpus) if corpus.is_file() else None,
            "split": spec.split,
            "split_seed": spec.split_seed,
            "text_column": spec.text_column,
        },
        tokenizer={
            "fingerprint": file_sha256(model_dir / "tokenizer.json"),
            "vocab_size": tokenizer.get_vocab_size(),
            "end_of_document": eos,
        },
    )
    return model, windows, plan


def manifest_draft(
    model: nn.Module,
    windows: np.ndarray,
    batch_size: int,
    coefficient_dtype: str,
    model_record: dict,
    corpus: dict,
    tokenizer: dict,
) -> dict:
    """The manifest draft of a build of `model` over `windows` [N, T + 1]: sites and sizes, the model's
    record completed with its fingerprint and dtype, and the environment the coefficients are computed in."""
    specs = site_specs(model)
    return cache_plan(
        specs,
        windows.shape[1] - 1,
        len(windows),
        model={**model_record, "fingerprint": fingerprint_state(model), "dtype": model_dtype_name(model)},
        corpus=corpus,
        coefficient_dtype=coefficient_dtype,
        tokenizer=tokenizer,
        raw_bytes_per_token=bytes_per_token(specs, COEFFICIENT_BYTES[coefficient_dtype]),
        environment={**current_environment(model), "batch_size": batch_size},
    )


def build_cache(
    model: nn.Module,
    windows,
    out: str | Path,
    seq_len: int | None = None,
    split: str = "eval",
    corpus_name: str = "in-memory",
    model_name: str | None = None,
    batch_size: int = 16,
    coefficient_dtype: str = "float32",
    overwrite: bool = False,
    workers: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    show_progress: bool = False,
) -> Path:
    """A cache of any model with controller sites, held in memory (`fca.build_cache`).

    windows: token windows [N, T + 1] (each row's first T tokens are the input, its last T the targets),
    or a 1-D token stream cut into windows of `seq_len` + 1. `split` and `corpus_name` describe where
    the windows come from: an evaluated and a calibration cache must come from different splits.
    """
    if split not in data.SPLITS:  # as the CLI: the dashboard pairs an evaluated cache with its "calibration" one
        raise ValueError(f"split {split!r}: choose one of {', '.join(data.SPLITS)}")
    windows = as_windows(windows, seq_len)  # [N, T + 1]
    specs = site_specs(model)
    if not specs:
        raise ValueError(
            f"{model_class_name(model)}: the model has no controller sites (declare them with attach_sites)"
        )
    if model.training:  # refused before anything is written (record passes refuse it too, later)
        raise ValueError(f"{model_class_name(model)} is in training mode; call model.eval() before building a cache")
    config = model.config.to_dict() if hasattr(getattr(model, "config", None), "to_dict") else None
    vocab_size = _vocab_size(model, windows, out)
    # A model without a known embedding (`vocab_rows`) is held to its logits' width, before anything is
    # written; else an id beyond it fails deep in the model (on a GPU, a device assert).
    check_embedded_ids(model, windows, out)
    if vocab_rows(model) is None and (windows.min() < 0 or windows.max() >= vocab_size):
        raise ValueError(
            f"{out}: token ids from {windows.min()} to {windows.max()}, but {model_class_name(model)} predicts ids in "
            f"[0, {vocab_size}): the windows do not belong to this model"
        )
    # A window longer than the model's context (which a module held in memory does not state) otherwise failed
    # deep inside the first record pass; probed after the ids are known to fit, its failure is then the context.
    _probe(model, torch.from_numpy(windows[:1, :-1]), out)  # [1, T]
    plan = manifest_draft(
        model,
        windows,
        batch_size,
        coefficient_dtype,
        model_record={
            "path": model_name or model_class_name(model),  # (a compiled model's: the original's class)
            "model_type": (config or {}).get("model_type", model_class_name(model)),
            "config": config,
        },
        corpus={"name": corpus_name, "fingerprint": hashlib.sha256(windows.tobytes()).hexdigest(), "split": split},
        tokenizer={"fingerprint": None, "vocab_size": vocab_size},
    )
    return write_cache(
        model,
        windows,
        out,
        plan,
        batch_size,
        overwrite=overwrite,
        progress=progress,
        show_progress=show_progress,
        desc=f"cache {split}",
        workers=workers,
    )


def as_windows(tokens, seq_len: int | None = None) -> np.ndarray:
    """Token windows [N, T + 1] as int64: given as such, or cut from a 1-D stream (seq_len + 1 per window)."""
    array = np.asarray(tokens.cpu() if isinstance(tokens, torch.Tensor) else tokens)
    if not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"token windows must be integers, got {array.dtype}")
    if array.ndim == 1:
        if not seq_len:
            raise ValueError("a 1-D token stream needs seq_len to be cut into windows")
        n = (len(array) - 1) // seq_len
        if n < 1:
            raise ValueError(f"a stream of {len(array)} tokens holds no window of {seq_len} + 1")
        array = np.stack([array[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)])
    if array.ndim != 2 or array.shape[1] < 2:
        raise ValueError(f"token windows must be [N, T + 1] with T >= 1, got shape {array.shape}")
    if seq_len and array.shape[1] != seq_len + 1:  # (windows of 100 tokens and seq_len=128 made a cache of T=99)
        raise ValueError(
            f"windows of shape {array.shape} hold {array.shape[1] - 1} + 1 tokens, not seq_len + 1 = {seq_len + 1}; "
            "give windows [N, seq_len + 1], or leave seq_len out"
        )
    return np.ascontiguousarray(array, dtype=np.int64)


@torch.no_grad()
def _probe(model: nn.Module, ids: torch.Tensor, out: str | Path):
    """The model's output on `ids` [1, T], or a one-line error naming the window length it fails on."""
    try:
        return model(ids.to(next(model.parameters()).device))
    except (IndexError, RuntimeError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(
            f"{out}: {model_class_name(model)} fails on a window of {ids.shape[1]} tokens, so nothing was written "
            f"({reason}); a window longer than the model's context fails this way"
        ) from None


def _vocab_size(model: nn.Module, windows: np.ndarray, out: str | Path) -> int:
    """The model's vocabulary: its config's, else the width of its logits on a window of token 0 (an id
    every vocabulary has) as long as the windows' inputs (a model may need that many: a router that picks
    16 tokens of each sequence fails on 2)."""
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    if size:
        return int(size)
    T = windows.shape[1] - 1
    return int(model_logits(_probe(model, torch.zeros(1, T, dtype=torch.long), out), model).shape[-1])
