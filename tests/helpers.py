"""Small real artifacts for tests: a generated prose corpus, trained tokenizers and tiny models."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fca.engine.loading import save_model
from fca.engine.models.featuregate import FeatureGateConfig, build_featuregate
from fca.tables import data

SUBJECTS = [
    "the king",
    "a shepherd",
    "the people",
    "my brother",
    "the prophet",
    "a stranger",
    "the elders",
    "his servant",
]
VERBS = ["went up to", "spoke unto", "looked upon", "dwelt in", "came down from", "built", "remembered", "sought"]
OBJECTS = [
    "the city",
    "the mountain",
    "the river",
    "the house of bread",
    "the field",
    "the temple",
    "the valley",
    "the gate",
]
TAILS = ["in the morning", "by night", "with great joy", "and was afraid", "for seven days", "as it was written"]


def write_corpus(path: Path, num_docs: int = 400, seed: int = 0) -> Path:
    """Blank-line-separated paragraphs of simple, patterned prose (enough for all three splits)."""
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(num_docs):
        sentences = []
        for _ in range(int(rng.integers(3, 7))):
            words = [
                SUBJECTS[rng.integers(len(SUBJECTS))],
                VERBS[rng.integers(len(VERBS))],
                OBJECTS[rng.integers(len(OBJECTS))],
            ]
            if rng.random() < 0.5:
                words.append(TAILS[rng.integers(len(TAILS))])
            sentences.append(" ".join(words).capitalize() + ".")
        docs.append(" ".join(sentences))
    path.write_text("\n\n".join(docs) + "\n")
    return path


TINY = dict(d_model=32, n_layers=2, n_heads=2, mlp_groups=2, max_seq_len=16)


def make_model_dir(
    out: Path, corpus: Path, gated: bool = True, seed: int = 0, vocab_size: int = 320, **overrides
) -> Path:
    """An untrained tiny model with a tokenizer trained on the corpus' train split, saved like a real one."""
    tokenizer = data.train_tokenizer(data.split_documents(data.load_documents(corpus), 0)["train"], vocab_size)
    config = FeatureGateConfig(
        **{**TINY, **overrides}, vocab_size=tokenizer.get_vocab_size(), gated=gated, init_seed=seed
    )
    return save_model(build_featuregate(config).eval(), out, tokenizer)
