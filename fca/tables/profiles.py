"""Static profiles from a (calibration) cache: one streaming pass gives every profile and statistic.

- static (per site): `mu_s[k]`, the mean of site s channel k over all tokens of the cache;
- global mean: one number per coefficient family (no layer identity), used at every site/channel;
- per position: `mu_s[t, k]`, the mean at each position.
"""

from __future__ import annotations

import math
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from fca.tables.errors import CacheError
from fca.tables.schema import MANIFEST, MOMENTS, coefficient_values, file_sha256, read_arrays
from fca.tables.stats import Moments, SlotLayout, family_grand_means, merge_moment_arrays
from fca.tables.store import Cache


def slot_layout(cache: Cache) -> SlotLayout:
    specs = cache.site_specs
    families = [family for spec in specs.values() for family in spec.families_per_channel()]  # [C]
    return SlotLayout(sites=list(specs), widths=[s.num_channels for s in specs.values()], families=families)


def _batch_values(batch: pa.RecordBatch, sites: list[str], T: int) -> tuple[np.ndarray, np.ndarray]:
    """A record batch of whole sequences -> (values [n, T, C], tokens [n, T])."""
    n = batch.num_rows // T
    blocks = [coefficient_values(batch.column(name)).reshape(n, T, -1) for name in sites]  # [n, T, K_s]
    return np.concatenate(blocks, axis=2).astype(np.float64), batch.column("token").to_numpy().reshape(n, T)


def moments_shapes(cache: Cache, num_slots: int) -> Callable[[str, tuple[int, ...]], str | None]:
    """What a member of a cache's stored moments may hold, from the manifest's counts (already checked
    against the parts): C slots, T positions, at most one row per distinct token id. A member of another
    name (one a later FCA adds) holds at most (T + 1) x (C + 1) numbers. Judged before it is inflated."""
    C, T = num_slots, cache.seq_len
    tokens = min(cache.manifest.num_tokens, cache.manifest.vocab_size or cache.manifest.num_tokens)
    exact = {"count": (), "num_seqs": (), "pos_count": (T,), "pos_sum": (T, C)}
    exact |= {key: (C,) for key in ("sum", "sumsq", "seq_term", "minimum", "maximum")}

    def check(name: str, shape: tuple[int, ...]) -> str | None:
        if name in exact:
            return None if shape == exact[name] else f"the manifest implies {list(exact[name])}"
        if name in ("tok_ids", "tok_count", "tok_sum"):
            fits = len(shape) == (2 if name == "tok_sum" else 1) and shape[0] <= tokens and shape[1:] in ((), (C,))
            return (
                None
                if fits
                else f"the manifest implies at most {tokens:,} token ids" + (f" x {C}" * (name == "tok_sum"))
            )
        return None if math.prod(shape) <= (T + 1) * (C + 1) else f"more than {(T + 1) * (C + 1):,} numbers"

    return check


def stored_moments(cache: Cache, layout: SlotLayout, with_tokens: bool = True) -> Moments | None:
    """The moments the build stored beside the manifest (`moments.npz`), or None when there are none
    (caches built before they were stored) or they lack what is asked (token-id sums). The file is
    O(T x C + distinct tokens x C) whatever the cache's size, and is checked against its hash."""
    entry = cache.manifest.raw.get("moments")
    if not isinstance(entry, dict) or (with_tokens and cache.manifest.vocab_size and not entry.get("token_sums")):
        return None
    if entry.get("contents") != cache.manifest.contents_fingerprint:
        return None  # parts changed since the moments were merged: scan what is there now
    if entry.get("file") != MOMENTS:  # a name the manifest gives is read only if it is the cache's own file
        raise CacheError(f"{cache.path / MANIFEST}: its moments entry names {entry.get('file')!r}, not {MOMENTS!r}")
    path = cache.path / MOMENTS
    if not path.is_file():
        raise CacheError(f"{path}: the manifest lists stored moments, but the file is missing")
    if file_sha256(path) != entry.get("sha256"):
        raise CacheError(f"{path}: contents do not match the manifest's sha256 (corrupt or modified)")
    vocab = cache.manifest.vocab_size if with_tokens else None
    try:
        arrays = read_arrays(path, moments_shapes(cache, layout.num_slots))
        m, _ = merge_moment_arrays(iter([arrays]), layout.num_slots, cache.seq_len, vocab)
    except CacheError:
        raise
    except (OSError, ValueError, KeyError, TypeError, zipfile.BadZipFile) as err:  # (hash-consistent, yet malformed)
        reason = f"no {err.args[0]!r}" if isinstance(err, KeyError) and err.args else str(err).splitlines()[0]
        raise CacheError(f"{path}: malformed stored moments ({reason})") from None
    if m.num_seqs != cache.num_seqs:
        raise CacheError(f"{path}: moments of {m.num_seqs} sequences, the cache has {cache.num_seqs}")
    if not (np.isfinite(m.sum).all() and np.isfinite(m.sumsq).all()):
        raise CacheError(f"{cache.path}: non-finite coefficients (NaN or inf) in the cache")
    return m


def cache_moments(
    cache: Cache,
    with_tokens: bool = True,
    progress: Callable[[int, int], None] | None = None,
    scan_for_tokens: bool = False,
    num_seqs: int | None = None,
) -> tuple[Moments, SlotLayout]:
    """Mergeable moments of the whole cache: those stored at build time when there are (no coefficient is
    read), else one streaming pass over the cache, a few thousand rows at a time. `num_seqs`: of its first
    sequences only (read, since the stored moments are the whole cache's), as an audit of part of a cache.

    Token-id sums are stored only when parts repeat their token ids (small vocabularies or big parts).
    When they are not, the stored moments are used without them (the token-id factor is then reported
    as unknown) unless `scan_for_tokens` asks for a full scan to compute it."""
    layout = slot_layout(cache)
    if num_seqs is not None and num_seqs < cache.num_seqs:
        return scan_moments(cache, layout, with_tokens, progress, num_seqs)
    stored = stored_moments(cache, layout, with_tokens)
    if stored is None and with_tokens and not scan_for_tokens:
        stored = stored_moments(cache, layout, with_tokens=False)
    if stored is not None:
        if progress is not None:
            progress(cache.num_seqs, cache.num_seqs)
        return stored, layout
    return scan_moments(cache, layout, with_tokens, progress)


def scan_moments(
    cache: Cache,
    layout: SlotLayout,
    with_tokens: bool = True,
    progress: Callable[[int, int], None] | None = None,
    num_seqs: int | None = None,
) -> tuple[Moments, SlotLayout]:
    """Stream the cache (or its first `num_seqs` sequences) once, a few thousand rows at a time, into
    mergeable moments."""
    T = cache.seq_len
    m = Moments(layout.num_slots, T, cache.manifest.vocab_size if with_tokens else None)  # None: no token-id factor
    seqs_per_batch = max(1, 8192 // T)  # ~8k rows at a time: memory stays flat however big the cache
    total = cache.num_seqs if num_seqs is None else min(num_seqs, cache.num_seqs)
    cache.verify(range(total))  # the parts read, against their hashes (once per opened cache)

    def batches() -> Iterator[tuple[np.ndarray, np.ndarray]]:  # (values [n, T, C], tokens [n, T])
        if total < cache.num_seqs:  # only the row groups of the sequences asked for are read
            for lo in range(0, total, seqs_per_batch):
                rows = cache.read_seqs(range(lo, min(total, lo + seqs_per_batch)), layout.sites)
                yield np.concatenate([rows[s].astype(np.float64) for s in layout.sites], axis=2), rows["token"]
            return
        for batch in cache.iter_batches(columns=["token", *layout.sites], batch_size=seqs_per_batch * T):
            if batch.num_rows % T:
                raise CacheError(f"{cache.path}: a batch of {batch.num_rows} rows is not whole sequences of {T}")
            yield _batch_values(batch, layout.sites, T)

    for values, tokens in batches():
        if not np.isfinite(values).all():
            raise CacheError(f"{cache.path}: non-finite coefficients (NaN or inf) in the cache")
        if m.vocab_size is not None and tokens.size and not 0 <= tokens.min() <= tokens.max() < m.vocab_size:
            raise CacheError(
                f"{cache.path}: token ids from {tokens.min()} to {tokens.max()}, outside its vocabulary [0, "
                f"{m.vocab_size}): a damaged cache"
            )
        m.add(values, tokens)
        if progress is not None:
            progress(m.num_seqs, total)
    return m, layout


def split_by_site(values: np.ndarray, layout: SlotLayout) -> dict[str, np.ndarray]:
    """[..., C] -> site -> [..., K_s] (float32)."""
    return {s: values[..., layout.site_slice(s)].astype(np.float32) for s in layout.sites}


@dataclass
class Profiles:
    """Static profiles of one calibration cache."""

    static: dict[str, np.ndarray]  # site -> [K_s]
    global_mean: dict[str, np.ndarray]  # site -> [K_s], every channel its family's grand mean
    position: dict[str, np.ndarray]  # site -> [T, K_s]
    family_means: dict[str, float]
    moments: Moments
    layout: SlotLayout


def profiles_from_moments(m: Moments, layout: SlotLayout) -> Profiles:
    families = family_grand_means(m, layout.families)
    global_values = np.array([families[f] for f in layout.families])
    return Profiles(
        static=split_by_site(m.slot_mean, layout),
        global_mean=split_by_site(global_values, layout),
        position=split_by_site(m.position_mean, layout),
        family_means=families,
        moments=m,
        layout=layout,
    )


def slot_deviation(values: np.ndarray, mean: np.ndarray, sd: np.ndarray) -> np.ndarray:
    """Coefficients [..., K] as deviations from their slots' means [K] in the slots' SDs [K] (a slot that
    never varies: the raw deviation), as the dashboard's token views colour them."""
    return (values - mean) / np.where(sd > 0, sd, 1.0)


def calibration_profiles(cache: Cache, progress: Callable[[int, int], None] | None = None) -> Profiles:
    return profiles_from_moments(*cache_moments(cache, with_tokens=False, progress=progress))


def quantile_band(
    cache: Cache, quantiles: tuple[float, float] = (0.05, 0.95), max_seqs: int = 64
) -> dict[str, np.ndarray]:
    """site -> [2, K_s]: per-channel quantiles over the tokens of the first `max_seqs` sequences
    (a sample, so it stays cheap on caches of any size)."""
    seqs = list(range(min(max_seqs, cache.num_seqs)))
    coefficients = cache.coefficients(seqs)
    return {
        s: np.quantile(v.reshape(-1, v.shape[-1]), quantiles, axis=0).astype(np.float32)
        for s, v in coefficients.items()
    }
