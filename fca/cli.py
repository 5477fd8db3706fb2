"""`python -m fca SUBCOMMAND ...`: the command-line face of the library.

Every subcommand reports bad input as one line on stderr (`fca: error: ...`) and exits non-zero.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from . import data
from .loading import ModelLoadError

# Errors that are the user's input, not our bug: reported as one line, exit code 2.
USER_ERRORS: tuple[type[BaseException], ...] = (data.CorpusError, ModelLoadError, FileNotFoundError, KeyError)


def _add_model_size_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--d-model", type=int, default=192)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--mlp-groups", type=int, default=6)
    p.add_argument("--seq-len", type=int, default=128, help="context length (tokens)")
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--controller", choices=["linear", "mlp"], default="linear")
    p.add_argument("--granularity", choices=["group", "feature"], default="group")


def cmd_corpus(args: argparse.Namespace) -> None:
    out = data.extract_kjv(args.out)
    docs = data.load_documents(out)
    print(f"wrote {out}: {len(docs)} documents, {out.stat().st_size / 1e6:.1f} MB")


def _train_one(args: argparse.Namespace, arch: str, seed: int, out: Path) -> dict:
    from .models.featuregate import FeatureGateConfig
    from .train import TrainSettings, train

    config = FeatureGateConfig(
        d_model=args.d_model, n_layers=args.layers, n_heads=args.heads, mlp_groups=args.mlp_groups,
        max_seq_len=args.seq_len, gated=(arch == "featuregate"), controller=args.controller, granularity=args.granularity,
    )
    settings = TrainSettings(steps=args.steps, batch_size=args.batch, lr=args.lr, seed=seed, split_seed=args.split_seed, vocab_size=args.vocab_size)
    log = train(args.corpus, out, config, settings)
    print(f"{out}: {arch}, {log['parameters']:,} parameters, held-out NLL {log['final_eval_nll']:.4f} nats/token "
          f"({log['final_eval_tokens']:,} tokens), {log['train_seconds']:.0f} s")
    return log


def cmd_train(args: argparse.Namespace) -> None:
    _train_one(args, args.arch, args.seed, Path(args.out))


def cmd_train_seeds(args: argparse.Namespace) -> None:
    for seed in args.seeds:
        for arch in args.arch:
            _train_one(args, arch, seed, Path(args.out) / f"{arch}-seed{seed}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fca", description="Frozen-Controller Auditing of dynamic neural networks.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("corpus", help="extract the default corpus (King James Bible, Debian's bible-kjv) to a text file")
    p.add_argument("--out", default="data/kjv.txt")
    p.set_defaults(func=cmd_corpus)

    for name, helptext in (("train", "train a FeatureGate model or its Dense twin"), ("train-seeds", "train several seeds (gated and dense) for multi-seed studies")):
        p = sub.add_parser(name, help=helptext)
        if name == "train":
            p.add_argument("--arch", choices=["featuregate", "dense"], default="featuregate")
            p.add_argument("--seed", type=int, default=0)
        else:
            p.add_argument("--arch", nargs="+", choices=["featuregate", "dense"], default=["featuregate", "dense"])
            p.add_argument("--seeds", type=int, nargs="+", required=True)
        p.add_argument("--corpus", required=True, help="text file, folder of .txt files, or Parquet/Arrow with a 'text' column")
        p.add_argument("--out", required=True, help="output model directory" if name == "train" else "parent directory: one subdirectory per arch and seed")
        p.add_argument("--steps", type=int, default=800)
        p.add_argument("--batch", type=int, default=32)
        p.add_argument("--lr", type=float, default=2e-3)
        p.add_argument("--split-seed", type=int, default=0, help="seed of the train/calibration/eval document split")
        _add_model_size_flags(p)
        p.set_defaults(func=cmd_train if name == "train" else cmd_train_seeds)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except USER_ERRORS as err:
        message = err.args[0] if isinstance(err, KeyError) and err.args else str(err)
        print(f"fca: error: {message}", file=sys.stderr)
        return 2
    return 0
