"""Routing agreement: how much of the experts' selection a replay condition keeps, read from what ran.

A condition's penalty says what reassigning a mixture of experts' router coefficients costs in NLL; it
does not say how much routing changed. Routers choose in many ways (a softmax's top-k, sigmoid scores
with a correction bias, group-limited top-k, a hash of the token id, capacity limits), so no formula
applied to the coefficients can say which experts ran. The figures are therefore read at the experts
modules (the family's `expert_paths`): a forward pre-hook reads the selection each is handed (the
family's `expert_selection`: expert index [N, k] and mixing weights [N, k]) under every condition, and
compares it token by token with the selection the same tokens' experts received when fed the tokens'
own coefficients (Correct replay of the cache). Ties were broken as they were broken in that run.

Each router site is paired with the experts module nearest to it in the module tree (the longest shared
module path). A router whose selection cannot be read this way (no experts modules declared, none beside
it, or one never called) gets no figure, and the reason is kept (`RoutingTally.unobserved`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import partial
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from fca.engine.adapters import match_modules
from fca.engine.family import ExpertSelection
from fca.engine.sites import forward_pre_hooks, unwrapped

# Per-sequence figures of `routing_agreement`, in the order reports give them.
ROUTING_FIGURES = ("same_experts", "expert_overlap", "weight_kept")


class Selection(NamedTuple):
    """The experts one call of an experts module was handed: index [N, k] (an index >= E is an empty slot)
    and the mixing weights [N, k] (None where the module is not handed any)."""

    index: torch.Tensor
    weights: torch.Tensor | None


def selection_masks(selection: Selection, experts: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A selection -> (selected [N, E] bool, weights [N, E] float32 or None), empty slots dropped; an expert
    named twice in a token's slots runs once, with the sum of its weights."""
    index = selection.index.long()
    slot = torch.where((index >= 0) & (index < experts), index, experts)  # [N, k]; E: the empty slot
    selected = torch.zeros(index.shape[0], experts + 1, dtype=torch.bool, device=index.device)
    selected = selected.scatter_(1, slot, True)[:, :experts]
    if selection.weights is None:
        return selected, None
    weights = torch.zeros(index.shape[0], experts + 1, dtype=torch.float32, device=index.device)
    weights = weights.scatter_add_(1, slot, selection.weights.float())[:, :experts]
    return selected, weights


def routing_agreement(own: Selection, chosen: Selection, experts: int, sequences: int) -> dict[str, torch.Tensor]:
    """The experts the tokens' own coefficients had them run and those a condition's did, [N, k] each with
    N = sequences * T tokens, sequence-major -> per sequence [sequences] (float64):

    - `same_experts`: the share of tokens that ran the same set of experts;
    - `expert_overlap`: the mean share of a token's own experts that still ran for it (a token whose own
      selection was empty counts 1 if the condition's is empty too, else 0);
    - `weight_kept`: the mean share of the token's own mixing weight left on the same experts (expert by
      expert the smaller of the two weights, over the token's own total; a zero total counts as
      `same_experts`); NaN throughout when either side was handed no weights."""
    own_selected, own_weights = selection_masks(own, experts)
    chosen_selected, chosen_weights = selection_masks(chosen, experts)
    same = (own_selected == chosen_selected).all(-1)  # [N]
    own_count = own_selected.sum(-1)
    kept = (own_selected & chosen_selected).sum(-1)
    overlap = torch.where(own_count > 0, kept / own_count.clamp_min(1), same.to(torch.float32))
    if own_weights is None or chosen_weights is None:
        weight = torch.full_like(overlap, float("nan"))
    else:
        total = own_weights.sum(-1)
        shared = torch.minimum(own_weights, chosen_weights).sum(-1)
        weight = torch.where(total != 0, shared / torch.where(total != 0, total, 1.0), same.to(torch.float32))
    per_seq = lambda values: values.double().reshape(sequences, -1).mean(1)  # noqa: E731  [N] -> [sequences]
    return {"same_experts": per_seq(same), "expert_overlap": per_seq(overlap), "weight_kept": per_seq(weight)}


def pair_experts(routers: Sequence[str], experts: Sequence[str]) -> dict[str, str | None]:
    """Each router site -> the experts module it routes to: the one sharing the longest module path with it
    (`model.layers.3.mlp.gate` -> `model.layers.3.mlp.experts`); None where there is none or two are as near."""
    out: dict[str, str | None] = {}
    for router in routers:
        parts = router.split(".")
        # (commonprefix compares item by item: on lists of path components, the shared leading components)
        shared = {name: len(os.path.commonprefix([parts, name.split(".")])) for name in experts}
        best = max(shared.values(), default=0)
        nearest = [name for name, depth in shared.items() if depth == best]
        out[router] = nearest[0] if best > 0 and len(nearest) == 1 else None
    return out


class ExpertObserver:
    """Forward pre-hooks on every experts module matching `expert_paths` that keep the selection each is
    handed (read by `expert_selection`) while `recording()`; use as a context manager (the hooks are
    removed on exit). Reading only references the tensors the model made: no copy, no host transfer."""

    def __init__(self, model: nn.Module, expert_paths: Sequence[str], expert_selection: ExpertSelection) -> None:
        model = unwrapped(model)
        self.modules = {name: model.get_submodule(name) for p in expert_paths for name in match_modules(model, p)}
        self.expert_selection = expert_selection
        self.unreadable: dict[str, str] = {}  # experts module -> why its call could not be read
        self._taken: dict[str, list[Selection]] | None = None

    def __enter__(self) -> ExpertObserver:
        self._hooks = forward_pre_hooks((module, partial(self._keep, name)) for name, module in self.modules.items())
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    def _keep(self, name: str, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._taken is None or name in self.unreadable:
            return
        try:
            selection = Selection(*self.expert_selection(module, args, kwargs))
        except (ValueError, KeyError, IndexError, TypeError) as err:  # a call the family's reader does not fit
            self.unreadable[name] = str(err) or type(err).__name__
            return
        self._taken.setdefault(name, []).append(selection)

    @contextmanager
    def recording(self) -> Iterator[dict[str, list[Selection]]]:
        """Within the block: experts module -> the selections of its calls, in call order."""
        taken: dict[str, list[Selection]] = {}
        self._taken = taken
        try:
            yield taken
        finally:
            self._taken = None


class RoutingTally:
    """Routing agreement of each condition of a replay run, per sequence and router, batch by batch, from
    the selections the experts modules were handed (`ExpertObserver`), compared on the replay's device.

    routers: the router sites, in report order; observer: the hooks on the family's experts modules (None:
    it names none); names: the run's conditions; n: its sequences. `figures()`: condition -> figure ->
    [n, S], S the observed routers (`observed`), in order; `unobserved`: router -> why it has no figure."""

    def __init__(self, routers: Sequence[str], observer: ExpertObserver | None, names: Sequence[str], n: int) -> None:
        self.names, self.n = list(names), n
        self.unobserved: dict[str, str] = {}
        self.experts: dict[str, str] = {}  # router -> its experts module
        if observer is None:
            self.unobserved = dict.fromkeys(routers, "its family names no experts modules (Family.expert_paths)")
        else:
            for router, module in pair_experts(routers, list(observer.modules)).items():
                if module is None:
                    self.unobserved[router] = "no experts module matching the family's expert_paths is beside it"
                elif not isinstance(getattr(observer.modules[module], "num_experts", None), int):
                    self.unobserved[router] = f"its experts module {module} has no num_experts attribute"
                else:
                    self.experts[router] = module
        self.num_experts = {r: observer.modules[m].num_experts for r, m in self.experts.items()}
        self._observer = observer
        self.top_k: dict[str, int] = {}  # router -> the width of the selections its experts were handed
        self._figures: list[tuple[str, list[int], str, dict[str, torch.Tensor]]] = []  # condition, rows, router
        self._index: list[int] = []
        self._T = 0
        self._own: dict[str, Selection] = {}
        self._pending: list[tuple[list[str | None], dict[str, list[Selection]], int | None]] = []
        self._own_names: list[str] = []

    @property
    def observed(self) -> list[str]:
        """The routers with figures, in order."""
        return [r for r in self.experts if r not in self.unobserved]

    def start_batch(self, index: list[int], T: int) -> None:
        """The batch at positions `index` of the run, of T tokens per sequence."""
        self._index, self._T, self._own, self._pending, self._own_names = index, T, {}, [], []

    def set_own(self, taken: Mapping[str, list[Selection]]) -> None:
        """What the experts were handed in a forward of this batch fed the tokens' own coefficients."""
        self._own = self._one_call(taken, 1)

    def add_own(self, name: str) -> None:
        """Condition `name` fed the tokens' own coefficients (Correct, not replayed again)."""
        self._own_names.append(name)

    def add_observed(
        self, names: Sequence[str | None], taken: Mapping[str, list[Selection]], own: int | None = None
    ) -> None:
        """Conditions replayed in one forward, condition-major: names, the g conditions (None for one not
        reported); taken, what `ExpertObserver.recording` kept in that forward; own, the position of a
        condition fed the tokens' own coefficients (plain Correct), whose selection is then the batch's own
        unless `set_own` gave it."""
        self._pending.append((list(names), dict(taken), own))

    def end_batch(self) -> None:
        """Score the batch's conditions against the selection of the tokens' own coefficients."""
        b = len(self._index)
        parts = []  # (name, router, Selection of the b * T tokens)
        for names, taken, own_at in self._pending:
            g = len(names)
            for router, chosen in self._one_call(taken, g).items():
                rows = chosen.index.shape[0] // g  # b * T tokens per condition (condition-major)
                for i, name in enumerate(names):
                    part = Selection(*(None if t is None else t[i * rows : (i + 1) * rows] for t in chosen))
                    if i == own_at and router not in self._own:
                        self._own[router] = part
                    if name is not None:
                        parts.append((name, router, part))
        parts += [(name, router, own) for name in self._own_names for router, own in self._own.items()]
        for name, router, part in parts:
            if router in self.observed:  # (one marked unobserved in a later forward of the batch: none)
                if router not in self._own:
                    raise RuntimeError(f"routing tally: no selection of the tokens' own coefficients for {router}")
                agreement = routing_agreement(self._own[router], part, self.num_experts[router], b)
                self._figures.append((name, self._index, router, agreement))  # [b] each, still on the device
        self._pending, self._own_names = [], []

    def _one_call(self, taken: Mapping[str, list[Selection]], g: int) -> dict[str, Selection]:
        """router -> the one selection its experts module was handed in a forward of g conditions; a router
        whose module was not called exactly once, or not handed one row per token (g * b * T), is marked
        unobserved."""
        out = {}
        for router in self.observed:
            module = self.experts[router]
            calls = taken.get(module, [])
            expected = g * len(self._index) * self._T  # (the experts see [g * b, T] flattened row-major)
            if module in self._observer.unreadable:
                why = f"its experts module's call could not be read ({self._observer.unreadable[module]})"
            elif not calls:
                why = f"its experts module {module} was never called"
            elif len(calls) > 1:
                why = f"its experts module {module} was called {len(calls)} times in one forward"
            elif calls[0].index.dim() != 2 or calls[0].index.shape[0] != expected:
                why = (
                    f"its experts module {module} was handed expert indices {list(calls[0].index.shape)}, not "
                    f"[{expected}, k] for the {expected} tokens of the forward"
                )
            else:
                self.top_k[router] = int(calls[0].index.shape[1])
                out[router] = calls[0]
                continue
            self.unobserved[router] = why
        return out

    def figures(self) -> dict[str, dict[str, np.ndarray]]:
        """condition -> figure -> [n, S] over the observed routers (zero at positions not scored: another
        shard's; NaN for weight_kept where no weights were handed)."""
        routers = self.observed
        column = {r: i for i, r in enumerate(routers)}
        out = {name: {f: np.zeros((self.n, len(routers))) for f in ROUTING_FIGURES} for name in self.names}
        for name, index, router, figures in self._figures:  # (one copy to the host per entry, after the run)
            if router in column:
                for figure, values in figures.items():
                    out[name][figure][index, column[router]] = values.cpu().numpy()
        return out
