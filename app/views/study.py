"""Study: one table across independently trained models (seeds), from a study file.

Studies are found at `<root>/study.json` and `<root>/<folder>/study.json` under the sidebar's roots
(`cache/` and FCA_CACHE_ROOTS), e.g. `cache/demo-study/study.json`; `python -m fca study` and
`python -m fca demo-study` write them. Audits are named relative to the study's folder.

The seed picker opens a seed in the other pages: when that seed's evaluated cache is on this machine,
it becomes the sidebar's cache selection (and its model, calibration cache and audit come with it)
and the Overview opens; when only its audit was committed, its audit report is shown here instead.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pandas as pd
import streamlit as st

from app import figures, resources
from app.views.common import chart, download, guard, selection, study_retention_frames, teach
from fca.tables import paper
from fca.tables import study as studies
from fca.tables.report import render_markdown
from fca.tables.text import markdown_code

# The sidebar's cache selectbox key (app/main.py): the seed picker sets it to open a seed's cache.
SIDEBAR_CACHE_KEY = "cache"
OPEN_REQUEST = "study_open_request"

sel = selection()
st.title("Study across seeds")
teach(
    "A single audit describes one trained model. A **study** puts the audits of independently trained models "
    "(the same configuration, different seeds) side by side: for each condition the mean over models, the sample "
    "standard deviation and a 95% Student t interval over models. The figure places every model on the "
    "**gap-retention** scale: 0 is the global-mean profile (no layer identity), 1 the model's own per-token "
    "coefficients; a static per-layer profile placed at 0.5 keeps half of what per-token control buys."
)

# A picked seed's cache was set in the button's callback (a widget's value can be changed only before
# it is drawn); the page switch happens here, in the script run that follows.
if st.session_state.pop(OPEN_REQUEST, False):
    st.switch_page("views/overview.py")

found = studies.find_studies(sel.roots)
if not found:
    st.info(
        "No study found under "
        + ", ".join(f"{markdown_code(r)}" for r in sel.roots)
        + ". A study is a `study.json` in a "
        "root or one folder below it. Make the demo's (trains seeds 1 and 2 of the demo configuration, adds the "
        "shipped demo as seed 0):"
    )
    st.code("python -m fca demo-study --seeds 1 2 --device cuda --out cache/demo-study", language="bash")
    st.markdown("or aggregate audits you already have:")
    st.code(
        "python -m fca study runs/seed*/audit.json \\\n"
        "    --json cache/my-study/study.json --markdown cache/my-study/study.md",
        language="bash",
    )
    st.stop()


def label(path: Path) -> str:
    for root in sel.roots:
        if path.is_relative_to(root):
            return str(path.relative_to(root))
    return str(path)


chosen = st.selectbox("Study", [str(p) for p in found], key="study_file", format_func=lambda p: label(Path(p)))
study_path = Path(chosen)
study = None
with guard("Study"):
    study = resources.study(str(study_path), resources.file_stamp(study_path))
if study is None:
    st.stop()

rows, summary = study["seeds"], study["summary"]
conditions = summary["conditions"]
retained = [c for c, s in conditions.items() if "gap_retention" in s]
points, spreads = study_retention_frames(study)
if retained:
    chart(
        figures.study_retention(points, spreads),
        key="study_retention",
        caption=f"study {label(study_path)} | {study['num_models']} models, seeds "
        + ", ".join(dict.fromkeys(points["seed"]))
        + " | conditions "
        + ", ".join(retained),
    )
    st.caption(paper.citation_sentence() + " Its band: the static-layer retention of its two gated configurations.")


n_models = study["num_models"]
st.subheader(f"Across {n_models} model{'s' if n_models != 1 else ''}")
st.caption(
    "mean ± sample SD over models [95% Student t interval over models]"
    if n_models > 1
    else "one model: its own figures; a spread and an interval need at least two independently trained models"
)
cell = studies.format_spread  # the cells of the study's Markdown, so the page and its download agree
st.markdown("\n".join(studies.conditions_table(study)))
st.markdown(
    f"- **Layer-identity share** of coefficient variance: {cell(summary['layer_identity_share'], 1, percent=True)}\n"
    f"- **Latency vs Dense twin**: {cell(summary['latency_ratio_vs_dense'], 3, of=n_models)}x\n"
    f"- **Blocks executed** per token: {cell(summary['blocks_executed_fraction'], 1, percent=True)}; "
    f"**controller FLOPs**: {cell(summary['controller_flops_share'], 2, percent=True)} of the forward"
)

st.subheader("Seeds")
table = pd.DataFrame(
    [
        {
            "seed": r["seed"],
            "model": r["name"],
            "fingerprint": r["fingerprint"][:12],
            "NLL correct": r["nll"].get("correct"),
            **{f"penalty {c}": r["penalty"].get(c) for c in conditions if c != "correct"},
            **{f"retention {c}": r["gap_retention"].get(c) for c in retained},
            "layer-id share": r["layer_identity_share"],
            "latency x": r["latency_ratio_vs_dense"],
            "trained on": (r.get("training") or {}).get("device"),
            "audit": r["audit"],
        }
        for r in rows
    ]
)


def shown(figure: str, value: object) -> str:
    """One cell of the turned table, in the units of its figure."""
    if value is None or (isinstance(value, float) and np.isnan(value)):
        return "–"
    if figure.startswith("retention "):
        return f"{100 * value:.1f}%"
    if figure == "layer-id share":  # a percent, as above the table, in the study's Markdown and every page
        return f"{100 * value:.1f}%"
    if figure == "latency x":
        return f"{value:.3f}x"
    return f"{value:.4f}" if isinstance(value, float) else str(value)


# What each seed is, said above the table: in it, the model's name, fingerprint and audit path made the
# seeds' columns so wide that three seeds scrolled sideways at 800 px.
IDENTITY = ("model", "fingerprint", "trained on", "audit")


def seed_names(rows: list[dict]) -> list[str]:
    names = [f"seed {r['seed']}" if r["seed"] is not None else r["name"] for r in rows]
    return [n if names.count(n) == 1 else f"{n} (#{i + 1})" for i, n in enumerate(names)]  # two audits of a seed


def by_figure(table: pd.DataFrame, rows: list[dict]) -> pd.DataFrame:
    """The seeds' figures turned: one row per figure, one column per seed, so that a figure's values across
    the seeds read along a row (a column per figure, fourteen of them, scrolled sideways on a 1024 px screen)."""
    measures = [c for c in table.columns if c != "seed" and c not in IDENTITY]
    return pd.DataFrame(
        {
            "figure": measures,
            **{n: [shown(f, row[f]) for f in measures] for n, (_, row) in zip(seed_names(rows), table.iterrows())},
        }
    )


def identity(name: str, row: pd.Series) -> str:
    """One seed's line above the table: its model, fingerprint, training device (where recorded) and audit."""
    trained = f", trained on {row['trained on']}" if pd.notna(row["trained on"]) else ""
    return f"- **{name}**: {markdown_code(row['model'])} ({row['fingerprint']}){trained}, audit {markdown_code(row['audit'])}"


# The figures' column a little wider than its longest name: sized by the grid to the name's measured width
# exactly, "retention token_shuffle" had no room to spare and could lose its last letter.
LABEL_CHAR_PX, LABEL_PAD_PX = 7, 24


def label_width(labels: pd.Series) -> int:
    return LABEL_PAD_PX + LABEL_CHAR_PX * max((len(str(label)) for label in labels), default=0)


st.markdown("\n".join(identity(name, row) for name, (_, row) in zip(seed_names(rows), table.iterrows())))
turned = by_figure(table, rows)
st.dataframe(
    turned,
    height="content",  # every figure at once (the default shows ten rows)
    hide_index=True,
    key="study_table",
    column_config={
        "figure": st.column_config.TextColumn(pinned=True, width=label_width(turned["figure"])),
        **{name: st.column_config.TextColumn(alignment="right") for name in turned.columns[1:]},
    },
)
st.caption("One column per seed; the CSV below has one row per seed, with the figures unrounded.")

st.subheader("Open one seed")
by_path = {str(e.path): e for e in sel.entries if e.error is None}


def evaluated_cache(row: dict) -> Path:
    return (study_path.parent / row["evaluated_cache"]).resolve()


def open_seed(index: int) -> None:
    """Callback of the Open button: select the seed's evaluated cache in the sidebar, then switch pages."""
    st.session_state[SIDEBAR_CACHE_KEY] = str(evaluated_cache(rows[index]))
    st.session_state[OPEN_REQUEST] = True


def seed_label(i: int) -> str:
    seed = "?" if rows[i]["seed"] is None else rows[i]["seed"]
    return f"seed {seed}: {rows[i]['name']} ({rows[i]['fingerprint'][:12]})"


# One box per study: with the same options (0, 1, 2) another study's box kept showing its own labels.
index = st.selectbox("Seed", list(range(len(rows))), key=f"study_seed:{chosen}", format_func=seed_label)
row = rows[index]
listed = by_path.get(str(evaluated_cache(row)))
# The path is the audit's cache folder beside the audit file: an audit written into another seed's folder
# points at that seed's cache, which must not open as this one's.
other_model = listed is not None and listed.model_fingerprint not in (None, row["fingerprint"])
if listed is not None and not other_model:
    st.caption(
        f"Its evaluated cache {markdown_code(label(evaluated_cache(row)))} is on this machine: opening it selects it in the "
        "sidebar (with its model, calibration cache and audit) and shows the Overview."
    )
    st.button("Open in the other pages", key="study_open", on_click=open_seed, args=(index,), type="primary")
else:
    audit_path = (study_path.parent / row["audit"]).resolve()
    if other_model:
        st.warning(
            f"{markdown_code(label(evaluated_cache(row)))} holds another model's cache (model {listed.model_fingerprint[:12]}, "
            f"not this seed's {row['fingerprint'][:12]}): its audit was written outside its own folder. This seed's "
            "audit report follows."
        )
    else:
        st.caption(
            f"Its evaluated cache is not among the caches this dashboard lists (`cache/` and `FCA_CACHE_ROOTS`; "
            f"for the shipped studies only its audit, {markdown_code(label(audit_path))}, was kept), so the other pages cannot "
            "open it; its audit report follows. Add its folder to FCA_CACHE_ROOTS, or regenerate models and caches "
            "with the command that made the study (the README's Multi-seed studies gives the shipped studies')."
        )
    with guard("Audit report"):
        text = render_markdown(resources.report(str(audit_path), resources.file_stamp(audit_path)))
        # Inside the page, under its own headings: each of the report's headings two levels down.
        st.markdown(re.sub(r"^(#+) ", lambda m: "#" * min(len(m[1]) + 2, 6) + " ", text, flags=re.M))

d1, d2 = st.columns(2)
with d1:
    download(table, "study_seeds.csv", "Seeds (CSV)", key="study_csv")
with d2:
    st.download_button(
        "Study (Markdown)", studies.render_markdown(study), file_name="study.md", mime="text/markdown", key="study_md"
    )
