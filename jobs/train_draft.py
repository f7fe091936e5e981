"""Train the EAGLE-style draft head on the base model's features.

    python -m jobs.train_draft --model models/specee-tiny                      # corpus windows
    python -m jobs.train_draft --model models/smollm2-135m-instruct \\
        --data data/distill/smollm2.jsonl --feature-dtype bfloat16 --seq-len 512   # self-distilled

Training sequences are either random windows of the tokenized corpus (--corpus) or, with
--data, the model's own answers from jobs.make_distill_data (prompt_ids + answer_ids, as EAGLE
trains on the target model's outputs); a ~5% slice of that file, chosen by a hash of the id,
is held out. The base model is frozen; its final-normed hidden states f_t are computed once
(in --feature-dtype: use the dtype the engine will decode in) and cached under --ckpt-dir.
The head learns f_{t+1} from [embedding(x_{t+1}); f_t] with EAGLE-1's loss: SmoothL1 on the
feature plus ce_weight x cross-entropy against the base model's next-token distribution,
taken over the --draft-vocab frequent tokens the head ranks at run time (the whole vocabulary
with --draft-vocab 0). Checkpoints every --ckpt-every-s (rerun the command to resume) and
saves <model>/draft/ in EAGLE-1 layout. Prints held-out top-1 / top-k hit rates as JSON: on
distilled data over answer positions only, where teacher forcing is what decoding sees.
"""
from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from jobs.cli import parse_config
from jobs.make_distill_data import is_heldout_id, manifest_path, read_jsonl
from jobs.build_corpus import fixed_windows, tokenize_split
from specee_core import load_model, load_tokenizer
from specee_core.draft.head import DraftHead

log = logging.getLogger(__name__)


@dataclass
class DraftTrainConfig:
    model: Path = Path("models/specee-tiny")
    corpus: Path = Path("data/corpus")
    data: Path | None = None  # distill JSON lines (jobs.make_distill_data); replaces --corpus
    heldout_fraction: float = 0.05  # --data: the share of ids held out (by hash)
    cache_dir: Path = Path("runs/train_base/tokens")
    ckpt_dir: Path = Path("runs/train_draft")
    train_windows: int = 1200  # corpus windows, or at most this many distill rows
    eval_windows: int = 64  # corpus only: --data holds out its hash slice
    seq_len: int = 256  # corpus window length; distill sequences are cut to it
    batch_size: int = 8
    epochs: int = 3
    lr: float = 1e-3
    ce_weight: float = 0.1
    k: int = 4
    draft_vocab: int = 2048  # rank only the most frequent tokens at run time (0 = the whole vocabulary)
    feature_dtype: str = "float32"  # the base model's dtype for features: the engine's decode dtype
    time_budget_min: float = 0.0  # > 0: stop training after this long; the lr decays by time or steps
    ckpt_every_s: float = 300.0
    seed: int = 0
    threads: int = 0

    def __post_init__(self) -> None:
        self.model, self.corpus, self.cache_dir = Path(self.model), Path(self.corpus), Path(self.cache_dir)
        self.ckpt_dir = Path(self.ckpt_dir)
        self.data = None if self.data in (None, "") else Path(self.data)
        if self.seq_len < 2 or self.train_windows < 1:
            raise ValueError("seq_len must be >= 2 and train_windows >= 1")
        if self.data is not None and not self.data.is_file():
            raise FileNotFoundError(f"distill data not found: {self.data} (run jobs.make_distill_data)")
        if not 0 < self.heldout_fraction < 1:
            raise ValueError(f"heldout_fraction must be in (0, 1), got {self.heldout_fraction}")
        if self.feature_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"feature_dtype must be 'float32' or 'bfloat16', got {self.feature_dtype!r}")


@dataclass
class SeqBatch:
    """Right-padded training sequences. Pair i is (x_{i+1}, f_i), whose target is f_{i+1}."""
    tokens: torch.Tensor  # [N, T]
    lens: torch.Tensor  # [N] valid tokens per row
    loss_mask: torch.Tensor  # [N, T-1] pairs that train (i + 1 < len)
    eval_mask: torch.Tensor  # [N, T-1] pairs that count in evaluation (distill: those predicting answer tokens)
    feats: torch.Tensor | None = None  # [N, T, D] base features, stored in feature_dtype


def make_batches(seqs: list[list[int]], eval_from: list[int], batch_size: int) -> list[SeqBatch]:
    """Batches of similar length (sorted), right-padded. eval_from[r]: the first pair index of row r
    that evaluation counts (pair i predicts token i + 2, so len(prompt) - 1 for answers)."""
    order = sorted(range(len(seqs)), key=lambda r: len(seqs[r]))
    out = []
    for s in range(0, len(order), batch_size):
        rows = order[s : s + batch_size]
        t = max(len(seqs[r]) for r in rows)
        tokens = torch.zeros(len(rows), t, dtype=torch.int64)
        for j, r in enumerate(rows):
            tokens[j, : len(seqs[r])] = torch.tensor(seqs[r])
        lens = torch.tensor([len(seqs[r]) for r in rows])
        pair = torch.arange(t - 1)
        loss_mask = pair[None] + 1 < lens[:, None]
        eval_mask = loss_mask & (pair[None] >= torch.tensor([eval_from[r] for r in rows])[:, None])
        out.append(SeqBatch(tokens, lens, loss_mask, eval_mask))
    return out


@torch.no_grad()
def base_features(model, batches: list[SeqBatch]) -> None:
    """Fill each batch's feats [N, T, D]: the frozen base model's final-normed hidden states."""
    for b in batches:
        n, t = b.tokens.shape
        cache = model.new_cache(n, t)
        h = model.forward(b.tokens, torch.arange(t).expand(n, t), cache, n_valid=b.lens)
        b.feats = model.final_norm(h)


def draft_outputs(head: DraftHead, model, tokens: torch.Tensor, feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [N, T], feats [N, T, D] -> (predicted f_{i+1}, target f_{i+1}), each [N, T-1, D] fp32."""
    t = tokens.shape[1] - 1
    cos, sin = (x[:, :1] for x in model.rope_for(torch.arange(t).expand(len(tokens), t)))  # the full-attention RoPE
    feats = feats.float()
    return head(model.embed(tokens[:, 1:]), feats[:, :-1], cos, sin), feats[:, 1:]


def draft_loss(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor, lm_w: torch.Tensor,
               ce_weight: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """EAGLE-1's loss over the pairs in mask [N, T-1]: SmoothL1 on the feature plus ce_weight x
    cross-entropy against the base's distribution over the rows of lm_w [V', D]."""
    pred, target = pred[mask], target[mask]  # [P, D]
    reg = F.smooth_l1_loss(pred, target)
    with torch.no_grad():
        p_target = F.linear(target, lm_w).softmax(-1)
    ce = -(p_target * F.linear(pred, lm_w).log_softmax(-1)).sum(-1).mean()
    return reg + ce_weight * ce, reg, ce


def load_sequences(cfg: DraftTrainConfig, tokenizer, vocab_size: int) -> tuple[list[SeqBatch], list[SeqBatch], np.ndarray, dict]:
    """(train batches, eval batches, token counts [V] for the draft vocabulary, data summary)."""
    if cfg.data is not None:
        rows = read_jsonl(cfg.data)
        held = [r for r in rows if is_heldout_id(r["id"], cfg.heldout_fraction)]
        train_rows = [r for r in rows if not is_heldout_id(r["id"], cfg.heldout_fraction)][: cfg.train_windows]
        seq = lambda r: (r["prompt_ids"] + r["answer_ids"])[: cfg.seq_len]  # noqa: E731
        answers = np.fromiter((t for r in train_rows for t in r["answer_ids"]), dtype=np.int64)
        summary = {"source": str(cfg.data), "train_rows": len(train_rows), "heldout_rows": len(held),
                   "train_tokens": sum(len(seq(r)) for r in train_rows),
                   "train_answer_tokens": len(answers)}
        if manifest_path(cfg.data).is_file():  # how the data was made travels with the head
            summary["distill_manifest"] = json.loads(manifest_path(cfg.data).read_text())
        train_b = make_batches([seq(r) for r in train_rows], [0] * len(train_rows), cfg.batch_size)
        eval_b = make_batches([seq(r) for r in held], [len(r["prompt_ids"]) - 1 for r in held], cfg.batch_size)
        return train_b, eval_b, np.bincount(answers, minlength=vocab_size), summary
    train_stream = tokenize_split(cfg.corpus, "train", tokenizer, cfg.cache_dir)
    held_stream = tokenize_split(cfg.corpus, "heldout", tokenizer, cfg.cache_dir)
    rng = np.random.default_rng(cfg.seed)
    starts = rng.integers(0, len(train_stream) - cfg.seq_len, size=cfg.train_windows)
    train_w = [train_stream[s : s + cfg.seq_len].astype(np.int64).tolist() for s in starts]
    eval_w = fixed_windows(held_stream, cfg.eval_windows, cfg.seq_len - 1).tolist()
    summary = {"source": str(cfg.corpus), "train_windows": len(train_w), "train_tokens": len(train_w) * cfg.seq_len}
    return (make_batches(train_w, [0] * len(train_w), cfg.batch_size), make_batches(eval_w, [0] * len(eval_w), cfg.batch_size),
            np.bincount(train_stream.astype(np.int64), minlength=vocab_size), summary)


def cached_features(cfg: DraftTrainConfig, model_dir: Path, batches: dict[str, list[SeqBatch]]) -> float:
    """Compute (or load from --ckpt-dir) the base features of every batch; returns the seconds spent."""
    key = {k: str(getattr(cfg, k)) for k in ("model", "corpus", "data", "heldout_fraction", "train_windows",
                                             "eval_windows", "seq_len", "batch_size", "feature_dtype", "seed")}
    path = cfg.ckpt_dir / "features.pt"
    if path.is_file():
        saved = torch.load(path, weights_only=True)
        if saved["key"] == key:
            for name, bs in batches.items():
                for b, f in zip(bs, saved[name]):
                    b.feats = f
            log.info("features loaded from %s", path)
            return 0.0
    t0 = time.perf_counter()
    feature_model = load_model(model_dir, dtype=cfg.feature_dtype)
    for name, bs in batches.items():
        base_features(feature_model, bs)
    cfg.ckpt_dir.mkdir(parents=True, exist_ok=True)
    torch.save({"key": key, **{name: [b.feats for b in bs] for name, bs in batches.items()}}, path)
    return time.perf_counter() - t0


def lr_at(cfg: DraftTrainConfig, step: int, total: int, elapsed_s: float) -> float:
    """Linear warmup over 5% of the steps, then cosine to 10% over max(step / total, time used)."""
    warm = max(1, total // 20)
    if step < warm:
        return cfg.lr * (step + 1) / warm
    progress = step / total
    if cfg.time_budget_min > 0:
        progress = max(progress, elapsed_s / (cfg.time_budget_min * 60))
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def train(cfg: DraftTrainConfig) -> dict:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    model = load_model(cfg.model, dtype="float32")  # embedding, RoPE and LM head for the head's loss
    tokenizer = load_tokenizer(cfg.model)
    V = model.config.vocab_size
    train_b, eval_b, counts, summary = load_sequences(cfg, tokenizer, V)
    if not train_b or not eval_b:
        raise ValueError(f"need training and held-out sequences, got {len(train_b)} and {len(eval_b)} batches "
                         f"(a --data file with too few rows?)")
    features_s = cached_features(cfg, cfg.model, {"train": train_b, "eval": eval_b})
    print(json.dumps({"features_s": round(features_s, 1), "feature_dtype": cfg.feature_dtype, **summary}), flush=True)

    subset = None
    if 0 < cfg.draft_vocab < V:
        subset = torch.from_numpy(np.sort(np.argsort(-counts, kind="stable")[: cfg.draft_vocab]).astype(np.int64))
    lm_w = model.w.lm_head if subset is None else model.w.lm_head[subset].contiguous()  # [V', D]

    head = DraftHead(model.config)
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=0.0)
    steps = cfg.epochs * len(train_b)
    step, elapsed = 0, 0.0
    ckpt = cfg.ckpt_dir / "last.pt"
    if ckpt.is_file():
        state = torch.load(ckpt, weights_only=False)
        if state["config"] == asdict(cfg):
            head.load_state_dict(state["head"])
            opt.load_state_dict(state["opt"])
            step, elapsed = state["step"], state["elapsed_s"]
            log.info("resumed from %s at step %d of %d", ckpt, step, steps)
    t0 = time.perf_counter() - elapsed
    t_ckpt = time.perf_counter()
    out_of_time = cfg.time_budget_min > 0 and elapsed > cfg.time_budget_min * 60  # a resumed run already out of time
    while step < steps and not out_of_time:
        epoch, first = divmod(step, len(train_b))
        order = torch.randperm(len(train_b), generator=torch.Generator().manual_seed(cfg.seed + epoch)).tolist()
        for i in order[first:]:
            b = train_b[i]
            for g in opt.param_groups:
                g["lr"] = lr_at(cfg, step, steps, time.perf_counter() - t0)
            pred, target = draft_outputs(head, model, b.tokens, b.feats)
            loss, reg, ce = draft_loss(pred, target, b.loss_mask, lm_w, cfg.ce_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opt.step()
            step += 1
            elapsed = time.perf_counter() - t0
            if step % 20 == 0:
                print(json.dumps({"epoch": epoch, "step": step, "of": steps, "loss": round(loss.item(), 4),
                                  "smooth_l1": round(reg.item(), 4), "ce": round(ce.item(), 3),
                                  "lr": round(opt.param_groups[0]["lr"], 6), "elapsed_s": round(elapsed, 1)}), flush=True)
            out_of_time = cfg.time_budget_min > 0 and elapsed > cfg.time_budget_min * 60
            if out_of_time or step == steps or time.perf_counter() - t_ckpt > cfg.ckpt_every_s:
                torch.save({"config": asdict(cfg), "head": head.state_dict(), "opt": opt.state_dict(), "step": step,
                            "elapsed_s": elapsed}, ckpt)
                t_ckpt = time.perf_counter()
            if out_of_time:
                break

    report = evaluate(head, model, eval_b, cfg, subset)
    report["train"] = {**summary, "steps": step, "planned_steps": steps, "train_time_s": round(elapsed, 1),
                       "features_s": round(features_s, 1), "feature_dtype": cfg.feature_dtype}
    if subset is not None:
        report["draft_vocab_token_coverage"] = float(counts[subset.numpy()].sum() / counts.sum())
    head.save(cfg.model / "draft", meta={"config": {k: str(v) for k, v in asdict(cfg).items()}, "heldout": report},
              vocab_subset=subset)
    print(json.dumps(report), flush=True)
    return report


@torch.no_grad()
def evaluate(head, model, batches: list[SeqBatch], cfg: DraftTrainConfig, subset: torch.Tensor | None = None) -> dict:
    """Teacher-forced held-out hit rates over each batch's eval_mask: the base model's greedy next
    token vs the draft's top-k (over the whole vocabulary, and over `subset` as the engine ranks it
    at run time)."""
    head.eval()
    top1 = topk = n = sub1 = subk = 0
    loss_sum = 0.0
    lm_w = model.w.lm_head if subset is None else model.w.lm_head[subset]
    for b in batches:
        if not b.eval_mask.any():  # prompts cut at seq_len: no answer positions
            continue
        pred, target = draft_outputs(head, model, b.tokens, b.feats)
        loss_sum += draft_loss(pred, target, b.eval_mask, lm_w, cfg.ce_weight)[0].item() * int(b.eval_mask.sum())
        pred, target = pred[b.eval_mask], target[b.eval_mask]  # [P, D]
        # draft output at pair i predicts f_{i+1}, whose argmax is the base's next token x_{i+2}
        target_tok = model.lm_head(target).argmax(-1)
        cands = model.lm_head(pred).topk(cfg.k, -1).indices
        top1 += (cands[:, 0] == target_tok).sum().item()
        topk += (cands == target_tok[:, None]).any(-1).sum().item()
        if subset is not None:
            sc = subset[F.linear(pred, lm_w).topk(cfg.k, -1).indices]
            sub1 += (sc[:, 0] == target_tok).sum().item()
            subk += (sc == target_tok[:, None]).any(-1).sum().item()
        n += len(target_tok)
    head.train()
    extra = {} if subset is None else {"subset_top1": sub1 / n, f"subset_top{cfg.k}": subk / n, "subset_size": len(subset)}
    return {**extra, "heldout_top1": top1 / n, f"heldout_top{cfg.k}": topk / n, "heldout_loss": loss_sum / n,
            "positions": n}


def main(argv: list[str] | None = None) -> None:
    train(parse_config(DraftTrainConfig, __doc__, argv))


if __name__ == "__main__":
    main()
