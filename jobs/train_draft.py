"""Train the EAGLE-style draft head on the base model's features over the training corpus.

    python -m jobs.train_draft --model models/specee-tiny

The base model is frozen; its final-normed hidden states f_t are computed once and cached.
The head learns f_{t+1} from [embedding(x_{t+1}); f_t] with EAGLE-1's loss: SmoothL1 on the
feature plus ce_weight x cross-entropy against the base model's next-token distribution.
Saves <model>/draft/ in EAGLE-1 layout and prints held-out top-1 / top-k hit rates as JSON.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from jobs.cli import parse_config
from jobs.train_base import fixed_windows, tokenize_split
from specee_core import load_model, load_tokenizer
from specee_core.speculators import DraftHead

log = logging.getLogger(__name__)


@dataclass
class DraftTrainConfig:
    model: Path = Path("models/specee-tiny")
    corpus: Path = Path("data/corpus")
    cache_dir: Path = Path("runs/train_base/tokens")
    train_windows: int = 1200
    eval_windows: int = 64
    seq_len: int = 256
    batch_size: int = 8
    epochs: int = 3
    lr: float = 1e-3
    ce_weight: float = 0.1
    k: int = 4
    draft_vocab: int = 2048  # rank only the most frequent tokens at run time (0 = the whole vocabulary)
    seed: int = 0
    threads: int = 0

    def __post_init__(self) -> None:
        self.model, self.corpus, self.cache_dir = Path(self.model), Path(self.corpus), Path(self.cache_dir)
        if self.seq_len < 2 or self.train_windows < 1:
            raise ValueError("seq_len must be >= 2 and train_windows >= 1")


@torch.no_grad()
def base_features(model, windows: torch.Tensor, batch: int) -> torch.Tensor:
    """windows [N, T] -> final-normed features [N, T, D] of the frozen base model."""
    out = []
    n, t = windows.shape
    cache = model.new_cache(batch, t)
    for s in range(0, n, batch):
        w = windows[s : s + batch]
        cache.reset()
        rows = torch.arange(len(w)) if len(w) < batch else None
        out.append(model.final_norm(model.forward(w, torch.arange(t).expand(len(w), t), cache, rows)))
    return torch.cat(out)


def draft_loss(head: DraftHead, model, tokens: torch.Tensor, feats: torch.Tensor, ce_weight: float):
    """tokens [N, T], feats [N, T, D]: pairs (x_{t+1}, f_t) predict f_{t+1}."""
    t = tokens.shape[1] - 1
    cos, sin = model.rope_for(torch.arange(t).expand(len(tokens), t))
    pred = head(model.embed(tokens[:, 1:]), feats[:, :-1], cos, sin)
    target = feats[:, 1:]
    reg = F.smooth_l1_loss(pred, target)
    logits = model.lm_head(pred)
    with torch.no_grad():
        p_target = model.lm_head(target).softmax(-1)
    ce = -(p_target * logits.log_softmax(-1)).sum(-1).mean()
    return reg + ce_weight * ce, reg, ce, logits, model.lm_head(target).argmax(-1)


def train(cfg: DraftTrainConfig) -> dict:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    model = load_model(cfg.model, dtype="float32")
    tokenizer = load_tokenizer(cfg.model)
    train_stream = tokenize_split(cfg.corpus, "train", tokenizer, cfg.cache_dir)
    held_stream = tokenize_split(cfg.corpus, "heldout", tokenizer, cfg.cache_dir)
    rng = np.random.default_rng(cfg.seed)
    starts = rng.integers(0, len(train_stream) - cfg.seq_len, size=cfg.train_windows)
    train_w = torch.from_numpy(np.stack([train_stream[s : s + cfg.seq_len] for s in starts]).astype(np.int64))
    eval_w = fixed_windows(held_stream, cfg.eval_windows, cfg.seq_len - 1)
    t0 = time.perf_counter()
    train_f = base_features(model, train_w, cfg.batch_size)
    eval_f = base_features(model, eval_w, cfg.batch_size)
    print(json.dumps({"features_s": round(time.perf_counter() - t0, 1), "train_tokens": train_w.numel()}), flush=True)

    head = DraftHead(model.config)
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=0.0)
    steps = cfg.epochs * ((len(train_w) + cfg.batch_size - 1) // cfg.batch_size)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg.lr, total_steps=steps, pct_start=0.05)
    step = 0
    for epoch in range(cfg.epochs):
        order = torch.randperm(len(train_w))
        for s in range(0, len(train_w), cfg.batch_size):
            i = order[s : s + cfg.batch_size]
            loss, reg, ce, _, _ = draft_loss(head, model, train_w[i], train_f[i], cfg.ce_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            if step % 20 == 0:
                print(json.dumps({"epoch": epoch, "step": step, "of": steps, "loss": round(loss.item(), 4),
                                  "smooth_l1": round(reg.item(), 4), "ce": round(ce.item(), 3),
                                  "elapsed_s": round(time.perf_counter() - t0, 1)}), flush=True)
    subset = None
    if 0 < cfg.draft_vocab < model.config.vocab_size:
        counts = np.bincount(train_stream, minlength=model.config.vocab_size)
        subset = torch.from_numpy(np.sort(np.argsort(-counts, kind="stable")[: cfg.draft_vocab]).astype(np.int64))
        report_cov = counts[subset.numpy()].sum() / counts.sum()
    report = evaluate(head, model, eval_w, eval_f, cfg, subset)
    if subset is not None:
        report["draft_vocab_token_coverage"] = float(report_cov)
    head.save(cfg.model / "draft", meta={"train": {k: str(v) for k, v in asdict(cfg).items()}, "heldout": report},
              vocab_subset=subset)
    report["train_time_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(report), flush=True)
    return report


@torch.no_grad()
def evaluate(head, model, windows, feats, cfg, subset: torch.Tensor | None = None) -> dict:
    """Teacher-forced held-out hit rates: the base model's greedy next token vs the draft's top-k
    (over the whole vocabulary, and over `subset` as the engine ranks it at run time)."""
    head.eval()
    top1 = topk = n = sub1 = subk = 0
    loss_sum = 0.0
    for s in range(0, len(windows), cfg.batch_size):
        loss, _, _, logits, target_tok = draft_loss(head, model, windows[s : s + cfg.batch_size],
                                                    feats[s : s + cfg.batch_size], cfg.ce_weight)
        # draft output at pair i predicts f_{i+1}, whose argmax is the base's next token x_{i+2}
        cands = logits.topk(cfg.k, -1).indices
        top1 += (cands[..., 0] == target_tok).sum().item()
        topk += (cands == target_tok[..., None]).any(-1).sum().item()
        if subset is not None:
            sc = subset[logits[..., subset].topk(cfg.k, -1).indices]
            sub1 += (sc[..., 0] == target_tok).sum().item()
            subk += (sc == target_tok[..., None]).any(-1).sum().item()
        n += target_tok.numel()
        loss_sum += loss.item()
    head.train()
    extra = {} if subset is None else {"subset_top1": sub1 / n, f"subset_top{cfg.k}": subk / n, "subset_size": len(subset)}
    return {**extra, "heldout_top1": top1 / n, f"heldout_top{cfg.k}": topk / n, "heldout_loss": loss_sum / max(1, len(windows) // cfg.batch_size),
            "positions": n}


def main(argv: list[str] | None = None) -> None:
    train(parse_config(DraftTrainConfig, __doc__, argv))


if __name__ == "__main__":
    main()
