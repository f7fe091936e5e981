"""Prefix cache benchmark: prompts that share a long system prompt, each with its own question, prefilled
with the engine core's prefix cache on and off (interleaved rounds), in dense and auto modes. Reports the
prefill time (generate with one new token: the prompts' prefill and the first token's choice), the ratio,
and whether the tokens of a longer generation are the same (fp32).

    python -m tools.bench_prefix --out docs/bench_prefix_cache.json
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

from jobs.cli import emit_json, parse_config
from specee_core import SpecEEEngine
from specee_core.machine import machine_facts

QUESTIONS = ["How do I reverse a list in Python?", "What is the capital of Australia and why was it chosen?",
             "Explain the difference between a process and a thread.", "Write a haiku about autumn leaves.",
             "What causes the seasons on Earth?", "Give three tips for writing clear emails.",
             "How does a hash table handle collisions?", "What is the boiling point of water at high altitude?"]


@dataclass
class Config:
    model: str = "models/smollm2-135m-instruct"
    prompts: int = 64
    system_tokens: int = 500
    batch_size: int = 16
    modes: str = "dense,auto"
    rounds: int = 2  # timed rounds after a warm-up round; the fastest counts
    check_tokens: int = 16
    out: str | None = None


def system_prompt(engine: SpecEEEngine, tokens: int) -> str:
    """A system prompt of about `tokens` tokens: house rules, numbered (distinct text, no repetition)."""
    lines, text = [], ""
    i = 0
    while len(engine.tokenizer(text)["input_ids"]) < tokens:
        i += 1
        lines.append(f"Rule {i}: when a user asks about topic number {i * 7 % 97}, answer politely, cite rule {i}, "
                     f"and keep the answer under {20 + i} words.")
        text = "You are a helpful assistant for the SpecEE help desk.\n" + "\n".join(lines)
    return text


def run(cfg: Config) -> dict:
    from jobs.cli import git_commit

    engine = SpecEEEngine.from_pretrained(cfg.model, dtype="float32", weights="fp32", max_batch_size=cfg.batch_size)
    system = system_prompt(engine, cfg.system_tokens)
    prompts = [engine.chat_prompt([{"role": "system", "content": system},
                                   {"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} (ticket {i})"}])
               for i in range(cfg.prompts)]
    lens = [len(engine.encode_prompt(p)) for p in prompts]
    modes = cfg.modes.split(",")
    def fresh(on: bool) -> SpecEEEngine:
        """An engine on the same model with the prefix cache on or off, and a new core (an empty cache)."""
        twin = SpecEEEngine(engine.model, engine.tokenizer, replace(engine.options, prefix_cache=on),
                            engine.early_exit, engine.draft)
        if "auto" in modes:
            twin.prepare_plan([cfg.batch_size])
        return twin

    times: dict[tuple[str, bool], list[float]] = {}
    tokens: dict[tuple[str, bool], list[list[int]]] = {}
    cached: dict[tuple[str, bool], int] = {}
    for r in range(cfg.rounds + 1):  # round 0 warms up
        for mode in modes:
            for on in (False, True):
                twin = fresh(on)
                t0 = time.perf_counter()
                res = twin.generate(prompts, max_new_tokens=1, mode=mode)
                dt = time.perf_counter() - t0
                if r:
                    times.setdefault((mode, on), []).append(dt)
                    cached[(mode, on)] = sum(x.cached_prompt_tokens for x in res)
                print(f"[bench_prefix] round {r} {mode} prefix_cache={on}: {dt:.2f} s", flush=True)
    for mode in modes:
        for on in (False, True):
            tokens[(mode, on)] = [x.token_ids for x in fresh(on).generate(prompts, max_new_tokens=cfg.check_tokens,
                                                                          mode=mode)]
    results = []
    for mode in modes:
        off, on = min(times[(mode, False)]), min(times[(mode, True)])
        results.append({"mode": mode, "prefill_s_no_cache": round(off, 3), "prefill_s_cache": round(on, 3),
                        "speedup": round(off / on, 2), "cached_prompt_tokens": cached[(mode, True)],
                        "prompt_tokens": sum(lens), "same_tokens": tokens[(mode, False)] == tokens[(mode, True)],
                        "rounds_s": {"no_cache": times[(mode, False)], "cache": times[(mode, True)]}})
    out = {"benchmark": "tools.bench_prefix", "git_commit": git_commit(), "config": vars(cfg),
           "machine": machine_facts(engine.device), "torch": torch.__version__,
           "cpu_capability": torch.backends.cpu.get_cpu_capability(), "dtype": "float32",
           "prompt_tokens_each": {"min": min(lens), "max": max(lens)}, "results": results}
    return out


def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(Config, __doc__, argv)
    emit_json(run(cfg), cfg.out)


if __name__ == "__main__":
    main()
