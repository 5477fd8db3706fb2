"""Regenerate the shipped demo (`python -m fca demo`): models, caches and the audit report.

    cache/demo/featuregate/   FeatureGate model (seed 0) trained on the King James Bible
    cache/demo/dense/         its Dense twin (same size, seed and batches)
    cache/demo/eval/          coefficient cache, eval split, 256 x 128 tokens
    cache/demo/calibration/   coefficient cache, calibration split, 256 x 128 tokens
    cache/demo/audit.json     the three-property report (and audit.md)

`make_skip_demo` (`python -m fca demo-skip`) regenerates the second demo, a model whose blocks really skip
tokens, laid out alike:

    cache/demo-skip/mod/            mixture-of-depths model (seed 0), each block run for about half the tokens
    cache/demo-skip/dense/          its Dense twin
    cache/demo-skip/eval/, calibration/, audit.json, audit.md

`make_demo_study` (`python -m fca demo-study`) trains the same configuration for more seeds and
aggregates their audits with the shipped demo's into a study:

    cache/demo-study/seed<N>/  featuregate/, dense/, eval/, calibration/ (local only, not committed)
                               audit.json, audit.md (committed)
    cache/demo-study/study.json, study.md
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from fca.engine.models.featuregate import FeatureGateConfig
from fca.engine.models.mixture_of_depths import MixtureOfDepthsConfig
from fca.jobs.audit import run_audit
from fca.jobs.build import build_cache_from_corpus
from fca.jobs.train import TrainableConfig, TrainSettings, train
from fca.tables import data
from fca.tables.audit_report import AuditReport
from fca.tables.catalog import DENSE_TWINS
from fca.tables.jsonfile import read_json_object
from fca.tables.report import render_markdown, write_report
from fca.tables.runs import SWEEP_ALPHAS
from fca.tables.study import (
    StudyError,
    check_study_paths,
    load_audit,
    load_study,
    study_from_files,
    write_study,
)

DEMO_CONFIG = dict(d_model=192, n_layers=6, n_heads=6, mlp_groups=6, max_seq_len=128)
DEMO_SEQS = 256
DEMO_AUDIT = Path("cache/demo/audit.json")  # seed 0 of every demo study
# The second demo: small enough to train on 2 CPU cores in minutes and to ship under 15 MB.
SKIP_DEMO_CONFIG = dict(d_model=128, n_layers=4, n_heads=4, max_seq_len=128, capacity=0.5)
SKIP_DEMO_SETTINGS = TrainSettings(steps=160, batch_size=16, eval_every=40)
SKIP_DEMO_MODEL = "mod"


def make_skip_demo(
    out: Path, corpus: Path, steps: int = SKIP_DEMO_SETTINGS.steps, retrain: bool = False, seed: int = 0
) -> dict:
    """Train the mixture-of-depths demo and its Dense twin on the CPU, build its caches and audit it."""
    if not corpus.exists():
        data.extract_kjv(corpus)
    settings = replace(SKIP_DEMO_SETTINGS, steps=steps, seed=seed)
    train_pair(out, corpus, SKIP_DEMO_CONFIG, settings, retrain=retrain, family=MixtureOfDepthsConfig)
    report = cache_and_audit(out, corpus, DEMO_SEQS, split_seed=0, sweep=SWEEP_ALPHAS, model=SKIP_DEMO_MODEL)
    write_report(report, out / "audit.json", out / "audit.md")
    print(render_markdown(report))
    return report


def make_demo(out: Path, corpus: Path, steps: int = 800, retrain: bool = False, seed: int = 0) -> dict:
    if not corpus.exists():
        data.extract_kjv(corpus)
    train_pair(out, corpus, DEMO_CONFIG, TrainSettings(steps=steps, seed=seed), retrain=retrain)
    report = cache_and_audit(out, corpus, DEMO_SEQS, split_seed=0, sweep=SWEEP_ALPHAS)
    write_report(report, out / "audit.json", out / "audit.md")
    print(render_markdown(report))
    return report


def train_pair(
    out: Path,
    corpus: Path,
    config: dict,
    settings: TrainSettings,
    device: str = "cpu",
    retrain: bool = False,
    show_progress: bool = True,
    family: type[TrainableConfig] = FeatureGateConfig,
) -> None:
    """A model of `family` (FeatureGate unless told) and its Dense twin (same seed and batches) into
    `out/<its directory>` (featuregate, mod) and `out/dense`; a model already there is kept unless `retrain`
    (when it was trained as asked: `check_kept_model`)."""
    dynamic = MODEL_DIRS[family.model_type]
    for arch in (dynamic, "dense"):
        model_dir = out / arch
        if retrain or not (model_dir / "model.safetensors").is_file():
            model_config = family(**config, **{DENSE_TWINS[family.model_type].switch: arch == dynamic})
            train(corpus, model_dir, model_config, settings, device=device, show_progress=show_progress)
        else:
            check_kept_model(model_dir, config, settings)


MODEL_DIRS = {FeatureGateConfig.model_type: "featuregate", MixtureOfDepthsConfig.model_type: SKIP_DEMO_MODEL}


def check_kept_model(model_dir: Path, config: dict, settings: TrainSettings) -> None:
    """A model kept from an earlier run (an interrupted study resumes) must be what this run asks for: kept
    silently, a model of another size or training would be audited under the flags given now."""
    saved = read_json_object(model_dir / "config.json") or {}
    trained = (read_json_object(model_dir / "training_log.json") or {}).get("settings")
    trained = trained if isinstance(trained, dict) else {}
    asked = {key: (saved, value) for key, value in config.items()}
    for key in ("steps", "batch_size", "lr", "seed"):
        asked[key] = (trained, getattr(settings, key))
    differing = [
        f"{key} {record[key]} (asked {value})"
        for key, (record, value) in asked.items()
        if key in record and record[key] != value
    ]
    if differing:
        raise StudyError(
            f"{model_dir}: kept from an earlier run, which trained it with {', '.join(differing[:4])}; "
            "--retrain replaces it, or choose another --out"
        )


def cache_and_audit(
    out: Path,
    corpus: Path,
    num_seqs: int,
    split_seed: int,
    device: str = "cpu",
    sweep: Sequence[float] = (),
    show_progress: bool = True,
    model: str = "featuregate",
) -> AuditReport:
    """The eval and calibration caches of `out/<model>` (batches of 16) and its audit against `out/dense`."""
    for split in ("eval", "calibration"):
        build_cache_from_corpus(
            out / model,
            corpus,
            split,
            out / split,
            num_seqs=num_seqs,
            batch_size=16,
            device=device,
            split_seed=split_seed,
            overwrite=True,
            show_progress=show_progress,
        )
    return run_audit(out / model, out / "eval", out / "calibration", out / "dense", device=device, sweep=sweep)


def make_demo_study(
    out: Path,
    corpus: Path,
    seeds: Sequence[int],
    include: Sequence[Path] = (DEMO_AUDIT,),
    device: str = "cpu",
    audit_device: str = "cpu",
    steps: int = 800,
    retrain: bool = False,
    config: dict | None = None,
    settings: TrainSettings | None = None,
    num_seqs: int = DEMO_SEQS,
    show_progress: bool = True,
) -> dict:
    """Audit the demo configuration for each of `seeds` (its FeatureGate model and Dense twin trained into
    `out/seed<N>`, their caches built and audited), then write `out/study.json` and `out/study.md` over the
    `include`d audits (the shipped demo, seed 0) followed by the new ones. `config` and `settings` default
    to the demo's (tests pass tiny ones)."""
    if not corpus.exists():
        data.extract_kjv(corpus)
    settings = settings or TrainSettings(steps=steps)
    config = config or DEMO_CONFIG
    check_study_plan(out, include, config["max_seq_len"], num_seqs)
    paths = list(include)
    for seed in seeds:
        # A seed's models already there are kept, so an interrupted study resumes. Its caches and audit run on
        # `audit_device` (CPU by default, like the shipped demo, so every seed's latency ratio is measured alike).
        seed_dir = out / f"seed{seed}"
        seeded = replace(settings, seed=seed)
        train_pair(seed_dir, corpus, config, seeded, device=device, retrain=retrain, show_progress=show_progress)
        report = cache_and_audit(
            seed_dir, corpus, num_seqs, seeded.split_seed, audit_device, show_progress=show_progress
        )
        write_report(report, seed_dir / "audit.json", seed_dir / "audit.md")
        paths.append(seed_dir / "audit.json")
        if len(paths) == len(include) + 1:  # after the first new seed, not after all: can they sit together?
            study_from_files(paths, relative_to=out)
    study = study_from_files(paths, relative_to=out)
    write_study(study, out / "study.json", out / "study.md")
    return study


def check_study_plan(out: Path, include: Sequence[Path], seq_len: int, num_seqs: int) -> None:
    """What can be refused before hours of training: included audits, or a study already in `out` (which
    this one would replace), of caches of another shape than the seeds to come. (Whether the models
    themselves compare is known after the first seed, whose audit is checked against them at once.)"""
    check_study_paths(out / "study.json", out / "study.md")  # (inside a cache, say: refused after training before)
    planned = {"cache.seq_len": seq_len, "cache.sequences": num_seqs}
    for path in include:
        cache = load_audit(path).cache
        for key, value in planned.items():
            if (had := {"cache.seq_len": cache.seq_len, "cache.sequences": cache.sequences}[key]) != value:
                raise StudyError(
                    f"{path}: an audit with {key} {had}, and this study's seeds will have {value}; "
                    "leave it out (--include with the audits to keep, or a bare --include for none)"
                )
    existing = out / "study.json"
    if existing.is_file():
        audit = load_study(existing)["definitions"]["audit"]
        for key, value in planned.items():
            if audit.get(key) != value:
                raise StudyError(
                    f"{existing}: a study of audits with {key} {audit.get(key)}, and this one's have {value}; "
                    "it would be replaced: choose another --out"
                )
