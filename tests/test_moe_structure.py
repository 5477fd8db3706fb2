"""Mixtures of experts recognised by structure, and declarations that fit real routers.

Every MoE causal-LM type the installed transformers registers is found by scanning it
(`bench.moe_coverage.moe_model_types`), built tiny and random, loaded with `fca.load_model` and replayed
with its routers' weights NaN: exact, or refused in one line saying why and how to declare it. The
all-types sweep and the README table are slow; one representative type runs every day.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import transformers
from torch import nn

import fca
from bench.moe_coverage import (
    check_type,
    coverage_rows,
    coverage_table,
    moe_model_types,
    readme_table,
    replay_without_routers,
    tiny_config,
    tiny_model,
)
from fca.cli import main
from fca.engine.adapters import Projection, SiteDeclaration, SiteDeclarationError, attach_sites
from fca.engine.families import family_of
from fca.engine.models.hf_structure import adapt_structural
from fca.engine.sites import find_sites, site_modes
from fca.tables.audit_report import AuditReport
from fca.tables.errors import ModelLoadError


def test_hunyuan_recognised_by_structure_replays_exactly():
    # HunYuan's block reads `gate.wg.weight` from its router: the site must stay transparent to it.
    model = adapt_structural(tiny_model("hunyuan_v1_moe"))
    sites = find_sites(model)
    assert sorted(sites) == ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
    assert sites["model.layers.0.mlp.gate"].spec.num_channels == 8
    assert sites["model.layers.0.mlp.gate"].wg.weight is sites["model.layers.0.mlp.gate"].controller.wg.weight
    family = family_of(model)
    assert family.expert_paths == ("model.layers.0.mlp.experts", "model.layers.1.mlp.experts")
    assert family.routers(model) == {"model.layers.0.mlp.gate": 2, "model.layers.1.mlp.gate": 2}  # top-2
    # The family reads, from the experts' own call, the selection the router made.
    read, made = [], []
    experts, router = model.get_submodule(family.expert_paths[0]), sites["model.layers.0.mlp.gate"]
    hooks = [
        experts.register_forward_pre_hook(
            lambda m, a, kw: read.append(family.expert_selection(m, a, kw)), with_kwargs=True
        ),
        router.register_forward_hook(lambda m, a, out: made.append(out)),
    ]
    with torch.no_grad():
        model(torch.randint(3, 100, (2, 7)))
    for hook in hooks:
        hook.remove()
    assert torch.equal(read[0][0], made[0][2]) and torch.equal(read[0][1], made[0][1])
    live, replayed = replay_without_routers(model, torch.randint(3, 100, (2, 7)))
    assert torch.isfinite(live).all() and torch.equal(live, replayed)


def test_non_moe_transformers_model_is_refused_in_one_line(tmp_path):
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
    )
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "llama")
    with pytest.raises(ModelLoadError) as err:
        fca.load_model(tmp_path / "llama")
    message = str(err.value)
    assert "\n" not in message and "not recognised as a mixture of experts" in message
    assert "fca.attach_sites" in message and "--family FILE" in message


def test_seq2seq_moe_is_refused_in_one_line(tmp_path):
    for model_type in ("switch_transformers", "nllb-moe"):
        path = tmp_path / model_type
        path.mkdir()
        (path / "config.json").write_text(json.dumps({"model_type": model_type}))
        with pytest.raises(ModelLoadError) as err:
            fca.load_model(path)
        message = str(err.value)
        assert "\n" not in message and "encoder-decoder" in message and str(path / "config.json") in message


class _Router(nn.Module):
    """A router returning (logits, weights, index), with a buffer and a mean its block reads."""

    def __init__(self, width: int = 6, experts: int = 4) -> None:
        super().__init__()
        self.proj = nn.Linear(width, experts, bias=False)
        self.register_buffer("bias", torch.linspace(-0.1, 0.1, experts))
        self.mean = 0.5

    def forward(self, h, scale):
        logits = self.proj(h)  # [B, T, E]
        weights, index = torch.topk(torch.sigmoid(logits) + self.bias, 2, dim=-1)
        return logits, weights * scale, index


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 6)
        self.gate = _Router()
        self.out = nn.Linear(6, 20)

    def forward(self, ids):
        h = self.embed(ids)  # [B, T, 6]
        _, weights, index = self.gate(h, 2.0)
        mixed = h * (weights.sum(-1, keepdim=True) + index.sum(-1, keepdim=True) * self.gate.mean)
        return self.out(mixed + self.gate.bias.sum() + self.gate.proj.weight.shape[0])


def test_projection_site_is_transparent_and_exact():
    torch.manual_seed(0)
    model = _Block().eval()
    attach_sites(model, [SiteDeclaration("gate", (("expert", 4),), "router", output=Projection())])
    site = model.gate
    # The block reads the router's attribute, buffer and submodule through the site.
    assert site.mean == 0.5 and site.bias is site.controller.bias and site.proj.weight is site.controller.proj.weight
    ids = torch.randint(0, 20, (2, 5))
    sink: dict = {}
    with torch.no_grad(), site_modes(model, "record", sink=sink):
        live = model(ids)
    assert sink["gate"].shape == (2, 5, 4)
    with torch.no_grad():
        model.gate.proj.weight.fill_(math.nan)  # the projection removed: never computed in replay
        with site_modes(model, "replay", provider=lambda s, B, T: sink[s.site_name]):
            replayed = model(ids)
    assert torch.isfinite(live).all() and torch.equal(live, replayed)


def test_projection_site_without_its_projection_is_refused_in_one_line():
    model = _Block().eval()
    attach_sites(model, [SiteDeclaration("gate", (("expert", 3),), "router", output=Projection())])  # proj has 4
    for mode, options in (("record", {"sink": {}}), ("replay", {"provider": lambda s, B, T: torch.zeros(B, T, 3)})):
        with pytest.raises(SiteDeclarationError) as err, torch.no_grad(), site_modes(model, mode, **options):
            model(torch.randint(0, 20, (2, 5)))
        assert "\n" not in str(err.value) and "site 'gate': its module made no linear projection with 3" in str(
            err.value
        )


def _topk_rebuild(logits, router, call=None):
    scale = call.args[1] if call is not None else 2.0
    weights, index = torch.topk(torch.sigmoid(logits) + router.bias, 2, dim=-1)
    return logits, weights * scale, index


def test_rebuild_call_receives_call_and_model_inputs():
    torch.manual_seed(0)
    seen = {}

    def rebuild(logits, router, call):
        seen["ids"] = call.model_args[0] if call.model_args else call.model_kwargs["ids"]
        return _topk_rebuild(logits, router, call)

    model = _Block().eval()
    attach_sites(
        model, [SiteDeclaration("gate", (("expert", 4),), "router", output=0, rebuild=rebuild, rebuild_call=True)]
    )
    ids = torch.randint(0, 20, (2, 5))
    sink: dict = {}
    with torch.no_grad(), site_modes(model, "record", sink=sink):
        live = model(ids)
    with torch.no_grad(), site_modes(model, "replay", provider=lambda s, B, T: sink[s.site_name]):
        replayed = model(ids)
    assert torch.equal(live, replayed) and torch.equal(seen["ids"], ids)


def test_inexact_rebuild_is_refused_naming_the_site():
    def off_by_a_bit(logits, router):
        logits, weights, index = _topk_rebuild(logits, router)
        return logits, weights * (1 + 2**-20), index

    model = _Block().eval()
    attach_sites(model, [SiteDeclaration("gate", (("expert", 4),), "router", output=0, rebuild=off_by_a_bit)])
    with pytest.raises(SiteDeclarationError) as err, torch.no_grad(), site_modes(model, "record", sink={}):
        model(torch.randint(0, 20, (2, 5)))
    message = str(err.value)
    assert "\n" not in message and "site 'gate'" in message and "output[1]" in message
    assert "max |diff|" in message and "rebuild must return exactly what the module returns" in message


def test_one_site_feeds_several_families():
    model = _Block().eval()
    attach_sites(
        model,
        [
            SiteDeclaration(
                "gate",
                (("expert", 4),),
                "router",
                output=Projection(),
                channel_families=("attention_gate", "attention_gate", "mlp_gate", "mlp_gate"),
            )
        ],
    )
    assert model.gate.spec.families_per_channel() == ("attention_gate", "attention_gate", "mlp_gate", "mlp_gate")
    with pytest.raises(SiteDeclarationError, match="one non-empty family per channel"):
        attach_sites(
            _Block(),
            [SiteDeclaration("gate", (("expert", 4),), "router", output=Projection(), channel_families=("a",))],
        )


@pytest.mark.slow
def test_moe_types_are_found_by_scanning_transformers():
    types = moe_model_types()
    assert {"mixtral", "olmoe", "deepseek_v3", "dbrx", "hunyuan_v1_moe", "jamba"} <= set(types)
    assert "llama" not in types and len(types) >= 55
    assert tiny_config("deepseek_v3").num_hidden_layers == 2


@pytest.fixture(scope="module")
def rows():
    return coverage_rows()


@pytest.mark.slow
def test_every_moe_type_is_exact_or_refused_in_one_line(rows):
    assert [r["model_type"] for r in rows] == list(moe_model_types())
    for row in rows:
        if not row["exact"]:
            assert row["why"] and "\n" not in row["why"], row
    assert sum(r["exact"] for r in rows) >= 55


@pytest.mark.slow
def test_readme_coverage_table_is_generated(rows):
    assert readme_table() == coverage_table(rows), "run python -m bench.moe_coverage --write"


CHUNKS = 8  # the all-types audit in eight tests, each a few minutes on a loaded machine


@pytest.mark.slow
@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_every_exact_type_audits_end_to_end(chunk, tmp_path, capsys):
    # Every scanned type that replays exactly is audited from Python and from the shell (DeepSeek-V3's
    # sigmoid scores, correction bias and group-limited top-k; DBRX, whose FLOP count used to fail); every
    # other is refused by fca.load_model in one line that says how to declare it.
    audited = []
    for model_type in moe_model_types()[chunk::CHUNKS]:
        work = tmp_path / model_type
        row = check_type(model_type, work)
        if not row["exact"]:
            assert row["why"] and "\n" not in row["why"], row
            if (work / model_type / "config.json").exists():
                with pytest.raises(ModelLoadError) as refused:
                    fca.load_model(work / model_type)
                said = str(refused.value)
                assert "\n" not in said and "--family FILE" in said and "fca.attach_sites" in said, said
            continue
        model = fca.load_model(work / model_type)
        windows = torch.randint(3, 100, (8, 9), generator=torch.Generator().manual_seed(0)).numpy()
        evaluated = fca.build_cache(model, windows[:4], work / "eval", split="eval", batch_size=2)
        calibration = fca.build_cache(model, windows[4:], work / "cal", split="calibration", batch_size=2)
        report = fca.audit(model, evaluated, calibration, num_seqs=4, latency_runs=1, sweep=())
        assert report.exactness.max_abs_logit_diff == 0.0, model_type
        assert report.execution.total_flops > 0, model_type
        routing = report.routing
        assert AuditReport.from_json(report.to_json()) == report, model_type  # (routers and experts: read back)
        if row["routing"] == "observed at experts":
            assert report.execution.experts.moe_layers >= 1, model_type
            assert routing.not_reported is None and routing.conditions, model_type
        else:
            assert routing.not_reported, model_type
        out = work / "report.json"
        args = ["audit", "--model", str(work / model_type), "--cache", str(evaluated), "--calibration"]
        assert main([*args, str(calibration), "--json", str(out), "--num-seqs", "4", "--device", "cpu"]) == 0
        assert json.loads(out.read_text())["exactness"]["max_abs_logit_diff"] == 0.0, model_type
        capsys.readouterr()
        audited.append(model_type)
    assert audited  # (every chunk holds types that replay exactly; how many in all: the table's test)
