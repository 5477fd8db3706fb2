"""Corpora -> documents -> deterministic splits -> a BPE tokenizer -> fixed-length token windows.

A corpus is a local path, one of:
- a text file: documents are separated by blank lines;
- a folder: every `*.txt` / `*.md` file below it (sorted) is one document;
- a Parquet or Arrow/Feather file (or a folder of Parquet files) with a text column: one row, one document.

Documents are assigned to the train / calibration / eval splits by a seeded permutation, so the
splits never overlap and are the same on every machine for the same seed and corpus.
"""

from __future__ import annotations

import itertools
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from fca.tables.errors import CorpusError, ModelLoadError
from fca.tables.outputs import OVERWRITE_HINT, check_output, write_output

SPLITS = ("train", "calibration", "eval")
SPLIT_FRACTIONS = {"train": 0.9, "calibration": 0.05, "eval": 0.05}
EOS = "<|endoftext|>"
# The end-of-document tokens of common tokenizers, the first one a tokenizer has is used: ours and
# GPT-NeoX's / Qwen's, Llama's and Mistral's (Mixtral), Llama 3's, Gemma's.
EOS_CANDIDATES = (EOS, "</s>", "<|end_of_text|>", "<eos>")
TEXT_SUFFIXES = (".txt", ".md")
TABLE_SUFFIXES = (".parquet", ".arrow", ".feather", ".ipc")


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise CorpusError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    except OSError as err:
        raise CorpusError(f"{path}: cannot read ({err.strerror})") from None


def _read_table_texts(path: Path, text_column: str) -> list[str]:
    import pyarrow as pa
    import pyarrow.dataset as ds

    fmt = "parquet" if path.is_dir() or path.suffix == ".parquet" else "ipc"
    try:
        dataset = ds.dataset(path, format=fmt)
    except Exception as err:  # pyarrow raises several types for unreadable files
        raise CorpusError(f"{path}: not a readable {fmt} dataset ({err})") from None
    if text_column not in dataset.schema.names:
        raise CorpusError(f"{path}: no column {text_column!r} (columns: {', '.join(dataset.schema.names)})")
    kind = dataset.schema.field(text_column).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise CorpusError(f"{path}: column {text_column!r} holds {kind}, not text")
    return [t for t in dataset.to_table(columns=[text_column]).column(text_column).to_pylist() if t and t.strip()]


def load_documents(path: str | Path, text_column: str = "text") -> list[str]:
    """Read a local corpus into a list of non-empty documents: a table's `text_column`, or plain text (a
    file of blank-line-separated documents, or a folder of files)."""
    path = Path(path)
    if not path.exists():
        raise CorpusError(f"{path}: corpus not found")
    is_table = path.suffix in TABLE_SUFFIXES or (path.is_dir() and any(path.rglob("*.parquet")))
    if text_column != "text" and not is_table:  # else the column asked for would be ignored
        raise CorpusError(f"{path}: a text corpus has no columns; --text-column {text_column} is for tables")
    if is_table:
        docs = _read_table_texts(path, text_column)
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file())
        if not files:  # (it was "corpus is empty", of a folder that may hold much, only not as text files)
            raise CorpusError(
                f"{path}: a folder without .txt or .md files; a corpus folder holds one document per such file, "
                "or Parquet files with a text column"
            )
        docs = [t for t in (_read_text(f).strip() for f in files) if t]
    elif not path.is_file():  # a device (/dev/zero) or a pipe would be read without end, into memory
        raise CorpusError(f"{path}: not a regular file; give a text file, a folder of them, or a Parquet table")
    else:
        text = _read_text(path)
        docs = [d.strip() for d in text.replace("\r\n", "\n").split("\n\n") if d.strip()]
    if not docs:
        raise CorpusError(f"{path}: corpus is empty (no non-blank documents)")
    return docs


def split_documents(docs: Sequence[str], seed: int = 0) -> dict[str, list[str]]:
    """Assign documents to splits by a seeded permutation. Every split gets at least one document."""
    if len(docs) < len(SPLITS):
        raise CorpusError(f"need at least {len(SPLITS)} documents to make {'/'.join(SPLITS)} splits, got {len(docs)}")
    order = np.random.default_rng(seed).permutation(len(docs))
    n_cal = max(1, round(SPLIT_FRACTIONS["calibration"] * len(docs)))
    n_eval = max(1, round(SPLIT_FRACTIONS["eval"] * len(docs)))
    n_train = len(docs) - n_cal - n_eval
    if n_train < 1:
        raise CorpusError(f"{len(docs)} documents leave nothing for the train split")
    bounds = {"train": (0, n_train), "calibration": (n_train, n_train + n_cal), "eval": (n_train + n_cal, len(docs))}
    # Keep each split in corpus order, so windows read like the original text.
    return {name: [docs[i] for i in sorted(order[a:b])] for name, (a, b) in bounds.items()}


def train_tokenizer(texts: Sequence[str], vocab_size: int):
    """Byte-level BPE trained on `texts` (the train split only). Returns a `tokenizers.Tokenizer`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def load_tokenizer(model_dir: str | Path):
    from tokenizers import Tokenizer

    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: tokenizer not found")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as err:  # the tokenizers library raises a bare Exception for a damaged file
        raise ModelLoadError(f"{path}: not a readable tokenizer ({err})") from None


def end_of_document(tokenizer, where: str = "the model's tokenizer.json", config_eos=None) -> int:
    """The id of the tokenizer's end-of-document token: the first of EOS_CANDIDATES it has, else the model
    config's `eos_token_id` (an id or a list, first id used). The candidates come first because a chat
    model's configured end token often ends a turn (`<|im_end|>`), not a document."""
    eos = next((i for i in map(tokenizer.token_to_id, EOS_CANDIDATES) if i is not None), None)
    if eos is None and isinstance(config_eos, list) and config_eos:
        config_eos = config_eos[0]
    configured = isinstance(config_eos, int) and not isinstance(config_eos, bool)
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if eos is None and configured and 0 <= config_eos < size:
        eos = config_eos
    if eos is None:
        config = (
            f"the eos_token_id {config_eos} of the model's config.json is not among its {size} ids"
            if configured
            else "no eos_token_id in the model's config.json"
        )
        raise ModelLoadError(f"{where}: no end-of-document token (none of {', '.join(EOS_CANDIDATES)}, and {config})")
    return eos


def encode_stream(docs: Sequence[str], tokenizer, eos: int | None = None) -> np.ndarray:
    """All documents as one int32 token stream, each followed by the end-of-document token `eos` (None: the
    tokenizer's own, `end_of_document`)."""
    eos = end_of_document(tokenizer) if eos is None else eos
    ids: list[int] = []
    for enc in tokenizer.encode_batch(list(docs)):
        ids.extend(enc.ids)
        ids.append(eos)
    return np.asarray(ids, dtype=np.int32)


def make_windows(stream: np.ndarray, seq_len: int, num_seqs: int | None = None) -> np.ndarray:
    """Non-overlapping windows of `seq_len + 1` tokens: inputs are `w[:-1]`, targets `w[1:]`.

    Returns [N, seq_len + 1] int64. Raises when the stream cannot fill the windows asked for.
    """
    available = len(stream) // (seq_len + 1)
    if available == 0:
        raise CorpusError(f"the split has {len(stream)} tokens, fewer than one window of {seq_len + 1}")
    n = available if num_seqs is None else num_seqs
    if n > available:
        raise CorpusError(f"asked for {n} windows of {seq_len} tokens, the split has only {available}")
    return stream[: n * (seq_len + 1)].reshape(n, seq_len + 1).astype(np.int64)


def split_windows(
    corpus: str | Path,
    split: str,
    tokenizer,
    seq_len: int,
    seed: int,
    num_seqs: int | None = None,
    text_column: str = "text",
    eos: int | None = None,
) -> np.ndarray:
    """Corpus path -> windows [N, seq_len + 1] of one split, documents ended by `eos` (`encode_stream`)."""
    if split not in SPLITS:
        raise CorpusError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
    try:
        docs = split_documents(load_documents(corpus, text_column), seed)[split]
        return make_windows(encode_stream(docs, tokenizer, eos), seq_len, num_seqs)
    except CorpusError as err:  # name the corpus in every refusal (most already do)
        raise err if str(corpus) in str(err) else CorpusError(f"{corpus}: {err}") from None


def extract_kjv(out: str | Path, overwrite: bool = False) -> Path:
    """Write the King James Bible (Debian's `bible-kjv`) as one chapter per blank-line-separated document
    (an existing file only with `overwrite`)."""
    if Path(out).exists() and not overwrite:  # before minutes of extraction
        raise CorpusError(f"{out}: already exists ({OVERWRITE_HINT})")
    is_txt = Path(out).suffix == ".txt"
    check_output(out, "text corpus (.txt; --overwrite replaces one)", lambda _: overwrite and is_txt)
    if shutil.which("bible") is None:
        raise CorpusError("the `bible` program is missing: apt-get install bible-kjv bible-kjv-text")
    lines = subprocess.run(
        ["bible", "-f", "gen1:1-rev22:21"], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    verses = [line.partition(" ") for line in lines]  # ("Ge1:1", " ", "In the beginning ...")
    chapters = itertools.groupby(verses, key=lambda verse: verse[0].rsplit(":", 1)[0])  # "Ge1:1" -> "Ge1"
    text = "\n\n".join(" ".join(verse[2].strip() for verse in chapter) for _, chapter in chapters) + "\n"
    # --overwrite replaces a text corpus: a `.txt` file, never a manifest, a config or a report.
    return write_output(out, text, "text corpus (.txt; --overwrite replaces one)", lambda _: overwrite and is_txt)
