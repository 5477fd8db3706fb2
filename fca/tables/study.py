"""Multi-seed studies: one table across independently trained models, from their audit reports.

`build_study` takes audit reports (`fca.tables.audit_report.AuditReport`, as `fca.jobs.audit.run_audit`
returns them) of models that differ only
in their training seed, checks that every report was made with the same definitions, and returns per
quantity the mean, the sample standard deviation and a 95% Student t interval over models, beside the
per-model rows. Pure functions over reports plus small JSON/Markdown I/O: no torch, no UI, so the CLI's
`study` command and the dashboard's Study page read studies without loading a model.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path

from fca.tables.audit_report import AuditReport, report_field
from fca.tables.execution import audit_summary
from fca.tables.jsonfile import read_json, read_json_object
from fca.tables.outputs import RenderedPair, json_with, starts_with, strict_json
from fca.tables.report import DAMAGED_FIELD_ERRORS, ReportError, condition_cell, damage, read_report, routing_scope
from fca.tables.text import markdown_code, markdown_text, percent

STUDY_VERSION = 1
# The fields that must agree for numbers to be averaged: what was evaluated (corpus, split, window
# length, sizes), how the conditions and statistics are defined (families, permutation seeds,
# bootstrap settings), and where latency was measured. Dotted paths into the report. Not compared:
# anything about exactness (its layout may change; every audit passed it or it would not exist) and
# free text that only describes (e.g. the exactness definition).
COMPARED_FIELDS = (
    "fca_report_version",
    "model.model_type",
    "model.parameters",
    "model.controller_parameters",
    "model.dtype",
    "cache.split",
    "cache.corpus",
    "cache.sequences",
    "cache.seq_len",
    "cache.coefficient_dtype",
    "calibration.split",
    "calibration.corpus",
    "calibration.tokens",
    "calibration.coefficient_dtype",
    "execution.device",
    "execution.batch_shape",
    "execution.runs",
    "definitions.nll",
    "definitions.penalty",
    "definitions.gap_retention",
    "definitions.conditions",
    "definitions.condition_specs",
    "definitions.global_mean_families",
    "definitions.splits",
    "definitions.layer_identity_share",
    "definitions.controller_flops",
    "definitions.latency",
    "definitions.coefficient",
)
# Compared only when both reports carry them (a training summary is optional in a report).
OPTIONAL_FIELDS = (
    "training.split_seed",
    "training.steps",
    "training.batch_size",
    "training.lr",
    "training.min_lr",
    "training.corpus",
    "training.corpus_fingerprint",  # (training logs before it name the corpus file only)
    "cache.split_seed",  # (reports before it name the split only)
    "calibration.split_seed",
    "cache.corpus_fingerprint",  # (reports before it name the corpus file only)
    "calibration.corpus_fingerprint",
)
# Scalars of a report (`fca.tables.execution.audit_summary`) aggregated beside the conditions.
SCALARS = (
    "layer_identity_share",
    "latency_ratio_vs_dense",
    "blocks_executed_fraction",
    "blocks_executed_per_token",
    "controller_flops_share",
)


# Two-sided 95% Student t quantiles t(0.975, df) for df = 1..30 (standard tables, 6 decimals).
_T975 = (
    12.706205,
    4.302653,
    3.182446,
    2.776445,
    2.570582,
    2.446912,
    2.364624,
    2.306004,
    2.262157,
    2.228139,
    2.200985,
    2.178813,
    2.160369,
    2.144787,
    2.131450,
    2.119905,
    2.109816,
    2.100922,
    2.093024,
    2.085963,
    2.079614,
    2.073873,
    2.068658,
    2.063899,
    2.059539,
    2.055529,
    2.051831,
    2.048407,
    2.045230,
    2.042272,
)
_Z975 = 1.959963984540054


class StudyError(ValueError):
    """Audits that cannot be put in one study (not reports, different definitions, the same model twice)."""


def t_quantile_975(df: int) -> float:
    """t(0.975, df): from the table up to 30 degrees of freedom, beyond by the Cornish-Fisher expansion
    around the normal quantile (error below 1e-6 there)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z, v = _Z975, float(df)
    return (
        z
        + (z**3 + z) / (4 * v)
        + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * v**2)
        + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * v**3)
        + (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / (92160 * v**4)
    )


def spread(values: Sequence[float | None]) -> dict:
    """Mean, sample SD (n - 1) and 95% t interval of the defined values; `n` counts those used.
    With one value the SD and interval are None; with none, the mean is None too."""
    xs = [float(x) for x in values if x is not None and math.isfinite(float(x))]
    n = len(xs)
    if n == 0:
        return {"n": 0, "mean": None, "sd": None, "ci95": None}
    try:
        mean = math.fsum(xs) / n
    except OverflowError:  # values near float's limit (a damaged audit, say): averaged without their sum
        mean = math.fsum(x / n for x in xs)
    if n == 1:
        return {"n": 1, "mean": mean, "sd": None, "ci95": None}
    try:
        sd = math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / (n - 1))
    except OverflowError:  # the same, their squared deviations taken in units of the largest
        scale = max(abs(x - mean) for x in xs)
        sd = scale * math.sqrt(math.fsum(((x - mean) / scale) ** 2 for x in xs) / (n - 1))
    half = t_quantile_975(n - 1) * sd / math.sqrt(n)
    return {"n": n, "mean": mean, "sd": sd, "ci95": [mean - half, mean + half]}


def load_audit(path: str | Path) -> AuditReport:
    """An audit report from disk, or a one-line StudyError naming the file."""
    path = Path(path)
    try:
        report = read_report(path)  # as `fca report` reads it
    except ReportError as err:  # (its message names the file)
        raise StudyError(str(err)) from None
    if not report.model.fingerprint:
        raise StudyError(f"{path}: not an FCA audit report (no model fingerprint)")
    try:  # what a study reads of it, read once here: a damaged field is this line, not a traceback later
        render_markdown(build_study([(str(path), report)]))
    except DAMAGED_FIELD_ERRORS as err:
        raise StudyError(
            f"{path}: not an FCA audit report for a study (a field cannot be read: {damage(err)})"
        ) from None
    return report


def training_info(report: AuditReport, audit_path: str | Path | None = None) -> dict:
    """Seed and training summary of the audited model: the report's own `training` entry, else the
    model directory beside the report (`<audit dir>/<model name>/training_log.json` or `config.json`).
    Empty when neither is there (a study does not need it; rows then show no seed)."""
    if report.training is not None:
        return dict(report.training)
    if audit_path is None:
        return {}
    return model_training(Path(audit_path).parent / report.model.name)


def model_training(model_dir: str | Path) -> dict:
    """The training summary of a model directory: its `training_log.json` summarized, else the seed in
    its `config.json`, else empty (a model trained elsewhere)."""
    log = read_json_object(Path(model_dir) / "training_log.json")
    if log is not None:
        return summarize_training_log(log)
    config = read_json_object(Path(model_dir) / "config.json") or {}
    return {"seed": config["init_seed"]} if "init_seed" in config else {}


def summarize_training_log(log: dict) -> dict:
    """The part of a `training_log.json` a study shows (seed, split, steps, device, throughput)."""
    settings = log.get("settings", {})
    out = {
        **{key: settings.get(key) for key in ("seed", "split_seed", "steps", "batch_size", "lr", "min_lr")},
        "corpus": Path(str(log.get("corpus", ""))).name or None,
        "corpus_fingerprint": log.get("corpus_fingerprint"),
        "device": log.get("device", "cpu"),
        "precision": log.get("precision", "float32"),
        "tokens_per_second": log.get("tokens_per_second"),
        "train_seconds": log.get("train_seconds"),
        "final_eval_nll": log.get("final_eval_nll"),
    }
    return {k: v for k, v in out.items() if v is not None}


def _short(value) -> str:
    text = "absent" if value is _MISSING else json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= 70 else text[:67] + "..."


_MISSING = object()


def without_sweep(report: AuditReport) -> AuditReport:
    """The report without its interpolation sweep's conditions (in `conditions`, `gap_retention` and
    `definitions.condition_specs`): a study averages the conditions every audit has, and audits made
    before the sweep, or with other alphas, stay comparable. The sweep itself is not averaged."""
    swept = report.sweep_conditions
    if not swept:
        return report
    definitions = dict(report.definitions)
    if isinstance(definitions.get("condition_specs"), dict):
        definitions["condition_specs"] = {k: v for k, v in definitions["condition_specs"].items() if k not in swept}
    return dataclasses.replace(
        report,
        interpolation_sweep=None,
        conditions={k: v for k, v in report.conditions.items() if k not in swept},
        gap_retention={k: v for k, v in report.gap_retention.items() if k not in swept},
        definitions=definitions,
    )


def check_comparable(audits: Sequence[tuple[str, AuditReport]]) -> None:
    """Raise StudyError (one line, the field and both files) unless every audit was made with the same
    definitions as the first, and no model appears twice (sweeps left out by `build_study`, the caller)."""
    if not audits:
        raise StudyError("a study needs at least one audit report")
    first_name, first = audits[0]
    first_json = first.to_json()  # (the fields compared are dotted paths into a report's JSON form)
    seen: dict[str, str] = {}
    for name, report in audits:
        fingerprint = report.model.fingerprint
        if fingerprint in seen:
            raise StudyError(
                f"{name}: the same model (fingerprint {fingerprint[:16]}) as {seen[fingerprint]}; "
                "a study needs independently trained models"
            )
        seen[fingerprint] = name
        if sorted(report.conditions) != sorted(first.conditions):
            a, b = _short(sorted(first.conditions)), _short(sorted(report.conditions))
            raise StudyError(f"conditions differ between {first_name} ({a}) and {name} ({b})")
        if (report.dense is None) != (first.dense is None):
            raise StudyError(
                f"dense twin differs between {first_name} and {name}: "
                "one was audited with a Dense twin, the other without"
            )
        a, b = architecture(first), architecture(report)
        if a is not None and b is not None and a != b:
            changed = sorted(k for k in {*a, *b} if a.get(k, _MISSING) != b.get(k, _MISSING))
            raise StudyError(
                f"the model configuration differs between {first_name} and {name} ({', '.join(changed[:5])}); "
                "a study averages models of one architecture, trained from different seeds"
            )
        checks = [(f, False) for f in COMPARED_FIELDS] + [(f, True) for f in OPTIONAL_FIELDS]
        this_json = report.to_json()
        for path, optional in checks:
            a, b = report_field(first_json, path, _MISSING), report_field(this_json, path, _MISSING)
            if optional and (a is _MISSING or b is _MISSING):
                continue
            if a != b:
                raise StudyError(
                    f"{path} differs between {first_name} ({_short(a)}) and {name} ({_short(b)}); "
                    "a study averages audits made with the same definitions only"
                )


# Configuration keys that are not the architecture: the seed itself and the library that wrote the file.
NOT_ARCHITECTURE = ("init_seed", "transformers_version", "_name_or_path")


def architecture(report: AuditReport) -> dict | None:
    """The audited model's configuration without its seed (None where the report does not record it: the
    released reports of early audits)."""
    config = report.model.config
    return {k: v for k, v in config.items() if k not in NOT_ARCHITECTURE} if config is not None else None


def check_seeds(rows: Sequence[dict], reports: Sequence[AuditReport]) -> None:
    """Each training seed at most once (where known), and no model evaluated on another split of its own
    training corpus: a split drawn with another split seed than the training split holds training documents."""
    seen: dict[int, str] = {}
    for row, report in zip(rows, reports, strict=True):
        seed, training = row["seed"], row["training"]
        if seed is not None and seed in seen:
            raise StudyError(
                f"{row['audit']}: training seed {seed} again (also {seen[seed]}); a study's seeds are distinct"
            )
        if seed is not None:
            seen[seed] = row["audit"]
        trained, evaluated = training.get("split_seed"), row["cache_split_seed"]
        trained_on, evaluated_on = training.get("corpus_fingerprint"), report.cache.corpus_fingerprint
        if trained_on and evaluated_on:  # the text itself, where both say it (a file may be renamed or replaced)
            same_corpus = trained_on == evaluated_on
        else:
            same_corpus = training.get("corpus") == report.cache.corpus
        if same_corpus and trained is not None and evaluated is not None and trained != evaluated:
            raise StudyError(
                f"{row['audit']}: evaluated on a split drawn with split seed {evaluated}, but the model was trained "
                f"on one drawn with split seed {trained}: its evaluated windows may be training text"
            )


def seed_row(report: AuditReport, audit: str, training: dict) -> dict:
    """One model's line of the study: identity, seed, and the numbers the summary averages."""
    conditions = report.conditions
    routing = report.routing.conditions if report.routing is not None else None
    routing = routing or {}  # (models with observed routers)
    summary = audit_summary(report)
    return {
        "audit": audit,
        "name": report.model.name,
        "fingerprint": report.model.fingerprint,
        "seed": training.get("seed"),
        "parameters": report.model.parameters,
        "dense_fingerprint": report.dense.fingerprint if report.dense is not None else None,
        "evaluated_cache": str(Path(audit).parent / report.cache.path),
        "cache_fingerprint": report.cache.fingerprint,
        "cache_split_seed": report.cache.split_seed,
        "nll": {c: row.nll for c, row in conditions.items()},
        "penalty": {c: row.penalty for c, row in conditions.items()},
        "penalty_ci95": {c: list(row.penalty_ci95) for c, row in conditions.items()},
        # (over documents, where the audit's cache recorded them: the interval to quote)
        **(
            {"penalty_ci95_documents": {c: list(row.penalty_ci95_documents) for c, row in conditions.items()}}
            if all(row.penalty_ci95_documents is not None for row in conditions.values())
            else {}
        ),
        "gap_retention": dict(report.gap_retention),
        # (models with observed routers: the share of tokens each condition keeps on their own experts, and
        # what it is taken over: "(1 of 2 routers)")
        "same_experts": {c: row.same_experts for c, row in routing.items()},
        "routing_marks": {
            c: routing_scope(row.routers_changed, list(report.routing.routers)) for c, row in routing.items()
        },
        **{key: summary[key] for key in SCALARS},
        "training": training,
        "exactness": report.exactness.to_json(),  # passed through as the audit wrote it
    }


def build_study(audits: Sequence[tuple[str, AuditReport]], trainings: Sequence[dict] | None = None) -> dict:
    """The study of `audits` [(name or path shown in the study, report)], its rows in the order of their
    training seeds (seed 2 before seed 10, whatever order a shell's glob gave), those of unknown seed
    last in the given order. `trainings`: each model's training summary (see `training_info`), or None."""
    audits = [(name, without_sweep(report)) for name, report in audits]
    check_comparable(audits)
    trainings = list(trainings) if trainings is not None else [training_info(r) for _, r in audits]
    rows = [seed_row(report, name, training) for (name, report), training in zip(audits, trainings, strict=True)]
    check_seeds(rows, [report for _, report in audits])
    rows.sort(key=lambda row: (not isinstance(row["seed"], int), row["seed"] if isinstance(row["seed"], int) else 0))
    names = list(audits[0][1].conditions)
    retained = [c for c in names if any(c in r["gap_retention"] for r in rows)]
    routed = [c for c in names if all(c in r["same_experts"] for r in rows)]
    summary = {
        "conditions": {
            c: {
                "nll": spread([r["nll"][c] for r in rows]),
                "penalty": spread([r["penalty"][c] for r in rows]),
                **({"gap_retention": spread([r["gap_retention"].get(c) for r in rows])} if c in retained else {}),
                **({"same_experts": spread([r["same_experts"][c] for r in rows])} if c in routed else {}),
            }
            for c in names
        },
        **{key: spread([r[key] for r in rows]) for key in SCALARS},
    }
    first = audits[0][1]
    return {
        "fca_study_version": STUDY_VERSION,
        "num_models": len(rows),
        "summary": summary,
        "seeds": rows,
        "definitions": {
            "unit": "one model (an independent training run, usually one seed) is one observation",
            "mean": "arithmetic mean over models",
            "sd": "sample standard deviation over models (denominator n - 1); null for one model",
            "ci95": "two-sided 95% Student t interval for the mean over models: "
            "mean +/- t(0.975, n - 1) * sd / sqrt(n); "
            "null for one model. It reflects seed-to-seed variation only; each model's own bootstrap CIs, over "
            "sequences and, where its cache records them, over documents, are in its audit and in its row of the "
            "study's JSON (seeds[].penalty_ci95, seeds[].penalty_ci95_documents)",
            "gap_retention": "averaged over the models where it is defined; n says how many",
            "same_experts": "models with routers: the share of tokens that run the same experts under a condition "
            "as on their own coefficients, read at the experts (each audit's routing section), averaged over models",
            "compared_fields": "audits are refused unless these agree: "
            + ", ".join(COMPARED_FIELDS)
            + "; and, where both reports have them, "
            + ", ".join(OPTIONAL_FIELDS)
            + "; and the model configuration (model.config without "
            + ", ".join(NOT_ARCHITECTURE)
            + "). Each training seed appears once, and each model is evaluated on a split of its own training "
            "split seed",
            "audit": {path: report_field(first, path) for path in COMPARED_FIELDS},
        },
    }


def study_from_files(paths: Sequence[str | Path], relative_to: str | Path | None = None) -> dict:
    """Load, check and aggregate audit files. Rows name each audit relative to `relative_to` (the
    study's folder, so the study can be moved with its audits), else as given."""
    audits, trainings = [], []
    for path in paths:
        report = load_audit(path)
        shown = str(path) if relative_to is None else os.path.relpath(Path(path).resolve(), Path(relative_to).resolve())
        audits.append((shown, report))
        trainings.append(training_info(report, path))
    try:
        return build_study(audits, trainings)
    except StudyError as err:
        if relative_to is None:
            raise
        raise StudyError(f"{err} (paths relative to {relative_to})") from None


def conditions_table(study: dict) -> list[str]:
    """The study's conditions as Markdown table lines (its page and the dashboard's Study page): NLL,
    penalty and gap retention across models, and for models with routers the share of tokens kept
    on their own experts."""
    conditions, n = study["summary"]["conditions"], study["num_models"]
    routed = any("same_experts" in s for s in conditions.values())
    header = "| condition | NLL (nats/token) | penalty vs correct (nats/token) | gap retention |"
    lines = [header + (" same experts |" if routed else ""), "|---|---|---|---|" + ("---|" if routed else "")]
    for name, s in conditions.items():
        retention = format_spread(s["gap_retention"], 1, percent=True, of=n) if "gap_retention" in s else ""
        penalty = format_spread(s["penalty"]) if name != "correct" else ""
        marks = {r.get("routing_marks", {}).get(name, "") for r in study["seeds"]}  # (the same in every audit, or said)
        mark = next(iter(marks)) if len(marks) == 1 else " (routers taken over differ between models)"
        same = f" {format_spread(s['same_experts'], 1, percent=True)}{mark} |" if "same_experts" in s else " |"
        lines.append(
            f"| {condition_cell(name)} | {format_spread(s['nll'])} | {penalty} | {retention} |"
            + (same if routed else "")
        )
    return lines


def format_spread(s: dict | None, digits: int = 4, percent: bool = False, of: int | None = None) -> str:
    """'mean ± sd [lo, hi]' of a spread, in percent if asked; '(n=k)' when only k of `of` models count."""
    if not s or s["mean"] is None:
        return "n/a"
    k = 100.0 if percent else 1.0
    unit = "%" if percent else ""
    text = f"{k * s['mean']:.{digits}f}{unit}"
    if s["sd"] is not None:
        lo, hi = s["ci95"]
        text += f" ± {k * s['sd']:.{digits}f}{unit} [{k * lo:.{digits}f}{unit}, {k * hi:.{digits}f}{unit}]"
    return text + (f" (n={s['n']})" if of is not None and s["n"] != of else "")


def _num(x, digits: int = 4) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def render_markdown(study: dict) -> str:
    """The study as a page for papers and READMEs: across-model table, then one row per model."""
    rows, summary, n = study["seeds"], study["summary"], study["num_models"]
    audit = study["definitions"]["audit"]
    t, c = markdown_text, markdown_code  # (every string here came from a file: shown as text or code)
    lines = [
        f"# FCA study: {n} model{'s' if n != 1 else ''}",
        "",
        f"Model type {c(audit.get('model.model_type'))}, {audit.get('model.parameters') or 0:,} parameters each; "
        f"evaluated on the {t(audit.get('cache.split'))} split of {c(audit.get('cache.corpus'))} "
        f"({t(audit.get('cache.sequences'))} x {t(audit.get('cache.seq_len'))} tokens), static profiles from the "
        f"{t(audit.get('calibration.split'))} split ({audit.get('calibration.tokens') or 0:,} tokens). "
        f"Seeds: {', '.join('?' if r['seed'] is None else str(r['seed']) for r in rows)}.",
        "",
        "Each cell: mean ± sample SD over models [95% Student t interval over models].",
        "",
        "## Functional dependence",
        "",
        *conditions_table(study),
    ]
    lines += [
        "",
        "## Variation and execution",
        "",
        "| quantity | across models |",
        "|---|---|",
        f"| layer-identity share of coefficient variance | {format_spread(summary['layer_identity_share'], 1, percent=True)} |",
        f"| latency vs Dense twin (x) | {format_spread(summary['latency_ratio_vs_dense'], 3, of=n)} |",
        f"| blocks executed per token (fraction) | {format_spread(summary['blocks_executed_fraction'], 3)} |",
        f"| controller FLOPs (share of forward) | {format_spread(summary['controller_flops_share'], 5)} |",
        "",
        "## Per model",
        "",
    ]
    conditions = list(summary["conditions"])
    penalized = [c for c in conditions if c != "correct"]
    retained = [c for c in conditions if "gap_retention" in summary["conditions"][c]]
    header = (
        ["seed", "model", "fingerprint", "NLL correct"]
        + [f"penalty {condition_cell(name)}" for name in penalized]
        + [f"retention {condition_cell(name)}" for name in retained]
        + ["layer-id share", "latency x", "audit"]
    )
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        cells = [
            str(r["seed"]) if r["seed"] is not None else "?",
            t(r["name"], cell=True),
            c(r["fingerprint"][:12]),
            _num(r["nll"].get("correct")),
            *(_num(r["penalty"].get(name)) for name in penalized),
            *(percent(r["gap_retention"].get(name)) for name in retained),
            percent(r["layer_identity_share"]),
            _num(r["latency_ratio_vs_dense"], 3),
            c(r["audit"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## Definitions", ""]
    for key, value in study["definitions"].items():
        if key != "audit":
            lines.append(f"- **{t(key)}**: {t(value)}")
    shared = (
        "definitions.penalty",
        "definitions.gap_retention",
        "definitions.layer_identity_share",
        "definitions.latency",
    )
    for key in shared:
        if audit.get(key):
            lines.append(f"- **{t(key.split('.', 1)[1])}** (each audit): {t(audit[key])}")
    return "\n".join(lines) + "\n"


def write_study(study: dict, json_path: str | Path | None = None, markdown_path: str | Path | None = None) -> None:
    """Write the study as JSON and/or Markdown, each through a temporary file renamed into place, and
    replacing only an earlier study (never, say, one of its audits)."""
    STUDY_FILES.write(json_path, lambda: strict_json(study), markdown_path, lambda: render_markdown(study))


STUDY_FILES = RenderedPair("study", json_with("fca_study_version"), starts_with("# FCA study"))


def check_study_paths(json_path: str | Path | None = None, markdown_path: str | Path | None = None) -> None:
    """What `write_study` would refuse, refused before the audits are read."""
    STUDY_FILES.check(json_path, markdown_path)


def find_studies(roots: Sequence[str | Path]) -> list[Path]:
    """Study files under the dashboard's roots: `<root>/study.json` and `<root>/<folder>/study.json`
    (e.g. `cache/demo-study/study.json`), sorted; the layout the Study page documents."""
    candidates = (path for root in map(Path, roots) for path in [root / "study.json", *root.glob("*/study.json")])
    return sorted({path.resolve() for path in candidates if path.is_file()})


def load_study(path: str | Path) -> dict:
    """A study written by `write_study`, or a one-line StudyError naming the file."""
    path = Path(path)
    try:
        study = read_json(path, StudyError)
    except StudyError as err:
        raise StudyError(f"{path}: not a readable study ({str(err).removeprefix(f'{path}: ')})") from None
    if not isinstance(study, dict) or "fca_study_version" not in study or "seeds" not in study:
        raise StudyError(f"{path}: not an FCA study (no 'fca_study_version' or 'seeds')")
    if study["fca_study_version"] != STUDY_VERSION:
        raise StudyError(f"{path}: study version {study['fca_study_version']!r}; this FCA reads {STUDY_VERSION}")
    try:  # every field the study's views read, read once here: a damaged one is this line, not a traceback
        render_markdown(study)
    except DAMAGED_FIELD_ERRORS as err:
        raise StudyError(f"{path}: not an FCA study (a field cannot be read: {damage(err)})") from None
    return study
