"""The typed manifest (fca.tables.manifest.Manifest) and the registry of model families (fca.engine.families)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import transformers
from torch import nn

import fca
from fca.engine.adapters import SiteDeclaration, attach_sites
from fca.engine.execution import execution_audit, model_blocks
from fca.engine.families import (
    Family,
    family_for_type,
    family_of,
    register_family,
    registered_families,
)
from fca.engine.models.featuregate import FeatureGateConfig, build_featuregate
from fca.engine.models.hf_moe import EXECUTION_NOTE, MOE_MODEL_TYPES, adapt_moe
from fca.engine.models.muddpythia import (
    FAMILY_DEFINITION,
    MUDDPythia,
    MUDDPythiaConfig,
    dense_twin_config,
)
from fca.tables import catalog
from fca.tables.errors import CacheError, ModelLoadError
from fca.tables.manifest import CorpusRecord, Manifest, ModelRecord, PartRecord, TokenizerRecord, read_manifest
from fca.tables.profiles import cache_moments
from fca.tables.schema import MANIFEST, cache_plan, cache_schema, record_batch
from fca.tables.spec import SiteSpec
from fca.tables.store import open_cache
from fca.tables.writer import CacheWriter

DEMO = Path(__file__).resolve().parents[1] / "cache" / "demo"
SPECS = {
    "a.gate": SiteSpec(axes=(("gate", 3),), family="gate", channel_labels=("x", "y", "z"), coefficient="gate values"),
    "b.mix": SiteSpec(axes=(("stream", 2), ("source", 2)), family="mix", channel_families=("q", "q", "r", "r")),
}
T, N, VOCAB = 5, 6, 40


def write_tiny_cache(out: Path, model: dict | None = None, tokenizer: dict | None = None, **extra) -> Path:
    """A 6-sequence cache of random coefficients, with every manifest field a real build writes."""
    model = (
        model
        if model is not None
        else {
            "path": "tiny-model",
            "model_type": "featuregate",
            "fingerprint": "f" * 64,
            "config": {"model_type": "featuregate", "vocab_size": VOCAB, "d_model": 8},
            "dtype": "float32",
        }
    )
    plan = cache_plan(
        SPECS,
        T,
        N,
        model=model,
        corpus={"name": "prose.txt", "fingerprint": "c" * 64, "split": "eval", "split_seed": 3, "text_column": "text"},
        **({"tokenizer": tokenizer} if tokenizer is not None else {}),
        environment={"device_type": "cpu", "model_dtype": "float32", "batch_size": 4},
        **extra,
    )
    schema = cache_schema(SPECS)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, (N, T + 1))
    writer = CacheWriter(out, plan, schema, seqs_per_part=4)
    for lo, hi in ((0, 4), (4, N)):
        coefficients = {
            name: rng.normal(size=(hi - lo, T, spec.num_channels)).astype(np.float32) for name, spec in SPECS.items()
        }
        writer.write(
            record_batch(
                schema,
                np.arange(lo, hi),
                tokens[lo:hi, :-1],
                tokens[lo:hi, 1:],
                np.ones((hi - lo, T), np.float32),
                coefficients,
            ),
            hi - lo,
        )
    return writer.finish({"created": "2030-01-01T00:00:00Z", "library_versions": {"fca": "test"}})


# ------------------------------------------------------------------------------------------ manifest


def test_manifest_round_trip_every_field_typed(tmp_path):
    path = write_tiny_cache(
        tmp_path / "c", tokenizer={"fingerprint": "t" * 64, "vocab_size": VOCAB}, raw_bytes_per_token=48
    )
    raw = json.loads((path / MANIFEST).read_text())
    cache = open_cache(path, verify=True)
    m = cache.manifest
    assert isinstance(m, Manifest) and m.raw == raw
    assert m.schema_version == raw["schema_version"] == 1
    assert m.model == ModelRecord(
        path="tiny-model",
        model_type="featuregate",
        fingerprint="f" * 64,
        config=raw["model"]["config"],
        dtype="float32",
    )
    assert m.tokenizer == TokenizerRecord(fingerprint="t" * 64, vocab_size=VOCAB)
    assert m.corpus == CorpusRecord(
        name="prose.txt", fingerprint="c" * 64, split="eval", split_seed=3, text_column="text"
    )
    assert (m.seq_len, m.num_seqs, m.num_tokens) == (raw["seq_len"], raw["num_seqs"], raw["num_tokens"])
    assert (m.seq_len, m.num_seqs, m.num_tokens) == (T, N, N * T)
    assert m.coefficient_dtype == raw["coefficient_dtype"] == "float32"
    assert m.sites == SPECS and list(m.sites) == list(raw["sites"])  # SiteSpecs, in execution order
    assert m.parts == tuple(PartRecord(**p) for p in raw["parts"]) and [p.num_seqs for p in m.parts] == [4, 2]
    assert m.seqs_per_part == raw["seqs_per_part"] == 4
    assert m.environment == raw["environment"] and m.created == raw["created"] == "2030-01-01T00:00:00Z"
    assert m.library_versions == {"fca": "test"} and m.raw["raw_bytes_per_token"] == 48  # extra keys stay in raw
    assert m.total_bytes == sum(p["bytes"] for p in raw["parts"]) == sum(f.stat().st_size for f in cache.part_paths())
    # The Cache delegates to the typed manifest.
    assert cache.site_specs == SPECS and cache.sites == list(SPECS) and (cache.num_seqs, cache.seq_len) == (N, T)
    assert (cache.environment, cache.model_dtype, cache.coefficient_dtype) == (raw["environment"], "float32", "float32")
    assert cache.build_batches() == {(0, 4), (4, 6)} and cache.fingerprint == m.contents_fingerprint
    assert read_manifest(path) == m


def test_demo_cache_manifest_reads():
    cache = open_cache(DEMO / "eval")
    m = cache.manifest
    assert m.model.path == "featuregate" and m.model.model_type == "featuregate" and len(m.model.fingerprint) == 64
    assert m.corpus.split == "eval" and m.corpus.split_seed == 0 and m.tokenizer.vocab_size == 2048 == cache.vocab_size
    assert (m.seq_len, m.num_seqs, m.num_tokens) == (128, 256, 128 * 256) and m.coefficient_dtype == "float32"
    assert list(m.sites) == [f"blocks.{i}.gate" for i in range(6)]
    assert all(s.num_channels == 12 and s.family == "gate" for s in m.sites.values())
    env = m.environment  # where the shipped demo was built: a CPU, in float32, in batches of 16
    assert (env["device_type"], env["model_dtype"], env["batch_size"]) == ("cpu", "float32", 16)
    assert cache.model_dtype == "float32" and m.seqs_per_part >= 256 and len(m.parts) == 1
    assert m.total_bytes == m.parts[0].bytes and (DEMO / "eval" / "moments.npz").is_file()
    report = json.loads((DEMO / "audit.json").read_text())
    assert m.model.fingerprint == report["model"]["fingerprint"] and cache.fingerprint == report["cache"]["fingerprint"]


def test_sequences_are_asked_for_as_whole_numbers():
    cache = open_cache(DEMO / "eval")
    for wrong in ("12", [0.7], [True]):
        with pytest.raises(TypeError, match="sequences are given as whole numbers"):
            cache.read_seqs(wrong)
    with pytest.raises(ValueError, match="no sequences asked for"):
        cache.read_seqs([])
    assert cache.read_seqs(np.array([3, 1]))["token"].shape == (2, 128)


def test_manifest_refuses_what_open_cache_refuses(tmp_path):
    raw = json.loads((DEMO / "eval" / MANIFEST).read_text())
    with pytest.raises(CacheError, match="no 'parts' entry"):
        Manifest.from_json({k: v for k, v in raw.items() if k != "parts"}, "m.json")
    with pytest.raises(CacheError, match="schema version 99"):
        Manifest.from_json({**raw, "schema_version": 99}, "m.json")
    with pytest.raises(CacheError, match="malformed"):
        Manifest.from_json({**raw, "parts": [{"file": "x"}]}, "m.json")
    # Counts that disagree with one another (a hand-edited manifest) are refused with what disagrees.
    part = raw["parts"][0]
    for edit, said in (
        ({"num_seqs": 32}, "num_tokens 32768, but 32 sequences x 128 tokens"),
        ({"num_seqs": 32, "num_tokens": 32 * 128}, "its parts hold 256 sequences, not num_seqs 32"),
        ({"seq_len": -1}, "256 sequences of -1 tokens"),
        ({"num_tokens": 5}, "num_tokens 5"),
        ({"parts": [{**part, "rows": 999}]}, "999 rows for 256 sequences of 128 tokens"),
        ({"coefficient_dtype": "int8"}, "coefficient dtype 'int8'"),
    ):
        with pytest.raises(CacheError, match=f"m.json: inconsistent manifest: .*{said}"):
            Manifest.from_json({**raw, **edit}, "m.json")
        with pytest.raises(CacheError, match="m.json: inconsistent manifest: no sites"):
            Manifest.from_json({**raw, "sites": {}}, "m.json")
    site = next(iter(raw["sites"]))  # (12 gates: its axes give [12])
    # Fields of the wrong type are refused by name, never read as something else (256.7 as 256, "1" as 1)
    # nor left to fail later (a part file of 5, or one outside the cache's folder).
    for edit, said in (
        ({"num_seqs": "256"}, 'num_seqs is "256", not a whole number'),
        ({"num_seqs": 256.7}, "num_seqs is 256.7, not a whole number"),
        ({"schema_version": "1"}, 'schema_version is "1", not a whole number'),
        ({"parts": [{**part, "file": 5}]}, "a part's file is 5, not text"),
        ({"parts": [{**part, "file": "../other/part-00000.parquet"}]}, "is not a part-NNNNN.parquet of this folder"),
        ({"parts": [{**part, "num_seqs": None}]}, "part-00000.parquet's num_seqs is null"),
        ({"model": {**raw["model"], "path": 5}}, "model.path is 5, not text"),
        ({"model": {**raw["model"], "config": [1]}}, r"model.config is \[1\], not an object"),
        ({"seqs_per_part": True}, "seqs_per_part is true, not a whole number"),
        ({"sites": {**raw["sites"], site: {**raw["sites"][site], "shape": [13]}}}, rf"{site}'s shape is \[13\]"),
        ({"sites": {**raw["sites"], site: {**raw["sites"][site], "shape": 12}}}, rf"{site}'s shape is 12, but"),
    ):
        with pytest.raises(CacheError, match=f"m.json: malformed manifest: .*{said}"):
            Manifest.from_json({**raw, **edit}, "m.json")
    # The catalog reads the same way: a manifest open_cache would refuse is listed with its reason.
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / MANIFEST).write_text(json.dumps({**raw, "schema_version": 99}))
    entry = catalog.read_entry(tmp_path / "old")
    assert entry.error and "schema version 99" in entry.error
    assert catalog.read_entry(DEMO / "eval").model_fingerprint == raw["model"]["fingerprint"]


def test_a_site_shape_edited_apart_from_its_axes_is_refused_by_inspect(tmp_path, capsys):
    """A site's `shape` set to [5] for 4 channels passed `inspect --verify` (the parts' hashes still matched)."""
    from fca.cli import main

    cache = write_tiny_cache(tmp_path / "c")
    raw = json.loads((cache / MANIFEST).read_text())
    name, site = next((n, d) for n, d in raw["sites"].items() if d["shape"] == [4])
    (cache / MANIFEST).write_text(json.dumps({**raw, "sites": {**raw["sites"], name: {**site, "shape": [5]}}}))
    assert main(["inspect", str(cache), "--verify"]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"fca: error: {cache / MANIFEST}: malformed manifest: site {name}'s shape is [5], but its axes "
        f"({' x '.join(str(size) for _, size in site['axes'])}) give [4]\n"
    )


def test_parts_listed_twice_out_of_order_or_exchanged_are_refused_by_name(tmp_path):
    """Such caches passed `inspect --verify` (every hash matched its manifest entry), then a replay stopped
    half-way with "expected 2048 rows for 16 sequences, found 0", naming no file."""
    import shutil

    from fca.tables.schema import file_sha256

    good = write_tiny_cache(tmp_path / "good")
    raw = json.loads((good / MANIFEST).read_text())
    first, second = raw["parts"]  # sequences 0-3 and 4-5
    for edit, said in (
        (
            {"parts": [first, first], "num_seqs": 8, "num_tokens": 8 * raw["seq_len"]},
            "part part-00000.parquet is listed",
        ),
        ({"parts": [second, first]}, "part part-00001.parquet begins at sequence 4, but the parts before it end at 0"),
    ):
        with pytest.raises(CacheError, match=f"m.json: inconsistent manifest: {said}"):
            Manifest.from_json({**raw, **edit}, "m.json")
    # Part 1's file replaced by a copy of part 0's, its manifest entry rewritten to match (hash, size, rows).
    copied = tmp_path / "copied"
    shutil.copytree(good, copied)
    shutil.copyfile(copied / first["file"], copied / second["file"])
    second_copy = {**second, "sha256": file_sha256(copied / second["file"]), "bytes": first["bytes"]}
    second_copy.update(num_seqs=first["num_seqs"], rows=first["rows"])
    changed = {**raw, "num_seqs": 8, "num_tokens": 8 * raw["seq_len"], "parts": [first, second_copy]}
    (copied / MANIFEST).write_text(json.dumps(changed))
    with pytest.raises(CacheError, match=r"part-00001\.parquet: holds sequences 0-3, but the manifest places "):
        open_cache(copied, verify=True)
    with pytest.raises(CacheError, match=r"part-00001\.parquet: holds sequences 0-3, but the manifest places "):
        open_cache(copied).read_seqs([5])
    assert open_cache(copied).read_seqs([1])["token"].shape == (1, raw["seq_len"])  # part 0 is what it says
    # A part record without its first sequence is refused by name (readers place parts by it).
    with pytest.raises(CacheError, match="m: malformed manifest: part-00000.parquet's first_seq is null"):
        Manifest.from_json(
            {**raw, "parts": [{k: v for k, v in p.items() if k != "first_seq"} for p in raw["parts"]]}, "m"
        )
    # A part holding sequences past its range (part 0 holds 1-4 for 0-3) is refused as one holding others.
    shifted = tmp_path / "shifted"
    shutil.copytree(good, shifted)
    path = shifted / first["file"]
    table = pq.read_table(path)
    seq = table.schema.get_field_index("seq")
    table = table.set_column(seq, table.schema.field(seq), pa.array(table.column(seq).to_numpy() + 1, pa.int32()))
    pq.write_table(table, path)
    moved = {**raw, "parts": [{**first, "sha256": file_sha256(path), "bytes": path.stat().st_size}, second]}
    (shifted / MANIFEST).write_text(json.dumps(moved))
    with pytest.raises(CacheError, match=r"holds sequences 1-4, but the manifest places sequences 0-3"):
        open_cache(shifted, verify=True)


def test_one_vocabulary_rule(tmp_path):
    """Tokenizer record, else the model config, else None; the cache, its manifest and the statistics agree."""
    with_tokenizer = write_tiny_cache(tmp_path / "tok", tokenizer={"vocab_size": 64})
    from_config = write_tiny_cache(tmp_path / "cfg")
    unknown = write_tiny_cache(tmp_path / "none", model={"path": "m", "fingerprint": "m"})
    for path, expected in ((with_tokenizer, 64), (from_config, VOCAB), (unknown, None)):
        cache = open_cache(path)
        assert cache.manifest.vocab_size == cache.vocab_size == expected
        moments, _ = cache_moments(cache)
        assert moments.vocab_size == expected  # None: no token-id factor


# ------------------------------------------------------------------------------------------ families


MIXTRAL = {
    "vocab_size": 50,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 32,
}


def test_each_builtin_family_is_found_for_its_model():
    assert {"featuregate", "muddpythia", *MOE_MODEL_TYPES} <= set(registered_families())
    featuregate = build_featuregate(
        FeatureGateConfig(vocab_size=50, d_model=16, n_layers=3, n_heads=2, mlp_groups=2, max_seq_len=16)
    )
    family = family_of(featuregate)
    assert family.model_type == "featuregate" and family.load is not None and family.dense_twin.switch == "gated"
    assert model_blocks(featuregate) == list(featuregate.blocks) and family.definitions(featuregate) == {}

    config = MUDDPythiaConfig(vocab_size=50, dim=32, n_layer=3, n_head=2, intermediate_size=256, block_size=32)
    mudd = MUDDPythia(config)
    family = family_of(mudd)
    assert family.model_type == "muddpythia" and model_blocks(mudd) == list(mudd.layers)
    assert family.definitions(mudd) == {"global_mean_families": FAMILY_DEFINITION}
    assert family.definitions(MUDDPythia(dense_twin_config(config))) == {}
    # The Dense twin's config is built from the one table the catalog finds twins with.
    twin = dense_twin_config(config)
    assert (twin.dense, twin.dynamic_dense) == (False, False)
    assert catalog.is_dense_twin(config.to_dict(), family.dense_twin.config(config.to_dict()))

    torch.manual_seed(0)
    moe = adapt_moe(transformers.AutoModelForCausalLM.from_config(transformers.MixtralConfig(**MIXTRAL)).eval())
    family = family_of(moe)
    assert family.model_type == "mixtral" and family.coefficient_kind == "router logits" and family.dense_twin is None
    assert family.expert_paths and family.execution_note == EXECUTION_NOTE
    assert model_blocks(moe) == list(moe.model.layers)
    report = execution_audit(moe, torch.randint(0, 50, (2, 6)))
    assert report["note"] == EXECUTION_NOTE and report["experts"]["moe_layers"] == 2
    assert all(family_for_type(t).expert_paths for t in MOE_MODEL_TYPES)


class Gated(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.gate = nn.Linear(d, 2)
        self.mlp = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = torch.sigmoid(self.gate(x))  # [B, T, 2]
        return x + self.mlp(x) * g.mean(-1, keepdim=True)  # [B, T, D]


class CustomModel(nn.Module):
    """The blocks are *not* the longest module list (`spare` is), so only a declared family finds them."""

    # Every per-family fact, declared in one place.
    fca_family = Family(
        "custom_gated",
        blocks=lambda model: list(model.layers),
        definitions=lambda model: {"custom": "gates scale each layer's MLP"},
        coefficient_kind="gate values",
        execution_note="every layer runs for every token",
    )

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 8)
        self.layers = nn.ModuleList(Gated(8) for _ in range(2))
        self.spare = nn.ModuleList(nn.Identity() for _ in range(5))
        self.head = nn.Linear(8, 50)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)  # [B, T, D]
        for layer in self.layers:
            x = layer(x)
        return self.head(x)  # [B, T, V]


def test_custom_model_declares_its_family_in_one_place():
    torch.manual_seed(0)
    declaration = SiteDeclaration(path="layers.*.gate", axes=(("gate", 2),), family="gate")
    model = attach_sites(CustomModel().eval(), [declaration])
    ids = torch.randint(0, 50, (2, 6))
    family = family_of(model)
    assert family is CustomModel.fca_family and family.definitions(model) == {"custom": "gates scale each layer's MLP"}
    report = execution_audit(model, ids)
    assert report["num_blocks"] == 2 and report["tokens_per_block"] == [12, 12]
    assert report["blocks_executed_fraction"] == 1.0
    assert report["note"] == "every layer runs for every token" and "experts" not in report
    assert 0 < report["controller_flops_share"] < 1 and report["latency_ratio_vs_dense"] is None
    # Without a declared family the default takes the longest module list (here the wrong one).
    plain = nn.Sequential(CustomModel())
    assert family_of(plain).model_type == "Sequential" and len(model_blocks(plain)) == 5


@pytest.fixture
def registry_guard():
    """Registrations made by a test are undone afterwards."""
    families, twins = dict(registered_families()), dict(catalog.DENSE_TWINS)
    yield
    from fca.engine import families as module

    module._FAMILIES.clear()
    module._FAMILIES.update(families)
    catalog.DENSE_TWINS.clear()
    catalog.DENSE_TWINS.update(twins)


class ConfiguredModel(CustomModel):
    fca_family = None  # found through the registry by its config's model_type instead

    def __init__(self, gated: bool = True) -> None:
        super().__init__()
        self.config = SimpleNamespace(model_type="registered_gated", gated=gated, d=8)


@pytest.mark.slow
def test_a_family_registered_for_a_built_in_type_replaces_it_whenever_it_is_registered():
    """The built-in families join the registry on its first lookup, under those registered before: a
    family registered for `featuregate` replaces the built-in one even before anything was looked up or
    the model files were imported (a fresh interpreter), as it does after."""
    import subprocess
    import sys

    script = (
        "from fca.engine.families import Family, family_for_type, register_family, registered_families\n"
        "register_family(Family('featuregate', coefficient_kind='mine'))\n"
        "import fca.engine.models\n"
        "assert family_for_type('featuregate').coefficient_kind == 'mine'\n"
        "assert family_for_type('muddpythia').load is not None and 'qwen3_moe' in registered_families()\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_registered_family_loads_and_has_a_dense_twin(tmp_path, registry_guard):
    register_family(
        Family(
            "registered_gated",
            load=lambda path: ConfiguredModel(),
            dense_twin=catalog.DenseTwin("gated"),
            blocks=lambda model: list(model.layers),
        )
    )
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"model_type": "registered_gated", "gated": True, "d": 8}))
    (tmp_path / "twin").mkdir()
    twin_config = {"model_type": "registered_gated", "gated": False, "d": 8}
    (tmp_path / "twin" / "config.json").write_text(json.dumps(twin_config))
    model = fca.load_model(model_dir)
    assert isinstance(model, ConfiguredModel) and not model.training and len(model_blocks(model)) == 2
    assert catalog.find_dense_twin(model_dir) == tmp_path / "twin"  # the catalog learned the family's twin
    with pytest.raises(
        ModelLoadError, match="unsupported model_type 'nobody'.*featuregate.*attach_sites.*--family FILE"
    ):
        (tmp_path / "x").mkdir()
        (tmp_path / "x" / "config.json").write_text(json.dumps({"model_type": "nobody"}))
        fca.load_model(tmp_path / "x")


@pytest.mark.slow
def test_flops_count_attention_and_experts_on_the_cpu():
    """torch's counter has no formula for the CPU's fused attention nor for the grouped products of
    transformers' experts: a CPU audit of the demo left out every attention product (0.45% controller share
    instead of 0.41%), and an MoE audit every expert. Counted now, to the FLOP of a hand count."""
    from fca.engine.execution import controller_flops

    torch.manual_seed(0)
    B, T, D, V, L, K = 2, 16, 16, 50, 3, 4  # K = heads + groups gate channels
    model = build_featuregate(FeatureGateConfig(vocab_size=V, d_model=D, n_layers=L, n_heads=2, mlp_groups=2))
    per_layer = (
        2 * D * 3 * D + 2 * D * D + 2 * 2 * D * 4 * D + 2 * D * K + 2 * 2 * T * D
    )  # qkv, proj, MLP, gates, attention
    counted = controller_flops(model.eval(), torch.randint(0, V, (B, T)))
    assert counted["flops_per_token"] == L * per_layer + 2 * D * V and counted["uncounted_ops"] == []
    assert counted["controller_flops"] == B * T * L * 2 * D * K

    # Mixtral's experts, run as transformers' default grouped product and as a loop over experts: the same count.
    flops = {}
    for implementation in ("grouped_mm", "eager"):
        torch.manual_seed(0)
        moe = transformers.AutoModelForCausalLM.from_config(transformers.MixtralConfig(**MIXTRAL)).eval()
        moe.set_experts_implementation(implementation)
        flops[implementation] = controller_flops(adapt_moe(moe), torch.randint(0, 50, (2, 6)))
    assert flops["grouped_mm"] == flops["eager"] and flops["eager"]["uncounted_ops"] == []


class IntegerProduct(nn.Module):
    """A forward that runs a matrix product torch has no FLOP formula for (int8 x int8 -> int32)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(32, 32)])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        weights = torch.ones(32, 32, dtype=torch.int8)
        return self.layers[0](torch._int_mm(input_ids.to(torch.int8), weights).float())  # [32, 32]


def test_a_product_without_a_formula_is_listed_not_counted_as_zero():
    from fca.engine.execution import controller_flops

    counted = controller_flops(IntegerProduct(), torch.ones(32, 32, dtype=torch.long))
    assert counted["uncounted_ops"] == ["aten._int_mm"] and counted["total_flops"] == 2 * 32 * 32 * 32
    from fca.tables.report import AuditReport, render_markdown

    report = json.loads((Path(__file__).parents[1] / "cache" / "demo" / "audit.json").read_text())
    report["execution"]["uncounted_ops"] = counted["uncounted_ops"]
    assert "- Not counted (no FLOP formula in this torch): aten._int_mm; the share leaves" in render_markdown(
        AuditReport.from_json(report)
    )


def test_an_moe_report_says_which_blocks_have_experts_and_whether_a_shared_one_runs():
    """Qwen2-MoE with a dense MLP in its first block and a shared expert in the others: the report had said
    "per MoE layer" without how many there are, and of Mixtral that "a shared expert ... is not among them"."""
    from fca.engine.models.hf_moe import expert_execution
    from fca.tables.report import AuditReport, render_markdown

    config = transformers.Qwen2MoeConfig(
        **{k: v for k, v in MIXTRAL.items() if k != "num_local_experts"},
        num_experts=4,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        mlp_only_layers=[0],
    )
    torch.manual_seed(0)
    model = adapt_moe(transformers.AutoModelForCausalLM.from_config(config).eval())
    report = json.loads((Path(__file__).parents[1] / "cache" / "demo" / "audit.json").read_text())
    report["execution"] = execution_audit(model, torch.randint(0, 50, (2, 6)))
    experts = report["execution"]["experts"]
    assert experts["moe_layers"] == 1 and experts["shared_experts"] is True
    assert "counted from the dispatched indices; 1 of the 2 blocks has an MoE layer; a shared expert runs for " \
        "every token besides them." in render_markdown(AuditReport.from_json(report))  # fmt: skip
    assert expert_execution(adapt_moe(transformers.AutoModelForCausalLM.from_config(
        transformers.MixtralConfig(**MIXTRAL)).eval()), torch.randint(0, 50, (2, 6)))["shared_experts"] is False  # fmt: skip
