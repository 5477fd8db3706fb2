"""`python -m fca SUBCOMMAND ...`: the command-line face of the library.

Every subcommand reports bad input as one line on stderr (`fca: error: ...`) and exits non-zero.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import sys
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import NoReturn

# Only torch-free modules at module level, so `fca --help` stays fast; each subcommand imports what it runs.
from fca.tables.errors import CacheError, CorpusError, ExactnessError, ModelLoadError

# Errors that are the user's input or machine, not our bug: reported as one line, exit code 2 (FCA_DEBUG=1
# shows the traceback instead). OSError: a path that cannot be written or read (permissions, a file where a
# folder should be, a full disk); its message names the path.
USER_ERRORS: tuple[type[BaseException], ...] = (
    CorpusError,
    ModelLoadError,
    CacheError,
    OSError,
    KeyError,
    ValueError,
)
EXIT_INEXACT = 3
DTYPES = ["float32", "bfloat16", "float16"]
REPLAY_DTYPE_HELP = "model weights dtype (default: the one the cache's coefficients were recorded with)"


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    """The model's size and training: read by `_model_and_settings`."""
    p.add_argument("--steps", type=_positive_int, default=800, help="optimizer steps")
    p.add_argument("--batch", type=_positive_int, default=32, help="training windows per step")
    p.add_argument("--lr", type=_learning_rate, default=2e-3, help="peak learning rate (cosine decay to a tenth)")
    p.add_argument("--d-model", type=_positive_int, default=192)
    p.add_argument("--layers", type=_positive_int, default=6)
    p.add_argument("--heads", type=_positive_int, default=6)
    p.add_argument("--mlp-groups", type=_positive_int, default=6)
    p.add_argument("--seq-len", type=_positive_int, default=128, help="context length (tokens)")
    p.add_argument(
        "--vocab-size",
        type=_whole_number(257),  # (a smaller size still gave 257: the byte alphabet and the end-of-text token)
        default=2048,
        help="BPE vocabulary, at least 257: the 256 bytes and the end-of-text token",
    )
    p.add_argument("--controller", choices=["linear", "mlp"], default="linear")
    p.add_argument("--granularity", choices=["group", "feature"], default="group")


ARCHS = ("featuregate", "dense")


def _add_training_flags(p: argparse.ArgumentParser) -> None:
    """train's and train-seeds' flags after the architectures, seeds and output."""
    p.add_argument(
        "--corpus", required=True, help="text file, folder of .txt files, or Parquet/Arrow with a 'text' column"
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing model directory")
    p.add_argument("--split-seed", type=_seed, default=0, help="seed of the train/calibration/eval document split")
    p.add_argument("--text-column", default="text", help="text column of a Parquet/Arrow corpus")
    p.add_argument(
        "--device",
        type=_device,
        default="cpu",
        help="cpu (default: float32, how the shipped demo was trained) or cuda[:N] (bf16 autocast, "
        "fused AdamW, float32 weights saved); auto: cuda when available",
    )
    _add_model_flags(p)


def _model_and_settings(args: argparse.Namespace, **settings):
    """`_add_model_flags`' values: FeatureGateConfig's fields but `gated`, and the TrainSettings (`settings`:
    more of its fields)."""
    from fca.jobs.train import TrainSettings

    config = dict(
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.heads,
        mlp_groups=args.mlp_groups,
        max_seq_len=args.seq_len,
        controller=args.controller,
        granularity=args.granularity,
    )
    training = TrainSettings(
        steps=args.steps,
        batch_size=args.batch,
        lr=args.lr,
        min_lr=args.lr / 10,  # (the help's "cosine decay to a tenth"; fixed at 2e-4 it rose for --lr below that)
        vocab_size=args.vocab_size,
        **settings,
    )
    return config, training


def cmd_corpus(args: argparse.Namespace) -> None:
    from fca.tables import data

    out = data.extract_kjv(args.out, overwrite=args.overwrite)
    docs = data.load_documents(out)
    print(f"wrote {out}: {len(docs)} documents, {out.stat().st_size / 1e6:.1f} MB")


def cmd_train(args: argparse.Namespace) -> None:
    _train_all(args, [(args.arch, args.seed, Path(args.out))])


def cmd_train_seeds(args: argparse.Namespace) -> None:
    _check_distinct(args.seeds, "--seeds")
    _check_distinct(args.arch, "--arch")
    _train_all(args, [(arch, seed, Path(args.out) / f"{arch}-seed{seed}") for seed in args.seeds for arch in args.arch])


def _check_distinct(values: list, option: str) -> None:
    """A value given twice would train (and, in a study, audit) one model twice, the second replacing the first."""
    twice = sorted({v for v in values if values.count(v) > 1}, key=str)
    if twice:
        raise ValueError(f"{option} gives {', '.join(map(str, twice))} more than once")


def _train_all(args: argparse.Namespace, runs: list[tuple[str, int, Path]]) -> None:
    from fca.engine.loading import is_model_file
    from fca.engine.models.featuregate import FeatureGateConfig
    from fca.jobs.train import train
    from fca.tables.outputs import check_replaceable

    for _, _, out in runs:  # every destination checked before minutes of training, not after
        check_replaceable(out, "model", is_model_file, "config.json", args.overwrite)
    for arch, seed, out in runs:
        size, settings = _model_and_settings(args, seed=seed, split_seed=args.split_seed)
        config = FeatureGateConfig(**size, gated=(arch == "featuregate"))
        log = train(args.corpus, out, config, settings, text_column=args.text_column, device=args.device)
        print(
            f"{out}: {arch}, {log['parameters']:,} parameters, held-out NLL {log['final_eval_nll']:.4f} nats/token "
            f"({log['final_eval_tokens']:,} tokens), {log['train_seconds']:.0f} s on {log['device_name']} "
            f"({log['precision']}, {log['tokens_per_second'] or 0:,.0f} tokens/s)"
        )


def _dtype(name: str | None):
    """A --dtype flag's torch dtype (None: not given)."""
    import torch

    return None if name is None else getattr(torch, name)


def cmd_build_cache(args: argparse.Namespace) -> None:
    from fca.jobs.build import build_cache_from_corpus
    from fca.tables.manifest import Manifest
    from fca.tables.store import open_cache
    from fca.tables.writer_store import is_uri, published_manifest

    # `fca.jobs.build.BuildSpec`'s fields: the flags named as the fields, then the batch and the dtype
    same = ("num_seqs", "seq_len", "device", "split_seed", "text_column", "coefficient_dtype", "part_seqs")
    settings = {name: getattr(args, name) for name in same} | dict(batch_size=args.batch, dtype=_dtype(args.dtype))
    writers = {"workers": args.writers} if args.engine == "local" else {}  # (Ray's actors write their parts inline)
    out = _on_engine(args, build_cache_from_corpus, "build_cache_distributed")(
        args.model, args.corpus, args.split, args.out, overwrite=args.overwrite, **writers, **settings
    )
    if is_uri(str(out)):  # published to a filesystem URI: its manifest says what was written
        manifest = Manifest.from_json(published_manifest(str(out)), str(out))
    else:
        manifest = open_cache(out).manifest
    print(
        f"wrote {out}: {manifest.num_seqs} sequences x {manifest.seq_len} tokens, {len(manifest.sites)} sites, "
        f"{manifest.total_bytes / 1e6:.2f} MB"
    )


def _add_family_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--family", action="append", default=[], metavar="FILE", help=FAMILY_HELP)


def load_families(args: argparse.Namespace) -> None:
    """Run the family files FCA_FAMILIES and --family name (in that order: a later one's family of a
    model_type replaces an earlier one's), and load installed packages' families, before the command
    starts its work; the files are kept in `args.family_files` for the processes the command starts."""
    listed = os.environ.get("FCA_FAMILIES", "").split(os.pathsep)
    args.family_files = [*(p.strip() for p in listed if p.strip()), *args.family]
    if args.family_files:
        from fca.engine.user_families import load_family_files  # (torch: only once there is a family to load)

        load_family_files(args.family_files)
    elif args.command != "dashboard":  # (the app's server imports torch when a page needs it, not sooner)
        from fca.engine.families import registered_families

        registered_families()  # installed packages' families: a broken one is said before the work starts


def _add_replay_flags(p: argparse.ArgumentParser) -> None:
    """audit's and replay's flags: what they replay, and how."""
    p.add_argument("--model", required=True, help=MODEL_HELP)
    p.add_argument("--cache", required=True, help="evaluated cache")
    p.add_argument("--calibration", required=True, help="calibration cache (an independent split)")
    p.add_argument("--device", type=_device, default="auto", help=DEVICE_HELP)
    p.add_argument("--dtype", choices=DTYPES, default=None, help=REPLAY_DTYPE_HELP)
    p.add_argument("--batch", type=_positive_int, default=None, help=REPLAY_BATCH_HELP)
    p.add_argument("--seed", type=_seed, default=0, help=SEED_HELP)
    _add_engine_flags(p, "replayed sequences")
    _add_family_flag(p)


def _replay_settings(args: argparse.Namespace) -> dict:
    """audit's and replay's keywords from `_add_replay_flags` and their --num-seqs."""
    same = {name: getattr(args, name) for name in ("device", "num_seqs", "seed")}
    return same | dict(dtype=_dtype(args.dtype), batch_size=args.batch)


def _add_engine_flags(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--engine",
        choices=["local", "ray"],
        default="local",
        help=f"local: one process (default); ray: {what} sharded over Ray actors (pip install ray)",
    )
    p.add_argument("--address", default=None, help="Ray cluster address (default: start a local cluster)")
    p.add_argument(
        "--workers", type=_positive_int, default=None, help="Ray actors (default: one per GPU, else one per CPU)"
    )


def _on_engine(args: argparse.Namespace, local: Callable, distributed: str) -> Callable:
    """`local`, or with --engine ray its form sharded over Ray actors: `fca.jobs.distributed.<distributed>`."""
    if args.engine == "local":
        return local
    from fca.jobs import distributed as ray_engine

    return partial(getattr(ray_engine, distributed), workers=args.workers, address=args.address)


def _progress_bars():
    from tqdm.auto import tqdm

    bars: dict = {}

    def progress(stage: str, done: int, total: int) -> None:
        bar = bars.get(stage) or bars.setdefault(stage, tqdm(total=total, desc=stage, unit="seq"))
        bar.update(done - bar.n)

    return progress, bars


def _whole_number(minimum: int, maximum: int | None = None):
    """An argparse type: a whole number of at least `minimum` (1 for counts and sizes, 0 for seeds), and at most
    `maximum` if given."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, not {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, not {value}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"must be at most {maximum}, not {value}")
        return value

    return parse


_positive_int, _seed = _whole_number(1), _whole_number(0)
MAX_PORT = 65535  # (a TCP port is 16 bits)
_port = _whole_number(1, MAX_PORT)  # --port (a larger one reached the server, which failed on it)


def _learning_rate(text: str) -> float:
    """--lr: a finite number above 0 (inf or nan would train every weight into NaN, and save them)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, not {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, not {text}")
    return value


def _device(text: str) -> str:
    """--device: auto, cpu, cuda or cuda:N, checked when the command line is read (whether CUDA is there is
    checked when the device is used)."""
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", text):
        raise argparse.ArgumentTypeError(f"expected auto, cpu, cuda or cuda:N, not {text!r}")
    return text


def _alphas(text: str) -> tuple[float, ...]:
    """`--sweep 0,0.5,1` -> (0.0, 0.5, 1.0); `none` or an empty text -> no sweep."""
    if text.strip().lower() in ("", "none"):
        return ()
    try:
        return tuple(float(a) for a in text.split(",") if a.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--sweep takes comma-separated numbers or 'none', not {text!r}") from None


def cmd_audit(args: argparse.Namespace) -> None:
    from fca.jobs.audit import run_audit
    from fca.tables.report import check_report_paths, exactness_sentences, render_markdown, write_report

    check_report_paths(args.json, args.markdown)

    progress, bars = _progress_bars()
    try:
        report = _on_engine(args, run_audit, "run_audit_distributed")(
            args.model,
            args.cache,
            args.calibration,
            args.dense,
            **_replay_settings(args),
            extra_conditions=args.extra_conditions,
            progress=progress,
            **({} if args.sweep is None else {"sweep": args.sweep}),  # None: the audit's SWEEP_ALPHAS
        )
    finally:
        for bar in bars.values():
            bar.close()
    write_report(report, args.json, args.markdown)
    audited = report.cache.sequences
    if args.num_seqs is not None and audited < args.num_seqs:  # said as replay says it, on stderr (stdout: Markdown)
        print(f"{args.cache}: {audited} sequences audited (all it has; {args.num_seqs} asked for)", file=sys.stderr)
    if not args.json and not args.markdown:
        print(render_markdown(report))
    else:
        print(*exactness_sentences(report.exactness), sep="\n")
        share, static = report.variance.layer_identity_share, report.gap_retention.get("static_layer")
        print(
            " ".join(f"{k}={v.nll:.4f}" for k, v in report.conditions.items()),
            f"| static_layer retention {'undefined' if static is None else f'{100 * static:.1f}%'}",
            f"| layer-identity share {'undefined' if share is None else f'{share:.3f}'}",
        )


def cmd_report(args: argparse.Namespace) -> None:
    from fca.tables.report import read_report, render_markdown, write_report

    report = read_report(args.json)
    if args.markdown:
        write_report(report, markdown_path=args.markdown)
        print(f"wrote {args.markdown}")
    else:
        print(render_markdown(report), end="")


def cmd_inspect(args: argparse.Namespace) -> None:
    from fca.tables.environment import describe
    from fca.tables.fidelity import replay_standard
    from fca.tables.store import open_cache

    cache = open_cache(args.cache, verify=args.verify)  # (before torch is imported: a refusal costs ~80 MB, not 270)
    from fca.engine.environment import environment_on
    from fca.engine.loading import resolve_device

    device = resolve_device(args.device)
    if args.verify:  # the stored moments too: hashed and read, as the audit and the dashboard read them
        from fca.tables.profiles import slot_layout, stored_moments

        stored_moments(cache, slot_layout(cache), with_tokens=False)
    m = cache.manifest
    print(
        f"{cache.path}: {cache.num_seqs} sequences x {cache.seq_len} tokens ({m.num_tokens:,} tokens), "
        f"split {m.corpus.split!r} of {m.corpus.name}, {len(m.parts)} part file(s), {m.total_bytes / 1e6:.2f} MB, "
        f"{m.coefficient_dtype} coefficients"
    )
    print(
        f"model {m.model.model_type} {m.model.fingerprint[:16]} ({cache.model_dtype}); "
        f"{'parts verified' if args.verify else 'parts not hashed (use --verify)'}"
    )
    batch = (cache.environment or {}).get("batch_size")
    print(f"coefficients computed on {describe(cache.environment)}" + (f", in batches of {batch}" if batch else ""))
    eos = m.tokenizer.end_of_document
    print(
        f"end-of-document id {eos}: reports give CIs over the documents the windows lie in"
        if eos is not None and m.corpus.split is not None
        else "no end-of-document id recorded: reports resample windows only, not documents"
    )
    here = environment_on(device, cache.model_dtype)  # (the dtype a replay loads the model in)
    print(
        f"a replay here ({describe(here)}) would find {replay_standard(cache.environment, here, m.coefficient_dtype)}"
    )
    for name, spec in m.sites.items():
        axes = [[axis, size] for axis, size in spec.axes]  # printed as the manifest writes them
        # Per-channel families (MUDDPythia's q, k, v, r streams) are what global_mean averages within.
        families = ",".join(dict.fromkeys(spec.families_per_channel()))
        print(f"  {name}: K={spec.num_channels} axes={axes} family={families}")


def cmd_replay(args: argparse.Namespace) -> None:
    from fca.jobs.runs import run_replay
    from fca.tables.audit_report import Exactness
    from fca.tables.report import documents_note, exactness_sentences
    from fca.tables.stats import MIN_BOOTSTRAP_VALUES

    record = _on_engine(args, run_replay, "run_replay_distributed")(
        args.model,
        args.cache,
        args.calibration,
        args.conditions,
        **_replay_settings(args),
        save=not args.no_save,
        show_progress=True,
    )
    asked, n = args.num_seqs, record["spec"]["num_seqs"]
    results = record["results"]
    print(f"{args.cache}: {n} sequences replayed" + (f" (all it has; {asked} asked for)" if n < asked else ""))
    print(*exactness_sentences(Exactness.read(results["exactness"], "exactness")), sep="\n")
    routing = results.get("routing", {})  # (models with routers)
    rows = results["conditions"]
    width = max(map(len, rows), default=0)  # a condition naming sites can be long: the columns follow it
    for name, row in rows.items():
        lo, hi = row["penalty_ci95"]
        ci = f"[{lo:+.4f}, {hi:+.4f}]" if math.isfinite(lo) else f"(no CI from under {MIN_BOOTSTRAP_VALUES} sequences)"
        if "penalty_ci95_documents" in row:  # (the cache records the windows' documents: the interval to quote)
            lo, hi = row["penalty_ci95_documents"]
            ci = f"[{lo:+.4f}, {hi:+.4f}] over documents, {ci} over sequences"
        print(
            f"{name:{width}s}  NLL {row['nll']:.4f}  penalty {row['penalty']:+.4f} {ci}{_routing_figures(routing, name)}"
        )
    if note := documents_note(n, results.get("documents")):
        print(note)
    print(retention_lines(results))
    if routing.get("conditions"):  # (routers whose experts were observed)
        chance = routing["chance"]
        print(
            f"same experts: tokens that ran the same experts as on their own coefficients (read at the experts); "
            f"kept: the share of those experts kept; weight kept: the share of each token's mixing weight left "
            f"on them. Experts drawn at random: {100 * chance['same_experts']:.1f}% and "
            f"{100 * chance['expert_overlap']:.1f}%."
        )
    if note := routing.get("not_reported"):
        print(note)
    if record.get("path"):
        print(f"saved {record['path']}")


def retention_lines(results: dict) -> str:
    """A replay's gap retention, each with its 95% CI, or why there is none (never silently absent)."""
    conditions = results["conditions"]
    if "global_mean" not in conditions or "correct" not in conditions:
        return "gap retention: not defined for this run (it needs correct and global_mean among the conditions)"
    retention, intervals = results["gap_retention"], results["gap_retention_ci95"]
    if not retention or all(v is None for v in retention.values()):
        return "gap retention: undefined (the global-mean profile's penalty CI does not lie above 0)"
    lines = ["gap retention (0% = global mean, 100% = correct):"]
    for name, value in retention.items():
        shown = "undefined" if value is None else f"{100 * value:.1f}%"
        if name in intervals:
            lo, hi = intervals[name]
            shown += f" [95% CI {100 * lo:.1f}% to {100 * hi:.1f}%]"
        elif value is not None:
            shown += " (no CI: too few sequences, or too many resamples without a gap)"
        lines.append(f"  {name}: {shown}")
    return "\n".join(lines)


def _routing_figures(routing: dict, name: str) -> str:
    """A replay line's routing figures (models with observed routers), with what they are taken over."""
    from fca.tables.report import routing_scope

    if name not in routing.get("conditions", {}):
        return ""
    row = routing["conditions"][name]
    mark = routing_scope(row["routers_changed"], list(routing["routers"]))
    if row["same_experts"] is None:
        return f" {mark}"
    weight = row.get("weight_kept")
    return (
        f"  same experts {100 * row['same_experts']:.1f}%, kept {100 * row['expert_overlap']:.1f}%"
        + (f", weight kept {100 * weight:.1f}%" if weight is not None else "")
        + mark
    )


def cmd_bench(args: argparse.Namespace) -> None:
    from fca.jobs.bench import run_bench
    from fca.tables.outputs import check_output, json_with, write_output

    # The JSON path is checked before minutes of measuring, and replaces only an earlier bench result.
    kind, earlier = "bench result (JSON)", json_with("capture_ratio")
    if args.json:
        check_output(args.json, kind, earlier)
    result = run_bench(args.model, args.corpus, device=args.device, show_progress=True)
    text = json.dumps(result, indent=1)
    if args.json:
        write_output(args.json, text, kind, earlier)
    print(text)


def cmd_study(args: argparse.Namespace) -> None:
    from fca.tables.study import check_study_paths, render_markdown, study_from_files, write_study

    check_study_paths(args.json, args.markdown)
    out_dir = Path(args.json).parent if args.json else (Path(args.markdown).parent if args.markdown else None)
    study = study_from_files(args.audits, relative_to=out_dir)
    write_study(study, args.json, args.markdown)
    if not args.json and not args.markdown:
        print(render_markdown(study), end="")
    else:
        static = study["summary"]["conditions"].get("static_layer", {}).get("gap_retention") or {}
        n = study["num_models"]
        shown = "n/a" if static.get("mean") is None else f"{100 * static['mean']:.1f}%"
        if static.get("n") is not None and static["n"] < n:  # (undefined for some models: their mean is not all)
            shown += f" (defined for {static['n']} of the {n})"
        written = " and ".join(str(p) for p in (args.json, args.markdown) if p)
        print(f"{n} model{'s' if n != 1 else ''}, static_layer gap retention mean {shown}; wrote {written}")


def cmd_demo_study(args: argparse.Namespace) -> None:
    from fca.jobs.demo import make_demo_study
    from fca.tables.study import render_markdown

    _check_distinct(args.seeds, "--seeds")
    # The size flags default to the demo configuration; other sizes make a study of their own (pass
    # `--include` with no file then: the shipped demo's audit is of another model size and is refused).
    config, settings = _model_and_settings(args)
    study = make_demo_study(
        Path(args.out),
        Path(args.corpus),
        args.seeds,
        include=[Path(p) for p in args.include],
        device=args.device,
        audit_device=args.audit_device,
        retrain=args.retrain,
        config=config,
        settings=settings,
        num_seqs=args.num_seqs,
    )
    print(render_markdown(study), end="")
    print(f"wrote {Path(args.out) / 'study.json'} and {Path(args.out) / 'study.md'}")


def cmd_demo(args: argparse.Namespace) -> None:
    """demo and demo-skip."""
    from fca.jobs.demo import make_demo, make_skip_demo

    make = make_demo if args.command == "demo" else make_skip_demo
    steps = {} if args.steps is None else {"steps": args.steps}  # (demo-skip's own unless told)
    make(Path(args.out), Path(args.corpus), retrain=args.retrain, **steps)


def dashboard_command(address: str, port: int) -> list[str]:
    """`streamlit run app/main.py` bound to `address`, with the repository's settings (no usage statistics,
    no file watching) whichever folder it is started from: streamlit reads `.streamlit/config.toml` only
    from the folder it is started in."""
    main_py = Path(__file__).resolve().parent.parent / "app" / "main.py"
    if not main_py.is_file():
        raise FileNotFoundError(f"{main_py}: the dashboard ships with the repository, not with the package")
    settings = {
        "server.address": address,
        "server.port": port,
        "server.headless": "true",
        "server.fileWatcherType": "none",
        "browser.gatherUsageStats": "false",
    }
    return [sys.executable, "-m", "streamlit", "run", str(main_py), *(f"--{k}={v}" for k, v in settings.items())]


def dashboard_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The app's environment: streamlit starts in the repository (its settings live there), so the paths in
    the variables the app reads are made absolute against the folder the command was given in."""
    env = dict(environ)
    for name in ("FCA_DEFAULT_CACHE", "FCA_FAMILIES", "FCA_CACHE_ROOTS"):
        if env.get(name, "").strip():  # (the other two are os.pathsep-separated lists; one cache's path may hold it)
            paths = [env[name]] if name == "FCA_DEFAULT_CACHE" else env[name].split(os.pathsep)
            env[name] = os.pathsep.join(str(Path(p.strip()).expanduser().absolute()) for p in paths if p.strip())
    return env


# What the dashboard imports beyond the library: the `app` extra of pyproject.toml.
DASHBOARD_MODULES = ("streamlit", "plotly")


def cmd_dashboard(args: argparse.Namespace) -> NoReturn:
    # Checked before the URL is printed: without them the server died at once with a bare ModuleNotFoundError.
    missing = [name for name in DASHBOARD_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        raise ValueError(f'the dashboard needs {" and ".join(missing)} (pip install -e ".[app]")')
    command = dashboard_command(args.address, args.port)
    print(f"FCA dashboard: http://{'localhost' if args.address == '127.0.0.1' else args.address}:{args.port}")
    sys.stdout.flush()
    # This process becomes streamlit, started in the repository (its settings live there): a signal sent to
    # it (Ctrl-C, kill, a timeout) reaches the server itself, and the server's exit status is the command's.
    # The family files (checked above, by `load_families`) reach the app as FCA_FAMILIES. Paths are made
    # absolute here, before leaving the folder the command was given in.
    environ = dashboard_environment({**os.environ, "FCA_FAMILIES": os.pathsep.join(args.family_files)})
    os.chdir(Path(command[4]).parent.parent)
    os.execve(command[0], command, environ)


MODEL_HELP = "model directory (config.json, weights, tokenizer.json)"
FAMILY_HELP = (
    "a Python file declaring model families (FAMILY = fca.Family(...) or FAMILIES = [...]), for models FCA does "
    "not know: the file is run, so give only files you trust; may be repeated, and a later file's family "
    "replaces an earlier one's and a built-in one of the same model_type; FCA_FAMILIES (os.pathsep-separated) "
    "names more, loaded first. Families of installed packages (entry points fca.families) are always loaded"
)
DEVICE_HELP = "auto (cuda when available), cpu, cuda or cuda:N"
REPLAY_BATCH_HELP = (
    "sequences per forward pass (default: the batches the cache was built in, where a cache made on this "
    "machine must replay bit for bit; else 16)"
)
SEED_HELP = "seed of cross_input's pairing, token_shuffle's permutations and the bootstrap CIs"


class DefaultsHelp(argparse.HelpFormatter):
    """Help that states each option's default, unless the help says it already (or there is none to say)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        unset = action.default is None or action.default is False or action.default in (argparse.SUPPRESS, [])
        if "default" in text or unset or not action.option_strings:
            return text
        shown = " ".join(map(str, action.default)) if isinstance(action.default, list) else "%(default)s"
        return f"{text} (default: {shown})"


class OneLineErrors(argparse.ArgumentParser):
    """A mistake on the command line is said in one line, as every other error is (`fca: error: ...`),
    with where to read the command's options, instead of the whole usage text."""

    def error(self, message: str) -> NoReturn:
        command = self.prog.removeprefix("python -m ").removeprefix("fca").strip()
        where = f"{command}: " if command else ""
        self.exit(2, f"fca: error: {where}{message} (options: {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    # The installed `fca` script is named as such; `python -m fca` otherwise.
    prog = "fca" if Path(sys.argv[0]).name == "fca" else "python -m fca"
    parser = OneLineErrors(prog=prog, description="Frozen-Controller Auditing of dynamic neural networks.")
    parser.commands = {}  # name -> its parser, so that an error can name the command it is about
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add_command(name: str, **kwargs) -> argparse.ArgumentParser:
        command = sub.add_parser(name, formatter_class=DefaultsHelp, **kwargs)  # every command's help shows defaults
        parser.commands[name] = command
        return command

    p = add_command("corpus", help="extract the default corpus (King James Bible, Debian's bible-kjv) to a text file")
    p.add_argument("--out", default="data/kjv.txt", help="text file to write")
    p.add_argument("--overwrite", action="store_true", help="replace an existing file")
    p.set_defaults(func=cmd_corpus)

    p = add_command("train", help="train a FeatureGate model or its Dense twin")
    p.add_argument("--arch", choices=ARCHS, default="featuregate", help="gated or Dense twin")
    p.add_argument("--seed", type=_seed, default=0, help="training seed (initial weights and batch order)")
    p.add_argument("--out", required=True, help="output model directory")
    _add_training_flags(p)
    p.set_defaults(func=cmd_train)

    p = add_command("train-seeds", help="train several seeds (gated and dense) for multi-seed studies")
    p.add_argument("--arch", nargs="+", choices=ARCHS, default=list(ARCHS), help="per seed")
    p.add_argument("--seeds", type=_seed, nargs="+", required=True, help="training seeds")
    p.add_argument("--out", required=True, help="parent directory: one subdirectory per arch and seed")
    _add_training_flags(p)
    p.set_defaults(func=cmd_train_seeds)

    p = add_command("build-cache", help="record every site's coefficients on one split into a Parquet cache")
    p.add_argument("--model", required=True, help=MODEL_HELP)
    p.add_argument("--corpus", required=True, help="text file, folder of .txt files, or Parquet/Arrow table")
    p.add_argument(
        "--split", choices=["calibration", "eval", "train"], required=True, help="the document split to cache"
    )
    p.add_argument("--out", required=True, help="cache directory to create")
    p.add_argument("--num-seqs", type=_positive_int, default=256, help="windows to cache")
    p.add_argument("--seq-len", type=_positive_int, default=None, help="window length (default: the model's context)")
    p.add_argument("--batch", type=_positive_int, default=16, help="sequences per forward pass")
    p.add_argument("--device", type=_device, default="auto", help=DEVICE_HELP)
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="model weights dtype")
    p.add_argument(
        "--coefficient-dtype",
        choices=["float32", "float16", "bfloat16"],
        default="float32",
        help="stored coefficient precision (bfloat16: a bfloat16 model's values, bit for bit, in 16 bits)",
    )
    p.add_argument(
        "--writers",
        type=_positive_int,
        default=None,
        metavar="N",
        help="writer threads encoding Parquet parts (default on CUDA: cores minus two, from 2 to 8; on CPU: 1)",
    )
    p.add_argument(
        "--split-seed", type=_seed, default=0, help="seed of the document split (the same for eval and calibration)"
    )
    p.add_argument("--text-column", default="text", help="text column of a Parquet/Arrow corpus")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier cache at --out")
    p.add_argument(
        "--part-seqs",
        type=_positive_int,
        default=None,
        help="sequences per part file, a multiple of --batch (default: about 32 MB raw per part; on CUDA at least 8 "
        "parts where batches allow; see docs/scale.md)",
    )
    _add_engine_flags(p, "windows")
    _add_family_flag(p)
    p.set_defaults(func=cmd_build_cache)

    p = add_command("audit", help="the three-property report of a model on an evaluated and a calibration cache")
    _add_replay_flags(p)
    p.add_argument("--dense", help="Dense twin for the latency ratio")
    p.add_argument("--json", help="write the report as JSON here")
    p.add_argument("--markdown", help="write the report as Markdown here (with neither, it is printed)")
    p.add_argument("--num-seqs", type=_positive_int, default=None, help="evaluate only the first N sequences")
    p.add_argument("--extra-conditions", nargs="*", default=[], help="e.g. interpolate:0.5 token_shuffle+independent")
    p.add_argument(
        "--sweep",
        type=_alphas,
        default=None,
        metavar="A,B,...",
        help="alphas of the interpolation sweep (0: static profile, 1: own coefficients; default 0,0.25,0.5,0.75,1); "
        "'none' to skip it",
    )
    p.set_defaults(func=cmd_audit)

    p = add_command("report", help="render an audit JSON as Markdown")
    p.add_argument("json", help="an audit report (JSON)")
    p.add_argument("--markdown", help="write the Markdown here (without it, it is printed)")
    p.set_defaults(func=cmd_report)

    p = add_command("inspect", help="describe a cache (and verify its part hashes)")
    p.add_argument("cache", help="cache directory")
    p.add_argument("--verify", action="store_true", help="recompute every part's sha256 against the manifest")
    p.add_argument(
        "--device", type=_device, default="auto", help="the device a replay would run on, for what it would expect"
    )
    p.set_defaults(func=cmd_inspect)

    p = add_command("replay", help="replay chosen conditions and save the run beside the cache")
    _add_replay_flags(p)
    p.add_argument(
        "--conditions", nargs="+", default=["correct", "static_layer"], help="kind[:alpha][+independent][@site,site]"
    )
    p.add_argument("--num-seqs", type=_positive_int, default=32, help="replay the first N evaluated sequences")
    p.add_argument("--no-save", action="store_true", help="do not save the run in <cache>.runs/")
    p.set_defaults(func=cmd_replay)

    p = add_command(
        "bench",
        help="performance ratios measured in one run (capture, replay, batching, Parquet)",
        description="Performance ratios measured in one run; about 7 minutes on 2 CPU cores.",
    )
    p.add_argument("--model", default="cache/demo/featuregate", help="model directory to time")
    p.add_argument(
        "--corpus", default="data/kjv.txt", help="eval windows from here; if it is missing, from cache/demo/eval"
    )
    p.add_argument("--device", type=_device, default="auto", help=DEVICE_HELP)
    p.add_argument("--json", help="also write the figures here")
    _add_family_flag(p)
    p.set_defaults(func=cmd_bench)

    p = add_command("demo", help="regenerate the shipped demo: models, caches and audit report")
    p.add_argument("--out", default="cache/demo", help="folder of the demo's models, caches and report")
    p.add_argument("--corpus", default="data/kjv.txt", help="extracted first if missing (needs Debian's bible-kjv)")
    p.add_argument("--steps", type=_positive_int, default=800, help="optimizer steps (for models not yet trained)")
    p.add_argument("--retrain", action="store_true", help="train the models even if they exist")
    p.set_defaults(func=cmd_demo)

    p = add_command("demo-skip", help="regenerate the second shipped demo: a mixture-of-depths model that skips work")
    p.add_argument("--out", default="cache/demo-skip", help="folder of the demo's models, caches and report")
    p.add_argument("--corpus", default="data/kjv.txt", help="extracted first if missing (needs Debian's bible-kjv)")
    p.add_argument("--steps", type=_positive_int, help="optimizer steps (for models not yet trained; default 160)")
    p.add_argument("--retrain", action="store_true", help="train the models even if they exist")
    p.set_defaults(func=cmd_demo)

    p = add_command("study", help="one table across models (seeds) from their audit reports: mean, SD and 95%% CI")
    p.add_argument("audits", nargs="+", metavar="AUDIT.json", help="audit reports of independently trained models")
    p.add_argument("--json", help="write the study here (audit paths are stored relative to its folder)")
    p.add_argument("--markdown", help="write the study as Markdown here")
    p.set_defaults(func=cmd_study)

    p = add_command("demo-study", help="train, cache and audit more seeds of the demo configuration; write a study")
    p.add_argument("--seeds", type=_seed, nargs="+", default=[1, 2], help="training seeds of the new models")
    p.add_argument("--out", default="cache/demo-study", help="the study's folder (one seed<N>/ per seed)")
    p.add_argument("--corpus", default="data/kjv.txt", help="extracted first if missing (needs Debian's bible-kjv)")
    p.add_argument("--device", type=_device, default="cpu", help="training device (see train --help)")
    p.add_argument(
        "--audit-device",
        type=_device,
        default="cpu",
        help="caches and audit (default cpu, like the shipped demo, so latency ratios compare)",
    )
    p.add_argument(
        "--include",
        nargs="*",
        default=["cache/demo/audit.json"],
        help="audits put first in the study (default: the shipped demo, seed 0); a bare --include puts none",
    )
    p.add_argument("--retrain", action="store_true", help="train the models even if they exist")
    p.add_argument(
        "--num-seqs", type=_positive_int, default=256, help="windows in each of the eval and calibration caches"
    )
    _add_model_flags(p)
    p.set_defaults(func=cmd_demo_study)

    p = add_command(
        "dashboard", help="start the dashboard on this machine (streamlit run app/main.py, from any folder)"
    )
    p.add_argument("--port", type=_port, default=8501, help="port to serve on (default 8501)")
    p.add_argument(
        "--address",
        default="127.0.0.1",
        help="address to bind (default 127.0.0.1: this machine only; 0.0.0.0 serves every network interface)",
    )
    _add_family_flag(p)
    p.set_defaults(func=cmd_dashboard)
    return parser


def _one_line(err: BaseException) -> str:
    """A user error as one line: an OSError's path first (`out.lock: Permission denied`, not
    `[Errno 13] Permission denied: 'out.lock'`), a KeyError's message without the quotes str() adds."""
    if isinstance(err, OSError) and err.filename is not None and err.strerror:
        target = f" -> {err.filename2}" if err.filename2 is not None else ""
        return f"{err.filename}{target}: {err.strerror}"
    return err.args[0] if isinstance(err, KeyError) and err.args else str(err)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # argparse would report a command's unknown arguments as the top level's: name the command
        parser.commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        if hasattr(args, "family"):  # (the commands that load models)
            load_families(args)
        args.func(args)
    except ExactnessError as err:
        print(f"fca: error: {err}", file=sys.stderr)
        return EXIT_INEXACT
    except KeyboardInterrupt:
        resumable = " (rerun the same command to resume the cache build)" if args.command == "build-cache" else ""
        print(f"fca: interrupted{resumable}", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of our output went away (`fca inspect ... | head`): nothing to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (so the exit's flush does not fail too)
        return 0
    except USER_ERRORS as err:
        if os.environ.get("FCA_DEBUG"):
            raise
        print(f"fca: error: {_one_line(err)}", file=sys.stderr)
        return 2
    return 0
