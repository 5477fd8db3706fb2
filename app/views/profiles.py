"""Profiles: one token's live coefficients against the static profile and its calibration band."""

from __future__ import annotations

import numpy as np
import pandas as pd
import streamlit as st

from app import figures, resources
from app.views.common import chart, download, guard, in_range, keep, one_of, require_cache, teach
from fca.tables.profiles import slot_deviation

WINDOW = 32  # positions shown at once in the heatmap: every label legible on a 1024 px screen
MAX_SITES = 12  # sites preselected when a model has many (the user can add the rest)
PROFILE_SECTIONS = ["One token vs the static profile", "Every token: deviation heatmap"]
BANDS = {"5-95%": resources.DEFAULT_BAND, "1-99%": (0.01, 0.99), "10-90%": (0.10, 0.90), "25-75%": (0.25, 0.75)}

sel = require_cache()
cache = sel.cache
st.title("Live coefficients vs the static profile")
teach(
    "The **static profile** (dashed) is what the `static_layer` condition feeds the frozen model: the mean of each "
    "slot over the calibration split. The shaded **band** shows where the calibration tokens usually are. The red "
    "line is one token's live coefficients: where it leaves the band, this token is steered differently from a "
    "typical one. The second tab's heatmap shows that deviation, in calibration standard deviations, for every "
    "token of the sequence."
)

reference = sel.static_profile_cache
if sel.is_calibration:
    st.caption("This is a calibration cache: the profile and band are its own, the static profile itself.")
elif reference is None:
    st.warning("No calibration cache of this model was found, so the profile and band come from this cache itself.")
    reference = cache

ref_stats = None
with guard("Profiles"):
    ref_stats = resources.cache_stats(str(reference.path), reference.fingerprint)
if ref_stats is None:
    st.stop()
T = cache.seq_len


# Three nested fragments, so a widget reruns only what depends on it: the sequence and sites (all
# three charts), the token and band (strip and profile), the heatmap's window (the heatmap).
@st.fragment
def sequence_view() -> None:
    with guard("Profiles"):  # inside: a fragment's own rerun bypasses guards around its call
        _sequence_view()


def _sequence_view() -> None:
    c1, c3 = st.columns([1, 3])
    sites = cache.sites
    keep("prof_seq", 0, in_range(0, cache.num_seqs - 1))
    keep("prof_sites", sites[:MAX_SITES], lambda chosen: isinstance(chosen, list) and set(chosen) <= set(sites))
    seq = int(c1.number_input("Sequence", 0, cache.num_seqs - 1, key="prof_seq", help=f"0 to {cache.num_seqs - 1}"))
    chosen_sites = c3.multiselect("Sites", sites, key="prof_sites")
    if not chosen_sites:
        c3.caption(f"No site chosen: showing all {len(sites)} sites.")
        chosen_sites = sites
    data = resources.sequence(str(cache.path), cache.fingerprint, seq)

    # Per slot of the chosen sites: live [T], static mean and SD, looked up by site name so the two
    # caches' column order does not matter.
    live, static, sd, slots = [], [], [], []
    for site in chosen_sites:
        spec = cache.manifest.sites[site]
        columns = ref_stats["site_slots"][site]
        live.append(data[site])  # [T, K]
        static.append(ref_stats["slot_mean"][columns])
        sd.append(ref_stats["slot_sd"][columns])
        slots += [f"{site}/{label}" for label in spec.channel_names()]
    live_m, static_v, sd_v = np.concatenate(live, axis=1), np.concatenate(static), np.concatenate(sd)
    deviation = slot_deviation(live_m, static_v, sd_v)  # [T, C] in calibration SDs
    tokens = resources.decode_tokens(str(sel.model_dir) if sel.model_dir else "", tuple(int(t) for t in data["token"]))

    # Lazy tabs: only the open one runs and is drawn (a chart fewer on a first visit).
    keep("prof_section", PROFILE_SECTIONS[0], one_of(PROFILE_SECTIONS))  # the open tab, as left
    one_token, every_token = st.tabs(PROFILE_SECTIONS, key="prof_section", on_change="rerun")
    if one_token.open:
        with one_token:
            token_view(seq, chosen_sites, slots, live_m, static_v, deviation, tokens)
    if every_token.open:
        with every_token:
            heatmap_view(seq, slots, deviation, tokens)
    dev_df = pd.DataFrame(deviation, columns=slots)
    dev_df.insert(0, "token", tokens)
    dev_df.insert(0, "position", np.arange(T))
    download(dev_df, f"deviation_seq{seq}.csv", "Deviations (CSV)", key="dl-deviation")


STRIP_GENERATION = "prof_strip_generation"


def token_typed() -> None:
    """The token box changed: the strip chart starts over without a selection (`token_view`)."""
    st.session_state[STRIP_GENERATION] = st.session_state.get(STRIP_GENERATION, 0) + 1


@st.fragment
def token_view(seq, chosen_sites, slots, live_m, static_v, deviation, tokens) -> None:
    with guard("Token profile"):
        # A click on the token strip picks the token: apply it before the index widget is drawn. The
        # strip is keyed by sequence and by each typed token, so it starts without a selection then: a
        # click on the point clicked before counts again (a chart whose selection does not change sends
        # nothing), and another sequence never re-applies an old click over a typed token.
        strip_key = f"prof_strip::{seq}::{st.session_state.get(STRIP_GENERATION, 0)}"
        clicked = (st.session_state.get(strip_key) or {}).get("selection", {}).get("points", [])
        if clicked and st.session_state.get("prof_last_click") != (strip_key, clicked[0].get("x")):
            st.session_state["prof_last_click"] = (strip_key, clicked[0].get("x"))
            st.session_state["prof_token"] = int(clicked[0]["x"])
        keep("prof_token", 0, in_range(0, T - 1))
        c1, c2 = st.columns([3, 1])
        token = int(
            c1.number_input(
                "Token index (or click a point below)",
                0,
                T - 1,
                key="prof_token",
                on_change=token_typed,
                help=f"0 to {T - 1}",
            )
        )
        keep("prof_band", next(iter(BANDS)), one_of(BANDS))
        band_name = c2.selectbox("Calibration band", list(BANDS), key="prof_band")

        strip = pd.DataFrame({"pos": np.arange(T), "token": tokens, "deviation": np.sqrt((deviation**2).mean(1))})
        chart(figures.token_strip(strip, token), key=strip_key, on_select="rerun", selection_mode="points")

        lo_q, hi_q = BANDS[band_name]
        band = resources.calibration_band(str(reference.path), reference.fingerprint, lo_q, hi_q)
        profile = pd.DataFrame(
            {
                "slot": slots,
                "live": live_m[token],
                "static": static_v,
                "lo": np.concatenate([band[site][0] for site in chosen_sites]),
                "hi": np.concatenate([band[site][1] for site in chosen_sites]),
            }
        )
        chart(figures.profile_lines(profile, f"position {token} {tokens[token]!r}", band_name), key="prof_lines")
        download(profile, f"profile_seq{seq}_tok{token}.csv", "This token's profile (CSV)", key="dl-profile")


@st.fragment
def heatmap_view(seq, slots, deviation, tokens) -> None:
    with guard("Deviation heatmap"):
        start = 0
        if T > WINDOW:
            keep("prof_window", 0, in_range(0, T - WINDOW))
            start = st.slider("First position in the heatmap", 0, T - WINDOW, key="prof_window")
        span = slice(start, min(T, start + WINDOW))
        chart(
            figures.deviation_heatmap(
                deviation[span], slots, tokens[span], f"Sequence {seq}: deviation from the static profile", span.start
            ),
            key="prof_heatmap",
        )


sequence_view()
