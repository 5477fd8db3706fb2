"""Routing agreement read from what ran, on routers that do not choose by a softmax's top-k.

Tiny random DeepSeek-V3 (sigmoid scores, a nonzero correction bias, group-limited top-k) and DeepSeek-V4
(a hash-routed layer beside a top-k one) models of the installed transformers, declared by hand with
`fca.attach_sites` and a `Family` of the test's own. The figures a replay run reports must equal those
counted here from the experts modules' own inputs, each condition replayed on its own.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from torch import nn

import fca
from fca.engine.adapters import SiteDeclaration
from fca.engine.family import Family
from fca.engine.replay import run_conditions
from fca.engine.sites import find_sites
from fca.tables.conditions import Condition, condition_coefficients, derangement, parse_condition
from fca.tables.profiles import calibration_profiles
from fca.tables.store import open_cache

E, TOP_K, VOCAB, T, SEQS, BATCH = 8, 2, 64, 16, 4, 2
ROUTER, EXPERTS = "model.layers.*.mlp.gate", "model.layers.*.mlp.experts"
CONDITIONS = ("cross_input", "token_shuffle", "static_layer", "global_mean")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def deepseek_v3_routing(logits: torch.Tensor, router: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's router output from its logits [N, E]: sigmoid scores; the choice adds the correction bias,
    keeps the `topk_group` groups whose two best choice scores sum highest, and takes the top-k there; the
    weights are the chosen experts' scores, renormalised and scaled."""
    scores = logits.sigmoid()  # [N, E]
    choice = scores + router.e_score_correction_bias
    N, groups = choice.shape[0], router.num_group
    per_group = choice.view(N, groups, -1)  # [N, G, E / G]
    best = per_group.topk(2, dim=-1).values.sum(-1)  # [N, G]
    kept = torch.zeros_like(best).scatter_(1, best.topk(router.topk_group, dim=-1, sorted=False).indices, 1)
    allowed = kept.bool()[:, :, None].expand_as(per_group).reshape(N, -1)  # [N, E]
    index = choice.masked_fill(~allowed, float("-inf")).topk(router.top_k, dim=-1, sorted=False).indices  # [N, k]
    weights = scores.gather(1, index)
    if router.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return logits, weights * router.routed_scaling_factor, index


def deepseek_v4_routing(logits: torch.Tensor, router: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DeepSeek-V4's router output from its logits [N, E]: scores by the config's function; a hash layer's
    experts are its table's for each token id (kept on the router by a pre-hook: `rebuild` is not handed the
    router's call arguments), a top-k layer's the top-k of the scores plus the correction bias."""
    scores = router.score_fn(logits)
    if hasattr(router, "tid2eid"):
        index = router.tid2eid[router.fca_test_token_ids.reshape(-1)].long()  # [N, k]
    else:
        index = torch.topk(scores + router.e_score_correction_bias, router.top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, index)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return logits, weights * router.routed_scaling_factor, index


def declared(model: nn.Module, rebuild) -> nn.Module:
    routers = SiteDeclaration(
        path=ROUTER, axes=(("expert", E),), family="router", output=0, token_layout="flat", rebuild=rebuild
    )
    fca.attach_sites(model, [routers], blocks="model.layers")
    model.fca_family = Family(
        model.config.model_type,
        coefficient_kind="router logits",
        expert_paths=(EXPERTS,),
        routers=lambda m: {name: TOP_K for name, site in find_sites(m).items() if site.spec.family == "router"},
    )
    return model


def deepseek_v3() -> nn.Module:
    config = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=E, num_experts_per_tok=TOP_K, n_group=4,
        topk_group=2, first_k_dense_replace=0, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=16, n_shared_experts=1, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    for layer in model.model.layers:
        gate = layer.mlp.gate
        nn.init.normal_(gate.weight, std=0.5)  # (zeros as initialised: every expert would tie)
        gate.e_score_correction_bias.copy_(torch.randn(E) * 0.3)  # the choice is not the scores' top-k
    return declared(model, deepseek_v3_routing)


def deepseek_v4() -> nn.Module:
    config = transformers.DeepseekV4Config(
        vocab_size=VOCAB, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, q_lora_rank=16, n_routed_experts=E, num_experts_per_tok=TOP_K,
        mlp_layer_types=["hash_moe", "moe"], o_groups=2, o_lora_rank=16, index_n_heads=2, index_head_dim=16,
        index_topk=4, hc_mult=2, sliding_window=8, num_nextn_predict_layers=0, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    table = torch.stack([torch.randperm(E)[:TOP_K] for _ in range(VOCAB)])  # token id -> its 2 experts
    model.model.layers[0].mlp.gate.tid2eid.copy_(table)
    for layer in model.model.layers:
        nn.init.normal_(layer.mlp.gate.weight, std=0.5)  # (scores that differ between tokens)
    model.model.layers[1].mlp.gate.e_score_correction_bias.copy_(torch.randn(E) * 0.3)
    model = declared(model, deepseek_v4_routing)
    hashed = model.model.layers[0].mlp.gate  # the site; its router reads the token ids it is called with
    hashed.register_forward_pre_hook(lambda site, args: setattr(site.controller, "fca_test_token_ids", args[1]))
    return model


def handed(model: nn.Module, names: list[str]) -> tuple[dict[str, torch.Tensor], list]:
    """Hooks of the test's own on the experts modules `names`: module -> the weight each expert was handed in
    the last call, dense [N, E] (0 where it did not run; an index E is an empty slot)."""
    seen: dict[str, torch.Tensor] = {}

    def keep(name, module, args, kwargs):
        index, weights = args[1], args[2]  # [N, k] each
        seen[name] = torch.zeros(len(index), E + 1).scatter_add_(1, index.long(), weights.float())[:, :E]

    hooks = [
        model.get_submodule(name).register_forward_pre_hook(
            lambda m, a, kw, n=name: keep(n, m, a, kw), with_kwargs=True
        )
        for name in names
    ]
    return seen, hooks


def observed_figures(model, cache, profiles, names: list[str] | None = None) -> dict[str, np.ndarray]:
    """condition -> [SEQS, layers, 3 figures], counted from the experts' inputs: each condition replayed
    alone, batch by batch, against the same batch's Correct replay."""
    names = names or [f"model.layers.{i}.mlp.experts" for i in range(2)]
    seen, hooks = handed(model, names)
    partner = derangement(SEQS, 0)
    out = {name: np.zeros((SEQS, len(names), 3)) for name in CONDITIONS}
    try:
        for lo in range(0, SEQS, BATCH):
            index = list(range(lo, lo + BATCH))
            rows = cache.read_seqs(index)
            own = {s: rows[s] for s in cache.sites}
            fca.replay(model, rows["token"], own)
            mine = dict(seen)
            for name in CONDITIONS:
                other = cache.coefficients([int(partner[i]) for i in index])
                fed = condition_coefficients(parse_condition(name), own, index, profiles, other)
                fca.replay(model, rows["token"], fed)
                for layer, module in enumerate(names):
                    a, b = mine[module], seen[module]
                    same = ((a > 0) == (b > 0)).all(-1).double()  # [N]
                    count = (a > 0).sum(-1)
                    kept = torch.where(count > 0, ((a > 0) & (b > 0)).sum(-1) / count.clamp_min(1), same)
                    total = a.sum(-1)
                    weight = torch.where(total > 0, torch.minimum(a, b).sum(-1) / total.clamp_min(1e-30), same)
                    figures = torch.stack([same, kept.double(), weight.double()], -1).reshape(BATCH, T, 3)
                    out[name][index, layer] = figures.mean(1).numpy()
    finally:
        for hook in hooks:
            hook.remove()
    return out


def softmax_top_k_same(cache, profiles, name: str) -> float:
    """same_experts as a softmax top-k of the coefficients would have it (the old reading of router logits)."""
    rows = cache.read_seqs(list(range(SEQS)))
    own = {s: rows[s] for s in cache.sites}
    other = cache.coefficients([int(p) for p in derangement(SEQS, 0)])
    fed = condition_coefficients(parse_condition(name), own, list(range(SEQS)), profiles, other)
    same = []
    for site, values in own.items():
        top = lambda x: torch.from_numpy(np.broadcast_to(x, values.shape).copy()).topk(TOP_K).indices.sort(-1).values  # noqa: E731
        same.append((top(values) == top(fed[site])).all(-1).double().mean().item())
    return float(np.mean(same))


def replayed(model: nn.Module, tmp_path):
    rng = np.random.default_rng(0)
    windows = rng.integers(0, VOCAB, size=(2 * SEQS, T + 1))
    evaluated = fca.build_cache(model, windows[:SEQS], tmp_path / "eval", split="eval", batch_size=BATCH)
    calibration = fca.build_cache(model, windows[SEQS:], tmp_path / "cal", split="calibration", batch_size=BATCH)
    cache, profiles = open_cache(evaluated), calibration_profiles(open_cache(calibration))
    conditions = [Condition("correct"), *map(parse_condition, CONDITIONS)]
    # every condition stacked into one forward per batch: [5 * b, T] condition-major
    results = run_conditions(model, cache, conditions, profiles, batch_size=BATCH)
    assert results.max_abs_logit_diff == 0.0  # the declared rebuild reproduces the routers exactly
    return results, cache, profiles


def assert_report_is_observed(results, observed, routers: list[str] | None = None) -> None:
    routers = routers or [f"model.layers.{i}.mlp.gate" for i in range(2)]
    assert results.routers == dict.fromkeys(routers, TOP_K) and results.routing_unobserved == {}
    for f in ("same_experts", "expert_overlap", "weight_kept"):
        assert results.routing["correct"][f].tolist() == [[1.0] * len(routers)] * SEQS
    for name in CONDITIONS:
        for i, figure in enumerate(("same_experts", "expert_overlap", "weight_kept")):
            np.testing.assert_allclose(results.routing[name][figure], observed[name][:, :, i], rtol=1e-6, atol=1e-12)


@pytest.mark.slow
def test_a_deepseek_v3_router_is_reported_as_its_experts_ran(tmp_path):
    """Sigmoid scores, a correction bias and group-limited top-k: the figures are those of the experts that ran,
    which a softmax top-k of the logits misstates."""
    model = deepseek_v3()
    gate = model.model.layers[0].mlp.gate
    h = torch.randn(T, 64)
    live = gate.controller(h)
    rebuilt = deepseek_v3_routing(live[0], gate.controller)
    assert all(torch.equal(a, b) for a, b in zip(live, rebuilt))  # the rebuild is the module's own output
    results, cache, profiles = replayed(model, tmp_path)
    observed = observed_figures(model, cache, profiles)
    assert_report_is_observed(results, observed)
    assert 0 < results.routing["cross_input"]["same_experts"].mean() < 1
    # the old reading (softmax top-k of the logits) would have reported other figures
    assert any(
        abs(softmax_top_k_same(cache, profiles, name) - observed[name][:, :, 0].mean()) > 0.01 for name in CONDITIONS
    )


@pytest.mark.slow
def test_a_hash_routed_layer_keeps_every_token_on_its_experts(tmp_path):
    """DeepSeek-V4's hash layer chooses experts by token id: every condition keeps 100% of its tokens on them
    (only their weights move); the top-k layer beside it is reported as it ran."""
    model = deepseek_v4()
    results, cache, profiles = replayed(model, tmp_path)
    observed = observed_figures(model, cache, profiles)
    assert_report_is_observed(results, observed)
    for name in CONDITIONS:
        hashed = results.routing[name]
        assert hashed["same_experts"][:, 0].tolist() == [1.0] * SEQS == hashed["expert_overlap"][:, 0].tolist()
        assert hashed["weight_kept"][:, 0].max() < 1.0  # the weights follow the reassigned logits
        assert hashed["same_experts"][:, 1].mean() < 1.0
    assert softmax_top_k_same(cache, profiles, "cross_input") < 0.5  # (what a formula would have said)


@pytest.mark.slow
def test_routing_that_cannot_be_observed_is_not_reported_and_said_so(tmp_path, monkeypatch, capsys):
    """No experts modules declared, or experts that are never called: no routing figure, one sentence why,
    in the run's JSON, its Markdown and the CLI's words."""
    from fca.jobs.runs import run_replay
    from fca.tables.audit_report import Routing
    from fca.tables.report import routing_table

    model = deepseek_v3()
    rng = np.random.default_rng(0)
    windows = rng.integers(0, VOCAB, size=(2 * SEQS, T + 1))
    evaluated = fca.build_cache(model, windows[:SEQS], tmp_path / "eval", split="eval", batch_size=BATCH)
    calibration = fca.build_cache(model, windows[SEQS:], tmp_path / "cal", split="calibration", batch_size=BATCH)
    family = model.fca_family
    model.fca_family = Family(family.model_type, routers=family.routers)  # (no expert_paths)
    record = run_replay(model, evaluated, calibration, ["global_mean"], num_seqs=SEQS, batch_size=BATCH, save=False)
    routing = record["results"]["routing"]
    assert routing == {
        "not_reported": "No routing figure is reported for any router: which experts ran could not be read at the "
        "experts (model.layers.0.mlp.gate, model.layers.1.mlp.gate: its family names no experts modules "
        "(Family.expert_paths))."
    }
    assert routing_table(Routing.read(routing, "routing"))[-1].startswith(
        "**Routing.** No routing figure is reported for any"
    )
    # `fca replay` says it too (the run is the one above: the CLI loads models by path)
    from fca.cli import main

    monkeypatch.setattr("fca.jobs.runs.run_replay", lambda *args, **kwargs: record)
    capsys.readouterr()
    assert main(["replay", "--model", str(tmp_path), "--cache", str(evaluated), "--calibration", str(calibration),
                 "--conditions", "global_mean", "--no-save", "--device", "cpu"]) == 0  # fmt: skip
    said = capsys.readouterr().out
    assert routing["not_reported"] in said.splitlines() and "same experts" not in said
    # experts modules that are never called (a list the model indexes)
    for layer in model.model.layers:
        layer.mlp.expert_list = nn.ModuleList()  # (no weights: the cache's model still)
        layer.mlp.expert_list.num_experts = E
    model.fca_family = Family(
        family.model_type, routers=family.routers, expert_paths=("model.layers.*.mlp.expert_list",)
    )
    record = run_replay(model, evaluated, calibration, ["global_mean"], num_seqs=SEQS, batch_size=BATCH, save=False)
    assert (
        "its experts module model.layers.0.mlp.expert_list was never called"
        in record["results"]["routing"]["not_reported"]
    )


class Experts(nn.Module):
    """Experts called as transformers' are: experts(hidden [N, D], index [N, k], weights [N, k]); an index
    of `num_experts` is an empty slot."""

    def __init__(self, d: int, experts: int) -> None:
        super().__init__()
        self.num_experts = experts
        self.up = nn.Parameter(torch.randn(experts, d, d) / d**0.5)

    def forward(self, hidden: torch.Tensor, index=None, weights=None, selection=None) -> torch.Tensor:
        if selection is not None:  # (another call convention: the selection packed in one keyword)
            index, weights = selection
        out = torch.zeros_like(hidden)
        for slot in range(index.shape[1]):
            for expert in range(self.num_experts):
                rows = index[:, slot] == expert
                out[rows] += torch.tanh(hidden[rows] @ self.up[expert]) * weights[rows, slot, None]
        return out


class CapacityMoE(nn.Module):
    """Top-k of a softmax router, each expert taking at most `capacity` tokens of each sequence, in token
    order: a token routed to a full expert gets an empty slot (index E, weight 0) and skips it."""

    def __init__(self, d: int, capacity: int, packed: bool = False) -> None:
        super().__init__()
        self.gate = nn.Linear(d, E, bias=False)
        self.experts = Experts(d, E)
        self.capacity, self.packed = capacity, packed

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # [B, T, D]
        B, T_, D = h.shape
        flat = h.reshape(-1, D)  # [N, D]
        probs = self.gate(flat).softmax(-1)  # [N, E]
        weights, index = probs.topk(TOP_K, dim=-1)  # [N, k]
        routed = nn.functional.one_hot(index, E).reshape(B, T_ * TOP_K, E)  # token-major per sequence
        place = (routed.cumsum(1) * routed).sum(-1).reshape(B * T_, TOP_K)  # 1-based place in its expert's queue
        full = place > self.capacity
        index, weights = index.masked_fill(full, E), weights.masked_fill(full, 0.0)
        out = self.experts(flat, selection=(index, weights)) if self.packed else self.experts(flat, index, weights)
        return out.reshape(B, T_, D)


class CapacityModel(nn.Module):
    def __init__(self, d: int = 32, capacity: int = 5, packed: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList(CapacityMoE(d, capacity, packed) for _ in range(2))
        self.head = nn.Linear(d, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


@pytest.mark.slow
def test_capacity_limited_routing_is_reported_with_the_tokens_it_dropped(tmp_path):
    """Experts that take a limited number of tokens: a token dropped by a full expert ran none there, and the
    figures say so (a softmax top-k of the logits would count it as routed)."""
    torch.manual_seed(0)
    model = CapacityModel().eval()
    routers = SiteDeclaration(path="blocks.*.gate", axes=(("expert", E),), family="router", token_layout="flat")
    fca.attach_sites(model, [routers], blocks="blocks")
    names = [f"blocks.{i}.gate" for i in range(2)]
    model.fca_family = Family(
        "capacity_moe", expert_paths=("blocks.*.experts",), routers=lambda m: dict.fromkeys(names, TOP_K)
    )
    seen, hooks = handed(model, ["blocks.0.experts"])
    model(torch.randint(0, VOCAB, (BATCH, T)))
    hooks[0].remove()
    dropped = ((seen["blocks.0.experts"] > 0).sum(-1) < TOP_K).double().mean().item()
    assert 0.05 < dropped < 0.95  # (the capacity binds: some tokens lose an expert)
    results, cache, profiles = replayed(model, tmp_path)
    observed = observed_figures(model, cache, profiles, [f"blocks.{i}.experts" for i in range(2)])
    assert_report_is_observed(results, observed, names)


def test_the_familys_expert_selection_reads_experts_called_otherwise():
    """Experts called as experts(hidden, selection=(index, weights)): the execution audit and the routing
    observer read them through the family's `expert_selection`; without it the audit says what to declare."""
    from fca.engine.models.hf_moe import expert_execution
    from fca.engine.routing import ExpertObserver

    torch.manual_seed(0)
    model = CapacityModel(packed=True).eval()
    ids = torch.randint(0, VOCAB, (BATCH, T))
    with pytest.raises(ValueError, match=r"blocks\.0\.experts: not an experts module .* expert_selection"):
        expert_execution(model, ids, ("blocks.*.experts",))
    packed = lambda experts, args, kwargs: kwargs["selection"]  # noqa: E731
    report = expert_execution(model, ids, ("blocks.*.experts",), "", packed)
    with ExpertObserver(model, ("blocks.*.experts",), packed) as observer, observer.recording() as taken:
        model(ids)
    index = taken["blocks.0.experts"][0].index  # [N, k]
    assert index.shape == (BATCH * T, TOP_K) and bool((index == E).any())  # (dropped slots: index E)
    ran = (index < E).sum(-1).double().mean().item()  # experts run per token, empty slots left out
    assert report["layers"]["blocks.0.experts"]["experts_run_per_token_mean"] == pytest.approx(ran)
    assert report["layers"]["blocks.0.experts"]["experts_available"] == E and report["moe_layers"] == 2
    # A replay whose family keeps the default reader: no routing figure, and why (not a traceback).
    from fca.engine.family import transformers_expert_selection
    from fca.engine.routing import RoutingTally

    with ExpertObserver(model, ("blocks.*.experts",), transformers_expert_selection) as observer:
        tally = RoutingTally(["blocks.0.gate", "blocks.1.gate"], observer, ["correct"], BATCH)
        tally.start_batch(list(range(BATCH)), T)
        with observer.recording() as taken:
            model(ids)
        tally.set_own(taken)
    assert tally.observed == [] and tally.unobserved["blocks.0.gate"].startswith(
        "its experts module's call could not be read (Experts: not called as experts(hidden, top_k_index, "
    )
