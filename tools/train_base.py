"""Train the bundled Llama-architecture model on the stdlib corpus.

    python -m tools.train_base --out models/specee-tiny --time-budget-min 80

Uses CUDA when present, CPU otherwise. Resumable: rerun the same command and it continues
from --ckpt-dir/last.pt (model, optimizer, step, elapsed time). The learning rate follows a
cosine over progress = max(step / max_steps, elapsed / time budget), so a time-limited run
still ends with a decayed learning rate. Prints loss and tokens/s; writes a JSON-lines log and,
at the end, the model in HF layout (bf16 safetensors) with train_log.json.
"""
from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from jobs.cli import parse_config
from jobs.build_corpus import fixed_windows, tokenize_split

log = logging.getLogger(__name__)


@dataclass
class TrainConfig:
    out: Path
    corpus: Path = Path("data/corpus")
    ckpt_dir: Path = Path("runs/train_base")
    num_layers: int = 16
    hidden_size: int = 320
    num_heads: int = 5
    num_kv_heads: int = 5
    intermediate_size: int = 864
    max_position: int = 1024
    seq_len: int = 512
    batch_size: int = 8
    lr: float = 1.5e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 40
    weight_decay: float = 0.1
    max_steps: int = 100_000
    time_budget_min: float = 80.0
    log_every: int = 5
    eval_every: int = 100
    ckpt_every_s: float = 300.0
    seed: int = 0
    threads: int = 0  # 0: torch default

    def __post_init__(self) -> None:
        self.out, self.corpus, self.ckpt_dir = Path(self.out), Path(self.corpus), Path(self.ckpt_dir)
        if self.num_layers < 1 or self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} must divide into {self.num_heads} heads")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} must be a multiple of num_kv_heads {self.num_kv_heads}")
        if self.seq_len > self.max_position:
            raise ValueError(f"seq_len {self.seq_len} exceeds max_position {self.max_position}")
        if not (self.out / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{self.out / 'tokenizer.json'} not found: run tools.train_tokenizer first")


def sample_batch(stream: np.ndarray, batch: int, seq_len: int, rng: np.random.Generator) -> torch.Tensor:
    starts = rng.integers(0, len(stream) - seq_len - 1, size=batch)
    return torch.from_numpy(np.stack([stream[s : s + seq_len + 1] for s in starts]).astype(np.int64))


@torch.no_grad()
def evaluate(model, windows: torch.Tensor, device: str, batch: int = 8) -> dict:
    """Mean next-token loss and greedy next-token accuracy over windows [N, T+1]."""
    model.eval()
    total_loss, total_correct, total = 0.0, 0, 0
    for i in range(0, len(windows), batch):
        w = windows[i : i + batch].to(device)
        logits = model(input_ids=w[:, :-1]).logits.float()
        tgt = w[:, 1:]
        total_loss += torch.nn.functional.cross_entropy(logits.flatten(0, 1), tgt.flatten(), reduction="sum").item()
        total_correct += (logits.argmax(-1) == tgt).sum().item()
        total += tgt.numel()
    model.train()
    loss = total_loss / total
    return {"loss": loss, "ppl": math.exp(loss), "next_token_acc": total_correct / total, "tokens": total}


def lr_at(cfg: TrainConfig, step: int, elapsed_s: float) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, max(step / cfg.max_steps, elapsed_s / (cfg.time_budget_min * 60)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def build_model(cfg: TrainConfig, tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(cfg.seed)
    return LlamaForCausalLM(config)


def save_checkpoint(path: Path, model, opt, step: int, elapsed: float) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "elapsed": elapsed}, tmp)
    os.replace(tmp, path)  # atomic: a crash never leaves a half-written last.pt


def train(cfg: TrainConfig) -> dict:
    from transformers import AutoTokenizer

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = AutoTokenizer.from_pretrained(cfg.out)
    cache = cfg.ckpt_dir / "tokens"
    train_stream = tokenize_split(cfg.corpus, "train", tokenizer, cache)
    held_stream = tokenize_split(cfg.corpus, "heldout", tokenizer, cache)
    log.info("train tokens %d, held-out tokens %d", len(train_stream), len(held_stream))
    eval_windows = fixed_windows(held_stream, 32, cfg.seq_len)

    model = build_model(cfg, tokenizer).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(0.9, 0.95), fused=device == "cuda",
    )
    cfg.ckpt_dir.mkdir(parents=True, exist_ok=True)
    ckpt_path = cfg.ckpt_dir / "last.pt"
    step, elapsed = 0, 0.0
    if ckpt_path.is_file():
        state = torch.load(ckpt_path, map_location=device, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step, elapsed = state["step"], state["elapsed"]
        log.info("resumed from %s at step %d (%.0f s)", ckpt_path, step, elapsed)
    log_path = cfg.ckpt_dir / "log.jsonl"
    tokens_per_step = cfg.batch_size * cfg.seq_len
    t_last, last_ckpt = time.perf_counter(), time.perf_counter()
    model.train()
    while step < cfg.max_steps and elapsed < cfg.time_budget_min * 60:
        lr = lr_at(cfg, step, elapsed)
        for g in opt.param_groups:
            g["lr"] = lr
        batch = sample_batch(train_stream, cfg.batch_size, cfg.seq_len, np.random.default_rng(cfg.seed * 1_000_003 + step)).to(device)
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=device == "cuda"):
            logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        now = time.perf_counter()
        dt, t_last = now - t_last, now
        elapsed += dt
        record = {"step": step, "loss": round(loss.item(), 4), "lr": lr, "tokens_seen": step * tokens_per_step,
                  "tokens_per_s": round(tokens_per_step / dt, 1), "elapsed_s": round(elapsed, 1)}
        if step % cfg.eval_every == 0:
            record["heldout"] = evaluate(model, eval_windows, device)
        if step % cfg.log_every == 0 or "heldout" in record:
            print(json.dumps(record), flush=True)
            with open(log_path, "a") as f:
                f.write(json.dumps(record) + "\n")
        if now - last_ckpt > cfg.ckpt_every_s:
            save_checkpoint(ckpt_path, model, opt, step, elapsed)
            last_ckpt = time.perf_counter()
            t_last = last_ckpt  # checkpoint time is not training time
    save_checkpoint(ckpt_path, model, opt, step, elapsed)

    final = evaluate(model, fixed_windows(held_stream, 256, cfg.seq_len), device)
    held_bytes = json.loads((cfg.corpus / "manifest.json").read_text())["heldout"]["bytes"]
    final["bits_per_byte"] = final["loss"] / math.log(2) * len(held_stream) / held_bytes
    summary = {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()},
        "params": n_params, "steps": step, "tokens_seen": step * tokens_per_step, "train_time_s": round(elapsed, 1),
        "device": torch.cuda.get_device_name() if device == "cuda" else f"cpu x{torch.get_num_threads()} threads",
        "heldout": final, "torch": torch.__version__,
    }
    model.to(torch.bfloat16).save_pretrained(cfg.out, safe_serialization=True)
    (cfg.out / "train_log.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary), flush=True)
    return summary


def main(argv: list[str] | None = None) -> None:
    train(parse_config(TrainConfig, __doc__, argv, out=Path("models/specee-tiny")))


if __name__ == "__main__":
    main()
