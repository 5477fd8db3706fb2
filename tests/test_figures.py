"""Figures for a light or a dark page (`figures.themed`), read off the plotly figure objects: every text colour
they set stands out from the page's background, and the marks drawn in ink turn light on a dark page."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from app import figures

BACKGROUNDS = {"light": "#ffffff", "dark": "#171614"}  # the dashboard's pages (Streamlit's light and dark)


def contrast(a: str, b: str) -> float:
    """WCAG contrast ratio of two opaque colours (#rrggbb)."""

    def luminance(colour: str) -> float:
        rgb = [int(colour[i : i + 2], 16) / 255 for i in (1, 3, 5)]
        lin = [v / 12.92 if v <= 0.03928 else ((v + 0.055) / 1.055) ** 2.4 for v in rgb]
        return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]

    hi, lo = sorted((luminance(a), luminance(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


def test_contrast_matches_wcag_examples():
    assert contrast("#000000", "#ffffff") == pytest.approx(21.0)
    assert contrast("#777777", "#ffffff") == pytest.approx(4.48, abs=0.01)  # the grey that just fails AA


def every_figure() -> dict[str, object]:
    """One of each figure the pages draw whose marks or labels carry colours of their own."""
    conditions = {
        "correct": {"nll": 3.4, "penalty": 0.0, "penalty_ci95": [0.0, 0.0]},
        "static_layer": {"nll": 3.9, "penalty": 0.5, "penalty_ci95": [0.45, 0.55]},
        "global_mean": {"nll": 4.2, "penalty": 0.8, "penalty_ci95": [0.75, 0.85]},
    }
    points = pd.DataFrame({"condition": ["static_layer"] * 2, "seed": ["0", "1"], "retention": [0.4, 0.42]})
    summary = pd.DataFrame({"condition": ["static_layer"], "mean": [0.41], "lo": [0.38], "hi": [0.44]})
    strip = pd.DataFrame({"pos": range(8), "token": list("abcdefgh"), "deviation": np.linspace(0, 2, 8)})
    profile = pd.DataFrame({"slot": ["a/0", "a/1"], "live": [1, 2], "static": [1, 1], "lo": [0, 0], "hi": [2, 2]})
    factors = pd.DataFrame({"factor": ["site", "token"], "share": [0.2, 0.5], "chance": [0.01, 0.1]})
    return {
        "retention_scale": figures.retention_scale(conditions, {"static_layer": 0.375}),
        "sweep_curve": figures.sweep_curve(
            [{"alpha": 0.5, "nll": 3.6, "penalty": 0.2, "penalty_ci95": [0.15, 0.25]}], conditions
        ),
        "study_retention": figures.study_retention(points, summary),
        "token_strip": figures.token_strip(strip, 2),
        "profile_lines": figures.profile_lines(profile, "position 0 'a'", "5-95%"),
        "factor_bars": figures.factor_bars(factors),
    }


def text_colours(fig) -> list[str]:
    """Every colour the figure sets on text of its own: the page font, annotations, traces' text."""
    colours = [fig.layout.font.color]
    colours += [note.font.color for note in fig.layout.annotations]
    colours += [trace.textfont.color for trace in fig.data if "textfont" in trace]
    return [c for c in colours if isinstance(c, str)]


@pytest.mark.parametrize("theme", ["light", "dark"])
def test_every_text_colour_stands_out_from_the_page(theme):
    background = BACKGROUNDS[theme]
    for name, fig in every_figure().items():
        shown = figures.themed(fig, theme)
        assert shown.layout.paper_bgcolor == shown.layout.plot_bgcolor == "rgba(0,0,0,0)"  # the page behind it
        colours = text_colours(shown)
        assert shown.layout.font.color in colours, name
        low = {c: round(contrast(c, background), 2) for c in colours if contrast(c, background) < 4.5}
        assert not low, f"{name} in {theme}: {low}"


def test_ink_turns_light_on_a_dark_page():
    found = every_figure()
    # The chance-level mark, the mean's whiskers, the token strip's labels, the calibration band: dark on dark
    # before, each now the dark theme's own colour.
    chance = figures.themed(found["factor_bars"], "dark").data[1].marker
    assert contrast(chance.color, BACKGROUNDS["dark"]) > 4.5 and chance.color != figures.INK
    mean = figures.themed(found["study_retention"], "dark").data[0]
    assert contrast(mean.error_y.color, BACKGROUNDS["dark"]) > 4.5
    scale = figures.themed(found["retention_scale"], "dark")
    assert all(contrast(t.error_x.color, BACKGROUNDS["dark"]) > 4.5 for t in scale.data)  # (plotly's #444 before)
    band = figures.themed(found["profile_lines"], "dark").data[1]
    assert band.fillcolor == figures.THEMES["dark"].swap[figures.BAND_FILL]
    # The figure itself is untouched: the slides' copy starts from it, on white.
    assert found["factor_bars"].data[1].marker.color == figures.INK


def test_titles_are_one_line_with_their_detail_below():
    fig = figures.site_distributions(
        pd.DataFrame({k: [0.5] for k in ("q01", "q05", "q25", "q50", "q75", "q95", "q99", "mean")} | {"site": ["a"]})
    )
    assert fig.layout.title.text == "Coefficients per site" and "<br>" not in fig.layout.title.text
    assert fig.layout.title.subtitle.text == "box 25-75%, whiskers 5-95%"
    for fig in every_figure().values():
        assert "<br>" not in (fig.layout.title.text or "")


def test_study_reference_labels_sit_on_their_lines():
    fig = every_figure()["study_retention"]
    lines = {shape.y0 for shape in fig.layout.shapes if shape.type == "line"}
    labels = [n for n in fig.layout.annotations if n.text.startswith(("global mean", "correct"))]
    assert len(labels) == 2
    for label in labels:
        # at the line's right end, beside the plot, its middle level with the line
        assert label.y in lines and label.yanchor == "middle"
        assert (label.xref, label.x, label.xanchor) == ("paper", 1, "left")
    assert fig.layout.margin.r >= figures.REFERENCE_LABEL_PX


def test_token_axis_labels_what_fits():
    assert figures.token_step(12) == 1  # 12 x 17 px fit 210 px: all labelled
    assert figures.token_step(32) == 3 and figures.token_step(64) == 6
    assert [figures.ordinal(n) for n in (2, 3, 4, 11, 12, 13, 21, 22)] == [
        "2nd",
        "3rd",
        "4th",
        "11th",
        "12th",
        "13th",
        "21st",
        "22nd",
    ]
    z = pd.DataFrame(np.zeros((2, 32)), index=["a", "b"], columns=range(32))
    axis = figures.token_layer_heatmap(z, [f"t{i}" for i in range(32)], "v", "t").layout.xaxis
    assert list(axis.tickvals) == [f"{i}:t{i}" for i in range(0, 32, 3)] and axis.tickfont.size >= 12
    assert "every 3rd labelled" in axis.title.text


@pytest.mark.slow
def test_theme_switch_draws_the_charts_for_the_page_with_either_display(monkeypatch):
    """The sidebar's Theme switch: its choice is the charts' (transparent, the theme's text), in presenter view
    too, and once used, the page is told to take it (the script that sets the browser's theme)."""
    import json

    from tests.test_app import REPO, app_for, no_exceptions

    at = app_for(monkeypatch, [REPO / "cache"], REPO / "cache" / "demo" / "eval")
    at.run()
    no_exceptions(at)
    switch = at.sidebar.get("button_group")[1]  # (Display, then Theme)
    assert switch.label == "Theme" and switch.value == "light"  # AppTest's browser says nothing: light
    assert not [h for h in at.sidebar.get("html") if "setAndSendTheme" in h.proto.body]
    for display in ("standard", "presenter"):
        at.session_state["fca_display"] = display
        switch.set_value("dark").run()
        no_exceptions(at)
        spec = json.loads(at.get("plotly_chart")[0].proto.spec)
        assert spec["layout"]["font"]["color"] == figures.THEMES["dark"].text
        assert spec["layout"]["paper_bgcolor"] == "rgba(0,0,0,0)"
        assert spec["layout"]["font"].get("size") == (16 if display == "presenter" else None)  # (else: the template's)
        assert any('"Dark"' in h.proto.body for h in at.sidebar.get("html"))
        switch.set_value("light").run()
        spec = json.loads(at.get("plotly_chart")[0].proto.spec)
        assert spec["layout"]["font"]["color"] == figures.THEMES["light"].text
        assert any('"Light"' in h.proto.body for h in at.sidebar.get("html"))
