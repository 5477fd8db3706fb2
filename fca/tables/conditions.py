"""Replay conditions: which coefficients the frozen model is fed. Small pure functions over arrays.

For evaluated sequences `n` (indices into the evaluated list), positions `t`, channels `k`:
    correct          C[n, t]
    cross_input      C[pi(n), t]        pi: a seeded derangement of the evaluated sequences
    token_shuffle    C[n, sigma_n(t)]   sigma_n: a seeded permutation per sequence, shared by all sites
                                        (or, with `independent`, one per sequence and site)
    static_layer     mu[k]              calibration mean of each site and channel
    global_mean      g[family(k)]       calibration grand mean of the coefficient family
    interpolate      alpha * C + (1 - alpha) * mu
    position_profile mu[t, k]           calibration mean at each position
`sites` restricts a condition to a subset of sites; the others stay correct.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from fca.tables.errors import SiteError

if TYPE_CHECKING:  # the annotation only: profiles pulls in the Parquet store, which conditions never need
    from fca.tables.profiles import Profiles

KINDS = ("correct", "cross_input", "token_shuffle", "static_layer", "global_mean", "interpolate", "position_profile")
PAPER_CONDITIONS = ("correct", "cross_input", "token_shuffle", "static_layer", "global_mean")
GRAMMAR = "kind[:alpha][+independent][@site,site,...]"


@dataclass(frozen=True)
class Condition:
    """One replay condition. Its text form (`spec`, also its `name` in reports) is
    `kind[:alpha][+independent][@site,site,...]`, and `parse_condition(c.spec, c.seed) == c` for every
    condition: the seed is not part of the text, it is the run's."""

    kind: str
    alpha: float | None = None  # interpolate only
    sites: tuple[str, ...] | None = None  # None: every site
    independent: bool = False  # token_shuffle: one permutation per site
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown condition {self.kind!r}; choose one of {', '.join(KINDS)}")
        if self.kind == "interpolate" and self.alpha is None:
            raise ValueError("interpolate needs alpha (e.g. interpolate:0.5)")
        if self.kind != "interpolate" and self.alpha is not None:
            raise ValueError(f"{self.kind} takes no alpha (only interpolate does, e.g. interpolate:0.5)")
        if self.independent and self.kind != "token_shuffle":
            # It would run as the plain kind under another name: a second row equal to the first.
            raise ValueError(f"{self.kind} takes no +independent (only token_shuffle does: one permutation per site)")
        if self.alpha is not None:
            if not math.isfinite(self.alpha):
                raise ValueError(f"interpolate needs a finite alpha, not {self.alpha!r}")
            object.__setattr__(self, "alpha", float(self.alpha))  # so interpolate:1 equals interpolate:1.0
        if self.sites is not None:
            object.__setattr__(self, "sites", tuple(self.sites))
            bad = [s for s in self.sites if not s or re.search(r"[\s,@]", s)]
            if not self.sites or bad:
                raise ValueError(
                    f"sites must be non-empty names without spaces, ',' or '@' (None: every site), not {self.sites!r}"
                )
            twice = sorted({s for s in self.sites if self.sites.count(s) > 1})
            if twice:
                raise ValueError(f"site(s) {', '.join(twice)} named twice in one condition")

    @property
    def spec(self) -> str:
        """The canonical text form, e.g. `interpolate:0.5@blocks.0.gate`, `token_shuffle+independent`."""
        return format_condition(self)

    name = spec  # the condition's key in results and reports: its canonical text form

    @property
    def needs_profiles(self) -> bool:
        return self.kind in ("static_layer", "global_mean", "interpolate", "position_profile")

    def to_json(self) -> dict:
        return {
            "kind": self.kind,
            "alpha": self.alpha,
            "sites": list(self.sites) if self.sites else None,
            "independent": self.independent,
            "seed": self.seed,
        }


def _format_alpha(alpha: float) -> str:
    # repr is the shortest text that reads back as the same float (0.1 + 0.2 -> 0.30000000000000004);
    # whole numbers drop the ".0" so `interpolate:1` stays as users type it.
    text = repr(float(alpha))
    return text[:-2] if text.endswith(".0") else text


def format_condition(condition: Condition) -> str:
    """`kind[:alpha][+independent][@site,site,...]`: the inverse of `parse_condition`."""
    text = condition.kind
    if condition.alpha is not None:
        text += ":" + _format_alpha(condition.alpha)
    if condition.independent:
        text += "+independent"
    if condition.sites is not None:
        text += "@" + ",".join(condition.sites)
    return text


_FLOAT = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"
_SPEC = re.compile(rf"^(?P<kind>[a-z_]+)(?::(?P<alpha>{_FLOAT}))?(?P<ind>\+independent)?(?:@(?P<sites>.+))?$")


def parse_condition(text: str, seed: int = 0) -> Condition:
    """`kind[:alpha][+independent][@site,site,...]`, e.g. `interpolate:0.5@blocks.0.gate`."""
    match = _SPEC.match(text.strip())
    if not match:
        raise ValueError(f"cannot read condition {text!r}; form: {GRAMMAR}")
    alpha = float(match["alpha"]) if match["alpha"] is not None else None
    sites = tuple(s for s in match["sites"].split(",") if s) if match["sites"] else None
    return Condition(match["kind"], alpha, sites, bool(match["ind"]), seed)


def as_conditions(specs, seed: int = 0) -> list[Condition]:
    """`Condition`s or specs (`parse_condition`), or one spec, as a list of `Condition`s."""
    if isinstance(specs, (str, Condition)):
        specs = [specs]
    conditions = []
    for c in specs:
        if not isinstance(c, (str, Condition)):
            raise ValueError(f"a condition is a Condition or a spec such as 'static_layer', not {c!r}")
        conditions.append(c if isinstance(c, Condition) else parse_condition(c, seed))
    return conditions


def derangement(n: int, seed: int) -> np.ndarray:
    """A uniformly drawn permutation of range(n) with no fixed point (rejection sampling; n >= 2)."""
    if n < 2:
        raise ValueError(f"cross_input needs at least 2 evaluated sequences, got {n}")
    rng = np.random.default_rng(seed)
    while True:
        perm = rng.permutation(n)
        if not (perm == np.arange(n)).any():
            return perm


def position_permutation(n: int, T: int, seed: int, site_index: int | None = None) -> np.ndarray:
    """sigma_n: a permutation of T positions for evaluated sequence n (and site, if independent).

    Seeded per sequence, so it does not depend on how sequences are batched. A site's key ends in
    site_index + 1: numpy's SeedSequence pads its entropy with zeros, so [seed, n, 0] would draw the shared
    permutation [seed, n] again, and the first site of +independent would be shuffled as in the shared run."""
    key = [seed, n] if site_index is None else [seed, n, site_index + 1]
    return np.random.default_rng(key).permutation(T)


def check_sites_named(conditions: Sequence[Condition], sites: Sequence[str]) -> None:
    """Refuse a condition that names a site not among `sites` (a cache's), with the sites there are."""
    for condition in conditions:
        unknown = sorted(set(condition.sites or ()) - set(sites))
        if unknown:
            raise SiteError(f"condition {condition.name}: unknown site(s) {unknown}; the sites: {list(sites)}")


def condition_coefficients(
    condition: Condition,
    own: Mapping[str, np.ndarray],
    seq_index: Sequence[int],
    profiles: Profiles | None = None,
    other: Mapping[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """The coefficients of one batch under `condition`.

    own: site -> [b, T, K] cached coefficients of the batch; seq_index: the batch's positions in the
    evaluated list (seeds the permutations); other: for cross_input, the cached coefficients of the
    derangement's partners `[b, T, K]`. Returns site -> [b, T, K] (or broadcastable [K] / [T, K]).
    """
    if condition.needs_profiles and profiles is None:
        raise ValueError(f"{condition.name} needs calibration profiles")
    names = list(own)
    check_sites_named([condition], names)
    chosen = set(names) if condition.sites is None else set(condition.sites)
    out: dict[str, np.ndarray] = {}
    for site_index, name in enumerate(names):
        c = own[name]  # [b, T, K]
        if name not in chosen or condition.kind == "correct":
            out[name] = c
        elif condition.kind == "cross_input":
            if other is None:
                raise ValueError("cross_input needs the partners' coefficients")
            out[name] = other[name]
        elif condition.kind == "token_shuffle":
            T = c.shape[1]
            perms = np.stack(
                [
                    position_permutation(n, T, condition.seed, site_index if condition.independent else None)
                    for n in seq_index
                ]
            )  # [b, T]
            out[name] = np.take_along_axis(c, perms[:, :, None], axis=1)
        elif condition.kind == "static_layer":
            out[name] = profiles.static[name]  # [K]
        elif condition.kind == "global_mean":
            out[name] = profiles.global_mean[name]  # [K]
        elif condition.kind == "interpolate":
            # A huge alpha overflows to inf or nan: not warned of here, the run refuses its NLL (`check_finite`).
            with np.errstate(over="ignore", invalid="ignore"):
                out[name] = (condition.alpha * c + (1 - condition.alpha) * profiles.static[name]).astype(np.float32)
        elif condition.kind == "position_profile":
            out[name] = profiles.position[name][: c.shape[1]]  # [T, K]
    return out
