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
    # Multi-head latent attention (DeepSeek and its kin): its head sizes, in place of head_dim.
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "tie_word_embeddings": False,
    # Inkling's vocabulary before padding and its sliding-window attention's own head sizes.
    "unpadded_vocab_size": 128,
    "swa_num_attention_heads": 4,
    "swa_num_key_value_heads": 2,
    "swa_head_dim": 16,
    "enable_moe_block": True,
    "top_k_experts": 2,
    "use_cache": False,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

# Types whose configs nest their sizes or need a value the defaults leave out.
SPECIAL = {
    "dbrx": {
        "d_model": 64,
        "n_heads": 4,
        "n_layers": 2,
        "max_seq_len": 128,
        "ffn_config": {"ffn_hidden_size": 128, "moe_num_experts": 8, "moe_top_k": 2},
        "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
    },
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 0},
    "longcat_flash": {"num_layers": 1, "head_dim": 8},  # (two sublayers per layer; rotary on qk_rope_head_dim)
    "zaya": {"num_experts_per_tok": 1},  # (it routes each token to one expert only)
}


def _causal_lm_class(model_type: str):
    """The causal-LM class transformers builds from `model_type`'s config (a type may reuse another's
    modeling code: sarvam_mla builds DeepSeek-V3's), or None."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[CONFIG_MAPPING[model_type]]
    except Exception:  # a type whose modeling module does not import here (an optional dependency)
        return None


def _modeling_source(model_class) -> str | None:
    try:
        return inspect.getsource(importlib.import_module(model_class.__module__))
    except Exception:
        return None


def _has(config, name: str) -> bool:
    try:
        getattr(config, name)
    except AttributeError:
        return False
    except Exception:  # a per-layer attribute, which the config refuses to read globally: it has it
        return True
    return True


@cache
def moe_model_types() -> tuple[str, ...]:
    """Causal-LM types of the installed transformers whose config builds a `...ForCausalLM` (its own or one
    it shares) whose modeling code defines experts (transformers' `experts(hidden, top_k_index, ...)`).
    A config with a text_config (text beside vision or audio) is left out: its text part is a type of its own."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    found = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for model_type, class_name in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()):
            if not class_name.endswith("ForCausalLM") or "text_config" in (
                CONFIG_MAPPING[model_type].sub_configs or {}
            ):
                continue
            model_class = _causal_lm_class(model_type)
            source = _modeling_source(model_class) if model_class is not None else None
            if source is not None and re.search(r"class \w*(Experts|MoE|Moe\w*Block|Moe)\(nn\.Module\)", source):
                found.append(model_type)
    return tuple(found)


def tiny_config(model_type: str):
    """A tiny random config of `model_type`: the sizes above where the config has them."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    defaults = config_class()
    sizes = {k: v for k, v in TINY.items() if _has(defaults, k)}
    if "qk_rope_head_dim" in sizes:  # latent attention: its own head sizes, as many key/value heads as heads
        sizes.pop("head_dim", None)
        sizes["num_key_value_heads"] = sizes.get("num_attention_heads", 4)
    kinds = getattr(defaults, "mlp_layer_types", None)
    if isinstance(kinds, list):  # every layer a mixture of experts (the defaults begin with dense ones)
        sparse = [k for k in dict.fromkeys(kinds) if k != "dense"]
        if sparse:
            sizes["mlp_layer_types"] = [sparse[0]] * TINY["num_hidden_layers"]
    return config_class(**{**sizes, **SPECIAL.get(model_type, {})})


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

    row = {"model_type": model_type, "recognised": "", "exact": False, "routing": "none", "why": ""}
    try:
        model = tiny_model(model_type)
    except Exception as err:
        row["why"] = f"tiny config does not build ({type(err).__name__})"
        return row
    directory = work / model_type
    try:
        model.save_pretrained(directory)  # (transformers' own writer: tied embeddings are its to handle)
    except Exception as err:
        row["why"] = f"transformers cannot save its tiny model ({type(err).__name__}: {_first_line(err)})"
        return row
    try:
        loaded = fca.load_model(directory)
    except Exception as err:
        said = _first_line(err, 400).split(f"{directory}: ", 1)[-1].split(f"{directory / 'config.json'}: ", 1)[-1]
        row["why"] = said.removeprefix(f"{model_type}: ").split("; declare")[0][:160]
        return row
    from fca.engine.models.hf_structure import ROUTER_OUTPUTS

    row["recognised"] = (
        "by name"
        if family_for_type(model_type) is not None
        else "by structure, router outputs declared"
        if model_type in ROUTER_OUTPUTS
        else "by structure"
    )
    try:
        live, replayed = replay_without_routers(loaded)
    except Exception as err:
        row["why"] = f"replay fails ({type(err).__name__}: {_first_line(err)})"
        return row
    row["exact"] = bool(torch.equal(live, replayed))
    if not row["exact"]:
        row["why"] = f"Correct replay differs (max |logit diff| {float((live - replayed).abs().max()):.3g})"
    family = family_of(loaded)
    row["routing"] = "observed at experts" if family.expert_paths else "none"
    return row


def _first_line(err: Exception, limit: int = 120) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return (lines[0] if lines else "")[:limit]


def replay_without_routers(
    loaded: torch.nn.Module, ids: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(live logits while recording, Correct-replay logits with every site's weights NaN); ids: [B, T],
    by default two seeded sequences of 7 tokens."""
    from fca.engine.sites import find_sites, site_modes

    if ids is None:
        ids = torch.randint(3, 100, (2, 7), generator=torch.Generator().manual_seed(1))
    sites = find_sites(loaded)
    with torch.no_grad():
        sink: dict = {}
        with site_modes(loaded, "record", sink=sink):
            live = loaded(ids).logits
        for site in sites.values():  # the routers removed: their projections' weights NaN, never read in replay
            for p in site.controller.parameters():
                if p.dim() == 2 and p.shape[0] == site.spec.num_channels:
                    p.fill_(math.nan)
        with site_modes(loaded, "replay", provider=lambda site, B, T: sink[site.site_name]):
            replayed = loaded(ids).logits
    return live, replayed


def coverage_rows() -> list[dict]:
    """check_type of every scanned type, in name order."""
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()  # (one "Writing model shards" bar per type said nothing)
    try:
        with tempfile.TemporaryDirectory(prefix="fca-moe-coverage-") as work, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return [check_type(t, Path(work)) for t in moe_model_types()]
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def coverage_table(rows: list[dict]) -> str:
    """The README's table: type, how recognised, exact on CPU, routing source, and why a type stays out."""
    exact = sum(r["exact"] for r in rows)
    lines = [
        f"{exact} of the {len(rows)} mixture-of-experts causal-LM types of transformers load with `fca.load_model` "
        "and replay exactly with their routers removed (tiny random models, CPU float32; "
        "`python -m bench.moe_coverage`).",
        "",
        "| type | how recognised | exact on CPU | routing source | why not |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        why = r["why"].split("; declare")[0].replace("|", "/")
        lines.append(
            f"| {r['model_type']} | {r['recognised'] or 'refused'} | {'yes' if r['exact'] else 'no'} | "
            f"{r['routing'] if r['exact'] else 'none'} | {why} |"
        )
    return "\n".join(lines)


def readme_table(readme: Path = README) -> str:
    text = readme.read_text()
    if BEGIN not in text or END not in text:
        return ""
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n")


def write_readme(table: str, readme: Path = README) -> None:
    text = readme.read_text()
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    tmp = readme.with_name(f".{readme.name}.tmp")
    tmp.write_text(f"{head}{BEGIN}\n{table}\n{END}{tail}")
    tmp.replace(readme)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the README's table differs")
    parser.add_argument("--write", action="store_true", help="write the table into the README")
    args = parser.parse_args(argv)
    table = coverage_table(coverage_rows())
    if args.write:
        write_readme(table)
    elif args.check:
        if readme_table() != table:
            print(
                f"{README.name}: its mixture-of-experts coverage table differs; run python -m bench.moe_coverage --write"
            )
            return 1
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
