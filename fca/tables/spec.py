"""What a site's coefficients are. Kept free of torch so caches, statistics and the dashboard can
describe sites without importing it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SiteSpec:
    """What a site's coefficients are: their per-token channel layout and meaning.

    `axes` names the structure that is flattened (row-major) into the `K` channels, e.g.
    `(("channel", 12),)` for FeatureGate or `(("stream", 4), ("source", 5))` for MUDDPythia layer 3.
    `family` groups sites whose coefficients mean the same kind of thing (the global-mean profile is
    one number per family).
    """

    axes: tuple[tuple[str, int], ...]
    family: str
    # Human-readable channel names, one per flattened channel (optional).
    channel_labels: tuple[str, ...] | None = None
    # One family per flattened channel, for sites whose channels mean different kinds of thing (a
    # MUDDPythia layer holds the q, k, v and r streams). None: every channel is in `family`.
    channel_families: tuple[str, ...] | None = None
    # What the recorded values are, in words, for reports (e.g. "router logits"); "" when the site's
    # model documents it elsewhere.
    coefficient: str = ""

    def __post_init__(self) -> None:
        for name, values in (("channel_labels", self.channel_labels), ("channel_families", self.channel_families)):
            if values is not None and len(values) != self.num_channels:
                raise ValueError(f"{name} has {len(values)} entries for {self.num_channels} channels")

    @property
    def num_channels(self) -> int:
        # (a loop: torch.compile traces this in every replayed site, and math.prod breaks its graph there)
        k = 1
        for _, size in self.axes:
            k *= size
        return k

    def channel_names(self) -> tuple[str, ...]:
        """Each of the `K` channels' name: its label, else its number ("0", "1", ...)."""
        return self.channel_labels if self.channel_labels is not None else tuple(map(str, range(self.num_channels)))

    def families_per_channel(self) -> tuple[str, ...]:
        """The coefficient family of each of the `K` channels (length `K`)."""
        return self.channel_families if self.channel_families is not None else (self.family,) * self.num_channels
