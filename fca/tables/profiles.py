"""Static profiles from a (calibration) cache: one streaming pass gives every profile and statistic.

- static (per site): `mu_s[k]`, the mean of site s channel k over all tokens of the cache;
- global mean: one number per coefficient family (no layer identity), used at every site/channel;
- per position: `mu_s[t, k]`, the mean at each position.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from fca.tables.stats import Moments, SlotLayout, family_grand_means
from fca.tables.store import Cache, CacheError


def slot_layout(cache: Cache) -> SlotLayout:
    specs = cache.site_specs
    families: list[str] = []
    for spec in specs.values():
        families.extend(spec.families_per_channel())
    return SlotLayout(sites=list(specs), widths=[s.num_channels for s in specs.values()], families=families)


def _batch_values(batch: pa.RecordBatch, sites: list[str], T: int) -> tuple[np.ndarray, np.ndarray]:
    """A record batch of whole sequences -> (values [n, T, C], tokens [n, T])."""
    n = batch.num_rows // T
    blocks = []
    for name in sites:
        column = batch.column(name)
        K = column.type.list_size
        blocks.append(column.flatten().to_numpy().astype(np.float64).reshape(n, T, K))
    return np.concatenate(blocks, axis=2), batch.column("token").to_numpy().reshape(n, T)


def cache_moments(
    cache: Cache, with_tokens: bool = True, progress: Callable[[int, int], None] | None = None
) -> tuple[Moments, SlotLayout]:
    """Stream the cache once (a few thousand rows at a time) into mergeable moments."""
    layout = slot_layout(cache)
    T = cache.seq_len
    m = Moments(layout.num_slots, T, cache.manifest.vocab_size if with_tokens else None)  # None: no token-id factor
    seqs_per_batch = max(1, 8192 // T)  # ~8k rows at a time: memory stays flat however big the cache
    for batch in cache.iter_batches(columns=["token", *layout.sites], batch_size=seqs_per_batch * T):
        if batch.num_rows % T:
            raise CacheError(f"{cache.path}: a batch of {batch.num_rows} rows is not whole sequences of {T}")
        values, tokens = _batch_values(batch, layout.sites, T)
        if not np.isfinite(values).all():
            raise CacheError(f"{cache.path}: non-finite coefficients (NaN or inf) in the cache")
        m.add(values, tokens)
        if progress is not None:
            progress(m.num_seqs, cache.num_seqs)
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
