"""Adapters: declare controller sites on any `torch.nn.Module` by module path.

A `SiteDeclaration` names modules by path (a glob per dotted component: `model.layers.*.mlp.gate`)
and says which part of each module's output is the coefficient tensor, how that tensor lays out its
tokens, and how to rebuild the module's output from coefficients alone. `attach_sites` swaps every
matched module for a `ModuleSite` that holds it as its controller, so the record / replay machinery
of `fca.engine.sites` (and `fca.capture`, `fca.replay` on top of it) works unchanged. In replay the original
module is never called: it is swapped out, not run and overwritten.

Shape legend: B = batch, T = positions, N = B * T tokens (a "flat" layout), K = channels of a site.
"""

from __future__ import annotations

import difflib
import math
import numbers
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from functools import partial
from typing import Any, Literal

import torch
from torch import nn

from fca.engine.sites import OutputSelector, Site, SiteSpec, assign_site_names, unwrapped

F_LINEAR = torch.nn.functional.linear

TokenLayout = Literal["batched", "flat"]
Axes = tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class Projection:
    """`output=Projection()`: the coefficient is the module's linear projection, the one `F.linear` call
    inside its forward that has `K` outputs (a router's logits; also reached through a child `nn.Linear`).
    Replay runs the module's own forward with that call answered by the replayed coefficients, so whatever
    the module does with its logits (softmax or sigmoid, correction bias, group-limited or hash top-k) is
    rebuilt by its own code, exactly, while the projection itself is never computed. No `rebuild` is needed."""


@dataclass(frozen=True)
class SiteCall:
    """What a `rebuild` declared with `rebuild_call=True` receives beside the coefficients: the module's own
    call arguments and the model's (e.g. `input_ids`, which a hash router needs)."""

    args: tuple
    kwargs: dict
    model_args: tuple
    model_kwargs: dict


class SiteDeclarationError(ValueError):
    """A declaration that matches no module or does not fit the module's output; the message is one
    line and names what to change (candidate module paths, or the output the module returned)."""


@dataclass(frozen=True)
class SiteDeclaration:
    """Which modules are controllers and how to read and rebuild their coefficients.

    - `path`: dotted module path; each component may be a glob (`*` matches one component).
    - `axes`: the per-token channel structure, flattened row-major into `K`; or a function of the
      matched module giving it (so one glob can cover layers of different widths).
    - `family`: coefficients that mean the same kind of thing share a family (global-mean profile).
    - `output`: where the coefficient tensor sits in the module's output: `None` (the output is the
      coefficient tensor), an index into a tuple (a router returning (logits, weights, index) names 0), an
      attribute or key name, a function, or `Projection()` (the module's own linear projection, replayed
      through the module's own forward; see `Projection`).
    - `token_layout`: `"batched"` if the module sees `[B, T, ...]`, `"flat"` if it sees `[N, ...]`.
    - `rebuild(coefficients, module)`: the module's output from coefficients alone, in the module's
      own layout (`[B, T, *axes]` or `[N, *axes]`); needed whenever `output` is neither `None` nor a
      `Projection`. It must reproduce the module's output exactly (the first recorded call checks it, bit for
      bit); it may read the module's attributes (top-k, flags) but must not call the module.
    - `rebuild_call`: True to call `rebuild(coefficients, module, call)` with a `SiteCall`: the module's
      call arguments and the model's inputs (a router that also takes a bias, a hash router's token ids).
    - `channel_families`: one family per channel (length `K`), or a function of the module giving them,
      for a module whose channels feed different kinds of thing (one Linear emitting attention and MLP
      gates); each channel's global mean is then its own family's. None: every channel is in `family`.
    - `coefficient`: what the recorded values are (e.g. "router logits"), stated in reports.
    """

    path: str
    axes: Axes | Callable[[nn.Module], Axes]
    family: str
    output: int | str | Callable[[Any], torch.Tensor] | None = None
    token_layout: TokenLayout = "batched"
    rebuild: Callable[..., Any] | None = None
    coefficient: str = ""
    rebuild_call: bool = False
    channel_families: Sequence[str] | Callable[[nn.Module], Sequence[str]] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path:
            raise SiteDeclarationError(f"path must be a dotted module path, not {self.path!r}")
        if not callable(self.axes):
            check_axes(self.axes, self.path)
        if not isinstance(self.family, str) or not self.family:
            raise SiteDeclarationError(f"{self.path}: family must be a non-empty name, not {self.family!r}")
        if self.token_layout not in ("batched", "flat"):
            raise SiteDeclarationError(
                f"{self.path}: token_layout must be 'batched' or 'flat', not {self.token_layout!r}"
            )
        if self.output is not None and not isinstance(self.output, Projection) and self.rebuild is None:
            raise SiteDeclarationError(
                f"{self.path}: output={self.output!r} picks the coefficient out of a larger output, "
                "so replay needs rebuild="
            )


def check_axes(axes: Any, path: str) -> None:
    """SiteDeclarationError unless `axes` is a sequence of (name, size) pairs, sizes whole numbers >= 1; empty
    for a controller that gives one scalar per token ([B, T] or [B * T])."""
    if not isinstance(axes, (tuple, list)) or not all(
        isinstance(axis, (tuple, list))
        and len(axis) == 2
        and isinstance(axis[0], str)
        and isinstance(axis[1], numbers.Integral)
        and not isinstance(axis[1], bool)
        and axis[1] >= 1
        for axis in axes
    ):
        raise SiteDeclarationError(
            f"{path}: axes must be (name, size) pairs with whole sizes of at least 1, e.g. (('group', 4),), or () "
            f"for one scalar per token; got {axes!r}"
        )


def _describe(value: Any) -> str:
    """A short structural description of a module output, for error messages."""
    if isinstance(value, torch.Tensor):
        return f"Tensor{list(value.shape)}"
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__}({', '.join(_describe(v) for v in value)})"
    return type(value).__name__


class ModuleSite(Site):
    """A site around an arbitrary module, declared by a `SiteDeclaration`.

    Live and record return the module's own output untouched; record also hands the coefficients
    `[B, T, K]` to the sink. Replay takes `[B, T, K]` from the provider and returns
    `declaration.rebuild(...)` without calling the module.
    """

    def __init__(self, controller: nn.Module, spec: SiteSpec, declaration: SiteDeclaration) -> None:
        super().__init__(controller, spec)
        self.declaration = declaration
        # (B, T) of the current model call, set by the pre-hook `attach_sites` puts on the model: a
        # module that sees flattened tokens [N, ...] cannot tell B from T by itself.
        self.batch_shape: tuple[int, int] | None = None
        self.model_call: tuple[tuple, dict] = ((), {})  # the model's (args, kwargs), for a rebuild_call
        self.rebuild_checked = False  # the first recorded call checks rebuild against the module's output
        # The wrapper is invisible in state dicts: keys stay those of the unadapted model, so its
        # fingerprint and checkpoints do not change.
        self.register_state_dict_post_hook(_hide_controller_keys)
        self.register_load_state_dict_pre_hook(_restore_controller_keys)

    def __getattr__(self, name: str) -> Any:
        # Transparent to the parent: a block that reads `gate.weight` or `gate.e_score_correction_bias` reads
        # the wrapped module's. Only reached when ordinary lookup fails, so it costs a site's calls nothing.
        try:
            return super().__getattr__(name)
        except AttributeError:
            controller = self.__dict__.get("_modules", {}).get("controller")
            if controller is None or name.startswith("__"):
                raise
            return getattr(controller, name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        first = next((v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)), None)
        B, T = self._current_batch_shape(first)
        if isinstance(self.declaration.output, Projection):
            return self._projection_forward(B, T, args, kwargs)
        if self.mode == "replay":
            dtype = first.dtype if first is not None and first.is_floating_point() else torch.get_default_dtype()
            device = first.device if first is not None else None
            coefficients = self.replayed(B, T, device, dtype)  # [B, T, K]
            return self._rebuilt(self._native(coefficients, B, T), args, kwargs)
        output = self.controller(*args, **kwargs)
        coefficients = self._coefficients(output, B, T)  # [B, T, K]
        self.__dict__["_produced_dtype"] = coefficients.dtype  # what replay feeds (Site._produced_dtype)
        if self.mode == "record":
            self.record(coefficients)
            if not self.rebuild_checked and self.declaration.rebuild is not None:
                self._check_rebuild(output, self._native(coefficients, B, T), args, kwargs)
        return output

    def _native(self, coefficients: torch.Tensor, B: int, T: int) -> torch.Tensor:
        dims = tuple(size for _, size in self.spec.axes)
        if self.declaration.token_layout == "flat":
            return coefficients.reshape(B * T, *dims)  # [B * T, *axes]
        return coefficients.reshape(B, T, *dims)  # [B, T, *axes]

    def _rebuilt(self, native: torch.Tensor, args: tuple, kwargs: dict) -> Any:
        rebuild = self.declaration.rebuild
        if rebuild is None:
            return native
        if self.declaration.rebuild_call:
            return rebuild(native, self.controller, SiteCall(args, kwargs, *self.model_call))
        return rebuild(native, self.controller)

    def _check_rebuild(self, output: Any, native: torch.Tensor, args: tuple, kwargs: dict) -> None:
        """SiteDeclarationError unless rebuild, given the coefficients just recorded, returns the module's output
        bit for bit: else Correct replay would differ from the live run with no word of which site is why."""
        with torch.no_grad():
            rebuilt = self._rebuilt(native.clone(), args, kwargs)
        where, diff = _largest_difference(output, rebuilt)
        if diff != 0.0:
            raise SiteDeclarationError(
                f"site {self.site_name!r}: rebuild does not reproduce the module's output ({where}: max |diff| "
                f"{diff:.3g}); rebuild must return exactly what the module returns, from the recorded "
                "coefficients alone (the same operations, dtypes and casts), or replay cannot be exact"
            )
        self.__dict__["rebuild_checked"] = True

    def _projection_forward(self, B: int, T: int, args: tuple, kwargs: dict) -> Any:
        if self.mode == "live":
            return self.controller(*args, **kwargs)
        K = self.spec.num_channels
        replaced = None  # recording: the projection runs, and what it returns is recorded
        if self.mode == "replay":
            # (the dtype the projection produced when it last ran, else its inputs' result type: set in the mode)
            replaced = self.replayed(B, T, None, self._produced_dtype or torch.float32)  # [B, T, K]
        with _ProjectionCall(self, K, replaced) as call:
            output = self.controller(*args, **kwargs)
        if call.seen is None:
            raise SiteDeclarationError(
                f"site {self.site_name!r}: its module made no linear projection with {K} outputs (F.linear), so "
                "output=Projection() cannot read its coefficients; declare output= and rebuild= instead"
            )
        if replaced is None:
            self.record(call.seen.reshape(B, T, K))  # [B, T, K]
        return output

    def _current_batch_shape(self, first: torch.Tensor | None) -> tuple[int, int]:
        if self.batch_shape is not None:
            return self.batch_shape
        if self.declaration.token_layout == "batched" and first is not None and first.dim() >= 2:
            return first.shape[0], first.shape[1]
        raise SiteDeclarationError(
            f"site {self.site_name!r}: the batch shape (B, T) is unknown; call the model that attach_sites adapted "
            "(its pre-hook records B and T from input_ids), not a submodule"
        )

    def _coefficients(self, output: Any, B: int, T: int) -> torch.Tensor:
        """The coefficient tensor out of the module's output, checked against the spec, as [B, T, K]."""
        how = self.declaration.output
        try:
            if how is None:
                picked = output
            elif isinstance(how, int):
                picked = output[how]
            elif isinstance(how, str):
                picked = getattr(output, how) if hasattr(output, how) else output[how]
            else:
                picked = how(output)
        except (IndexError, KeyError, TypeError) as err:
            raise SiteDeclarationError(
                f"site {self.site_name!r}: output={how!r} cannot be read from the module's output "
                f"{_describe(output)} ({err})"
            ) from None
        K = self.spec.num_channels
        lead = (B * T,) if self.declaration.token_layout == "flat" else (B, T)
        # The trailing dims must be the axes' sizes, not merely hold K values: replay hands the module's
        # consumer (or `rebuild`) [.., *axes], so a [B, T, 4, 1] output declared as (("head", 4),) would be
        # replayed as [B, T, 4], which broadcasts differently or not at all.
        dims = tuple(size for _, size in self.spec.axes)
        per_token = isinstance(picked, torch.Tensor) and tuple(picked.shape[: len(lead)]) == lead
        if not per_token or tuple(picked.shape[len(lead) :]) != dims:
            extra = list(picked.shape[len(lead) :]) if per_token else None
            trailing = (
                " (one scalar per token: declare axes=())"
                if extra == []
                else f" (declare axes for each of its dims {extra})"
                if extra is not None and math.prod(extra) == K
                else f" (coefficients are recorded per token: the output must begin with {list(lead)}; per-sequence "
                "or pooled coefficients are not supported)"
                if isinstance(picked, torch.Tensor) and not per_token
                else ""
            )
            raise SiteDeclarationError(
                f"site {self.site_name!r}: the coefficient {_describe(picked)} does not fit "
                f"token_layout={self.declaration.token_layout!r} (leading dims {list(lead)} for B={B}, T={T}) and "
                f"axes {self.spec.axes} (trailing dims {list(dims)}){trailing}; the module returned "
                f"{_describe(output)}"
                + (
                    "; set output= to pick the coefficient tensor"
                    if how is None and not isinstance(output, torch.Tensor)
                    else ""
                )
            )
        return picked.reshape(B, T, K)  # [B, T, K]


def _largest_difference(a: Any, b: Any, where: str = "output") -> tuple[str, float]:
    """(where, max |a - b|) over the tensors of two module outputs of one structure; inf where they differ
    in structure, shape or dtype, 0.0 where they are identical."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.shape != b.shape:
            return f"{where} {_describe(a)} against {_describe(b)}", math.inf
        if a.dtype != b.dtype:
            return f"{where} {a.dtype} against {b.dtype}", math.inf
        if torch.equal(a, b):
            return where, 0.0
        if not a.is_floating_point():
            return where, math.inf
        diff = (a.double() - b.double()).abs().nan_to_num(nan=math.inf)
        return where, float(diff.max()) if diff.numel() else 0.0
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        if len(a) != len(b):
            return f"{where} {_describe(a)} against {_describe(b)}", math.inf
        worst = (where, 0.0)
        for i, (x, y) in enumerate(zip(a, b)):
            found = _largest_difference(x, y, f"{where}[{i}]")
            if found[1] > worst[1]:
                worst = found
        return worst
    return (where, 0.0) if a is b or a == b else (f"{where} {_describe(a)} against {_describe(b)}", math.inf)


class _ProjectionCall(torch.overrides.TorchFunctionMode):
    """Inside one call of a `Projection` site's module: the `F.linear` with `size` outputs is its projection.
    Recording, it runs and its output is kept (`seen`); replaying, it is answered by `replaced` [B, T, K]
    in the projection's own leading shape and dtype, and never computed."""

    def __init__(self, site: ModuleSite, size: int, replaced: torch.Tensor | None) -> None:
        super().__init__()
        self.site, self.size, self.replaced = site, size, replaced
        self.seen: torch.Tensor | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F_LINEAR:
            return func(*args, **kwargs)
        x = args[0] if args else kwargs["input"]
        weight = args[1] if len(args) > 1 else kwargs["weight"]
        if weight.dim() != 2 or weight.shape[0] != self.size:
            return func(*args, **kwargs)
        if self.seen is not None:
            raise SiteDeclarationError(
                f"site {self.site.site_name!r}: its module makes more than one linear projection with {self.size} "
                "outputs, so output=Projection() cannot tell which is the coefficient; declare output= and rebuild="
            )
        if self.replaced is None:
            self.seen = func(*args, **kwargs)  # [..., K]
            self.site.__dict__["_produced_dtype"] = self.seen.dtype
            return self.seen
        dtype = torch.result_type(x, weight)
        self.seen = self.replaced.to(device=x.device, dtype=dtype).reshape(*x.shape[:-1], self.size)  # [..., K]
        return self.seen


def _hide_controller_keys(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    inner = prefix + "controller."
    for key in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + key[len(inner) :]] = state_dict.pop(key)


def _restore_controller_keys(module: nn.Module, state_dict: dict, prefix: str, *_: Any) -> None:
    inner = prefix + "controller."
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + key[len(prefix) :]] = state_dict.pop(key)


def _matches(path: list[str], parts: list[str]) -> bool:
    return all(fnmatchcase(n, p) for n, p in zip(path, parts))


def match_modules(model: nn.Module, pattern: str) -> list[str]:
    """Paths of the modules matching `pattern`, one glob per dotted component, in module-tree order (a
    compiled model's paths are its original module's, as its site names are)."""
    parts = pattern.split(".")
    model = unwrapped(model)
    return [
        name
        # Every path, also a second one to a module reached twice: a controller shared by the blocks is
        # one site per block (its calls are separate uses), not one site for the first block only.
        for name, _ in model.named_modules(remove_duplicate=False)
        if name and len(name.split(".")) == len(parts) and _matches(name.split("."), parts)
    ]


def candidate_paths(model: nn.Module, pattern: str, limit: int = 8) -> list[str]:
    """Module paths a user probably meant by `pattern`, nearest in structure first, then in spelling.

    1. Every module of the pattern's depth that matches all its components but one, one path per
       differing name (`blocks.*.gate` -> `blocks.0.controller`); these are never cut by `limit`, since
       a controller misnamed in the pattern is exactly such a module.
    2. The children of the deepest prefix of the pattern that does match (the alternatives at the first
       component that fails), then the children of the prefix one shorter (the failing component's
       parent's siblings), one path per child name, from the first matching parent.
    3. Close spellings of the whole pattern, then modules named like controllers (gate, router, controller).
    Groups 2 and 3 fill up to `limit` entries in all, one path per shape: `blocks.9.gate` adds nothing
    after `blocks.0.gate`, since a number component is an index into a module list.
    """
    parts = pattern.split(".")
    names = [name for name, _ in unwrapped(model).named_modules() if name]
    split = {name: name.split(".") for name in names}

    fits: dict[tuple[int, str], str] = {}  # (differing position, name there) -> first such path
    for name, path in split.items():
        if len(path) == len(parts):
            misses = [i for i, (n, p) in enumerate(zip(path, parts)) if not fnmatchcase(n, p)]
            if len(misses) == 1:
                fits.setdefault((misses[0], path[misses[0]]), name)

    depth = max(
        (
            m
            for m in range(len(parts))
            if any(len(path) > m and _matches(path[:m], parts[:m]) for path in split.values())
        ),
        default=0,
    )
    siblings: dict[tuple[int, str], str] = {}  # (level, child name) -> first path
    for level in (depth, depth - 1):
        for name, path in split.items():
            if level >= 0 and len(path) == level + 1 and _matches(path[:level], parts[:level]):
                siblings.setdefault((level, path[-1]), name)

    close = difflib.get_close_matches(pattern.replace("*", "0"), names, n=limit, cutoff=0.6)
    controller_like = [n for n in names if re.search(r"gate|router|controller", split[n][-1], re.IGNORECASE)]
    kept = list(fits.values())
    shapes = {_shape(split[n]) for n in kept}
    extra = []
    for name in [*siblings.values(), *close, *controller_like]:
        if _shape(split[name]) not in shapes:
            shapes.add(_shape(split[name]))
            extra.append(name)
    return kept + extra[: max(limit - len(kept), 0)]


def _shape(path: list[str]) -> tuple[str, ...]:
    return tuple("#" if n.isdigit() else n for n in path)


def _resolve_axes(declaration: SiteDeclaration, module: nn.Module, path: str) -> Axes:
    axes = declaration.axes
    if callable(axes):
        try:
            axes = axes(module)
        except (AttributeError, TypeError) as err:
            raise SiteDeclarationError(f"{path}: axes could not be read from {type(module).__name__} ({err})") from None
        check_axes(axes, path)
    return tuple((name, int(size)) for name, size in axes)


def _resolve_channel_families(
    declaration: SiteDeclaration, module: nn.Module, path: str, axes: Axes
) -> tuple[str, ...] | None:
    families = declaration.channel_families
    if families is None:
        return None
    if callable(families):
        families = families(module)
    K = math.prod(size for _, size in axes)
    if isinstance(families, str) or len(families) != K or not all(isinstance(f, str) and f for f in families):
        raise SiteDeclarationError(
            f"{path}: channel_families must name one non-empty family per channel ({K} channels), got {families!r}"
        )
    return tuple(families)


def _record_batch_shape(sites: Sequence[ModuleSite], module: nn.Module, args: tuple, kwargs: dict) -> None:
    ids = kwargs.get("input_ids")
    if ids is None:
        ids = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("inputs_embeds")
    shape = (ids.shape[0], ids.shape[1]) if isinstance(ids, torch.Tensor) and ids.dim() >= 2 else None
    for site in sites:
        site.__dict__.update(batch_shape=shape, model_call=(args, kwargs))


def _forget_batch_shape(sites: Sequence[ModuleSite], *_: Any) -> None:
    for site in sites:
        site.__dict__.update(batch_shape=None, model_call=((), {}))


def attach_sites(
    model: nn.Module,
    declarations: Sequence[SiteDeclaration],
    *,
    blocks: str | None = None,
    output: OutputSelector | None = None,
) -> nn.Module:
    """Swap every module matched by a declaration for a `ModuleSite` wrapping it; returns `model`.

    `blocks` optionally names the module list of the model's blocks (e.g. `model.layers`); the model
    then offers `model.fca_blocks()` for the execution audit. `output` says where the logits sit when
    the model returns neither a tensor nor an object with `.logits`: an index into a tuple (`0`), a key
    or attribute name (`"logits"`), or a function of the output; it is kept as `model.fca_output` and
    read by `fca.engine.sites.model_logits`. A declaration that matches nothing, or matches a module
    inside another matched module, raises `SiteDeclarationError` listing candidates. A compiled model
    (`torch.compile(model)`) is adapted through its original module, so paths, site names and weight names
    are the uncompiled model's; it is `model` that is returned, and its forward passes stay compiled.
    """
    compiled, model = model, unwrapped(model)
    # Every declaration is checked before any module is swapped, so an error leaves the model as it was.
    planned: dict[str, tuple[nn.Module, SiteDeclaration, SiteSpec]] = {}
    slots: dict[tuple[int, str], str] = {}  # (id of the parent module, attribute) -> the first path to it
    for declaration in declarations:
        paths = match_modules(model, declaration.path)
        if not paths:
            candidates = candidate_paths(model, declaration.path)
            raise SiteDeclarationError(
                f"no module of {type(model).__name__} matches {declaration.path!r}; candidates: {', '.join(candidates)}"
            )
        for path in paths:
            module = model.get_submodule(path)
            if isinstance(module, Site):
                raise SiteDeclarationError(f"{path} is already a controller site")
            if any(path == c or path.startswith(c + ".") or c.startswith(path + ".") for c in planned):
                raise SiteDeclarationError(f"{path} is declared twice, or nested with another declared site")
            parent, _, leaf = path.rpartition(".")
            slot = (id(model.get_submodule(parent)), leaf)
            if slot in slots:
                raise SiteDeclarationError(
                    f"{path} and {slots[slot]} are one attribute of one shared parent module, so they cannot be "
                    "told apart as two sites; give each use its own parent module"
                )
            slots[slot] = path
            axes = _resolve_axes(declaration, module, path)
            spec = SiteSpec(
                axes=axes,
                family=declaration.family,
                coefficient=declaration.coefficient,
                channel_families=_resolve_channel_families(declaration, module, path, axes),
            )
            planned[path] = (module, declaration, spec)
    if blocks is not None:  # fail now, not in the execution audit
        try:
            model.get_submodule(blocks)
        except AttributeError:
            candidates = candidate_paths(model, blocks)
            raise SiteDeclarationError(
                f"blocks={blocks!r}: no module of {type(model).__name__} is there; candidates: {', '.join(candidates)}"
            ) from None
    new_sites: list[ModuleSite] = []
    for path, (module, declaration, spec) in planned.items():
        site = ModuleSite(module, spec, declaration)
        parent, _, leaf = path.rpartition(".")
        setattr(model.get_submodule(parent), leaf, site)  # (get_submodule("") is the model)
        new_sites.append(site)
    # Kept on the model so that `detach_sites` can remove them; always_call clears the batch shape
    # even when the forward raises, so a stale (B, T) never shapes a later call.
    hooks = getattr(model, "fca_adapter_hooks", [])
    hooks.append(model.register_forward_pre_hook(partial(_record_batch_shape, new_sites), with_kwargs=True))
    hooks.append(model.register_forward_hook(partial(_forget_batch_shape, new_sites), always_call=True))
    model.fca_adapter_hooks = hooks
    if blocks is not None:
        model.fca_blocks = partial(model.get_submodule, blocks)  # (the module list; default_blocks lists it)
    if output is not None:
        model.fca_output = output
    assign_site_names(model)
    return compiled


def detach_sites(model: nn.Module) -> nn.Module:
    """Undo `attach_sites`: put every wrapped module back in place and remove the hooks."""
    compiled, model = model, unwrapped(model)
    for name, module in list(model.named_modules()):
        if isinstance(module, ModuleSite):
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, module.controller)
    for hook in getattr(model, "fca_adapter_hooks", []):
        hook.remove()
    model.fca_adapter_hooks = []
    vars(model).pop("fca_output", None)  # only the instance's: a selector the class declares stays
    return compiled
