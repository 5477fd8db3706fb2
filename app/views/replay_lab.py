"""Replay lab: run conditions on the frozen model from the UI, save each run beside the cache.

State, in words: one run at a time per session (`JOB_KEY`), in a background thread (app/jobs.py).
While it runs every setting is disabled and a fragment polls its progress; when it ends the page
reruns once and shows the result with the settings and command of *that* run (read from its record),
apart from the live preview of what the form would run next. A finished run of another cache is not
shown (its error or "cancelled" note belongs to that cache), and a newly saved run joins "Compare runs".
The page never waits for the model: a run loads it as its first step, unless the warm-up or an earlier
run has (its errors, such as a model that did not make this cache, are then the run's).
"""

from __future__ import annotations

import html
from pathlib import Path

import numpy as np
import pandas as pd
import streamlit as st

from app import figures, resources
from app.jobs import QUICK_BATCH, QUICK_SEQUENCES, ReplayJob
from app.views.common import chart, download, figure_caption, guard, require_cache, teach
from fca.tables.audit_report import Exactness
from fca.tables.conditions import Condition, as_conditions
from fca.tables.report import NO_INTERVAL, condition_cell, documents_note, exactness_sentences, few_sequences_caution
from fca.tables.runs import (
    SWEEP_ALPHAS,
    condition_rows,
    replay_command,
    run_label,
    run_labels,
    runs_writable,
    saved_run_rows,
    sweep_conditions,
    sweep_points,
)
from fca.tables.stats import MIN_BOOTSTRAP_VALUES
from fca.tables.text import markdown_code, markdown_text

JOB_KEY = "replay_job"
KINDS = {
    "cross_input": "another sequence's coefficients (seeded derangement)",
    "token_shuffle": "positions shuffled within the sequence",
    "static_layer": "the calibration mean of each slot, at every token",
    "global_mean": "one grand mean per coefficient family, everywhere",
    "interpolate": "alpha x live + (1 - alpha) x static profile",
    "position_profile": "the calibration mean at each position",
}
# Default batch: the batches the cache was built in, where a cache made on this machine must replay bit for
# bit (in others it is held only to the tolerances of another environment, and a lab run said "within
# tolerance" of the shipped demo); else 2, as progress and Cancel act between batches. Results depend on the
# batch composition, so each result's command carries its --batch and gives the same numbers.
DEFAULT_BATCH = 2
# Enough sequences for figures to quote: `few_sequences_caution` warns below 20, and the demo's first 64
# windows lie in 7 chapters, too few for a CI over documents (`MIN_DOCUMENTS`, 10; 96 windows: 10).
DEFAULT_SEQUENCES = 96
MAX_BATCH = 256
# name -> the form's settings it sets (the rest stay as they are); "freeze one layer" takes the first site.
PRESETS = {
    "The paper's experiment": {
        "lab_kinds": ["cross_input", "token_shuffle", "static_layer", "global_mean"],
        "lab_sites": [],
        "lab_sweep": False,
    },
    "Interpolation sweep": {"lab_kinds": ["static_layer", "global_mean"], "lab_sites": [], "lab_sweep": True},
    "Freeze one layer": {"lab_kinds": ["static_layer", "global_mean"], "lab_sweep": False, "lab_sites": None},
}


def apply_preset(name: str) -> None:
    """A preset's settings, set before the form's widgets are drawn (a button's callback)."""
    for key, value in PRESETS[name].items():
        st.session_state[key] = value if value is not None else cache.sites[:1]


def quick_mode() -> None:
    """Few sequences in small batches: a run that finishes in seconds, for a lecture (wider CIs, said by
    them), its count moving after every batch."""
    st.session_state["lab_num_seqs"] = min(QUICK_SEQUENCES, cache.num_seqs)
    st.session_state["lab_batch"] = QUICK_BATCH


def replay(**settings) -> dict:
    """`fca.jobs.runs.run_replay`, imported in the run's thread: importing torch in the page's own run
    held the first progress line back by seconds on a freshly started server."""
    from fca.jobs.runs import run_replay

    return run_replay(**settings)


def import_torch() -> None:
    import fca.jobs.runs  # noqa: F401 (torch and the replay engine)


def import_transformers() -> None:
    from fca.jobs.families import import_transformers

    import_transformers()


def import_model_code() -> None:
    from fca.jobs.families import load_builtin_families

    load_builtin_families()


# What a run loads before the model, each step named by the progress line while it lasts (on a freshly
# started server they take seconds; loaded already, no time at all).
PREPARING = (
    ("torch", import_torch),
    ("transformers", import_transformers),
    ("the model families' code", import_model_code),
)


# Columns the shared bar figures read (app/figures.py), from the plain names of our tables.
FIGURE_COLUMNS = {
    "NLL (nats/token)": "nll",
    "NLL 95% CI low": "ci_lo",
    "NLL 95% CI high": "ci_hi",
    "penalty (nats/token)": "penalty",
    "penalty 95% CI low": "lo",
    "penalty 95% CI high": "hi",
}


# The result as shown: nats to four decimals, as the audit report gives them, each 95% CI in one cell so
# that a row fits a 1024 px screen (eight columns scrolled sideways); the CSV keeps every bound apart. One
# penalty interval, the one to quote (over documents where the run has it, as the chart and the Overview's
# table), and the NLL's drawn in the chart below: with three intervals the table scrolled sideways at 800 px.
RESULT_COLUMNS = {
    "condition": st.column_config.TextColumn(pinned=True),
    "NLL": st.column_config.NumberColumn(format="%.4f", help="mean NLL over sequences, nats/token"),
    "penalty": st.column_config.NumberColumn(format="%.4f", help="NLL minus correct's, nats/token"),
    "penalty 95% CI": st.column_config.TextColumn(help="95% paired bootstrap CI over sequences", alignment="right"),
    # one decimal, as in the audit report and every page ("percent" gave "44.8%", "-12.44%", "70.63%")
    "gap retention": st.column_config.TextColumn(
        help="percent of the way from global mean to correct, [its 95% bootstrap CI] as the audit's",
        alignment="right",
    ),
    "same experts": st.column_config.NumberColumn(
        format="percent", help="tokens that ran the same experts as on their own coefficients (read at the experts)"
    ),
    "experts kept": st.column_config.NumberColumn(format="percent", help="mean share of each token's k experts kept"),
    "weight kept": st.column_config.NumberColumn(
        format="percent", help="mean share of each token's own mixing weight left on the same experts"
    ),
}


def result_view(result: pd.DataFrame, intervals: bool = True) -> pd.DataFrame:
    """`condition_rows` as shown: short headers (units in each header's help), the penalty's interval to quote
    in one cell (over documents where the run has it; every interval is in the CSV, the NLL's in its chart);
    not `intervals` (a run too short for them): no interval column."""

    def interval(lo: str, hi: str) -> list[str]:
        # NaN bounds: too few sequences give no interval, said so rather than drawn as "nan to nan"
        return [
            f"{a:.4f} to {b:.4f}" if np.isfinite(a) and np.isfinite(b) else NO_INTERVAL
            for a, b in zip(result[lo], result[hi])
        ]

    view = pd.DataFrame(
        {
            "condition": result["condition"],
            "NLL": result["NLL (nats/token)"],
            "penalty": result["penalty (nats/token)"],
            # (a cache built from a corpus records its documents)
            "penalty 95% CI": interval("penalty 95% CI low (documents)", "penalty 95% CI high (documents)")
            if "penalty 95% CI low (documents)" in result
            else interval("penalty 95% CI low", "penalty 95% CI high"),
        }
    )
    if not intervals:
        view = view.drop(columns="penalty 95% CI")
    if "gap retention" in result:
        # One cell: the retention and its 95% CI (a column of its own made the table scroll sideways at 800 px).
        def retention_cell(i: int) -> str:
            value = result["gap retention"].iloc[i]
            if value is None or not np.isfinite(value):
                return "undefined"
            low = result["gap retention 95% CI low"].iloc[i] if "gap retention 95% CI low" in result else np.nan
            high = result["gap retention 95% CI high"].iloc[i] if "gap retention 95% CI high" in result else np.nan
            ci = f" [{100 * low:.1f}, {100 * high:.1f}]" if np.isfinite(low) and np.isfinite(high) else ""
            return f"{100 * value:.1f}%{ci}"

        view["gap retention"] = [retention_cell(i) for i in range(len(result))]
    for column in ("same experts", "experts kept", "weight kept"):
        if column in result:
            view[column] = result[column]
    return view


def frozen_sites_note(conditions: list[str], every: list[str]) -> str:
    """What a chart title adds for a run that froze only some sites: ": sites frozen a, b" (empty when
    its conditions froze every site). Names read from the cache are escaped: plotly reads tags in titles."""
    frozen = [s for c in as_conditions([c for c in conditions if c != "correct"], 0) for s in (c.sites or every)]
    frozen = list(dict.fromkeys(frozen))
    if not frozen or sorted(frozen) == sorted(every):
        return ""
    return f": site{'s' if len(frozen) > 1 else ''} frozen {html.escape(', '.join(frozen))}"


def rel(path: str | Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


sel = require_cache()
cache = sel.cache
st.title("Replay lab")
teach(
    "Here the controllers are switched off and the model is fed coefficients you choose. **Correct** (each token's "
    "own recorded coefficients) always runs and must reproduce the live model exactly; every other condition is "
    "scored by its **penalty**: the extra NLL in nats per token, with a 95% bootstrap CI (over whole documents where "
    "the cache records them: windows of one document are not independent). A penalty "
    "near zero means the model does not need what the controller computes per token. Each run is saved beside the "
    "cache, shown with its own settings and the command that reproduces it from the CLI with the same numbers."
)

if sel.model_dir is None:
    st.error("The replay lab needs the model directory the cache names, beside the cache; none was found.")
    st.stop()

if sel.is_calibration:
    evaluated = sel.evaluated_caches()
    st.info(
        "This is a calibration cache: it provides the static profile, and the lab replays an evaluated cache "
        "of the same model against it. "
        + (
            f"Pick {markdown_code(evaluated[0].label)} in the sidebar."
            if evaluated
            else "Build one with `python -m fca build-cache --split eval`."
        )
    )
    running: ReplayJob | None = st.session_state.get(JOB_KEY)
    if running is not None and running.running:  # its progress and Cancel are on the page of its cache
        st.caption(
            f"A run of {markdown_code(rel(running.settings['cache']))} is in progress: select that cache to follow or cancel it."
        )
    st.stop()

if sel.calibration is None:
    st.error(
        "The replay lab needs a calibration cache of the same model (a different split) beside this one; "
        "none was found."
    )
    st.stop()
selection = (sel.model_dir, sel.device, cache, sel.calibration_cache, sel.dense_dir)
if resources.experiment_ready(*selection):
    opened = None
    with guard("Model"):
        opened = resources.experiment(*selection)
    if opened is None:
        st.stop()
    experiment = opened[0]
    st.caption(
        f"Model {markdown_code(sel.model_dir.name)} (fingerprint {markdown_code(experiment.model_fingerprint[:12])}) on **{experiment.device}** "
        f"matches the cache; calibration: {markdown_code(sel.calibration.label)}."
    )
else:  # not loaded yet: the page draws at once, the model loads meanwhile, and a run waits for it
    resources.preload_experiment(*selection)
    st.caption(
        f"Model {markdown_code(sel.model_dir.name)}: loading in the background and checked against the cache (a run "
        f"started before it is ready shows it as its first step), then kept for the next runs; calibration: "
        f"{markdown_code(sel.calibration.label)}."
    )

job: ReplayJob | None = st.session_state.get(JOB_KEY)
if job is not None and not job.running and job.settings["cache"] != str(cache.path):
    # A finished run of another cache: its result, error or "cancelled" note does not belong here.
    del st.session_state[JOB_KEY]
    job = None
busy = job is not None and job.running


def form_settings(kinds: list[str], freeze: list[str], alpha: float, independent: bool, sweep: bool) -> dict:
    """run_replay's keyword arguments for the form's values (what Run would run)."""
    seed = int(st.session_state["lab_seed"])
    sites = tuple(freeze) or None
    conditions = [
        Condition(kind, alpha if kind == "interpolate" else None, sites, kind == "token_shuffle" and independent, seed)
        for kind in kinds
        if not (sweep and kind == "interpolate")
    ]
    if sweep:
        conditions += sweep_conditions(freeze, seed)
    return dict(
        model=str(sel.model_dir),
        cache=str(cache.path),
        calibration=str(sel.calibration.path),
        conditions=list(dict.fromkeys(c.spec for c in conditions)),
        num_seqs=int(st.session_state["lab_num_seqs"]),
        seed=seed,
        device=sel.device,
        batch_size=int(st.session_state["lab_batch"]),
        save=runs_writable(cache.path),  # a read-only cache's runs are shown, not saved
    )


# The form's settings are also kept under KEPT_KEY: Streamlit forgets a widget's value once its page is
# left, and the form must come back as it was (while a run is in progress: as that run was started).
KEPT_KEY = "lab_kept_settings"


def fitted_settings(values: dict) -> dict:
    """The form's settings (widget key -> value) made valid for this cache: its own sites only, and a
    number of sequences it has."""
    fewest = min(2, cache.num_seqs)
    return {
        **values,
        "lab_sites": [s for s in values["lab_sites"] if s in cache.sites],
        "lab_num_seqs": max(fewest, min(int(values["lab_num_seqs"]), cache.num_seqs)),
    }


def keep_settings() -> None:
    """Before the widgets are drawn: each setting as the user left it, else its default, fitted to this
    cache; and the values kept for the next visit."""
    state = st.session_state
    defaults = {
        "lab_kinds": ["static_layer", "global_mean"],
        "lab_sites": [],
        "lab_sweep": False,
        "lab_alpha": 0.5,
        "lab_independent": False,
        "lab_num_seqs": min(DEFAULT_SEQUENCES, cache.num_seqs),
        "lab_seed": 0,
        "lab_batch": min(MAX_BATCH, (cache.environment or {}).get("batch_size") or DEFAULT_BATCH),
    }
    kept = state.get(KEPT_KEY, {})
    values = fitted_settings({k: state[k] if k in state else kept.get(k, default) for k, default in defaults.items()})
    for key, value in values.items():
        if key not in state or state[key] != value:
            state[key] = value
    state[KEPT_KEY] = values


@st.fragment
def settings_form() -> None:
    """The settings, a live preview of the command they give, and Run. A fragment: changing a setting
    reruns only this part; Run starts the job and reruns the page, which then draws everything locked."""
    current: ReplayJob | None = st.session_state.get(JOB_KEY)
    locked = current is not None and current.running
    keep_settings()
    with st.container(horizontal=True):
        for name in PRESETS:
            st.button(name, key=f"lab_preset::{name}", on_click=apply_preset, args=(name,), disabled=locked)
        st.button(
            f"Quick ({min(QUICK_SEQUENCES, cache.num_seqs)} sequences)",
            key="lab_quick",
            on_click=quick_mode,
            disabled=locked,
            icon=":material/bolt:",
            help=f"the first few sequences in batches of {QUICK_BATCH}: seconds instead of a minute, with wider CIs",
        )
    with st.container(border=True):
        c1, c2 = st.columns([3, 2])
        kinds = c1.multiselect(
            "Conditions (correct always runs)",
            list(KINDS),
            key="lab_kinds",
            disabled=locked,
            help="; ".join(f"{k}: {v}" for k, v in KINDS.items()),
        )
        freeze = c2.multiselect(
            "Freeze only these sites (empty: all sites)",
            cache.sites,
            key="lab_sites",
            disabled=locked,
            help="the other sites keep their correct coefficients",
        )
        c3, c4 = st.columns(2)  # two rows: five columns cut the checkboxes' labels at 1024 px
        sweep = c3.checkbox(
            "Interpolation sweep",
            key="lab_sweep",
            disabled=locked,
            help=f"interpolate at alpha {', '.join(f'{a:g}' for a in SWEEP_ALPHAS)} in one run, drawn as NLL "
            "against alpha (0 = static profile, 1 = each token's own coefficients)",
        )
        alpha = c3.slider(
            "alpha (interpolate)",
            0.0,
            1.0,
            step=0.05,
            key="lab_alpha",
            disabled=locked or sweep or "interpolate" not in kinds,
            help="used by the interpolate condition: 1 = live coefficients, 0 = static profile",
        )
        independent = c4.checkbox(
            "token_shuffle per site",
            key="lab_independent",
            disabled=locked,
            help="token_shuffle with one permutation per site (by default one per sequence, shared by all sites)",
        )
        c5, c6, c7 = st.columns(3)
        c5.number_input(
            "Sequences",
            min(2, cache.num_seqs),
            cache.num_seqs,
            key="lab_num_seqs",
            disabled=locked,
            help=f"the first N of this cache's {cache.num_seqs} ({min(2, cache.num_seqs)} to {cache.num_seqs})",
        )
        c6.number_input("Seed", 0, 2**31 - 1, key="lab_seed", disabled=locked, help="0 to 2^31 - 1")
        c7.number_input(
            "Batch size",
            1,
            MAX_BATCH,
            key="lab_batch",
            disabled=locked,
            help=f"sequences per forward pass (1 to {MAX_BATCH}; by default the batches the cache was built in, "
            "where a cache made on this machine replays bit for bit); progress and Cancel act between batches, "
            "and results depend on the batch composition (the command below carries it)",
        )
        settings = form_settings(kinds, freeze, alpha, independent, sweep)
        if kinds or sweep:
            explained = [f"**{k}**: {KINDS[k]}" for k in kinds if not (sweep and k == "interpolate")]
            if sweep:
                explained.append(
                    f"**interpolation sweep**: {KINDS['interpolate']}, alpha "
                    + ", ".join(f"{a:g}" for a in SWEEP_ALPHAS)
                )
            st.caption("  \n".join(explained))
        if not settings["save"]:
            st.caption("This cache's folder is read-only: runs are shown here but not saved beside it.")
        st.caption(
            "**Preview, not yet run**: the command these settings give"
            + (" (locked while a run is in progress)" if locked else "")
        )
        # One option a line; a line still too long (many conditions, a long path) wraps in the box, which
        # scrolled sideways at 800 px (copying gives the command as it is, unwrapped).
        st.code(replay_command(settings, Path.cwd(), one_option_per_line=True), language="bash", wrap_lines=True)
        if st.button("Run", type="primary", disabled=locked, key="lab_run"):
            with guard("Replay"):
                started = ReplayJob(settings, total=settings["num_seqs"])
                started.start(replay, open_experiment=lambda: resources.experiment(*selection), preparing=PREPARING)
                st.session_state[JOB_KEY] = started
                st.rerun()  # the whole page: lock the form, drop the previous result, show progress


settings_form()


# What the last whole-page run drew: (which job, was it running). The progress fragment compares it
# with the job's state to know when the page must rerun to show a result.
RENDERED_KEY = "lab_rendered_job"
st.session_state[RENDERED_KEY] = (id(job), busy) if job is not None else None


def cancel(current: ReplayJob) -> None:
    current.stop.set()  # a callback: it runs first thing in the rerun the click causes


@st.fragment(run_every=0.5 if busy else None)
def progress_panel() -> None:
    """Polls the background run; when it has ended, reruns the whole page to draw the result. Asked on
    every poll until a whole-page run has drawn the ended job, so a rerun request lost in a race with
    the poll's own is asked again half a second later."""
    current: ReplayJob | None = st.session_state.get(JOB_KEY)
    if current is None:
        return
    if current.running:
        resources.page_ran()  # the background warm-up waits while a run is in progress
        elapsed = f"{current.elapsed:.0f} s"
        if current.phase in ("queued", "loading"):
            st.progress(0.0, text=f"Loading {current.step or 'the model'}… ({elapsed})")
        else:
            total = max(current.total, 1)
            st.progress(
                min(current.done / total, 1.0),
                text=f"Replaying: {current.done} / {current.total} sequences ({elapsed})",
            )
        if current.settings["cache"] != str(cache.path):
            st.caption(f"This run replays {markdown_code(rel(current.settings['cache']))}.")
        stopping = current.stop.is_set()
        st.button("Cancel", key="lab_cancel", disabled=stopping, on_click=cancel, args=(current,))
        if stopping:
            st.caption("Cancelling: the run stops before its next batch…")
    elif st.session_state.get(RENDERED_KEY) != (id(current), False):
        st.rerun()


progress_panel()

if job is not None and not job.running:
    if job.cancelled:
        st.warning(f"Cancelled after {job.done} of {job.total} sequences; nothing was saved.")
    elif job.error:
        st.error(f"The run failed: {markdown_text(job.error)}")
    elif job.record is not None:
        record = job.record
        spec = record["spec"]
        # The result's own settings: from its record (what actually ran), paths from the job.
        ran = {**job.settings, **{k: spec[k] for k in ("conditions", "num_seqs", "seed", "batch_size")}}
        st.subheader(f"Result: {run_label(spec, condition_cell)}")
        n = spec["num_seqs"]
        which = (
            f"all **{n}** sequences"
            if n >= cache.num_seqs
            else f"the first **{n}** of the cache's {cache.num_seqs} sequences (NLLs of those, not the audit's)"
        )
        st.markdown(
            f"Conditions {', '.join(f'{markdown_code(c)}' for c in spec['conditions'])} on {which}, "
            f"seed **{spec['seed']}**, batch **{spec['batch_size']}**, on **{markdown_text(record.get('device'))}**."
        )
        if caution := few_sequences_caution(spec["num_seqs"]):
            st.warning(caution)
        st.caption("The command that reproduces this result:")
        st.code(replay_command(ran, Path.cwd(), one_option_per_line=True), language="bash", wrap_lines=True)
        checks = exactness_sentences(Exactness.read(record["results"]["exactness"], "exactness"))  # all three
        st.success("  \n".join([*map(markdown_text, checks), f"Saved {markdown_code(rel(record.get('path', '')))}."]))
        result = pd.DataFrame(condition_rows(record))
        by_document = "penalty 95% CI low (documents)" in result  # (a cache built from a corpus records them)
        intervals = spec["num_seqs"] >= MIN_BOOTSTRAP_VALUES  # (fewer have none: `paired_bootstrap_ci`)
        st.caption(
            (
                "NLL and penalty in nats/token; the penalty's 95% paired bootstrap CI "
                + ("resampling documents (over sequences in the CSV)" if by_document else "over sequences")
                + ", the NLL's over sequences in the chart below. "
                if intervals
                else f"NLL and penalty in nats/token, without CIs (under {MIN_BOOTSTRAP_VALUES} sequences). "
            )
            + (documents_note(record["spec"]["num_seqs"], record["results"].get("documents")) or "")
        )
        columns = RESULT_COLUMNS
        if by_document:  # the table's interval is the one over documents
            tip = "95% paired bootstrap CI resampling whole documents: windows of one document are not independent"
            columns = {**columns, "penalty 95% CI": st.column_config.TextColumn(help=tip, alignment="right")}
        # Under MIN_BOOTSTRAP_VALUES sequences no interval column: the caption says there are none (a column
        # saying "none (under 10 sequences)" on each row made the table scroll sideways at 800 px).
        shown = result_view(result, intervals)
        st.dataframe(shown, hide_index=True, key="lab_result", column_config=columns, placeholder="–")
        if "global_mean" not in spec["conditions"]:  # (its column is absent: said, not silently left out)
            st.caption("No gap retention: it is measured against global_mean, which this run did not replay.")
        plotted = result.rename(columns=FIGURE_COLUMNS)
        if by_document:  # the interval to quote (`fca.tables.scoring.quoted_interval`)
            plotted["lo"], plotted["hi"] = (
                result["penalty 95% CI low (documents)"],
                result["penalty 95% CI high (documents)"],
            )
        run_caption = figure_caption(sel, spec["conditions"], seed=spec["seed"], sequences=spec["num_seqs"])
        frozen = frozen_sites_note(spec["conditions"], cache.sites)  # each chart says which sites were frozen
        left, right = st.columns(2)
        nll_title = "NLL per condition" + frozen + (" (95% CI of the mean over sequences)" if intervals else "")
        chart(figures.nll_bars(plotted, nll_title), "lab_nll", run_caption, where=left)
        others = plotted[plotted["condition"] != "correct"]
        if len(others):
            penalty_title = (
                figures.penalty_title(by_document, "Penalty vs correct" + frozen)
                if intervals
                else "Penalty vs correct" + frozen
            )
            chart(figures.penalty_bars(others, penalty_title), "lab_penalty", run_caption, where=right)
        else:
            right.info("Only correct ran: there is no penalty to draw. Choose a condition above to compare with it.")
        routing = record["results"].get("routing") or {}  # (a model with routers)
        if "conditions" in routing:
            chance = routing["chance"]
            st.caption(
                "Routing, read from what each MoE layer's experts were handed: *same experts* is the share of "
                "tokens that ran the same experts under a condition as on their own coefficients, over the routers "
                "it changes; *experts kept*, the mean share of those experts kept; *weight kept*, the share of "
                "each token's mixing weight left on the same experts. "
                f"Experts drawn at random: {chance['same_experts']:.1%} and "
                f"{chance['expert_overlap']:.1%}. "
                "A condition on sites that are no router changes no routing: its cells are empty."
            )
            chart(figures.routing_by_router(routing), "lab_routing", run_caption)
        if routing.get("not_reported"):
            st.text(routing["not_reported"])  # (names read from the file: shown as text)
        sweep = sweep_points(record["results"]["conditions"])
        if len(sweep) >= 2:  # a curve, drawn like the report's, with the run's reference lines
            sweep_title = figures.SWEEP_TITLE + frozen
            chart(
                figures.sweep_curve(sweep, record["results"]["conditions"], sweep_title), "lab_sweep_chart", run_caption
            )
        download(result, "replay_result.csv")

st.subheader("Saved runs of this cache")
runs = resources.saved_runs(cache.path)
if not runs:
    st.caption(f"None yet. Runs are saved in `{rel(cache.path)}.runs/`.")
else:
    ids = [Path(r["path"]).stem for r in runs]  # newest first
    labels = dict(zip(ids, run_labels(runs)))
    # The run's label says its conditions, sequences and seed ("static_layer + global_mean, n=16, seed 3"):
    # as columns of their own too, they made the table scroll sideways even at 1400 px (the CSV keeps them).
    table = pd.DataFrame(
        [
            {
                "run": labels[i],
                "created": r.get("created"),
                "batch size": r["spec"].get("batch_size"),
                "device": r.get("device"),
                "model ok": r["spec"].get("model_fingerprint") == cache.manifest.model.fingerprint,
            }
            for i, r in zip(ids, runs)
        ]
    )
    st.dataframe(
        table,
        hide_index=True,
        key="lab_runs",
        column_config={
            "run": st.column_config.TextColumn(pinned=True),
            # (a checkbox column is drawn narrow, and its header was cut to "model")
            "model ok": st.column_config.CheckboxColumn(
                width="medium", help="the run was made by the model that made this cache (its fingerprint)"
            ),
        },
    )
    # Per cache, so a choice never leaks to another cache. Runs saved since this page last ran (the one
    # just finished, or one from the CLI) join the choice; a first visit compares the newest two.
    compare_key, seen_key = f"lab_compare::{cache.path}", f"lab_seen_runs::{cache.path}"
    previous, seen = st.session_state.get(compare_key), st.session_state.get(seen_key)
    if previous is None or seen is None:
        value = ids[:2]
    else:
        value = [i for i in ids if i not in seen] + [i for i in previous if i in ids]
    st.session_state[compare_key] = list(dict.fromkeys(value))
    st.session_state[seen_key] = set(ids)
    chosen = st.multiselect("Compare runs", ids, format_func=labels.get, key=compare_key)
    picked = [r for i, r in zip(ids, runs) if i in chosen]
    rows = saved_run_rows(picked, [labels[i] for i in ids if i in chosen])
    if rows:
        long = pd.DataFrame(rows)
        plotted = long.rename(columns=FIGURE_COLUMNS)
        penalized = plotted[plotted["condition"] != "correct"]
        if len(penalized):
            chart(
                figures.penalty_bars(penalized, "Penalty vs correct, saved runs side by side"),
                "lab_compare_chart",
                figure_caption(sel, list(dict.fromkeys(penalized["condition"])), seed="per run (see the legend)"),
            )
        # A run of correct alone has no penalty: without a word it just went missing from the chart.
        if alone := [run for run in dict.fromkeys(plotted["run"]) if run not in set(penalized["run"])]:
            st.caption(
                f"{', '.join(f'{markdown_code(run)}' for run in alone)}: correct only, so no penalty bars "
                "(a penalty is a condition's NLL minus correct's); its NLL is in the CSV below."
            )
        download(long, "saved_runs.csv")
