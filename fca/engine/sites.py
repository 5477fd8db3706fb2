"""Controller sites: the named places where controller coefficients enter a model's computation.

A `Site` wraps a controller module. Its output is the coefficient tensor the model consumes,
shaped `[B, T, K]` (batch, positions, channels). Each site is in one of three modes:

- `live`: run the controller and return its coefficients;
- `record`: the same, and hand the coefficients to a sink (`sink[name] = tensor`);
- `replay`: do **not** call the controller; return coefficients from a provider instead.

Modes are only ever changed inside `site_modes(...)`, a context manager that restores every site in
`finally`, so an exception during a replay never leaves a model half-frozen.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from fca.tables.errors import SiteError
from fca.tables.spec import SiteSpec

Mode = Literal["live", "record", "replay"]
_PASS_LOCK = threading.Lock()
# A provider gives the replay coefficients of one site for the current batch: (site, B, T) -> [B, T, K]
# or anything broadcastable to it (e.g. a static profile of shape [K]).
Provider = Callable[["Site", int, int], torch.Tensor]


class Site(nn.Module):
    """A controller wrapped as a named intervention point.

    `controller(x)` maps the site input to coefficients `[B, T, K]`. In replay mode the controller
    is never called: the coefficients come from the provider, and `x` is only used for its batch
    shape, device and dtype, never for its values.
    """

    def __init__(self, controller: nn.Module | Callable[..., torch.Tensor], spec: SiteSpec) -> None:
        super().__init__()
        self.controller = controller
        self.spec = spec
        self.site_name = ""  # filled in by `assign_site_names`, from the module tree
        self.mode: Mode = "live"
        self._sink: MutableMapping[str, torch.Tensor] | None = None
        self._provider: Provider | None = None
        self._in_pass = False  # inside a `site_modes` block: no other pass may set its mode meanwhile
        self._used_in_pass = False  # recorded or replayed in the current pass (see `_check_once_per_pass`)
        # The dtype the controller produced when it last ran, which replay feeds: a float32 router in a
        # bfloat16 model hands float32 values on, and fed them rounded to the model's dtype, its replay
        # differs. Unknown (None) until the controller has run, and after the model changes dtype or device.
        self._produced_dtype: torch.dtype | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: the controller's input [B, T, ...]."""
        if self.mode == "replay":
            return self.replayed(x.shape[0], x.shape[1], x.device, x.dtype)
        coefficients = self.controller(x)  # [B, T, K]
        self.__dict__["_produced_dtype"] = coefficients.dtype  # (past nn.Module.__setattr__, as in _set_mode)
        if self.mode == "record":
            self.record(coefficients)
        return coefficients

    def replayed(self, B: int, T: int, device, dtype: torch.dtype) -> torch.Tensor:
        """The provider's coefficients for this call as a contiguous [B, T, K] tensor of its own, in the dtype
        the controller produced when it last ran, else in `dtype` (the site input's).

        Its own: the model may write into what its controller returned (`gate.sigmoid_()`), which must
        neither change the caller's arrays nor meet a broadcast view of a profile."""
        self._check_once_per_pass()
        given = self._provider(self, B, T)
        if not given.is_floating_point():  # bool, integer or complex values would be cast without a word
            raise ValueError(f"site {self.site_name!r}: replay coefficients must be floating point, not {given.dtype}")
        coefficients = given.to(device=device, dtype=self._produced_dtype or dtype)
        try:
            coefficients = coefficients.expand(B, T, self.spec.num_channels)  # [B, T, K]
        except RuntimeError:
            raise ValueError(
                f"site {self.site_name!r}: replay coefficients of shape {list(coefficients.shape)} do not broadcast "
                f"to this call's [B, T, K] = {[B, T, self.spec.num_channels]}"
            ) from None
        # Compiled (torch.compile), always a copy: dynamo cannot trace `data_ptr`, so asking whether the
        # tensor shares the caller's storage broke the graph at every replayed site.
        if torch.compiler.is_compiling() or not coefficients.is_contiguous() or _shares_storage(coefficients, given):
            coefficients = coefficients.clone(memory_format=torch.contiguous_format)
        return coefficients

    def record(self, coefficients: torch.Tensor) -> None:
        """Hand a copy of this call's coefficients [B, T, K] to the pass's sink: the model may still write
        into the tensor it was given (`gate.sigmoid_()`), and the sink must keep what the controller made."""
        self._check_once_per_pass()
        self._sink[self.site_name] = coefficients.detach().clone()

    def _check_once_per_pass(self) -> None:
        """A site runs once per pass: recorded twice, the second call would overwrite the first one's values;
        replayed twice, both calls would be fed one call's coefficients."""
        if self._used_in_pass:
            raise ValueError(
                f"site {self.site_name!r} ran twice in one forward pass; FCA records one coefficient tensor per "
                "site and pass, so a controller used twice must be declared as two modules (one per use)"
            )
        self.__dict__["_used_in_pass"] = True

    def _set_mode(self, mode: Mode, sink, provider, in_pass: bool) -> None:
        # Plain attributes, set past nn.Module.__setattr__ and its checks for parameters, buffers and
        # modules (none of these is one): site_modes sets them on every site twice per pass.
        self.__dict__.update(mode=mode, _sink=sink, _provider=provider, _in_pass=in_pass, _used_in_pass=False)

    def _apply(self, fn, *args, **kwargs):
        # `.to()`, `.half()`, `.cuda()`: what the controller produced before says nothing of what it will,
        # unless the move changed none of its parameters (`.cpu()` of a CPU model, `.to()` of its own dtype).
        before = [(p.dtype, p.device) for p in self.parameters()]
        module = super()._apply(fn, *args, **kwargs)
        if not before or before != [(p.dtype, p.device) for p in self.parameters()]:
            self.__dict__["_produced_dtype"] = None
        return module

    def extra_repr(self) -> str:
        return f"name={self.site_name!r}, K={self.spec.num_channels}, family={self.spec.family!r}"


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def unwrapped(model: nn.Module) -> nn.Module:
    """The module `torch.compile(model)` wraps (through any number of such wrappers), else `model` itself.

    The wrapper (dynamo's `OptimizedModule`) holds the original as its child `_orig_mod`, so its module
    tree and state dict name everything `_orig_mod.<name>`: site names, weight names and the fingerprint
    are taken from the original instead, and are the uncompiled model's. Only the forward pass goes
    through the wrapper. Torch offers no public test for the wrapper; a model can only be one once
    `torch._dynamo` has been imported, so nothing is imported here (a second of import time otherwise)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    while eval_frame is not None and isinstance(model, eval_frame.OptimizedModule):
        model = model._orig_mod
    return model


def model_class_name(model: nn.Module) -> str:
    """The model's class name in messages and records: a compiled model's is its original module's, not
    `OptimizedModule`."""
    return type(unwrapped(model)).__name__


def assign_site_names(model: nn.Module) -> None:
    """Name every site after its path in the module tree (e.g. `blocks.3.gate`) now, as each pass's
    `find_sites` does, so that a model's sites have their names before its first pass."""
    find_sites(model)


def find_sites(model: nn.Module) -> dict[str, Site]:
    """All sites of a model, by name, in registration order (which our models keep equal to execution
    order), with names built only for the sites. Every record and replay pass walks the tree once, and
    where the host's time per op is the pass's time (a small model on a GPU) that walk shows in the
    replay/live ratio: hence a walk over `_modules` rather than `named_modules()`, which names every module."""
    model = unwrapped(model)  # a compiled model's sites are named as the uncompiled model's
    found: dict[str, Site] = {}
    seen = {id(model)}
    if isinstance(model, Site):
        found[""] = model

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module._modules.items():
            if child is None or id(child) in seen:  # a module reached twice keeps its first name
                continue
            seen.add(id(child))
            path = prefix + name
            if isinstance(child, Site):
                found[path] = child
            if child._modules:
                visit(path + ".", child)

    visit("", model)
    for name, site in found.items():
        if site.site_name != name:
            site.site_name = name
    return found


def controller_parameters(model: nn.Module) -> int:
    """Parameters the model's controllers compute with, each counted once (a controller may be shared by
    several sites, or be a callable over parameters the model keeps elsewhere and offers `parameters()`)."""
    sizes: dict[int, int] = {}
    for site in find_sites(model).values():
        owned = site.controller.parameters() if hasattr(site.controller, "parameters") else site.parameters()
        sizes.update((id(p), p.numel()) for p in owned)
    return sum(sizes.values())


def site_specs(model: nn.Module) -> dict[str, SiteSpec]:
    return {name: site.spec for name, site in find_sites(model).items()}


@contextmanager
def site_modes(
    model: nn.Module,
    mode: Mode,
    *,
    sink: MutableMapping[str, torch.Tensor] | None = None,
    provider: Provider | None = None,
    only: set[str] | None = None,
) -> Iterator[dict[str, Site]]:
    """Put the sites of `model` (or just those named in `only`) into `mode` for the enclosed block.

    Every site is restored to `live` (with no sink or provider) on exit, even on error.

    One pass at a time per model: a site's mode is the model's state, so a second pass over the same
    sites while one is under way (from another thread, or from inside this block) would record into the
    first one's sink or replay its coefficients. That second pass is refused with a RuntimeError.
    """
    sites = find_sites(model)
    if not sites:
        raise ValueError(f"{model_class_name(model)} has no controller sites")
    if model.training:  # dropout would make the live pass and its replay differ by chance
        raise ValueError(
            f"{model_class_name(model)} is in training mode; call model.eval() before recording or replaying"
        )
    if only is not None:
        unknown = sorted(set(only) - set(sites))
        if unknown:
            raise SiteError(f"unknown site(s) {unknown}; the model has {list(sites)}")
    if mode == "record" and sink is None:
        raise ValueError("record mode needs a sink")
    if mode == "replay" and provider is None:
        raise ValueError("replay mode needs a provider")
    chosen = {n: s for n, s in sites.items() if only is None or n in only}
    with _PASS_LOCK:  # (checking that every site is free and taking them is one step)
        busy = next((name for name, site in sites.items() if site._in_pass), None)
        if busy is not None:
            raise RuntimeError(
                f"{model_class_name(model)}: site {busy!r} is already in a record or replay pass (another "
                "thread's, or one this pass was started inside); run one pass at a time per model object"
            )
        for site in sites.values():
            site.__dict__["_in_pass"] = True  # (as in `Site._set_mode`)
    try:
        for site in chosen.values():
            site._set_mode(mode, sink, provider, True)
        yield chosen
    finally:
        for site in sites.values():
            site._set_mode("live", None, None, False)


@contextmanager
def forward_pre_hooks(hooks: Iterable[tuple[nn.Module, Callable]]) -> Iterator[None]:
    """Each (module, hook) pair's hook called before the module's forward, as `hook(module, args, kwargs)`,
    within the block; removed on exit, also on error."""
    handles = [module.register_forward_pre_hook(hook, with_kwargs=True) for module, hook in hooks]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def as_input_ids(input_ids, model: nn.Module) -> torch.Tensor:
    """Token ids [B, T] as a long tensor on the model's device."""
    device = next(model.parameters()).device
    if input_ids is None:
        raise ValueError("input_ids must be token ids [batch, positions], not None")
    ids = torch.as_tensor(np.asarray(input_ids) if not isinstance(input_ids, torch.Tensor) else input_ids)
    if ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, positions], got shape {tuple(ids.shape)}")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"input_ids must be integer token ids, got {str(ids.dtype).replace('torch.', '')}")
    vocab = vocab_rows(model)
    if vocab is not None and ids.device.type == "cpu" and ids.numel():  # (on a GPU the check would wait for it)
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= vocab:
            raise ValueError(
                f"input_ids must lie in [0, {vocab}) for {model_class_name(model)}, got ids from {low} to {high}"
            )
    return ids.to(device=device, dtype=torch.long)


def run_model(model: nn.Module, ids: torch.Tensor) -> Any:
    """`model(ids)`, where an index out of range inside the model (token ids beyond an embedding that
    `vocab_rows` cannot find) is said in one line with the ids' range, not as torch's bare IndexError."""
    try:
        return model(ids)
    except IndexError as err:
        raise ValueError(
            f"{model_class_name(model)} raised IndexError ({str(err).splitlines()[0] if str(err) else 'no message'}) "
            f"on input ids from {int(ids.min())} to {int(ids.max())}: ids beyond its embedding? (a model with "
            "get_input_embeddings() or config.vocab_size has them checked before the pass)"
        ) from None


def vocab_rows(model: nn.Module) -> int | None:
    """Rows of the model's input embedding (else its config's vocab_size); None when it has neither."""
    try:
        embedding = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        embedding = None
    if isinstance(embedding, nn.Embedding):
        return embedding.num_embeddings
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    return size if isinstance(size, int) and size > 0 else None


# Where the logits sit in a model's output when it is neither a tensor nor has `.logits`: an index
# into a tuple, a key or attribute name, or a function of the output. Declared once per model, as the
# attribute `fca_output` (`attach_sites(..., output=0)` sets it; a model class may set it itself).
OutputSelector = int | str | Callable[[Any], torch.Tensor]


def model_logits(output: Any, model: nn.Module | None = None) -> torch.Tensor:
    """Logits [B, T, V] from `model`'s output: a tensor, an object with `.logits`, or whatever the
    model's declared selector (`model.fca_output`) picks out of a tuple, list or dict."""
    selector = getattr(model, "fca_output", None)
    if selector is None:
        if isinstance(output, torch.Tensor):
            return output
        if hasattr(output, "logits"):
            return output.logits
        raise TypeError(
            f"the model returned a {type(output).__name__}, not logits; declare where they are: "
            "attach_sites(model, ..., output=0) for a tuple's first item, output='logits' for a key or attribute"
        )
    try:
        if callable(selector):
            picked = selector(output)
        elif isinstance(selector, str) and not isinstance(output, Mapping):
            picked = getattr(output, selector)
        else:
            picked = output[selector]
    except (AttributeError, IndexError, KeyError, TypeError) as err:
        raise TypeError(
            f"the model's output selector {selector!r} does not fit its {type(output).__name__} output ({err})"
        ) from None
    if not isinstance(picked, torch.Tensor):
        raise TypeError(
            f"the model's output selector {selector!r} picked a {type(picked).__name__}, not a logits tensor"
        )
    return picked


@torch.no_grad()
def capture_tensors(model: nn.Module, input_ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One record pass. Returns (logits [B, T, V], site name -> coefficients [B, T, K_s])."""
    sink: dict[str, torch.Tensor] = {}
    with site_modes(model, "record", sink=sink):
        logits = model_logits(run_model(model, input_ids), model)
    return logits, sink


def tensor_provider(coefficients: Mapping[str, torch.Tensor]) -> Provider:
    """A provider serving fixed tensors, each broadcastable to the site's `[B, T, K]`."""

    def provide(site: Site, B: int, T: int) -> torch.Tensor:
        try:
            return coefficients[site.site_name]
        except KeyError:
            raise SiteError(f"no coefficients given for site {site.site_name!r}") from None

    return provide
