"""Which of transformers' mixture-of-experts causal LMs FCA audits, and how: the README's coverage table.

    python -m bench.moe_coverage            (prints the table)
    python -m bench.moe_coverage --check    (exit 1 when the README's table differs from it)

Every causal-LM type of the installed transformers whose modeling code hands experts a selection is
found by scanning transformers (not from a list), built tiny and random (2 layers, hidden 64, 8 experts,
top-2, float32, CPU), saved, loaded with `fca.load_model`, and checked: its routers removed (their weights
set to NaN), Correct replay must reproduce the live logits bit for bit.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import math
import re
import sys
import tempfile
import warnings
from functools import cache
from pathlib import Path

import torch

README = Path(__file__).resolve().parent.parent / "README.md"
BEGIN, END = "<!-- moe-coverage:begin -->", "<!-- moe-coverage:end -->"
TINY = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "ffn_hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 8,
    "num_local_experts": 8,
    "n_routed_experts": 8,
    "moe_num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_k": 2,
    "max_position_embeddings": 128,
    "first_k_dense_replace": 0,
    "n_group": 1,
    "topk_group": 1,
    "n_shared_experts": 1,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def _modeling_source(model_type: str) -> str | None:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        name = CONFIG_MAPPING[model_type].__module__.replace(".configuration_", ".modeling_")
        return inspect.getsource(importlib.import_module(name))
    except Exception:  # a type whose modeling module does not import here (an optional dependency)
        return None


@cache
def moe_model_types() -> tuple[str, ...]:
    """Causal-LM types of the installed transformers whose own config builds their causal LM and whose
    modeling code calls experts with a selection (transformers' `experts(hidden, top_k_index, ...)`)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    found = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for model_type, class_name in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()):
            source = _modeling_source(model_type)
            if source is None or not re.search(r"top_k_index|def forward\(self, hidden_states[^)]*router_indices", source):
                continue
            module = importlib.import_module(CONFIG_MAPPING[model_type].__module__.replace(".configuration_", ".modeling_"))
            causal = getattr(module, class_name, None)
            if causal is not None and getattr(causal, "config_class", None) is CONFIG_MAPPING[model_type]:
                found.append(model_type)
    return tuple(found)


def tiny_config(model_type: str):
    """A tiny random config of `model_type`: the sizes above where the config has them."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    defaults = config_class()
    sizes = {k: v for k, v in TINY.items() if hasattr(defaults, k)}
    return config_class(**sizes)


def tiny_model(model_type: str, seed: int = 0) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type)).eval()
    with torch.no_grad():  # random routers, so that each token's experts differ
        for name, p in model.named_parameters():
            if p.dim() >= 1 and p.is_floating_point():
                p.add_(torch.randn_like(p) * 0.02)
    return model


def check_type(model_type: str, work: Path) -> dict:
    """Save a tiny model, load it with fca.load_model, and replay it with every router removed. Returns
    {model_type, recognised, exact, routing, why}."""
    import fca
    from fca.engine.families import family_for_type, family_of
    from fca.engine.loading import save_model
    from fca.engine.sites import find_sites, site_modes

    row = {"model_type": model_type, "recognised": "", "exact": False, "routing": "none", "why": ""}
    try:
        model = tiny_model(model_type)
    except Exception as err:
        row["why"] = f"tiny config does not build ({type(err).__name__})"
        return row
    directory = save_model(model, work / model_type)
    try:
        loaded = fca.load_model(directory)
    except Exception as err:
        row["why"] = str(err).split(": ", 2)[-1][:160]
        return row
    row["recognised"] = "by name" if family_for_type(model_type) is not None else "by structure"
    ids = torch.randint(3, 100, (2, 7), generator=torch.Generator().manual_seed(1))
    sites = find_sites(loaded)
    with torch.no_grad():
        sink: dict = {}
        with site_modes(loaded, "record", sink=sink):
            live = loaded(ids).logits
        for site in sites.values():  # the routers removed: their weights NaN, never read in replay
            for p in site.controller.parameters():
                p.fill_(math.nan)
        with site_modes(loaded, "replay", provider=lambda site, B, T: sink[site.site_name]):
            replayed = loaded(ids).logits
    row["exact"] = bool(torch.equal(live, replayed))
    if not row["exact"]:
        row["why"] = f"Correct replay differs (max |logit diff| {float((live - replayed).abs().max()):.3g})"
    family = family_of(loaded)
    row["routing"] = "observed at experts" if family.expert_paths else "none"
    return row
