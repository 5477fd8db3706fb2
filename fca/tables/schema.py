"""The cache's on-disk format: file names, the Parquet schema, coefficient encodings, record batches.

Layout of one cache directory (README, "Cache layout"):
    manifest.json       what the cache is: model and tokenizer fingerprints, split, sites, part hashes
    part-00000.parquet  one row per (sequence, position); one FixedSizeList<float32>[K_s] column per site
    part-00000.moments.npz, moments.npz   each part's moments, and all parts' merged

bfloat16 caches store each coefficient's raw bits as uint16 (Parquet has no bfloat16); every reader
widens them to float32 exactly (`coefficient_values`).
"""

from __future__ import annotations

import hashlib
import io
import math
import re
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import numpy as np
import pyarrow as pa

from fca.tables.errors import CacheError
from fca.tables.spec import SiteSpec

SCHEMA_VERSION = 1
KEY_COLUMNS = ("seq", "pos", "token", "target", "live_nll")
KEY_INTS = KEY_COLUMNS[:4]  # int32 keys; every other column is floats (16-bit ones as their raw bits)
MANIFEST = "manifest.json"
PLAN = "plan.json"  # a build's bookkeeping in `<name>.partial/` (fca.tables.writer_store): its plan,
RECORD_SUFFIX = ".record.json"  # and one record per committed part (`part-XXXXX.record.json`)
MOMENTS = "moments.npz"  # the merged moments of all parts, written by `finish` (see `arrays_bytes`)


def cache_schema(specs: dict[str, SiteSpec], coefficient_type: pa.DataType = pa.float32()) -> pa.Schema:
    fields = [pa.field(name, pa.int32(), nullable=False) for name in KEY_INTS]
    fields.append(pa.field("live_nll", pa.float32(), nullable=False))
    # The list items are declared non-null: Parquet then stores no definition level per value, which
    # encoding and decoding would otherwise spend time on.
    item = pa.field("element", coefficient_type, nullable=False)
    fields += [pa.field(name, pa.list_(item, spec.num_channels), nullable=False) for name, spec in specs.items()]
    return pa.schema(fields)


# Stored coefficient types. bfloat16 has no Parquet type: its raw bits are stored as uint16 and the
# manifest's `coefficient_dtype` says how to read them; a uint16 column means bfloat16 bits.
COEFFICIENT_DTYPES = {"float32": pa.float32(), "float16": pa.float16(), "bfloat16": pa.uint16()}
COEFFICIENT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """float32 values that are exactly bfloat16 numbers -> their bfloat16 bits (uint16, same shape).

    Refuses values that would lose bits: bfloat16 storage is lossless or nothing."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    bits = values.view(np.uint32)
    if np.any(bits & 0xFFFF):
        raise CacheError("bfloat16 storage takes bfloat16 numbers; these float32 values would be rounded")
    return (bits >> 16).astype(np.uint16)


def arrow_numpy(array: pa.Array) -> np.ndarray:
    """A primitive Arrow array as numpy: a zero-copy, read-only view where it has no nulls. `to_numpy`
    gives the same, but its first call imports pandas (0.2-0.6 s here): in a build, inside the first
    batches, on a writer thread."""
    if array.null_count or pa.types.is_boolean(array.type):
        return array.to_numpy(zero_copy_only=False)
    dtype = np.dtype(array.type.to_pandas_dtype())
    if len(array) == 0:
        return np.empty(0, dtype)
    view = np.frombuffer(array.buffers()[1], dtype=dtype, count=len(array), offset=array.offset * dtype.itemsize)
    view.flags.writeable = False  # as `to_numpy` gives it: the Arrow data is shared, not copied
    return view


def coefficient_values(column: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """A site column (FixedSizeList of K) -> float32 values [rows, K].

    float16 widens exactly; bfloat16 bits (uint16) become the high half of a float32, which is exact too."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    K = column.type.list_size
    flat = arrow_numpy(column.flatten())
    if pa.types.is_uint16(column.type.value_type):
        flat = (flat.astype(np.uint32) << 16).view(np.float32)
    return flat.astype(np.float32, copy=False).reshape(-1, K)


def decoded_batch(batch: pa.RecordBatch) -> pa.RecordBatch:
    """A record batch whose bfloat16-bit (uint16) site columns are replaced by float32 ones."""
    for i, column_field in enumerate(batch.schema):
        if pa.types.is_fixed_size_list(column_field.type) and pa.types.is_uint16(column_field.type.value_type):
            item = column_field.type.value_field
            list_type = pa.list_(pa.field(item.name, pa.float32(), nullable=item.nullable), column_field.type.list_size)
            values = pa.array(coefficient_values(batch.column(i)).reshape(-1))
            column = pa.FixedSizeListArray.from_arrays(values, type=list_type)
            batch = batch.set_column(i, pa.field(column_field.name, list_type, nullable=column_field.nullable), column)
    return batch


def coefficient_arrow_type(name: str) -> pa.DataType:
    if name not in COEFFICIENT_DTYPES:
        raise CacheError(f"coefficient dtype {name!r} is not supported (choose {', '.join(COEFFICIENT_DTYPES)})")
    return COEFFICIENT_DTYPES[name]


def spec_to_json(spec: SiteSpec) -> dict:
    out = {
        "shape": [spec.num_channels],
        "axes": [[a, n] for a, n in spec.axes],
        "family": spec.family,
        "dtype": "float32",
    }
    for key in ("channel_labels", "channel_families"):
        if getattr(spec, key) is not None:
            out[key] = list(getattr(spec, key))
    if spec.coefficient:
        out["coefficient"] = spec.coefficient
    return out


def spec_from_json(d: dict) -> SiteSpec:
    return SiteSpec(
        axes=tuple((a, int(n)) for a, n in d["axes"]),
        family=d["family"],
        channel_labels=tuple(d["channel_labels"]) if d.get("channel_labels") is not None else None,
        channel_families=tuple(d["channel_families"]) if d.get("channel_families") is not None else None,
        coefficient=d.get("coefficient", ""),
    )


def cache_plan(
    specs: dict[str, SiteSpec],
    seq_len: int,
    num_seqs: int,
    model: dict,
    corpus: dict,
    coefficient_dtype: str = "float32",
    **extra,
) -> dict:
    """The manifest draft of a cache (everything but the part list and creation time)."""
    return {
        "schema_version": SCHEMA_VERSION,
        "model": model,
        "corpus": corpus,
        "seq_len": seq_len,
        "num_seqs": num_seqs,
        "num_tokens": num_seqs * seq_len,
        "coefficient_dtype": coefficient_dtype,
        "sites": {name: spec_to_json(spec) for name, spec in specs.items()},
        **extra,
    }


def _arrow(values: np.ndarray) -> pa.Array:
    """A 1-D numpy array as an Arrow array of its dtype, zero-copy (the reverse of `_numpy`). `pa.array`
    gives the same array, but its first call imports pandas (0.2 s here) to check the input is not a
    pandas object: in a build, inside the first batches."""
    values = np.ascontiguousarray(values)
    return pa.Array.from_buffers(pa.from_numpy_dtype(values.dtype), len(values), [None, pa.py_buffer(values)])


def record_batch(
    schema: pa.Schema,
    seq: np.ndarray,
    tokens: np.ndarray,
    targets: np.ndarray,
    live_nll: np.ndarray,
    coefficients: dict[str, np.ndarray],
) -> pa.RecordBatch:
    """Columns straight from numpy. seq: [n]; tokens, targets, live_nll: [n, T]; coefficients: site -> [n, T, K].

    For a bfloat16 schema (uint16 site columns) a site's values are its bfloat16 bits (uint16 or int16),
    or float32 values that are exactly bfloat16 numbers."""
    n, T = tokens.shape
    columns = [
        _arrow(np.repeat(seq.astype(np.int32), T)),
        _arrow(np.tile(np.arange(T, dtype=np.int32), n)),
        _arrow(tokens.reshape(-1).astype(np.int32)),
        _arrow(targets.reshape(-1).astype(np.int32)),
        _arrow(live_nll.reshape(-1).astype(np.float32)),
    ]
    for column_field in schema:
        if column_field.name in KEY_COLUMNS:
            continue
        values = coefficients[column_field.name]
        K = column_field.type.list_size
        if values.shape != (n, T, K):
            raise CacheError(f"site {column_field.name}: coefficients of shape {values.shape}, expected {(n, T, K)}")
        if pa.types.is_uint16(
            column_field.type.value_type
        ):  # bfloat16 bits: take bits as they are, floats only if exact
            values = values.view(np.uint16) if values.dtype in (np.int16, np.uint16) else bfloat16_bits(values)
        flat = _arrow(np.ascontiguousarray(values, dtype=column_field.type.value_type.to_pandas_dtype()).reshape(-1))
        columns.append(pa.FixedSizeListArray.from_arrays(flat, type=column_field.type))
    return pa.RecordBatch.from_arrays(columns, schema=schema)


def stream_sha256(stream: BinaryIO) -> str:
    digest = hashlib.sha256()
    while chunk := stream.read(8 << 20):
        digest.update(chunk)
    return digest.hexdigest()


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return stream_sha256(f)


def arrays_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    """Named arrays as the bytes of an .npz that `np.load` reads, byte for byte reproducibly: `np.savez`
    stamps each member with the current time, which would make equal moments hash differently."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_STORED) as z:
        for name, array in arrays.items():
            info = zipfile.ZipInfo(name + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
            array = np.asarray(array, order="C")  # keeps 0-d (`np.ascontiguousarray` would not)
            with z.open(info, "w", force_zip64=True) as f:
                # What `np.lib.format.write_array` writes, without its `tobytes` copy of each array.
                np.lib.format.write_array_header_1_0(f, np.lib.format.header_data_from_array_1_0(array))
                f.write(array.reshape(-1).view(np.uint8))
    return buffer.getvalue()


MemberCheck = Callable[[str, tuple[int, ...]], "str | None"]


def read_arrays(path: Path | BinaryIO, check: MemberCheck | None = None) -> dict[str, np.ndarray]:
    """The named arrays of an .npz (never unpickled). With `check`, each member is judged before it is
    inflated: its npy header (shape and dtype, the first bytes of the member) must account for the size the
    zip declares for it, and `check(name, shape)` gives a reason to refuse it or None. So a member of a few
    kilobytes on disk that would inflate to gigabytes is refused unread; raises CacheError naming the
    member. Without `check`, the file (or stream) is trusted: what a build wrote and reads back itself."""
    if check is None:
        with np.load(path, allow_pickle=False) as z:
            return {name: z[name] for name in z.files}
    arrays = {}
    with zipfile.ZipFile(path) as z:
        for info in z.infolist():
            name = info.filename.removesuffix(".npy")
            with z.open(info) as f:
                try:
                    header = np.lib.format.read_magic(f)
                    read_header = {(1, 0): np.lib.format.read_array_header_1_0}.get(
                        header, np.lib.format.read_array_header_2_0
                    )
                    shape, fortran, dtype = read_header(f)
                except ValueError as err:
                    raise CacheError(f"{path}: member {name!r} is not an npy array ({err})") from None
                if dtype.hasobject:
                    raise CacheError(f"{path}: member {name!r} holds Python objects, not numbers")
                data_bytes = math.prod(shape) * dtype.itemsize
                if f.tell() + data_bytes != info.file_size:
                    raise CacheError(
                        f"{path}: member {name!r} declares {info.file_size:,} bytes, but its header "
                        f"{list(shape)} {dtype} needs {f.tell() + data_bytes:,}"
                    )
                problem = check(name, shape)
                if problem is not None:
                    raise CacheError(f"{path}: member {name!r} of shape {list(shape)}: {problem}")
                data = f.read(data_bytes)
                if len(data) != data_bytes:
                    raise CacheError(f"{path}: member {name!r} is truncated")
                arrays[name] = np.frombuffer(data, dtype).reshape(shape, order="F" if fortran else "C").copy()
    return arrays


def is_cache_file(name: str) -> bool:
    """Whether a finished cache's folder holds an entry of this name (what --overwrite may delete): its
    files, and the build's bookkeeping, which a build stopped just after its final rename leaves behind."""
    return (
        name in (MANIFEST, MOMENTS, PLAN)
        or is_part_file(name)
        or re.fullmatch(r"part-\d+" + re.escape(RECORD_SUFFIX), name) is not None
    )


def is_part_file(name: str) -> bool:
    """A part's Parquet file or moments sidecar (`part-XXXXX.parquet`, `part-XXXXX.moments.npz`)."""
    return re.fullmatch(r"part-\d+(\.moments\.npz|\.parquet)", name) is not None


def is_partial_file(name: str) -> bool:
    """Whether an unfinished build's `<out>.partial/` holds an entry of this name."""
    return is_cache_file(name) or name.endswith(".tmp")


def byte_stream_split_columns(schema: pa.Schema) -> list[str]:
    """The columns written byte-stream-split: `live_nll` and every site's values. pyarrow names a list
    column's values by their leaf path (`<site>.list.element`); the site's own name would leave them PLAIN,
    and split float32 values compress smaller under zstd. float16 values stay PLAIN: DuckDB reads
    byte-stream-split only for 4- and 8-byte types."""
    return [
        f.name if f.name == "live_nll" else f"{f.name}.list.element"
        for f in schema
        if f.name not in KEY_INTS
        and not (pa.types.is_fixed_size_list(f.type) and pa.types.is_float16(f.type.value_type))
    ]


def moments_file(part_file: str) -> str:
    """The moments sidecar of a part: `part-00000.parquet` -> `part-00000.moments.npz`."""
    return part_file.removesuffix(".parquet") + ".moments.npz"


def check_part_schema(part: Path, schema: pa.Schema, expected: pa.Schema) -> None:
    """CacheError naming the part and column when `schema` lacks a column of `expected`, types it otherwise,
    or has one more (a site the manifest no longer lists: its statistics would not fit the manifest's)."""
    extra = [name for name in schema.names if name not in expected.names]
    if extra:
        raise CacheError(
            f"{part}: column {extra[0]!r} is not a site of the manifest (an edited manifest, or another cache's part)"
        )
    for column_field in expected:
        if column_field.name not in schema.names:
            raise CacheError(f"{part}: column {column_field.name!r} is missing")
        if not schema.field(column_field.name).type.equals(column_field.type):
            raise CacheError(
                f"{part}: column {column_field.name!r} has type {schema.field(column_field.name).type}, "
                f"expected {column_field.type}"
            )
