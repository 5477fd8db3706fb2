"""Regenerate the shipped demo (`python -m fca demo`): models, caches and the audit report.

    cache/demo/featuregate/   FeatureGate model (seed 0) trained on the King James Bible
    cache/demo/dense/         its Dense twin (same size, seed and batches)
    cache/demo/eval/          coefficient cache, eval split, 256 x 128 tokens
    cache/demo/calibration/   coefficient cache, calibration split, 256 x 128 tokens
    cache/demo/audit.json     the three-property report (and audit.md)
"""

from __future__ import annotations

from pathlib import Path

from . import data
from .audit import render_markdown, run_audit, write_report
from .capture import build_cache
from .models.featuregate import FeatureGateConfig
from .train import TrainSettings, train

DEMO_CONFIG = dict(d_model=192, n_layers=6, n_heads=6, mlp_groups=6, max_seq_len=128)
DEMO_SEQS = 256


def make_demo(out: Path, corpus: Path, steps: int = 800, retrain: bool = False, seed: int = 0) -> dict:
    if not corpus.exists():
        data.extract_kjv(corpus)
    for arch in ("featuregate", "dense"):
        model_dir = out / arch
        if retrain or not (model_dir / "model.safetensors").is_file():
            config = FeatureGateConfig(**DEMO_CONFIG, gated=(arch == "featuregate"))
            train(corpus, model_dir, config, TrainSettings(steps=steps, seed=seed))
    for split in ("eval", "calibration"):
        build_cache(out / "featuregate", corpus, split, out / split, num_seqs=DEMO_SEQS, batch_size=16, device="cpu", overwrite=True)
    report = run_audit(out / "featuregate", out / "eval", out / "calibration", out / "dense", device="cpu")
    write_report(report, out / "audit.json", out / "audit.md")
    print(render_markdown(report))
    return report
