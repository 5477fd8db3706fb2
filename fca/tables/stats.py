"""Statistics of coefficients: streaming, mergeable moments, the variance decomposition and bootstrap CIs.

Every coefficient of a cache sits in a *slot* (site, channel). All channels of all sites are laid out
side by side as `C` slots (`C = sum_s K_s`). A family groups slots whose values mean the same thing.

Variance decomposition within each family f (README, "What is measured, exactly"):
    SS_total_f   = sum over tokens and slots of f of (x - grand_mean_f)^2
    SS_between_f = sum over slots of f of n_slot * (slot_mean - grand_mean_f)^2     (layer identity)
    share        = sum_f SS_between_f / sum_f SS_total_f
Further factors are measured *within slots*: for a factor g (position, token id, sequence),
    SS_g = sum over slots and levels of g of n * (mean_{slot,g} - slot_mean)^2,
reported as a share of SS_total. These overlap (a token id partly determines its position's
statistics, and so on) and are not additive; each is the variance that factor would explain if the
slot were known. Group sums are all we need: SS_g = sum S_{slot,g}^2 / n_g - sum S_slot^2 / n_slot.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

# The token-id factor keeps one sum per (vocabulary entry, slot); above this many cells it is skipped
# (reported as null) rather than allocating gigabytes for a large vocabulary and many slots.
MAX_TOKEN_CELLS = 64_000_000
# `Moments.add_blocked`'s float64 scratch block. Measured on 1.4B-shaped pieces (2 cores): blocks of
# 256 KB-1 MB were slower and scaled worse on two writer threads (their Python calls, one per site and
# block, hold the GIL); 2-4 MB was best.
SCRATCH_BYTES = 2 << 20


@dataclass
class SlotLayout:
    """Where each site's channels sit among the `C` slots, and each slot's family."""

    sites: list[str]
    widths: list[int]
    families: list[str]  # per slot, length C

    @property
    def offsets(self) -> list[int]:
        return list(np.cumsum([0, *self.widths[:-1]]))

    @property
    def num_slots(self) -> int:
        return int(sum(self.widths))

    def site_slice(self, site: str) -> slice:
        i = self.sites.index(site)
        start = self.offsets[i]
        return slice(start, start + self.widths[i])


@dataclass
class Moments:
    """Mergeable sums over tokens for every slot (float64): `add` a block of tokens, `merge` two.

    Every sum is of `x - shift`, `shift` [C] a value each slot holds (its first token's): coefficients that
    vary little around a large mean keep their spread in these sums, where sums of x and x^2 would cancel
    it away (mean 100, spread 1e-5). A merge moves the other block's sums onto this one's shift."""

    num_slots: int
    seq_len: int
    vocab_size: int | None = None  # None: no token-id factor
    count: int = 0
    sum: np.ndarray = field(default=None)  # [C]
    sumsq: np.ndarray = field(default=None)  # [C]
    pos_count: np.ndarray = field(default=None)  # [T]
    pos_sum: np.ndarray = field(default=None)  # [T, C]
    tok_count: np.ndarray | None = None  # [V]
    tok_sum: np.ndarray | None = None  # [V, C]
    seq_term: np.ndarray = field(default=None)  # [C]: sum over sequences of S_{slot,seq}^2 / n_seq
    num_seqs: int = 0
    minimum: np.ndarray = field(default=None)  # [C]
    maximum: np.ndarray = field(default=None)  # [C]
    shift: np.ndarray = field(default=None)  # [C]: what every sum above is taken around

    def __post_init__(self) -> None:
        C, T = self.num_slots, self.seq_len
        self.sum = np.zeros(C) if self.sum is None else self.sum
        self.sumsq = np.zeros(C) if self.sumsq is None else self.sumsq
        self.pos_count = np.zeros(T) if self.pos_count is None else self.pos_count
        self.pos_sum = np.zeros((T, C)) if self.pos_sum is None else self.pos_sum
        self.seq_term = np.zeros(C) if self.seq_term is None else self.seq_term
        self.minimum = np.full(C, np.inf) if self.minimum is None else self.minimum
        self.maximum = np.full(C, -np.inf) if self.maximum is None else self.maximum
        self.shift = np.zeros(C) if self.shift is None else self.shift
        if self.vocab_size is not None and self.vocab_size * C > MAX_TOKEN_CELLS:
            self.vocab_size = None
        if self.vocab_size is not None and self.tok_sum is None:
            self.tok_count = np.zeros(self.vocab_size)
            self.tok_sum = np.zeros((self.vocab_size, C))

    def add(self, values: np.ndarray, tokens: np.ndarray) -> None:
        """values: [n, T, C] coefficients of n whole sequences; tokens: [n, T] their token ids."""
        n, T, C = values.shape
        if n == 0:
            return
        if self.count == 0:
            self.shift = values[0, 0].astype(np.float64)  # [C]: the first token's values
        self.minimum = np.minimum(self.minimum, values.min((0, 1)))
        self.maximum = np.maximum(self.maximum, values.max((0, 1)))
        x = values.astype(np.float64) - self.shift  # [n, T, C]
        flat = x.reshape(-1, C)  # [n*T, C]
        self.count += n * T
        self.num_seqs += n
        self.sum += flat.sum(0)
        self.sumsq += np.einsum("ij,ij->j", flat, flat)
        self.pos_count[:T] += n
        self.pos_sum[:T] += x.sum(0)
        seq_sums = x.sum(1)  # [n, C]
        self.seq_term += (seq_sums**2).sum(0) / T
        if self.tok_sum is not None:
            ids = tokens.reshape(-1)
            self.tok_count += np.bincount(ids, minlength=self.vocab_size)[: self.vocab_size]
            np.add.at(self.tok_sum, ids, flat)

    def add_blocked(self, values: np.ndarray | Sequence[np.ndarray], rows: int | None = None) -> None:
        """`add` without token-id sums, in blocks small enough to stay in a core's cache: float64 scratch
        blocks of `rows` token rows (default: about `SCRATCH_BYTES`), positions of one sequence at a time,
        or whole sequences at a time where several fit (a small model's piece is then a few blocks, not a
        Python loop over its sequences). `values` is [n, T, C] of n whole sequences as stored (float32),
        or a list of per-site [n, T, K_s] arrays whose channels are the slots in order: each site is
        widened straight into its columns of the scratch block, so a writer never concatenates a piece's
        sites. The same sums as `add` in another order."""
        blocks = [values] if isinstance(values, np.ndarray) else list(values)
        n, T = blocks[0].shape[:2]
        widths = [b.shape[2] for b in blocks]
        C = sum(widths)
        if n == 0:
            return
        if C != self.num_slots or any(b.shape[:2] != (n, T) for b in blocks):
            raise ValueError(f"blocks of shapes {[b.shape for b in blocks]} for {self.num_slots} slots")
        if self.count == 0:
            self.shift = first_token_values(blocks)
        rows = rows or max(1, SCRATCH_BYTES // (8 * C))
        positions, seqs = min(rows, T), min(n, max(1, rows // T))  # a block: [seqs, positions, C]
        columns = np.cumsum([0, *widths])
        self.count += n * T
        self.num_seqs += n
        self.pos_count[:T] += n
        seq_sums = np.zeros((n, C))  # [n, C]
        scratch = np.empty((seqs, positions, C))  # float64
        for s0 in range(0, n, seqs):
            s1 = min(n, s0 + seqs)
            for t0 in range(0, T, positions):
                t1 = min(T, t0 + positions)
                x = scratch[: s1 - s0, : t1 - t0]
                for block, c0, c1 in zip(blocks, columns[:-1], columns[1:]):
                    x[..., c0:c1] = block[s0:s1, t0:t1]  # widened exactly: extremes are the stored values'
                flat = x.reshape(-1, C)  # a view: one sequence's positions, or whole sequences
                np.minimum(self.minimum, flat.min(0), out=self.minimum)
                np.maximum(self.maximum, flat.max(0), out=self.maximum)
                x -= self.shift  # (flat is a view of x)
                s = x.sum(1)  # [seqs, C]
                seq_sums[s0:s1] += s
                self.sum += s.sum(0)
                self.sumsq += np.einsum("ij,ij->j", flat, flat)
                self.pos_sum[t0:t1] += x[0] if s1 - s0 == 1 else x.sum(0)
        self.seq_term += (seq_sums**2).sum(0) / T

    def reshifted(self, shift: np.ndarray) -> "Moments":
        """The same moments with every sum taken around `shift` [C] instead."""
        d = self.shift - shift  # [C]; x - shift = (x - self.shift) + d
        n = self.count
        return Moments(
            self.num_slots,
            self.seq_len,
            self.vocab_size if self.tok_sum is not None else None,
            n,
            self.sum + n * d,
            self.sumsq + 2 * d * self.sum + n * d**2,
            self.pos_count.copy(),
            self.pos_sum + self.pos_count[:, None] * d,
            None if self.tok_count is None else self.tok_count.copy(),
            None if self.tok_sum is None else self.tok_sum + self.tok_count[:, None] * d,
            self.seq_term + 2 * d * self.sum + n * d**2,  # sum over sequences of (S_seq + T d)^2 / T
            self.num_seqs,
            self.minimum.copy(),
            self.maximum.copy(),
            np.array(shift, dtype=np.float64),
        )

    def merge(self, other: "Moments") -> "Moments":
        shift = self.shift if self.count or not other.count else other.shift
        merged, moved = self.reshifted(shift), other.reshifted(shift)  # (copies: added to in place)
        merged.absorb(moved)
        if merged.tok_sum is None or moved.tok_sum is None:
            merged.vocab_size, merged.tok_count, merged.tok_sum = None, None, None
        else:
            merged.tok_count += moved.tok_count
            merged.tok_sum += moved.tok_sum
        return merged

    def absorb(self, other: "Moments") -> None:
        """Add in place the sums (not the token-id sums) of `other`, taken around this one's shift."""
        self.count += other.count
        self.num_seqs += other.num_seqs
        for key in ("sum", "sumsq", "pos_count", "pos_sum", "seq_term"):
            getattr(self, key)[...] += getattr(other, key)
        self.minimum = np.minimum(self.minimum, other.minimum)
        self.maximum = np.maximum(self.maximum, other.maximum)

    @property
    def slot_offset(self) -> np.ndarray:
        """[C] each slot's mean minus its shift."""
        return self.sum / self.count

    @property
    def slot_mean(self) -> np.ndarray:
        return self.shift + self.slot_offset

    @property
    def slot_within(self) -> np.ndarray:
        """[C] each slot's sum of squares around its own mean."""
        return np.maximum(self.sumsq - self.sum * self.slot_offset, 0.0)

    @property
    def slot_var(self) -> np.ndarray:
        return self.slot_within / self.count

    @property
    def position_mean(self) -> np.ndarray:
        """[T, C] mean at each position."""
        seen = self.pos_count > 0
        return np.where(seen[:, None], self.shift + self.pos_sum / np.maximum(self.pos_count, 1)[:, None], 0.0)


def first_token_values(blocks: Sequence[np.ndarray]) -> np.ndarray:
    """[C] float64: the first token's value in every slot of per-site [n, T, K_s] arrays (the slots in order),
    the shift of sums that start with them."""
    return np.concatenate([np.asarray(b[0, 0], dtype=np.float64) for b in blocks])


# ------------------------------------------------------------------------- stored (build-time) moments
# A build writes each part's moments beside the part and their merge beside the manifest, so statistics
# never rescan coefficients. Token-id sums are kept sparse (only the ids a part holds): a dense
# [V, C] table per part would be hundreds of MB for a 50k vocabulary. Files without `shift` (the shipped
# demo's) hold sums around 0.

MOMENT_KEYS = (
    "count",
    "num_seqs",
    "sum",
    "sumsq",
    "pos_count",
    "pos_sum",
    "seq_term",
    "minimum",
    "maximum",
    "shift",
)


class TokenSums(NamedTuple):
    """Sparse token-id sums of a block: the ids seen, their counts and their sums of `x - shift`."""

    ids: np.ndarray  # [u] int64, sorted
    counts: np.ndarray  # [u] float64
    sums: np.ndarray  # [u, C] float64
    shift: np.ndarray  # [C]

    def reshifted(self, shift: np.ndarray) -> "TokenSums":
        return TokenSums(self.ids, self.counts, self.sums + self.counts[:, None] * (self.shift - shift), shift)


def token_groups(tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """tokens [n, T] -> (ids [u] sorted, inverse [n * T], counts [u]): the ids seen and where each row's is."""
    return np.unique(tokens.reshape(-1), return_inverse=True, return_counts=True)


def token_sums(values: np.ndarray | Sequence[np.ndarray], tokens: np.ndarray, groups: tuple | None = None) -> TokenSums:
    """values [n, T, C] (or per-site [n, T, K_s] arrays, the slots in order), tokens [n, T] -> the sums of
    the ids seen, around the first token's values (the shift `Moments.add_blocked` takes for the same
    values). `groups`: `token_groups(tokens)`, if the caller already has them."""
    blocks = [values] if isinstance(values, np.ndarray) else list(values)
    shift = first_token_values(blocks)
    columns = np.cumsum([0, *(b.shape[-1] for b in blocks)])
    ids, inverse, counts = groups if groups is not None else token_groups(tokens)
    order = np.argsort(inverse, kind="stable")
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    sums = np.concatenate(
        [
            np.add.reduceat(b.reshape(-1, b.shape[-1])[order].astype(np.float64) - shift[c0:c1], starts, axis=0)
            for b, c0, c1 in zip(blocks, columns[:-1], columns[1:])
        ],
        axis=1,
    )  # [u, C]
    return TokenSums(ids.astype(np.int64), counts.astype(np.float64), sums, shift)


def merge_token_sums(pieces: list[TokenSums], num_slots: int) -> TokenSums:
    """Sparse token sums of several blocks -> one over the union of their ids, around the first's shift."""
    if not pieces:
        return TokenSums(np.zeros(0, np.int64), np.zeros(0), np.zeros((0, num_slots)), np.zeros(num_slots))
    shift = pieces[0].shift
    ids = np.unique(np.concatenate([p.ids for p in pieces]))
    counts, sums = np.zeros(len(ids)), np.zeros((len(ids), num_slots))
    for piece in pieces:  # in order: the same order gives the same bits
        piece = piece.reshifted(shift)
        at = np.searchsorted(ids, piece.ids)
        counts[at] += piece.counts
        sums[at] += piece.sums
    return TokenSums(ids, counts, sums, shift)


def moments_arrays(m: Moments, tokens: TokenSums | None = None) -> dict:
    """A `Moments` (without its dense token table) and optional sparse token sums -> named arrays to store."""
    out = {key: np.asarray(getattr(m, key)) for key in MOMENT_KEYS}
    if tokens is not None:
        tokens = tokens.reshifted(m.shift)
        out["tok_ids"], out["tok_count"], out["tok_sum"] = tokens.ids, tokens.counts, tokens.sums
    return out


def stored_moments_block(block: dict, num_slots: int, seq_len: int) -> Moments:
    """Named arrays as `moments_arrays` stores them -> `Moments` (no token sums)."""
    sums = ("sum", "sumsq", "pos_count", "pos_sum", "seq_term", "minimum", "maximum")
    return Moments(
        num_slots,
        seq_len,
        count=int(block["count"]),
        num_seqs=int(block["num_seqs"]),
        shift=np.asarray(block["shift"], np.float64) if "shift" in block else None,  # None: sums around 0
        **{key: np.asarray(block[key], np.float64) for key in sums},
    )


class MomentsMerger:
    """Stored moments of several blocks (parts), added one at a time in part order: a writer merges each
    part as soon as it and the parts before it are complete, instead of reading every sidecar back at
    the end. Sums are accumulated in place in the order given, around the first block's shift, so the
    same blocks in the same order give the same bits. The token-id table is filled only when every block
    carries token sums and `vocab_size` is known."""

    def __init__(self, num_slots: int, seq_len: int, vocab_size: int | None) -> None:
        self.moments = Moments(num_slots, seq_len, vocab_size)
        self.with_tokens = self.moments.tok_sum is not None

    def add(self, block: dict) -> None:
        m = self.moments
        stored = stored_moments_block(block, m.num_slots, m.seq_len)
        if m.count == 0:
            m.shift = stored.shift
        d = stored.shift - m.shift  # [C]
        m.absorb(stored.reshifted(m.shift))
        if self.with_tokens and "tok_ids" in block:
            ids = block["tok_ids"]
            if len(ids) and ids.max() >= m.vocab_size:
                self.with_tokens = False  # an id beyond the recorded vocabulary: no token factor, as when scanning
            else:
                m.tok_count[ids] += block["tok_count"]
                m.tok_sum[ids] += block["tok_sum"] + block["tok_count"][:, None] * d
        else:
            self.with_tokens = False

    def result(self) -> tuple[Moments, bool]:
        """(the merged Moments, whether it has token sums)."""
        m = self.moments
        if not self.with_tokens:
            m.vocab_size, m.tok_count, m.tok_sum = None, None, None
        return m, self.with_tokens


def merge_moment_arrays(
    blocks: Iterator[dict], num_slots: int, seq_len: int, vocab_size: int | None
) -> tuple[Moments, bool]:
    """Stored moments of several blocks (parts, in part order) -> (one Moments, whether it has token sums);
    see `MomentsMerger`."""
    merger = MomentsMerger(num_slots, seq_len, vocab_size)
    for block in blocks:
        merger.add(block)
    return merger.result()


def _family_offsets(m: Moments, families: list[str]) -> tuple[dict[str, float], np.ndarray, np.ndarray]:
    """(family -> its first slot's shift, [C] each slot's mean minus its family's, [C] each family's
    grand mean minus that reference): means as offsets from a value the family holds, so that a spread
    of 1e-5 around 100 is not lost to the rounding of 100."""
    fam = np.asarray(families)
    reference = {f: float(m.shift[families.index(f)]) for f in dict.fromkeys(families)}
    ref = np.array([reference[f] for f in families])  # [C]
    mean_offset = (m.shift - ref) + m.slot_offset  # [C] slot mean - family reference
    grand_offset = np.zeros(len(families))
    for f in reference:  # every slot holds the same tokens: the grand mean is the mean of slot means
        grand_offset[fam == f] = mean_offset[fam == f].mean()
    return reference, mean_offset - grand_offset, grand_offset


def family_grand_means(m: Moments, families: list[str]) -> dict[str, float]:
    reference, _, grand_offset = _family_offsets(m, families)
    return {f: reference[f] + float(grand_offset[families.index(f)]) for f in reference}


def variance_decomposition(m: Moments, layout: SlotLayout) -> dict:
    """The layer-identity share (pooled, per family, per site, per slot) and the further factors.

    Each sum of squares is taken around means, from the shifted sums (`Moments`): its rounding stays
    relative to the spread of the values, not to their magnitude."""
    fam = np.asarray(layout.families)
    grand = family_grand_means(m, layout.families)
    _, between_offset, _ = _family_offsets(m, layout.families)  # [C] slot mean - family grand mean
    ss_between_slot = m.count * between_offset**2  # [C]
    ss_within_slot = m.slot_within  # [C]
    ss_total_slot = ss_within_slot + ss_between_slot  # [C] around the family grand mean
    offset = m.slot_offset  # [C] slot mean - shift

    def share(num: float, den: float) -> float | None:
        # Undefined only where the values do not vary at all: sums of `x - shift` with shift a value the
        # slot holds are exactly 0 for a constant slot.
        return float(num / den) if den > 0 else None

    total = float(ss_total_slot.sum())
    per_family = {f: share(ss_between_slot[fam == f].sum(), ss_total_slot[fam == f].sum()) for f in grand}
    per_site = {
        s: share(ss_between_slot[layout.site_slice(s)].sum(), ss_total_slot[layout.site_slice(s)].sum())
        for s in layout.sites
    }
    # Site alone: every channel of a site shares one mean (within each family present in the site).
    ss_site = 0.0
    for s in layout.sites:
        sl = layout.site_slice(s)
        for f in dict.fromkeys(layout.families[sl]):
            cols = np.flatnonzero(fam[sl] == f) + sl.start
            ss_site += m.count * len(cols) * between_offset[cols].mean() ** 2
    ss_slot = float(ss_between_slot.sum())
    residual = share(float(ss_within_slot.sum()), total)

    def between_groups(counts: np.ndarray, sums: np.ndarray) -> float:
        # counts [G], sums [G, C] of `x - shift`: sum over groups and slots of n_g (group mean - slot mean)^2
        seen = counts > 0
        return float((counts[seen, None] * (sums[seen] / counts[seen, None] - offset) ** 2).sum())

    position = between_groups(m.pos_count, m.pos_sum)
    # Sequences keep only sum of S_seq^2 / T: its part around the slot mean is taken off afterwards.
    sequence = float(np.maximum(m.seq_term - m.sum * offset, 0.0).sum())
    token, token_ids = None, None
    if m.tok_sum is not None:
        token = between_groups(m.tok_count, m.tok_sum)
        token_ids = int((m.tok_count > 0).sum())
    groups = {  # the groups of each within-slot factor, in the report's order (no token ids: no token factor)
        "position_within_slot": int((m.pos_count > 0).sum()),
        **({"token_id_within_slot": token_ids} if token_ids is not None else {}),
        "sequence_within_slot": m.num_seqs,
    }
    # A grouping with no effect still takes a share: k groups among n values of a slot explain, in
    # expectation, (k - 1) / (n - 1) of the slot's within variance. A share is meaningful only above this.
    chance = {
        name: None if residual is None or m.count < 2 else (k - 1) / (m.count - 1) * residual
        for name, k in groups.items()
    }
    return {
        "layer_identity_share": share(ss_slot, total),
        "per_family": per_family,
        "per_site": per_site,
        "per_slot_share": [share(b, t) for b, t in zip(ss_between_slot, ss_total_slot)],
        "factors": {
            "site": share(ss_site, total),
            "channel_within_site": share(ss_slot - ss_site, total),
            "position_within_slot": share(position, total),
            "token_id_within_slot": share(token, total) if token is not None else None,
            "sequence_within_slot": share(sequence, total),
            "residual_after_slot": residual,
        },
        "chance_levels": chance,
        "ss_total": total,
        "family_grand_means": grand,
        "num_tokens": m.count,
    }


# Fewer values give no bootstrap interval of their mean: resampling 2, 3, 5 or 8 independent normal values,
# the 95% percentile interval covered the true mean 51%, 76%, 85% and 90% of the time (1000 trials each);
# from 10 on, 91% and more (20: 93%). A "95% CI" from three sequences would be one in name only.
MIN_BOOTSTRAP_VALUES = 10


def paired_bootstrap_ci(differences: np.ndarray, num_resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Percentile CI of the mean of per-sequence paired differences, resampling sequences; NaN from fewer
    than MIN_BOOTSTRAP_VALUES sequences."""
    d = np.asarray(differences, dtype=np.float64)
    if d.size < MIN_BOOTSTRAP_VALUES:
        return (float("nan"), float("nan"))
    return percentile_interval(resampled_means(d[:, None], None, num_resamples, seed)[:, 0])


def percentile_interval(draws: np.ndarray, level: float = 0.95) -> tuple[float, float]:
    """The central `level` interval of bootstrap draws [R] (NaN where any draw is NaN)."""
    alpha = (1 - level) / 2
    lo, hi = np.quantile(draws, [alpha, 1 - alpha])
    return float(lo), float(hi)


RESAMPLE_BLOCK = 2**22  # bootstrap indices held at once (32 MB)


def resampled_means(
    values: np.ndarray, groups: np.ndarray | None = None, num_resamples: int = 2000, seed: int = 0
) -> np.ndarray:
    """[R, k]: bootstrap means of each column of `values` [n, k], resampling its rows (sequences) or, given
    `groups` [n] (a label per row, e.g. the document a window of text lies in), whole groups of rows with
    replacement, each resample's mean taken over the rows its groups hold. One draw of indices serves every
    column, so the columns stay paired (a ratio of two columns' means can be bootstrapped from the draws).
    Rows: the same draws as resampling single values (`rng.integers(0, n, (R, n))`), so a column's row
    interval is the one `paired_bootstrap_ci` gave before groups existed."""
    values = np.asarray(values, dtype=np.float64)
    if groups is None:
        sums, counts = values, None
    else:
        _, label = np.unique(np.asarray(groups), return_inverse=True)
        sums = np.zeros((label.max() + 1, values.shape[1]))
        np.add.at(sums, label, values)  # [U, k]: each group's sum
        counts = np.bincount(label).astype(np.float64)  # [U]
    rng = np.random.default_rng(seed)
    units = len(sums)
    out = np.empty((num_resamples, values.shape[1]))
    # Resamples drawn a block at a time ([r, U] indices, r * U <= RESAMPLE_BLOCK): the same draws as one
    # [R, U] block (numpy's integers continue one stream), in bounded memory (2,000 x 50,000 sequences took
    # 1.6 GB at once). Column by column within a block, never [r, U, k].
    block = max(1, RESAMPLE_BLOCK // max(units, 1))
    for lo in range(0, num_resamples, block):
        idx = rng.integers(0, units, size=(min(block, num_resamples - lo), units))  # [r, U]
        drawn = values.shape[0] if counts is None else counts[idx].sum(1)  # rows each resample holds
        for j in range(values.shape[1]):
            out[lo : lo + len(idx), j] = sums[:, j][idx].sum(1) / drawn
    return out
