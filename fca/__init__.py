"""FCA: Frozen-Controller Auditing of dynamic neural networks.

Three layers, imports pointing down only (a test checks it):
    fca.tables  torch-free: cache store and manifest, statistics, profiles, conditions, reports, studies
    fca.engine  torch: controller sites, model families, record passes, replay, execution audit
    fca.jobs    what users run: build caches, audits, replay runs, benches, training, the demo
`fca.cli` and the dashboard (`app/`) sit on top.

The public API is loaded on first use, so tools that only read caches and reports (the dashboard's
first page, say) never pay for importing torch:
    load_model(path)                       a model directory of any supported family
    attach_sites(model, ...)               declare the controller sites of your own model
    capture(model, ids), replay(model, ids, coefficients)
    build_cache(model, windows, out)       a cache of any adapted model held in memory
    open_cache(path)
    audit(model, cache, calibration)       the three-property report (model: a directory or a module)
    Experiment.open(model, cache, calibration)  replay runs (`fca.jobs.runs.run_replay(..., experiment=)`)
    Condition(kind, alpha, sites), SiteDeclaration(path, axes, family)
    Family(model_type, load=...), register_family(family)   what FCA knows of an architecture
    load_family_file(path)                 run a family file (a module declaring FAMILY or FAMILIES)
"""

import importlib

__version__ = "0.1.0"  # the package version (pyproject.toml reads it from here); manifests record it

# name -> (module, attribute)
_API = {
    "load_model": ("fca.engine.loading", "load_model"),
    "attach_sites": ("fca.engine.adapters", "attach_sites"),
    "capture": ("fca.engine.capture", "capture"),
    "replay": ("fca.engine.replay", "replay"),
    "build_cache": ("fca.jobs.build", "build_cache"),
    "open_cache": ("fca.tables.store", "open_cache"),
    "audit": ("fca.jobs.audit", "run_audit"),
    "Experiment": ("fca.jobs.experiment", "Experiment"),
    "Condition": ("fca.tables.conditions", "Condition"),
    "AuditReport": ("fca.tables.audit_report", "AuditReport"),
    "read_report": ("fca.tables.report", "read_report"),
    "SiteDeclaration": ("fca.engine.adapters", "SiteDeclaration"),
    "Family": ("fca.engine.family", "Family"),
    "register_family": ("fca.engine.families", "register_family"),
    "load_family_file": ("fca.engine.user_families", "load_family_file"),
}
__all__ = list(_API)


def __getattr__(name: str):
    if name in _API:
        module, attribute = _API[name]
        value = getattr(importlib.import_module(module), attribute)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:  # the lazy API too, for completion in notebooks and shells
    return sorted({*globals(), *_API})
