"""Where coefficients are computed: the numeric environment of a forward pass.

Floating-point results depend on the order of reductions, which depends on the device, its kernels
(CPU vector width such as AVX2 or AVX-512, the GPU model), the torch build, the thread count and the
model's dtype. A cache's manifest records the environment that wrote it, so a replay elsewhere can say
"computed on X, replayed on Y" and judge the cache's fidelity by the right standard (see fidelity.py).
Torch-free: reading the current environment off a model lives in `fca.engine.environment`.
"""

from __future__ import annotations

# The fields that decide whether two environments compute bit-identical results, in words. Anything not
# listed here (the batch size of a build, say) is recorded for the reader but compared separately.
# `numerics`: settings that change kernels on the same device (float32 matmul precision, TF32, oneDNN's
# instruction-set limit): a build under ONEDNN_MAX_CPU_ISA=AVX2 on an AVX-512 machine differs from a replay
# without it in the last bits, so they are part of what must agree for bit-identical results.
LABELS = {
    "device_type": "device",
    "device_name": "device name",
    "capability": "CPU capability or GPU architecture",
    "model_dtype": "model dtype",
    "torch": "torch",
    "cuda": "CUDA",
    "threads": "threads",
    "numerics": "numeric settings",
}
IDENTITY_FIELDS = tuple(LABELS)


def check_environment(env: object) -> None:
    """ValueError unless `env` is an environment record: an object of plain values, its
    thread and batch counts whole numbers of at least 1."""
    if env is None:
        return
    if not isinstance(env, dict) or not all(isinstance(v, (str, int, float, type(None))) for v in env.values()):
        raise ValueError(f"'environment' must be an object of names, numbers or null, not {str(env)[:80]!r}")
    for key in ("threads", "batch_size"):
        if env.get(key) is not None and (not isinstance(env[key], int) or isinstance(env[key], bool) or env[key] < 1):
            raise ValueError(f"environment {key!r} must be a whole number of at least 1 or null, not {env[key]!r}")


def differing_fields(a: dict | None, b: dict | None) -> list[str]:
    """The identity fields on which two known environments differ, in words (empty if either is unknown)."""
    if not a or not b:
        return []
    return [LABELS[k] for k in IDENTITY_FIELDS if a.get(k) != b.get(k)]


def same_environment(a: dict | None, b: dict | None) -> bool:
    """True when both environments are known and agree on every field that decides the arithmetic."""
    return bool(a) and bool(b) and not differing_fields(a, b)


def describe(env: dict | None) -> str:
    """One line for people: 'cpu AMD EPYC (AVX512, 2 threads), float32, torch 2.13.0'."""
    if not env:
        return "an unknown environment (the cache predates environment records)"
    if env.get("device_type") == "cuda":
        where = f"cuda {env.get('device_name')} ({env.get('capability')}, CUDA {env.get('cuda')})"
    else:
        threads = env.get("threads")
        where = (
            f"{env.get('device_type')} {env.get('device_name')} ({env.get('capability')}, "
            f"{threads} thread{'' if threads == 1 else 's'})"
        )
    numerics = f", {env['numerics']}" if env.get("numerics") not in (None, "default") else ""
    return f"{where}, {env.get('model_dtype')}{numerics}, torch {env.get('torch')}"
