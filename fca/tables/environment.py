"""Where coefficients are computed: the numeric environment of a forward pass.

Floating-point results depend on the order of reductions, which depends on the device, its kernels
(CPU vector width such as AVX2 or AVX-512, the GPU model), the torch build, the thread count and the
model's dtype. A cache's manifest records the environment that wrote it, so a replay elsewhere can say
"computed on X, replayed on Y" and judge the cache's fidelity by the right standard (see fidelity.py).
"""

from __future__ import annotations

import platform
from functools import lru_cache

# The fields that decide whether two environments compute bit-identical results. Anything not listed
# here (the batch size of a build, say) is recorded for the reader but compared separately.
IDENTITY_FIELDS = ("device_type", "device_name", "capability", "model_dtype", "torch", "cuda", "threads")


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


def model_dtype_name(model) -> str:
    """'float32', 'bfloat16', ...: the dtype of a torch module's parameters, as manifests write it."""
    return str(next(model.parameters()).dtype).replace("torch.", "")


def current_environment(model) -> dict:
    """The environment `model` (a torch module) computes in now: device, its name and capability, dtype,
    torch, threads. torch is imported here only, so describing a cache stays torch-free."""
    import torch

    param = next(model.parameters())
    device = param.device
    env = {"device_type": device.type, "model_dtype": model_dtype_name(model), "torch": torch.__version__,
           "cuda": torch.version.cuda if device.type == "cuda" else None}
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        env.update(device_name=torch.cuda.get_device_name(device), capability=f"sm_{major}{minor}", threads=None)
    else:
        env.update(device_name=_cpu_name(), capability=torch.backends.cpu.get_cpu_capability(), threads=torch.get_num_threads())
    return {key: env[key] for key in IDENTITY_FIELDS}


def same_environment(a: dict | None, b: dict | None) -> bool:
    """True when both environments are known and agree on every field that decides the arithmetic."""
    return bool(a) and bool(b) and all(a.get(k) == b.get(k) for k in IDENTITY_FIELDS)


def describe(env: dict | None) -> str:
    """One line for people: 'cpu AMD EPYC (AVX512, 2 threads), float32, torch 2.13.0'."""
    if not env:
        return "an unknown environment (the cache predates environment records)"
    if env.get("device_type") == "cuda":
        where = f"cuda {env.get('device_name')} ({env.get('capability')}, CUDA {env.get('cuda')})"
    else:
        where = f"{env.get('device_type')} {env.get('device_name')} ({env.get('capability')}, {env.get('threads')} threads)"
    return f"{where}, {env.get('model_dtype')}, torch {env.get('torch')}"
