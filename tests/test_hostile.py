"""Hostile caches, reports and runs: files placed in a cache folder by someone else. Each case ends in one
line naming the file, or a valid result, within bounded time and memory; commands run in a child process
under an address-space limit (RLIMIT_AS), their peak resident memory read from the child's rusage."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
TORCH_FREE_LIMIT = 1 << 30  # address space for a torch-free child (pyarrow and numpy reserve ~0.3 GB)
TORCH_LIMIT = 3 << 30  # torch alone reserves ~0.9 GB of address space; a replay's threads and model more
DEEP = "[" * 10**6
# Sets the limit and runs the command in a child of its own, reporting that child's peak resident memory (KB)
# to a file: a process started from pytest's would count pytest's resident pages in its peak (Linux keeps the
# largest across exec), one forked from this small launcher does not.
LAUNCH = """
import os, resource, sys
limit, peak_file, command = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
pid = os.fork()
if pid == 0:
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    os.execv(command[0], command)
_, status, usage = os.wait4(pid, 0)
open(peak_file, "w").write(str(usage.ru_maxrss))
sys.exit(os.waitstatus_to_exitcode(status) % 256)
"""


# ------------------------------------------------------------------------------------------ helpers


def child(args: list[str], limit: int, cwd: Path, timeout: float = 180) -> tuple[int, str, str, int]:
    """(exit code, stdout, stderr, peak resident MB) of `python args` under an address-space limit,
    killed after `timeout` seconds."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}
    env.pop("FCA_DEBUG", None)
    with tempfile.TemporaryDirectory() as scratch:
        peak_file = Path(scratch) / "peak"
        command = [sys.executable, "-c", LAUNCH, str(limit), str(peak_file), sys.executable, *args]
        try:
            done = subprocess.run(
                command, cwd=cwd, env=env, capture_output=True, timeout=timeout, start_new_session=True
            )
        except subprocess.TimeoutExpired as expired:
            raise AssertionError(f"{args}: still running after {timeout} s") from expired
        return done.returncode, done.stdout.decode(), done.stderr.decode(), int(peak_file.read_text()) // 1024


def fca(args: list[str], cwd: Path, limit: int = TORCH_LIMIT) -> tuple[str, int]:
    """(the one line a refused `python -m fca args` prints, its peak resident MB)."""
    rc, out, err, peak = child(["-m", "fca", *args], limit, cwd)
    assert rc == 2, (rc, out[-500:], err[-2000:])
    assert "Traceback" not in err and err.count("\n") == 1 and err.startswith("fca: error: "), err[-2000:]
    return err.strip(), peak


def copy_demo(tiny_demo: Path, dest: Path, parts=("featuregate", "eval", "calibration")) -> Path:
    for name in parts:
        shutil.copytree(tiny_demo / name, dest / name)
    return dest


def edit_manifest(cache: Path, change) -> None:
    path = cache / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


def claim_sequences(num_seqs: int):
    """A manifest change: counts that agree with one another, not with the parts."""

    def change(m: dict) -> None:
        T, left = m["seq_len"], num_seqs
        m["num_seqs"], m["num_tokens"] = num_seqs, num_seqs * T
        for part in m["parts"][:-1]:
            left -= part["num_seqs"]
        m["parts"][-1].update(num_seqs=left, rows=left * T)

    return change


def claim_seq_len(seq_len: int):
    def change(m: dict) -> None:
        m["seq_len"], m["num_tokens"] = seq_len, seq_len * m["num_seqs"]
        for part in m["parts"]:
            part["rows"] = part["num_seqs"] * seq_len

    return change


# ------------------------------------------------------------------- claimed counts never allocate

REFUSED_CLAIM = r"part-\d+\.parquet: holds [\d,]+ rows, but the manifest records [\d,]+ \([\d,]+ sequences of"


def test_a_manifest_claiming_more_rows_than_its_parts_hold_is_refused_at_open(tiny_demo, tmp_path):
    from fca.tables.errors import CacheError
    from fca.tables.store import open_cache

    copy_demo(tiny_demo, tmp_path, ("eval",))
    edit_manifest(tmp_path / "eval", claim_sequences(10**12))
    with pytest.raises(CacheError, match=REFUSED_CLAIM):
        open_cache(tmp_path / "eval")


def test_site_axes_beyond_a_parquet_list_are_one_line(tiny_demo, tmp_path):
    from fca.tables.errors import CacheError
    from fca.tables.store import open_cache

    copy_demo(tiny_demo, tmp_path, ("eval",))

    def huge_site(m: dict) -> None:
        site = next(iter(m["sites"].values()))
        site.update(axes=[["a", 10**9], ["b", 10**3]], shape=[10**12])
        site.pop("channel_labels", None)
        site.pop("channel_families", None)

    edit_manifest(tmp_path / "eval", huge_site)
    with pytest.raises(CacheError, match=r"axes \(1000000000 x 1000\) are not 1 to 2,147,483,647 channels"):
        open_cache(tmp_path / "eval")


@pytest.mark.parametrize("page", ["views/overview.py", "views/replay_lab.py"])
def test_the_dashboard_refuses_a_claim_of_10_to_the_12_sequences_in_one_error(page, tiny_demo, tmp_path, monkeypatch):
    """The Replay lab's server grew from 2.4 to 5.9 GB at "Replaying: 0 / 96" on such a cache."""
    from .test_app import app_for, no_exceptions, render

    copy_demo(tiny_demo, tmp_path)
    edit_manifest(tmp_path / "eval", claim_sequences(10**12))
    at = render(app_for(monkeypatch, [tmp_path], tmp_path / "eval"), page)
    no_exceptions(at)
    errors = [e.value for e in at.error]
    assert len(errors) == 1 and re.search(REFUSED_CLAIM.replace(r"\(", r"\\?\("), errors[0]), errors
    assert not [b for b in at.button if b.label == "Run"]  # nothing to start


@pytest.mark.slow
@pytest.mark.parametrize("command", ["inspect", "inspect --verify", "replay", "audit"])
def test_every_command_refuses_a_claim_of_10_to_the_12_sequences_in_one_line(command, tiny_demo, tmp_path):
    """The issue's case: `replay --num-seqs 16` grew to 9.4 GB, `audit` ended in a MemoryError."""
    copy_demo(tiny_demo, tmp_path)
    for split in ("eval", "calibration"):
        edit_manifest(tmp_path / split, claim_sequences(10**12))
    models = ["--model", "featuregate", "--cache", "eval", "--calibration", "calibration"]
    args = {
        "inspect": ["inspect", "eval"],
        "inspect --verify": ["inspect", "eval", "--verify"],
        "replay": ["replay", *models, "--num-seqs", "16", "--no-save"],
        "audit": ["audit", *models, "--json", "out.json"],
    }[command]
    line, peak = fca(args, tmp_path, TORCH_FREE_LIMIT if command.startswith("inspect") else TORCH_LIMIT)
    assert re.search(REFUSED_CLAIM, line) and "1,000,000,000,000 sequences" in line, line
    # inspect refuses before torch is imported; replay and audit import torch (~260 MB resident) first.
    assert peak < (200 if command.startswith("inspect") else 200 + 270), peak


@pytest.mark.slow
def test_a_seq_len_of_10_to_the_9_is_refused_before_inspect_verify_allocates(tiny_demo, tmp_path):
    copy_demo(tiny_demo, tmp_path, ("eval",))
    edit_manifest(tmp_path / "eval", claim_seq_len(10**9))
    line, peak = fca(["inspect", "eval", "--verify"], tmp_path, TORCH_FREE_LIMIT)
    assert re.search(REFUSED_CLAIM, line) and "sequences of 1,000,000,000 tokens" in line and peak < 200, (line, peak)


# --------------------------------------------------------------------------------- deep JSON


def test_deep_json_is_one_line_from_the_one_reader(tmp_path):
    from fca.tables.jsonfile import MAX_JSON_DEPTH, read_json

    (tmp_path / "deep.json").write_text(DEEP)
    with pytest.raises(ValueError, match=rf"deep\.json: not valid JSON \(nested deeper than {MAX_JSON_DEPTH} levels\)"):
        read_json(tmp_path / "deep.json")
    # Parsed by json, too deep for code that walks it recursively later: refused the same way.
    (tmp_path / "deep.json").write_text("[" * 500 + "]" * 500)
    with pytest.raises(ValueError, match="nested deeper"):
        read_json(tmp_path / "deep.json")
    (tmp_path / "big.json").write_text("[" + "0," * 600 + "0]")
    with pytest.raises(ValueError, match=r"big\.json: larger than 1,000 bytes"):
        read_json(tmp_path / "big.json", max_bytes=1000)
    (tmp_path / "nan.json").write_text("[NaN]")
    with pytest.raises(ValueError, match=r"NaN is not JSON"):
        read_json(tmp_path / "nan.json", constants=False)
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(ValueError, match=r"fifo: not a regular file"):
        read_json(tmp_path / "fifo")


def test_every_reader_refuses_deep_json_in_one_line(tiny_demo, tmp_path):
    """The manifest, an audit report, a model's config.json, a study, a saved run: each reader's own error."""
    from fca.engine.checkpoints import read_config
    from fca.tables.errors import CacheError, ModelLoadError
    from fca.tables.manifest import read_manifest
    from fca.tables.report import ReportError, read_report
    from fca.tables.runs import list_runs
    from fca.tables.study import StudyError, load_study

    copy_demo(tiny_demo, tmp_path)
    (tmp_path / "calibration" / "manifest.json").write_text(DEEP)
    (tmp_path / "featuregate" / "config.json").write_text(DEEP)
    (tmp_path / "audit.json").write_text(DEEP)
    (tmp_path / "study.json").write_text(DEEP)
    (tmp_path / "eval.runs").mkdir()
    (tmp_path / "eval.runs" / "20260101T000000Z-0000000000.json").write_text(DEEP)
    for read, error, path in [
        (read_manifest, CacheError, tmp_path / "calibration"),
        (read_config, ModelLoadError, tmp_path / "featuregate"),
        (read_report, ReportError, tmp_path / "audit.json"),
        (load_study, StudyError, tmp_path / "study.json"),
    ]:
        with pytest.raises(error, match="nested deeper than") as caught:
            read(path)
        assert "\n" not in str(caught.value) and path.name in str(caught.value)
    assert list_runs(tmp_path / "eval") == []  # a file that is no run record is left unlisted


def test_a_deep_manifest_under_the_roots_is_listed_as_unreadable_and_breaks_no_page(tiny_demo, tmp_path, monkeypatch):
    from fca.tables import catalog

    from .test_app import app_for, no_exceptions, render

    copy_demo(tiny_demo, tmp_path)
    (tmp_path / "deep").mkdir()
    (tmp_path / "deep" / "manifest.json").write_text(DEEP)
    entries = {e.label: e for e in catalog.discover_caches([tmp_path])}
    assert "nested deeper than" in entries["deep"].error and entries["eval"].error is None
    at = render(app_for(monkeypatch, [tmp_path], tmp_path / "eval"), "views/overview.py")
    no_exceptions(at)
    assert not at.error and len(at.get("plotly_chart")) >= 1
    listed = at.sidebar.selectbox(key="cache").options
    assert "deep (unreadable: not valid JSON (nested deeper than 64 levels))" in listed, listed
    at.sidebar.selectbox(key="cache").set_value(str(tmp_path / "deep")).run()
    no_exceptions(at)
    assert any("nested deeper than" in e.value for e in at.error), [e.value for e in at.error]
    # A deep study, a deep saved run and a deep report beside the caches: each page goes on.
    (tmp_path / "studies").mkdir()
    (tmp_path / "studies" / "study.json").write_text(DEEP)
    (tmp_path / "eval.runs").mkdir()
    (tmp_path / "eval.runs" / "20260101T000000Z-0000000000.json").write_text(DEEP)
    (tmp_path / "audit.json").write_text(DEEP)
    for page in ("views/overview.py", "views/replay_lab.py", "views/study.py"):
        at = render(app_for(monkeypatch, [tmp_path], tmp_path / "eval"), page)
        no_exceptions(at)
        if page == "views/overview.py":
            assert any("audit.json: not a readable audit report" in e.value for e in at.error), page


# ------------------------------------------------------------------------- moments.npz bombs


def plant_moments_bomb(cache: Path, gib: float, member: str = "pos_sum") -> int:
    """Replace a member of the cache's moments.npz by `gib` GiB of zeros, deflated (a few MB on disk),
    and update the file's hash in the manifest, as someone crafting a cache would; its size on disk."""
    path = cache / "moments.npz"
    with np.load(path) as z:
        arrays = {name: z[name] for name in z.files}
    n = int(gib * 2**30) // 8
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for name, array in arrays.items():
            info = zipfile.ZipInfo(name + ".npy")
            info.compress_type = zipfile.ZIP_DEFLATED
            with z.open(info, "w", force_zip64=True) as f:
                if name != member:
                    np.lib.format.write_array(f, array)
                    continue
                np.lib.format.write_array_header_1_0(f, {"descr": "<f8", "fortran_order": False, "shape": (n,)})
                zeros = bytes(1 << 24)
                for start in range(0, n * 8, len(zeros)):
                    f.write(zeros[: min(len(zeros), n * 8 - start)])
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    edit_manifest(cache, lambda m: m["moments"].update(sha256=digest))
    return path.stat().st_size


def test_a_moments_member_larger_than_the_manifest_implies_is_refused_unread(tiny_demo, tmp_path):
    from fca.tables.errors import CacheError
    from fca.tables.profiles import slot_layout, stored_moments
    from fca.tables.store import open_cache

    copy_demo(tiny_demo, tmp_path, ("eval",))
    assert plant_moments_bomb(tmp_path / "eval", gib=1 / 64) < 100_000  # 16 MiB inflated
    cache = open_cache(tmp_path / "eval")
    with pytest.raises(CacheError, match=r"moments\.npz: member 'pos_sum' of shape \[2097152\]: the manifest implies"):
        stored_moments(cache, slot_layout(cache), with_tokens=False)


def test_a_moments_member_whose_header_disagrees_with_its_zip_size_is_refused(tiny_demo, tmp_path):
    from fca.tables.errors import CacheError
    from fca.tables.schema import read_arrays

    path = tmp_path / "m.npz"
    with zipfile.ZipFile(path, "w") as z:
        with z.open("a.npy", "w") as f:
            np.lib.format.write_array_header_1_0(f, {"descr": "<f8", "fortran_order": False, "shape": (10**9,)})
            f.write(bytes(64))
    with pytest.raises(
        CacheError, match=r"member 'a' declares [\d,]+ bytes, but its header \[1000000000\] float64 needs"
    ):
        read_arrays(path, lambda name, shape: None)


@pytest.mark.slow
def test_a_3_gib_moments_bomb_is_refused_without_inflating(tiny_demo, tmp_path):
    """The issue's bomb: a 3 GiB member in ~3 MB, its hash updated; it was inflated in full (3.3-3.6 GB)."""
    copy_demo(tiny_demo, tmp_path, ("eval",))
    assert plant_moments_bomb(tmp_path / "eval", gib=3) < 4_000_000
    line, peak = fca(["inspect", "eval", "--verify"], tmp_path)
    assert "moments.npz: member 'pos_sum' of shape [402653184]: the manifest implies" in line, line
    assert peak < 400, peak  # torch (imported once the cache has opened) is most of it


# ----------------------------------------------------------------------------- shown as text

HOSTILE_NAMES = [
    "[x](https://attacker.example/link)",
    "![i](https://attacker.example/pixel.png)",
    '<a href="https://attacker.example/a">a</a>',
    '<img src="https://attacker.example/img.png">',
    "https://attacker.example/bare and www.attacker.example",
]


def hostile_report(report: dict) -> dict:
    """`report` with its conditions but correct renamed to hostile strings, and markup in its free text."""
    names = iter(HOSTILE_NAMES)
    renamed = {}
    for name, row in report["conditions"].items():
        hostile = name if name in ("correct", "global_mean") else next(names, name)
        renamed[hostile] = row
        if name in report["gap_retention"]:
            report["gap_retention"][hostile] = report["gap_retention"].pop(name)
    report["conditions"] = renamed
    report["model"]["name"] = HOSTILE_NAMES[0]
    report["execution"]["note"] = HOSTILE_NAMES[1]
    report["definitions"]["hostile"] = HOSTILE_NAMES[2]
    report["exactness"]["fidelity"]["computed_on_text"] = HOSTILE_NAMES[1]
    return report


def markup_left(markdown: str) -> list[str]:
    """The links, images, raw HTML and bare URLs a Markdown renderer would make of `markdown` (outside code
    spans, where nothing is markup)."""
    text = re.sub(r"(`+).*?\1", "", markdown)
    return re.findall(r"(?<!\\)\[[^\]\n]*\]\(|(?<!\\)<(?:a|img)\b|https?://|(?<![\\/])www\.", text)


def test_report_markdown_shows_hostile_strings_as_text(tiny_demo):
    from fca.tables.report import AuditReport, render_markdown

    text = render_markdown(AuditReport.from_json(hostile_report(json.loads((tiny_demo / "audit.json").read_text()))))
    assert not markup_left(text), markup_left(text)
    assert "\\[x](https:\u2060//attacker.example/link)" in text and "\\<a href=" in text  # the names, escaped


def test_markdown_text_and_code_escape_what_makes_markup():
    from fca.tables.text import markdown_code, markdown_text

    assert markdown_text("static_layer") == "static_layer"
    assert markdown_text("[x](https://e.com)") == "\\[x](https:\u2060//e.com)"  # (a word joiner: no autolink)
    assert markdown_text("www.e.com a@b.c") == "www\u2060.e.com a\\@\u2060b.c"
    assert markdown_text("<img src=x>") == "\\<img src=x\\>"
    assert markdown_text("# a\n1. b") == "\\# a 1. b"
    assert markdown_text("1. b") == "1\\. b"
    assert markdown_code("a`b|c") == "``a`b\\|c``"
    assert markdown_text("a|b") == "a|b" and markdown_text("a|b", cell=True) == "a\\|b"


def strings_in(value) -> str:
    """Every string a figure holds (its dict form: to_json writes `<` as an escape), one per line."""
    if isinstance(value, str):
        return value + "\n"
    if isinstance(value, dict):
        return "".join(map(strings_in, value.values()))
    if isinstance(value, (list, tuple)) or (isinstance(value, np.ndarray) and value.dtype.kind in "OU"):
        return "".join(map(strings_in, list(value)))
    return ""


def test_figures_show_hostile_labels_as_text():
    from app import figures

    bars = {"condition": HOSTILE_NAMES, "penalty": [0.1] * 5, "lo": [0.0] * 5, "hi": [0.2] * 5}
    shown = strings_in(figures.penalty_bars(bars).to_dict())
    assert "<a " not in shown and "<img" not in shown and "&lt;a href" in shown and "&lt;img" in shown
    shown = strings_in(figures.share_by_site({"site": HOSTILE_NAMES[2:4], "share": [0.5, 0.25]}, 0.4).to_dict())
    assert "<a " not in shown and "<img" not in shown and "&lt;img" in shown
    import pandas as pd

    shown = strings_in(figures.penalty_bars(pd.DataFrame(bars)).to_dict())  # (a DataFrame's arrays are read-only)
    assert "<a " not in shown and "&lt;a href" in shown
    shown = strings_in(figures.penalty_bars({**bars, "condition": ["a<br>b <b>c</b>"] * 5}).to_dict())
    assert "a<br>b <b>c</b>" in shown  # (line breaks and emphasis: kept)


def test_the_overview_shows_a_hostile_report_as_text(tiny_demo, tmp_path, monkeypatch):
    from .test_app import app_for, no_exceptions, render

    copy_demo(tiny_demo, tmp_path)
    report = hostile_report(json.loads((tiny_demo / "audit.json").read_text()))
    (tmp_path / "audit.json").write_text(json.dumps(report))
    at = render(app_for(monkeypatch, [tmp_path], tmp_path / "eval"), "views/overview.py")
    no_exceptions(at)
    shown = "\n".join(m.value for m in (*at.markdown, *at.caption, *at.success, *at.warning, *at.error))
    assert "attacker" in shown and not markup_left(shown), markup_left(shown)


# ---------------------------------------------------------------- every read verifies the parts


def test_the_variance_distributions_refuse_a_part_changed_in_place(tiny_demo, tmp_path, monkeypatch):
    """One byte flipped (same size: only the hash tells); the distributions showed figures of it, no error."""
    from .test_app import app_for, no_exceptions, render

    copy_demo(tiny_demo, tmp_path)
    part = next((tmp_path / "eval").glob("part-*.parquet"))
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF
    part.write_bytes(bytes(data))
    from app import resources
    from fca.tables.errors import CacheError

    with pytest.raises(CacheError, match="contents do not match the manifest's sha256"):
        resources.site_quantiles(str(tmp_path / "eval"), "flipped")
    at = render(app_for(monkeypatch, [tmp_path], tmp_path / "eval"), "views/variance.py")
    no_exceptions(at)


# ------------------------------------------------------------------------------ model folders


def test_a_full_disk_while_merging_the_moments_names_the_file_and_the_cache(tmp_path, monkeypatch):
    """The final moments merge on a full disk said only "[Errno 28] No space left on device" and left its
    temporary file behind. It names the file and the cache; no temporary stays, and the build resumes."""
    import fca.tables.writer_store as writer_store
    from fca.cli import _one_line
    from fca.tables.store import open_cache
    from fca.tables.writer import CacheWriter

    from .test_writer import _plan_and_schema, _write_pairs

    plan, schema = _plan_and_schema()
    real_write = writer_store._write

    def full_disk(fs, path, data):
        if path.endswith("/moments.npz.tmp"):
            real_write(fs, path, data[: len(data) // 2])  # cut short where the disk filled
            raise OSError(28, "No space left on device")
        real_write(fs, path, data)

    monkeypatch.setattr(writer_store, "_write", full_disk)
    writer = _write_pairs(CacheWriter(tmp_path / "c", plan, schema, 2), 0, 4)
    with pytest.raises(OSError) as err:
        writer.finish()
    partial = tmp_path / "c.partial"
    assert err.value.filename == str(partial / "moments.npz") and err.value.errno == 28
    assert (
        _one_line(err.value)
        == f"{partial / 'moments.npz'}: No space left on device (building the cache {tmp_path / 'c'})"
    )
    assert not list(partial.glob("*.tmp")) and not (tmp_path / "c").exists() and not (tmp_path / "c.lock").exists()
    monkeypatch.undo()
    resumed = CacheWriter(tmp_path / "c", plan, schema, 2)
    assert resumed.pending_parts() == []
    assert open_cache(resumed.finish(), verify=True).num_seqs == 4


def test_a_weights_index_naming_a_file_outside_its_folder_is_refused(tmp_path):
    from fca.engine.checkpoints import check_safetensors_files, read_state_dict
    from fca.tables.errors import ModelLoadError

    (tmp_path / "elsewhere.safetensors").write_bytes(b"not yours")
    model = tmp_path / "model"
    model.mkdir()
    for shard in ("../elsewhere.safetensors", str(tmp_path / "elsewhere.safetensors"), "a/../../elsewhere.safetensors"):
        (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": shard}}))
        for read in (read_state_dict, check_safetensors_files):
            with pytest.raises(ModelLoadError, match="which is not a file of its own folder"):
                read(model)


@pytest.mark.slow
def test_a_transformers_folder_whose_pickle_is_no_state_dict_is_one_line(tiny_demo, tmp_path):
    """A Mixtral folder whose pytorch_model.bin pickles something else (43 lines of UnpicklingError before)."""
    import pickle

    import transformers

    from fca import load_model
    from fca.tables.errors import ModelLoadError

    transformers.MixtralConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=2,
        num_experts_per_tok=1,
    ).save_pretrained(tmp_path / "mixtral")
    (tmp_path / "mixtral" / "pytorch_model.bin").write_bytes(pickle.dumps({"w": {1, 2}}))
    with pytest.raises(ModelLoadError) as caught:
        load_model(tmp_path / "mixtral")
    said = str(caught.value)
    assert said.startswith(f"{tmp_path / 'mixtral' / 'pytorch_model.bin'}: not a weights-only state dict (")
    assert "\n" not in said
    copy_demo(tiny_demo, tmp_path, ("eval", "calibration"))
    line, _ = fca(["replay", "--model", "mixtral", "--cache", "eval", "--calibration", "calibration"], tmp_path)
    assert line == f"fca: error: {said}".replace(str(tmp_path / "mixtral"), "mixtral"), line


# ------------------------------------------------------------------------- property-based fuzz

# (A model's config.json is read by torch code: its reader is held to deep JSON above, in this process.)
# Each example runs in a child under TORCH_FREE_LIMIT: the readers a page or a command uses, in turn; every
# one must print "ok" or its one-line error (anything else is a traceback and fails the test).
CACHE_PROBE = """
import sys
from fca.tables.profiles import cache_moments
from fca.tables.store import open_cache
try:
    cache = open_cache(sys.argv[1], verify=True)
    cache_moments(cache)
    cache.read_seqs([0, cache.num_seqs - 1])
    cache.build_batches()
    print("ok")
except ValueError as err:  # CacheError, as every reader's error, is a ValueError
    print("error:", err)
"""

JSON_PROBE = """
import sys
from pathlib import Path
from fca.tables import catalog
from fca.tables.manifest import read_manifest
from fca.tables.report import read_report
from fca.tables.runs import list_runs
from fca.tables.study import load_study
root = Path(sys.argv[1])
readers = [(read_manifest, root / "eval"), (read_report, root / "audit.json"), (load_study, root / "study.json"),
           (list_runs, root / "eval"), (catalog.discover_caches, [root])]
for read, path in readers:
    try:
        read(path)
        print("ok")
    except ValueError as err:
        print("error:", err)
"""


def probe(code: str, path: Path) -> list[str]:
    rc, out, err, _ = child(["-c", code, str(path)], TORCH_FREE_LIMIT, REPO, timeout=60)
    assert rc == 0 and "Traceback" not in err, err[-3000:]
    lines = out.splitlines()
    assert lines and all(line == "ok" or line.startswith("error: ") for line in lines), out[-2000:]
    return lines


MANIFEST_FIELDS = [
    ("num_seqs",),
    ("seq_len",),
    ("num_tokens",),
    ("seqs_per_part",),
    ("coefficient_dtype",),
    ("schema_version",),
    ("parts", 0, "rows"),
    ("parts", 0, "num_seqs"),
    ("parts", 0, "bytes"),
    ("parts", 0, "first_seq"),
    ("parts", 0, "file"),
    ("moments", "file"),
    ("moments", "token_sums"),
    ("tokenizer", "vocab_size"),
    ("tokenizer", "end_of_document"),
    ("environment", "batch_size"),
    ("sites", "blocks.0.gate", "axes"),
    ("sites", "blocks.0.gate", "shape"),
    ("sites", "blocks.0.gate", "channel_labels"),
]


def _field_values():
    from hypothesis import strategies as st

    return st.one_of(
        st.integers(min_value=-(2**70), max_value=2**70),
        st.sampled_from([0, 1, -1, 2, 2**31, 2**63, 10**9, 10**12, 10**18]),
        st.floats(allow_nan=False),
        st.text(max_size=12),
        st.none(),
        st.booleans(),
        st.lists(st.one_of(st.integers(min_value=-2, max_value=10**10), st.text(max_size=3)), max_size=3),
        st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
    )


def _set(manifest: dict, path: tuple, value) -> None:
    target = manifest
    for key in path[:-1]:
        if isinstance(target, dict):
            target = target.setdefault(key, {})
        elif isinstance(target, list) and isinstance(key, int) and key < len(target):
            target = target[key]
        else:
            return
    if isinstance(target, dict) or (isinstance(target, list) and path[-1] < len(target)):
        target[path[-1]] = value


@pytest.mark.slow
def test_fuzzed_manifest_fields_end_in_one_line_or_a_valid_cache(tiny_demo, tmp_path_factory):
    from hypothesis import HealthCheck, example, given, settings
    from hypothesis import strategies as st

    site = next(iter(json.loads((tiny_demo / "eval" / "manifest.json").read_text())["sites"]))
    fields = [tuple(site if key == "blocks.0.gate" else key for key in path) for path in MANIFEST_FIELDS]

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(edits=st.lists(st.tuples(st.sampled_from(fields), _field_values()), min_size=1, max_size=3))
    @example(edits=[(("coefficient_dtype",), [])])  # (a list reached the dtype lookup as a TypeError)
    def check(edits):
        root = tmp_path_factory.mktemp("fuzz")
        copy_demo(tiny_demo, root, ("eval",))
        edit_manifest(root / "eval", lambda m: [_set(m, path, value) for path, value in edits])
        assert len(probe(CACHE_PROBE, root / "eval")) == 1
        shutil.rmtree(root)

    check()


@pytest.mark.slow
def test_fuzzed_json_files_end_in_one_line(tiny_demo, tmp_path_factory):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=10))
    documents = st.recursive(
        scalars,
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
        max_leaves=30,
    )
    texts = st.one_of(
        documents.map(json.dumps),
        st.integers(min_value=1, max_value=10**5).map(lambda n: "[" * n + "]" * n),
        st.integers(min_value=1, max_value=10**6).map(lambda n: '{"a":' * n),
        st.binary(max_size=64).map(lambda b: b.decode("latin-1")),
        st.sampled_from(["NaN", "[Infinity]", '{"a": 1e999}', "\ufeff{}", '{"fca_report_version": 1}', ""]),
    )
    files = {
        "manifest": "eval/manifest.json",
        "audit": "audit.json",
        "study": "study.json",
        "run": "eval.runs/20260101T000000Z-0000000000.json",
    }

    @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(text=texts, where=st.sampled_from(sorted(files)))
    def check(text, where):
        root = tmp_path_factory.mktemp("json")
        copy_demo(tiny_demo, root, ("eval",))
        (root / "eval.runs").mkdir()
        (root / files[where]).write_text(text, encoding="utf-8", errors="surrogatepass")
        assert len(probe(JSON_PROBE, root)) == 5
        shutil.rmtree(root)

    check()


# ------------------------------------------------------------------------------ in a browser

# Every link and image source on a page, HTML and plotly's SVG alike, that names another host than this one.
FOREIGN_LINKS = """() => [...document.querySelectorAll('a, img, image, link, script, iframe, source')]
  .map(e => [e, e.getAttribute('href') || e.getAttribute('xlink:href') || e.getAttribute('src') || ''])
  .filter(([e, u]) => u && !u.startsWith('#'))
  .map(([e, u]) => [e, new URL(u, location.href)])
  .filter(([e, u]) => ['http:', 'https:', 'ws:', 'wss:'].includes(u.protocol) ?
          !['127.0.0.1', 'localhost', '[::1]'].includes(u.hostname) : u.protocol === 'mailto:')
  .map(([e, u]) => `${e.tagName} ${u.href} in ${e.closest('[data-testid]')?.getAttribute('data-testid')}`)"""


def hostile_run(tiny_demo: Path, root: Path) -> None:
    """A real saved run of `root/eval`, its conditions renamed to hostile strings, as a shared runs folder may hold."""
    from fca.jobs.runs import run_replay

    record = run_replay(
        root / "featuregate",
        root / "eval",
        root / "calibration",
        ["static_layer", "cross_input"],
        num_seqs=4,
        device="cpu",
    )
    path = Path(record["path"])
    saved = json.loads(path.read_text())
    for old, new in zip(["static_layer", "cross_input"], HOSTILE_NAMES[2:4]):
        saved["results"]["conditions"][new] = saved["results"]["conditions"].pop(old)
    saved["device"] = HOSTILE_NAMES[0]
    path.write_text(json.dumps(saved))


@pytest.mark.slow
@pytest.mark.browser
def test_hostile_reports_and_runs_make_no_request_and_no_link_in_a_browser(tiny_demo, tmp_path):
    """Every page in Chromium over a cache whose report and saved run carry links, images and HTML in their
    names: no request leaves loopback (each is blocked and counted) and no page links to another host."""
    from bench.browser import CHROMIUM, CHROMIUM_ARGS, new_page, start_server, stop_server, wait_settled

    if not Path(CHROMIUM).is_file():
        pytest.skip(f"{CHROMIUM} is absent")
    from playwright.sync_api import sync_playwright

    copy_demo(tiny_demo, tmp_path, ("featuregate", "dense", "eval", "calibration"))
    (tmp_path / "audit.json").write_text(json.dumps(hostile_report(json.loads((tiny_demo / "audit.json").read_text()))))
    hostile_run(tiny_demo, tmp_path)
    study = json.loads((REPO / "cache" / "demo-study" / "study.json").read_text())
    for row, name in zip(study["seeds"], HOSTILE_NAMES):
        row["name"], row["audit"] = name, HOSTILE_NAMES[2]
    (tmp_path / "study").mkdir()
    (tmp_path / "study" / "study.json").write_text(json.dumps(study))
    proc, url, _ = start_server({"FCA_CACHE_ROOTS": str(tmp_path), "FCA_DEFAULT_CACHE": str(tmp_path / "eval")})
    outside: list[str] = []
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                page = new_page(browser, outside=outside)
                for path in ("", "variance", "profiles", "token_text", "replay_lab", "execution", "study"):
                    page.goto(f"{url}/{path}")
                    wait_settled(page)
                    page.wait_for_timeout(1500)  # (charts and images draw after the run settles)
                    errors = page.locator('[data-testid="stException"]')
                    assert errors.count() == 0, f"{path}: {errors.first.inner_text()[:2000]}"
                    links = page.evaluate(FOREIGN_LINKS)
                    assert links == [], f"{path}: {links}"
                    if path in ("", "study"):  # shown, as text (a loaded machine may still be drawing the page)
                        try:
                            page.wait_for_function(
                                "() => document.body.innerText.includes('attacker.example')", timeout=20_000
                            )
                        except Exception:
                            raise AssertionError(f"{path}: {page.inner_text('body')[-3000:]}") from None
            finally:
                browser.close()
    finally:
        stop_server(proc)
    assert not outside, f"requests left loopback: {outside}"
