"""Train a FeatureGate model (or its Dense twin) on a local corpus, offline, reproducibly by seed."""

from __future__ import annotations

import json
import math
import os
import platform
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from fca.engine.execution import synchronize
from fca.engine.loading import resolve_device, save_model
from fca.engine.models.featuregate import FeatureGateConfig, build_featuregate
from fca.engine.models.mixture_of_depths import MixtureOfDepthsConfig, build_mixture_of_depths
from fca.tables import data
from fca.tables.catalog import DENSE_TWINS
from fca.tables.schema import file_sha256

TrainableConfig = FeatureGateConfig | MixtureOfDepthsConfig
# The families `train` builds: model_type -> a freshly initialised model of a config, deterministic in its seed.
BUILDERS = {
    FeatureGateConfig.model_type: build_featuregate,
    MixtureOfDepthsConfig.model_type: build_mixture_of_depths,
}


def is_dynamic(config: TrainableConfig) -> bool:
    """The model has its controllers (not its Dense twin): the family's switch is on."""
    return getattr(config, DENSE_TWINS[config.model_type].switch) is not False


@dataclass(frozen=True)
class TrainSettings:
    steps: int = 800
    batch_size: int = 32
    lr: float = 2e-3
    min_lr: float = 2e-4
    warmup: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0  # model init and batch order
    split_seed: int = 0  # which documents are train / calibration / eval; shared across seeds
    eval_every: int = 100
    eval_windows: int = 64  # held-out windows scored at each evaluation
    final_eval_windows: int = 256
    vocab_size: int = 2048


def warmup_steps(s: TrainSettings) -> int:
    """The warm-up's length: `warmup`, or a tenth of the run when the run is not longer than that (a
    30-step run under the default 50 never reached its learning rate, nor decayed from it)."""
    return s.warmup if s.warmup < s.steps else max(1, s.steps // 10)


def lr_at(step: int, s: TrainSettings) -> float:
    """Linear warm-up, then cosine decay to `min_lr`."""
    warmup = warmup_steps(s)
    if step < warmup:
        return s.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, s.steps - warmup)
    return s.min_lr + 0.5 * (s.lr - s.min_lr) * (1 + math.cos(math.pi * progress))


@torch.no_grad()
def heldout_nll(model: torch.nn.Module, windows: np.ndarray, batch_size: int = 32) -> float:
    """Mean next-token NLL (nats) over all predicted positions of `windows` [N, T + 1], in the model's
    own dtype on its own device (no autocast: this scores the float32 weights that are saved)."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    model.eval()
    for i in range(0, len(windows), batch_size):
        w = torch.from_numpy(windows[i : i + batch_size]).to(device)
        logits = model(w[:, :-1]).logits  # [b, T, V]
        total += F.cross_entropy(logits.flatten(0, 1), w[:, 1:].flatten(), reduction="sum").item()
        count += w[:, 1:].numel()
    return total / count


@dataclass(frozen=True)
class Precision:
    """How the forward and backward run on one device type. CPU: plain float32 (the shipped demo was
    trained so; keep it bit-identical). CUDA: bf16 autocast over float32 master weights, fused AdamW,
    deterministic kernels so that a seed gives the same weights twice on the same GPU and software."""

    device: torch.device
    autocast: torch.dtype | None
    fused_optimizer: bool
    deterministic: bool

    def forward(self) -> AbstractContextManager:
        """The context of a training forward: autocast on CUDA, nothing at all on the CPU."""
        return nullcontext() if self.autocast is None else torch.autocast(self.device.type, dtype=self.autocast)

    @property
    def label(self) -> str:
        if self.autocast is None:
            return "float32"
        return f"{str(self.autocast).replace('torch.', '')} autocast, float32 master weights"


def precision_for(device: str | torch.device) -> Precision:
    device = resolve_device(device)
    if device.type == "cuda":
        return Precision(device, torch.bfloat16, fused_optimizer=True, deterministic=True)
    return Precision(device, None, fused_optimizer=False, deterministic=False)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or "cpu"


@contextmanager
def deterministic_kernels(enabled: bool) -> Iterator[None]:
    """Deterministic CUDA kernels for the duration of training (embedding and attention backward
    otherwise accumulate with atomics, in an order that varies run to run); restored afterwards."""
    if not enabled:
        yield
        return
    # cuBLAS reads this when it creates its handle: set before the first CUDA matrix product.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    before = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before, warn_only=warn_only)


def train(
    corpus: str | Path,
    out: str | Path,
    model_config: TrainableConfig,
    settings: TrainSettings,
    tokenizer=None,
    show_progress: bool = True,
    text_column: str = "text",
    device: str | torch.device = "cpu",
) -> dict:
    """Train and save to `out` (config, float32 weights, tokenizer, training_log.json). Returns the log.

    One code path for every device (`precision_for` says what differs). The batch order comes from a
    CPU generator and the initial weights from CPU generators too, so a seed picks the same batches
    and the same starting point on any device; the weights then match bit for bit across runs on one
    device type and software stack (not across devices)."""
    precision = precision_for(device)
    with deterministic_kernels(precision.deterministic):
        device = precision.device
        torch.manual_seed(settings.seed)
        try:
            splits = data.split_documents(data.load_documents(corpus, text_column), settings.split_seed)
        except data.CorpusError as err:  # named as build-cache names it
            raise err if str(corpus) in str(err) else data.CorpusError(f"{corpus}: {err}") from None
        if tokenizer is None:
            tokenizer = data.train_tokenizer(splits["train"], settings.vocab_size)
        config = type(model_config)(
            **{**model_config.to_dict(), "vocab_size": tokenizer.get_vocab_size(), "init_seed": settings.seed}
        )
        T = config.max_seq_len
        train_stream = torch.from_numpy(data.encode_stream(splits["train"], tokenizer).astype(np.int64))
        if len(train_stream) < T + 2:
            raise data.CorpusError(
                f"{corpus}: the train split has {len(train_stream)} tokens, too few for windows of {T}"
            )
        eval_windows = data.make_windows(data.encode_stream(splits["eval"], tokenizer), T)
        model = BUILDERS[config.model_type](config).to(device)  # initialised on the CPU (seeded generators), then moved
        decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": settings.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=settings.lr,
            betas=(0.9, 0.95),
            **({"fused": True} if precision.fused_optimizer else {}),
        )
        batches = torch.Generator().manual_seed(settings.seed)
        stream = train_stream.to(device)
        offsets = torch.arange(T + 1, device=device)
        parameters = sum(p.numel() for p in model.parameters())
        log: dict = {
            "settings": {**asdict(settings), "warmup": warmup_steps(settings)},  # (the warm-up run, not asked)
            "corpus": str(corpus),
            # (a study compares it with the evaluated cache's, as two files of one name may hold other text)
            "corpus_fingerprint": file_sha256(Path(corpus)) if Path(corpus).is_file() else None,
            "parameters": parameters,
            "train_tokens": len(train_stream),
            "eval_windows": len(eval_windows),
            "device": device.type,
            "device_name": device_name(device),
            "precision": precision.label,
            "optimizer": "AdamW (fused)" if precision.fused_optimizer else "AdamW",
            "deterministic_kernels": precision.deterministic,
            "torch": torch.__version__,
            "history": [],
        }
        started = time.perf_counter()
        step_seconds, since = 0.0, time.perf_counter()
        # Losses stay on the device until the next evaluation: reading one per step would wait for the GPU.
        pending: list[tuple[dict, torch.Tensor]] = []
        bar = tqdm(
            range(settings.steps),
            desc=f"train {config.model_type if is_dynamic(config) else 'dense'}",
            disable=not show_progress,
        )
        for step in bar:
            model.train()
            starts = torch.randint(0, len(train_stream) - T - 1, (settings.batch_size,), generator=batches)
            window = stream[starts.to(device)[:, None] + offsets]  # [B, T + 1]
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, settings)
            with precision.forward():
                loss = model(window[:, :-1], labels=window[:, 1:]).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
            optimizer.step()
            entry = {"step": step + 1}
            pending.append((entry, loss.detach()))
            log["history"].append(entry)
            if (step + 1) % settings.eval_every == 0 or step + 1 == settings.steps:
                synchronize(device)
                step_seconds += time.perf_counter() - since
                for e, value in pending:
                    e["loss"] = round(value.item(), 5)
                pending.clear()
                entry["eval_nll"] = round(heldout_nll(model, eval_windows[: settings.eval_windows]), 5)
                bar.set_postfix(loss=f"{entry['loss']:.3f}", eval=f"{entry['eval_nll']:.3f}")
                since = time.perf_counter()
        log["train_seconds"] = round(time.perf_counter() - started, 1)
        log["step_seconds"] = round(step_seconds, 3)
        log["tokens_seen"] = settings.steps * settings.batch_size * T
        log["tokens_per_second"] = round(log["tokens_seen"] / step_seconds, 1) if step_seconds > 0 else None
        log["final_eval_nll"] = heldout_nll(model, eval_windows[: settings.final_eval_windows])
        log["final_eval_tokens"] = int(min(len(eval_windows), settings.final_eval_windows) * T)
        finite_weights = all(bool(torch.isfinite(p).all()) for p in model.parameters())
        if not finite_weights or not math.isfinite(log["final_eval_nll"]):
            weights = "" if finite_weights else ", weights NaN or inf"
            raise ValueError(
                f"{out}: training diverged (held-out NLL {log['final_eval_nll']:.4g}{weights}), so no model is saved; "
                f"train with a lower --lr than {settings.lr:g}"
            )
        save_model(model.eval().to("cpu"), out, tokenizer, {"training_log.json": json.dumps(log, indent=1)})
        return log
