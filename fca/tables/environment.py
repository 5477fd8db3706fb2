"""Where coefficients are computed: the numeric environment of a forward pass.

Floating-point results depend on the order of reductions, which depends on the device, its kernels
(CPU vector width such as AVX2 or AVX-512, the GPU model), the torch build, the thread count and the
model's dtype. A cache's manifest records the environment that wrote it, so a replay elsewhere can say
"computed on X, replayed on Y" and judge the cache's fidelity by the right standard (see fidelity.py).
Torch-free: reading the current environment off a model lives in `fca.engine.environment`.
"""

from __future__ import annotations

# The fields that decide whether two environments compute bit-identical results. Anything not listed
# here (the batch size of a build, say) is recorded for the reader but compared separately.
IDENTITY_FIELDS = ("device_type", "device_name", "capability", "model_dtype", "torch", "cuda", "threads")


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
        where = (
            f"{env.get('device_type')} {env.get('device_name')} ({env.get('capability')}, {env.get('threads')} threads)"
        )
    return f"{where}, {env.get('model_dtype')}, torch {env.get('torch')}"
