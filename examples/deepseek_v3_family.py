"""A family file: DeepSeek-V3 (transformers' `deepseek_v3`), declared from outside FCA.

    python -m fca build-cache --family examples/deepseek_v3_family.py --model DIR ...

FCA runs this file when it is named with `--family` (or in FCA_FAMILIES) and registers the `Family`
it defines as `FAMILY`; it then loads any directory whose config.json says `"model_type": "deepseek_v3"`
with `load` below. Declared here, it replaces a built-in family of the same model_type.

The controller of each MoE block is its router, `model.layers.<i>.mlp.gate` (the first
`first_k_dense_replace` layers are dense and have none). The router returns
`(router_logits [N, E], top_k_weights [N, k], top_k_index [N, k])` and the block hands the last two to
its experts, so the coefficient is the logits and replay rebuilds the other two from them alone, with the
router's own steps: sigmoid scores, a per-expert correction bias that decides the choice but not the
weights, the best `topk_group` of `n_group` expert groups (each scored by its two best experts), the top k
experts within them, weights = their unbiased scores, renormalised where `norm_topk_prob`, times
`routed_scaling_factor`. Replay must reproduce the router's outputs exactly: same operations, same
order, same dtype (float32), so that Correct replay equals the live run bit for bit.

Legend: N = tokens (the block flattens B * T), E = routed experts, G = expert groups, k = experts per token.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

import fca
from fca.engine.adapters import SiteDeclaration

ROUTER_PATH = "model.layers.*.mlp.gate"
EXPERTS_PATH = "model.layers.*.mlp.experts"


def group_limited_top_k(
    router_logits: torch.Tensor, router: nn.Module
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The router's output rebuilt from its logits [N, E] (float32), without calling it."""
    scores = router_logits.sigmoid()  # [N, E]
    biased = scores + router.e_score_correction_bias  # [N, E]: chooses the experts, does not weigh them
    N, E, G = biased.shape[0], router.num_experts, router.num_group
    group_scores = biased.view(N, G, E // G).topk(2, dim=-1)[0].sum(dim=-1)  # [N, G]
    best_groups = torch.topk(group_scores, k=router.topk_group, dim=-1, sorted=False)[1]  # [N, topk_group]
    in_best = torch.zeros_like(group_scores).scatter_(1, best_groups, 1).bool()  # [N, G]
    allowed = in_best.unsqueeze(-1).expand(N, G, E // G).reshape(N, E)  # [N, E]
    top_index = torch.topk(biased.masked_fill(~allowed, float("-inf")), k=router.top_k, dim=-1, sorted=False)[1]
    top_weights = scores.gather(1, top_index)  # [N, k]
    if router.norm_topk_prob:
        top_weights = top_weights / (top_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return router_logits, top_weights * router.routed_scaling_factor, top_index


ROUTER = SiteDeclaration(
    path=ROUTER_PATH,
    axes=lambda router: (("expert", router.num_experts),),
    family="router",
    output=0,  # (router_logits, top_k_weights, top_k_index)
    token_layout="flat",
    rebuild=group_limited_top_k,
    coefficient="router logits (pre-sigmoid, one per routed expert)",
)


def load(path: Path) -> nn.Module:
    """A local DeepSeek-V3 directory, in float32 on CPU, nothing downloaded; its routers made sites."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    model.config.output_router_logits = False  # (replay runs no router to collect logits from)
    return fca.attach_sites(model, [ROUTER], blocks="model.layers")


FAMILY = fca.Family(
    "deepseek_v3",
    load=load,
    blocks=lambda model: list(model.model.layers),
    coefficient_kind="router logits",
    expert_paths=(EXPERTS_PATH,),
    execution_note=(
        "conditional execution is expert-level: inside each MoE block only the k routed experts run per token, "
        "beside the shared experts, which run for every token"
    ),
)
