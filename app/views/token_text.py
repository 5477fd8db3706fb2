"""Token text: one sequence as text, each token coloured by a site's coefficient or by its deviation from
the static profile, so a reader sees which words the controller treats differently."""

from __future__ import annotations

import numpy as np
import streamlit as st

from app import figures, resources
from app.views.common import download, guard, in_range, keep, one_of, require_cache, teach

MEAN = "mean of all"  # short: the box is narrow
COEFFICIENT, DEVIATION = "coefficient", "deviation from the static profile"

sel = require_cache()
cache = sel.cache
st.title("Token text")
teach(
    "The evaluated sequence as text. Each token's background is the coefficient that one controller site "
    "gave it (a channel, or the mean over the site's channels), or how far that coefficient is from the "
    "**static profile** (the calibration mean of the site and channel, the value the `static_layer` "
    "condition puts at every token). Tokens far from white in deviation mode are the ones per-token "
    "control treats differently. Hover a token for its values."
)

c1, c2, c3, c4 = st.columns([5, 6, 6, 6])  # the Sequence label and its help whole at 800 px ([2, 3, 3, 3] broke it)
keep("tt_seq", 0, in_range(0, cache.num_seqs - 1))
keep("tt_site", cache.sites[0], one_of(cache.sites))
seq = int(c1.number_input("Sequence", 0, cache.num_seqs - 1, key="tt_seq", help=f"0 to {cache.num_seqs - 1}"))
site = c2.selectbox("Site", list(cache.sites), key="tt_site")
with guard("Sequence"):
    data = resources.sequence(str(cache.path), cache.fingerprint, seq)
    coefficients = np.asarray(data[site], dtype=float)  # [T, K]
    width = coefficients.shape[1]
    # Channels by the names the Variance and Profiles pages give them (attn.0, mlp.5, ...), where the site has them.
    labels = cache.site_specs[site].channel_names()
    keep("tt_channel", MEAN, one_of([MEAN, *range(width)]))
    channel = c3.selectbox(
        "Channel",
        [MEAN, *range(width)],
        key="tt_channel",
        format_func=lambda k: k if k == MEAN else labels[k],
        help="one channel, or the mean over the site's channels",
    )
    cal = sel.static_profile_cache
    modes = [COEFFICIENT, DEVIATION] if cal is not None else [COEFFICIENT]
    keep("tt_mode", modes[0], one_of(modes))
    mode = c4.radio(
        "Colour by",
        modes,
        key="tt_mode",
        # One word an option: "deviation from the static profile" wrapped mid-phrase in its column at 800 px.
        format_func=lambda m: "deviation" if m == DEVIATION else m,
        help="coefficient: the value itself; deviation: from the static profile (the calibration mean of the site "
        "and channel), which needs a calibration cache of this model",
    )
    if cal is None:
        st.caption("No calibration cache of this model was found: deviations from the static profile are unavailable.")

    static = None
    if cal is not None:
        static = np.asarray(resources.profiles(str(cal.path), cal.fingerprint).static[site], dtype=float)  # [K]
    pick = (lambda a: a.mean(axis=-1)) if channel == MEAN else (lambda a: a[..., int(channel)])
    coefficient = pick(coefficients)  # [T]
    profile = None if static is None else float(pick(static))
    deviation = None if profile is None else coefficient - profile  # [T]
    ids = tuple(int(t) for t in data["token"])
    tokens = resources.decode_tokens(str(sel.model_dir) if sel.model_dir else "", ids)

    titles = [
        f"position {t}: {tok!r} | coefficient {coefficient[t]:.4f}"
        + ("" if profile is None else f" | static profile {profile:.4f} | deviation {deviation[t]:+.4f}")
        for t, tok in enumerate(tokens)
    ]
    shown = deviation if mode == DEVIATION else coefficient
    html, lo, hi = figures.token_text_html(tokens, shown, titles, diverging=mode == DEVIATION)
    what = f"{site}, {'channel mean' if channel == MEAN else f'channel {labels[channel]}'}: " + (
        # raw, unlike the Profiles and Variance pages' deviations in calibration SDs: said, so the two are not compared
        "coefficient minus the static profile, the raw difference (unitless; not in calibration SDs as on the "
        "Profiles and Variance pages)"
        if mode == DEVIATION
        else "coefficient value (unitless)"
    )
    st.html(figures.colour_legend_html(lo, hi, mode == DEVIATION, what))
    st.html(html)
    rows = [
        {
            "position": t,
            "token": tok,
            "coefficient": float(coefficient[t]),
            "static_profile": profile,
            "deviation_from_static": None if deviation is None else float(deviation[t]),
        }
        for t, tok in enumerate(tokens)
    ]
    download(rows, f"token_text_seq{seq}.csv", "Token values (CSV)", key="tt_csv")
