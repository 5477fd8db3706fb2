"""Mixture-of-experts causal LMs of transformers, recognised by the modules they have, not by name.

A transformers MoE layer hands its experts module the selection: `experts(hidden [N, D], index [N, k],
weights [N, k])`. One forward pass on a few tokens (the probe) finds every module called so, and, beside
it in the same MoE block, the child whose call makes the linear projection with one output per expert:
the router. Its coefficient is that projection (the router logits); the router is declared with
`output=Projection()`, so replay runs the router's own forward with the projection answered by the
replayed logits: softmax or sigmoid, correction bias, group-limited or hash top-k are rebuilt by the
router's own code, exactly, and the projection is never computed. A child `nn.Linear` of the block with
one output whose name says gate (a shared expert's gate) is a site too.

Where structure does not decide, a per-type declaration says only what it cannot (`ROUTER_OUTPUTS`).
A type the probe cannot read is refused in one line that says why and how to declare it
(a family file passed with `--family FILE`, or `fca.attach_sites` from Python). The four types declared by name in
`fca.engine.models.hf_moe` keep their declarations.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from torch import nn

from fca.engine.adapters import F_LINEAR, Projection, SiteDeclaration, attach_sites
from fca.engine.checkpoints import read_config
from fca.engine.family import Family, default_blocks, transformers_expert_selection
from fca.engine.models.hf_moe import ROUTER_FAMILY, SHARED_GATE_FAMILY, load_transformers_causal_lm
from fca.tables.errors import ModelLoadError

ROUTER_COEFFICIENT = "router logits (the router's projection, one per expert)"
SHARED_GATE_COEFFICIENT = "shared-expert gate logit (its projection)"
EXECUTION_NOTE = (
    "conditional execution is expert-level: every block runs for every token, and inside each MoE "
    "block only the experts each token's router selects run (counted from the experts' own calls)"
)
HOW_TO_DECLARE = (
    "declare its family in a Python file (FAMILY = fca.Family(model_type, load=...), the load calling "
    "fca.attach_sites with a SiteDeclaration per router) and pass it to any command with --family FILE, or "
    "from Python call fca.attach_sites, then fca.audit"
)


# Per-type declarations, only where structure does not decide: how many outputs a type's router projection
# has when it is not one per routed expert. Inkling's router scores its routed and shared experts in one
# projection (the shared experts' weights are its last outputs).
ROUTER_OUTPUTS = {"inkling_text": lambda config, experts: experts + int(config.n_shared_experts)}


class NotRecognised(ModelLoadError):
    """A transformers model the probe cannot read as a mixture of experts; one line, why and what to do."""


@dataclass(frozen=True)
class MoEStructure:
    """What the probe found: the decoder blocks, the experts modules, the routers and the shared gates
    (module paths), and where each experts call holds its selection (argument position of index, weights)."""

    blocks: str
    experts: tuple[str, ...]
    routers: tuple[tuple[str, int, int], ...]  # (path, experts E, experts per token k)
    shared_gates: tuple[str, ...]
    selection_at: tuple[int, int | None]


class _LinearCalls(torch.overrides.TorchFunctionMode):
    """Every `F.linear` call of a forward: (the module path stack at the call, its number of outputs)."""

    def __init__(self, stack: list[str]) -> None:
        super().__init__()
        self.stack, self.calls = stack, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F_LINEAR:
            weight = args[1] if len(args) > 1 else kwargs["weight"]
            if isinstance(weight, torch.Tensor) and weight.dim() == 2:
                self.calls.append((tuple(self.stack), int(weight.shape[0])))
        return func(*args, **kwargs)


def _probe(model: nn.Module, ids: torch.Tensor) -> tuple[dict, list]:
    """One forward on `ids` [B, T]: the modules called with an integer [N, k] tensor beside a floating first
    argument (experts candidates: path -> (index position, weights position, k)), and every linear call."""
    stack: list[str] = []
    called: dict[str, tuple[int, int | None, int]] = {}
    N = ids.numel()

    def enter(name, module, args, kwargs):
        stack.append(name)
        values = list(args) + list(kwargs.values())
        if values and isinstance(values[0], torch.Tensor) and values[0].is_floating_point():
            index = [
                i
                for i, v in enumerate(values)
                if isinstance(v, torch.Tensor) and not v.is_floating_point() and v.dim() == 2 and v.shape[0] == N
            ]
            if index and name not in called:
                i = index[0]
                k = values[i].shape[1]
                weights = [
                    j
                    for j, v in enumerate(values)
                    if j != i and isinstance(v, torch.Tensor) and v.is_floating_point() and tuple(v.shape) == (N, k)
                ]
                called[name] = (i, weights[0] if weights else None, k)

    def leave(name, module, args, output):
        if stack and stack[-1] == name:
            stack.pop()

    handles = []
    for name, module in model.named_modules():
        if name:
            handles.append(module.register_forward_pre_hook(partial(enter, name), with_kwargs=True))
            handles.append(module.register_forward_hook(partial(leave, name), always_call=True))
    try:
        with torch.no_grad(), _LinearCalls(stack) as linears:
            model(ids)
    finally:
        for handle in handles:
            handle.remove()
    return called, linears.calls


def _num_experts(module: nn.Module) -> int | None:
    """How many experts the module selects among: with zero-compute experts (LongCat-Flash) their total."""
    for name in ("total_experts", "num_experts", "num_local_experts", "n_routed_experts"):
        value = getattr(module, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def find_structure(model: nn.Module, where: str) -> MoEStructure:
    """The MoE structure of a transformers causal LM, read from one probe forward; NotRecognised (one line,
    starting with `where`) when there is none to read."""
    model_type = getattr(model.config, "model_type", type(model).__name__)
    vocab = int(getattr(model.config, "vocab_size", 2) or 2)
    ids = (torch.arange(6) % max(vocab - 1, 1)).reshape(2, 3) + 1  # [B=2, T=3]: B * T tells flat from batched
    try:
        called, linears = _probe(model, ids.to(next(model.parameters()).device))
    except Exception as err:  # the probe is the model's own forward: any failure is the model's, said in one line
        raise NotRecognised(
            f"{where}: {model_type}: its forward failed on a probe of 2 x 3 tokens ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''}); {HOW_TO_DECLARE}"
        ) from None
    experts = {p: at for p, at in called.items() if _num_experts(model.get_submodule(p)) is not None}
    if not experts:
        raise NotRecognised(
            f"{where}: {model_type}: no module is called with the experts' selection (hidden [N, D], index [N, k]) "
            f"and says its num_experts, so it is not recognised as a mixture of experts; {HOW_TO_DECLARE}"
        )
    routers: list[tuple[str, int, int]] = []
    shared: list[str] = []
    for path, (_, _, k) in experts.items():
        parent = path.rpartition(".")[0]
        experts_count = _num_experts(model.get_submodule(path))
        declared = ROUTER_OUTPUTS.get(model_type)
        E = declared(model.config, experts_count) if declared else experts_count  # the router projection's outputs
        depth = len(parent.split(".")) + 1 if parent else 1
        # The direct children of the MoE block inside whose call the block's E-output projections ran.
        owners = {
            stack[stack.index(parent) + 1] if parent in stack and stack.index(parent) + 1 < len(stack) else None
            for stack, size in linears
            if size == E and parent in stack
        }
        owners.discard(path)
        if None in owners or len(owners) != 1:
            why = (
                "its MoE block computes the router projection itself, outside any child module"
                if None in owners
                else "no child of its MoE block makes a projection with one output per expert"
                if not owners
                else f"several children of its MoE block make a projection with {E} outputs ({sorted(owners)})"
            )
            raise NotRecognised(f"{where}: {model_type}: {path}: {why}, so its router is not found; {HOW_TO_DECLARE}")
        router = owners.pop()
        if len(router.split(".")) != depth:
            raise NotRecognised(f"{where}: {model_type}: {router}: not a child of {parent}; {HOW_TO_DECLARE}")
        made = sum(1 for stack, size in linears if size == E and router in stack)
        if made != 1:
            raise NotRecognised(
                f"{where}: {model_type}: {router} makes {made} projections with {E} outputs in one forward, so "
                f"which is its coefficient is not decided by structure; {HOW_TO_DECLARE}"
            )
        routers.append((router, E, k))
        for name, child in model.get_submodule(parent).named_children():
            child_path = f"{parent}.{name}"
            if isinstance(child, nn.Linear) and child.out_features == 1 and "gate" in name.lower():
                if any(child_path in stack for stack, _ in linears):
                    shared.append(child_path)
    blocks = _blocks_path(model, next(iter(experts)))
    positions = {at[:2] for at in experts.values()}
    if len(positions) != 1:
        raise NotRecognised(f"{where}: {model_type}: its experts are called in different ways; {HOW_TO_DECLARE}")
    return MoEStructure(blocks, tuple(experts), tuple(routers), tuple(shared), positions.pop())


def _blocks_path(model: nn.Module, experts_path: str) -> str:
    """The module list of decoder layers: the deepest `nn.ModuleList` above the experts."""
    parts = experts_path.split(".")
    for end in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:end])
        if isinstance(model.get_submodule(prefix), nn.ModuleList):
            return prefix
    return ""


def declarations(structure: MoEStructure) -> list[SiteDeclaration]:
    """The routers' sites, then the shared-expert gates': each records its projection's output."""
    sites = [(path, ("expert", E), ROUTER_FAMILY, ROUTER_COEFFICIENT) for path, E, _ in structure.routers]
    sites += [
        (path, ("shared_expert", 1), SHARED_GATE_FAMILY, SHARED_GATE_COEFFICIENT) for path in structure.shared_gates
    ]
    return [
        SiteDeclaration(path=path, axes=(axis,), family=family, output=Projection(), coefficient=coefficient)
        for path, axis, family, coefficient in sites
    ]


def selection_reader(index_at: int, weights_at: int | None):
    """Family.expert_selection for experts called with the index and weights at these argument positions
    (positional, then keyword in call order); transformers' own convention is (1, 2)."""
    if (index_at, weights_at) == (1, 2):
        return transformers_expert_selection

    def read(experts: nn.Module, args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
        values = list(args) + list(kwargs.values())
        return values[index_at], values[weights_at] if weights_at is not None else None

    return read


def structural_family(model: nn.Module, structure: MoEStructure) -> Family:
    blocks = structure.blocks
    # The execution audit counts experts by their `num_experts`; experts without one are not counted there.
    counted = all(isinstance(getattr(model.get_submodule(p), "num_experts", None), int) for p in structure.experts)
    # Each router -> the experts per token its experts were handed in the probe; routing agreement is read
    # at the experts under every condition (`fca.engine.routing`), or said not observed where none are named.
    top_k = {path: k for path, _, k in structure.routers}
    return Family(
        model.config.model_type,
        load=load_structural,
        blocks=(lambda m: list(m.get_submodule(blocks))) if blocks else default_blocks,
        coefficient_kind="router logits",
        expert_paths=structure.experts if counted else (),
        execution_note=EXECUTION_NOTE if counted else "",
        expert_selection=selection_reader(*structure.selection_at),
        routers=lambda m: dict(top_k),
    )


def adapt_structural(model: nn.Module, where: str = "") -> nn.Module:
    """Find the MoE structure of a transformers causal LM, attach its sites and its family
    (`model.fca_family`); returns it. NotRecognised when the structure does not decide."""
    where = where or type(model).__name__
    if getattr(model.config, "output_router_logits", False):
        model.config.output_router_logits = False  # (see fca.engine.models.hf_moe.adapt_moe)
    structure = find_structure(model, where)
    attach_sites(model, declarations(structure), blocks=structure.blocks or None)
    model.fca_family = structural_family(model, structure)
    return model


def seq2seq_refusal(path: Path, model_type: str) -> str | None:
    """The one-line refusal of an encoder-decoder model, or None for any other."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
    )

    if (
        model_type in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES
        and model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    ):
        return (
            f"{path / 'config.json'}: {model_type} is an encoder-decoder (sequence-to-sequence) model; FCA captures "
            "and replays causal LMs, called on input ids alone, and does not feed decoder inputs"
        )
    return None


def is_transformers_type(model_type: str | None) -> bool:
    if not isinstance(model_type, str):
        return False
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return model_type in CONFIG_MAPPING_NAMES


def load_structural(path: Path) -> nn.Module:
    """A local transformers MoE causal-LM directory of a type not declared by name, recognised by structure."""
    model_type = read_config(path).get("model_type")
    refusal = seq2seq_refusal(path, model_type)
    if refusal:
        raise ModelLoadError(refusal)
    model = load_transformers_causal_lm(path)
    return adapt_structural(model.eval(), str(path))
