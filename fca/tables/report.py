"""An audit report (`fca.tables.audit_report.AuditReport`, what `fca.jobs.audit.run_audit` returns) as
Markdown, and both written to disk. Torch-free, so the dashboard can show reports without loading a model."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path

from fca.tables.audit_report import (
    AuditReport,
    ConditionRow,
    Exactness,
    Execution,
    Latency,
    ReportError,
    Routing,
    SweepRow,
    Variance,
)
from fca.tables.jsonfile import read_json
from fca.tables.outputs import RenderedPair, json_with, starts_with, strict_json
from fca.tables.paper import CITATION, STATIC_RETENTION, comparison_markdown
from fca.tables.scoring import MIN_DOCUMENTS
from fca.tables.stats import MIN_BOOTSTRAP_VALUES
from fca.tables.text import markdown_code, markdown_text, percent

# What an earlier report looks like (`write_report` replaces only that).
REPORT_FILES = RenderedPair("audit report", json_with("fca_report_version"), starts_with("# FCA audit"))


def condition_execution_table(exe: Execution) -> list[str]:
    """Markdown lines: the blocks each condition's replay ran (`execution.conditions`), or none."""
    under = exe.conditions
    if not under:
        return []
    lines = [
        "",
        "What ran under each condition (tokens the blocks processed during its replay, all evaluated sequences):",
        "",
        "| condition | blocks executed per token | share | per block |",
        "|---|---|---|---|",
    ]
    for name, row in under.items():
        per_block = " / ".join(f"{100 * f:.0f}%" for f in row.per_block_fraction)
        lines.append(
            f"| {condition_cell(name)} | {row.blocks_executed_per_token:.2f} | {100 * row.blocks_executed_fraction:.1f}% | "
            f"{per_block} |"
        )
    return lines


# What reading a damaged field of a JSON record raises (a key missing, a string where a number belongs,
# null where an object does, a number too large to format).
DAMAGED_FIELD_ERRORS = (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError)


def damage(err: Exception) -> str:
    """A damaged field's error in a few words: a missing key is named as such."""
    return f"no {err.args[0]!r}" if isinstance(err, KeyError) and err.args else f"{type(err).__name__}: {err}"


def report_mismatch(report: AuditReport, model_fingerprint: str, cache_fingerprint: str) -> str | None:
    """Why a report beside a cache does not describe it: "model" (another model's report), "cache" (the
    cache was rebuilt since), or None. The dashboard's pages show such a report with the mismatch said."""
    if report.model.fingerprint != model_fingerprint:
        return "model"
    if report.cache.fingerprint not in (None, cache_fingerprint):
        return "cache"
    return None


LATENCY_NOISY_SPREAD = 1.25  # max / min of the per-run latency ratios beyond which the report says so


def latency_is_noisy(latency: Latency) -> bool:
    """Whether a latency measurement's per-run ratios spread too widely to trust their median: timing shares
    the machine, and a wide spread says other work ran meanwhile."""
    return latency.ratio_max / latency.ratio_min > LATENCY_NOISY_SPREAD


def condition_cell(name: str) -> str:
    """A condition's name in a Markdown table: one naming sites as code, or "cross_input@model.layers.0.gate"
    is rendered as a link to an e-mail address."""
    return markdown_code(name) if "@" in name else markdown_text(name, cell=True)


def interval_columns(rows: Sequence[ConditionRow | SweepRow], both: bool = True) -> dict[str, str]:
    """The penalty intervals a table of `rows` shows, field -> what its header says after "95% CI": the one
    over sequences, and the one over documents where every row has it (alone without `both`)."""
    if not all(row.penalty_ci95_documents is not None for row in rows):
        return {"penalty_ci95": ""}
    documents = {"penalty_ci95_documents": " (documents)"}
    return {"penalty_ci95": " (sequences)", **documents} if both else documents


def _interval_cells(row: ConditionRow | SweepRow, columns: dict[str, str]) -> str:
    return " | ".join(_interval_cell(getattr(row, key)) for key in columns)


NO_INTERVAL = f"none (under {MIN_BOOTSTRAP_VALUES} sequences)"  # a CI's cell where too few sequences give none


def _interval_cell(bounds: Sequence[float | None]) -> str:
    """[low, high] to four decimals; NO_INTERVAL for the null (or NaN) ends of too few sequences' interval."""
    if any(x is None or not math.isfinite(x) for x in bounds):
        return NO_INTERVAL
    return f"[{bounds[0]:+.4f}, {bounds[1]:+.4f}]"


def conditions_table(report: AuditReport, both_intervals: bool = True, retention_first: bool = False) -> list[str]:
    """The report's conditions as Markdown table lines (the report's page and the dashboard's Overview):
    NLL, penalty and its 95% CI (over sequences, and over documents where the report has that; only the
    latter without `both_intervals`, for a narrow page), and gap retention ("undefined" where its CI does
    not lie above zero; blank for the scale's two ends). `retention_first`: gap retention right after the
    condition and the NLL last, so that on a narrow page the column that scrolls out of sight is the NLL
    (drawn on the retention scale), not the retention."""
    columns = interval_columns(list(report.conditions.values()), both_intervals)
    retention_ci = report.gap_retention_ci95 or {}  # (none in the released reports of early audits)
    headers = {
        "nll": "NLL (nats/token)",
        "penalty": "penalty vs correct (nats/token)",
        "intervals": " | ".join(f"penalty 95% CI{label}" for label in columns.values()),
        "retention": f"gap retention{' [95% CI]' if retention_ci else ''}",
    }
    order = (
        ["retention", "penalty", "intervals", "nll"]
        if retention_first
        else ["nll", "penalty", "intervals", "retention"]
    )
    lines = [
        "| condition | " + " | ".join(headers[k] for k in order) + " |",
        "|---|---|---|" + "---|" * len(columns) + "---|",
    ]
    for name, row in report.conditions.items():
        retention = report.gap_retention.get(name)
        shown = f"{100 * retention:.1f}%" if retention is not None else "undefined"
        if retention is not None and name in retention_ci:
            lo, hi = retention_ci[name]
            shown += f" [{100 * lo:.1f}%, {100 * hi:.1f}%]"
        shown = "" if name in ("correct", "global_mean") else shown
        cells = {
            "nll": f"{row.nll:.4f}",
            "penalty": f"{row.penalty:+.4f}",
            "intervals": _interval_cells(row, columns),
            "retention": shown,
        }
        lines.append(f"| {condition_cell(name)} | " + " | ".join(cells[k] for k in order) + " |")
    return lines


def documents_sentence(report: AuditReport) -> str | None:
    """Why a report's penalty CIs come in two kinds, and over how many documents (None when the cache does
    not record its documents, save for a corpus cache made before it did, which is said to be one)."""
    cache = report.cache
    if cache.origin_recorded and cache.documents is None and cache.split_seed is not None:
        return (
            "This corpus cache was built before caches recorded their documents, so its CIs resample windows "
            "as if they were independent, which is too narrow where windows share a document; rebuild it "
            "(fca build-cache) for CIs over documents."
        )
    return documents_note(cache.sequences, cache.documents, bool(report.gap_retention_ci95))


def documents_note(sequences: int, documents: int | None, retention_interval: bool = False) -> str | None:
    """What the CIs of `sequences` evaluated windows lying in `documents` documents resample, in words (the
    report, `fca replay` and the Replay lab; `retention_interval`: the report has gap retention CIs); None
    where the cache does not record its documents."""
    if not documents:
        return None
    if documents < MIN_DOCUMENTS:
        where = "one document" if documents == 1 else f"only {documents} documents"
        return (
            f"All {sequences} evaluated windows lie in {where}: too few for a CI over documents (at least "
            f"{MIN_DOCUMENTS}), and the CI over sequences, which takes the windows as independent, is too narrow; "
            "evaluate more windows."
        )
    retention = " Gap retention's CI resamples documents too." if retention_interval else ""
    return (
        f"The {sequences} evaluated windows are consecutive stretches of {documents} documents: windows of one "
        "document share its text, so their NLLs are not independent. The CI over documents resamples whole "
        "documents and is the one to quote; the CI over sequences treats every window as independent and is "
        f"narrower than the data support.{retention}"
    )


def routing_scope(changed: Sequence[str], routers: Sequence[str]) -> str:
    """What a condition's routing figures are taken over (`changed`, the routers it changes, of `routers`),
    to follow its name: "" for every router, " (1 of 2 routers)", or " (no router changed)" for one whose
    figures are null."""
    if not changed:
        return " (no router changed)"
    return "" if len(changed) == len(routers) else f" ({len(changed)} of {len(routers)} routers)"


def markdown_literal(text: object) -> str:
    """Text read from a file, for Markdown: every character Markdown gives a meaning to is escaped, so module
    names and reasons are shown as written (never as emphasis, links or HTML)."""
    return re.sub(r"([\\`*_{}\[\]()<>#+!|~-])", r"\\\1", str(text))


def routing_table(routing: Routing | None) -> list[str]:
    """Markdown lines for a report's (or saved run's results') `routing` section: the experts each condition
    had tokens run, against their own, and the sentence saying which routers have no figure and why; [] for
    none (a model without routers)."""
    if routing is None:
        return []
    note = routing.not_reported
    if routing.conditions is None:  # (no router's selection could be observed)
        return ["", f"**Routing.** {markdown_literal(note)}"]
    routers = list(routing.routers)
    k = "/".join(map(str, sorted(set(routing.routers.values()))))
    chance = routing.chance
    lines = [
        "",
        f"**Routing.** Which experts each token ran under each condition (top-{k}, {len(routers)} routers; read "
        "from what each MoE layer's experts were handed in the replay), against those it ran on its own "
        "coefficients; shares of tokens, over the routers the condition changes. Routed weight kept: the share "
        "of each token's own mixing weight still on the same experts (the smaller of the two weights the "
        "experts were handed, expert by expert). A penalty says what a condition costs; this says how much "
        "routing it changed."
        + (
            f" Experts drawn at random would be the same set for {100 * chance['same_experts']:.1f}% of tokens and "
            f"keep {100 * chance['expert_overlap']:.1f}% of them."
            if chance
            else ""
        ),
        "",
        "| condition | same experts | experts kept (mean share) | routed weight kept |",
        "|---|---|---|---|",
    ]
    for name, row in routing.conditions.items():
        lines.append(
            f"| {condition_cell(name)}{routing_scope(row.routers_changed, routers)} | {percent(row.same_experts, 1, '–')} | "
            f"{percent(row.expert_overlap, 1, '–')} | {percent(row.weight_kept, 1, '–')} |"
        )
    if note:
        lines += ["", markdown_literal(note)]
    return lines


# Below this many evaluated sequences a percentile bootstrap over sequences has few distinct resamples
# (3 sequences: 10 distinct means), so its intervals, and whether a gap retention is defined, are rough.
FEW_SEQUENCES = 20


def few_sequences_caution(n: int) -> str | None:
    """A sentence for figures whose CIs rest on `n` < FEW_SEQUENCES evaluated sequences, else None."""
    if n >= FEW_SEQUENCES:
        return None
    if n < MIN_BOOTSTRAP_VALUES:
        return (
            f"Only {n} evaluated sequence{'s' if n != 1 else ''}: too few for a bootstrap interval over sequences "
            f"(it takes {MIN_BOOTSTRAP_VALUES}), so there is none, nor a gap retention; use at least "
            f"{FEW_SEQUENCES} for figures to quote."
        )
    return (
        f"Only {n} evaluated sequence{'s' if n != 1 else ''}: the bootstrap intervals over sequences (and so "
        f"whether a gap retention is defined) are rough; use at least {FEW_SEQUENCES} for figures to quote."
    )


MAX_REPORT_BYTES = 64 * 2**20  # a report is kilobytes; a file this large is something else


def read_report(path: str | Path) -> AuditReport:
    """An audit report from its JSON file, checked whole up front (`AuditReport.from_json`) so that rendering
    never fails halfway."""
    try:  # (a missing file, a device or a pipe, or a file over MAX_REPORT_BYTES: refused before it is read)
        report = read_json(path, ReportError, MAX_REPORT_BYTES, constants=False)
    except ReportError as err:
        raise ReportError(f"{path}: not a readable audit report ({str(err).removeprefix(f'{path}: ')})") from None
    return AuditReport.from_json(report, path)


def exactness_sentences(ex: Exactness) -> list[str]:
    """The two exactness checks of a report's (or a saved run's) `exactness` in plain words (reports, CLI,
    dashboard)."""
    sentences = [
        f"Replay mechanism: Correct replay of the coefficients recorded in the same pass reproduces the live logits "
        f"(max |difference| {ex.max_abs_logit_diff:.3g}, tolerance {ex.tolerance:g}; NLL {ex.nll_live:.6f} "
        f"live, {ex.nll_correct:.6f} replayed)."
    ]
    fid = ex.fidelity
    if fid.verdict == "bit-identical":
        stored = fid.coefficient_dtype
        verdict = "the cached coefficients are bit-identical to those recorded now" + (
            "" if stored == "float32" else f", rounded to {stored} as stored (the replay runs on the rounded values)"
        )
    else:
        tol = fid.tolerances
        if fid.same_environment:
            reason = (
                "other batches than the build's, so kernels may differ (any batch of the build is held to bit-identity)"
            )
        elif fid.computed_on:
            reason = "another environment, so floating-point reduction order differs"
        else:
            reason = "an environment the cache does not record, so it is judged as a foreign one"
        stored_nll = fid.stored_live_nll_max_diff
        verdict = (
            f"{reason}: the cached coefficients differ from those recorded now by at most "
            f"{fid.max_abs_coefficient_diff:.2g} ({fid.max_rel_coefficient_diff:.2g} relative; tolerance "
            f"{tol['coefficient_rel']:.2g}), and Correct-from-cache NLL by {fid.nll_diff:.2g} nats from live "
            f"(tolerance {tol['nll_mean']:.2g})"
            + (
                f", the stored live NLL by up to {stored_nll:.2g} nats per token (tolerance {tol['nll_token']:.2g})"
                if stored_nll and "nll_token" in tol
                else ""
            )
            + "; accepted"
        )
    sentences.append(
        f"Cache fidelity: coefficients computed on {fid.computed_on_text}, replayed on "
        f"{fid.replayed_on_text}{_foreign(fid.differing_fields)}; {verdict}."
    )
    calibration = ex.calibration
    if calibration is not None:  # (none in the released reports of early audits)
        sentences.append(
            f"Calibration cache: computed on {calibration.computed_on_text}{_foreign(calibration.differing_fields)}; its coefficients "
            "enter only through their means (the static profiles), so they are not replayed one by one and their "
            "fidelity is not measured."
        )
    return sentences


def _foreign(differing: Sequence[str] | None) -> str:
    return f" (a foreign cache: the environments differ in {', '.join(differing)})" if differing else ""


def storage_sentence(coefficient_dtype: str) -> str:
    """How the cache stored its coefficients, when not in float32 (the default), in a sentence."""
    if coefficient_dtype == "float32":
        return ""
    if coefficient_dtype == "bfloat16":  # allowed for bfloat16 models only: their values, bit for bit
        return " Coefficients were stored in bfloat16, the model's own precision: the values it used, bit for bit."
    return f" **Coefficients were stored in reduced precision ({coefficient_dtype}).**"


def global_mean_sentence(report: AuditReport) -> str | None:
    """What global_mean put at every coefficient, family by family (None where the report does not say: the
    released reports of early audits)."""
    used = report.calibration.family_grand_means
    if not used:
        return None
    values = ", ".join(f"{markdown_text(family)} {value:.6g}" for family, value in used.items())
    return f"global_mean gives every coefficient its family's calibration grand mean: {values}."


def family_shares(variance: Variance) -> str | None:
    """ "router 8.1%, shared_expert_gate 34.8%": each family's layer-identity share, when a report's
    coefficients are of more than one family (the pooled share can be mostly one family's: a shared-expert
    gate beside the routers, say); None for one family."""
    shares = variance.per_family
    shown = (f"{markdown_text(family)} {percent(share, 1, '–')}" for family, share in shares.items())
    return ", ".join(shown) if len(shares) > 1 else None


def render_markdown(report: AuditReport) -> str:
    # Every string the report holds came from a file, maybe someone else's: shown as text (`t`) or code (`c`).
    m, ex, var, exe = report.model, report.exactness, report.variance, report.execution
    cache, calibration = report.cache, report.calibration
    t, c = markdown_text, markdown_code
    lines = [
        f"# FCA audit: {t(m.name)}",
        "",
        f"Model type {c(m.model_type)}, {m.parameters:,} parameters ({m.controller_parameters:,} in "
        f"controllers), fingerprint {c(m.fingerprint[:16])}, {t(m.dtype)} on {t(m.device)}.",
        f"Evaluated cache {c(cache.path)} ({t(cache.split)} split, {cache.sequences} x {cache.seq_len} tokens); "
        f"calibration cache {c(calibration.path)} ({t(calibration.split)} split, {calibration.tokens:,} tokens"
        + (  # a calibration of another corpus is allowed (independent by construction): said when so
            f", from {t(calibration.corpus)}" if calibration.corpus not in (None, cache.corpus) else ""
        )
        + ")."
        + storage_sentence(cache.coefficient_dtype),
        "",
        "**Exactness.** " + " ".join(map(t, exactness_sentences(ex))),
        "",
        "## 1. Coefficient variation",
        "Layer identity (the site and channel alone) explains "
        + (  # null: the coefficients do not vary, so no share is defined (it read "0.0%")
            f"**{100 * var.layer_identity_share:.1f}%** of the coefficient variance"
            if var.layer_identity_share is not None
            else "an undefined share of the coefficient variance (the coefficients do not vary)"
        )
        + (f", pooled over its families (within each: {each})" if (each := family_shares(var)) else "")
        + ".",
        "",
    ]
    chance = var.chance_levels  # (none in the released reports of early audits: no such column)
    lines += ["| factor | share of variance |" + (" chance level (no effect) |" if chance else "")]
    lines += ["|---|---|" + ("---|" if chance else "")]
    lines += [
        f"| {t(k.replace('_', ' '), cell=True)} | {percent(v, 1, '–')} |"
        + (f" {percent(chance[k], 2, '–') if k in chance else ''} |" if chance else "")
        for k, v in var.factors.items()
    ]
    lines += ["", "| site | layer-identity share |", "|---|---|"]
    # (percents, as the sentence above)
    lines += [f"| {c(k)} | {percent(v, 1, '–')} |" for k, v in var.per_site.items()]
    lines += [
        "",
        "## 2. Functional dependence (controllers removed, coefficients reassigned)",
        "",
        *conditions_table(report),
    ]
    if documents := documents_sentence(report):
        lines += ["", documents]
    if used := global_mean_sentence(report):
        lines += ["", used]
    caution = few_sequences_caution(cache.sequences)
    lines += ["", f"> {caution}"] if caution else []  # (FCA's words and a count)
    lines += routing_table(report.routing)
    lines += dependence_story_markdown(report)
    lines += [
        "",
        "## 3. Actual execution",
        "",
        f"- Blocks executed per token: {exe.blocks_executed_per_token:.2f} of {exe.num_blocks} "
        f"({100 * exe.blocks_executed_fraction:.1f}%), counted by forward hooks.",
        f"- Controller FLOPs: {100 * exe.controller_flops_share:.2f}% of the forward's FLOPs.",
    ]
    if exe.flops_ratio_vs_dense is not None:
        lines.append(
            f"- FLOPs per token vs the Dense twin: **{exe.flops_ratio_vs_dense:.3f}x** "
            f"({exe.flops_per_token:,.0f} and {exe.dense_flops_per_token:,.0f}, counted on the same batch)."
        )
    if exe.uncounted_ops:  # (none kept in the released reports of early audits)
        lines.append(
            f"- Not counted (no FLOP formula in this torch): {t(', '.join(exe.uncounted_ops))}; the share leaves "
            "their work out of both the controllers' and the forward's FLOPs."
        )
    if (timed := exe.latency) is not None:
        lines.append(
            f"- Latency vs the Dense twin: **{timed.latency_ratio_vs_dense:.3f}x** "
            f"(the median of {timed.runs} interleaved runs' ratios, batch {list(timed.batch_shape)}, "
            f"{t(timed.device)}; median times {timed.model_ms_median:.1f} ms and {timed.dense_ms_median:.1f} ms, "
            "whose quotient need not be the median ratio)."
        )
        lines.append(
            f"  The runs ranged from {timed.ratio_min:.3f}x to {timed.ratio_max:.3f}x"
            + (": too wide to trust; rerun the audit on an otherwise idle machine." if latency_is_noisy(timed) else ".")
        )
    elif exe.experts:  # (what an MoE model skips is experts, counted below; FCA makes it no Dense twin)
        lines.append(
            "- Latency vs a Dense twin: not measured (an MoE model has none here; its conditional work is the experts below)."
        )
    else:
        lines.append("- Latency vs a Dense twin: not measured (no --dense given).")
    if (e := exe.experts) is not None:
        some = e.moe_layers < exe.num_blocks  # (a model may keep dense MLPs in some blocks)
        lines.append(
            f"- Experts run per token: {e.experts_run_per_token_mean:.2f} of {e.experts_available:g} "
            f"routed experts per MoE layer (top-{e.top_k}: {100 * e.expert_fraction:.1f}% of them), "
            "counted from the dispatched indices"
            + (
                f"; {e.moe_layers} of the {exe.num_blocks} blocks {'has' if e.moe_layers == 1 else 'have'} an MoE layer"
                if some
                else ""
            )
            + ("; a shared expert runs for every token besides them." if e.shared_experts else ".")
        )
    if exe.note:
        lines.append(f"- Note: {t(exe.note)}")
    lines += condition_execution_table(exe)
    lines += ["", *comparison_markdown(report)]
    lines += ["", "## Definitions", ""]
    for key, value in report.definitions.items():
        if isinstance(value, dict):  # (condition_specs: a dict per condition; its names say enough here)
            lines.append(
                f"- **{t(key)}**: " + "; ".join(t(k if isinstance(v, dict) else f"{k}: {v}") for k, v in value.items())
            )
        else:
            lines.append(f"- **{t(key)}**: {t(value)}")
    return "\n".join(lines) + "\n"


def write_report(
    report: AuditReport, json_path: str | Path | None = None, markdown_path: str | Path | None = None
) -> None:
    """The report as JSON and/or Markdown, each replacing only an earlier report (`fca.tables.outputs`)."""
    REPORT_FILES.write(json_path, lambda: strict_json(report.to_json()), markdown_path, lambda: render_markdown(report))


def check_report_paths(json_path: str | Path | None = None, markdown_path: str | Path | None = None) -> None:
    """What `write_report` would refuse, refused now (an audit checks its outputs before it runs)."""
    REPORT_FILES.check(json_path, markdown_path)


def retention_sentence(report: AuditReport) -> str:
    """One plain sentence on the static profile's gap retention (README, "What is measured, exactly") beside the
    paper's, from a report's `conditions` and `gap_retention`; says why when it is undefined."""
    lo, hi = (f"{100 * x:.2f}" for x in STATIC_RETENTION)  # (the paper's gated models)
    paper = f"the paper's gated models kept {lo}-{hi}% ({CITATION})"
    if report.model.model_type != "featuregate":  # (a mixture of experts read it as its own yardstick)
        paper += " (gated Transformers: a point of reference, not a result for this architecture)"
    conditions = report.conditions
    if not all(k in conditions for k in ("correct", "global_mean", "static_layer")):
        return "This report lacks the correct, static_layer or global_mean condition, so retention is not defined."
    retention = report.gap_retention.get("static_layer")
    if retention is None and conditions["global_mean"].quoted_interval[1] < 0:
        return (
            "Removing per-token control lowers the NLL here: the global-mean profile scores better than the model's "
            "own coefficients (its penalty's CI lies below 0), so the static profile's retention is undefined; "
            f"{paper}."
        )
    if retention is None:
        return (
            "Per-token control is not clearly worth anything here (the global-mean profile's penalty CI does not lie above 0), "
            f"so the static profile's retention is undefined; {paper}."
        )
    shown = f"gap retention {100 * retention:.1f}%"
    if retention > 1:  # "keeps 126%" read as nonsense: the static profile scored below the own coefficients
        if conditions["static_layer"].quoted_interval[1] < 0:
            return (
                f"A fixed per-layer profile does better than the model's own per-token coefficients here ({shown}: "
                f"its penalty's CI lies below 0); {paper}."
            )
        return (
            f"A fixed per-layer profile does as well as per-token control here ({shown}; its penalty's CI reaches "
            f"0, so within noise of it); {paper}."
        )
    if retention < 0:
        interval = report.retention_interval("static_layer")
        if interval is not None and interval[1] >= 0:  # (none in the released reports of early audits)
            lo, hi = (f"{100 * x:.1f}%" for x in interval)
            return (
                f"A fixed per-layer profile does no better than the global-mean profile here ({shown}, 95% CI "
                f"{lo} to {hi}: within noise of it); {paper}."
            )
        return f"A fixed per-layer profile does worse here than the global-mean profile ({shown}); {paper}."
    return f"A fixed per-layer profile keeps {100 * retention:.1f}% of what per-token control is worth here; {paper}."


def dependence_story_markdown(report: AuditReport) -> list[str]:
    """Markdown lines after the conditions table: the retention sentence and the interpolation sweep."""
    lines = ["", retention_sentence(report)]
    sweep = report.sweep
    if sweep:
        columns = interval_columns(sweep)
        lines += [
            "",
            "### Interpolation sweep: alpha * own coefficients + (1 - alpha) * static profile",
            "",
            "| alpha | NLL (nats/token) | penalty vs correct (nats/token) | "
            + " | ".join(f"95% CI{label}" for label in columns.values())
            + " |",
            "|---|---|---|" + "---|" * len(columns),
        ]
        for row in sweep:
            cells = _interval_cells(row, columns)
            lines.append(f"| {row.alpha:g} | {row.nll:.4f} | {row.penalty:+.4f} | {cells} |")
        lines += ["", "alpha 0 is the static profile (static_layer), 1 the own coefficients (correct)."]
    return lines
