"""Shared fixtures: a tiny demo-shaped folder built once per test session (seconds, CPU only).

`tiny_demo` mirrors cache/demo/: featuregate/ (model), dense/ (its Dense twin), eval/ and calibration/
(caches), audit.json and audit.md (the report), all from a 2-layer, d_model=32 model on a generated corpus.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

WORDS = (
    "the lord said unto moses and aaron speak children israel land water light darkness day night "
    "heaven earth king people house city gold silver bread wine shepherd sheep river mountain"
).split()


def _corpus(path: Path, paragraphs: int = 400, seed: int = 0) -> Path:
    """~400 short blank-line-separated paragraphs: enough for 8 windows of 16 tokens in every split
    (data.split_documents gives calibration and eval 5% each)."""
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(paragraphs):
        sentences = [
            " ".join(rng.choice(WORDS, size=rng.integers(5, 12))).capitalize() + "." for _ in range(rng.integers(2, 4))
        ]
        docs.append(" ".join(sentences))
    path.write_text("\n\n".join(docs) + "\n")
    return path


@pytest.fixture(scope="session")
def tiny_demo(tmp_path_factory) -> Path:
    import torch

    from fca.engine.loading import save_model
    from fca.engine.models.featuregate import FeatureGateConfig, build_featuregate
    from fca.jobs.audit import run_audit
    from fca.jobs.build import build_cache_from_corpus
    from fca.tables import data
    from fca.tables.report import write_report

    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("tiny_demo")
    corpus = _corpus(root / "corpus.txt")
    train_docs = data.split_documents(data.load_documents(corpus), seed=0)["train"]
    tokenizer = data.train_tokenizer(train_docs, vocab_size=300)
    sizes = dict(vocab_size=tokenizer.get_vocab_size(), d_model=32, n_layers=2, n_heads=2, mlp_groups=2, max_seq_len=16)
    save_model(build_featuregate(FeatureGateConfig(**sizes)), root / "featuregate", tokenizer)
    save_model(build_featuregate(FeatureGateConfig(**sizes, gated=False)), root / "dense", tokenizer)
    for split in ("eval", "calibration"):
        build_cache_from_corpus(
            root / "featuregate",
            corpus,
            split,
            root / split,
            num_seqs=8,
            seq_len=16,
            batch_size=4,
            device="cpu",
            show_progress=False,
        )
    report = run_audit(  # without the interpolation sweep: the app tests count the Overview's charts
        root / "featuregate",
        root / "eval",
        root / "calibration",
        root / "dense",
        device="cpu",
        latency_runs=2,
        sweep=(),
    )
    write_report(report, root / "audit.json", root / "audit.md")
    return root


@pytest.fixture(autouse=True, scope="session")
def _no_background_warm_up():
    """AppTest runs the app in this process, and the app's background warm-up would outlive the tests and
    log after pytest has closed its output. The test of the warm-up itself sets a delay of 0."""
    from app import resources

    resources.WARM_UP_DELAY_S = None


# ------------------------------------------------------------------ which modules a run executes
# `pytest -m "not slow" --touched-modules` lists the modules of fca/ and app/ whose code the run executed
# (a function or page ran), those only imported, and those never loaded: the everyday run is meant to
# touch every one. A global trace function sees each new frame once and traces no lines. Code run in
# subprocesses (CLI tests that start `python -m fca`) is not seen.

_code_seen: set = set()


def pytest_addoption(parser):
    parser.addoption(
        "--touched-modules",
        action="store_true",
        help="after the run, list the modules of fca/ and app/ it executed, only imported, or never loaded",
    )


def _note_frame(frame, event, arg):
    _code_seen.add(frame.f_code)


def pytest_configure(config):
    if config.getoption("--touched-modules"):
        import threading

        sys.settrace(_note_frame)
        threading.settrace(_note_frame)


def pytest_terminal_summary(terminalreporter, config):
    if not config.getoption("--touched-modules"):
        return
    sys.settrace(None)
    ran: dict[str, set[str]] = {}
    for code in list(_code_seen):
        ran.setdefault(code.co_filename, set()).add(code.co_name)
    modules = sorted(
        p for top in ("fca", "app") for p in (REPO / top).rglob("*.py") if p.stat().st_size
    )  # (empty: no code)
    executed, imported, missed = [], [], []
    for path in modules:
        names = ran.get(str(path), set())
        name = str(path.relative_to(REPO))
        (executed if names - {"<module>"} else imported if names else missed).append(name)
    write = terminalreporter.write_line
    write(f"modules of fca/ and app/: {len(modules)}; executed {len(executed)}, only imported {len(imported)}")
    for label, names in (("only imported", imported), ("never loaded", missed)):
        if names:
            write(f"{label}: {', '.join(names)}")
