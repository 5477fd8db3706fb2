"""The audit report as one typed schema: what `fca.jobs.audit` writes, `fca.tables.report` renders, and the
study, the CLI and the dashboard read. Torch-free.

`AuditReport.from_json(data, source)` checks a report's JSON form in one place and raises a one-line
`ReportError` naming the file and the field path that is wrong; `to_json()` gives back that JSON form.
A field a released report may lack (a report of an earlier audit, written with the same version) is None
here and left out of the JSON again; so is a part that is optional by design (no Dense twin, no routers,
no interpolation sweep, no training record).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

REPORT_VERSION = 1  # `fca_report_version` of the reports `fca.jobs.audit` writes


class ReportError(ValueError):
    """A file that is not a readable FCA audit report; the message is one line naming the file."""


class WrongField(ValueError):
    """A field of a report's JSON that is missing or of the wrong kind: its dotted path and what is wrong."""

    def __init__(self, path: str, what: str):
        super().__init__(f"{path} {what}")
        self.path, self.what = path, what


Check = Callable[[Any, str], Any]  # (JSON value, its dotted path) -> the value as the schema holds it


def _kind(value: object) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number"
    )


def _at(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _of_kind(kinds: type | tuple[type, ...], what: str) -> Check:
    """The check that a JSON value is of `kinds` (a boolean never passes for a number), kept as written (an
    int stays an int, so that the JSON comes back as it was written)."""

    def check(value: object, path: str) -> Any:
        if not isinstance(value, kinds) or isinstance(value, bool) and kinds is not bool:
            raise WrongField(path, f"is {_kind(value)}, not {what}")
        return value

    return check


# (A number may be NaN: a CI of too few sequences, in a report not yet written; JSON files hold null.)
number = _of_kind((int, float), "a number")
whole = _of_kind(int, "a whole number")
text = _of_kind(str, "a string")
flag = _of_kind(bool, "true or false")
obj = _of_kind(dict, "an object")  # a free-form object (an environment, a configuration) too


def nullable(check: Check) -> Check:
    return lambda value, path: None if value is None else check(value, path)


def mapping(check: Check) -> Check:
    """An object of name -> `check`ed value, in the order written."""

    def read(value: object, path: str) -> dict:
        return {key: check(item, _at(path, key)) for key, item in obj(value, path).items()}

    return read


def listing(check: Check) -> Check:
    def read(value: object, path: str) -> tuple:
        if not isinstance(value, list):
            raise WrongField(path, f"is {_kind(value)}, not a list")
        return tuple(check(item, f"{path}[{i}]") for i, item in enumerate(value))

    return read


def interval(value: object, path: str) -> tuple[float | None, float | None]:
    """A [low, high] pair of numbers; null ends: the undefined CI of too few sequences."""
    if not (isinstance(value, list) and len(value) == 2):
        raise WrongField(path, "is not a [low, high] pair")
    return listing(nullable(number))(value, path)


def part(check: Check) -> Any:
    """A field every report has, read by `check`."""
    return field(metadata={"check": check, "absent": False})


def optional(check: Check) -> Any:
    """A field a report may lack, read by `check`: None where its key is absent, and left out of the JSON."""
    return field(default=None, metadata={"check": check, "absent": True})


def derived(default: Any = None) -> Any:
    """A field read from other keys than its own (`Section._derive`)."""
    return field(default=default, metadata={"derived": True})


def _dump(value: Any) -> Any:
    if isinstance(value, Section):
        return value.to_json()
    if isinstance(value, (tuple, list)):
        return [_dump(v) for v in value]
    if isinstance(value, dict):
        return {k: _dump(v) for k, v in value.items()}
    return value


@dataclass(frozen=True, kw_only=True)
class Section:
    """A JSON object of known fields: each read by its `check`, an unknown one refused (a report of another
    form would not come back as it was written)."""

    @classmethod
    def read(cls, value: object, path: str = "") -> Section:
        data = obj(value, path)
        known = {f.name for f in fields(cls) if not f.metadata.get("derived")}
        unknown = next((key for key in data if key not in known), None)
        if unknown is not None:
            raise WrongField(_at(path, unknown), "is not a field of this FCA's audit report")
        values = {}
        for f in fields(cls):
            if f.metadata.get("derived"):
                continue
            if f.name not in data:
                if f.metadata["absent"]:
                    continue
                raise WrongField(_at(path, f.name), "is missing")
            values[f.name] = f.metadata["check"](data[f.name], _at(path, f.name))
        return cls(**cls._derive(data, values, path))

    @classmethod
    def _derive(cls, data: dict, values: dict, path: str) -> dict:
        """The values of fields not read from a key of their own (none by default)."""
        return values

    def to_json(self) -> dict:
        return {
            f.name: _dump(getattr(self, f.name))
            for f in fields(self)
            if not f.metadata.get("derived") and self._written(f.name, getattr(self, f.name), f.metadata["absent"])
        }

    def _written(self, name: str, value: Any, absent: bool) -> bool:
        """Whether a field's key is in the JSON: a field that may be absent is left out where None."""
        return not (absent and value is None)


@dataclass(frozen=True, kw_only=True)
class Model(Section):
    name: str = part(text)
    model_type: str = part(text)
    fingerprint: str = part(text)
    parameters: int = part(whole)
    controller_parameters: int = part(whole)
    dtype: str = part(text)
    device: str = part(text)
    # The configuration the caches record: a study compares it (released reports of early audits lack it).
    config: dict | None = optional(nullable(obj))


@dataclass(frozen=True, kw_only=True)
class CacheEntry(Section):
    """An evaluated or calibration cache as the audit read it. `split_seed`, `corpus_fingerprint` (and an
    evaluated cache's `documents`) are null where the cache does not record them; `origin_recorded` is
    False for the released reports written before entries carried the three (none of their keys there)."""

    path: str = part(text)
    fingerprint: str | None = part(nullable(text))
    split: str = part(text)
    split_seed: int | None = optional(nullable(whole))
    corpus: str | None = part(nullable(text))
    corpus_fingerprint: str | None = optional(nullable(text))
    sequences: int = part(whole)
    seq_len: int = part(whole)
    tokens: int = part(whole)
    coefficient_dtype: str = part(text)
    environment: dict | None = part(nullable(obj))
    origin_recorded: bool = derived(True)

    ORIGIN = ("split_seed", "corpus_fingerprint")

    @classmethod
    def _derive(cls, data: dict, values: dict, path: str) -> dict:
        recorded = cls.ORIGIN[0] in data
        wrong = next((key for key in cls.ORIGIN if (key in data) != recorded), None)
        if wrong is not None:  # (all of them or none)
            raise WrongField(_at(path, wrong), "is missing" if recorded else "is given without split_seed")
        return {**values, "origin_recorded": recorded}

    def _written(self, name: str, value: Any, absent: bool) -> bool:
        # (null where the cache does not record them, never left out, since the entry records them)
        return (self.origin_recorded and name in self.ORIGIN) or super()._written(name, value, absent)


@dataclass(frozen=True, kw_only=True)
class EvaluatedCache(CacheEntry):
    documents: int | None = optional(nullable(whole))  # the documents the windows lie in (null: not recorded)

    ORIGIN = ("split_seed", "corpus_fingerprint", "documents")


@dataclass(frozen=True, kw_only=True)
class CalibrationCache(CacheEntry):
    # What global_mean put at every coefficient of each family (released reports of early audits lack it).
    family_grand_means: dict[str, float] | None = optional(mapping(number))


@dataclass(frozen=True, kw_only=True)
class Dense(Section):
    name: str = part(text)
    fingerprint: str = part(text)
    parameters: int = part(whole)


@dataclass(frozen=True, kw_only=True)
class Fidelity(Section):
    """Cache fidelity: the cached coefficients against those the model records now."""

    computed_on: dict | None = part(nullable(obj))
    replayed_on: dict = part(obj)
    computed_on_text: str = part(text)
    replayed_on_text: str = part(text)
    same_environment: bool = part(flag)
    same_batches: bool = part(flag)
    differing_in_build_batches: int | None = optional(whole)
    max_abs_coefficient_diff: float = part(number)
    max_rel_coefficient_diff: float = part(number)
    differing_coefficients: int = part(whole)
    coefficients_compared: int = part(whole)
    per_site_max_abs_diff: dict[str, float] = part(mapping(number))
    stored_live_nll_max_diff: float = part(number)
    nll_live: float = part(number)
    nll_correct_from_cache: float = part(number)
    nll_diff: float = part(number)
    max_seq_nll_diff: float = part(number)
    coefficient_dtype: str = part(text)
    tolerances: dict[str, Any] = part(obj)
    differing_fields: tuple[str, ...] | None = optional(listing(text))
    verdict: str = part(text)


@dataclass(frozen=True, kw_only=True)
class CalibrationOrigin(Section):
    """Where the calibration cache's coefficients were computed (they are not replayed one by one)."""

    computed_on: dict | None = part(nullable(obj))
    computed_on_text: str = part(text)
    same_environment: bool = part(flag)
    differing_fields: tuple[str, ...] = part(listing(text))


@dataclass(frozen=True, kw_only=True)
class Exactness(Section):
    """Both exactness checks: the replay mechanism (`mechanism`, its diagnostics as written) and the cache's
    fidelity; `calibration`: where the calibration cache was computed (released reports of early audits
    lack it)."""

    max_abs_logit_diff: float = part(number)
    nll_live: float = part(number)
    nll_correct: float = part(number)
    tolerance: float = part(number)
    mechanism: dict = part(obj)
    fidelity: Fidelity = part(Fidelity.read)
    calibration: CalibrationOrigin | None = optional(CalibrationOrigin.read)


@dataclass(frozen=True, kw_only=True)
class ConditionRow(Section):
    """One condition's NLL and its penalty against Correct, with the paired bootstrap CI over sequences and,
    where the cache records its documents, over documents."""

    nll: float = part(number)
    penalty: float = part(number)
    penalty_ci95: tuple[float | None, float | None] = part(interval)
    nll_sd_over_sequences: float | None = part(nullable(number))
    penalty_ci95_documents: tuple[float | None, float | None] | None = optional(interval)

    @property
    def quoted_interval(self) -> list[float]:
        """The penalty CI to quote (`fca.tables.scoring.quoted_interval`): over documents where there is one."""
        bounds = self.penalty_ci95_documents or self.penalty_ci95
        return [math.nan if x is None else x for x in bounds]


@dataclass(frozen=True, kw_only=True)
class SweepRow(Section):
    """One alpha of the interpolation sweep (`condition`: its name among the conditions)."""

    alpha: float = part(number)
    condition: str = part(text)
    nll: float = part(number)
    penalty: float = part(number)
    penalty_ci95: tuple[float | None, float | None] = part(interval)
    penalty_ci95_documents: tuple[float | None, float | None] | None = optional(interval)


@dataclass(frozen=True, kw_only=True)
class RoutingRow(Section):
    """One condition's routing figures, over the routers it changes (null where it changes none), and each
    per router in the routers' order (null where a router's experts were handed no weights)."""

    same_experts: float | None = part(nullable(number))
    expert_overlap: float | None = part(nullable(number))
    weight_kept: float | None = part(nullable(number))
    routers_changed: tuple[str, ...] = part(listing(text))
    same_experts_per_router: tuple[float | None, ...] = part(listing(nullable(number)))
    expert_overlap_per_router: tuple[float | None, ...] = part(listing(nullable(number)))
    weight_kept_per_router: tuple[float | None, ...] = part(listing(nullable(number)))


@dataclass(frozen=True, kw_only=True)
class Routing(Section):
    """Which experts each condition had tokens run (`fca.tables.scoring.summarize_routing`). Where no
    router's selection could be observed, only `not_reported` (the sentence saying why) is there."""

    routers: dict[str, int] | None = optional(mapping(whole))  # router site -> k
    experts: dict[str, int] | None = optional(mapping(whole))  # router site -> E
    chance: dict[str, float] | None = optional(mapping(number))
    conditions: dict[str, RoutingRow] | None = optional(mapping(RoutingRow.read))
    not_reported: str | None = optional(text)

    @classmethod
    def _derive(cls, data: dict, values: dict, path: str) -> dict:
        missing = [key for key in ("routers", "experts", "chance", "conditions") if key not in values]
        if 0 < len(missing) < 4:  # (all of them, or only the sentence)
            raise WrongField(_at(path, missing[0]), "is missing")
        return values


@dataclass(frozen=True, kw_only=True)
class Variance(Section):
    """Coefficient variation: the layer-identity share (null where the coefficients do not vary) pooled and
    per family, site and slot, the within-slot factors and what they take by chance."""

    layer_identity_share: float | None = part(nullable(number))
    per_family: dict[str, float | None] = part(mapping(nullable(number)))
    per_site: dict[str, float | None] = part(mapping(nullable(number)))
    per_slot_share: tuple[float | None, ...] = part(listing(nullable(number)))
    factors: dict[str, float | None] = part(mapping(nullable(number)))
    chance_levels: dict[str, float | None] | None = optional(mapping(nullable(number)))  # (early audits: none)
    ss_total: float = part(number)
    family_grand_means: dict[str, float] = part(mapping(number))
    num_tokens: int = part(whole)


@dataclass(frozen=True, kw_only=True)
class ExpertLayer(Section):
    experts_available: int = part(whole)
    top_k: int = part(whole)
    experts_run_per_token_mean: float = part(number)
    experts_hit: int = part(whole)
    tokens: int = part(whole)
    expert_fraction: float = part(number)


@dataclass(frozen=True, kw_only=True)
class Experts(Section):
    """An MoE model's experts run per token, counted from the dispatched indices, per layer and overall."""

    layers: dict[str, ExpertLayer] = part(mapping(ExpertLayer.read))
    moe_layers: int = part(whole)
    shared_experts: bool = part(flag)
    experts_available: float = part(number)  # per MoE layer
    top_k: int = part(whole)
    experts_run_per_token_mean: float = part(number)  # per MoE layer
    expert_fraction: float = part(number)
    note: str | None = part(nullable(text))


@dataclass(frozen=True, kw_only=True)
class Latency(Section):
    """The model's forward time against its Dense twin's: the median of interleaved runs' ratios."""

    latency_ratio_vs_dense: float = part(number)
    model_ms_median: float = part(number)
    dense_ms_median: float = part(number)
    runs: int = part(whole)
    ratio_min: float = part(number)
    ratio_max: float = part(number)
    batch_shape: tuple[int, ...] = part(listing(whole))
    device: str = part(text)


@dataclass(frozen=True, kw_only=True)
class ConditionExecution(Section):
    """What ran under one condition's replay: tokens each block processed over all evaluated sequences."""

    tokens: int = part(whole)
    tokens_per_block: tuple[int, ...] = part(listing(whole))
    blocks_executed_per_token: float = part(number)
    blocks_executed_fraction: float = part(number)
    per_block_fraction: tuple[float, ...] = part(listing(number))


LATENCY_KEYS = tuple(f.name for f in fields(Latency))


@dataclass(frozen=True, kw_only=True)
class Execution(Section):
    """Actual execution: blocks run per token, controller FLOPs, and where measured the Dense twin's FLOPs
    and `latency` (its keys lie in this section's JSON; a null `latency_ratio_vs_dense` without them where
    there is no twin), an MoE model's `experts`, the family's `note`, and what ran under each condition."""

    num_blocks: int = part(whole)
    tokens: int = part(whole)
    tokens_per_block: tuple[int, ...] = part(listing(whole))
    blocks_executed_per_token: float = part(number)
    blocks_executed_fraction: float = part(number)
    total_flops: int = part(whole)
    controller_flops: int = part(whole)
    controller_flops_share: float = part(number)
    flops_per_token: float = part(number)
    uncounted_ops: tuple[str, ...] | None = optional(listing(text))  # (early audits: not kept)
    experts: Experts | None = optional(Experts.read)
    note: str | None = optional(text)
    dense_flops_per_token: float | None = optional(number)  # (early audits with a twin: not counted)
    flops_ratio_vs_dense: float | None = optional(nullable(number))
    latency: Latency | None = derived()
    conditions: dict[str, ConditionExecution] | None = optional(mapping(ConditionExecution.read))

    @classmethod
    def read(cls, value: object, path: str = "") -> Execution:
        data = obj(value, path)
        timed = [key for key in LATENCY_KEYS if key in data]
        if "latency_ratio_vs_dense" not in data:
            raise WrongField(_at(path, "latency_ratio_vs_dense"), "is missing")
        if data["latency_ratio_vs_dense"] is None:
            timed = [key for key in timed if key != "latency_ratio_vs_dense"]
            if timed:
                raise WrongField(_at(path, timed[0]), "is given without a latency ratio")
            latency = None
        else:
            latency = Latency.read({key: data[key] for key in timed}, path)
        rest = super().read({k: v for k, v in data.items() if k not in LATENCY_KEYS}, path)
        return dataclasses.replace(rest, latency=latency)

    @property
    def latency_ratio_vs_dense(self) -> float | None:
        """The model's time over its Dense twin's (None where there is no twin)."""
        return None if self.latency is None else self.latency.latency_ratio_vs_dense

    def to_json(self) -> dict:
        out = super().to_json()
        timed = self.latency.to_json() if self.latency is not None else {"latency_ratio_vs_dense": None}
        tail = {"conditions": out.pop("conditions")} if "conditions" in out else {}
        return {**out, **timed, **tail}


@dataclass(frozen=True, kw_only=True)
class AuditReport(Section):
    """One audit report (README, "What is measured, exactly")."""

    fca_report_version: int = part(whole)
    model: Model = part(Model.read)
    cache: EvaluatedCache = part(EvaluatedCache.read)
    calibration: CalibrationCache = part(CalibrationCache.read)
    dense: Dense | None = part(nullable(Dense.read))  # (null: audited without a Dense twin)
    exactness: Exactness = part(Exactness.read)
    conditions: dict[str, ConditionRow] = part(mapping(ConditionRow.read))
    gap_retention: dict[str, float | None] = part(mapping(nullable(number)))  # null: undefined
    gap_retention_ci95: dict[str, tuple[float | None, float | None]] | None = optional(mapping(interval))
    interpolation_sweep: tuple[SweepRow, ...] | None = optional(listing(SweepRow.read))
    routing: Routing | None = optional(Routing.read)  # (models with routers)
    variance: Variance = part(Variance.read)
    execution: Execution = part(Execution.read)
    definitions: dict[str, Any] = part(obj)  # the words each figure is defined by, as written
    training: dict[str, Any] | None = optional(obj)  # how the model was trained (seed, steps, ...), where known
    seconds: float = part(number)

    @classmethod
    def from_json(cls, data: object, source: object = "report") -> AuditReport:
        """The report a JSON value holds, checked whole; else a one-line ReportError naming `source` and the
        field that is wrong."""
        if not isinstance(data, dict):
            raise ReportError(f"{source}: not an FCA audit report (a JSON {type(data).__name__}, not an object)")
        if "fca_report_version" in data and data["fca_report_version"] != REPORT_VERSION:
            raise ReportError(
                f"{source}: audit report version {data['fca_report_version']!r}; this FCA reads version {REPORT_VERSION}"
            )
        missing = [f.name for f in fields(cls) if f.name not in data and not f.metadata["absent"]]
        if missing:
            raise ReportError(
                f"{source}: not an FCA audit report (no {', '.join(repr(k) for k in missing)}); "
                "write one with `fca audit ... --json PATH`"
            )
        try:
            report = cls.read(data)
            training = report.training
            if training is not None and "seed" in training:
                nullable(whole)(training["seed"], "training.seed")
            for name in report.gap_retention:
                if name not in report.conditions:
                    raise WrongField(f"gap_retention.{name}", "names no condition of the report")
        except WrongField as wrong:
            raise ReportError(f"{source}: not an FCA audit report ({wrong})") from None
        return report

    @property
    def sweep(self) -> tuple[SweepRow, ...]:
        """The interpolation sweep's rows; () for an audit without one."""
        return self.interpolation_sweep or ()

    @property
    def sweep_conditions(self) -> set[str]:
        """The conditions the interpolation sweep ran (besides the others in `conditions`)."""
        return {row.condition for row in self.sweep}

    def retention_interval(self, condition: str) -> tuple[float | None, float | None] | None:
        """A condition's gap retention CI, where the report has one."""
        return (self.gap_retention_ci95 or {}).get(condition)


def report_field(report: Mapping | Section, path: str, default: Any = None) -> Any:
    """The value at a dotted path of a report's JSON form, or `default` where any part is missing (a study
    compares reports field by field)."""
    value: Any = report.to_json() if isinstance(report, Section) else report
    for key in path.split("."):
        if not isinstance(value, dict) or key not in value:
            return default
        value = value[key]
    return value
