"""The environment a model computes in now, read off the torch module: the engine half of
`fca.tables.environment`, which describes and compares recorded environments without torch."""

from __future__ import annotations

import os
import platform
import sys
from functools import lru_cache

import torch
from torch import nn

from fca.tables.environment import IDENTITY_FIELDS


@lru_cache(maxsize=1)
def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def model_dtype_name(model: nn.Module) -> str:
    """'float32', 'bfloat16', ...: the dtype of a torch module's parameters, as manifests write it."""
    return str(next(model.parameters()).dtype).replace("torch.", "")


def _setting(legacy, backend) -> bool | None:
    """A TF32 switch: the legacy flag, or, where torch refuses to read it (the newer `fp32_precision` API
    was used to set it) or warns, the newer API's value ("tf32" -> True); None when neither says."""
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return bool(legacy())
    except (RuntimeError, AttributeError):
        precision = getattr(backend, "fp32_precision", None)
        return None if precision in (None, "none") else precision == "tf32"


def numerics(device: torch.device) -> str:
    """The settings beside the device that change which kernels run ("default" when none does): float32
    matmul precision, TF32 on CUDA, oneDNN's instruction-set limit and precision on CPU."""
    settings = []
    try:  # torch refuses this legacy read once the per-backend fp32_precision API has been used
        precision = torch.get_float32_matmul_precision()
    except RuntimeError:
        precision = f"per backend ({getattr(torch.backends, 'fp32_precision', 'set')})"
    if precision != "highest":
        settings.append(f"float32 matmul precision {precision}")
    if device.type == "cuda":
        if _setting(lambda: torch.backends.cuda.matmul.allow_tf32, torch.backends.cuda.matmul) is True:
            settings.append("TF32 matmul")
        if _setting(lambda: torch.backends.cudnn.allow_tf32, torch.backends.cudnn) is False:
            settings.append("cuDNN TF32 off")
    else:
        isa = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA")
        if isa:
            settings.append(f"oneDNN ISA {isa}")
        if not torch.backends.mkldnn.enabled:
            settings.append("oneDNN off")
        precision = getattr(torch.backends.mkldnn, "fp32_precision", "none")
        if precision not in ("none", "ieee"):
            settings.append(f"oneDNN float32 precision {precision}")
    return ", ".join(settings) or "default"


def current_environment(model: nn.Module) -> dict:
    """The environment `model` computes in now: device, its name and capability, dtype, torch, threads and
    the numeric settings that choose kernels, among them the `torch.compile` backend a compiled model runs
    through. Inductor fuses operators into kernels of its own: on a CPU, the coefficients of a tiny
    FeatureGate compiled with it differed from the uncompiled model's by 1.2e-7, and a cache built
    uncompiled was refused as "not this model's output" in what its manifest recorded as this very
    environment. Compiled, the model computes in another one (eager and aot_eager were bit-identical)."""
    env = environment_on(next(model.parameters()).device, model_dtype_name(model))
    backend = compile_backend(model)
    if backend is not None:
        compiled = f"torch.compile {backend}"
        env["numerics"] = compiled if env["numerics"] == "default" else f"{env['numerics']}, {compiled}"
    return env


def compile_backend(model: nn.Module) -> str | None:
    """The backend a compiled model runs through ('inductor', 'aot_eager', 'eager', or a function's name):
    `torch.compile(model)`, or `model.compile()` (in place: no wrapper, the compiled call kept in
    `_compiled_call_impl`); None for a model compiled neither way. Read from torch's private objects, as
    torch offers no public way; a model can only be compiled once `torch._dynamo` is imported, so nothing is
    imported here."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is None:
        return None
    if isinstance(model, eval_frame.OptimizedModule):
        context = getattr(model, "dynamo_ctx", None)
    elif getattr(model, "_compiled_call_impl", None) is not None:
        # (the compiled call is dynamo's wrapper of the module's call, whose closure holds its context)
        cells = getattr(model._compiled_call_impl, "__closure__", None) or ()
        context = next((c.cell_contents for c in cells if hasattr(c.cell_contents, "callback")), None)
    else:
        return None
    try:
        backend = eval_frame.innermost_backend(context.callback)
    except (AttributeError, AssertionError):  # (another torch's objects: compiled, by an unknown backend)
        return "unknown backend"
    return str(getattr(backend, "compiler_name", None) or getattr(backend, "__name__", None) or type(backend).__name__)


def environment_on(device: torch.device, model_dtype: str) -> dict:
    """The environment a model of `model_dtype` ('float32', ...) would compute in on `device` now."""
    env = {
        "device_type": device.type,
        "model_dtype": model_dtype,
        "torch": torch.__version__,
        "cuda": torch.version.cuda if device.type == "cuda" else None,
        "numerics": numerics(device),
    }
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        env.update(device_name=torch.cuda.get_device_name(device), capability=f"sm_{major}{minor}", threads=None)
    else:
        env.update(
            device_name=_cpu_name(), capability=torch.backends.cpu.get_cpu_capability(), threads=torch.get_num_threads()
        )
    return {key: env[key] for key in IDENTITY_FIELDS}
