"""Built-in adapters for the Hugging Face mixture-of-experts families: Mixtral, OLMoE, Qwen2-MoE and
Qwen3-MoE, as implemented in transformers 5.

In these models every MoE block flattens its tokens and calls a dedicated router module,
`block.gate(h)`, that returns `(router_logits, top_k_weights, top_k_index)`; the experts module then
runs each expert only on the tokens routed to it. The router is the controller.

Router legend: N = tokens of the batch (B * T, flattened by the MoE block), D = hidden size,
E = experts, k = experts per token.

**Coefficient: the router logits** `[N, E]` (before the softmax), recorded per token as `[B, T, E]`.
They are what the router computes from the hidden state; the probabilities, the top-k selection
and the mixing weights are a fixed function of them. Replay therefore rebuilds
`(top_k_weights, top_k_index)` from the given logits with the router's own steps (float32 softmax,
top-k, optional renormalisation, the same dtype casts), so top-k selection and mixing weights
follow the replayed values, and Correct replay is bit-identical to the live run.

Qwen2-MoE also gates an always-run shared expert with `sigmoid(shared_expert_gate(h))`; that gate
is a second site (family `shared_expert_gate`, coefficient: its pre-sigmoid logit `[N, 1]`).
"""

from __future__ import annotations

import io
import logging
import pickle
import re
import warnings
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from fca.engine.adapters import SiteDeclaration, attach_sites, match_modules
from fca.engine.checkpoints import check_safetensors_files, read_config
from fca.engine.family import ExpertSelection, Family, transformers_expert_selection
from fca.engine.sites import as_input_ids, find_sites, forward_pre_hooks, unwrapped
from fca.tables.errors import ModelLoadError

ROUTER_FAMILY = "router"
SHARED_GATE_FAMILY = "shared_expert_gate"
ROUTER_COEFFICIENT = "router logits (pre-softmax, one per expert)"
SHARED_GATE_COEFFICIENT = "shared-expert gate logit (pre-sigmoid)"
EXECUTION_NOTE = (
    "conditional execution is expert-level: every block runs for every token, and inside each MoE "
    "block only the top-k routed experts run per token (the experts run per token, against those available), "
    "unlike FeatureGate, whose gates scale branches that always run"
)
BLOCKS_PATH = "model.layers"
ROUTER_PATH = "model.layers.*.mlp.gate"
EXPERTS_PATH = "model.layers.*.mlp.experts"
SHARED_GATE_PATH = "model.layers.*.mlp.shared_expert_gate"
MOE_MODEL_TYPES = ("mixtral", "olmoe", "qwen2_moe", "qwen3_moe")


@dataclass(frozen=True)
class TopKRouting:
    """Rebuild a transformers top-k router's output from its logits, without calling the router.

    Mirrors the routers' own forward step by step: OLMoE and Qwen cast the top-k weights back to
    the logits' dtype, Mixtral keeps them in float32; renormalisation follows the router's
    `norm_topk_prob` (Mixtral has none and always renormalises).
    """

    weights_in_logit_dtype: bool

    def __call__(
        self, router_logits: torch.Tensor, router: nn.Module
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        probs = F.softmax(router_logits, dim=-1, dtype=torch.float)  # [N, E] float32
        top_value, top_index = torch.topk(probs, router.top_k, dim=-1)  # [N, k], [N, k]
        if getattr(router, "norm_topk_prob", True):
            top_value = top_value / top_value.sum(dim=-1, keepdim=True)  # [N, k]
        if self.weights_in_logit_dtype:
            top_value = top_value.to(router_logits.dtype)
        return router_logits, top_value, top_index


def _router_axes(router: nn.Module) -> tuple[tuple[str, int], ...]:
    return (("expert", router.num_experts),)


def moe_declarations(model_type: str) -> list[SiteDeclaration]:
    """The site declarations of one supported MoE family."""
    if model_type not in MOE_MODEL_TYPES:
        raise ModelLoadError(
            f"no built-in MoE adapter for model_type {model_type!r} (known: {', '.join(MOE_MODEL_TYPES)})"
        )
    router = SiteDeclaration(
        path=ROUTER_PATH,
        axes=_router_axes,
        family=ROUTER_FAMILY,
        output=0,  # (router_logits, top_k_weights, top_k_index)
        token_layout="flat",
        rebuild=TopKRouting(weights_in_logit_dtype=model_type != "mixtral"),
        coefficient=ROUTER_COEFFICIENT,
    )
    if model_type != "qwen2_moe":
        return [router]
    shared = SiteDeclaration(
        path=SHARED_GATE_PATH,
        axes=(("shared_expert", 1),),
        family=SHARED_GATE_FAMILY,
        token_layout="flat",
        coefficient=SHARED_GATE_COEFFICIENT,
    )
    return [router, shared]


def adapt_moe(model: nn.Module) -> nn.Module:
    """Attach the built-in sites to a transformers MoE causal LM (`...ForCausalLM`); returns it.

    Turns off `config.output_router_logits` (checkpoints saved after training with the load-balancing loss
    often carry it): the model then collects every router's output for that loss, and in replay no router
    runs, so its first forward failed inside transformers with an IndexError. The auxiliary loss is a
    training quantity; the logits do not depend on it."""
    model_type = model.config.model_type
    attach_sites(model, moe_declarations(model_type), blocks=BLOCKS_PATH)
    if getattr(model.config, "output_router_logits", False):
        model.config.output_router_logits = False
    return model


def _load_report_rows(report: str, shown: int = 3) -> str:
    """The weights a transformers load report flags ("model.layers.0.mlp.experts.gate_up_proj MISSING"),
    with the reason of a failed conversion, in one line; "" when the report names none."""
    rows = dict.fromkeys(
        f"{key} {status}"
        for key, status in re.findall(r"^(\S+)\s*\|\s*(MISSING|UNEXPECTED|MISMATCH|CONVERSION)\b", report, re.M)
    )
    reasons = dict.fromkeys(re.findall(r"^(?:RuntimeError|ValueError): (.+)$", report, re.M))
    if not rows:
        return ""
    listed = list(rows)
    text = ", ".join(listed[:shown]) + (f" and {len(listed) - shown} more" if len(listed) > shown else "")
    return text + (f"; {next(iter(reasons))}" if reasons else "")


def load_hf_moe(path: Path) -> nn.Module:
    """A local transformers MoE directory of a type declared here, loaded in float32 on CPU, offline."""
    return adapt_moe(load_transformers_causal_lm(path))


def load_transformers_causal_lm(path: Path) -> nn.Module:
    """A local transformers causal-LM directory, loaded in float32 on CPU without any network access."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    # transformers fills missing weights with a fresh initialisation and drops unexpected ones, saying so
    # only in a multi-line load report: the model audited would not be the checkpoint. Its report is
    # kept from the terminal and the same facts refused in one line instead; where loading fails outright
    # ("look at the above report"), the report's rows name the weights.
    config = read_config(path)
    top_k, experts = config.get("num_experts_per_tok"), config.get("num_local_experts", config.get("num_experts"))
    if isinstance(top_k, int) and isinstance(experts, int) and not 1 <= top_k <= experts:
        # (else the first forward fails deep in the router: "selected index k out of range")
        raise ModelLoadError(
            f"{path / 'config.json'}: num_experts_per_tok {top_k} does not fit the {experts} experts "
            "(each token's router picks 1 to that many)"
        )
    check_safetensors_files(path)
    report = io.StringIO()
    handler = logging.StreamHandler(report)
    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_warning()
    hf_logging.disable_default_handler()
    hf_logging.add_handler(handler)
    hf_logging.disable_progress_bar()  # ("Loading weights" bars among the command's own progress)
    try:
        with warnings.catch_warnings():  # (torch's note on a pickle's protocol, before it refuses or reads it)
            warnings.filterwarnings("ignore", "Detected pickle protocol", UserWarning)
            model, info = AutoModelForCausalLM.from_pretrained(
                path, local_files_only=True, dtype=torch.float32, output_loading_info=True
            )
    except pickle.UnpicklingError as err:  # a pytorch_model.bin that is no weights-only pickle: refused, never run
        raise ModelLoadError(
            f"{path / 'pytorch_model.bin'}: not a weights-only state dict ({_unpickler_said(err)})"
        ) from None
    except (OSError, ValueError, KeyError, RuntimeError) as err:
        said = str(err).splitlines()[0]
        rows = _load_report_rows(report.getvalue())
        raise ModelLoadError(
            f"{path}: transformers could not load it ("
            + (f"the checkpoint's weights do not fit the model: {rows}" if rows else said)
            + ")"
        ) from None
    finally:
        hf_logging.remove_handler(handler)
        hf_logging.enable_default_handler()
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    for kind, what in (("missing_keys", "lacks"), ("unexpected_keys", "has unexpected"), ("mismatched_keys", "has")):
        keys = sorted(str(k[0] if isinstance(k, tuple) else k) for k in info.get(kind) or ())
        if keys:
            shown = ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
            label = "weights of another shape" if kind == "mismatched_keys" else "weights"
            raise ModelLoadError(f"{path}: the checkpoint {what} {label} ({shown}); it is not this model's checkpoint")
    return model


def _unpickler_said(err: Exception) -> str:
    """What torch's weights-only unpickler found, from its many-line message (the line naming the operand or
    global it refused)."""
    said = str(err).split("WeightsUnpickler error:")[-1].split("Check the documentation")[0]
    return " ".join(said.split())[:160] or "refused by torch's weights-only unpickler"


@torch.no_grad()
def expert_execution(
    model: nn.Module,
    input_ids,
    expert_paths: tuple[str, ...] = (EXPERTS_PATH,),
    note: str = EXECUTION_NOTE,
    expert_selection: ExpertSelection = transformers_expert_selection,
) -> dict:
    """Expert-level conditional execution of one forward pass, by counting what the experts run.

    A pre-hook on every experts module (those matching `expert_paths`: its family's, for the execution
    audit; each with a `num_experts` attribute) reads the expert index [N, k] it is handed with
    `expert_selection` (its family's; by default transformers' call `experts(hidden, top_k_index,
    top_k_weights)`): the dispatch that actually happens, whatever mode the sites are in; and counts the
    distinct experts each token runs. Returns, per MoE layer and overall, `experts_available` (E), `top_k`,
    `experts_run_per_token_mean` and `expert_fraction` (= run / available); plus `experts_hit`, the
    distinct experts that ran for at least one token of the batch; and `note`. A compiled model is counted
    on its original module, as `fca.engine.execution.blocks_executed` says why.
    """
    model = unwrapped(model)
    if not expert_paths:
        raise ValueError(f"{type(model).__name__}: no expert modules given (its family's expert_paths)")
    modules = {n: model.get_submodule(n) for p in expert_paths for n in match_modules(model, p)}
    seen: dict[str, dict] = {}

    def count(name: str, module: nn.Module, args: tuple, kwargs: dict) -> None:
        E = getattr(module, "num_experts", None)
        try:
            index, _ = expert_selection(module, args, kwargs)  # [N, k]
        except ValueError:
            index = None
        if not isinstance(index, torch.Tensor) or not isinstance(E, int):
            raise ValueError(
                f"{name}: not an experts module of the kind expert_paths must name: one whose call its family's "
                "expert_selection reads (by default experts(hidden, top_k_index, top_k_weights)), with a "
                "num_experts attribute"
            )
        # Indices >= E are "no expert" slots (expert-parallel padding): not run.
        ran = F.one_hot(index.long().clamp(min=0, max=E), E + 1)[..., :E].amax(dim=1)  # [N, E] 0/1
        seen[name] = {
            "experts_available": E,
            "top_k": index.shape[-1],
            "experts_run_per_token_mean": ran.sum(dim=-1).float().mean().item(),
            "experts_hit": int(ran.amax(dim=0).sum().item()),
            "tokens": index.shape[0],
        }

    with forward_pre_hooks((m, partial(count, n)) for n, m in modules.items()):
        model(as_input_ids(input_ids, model))
    if not seen:  # e.g. a ModuleList of experts, which the model indexes and never calls
        raise ValueError(
            f"{type(model).__name__}: no module matching {list(expert_paths)} was called in the forward pass "
            f"(matched: {list(modules)[:3]}); expert_paths must name experts modules the model calls"
        )
    for layer in seen.values():
        layer["expert_fraction"] = layer["experts_run_per_token_mean"] / layer["experts_available"]
    run = sum(v["experts_run_per_token_mean"] for v in seen.values())
    available = sum(v["experts_available"] for v in seen.values())
    return {
        "layers": seen,
        "moe_layers": len(seen),
        # Qwen2-MoE's shared expert runs for every token beside the routed ones (not counted above).
        "shared_experts": any(name.rsplit(".", 1)[-1] == "shared_expert" for name, _ in model.named_modules()),
        "experts_available": available / max(len(seen), 1),  # per MoE layer
        "top_k": max((v["top_k"] for v in seen.values()), default=0),
        "experts_run_per_token_mean": run / max(len(seen), 1),  # per MoE layer
        "expert_fraction": run / available if available else 0.0,
        "note": note,
    }


def moe_routers(model: nn.Module) -> dict[str, int]:
    """The router sites of an adapted MoE model -> the experts each token is routed to (its `top_k`). Which
    experts ran is read at the experts modules (`fca.engine.routing`), not recomputed from the logits."""
    return {
        name: int(site.controller.top_k)
        for name, site in find_sites(model).items()
        if site.spec.family == ROUTER_FAMILY
    }


FAMILIES = tuple(  # no Dense twin: a dense model of the same sizes is another model
    Family(
        model_type,
        load=load_hf_moe,
        blocks=lambda model: list(model.get_submodule(BLOCKS_PATH)),
        coefficient_kind="router logits",
        expert_paths=(EXPERTS_PATH,),
        execution_note=EXECUTION_NOTE,
        routers=moe_routers,
    )
    for model_type in MOE_MODEL_TYPES
)
