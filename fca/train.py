"""Train a FeatureGate model (or its Dense twin) on a local corpus, offline, reproducibly by seed."""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from . import data
from .loading import save_model
from .models.featuregate import FeatureGateConfig, build_featuregate


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


def lr_at(step: int, s: TrainSettings) -> float:
    """Linear warm-up, then cosine decay to `min_lr`."""
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    progress = (step - s.warmup) / max(1, s.steps - s.warmup)
    return s.min_lr + 0.5 * (s.lr - s.min_lr) * (1 + math.cos(math.pi * progress))


@torch.no_grad()
def heldout_nll(model: torch.nn.Module, windows: np.ndarray, batch_size: int = 32) -> float:
    """Mean next-token NLL (nats) over all predicted positions of `windows` [N, T + 1]."""
    total, count = 0.0, 0
    model.eval()
    for i in range(0, len(windows), batch_size):
        w = torch.from_numpy(windows[i : i + batch_size])
        logits = model(w[:, :-1]).logits  # [b, T, V]
        total += F.cross_entropy(logits.flatten(0, 1), w[:, 1:].flatten(), reduction="sum").item()
        count += w[:, 1:].numel()
    return total / count


def train(corpus: str | Path, out: str | Path, model_config: FeatureGateConfig, settings: TrainSettings, tokenizer=None, show_progress: bool = True,
          text_column: str = "text") -> dict:
    """Train and save to `out` (config, weights, tokenizer, training_log.json). Returns the log."""
    torch.manual_seed(settings.seed)
    splits = data.split_documents(data.load_documents(corpus, text_column), settings.split_seed)
    if tokenizer is None:
        tokenizer = data.train_tokenizer(splits["train"], settings.vocab_size)
    config = FeatureGateConfig(**{**model_config.to_dict(), "vocab_size": tokenizer.get_vocab_size(), "init_seed": settings.seed})
    T = config.max_seq_len
    train_stream = torch.from_numpy(data.encode_stream(splits["train"], tokenizer).astype(np.int64))
    if len(train_stream) < T + 2:
        raise data.CorpusError(f"{corpus}: the train split has {len(train_stream)} tokens, too few for windows of {T}")
    eval_windows = data.make_windows(data.encode_stream(splits["eval"], tokenizer), T)
    model = build_featuregate(config)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": settings.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=settings.lr, betas=(0.9, 0.95),
    )
    batches = torch.Generator().manual_seed(settings.seed)
    log: dict = {"settings": asdict(settings), "corpus": str(corpus), "parameters": sum(p.numel() for p in model.parameters()),
                 "train_tokens": len(train_stream), "eval_windows": len(eval_windows), "history": []}
    started = time.perf_counter()
    bar = tqdm(range(settings.steps), desc=f"train {'gated' if config.gated else 'dense'}", disable=not show_progress)
    for step in bar:
        model.train()
        starts = torch.randint(0, len(train_stream) - T - 1, (settings.batch_size,), generator=batches)
        window = torch.stack([train_stream[s : s + T + 1] for s in starts.tolist()])  # [B, T + 1]
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, settings)
        loss = model(window[:, :-1], labels=window[:, 1:]).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
        optimizer.step()
        entry = {"step": step + 1, "loss": round(loss.item(), 5)}
        if (step + 1) % settings.eval_every == 0 or step + 1 == settings.steps:
            entry["eval_nll"] = round(heldout_nll(model, eval_windows[: settings.eval_windows]), 5)
            bar.set_postfix(loss=f"{loss.item():.3f}", eval=f"{entry['eval_nll']:.3f}")
        log["history"].append(entry)
    log["train_seconds"] = round(time.perf_counter() - started, 1)
    log["final_eval_nll"] = heldout_nll(model, eval_windows[: settings.final_eval_windows])
    log["final_eval_tokens"] = int(min(len(eval_windows), settings.final_eval_windows) * T)
    save_model(model.eval(), out, tokenizer, {"training_log.json": json.dumps(log, indent=1)})
    return log
