"""How a CPU job splits this machine's cores among engine actors: a actors of t threads each (a x t = the cores),
measured once per machine and workload, and cached.

Which layout decodes more tokens per second depends on the machine (cores, memory bandwidth), the model, the
weight format, the mode and the batch size: one engine of all the threads shares its Python and its per-step
work among none, two engines of half the threads each split the memory bandwidth. So it is measured: for each
layout, a worker processes (plain subprocesses: no Ray; each an engine with t threads, built as the job builds
its actors) load, warm up, then decode the same batch of prompts at once; the layout's rate is their tokens
over the slowest one's seconds. Before that the machine's other plans (weight format, the auto mode's costs)
are measured in this process for each thread count, alone, so the workers read them and time only decoding.
The result is cached under $SPECEE_CACHE/actor_plans (specee_core.machine.cache_path), keyed by machine, torch,
cores, model shape and workload; one process at a time measures (measuring_lock).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import torch

from specee_core.machine import machine_name, measured_once

log = logging.getLogger(__name__)
CACHE_FOLDER = "actor_plans"
VERSION = 2
MAX_ACTORS = 8
# what the workers decode: generic instructions, as a job's rows are (the layout's ranking, not its absolute rate,
# is what is kept)
PROMPTS = ("Explain what a hash table is.", "Write a haiku about rain.", "List three uses of Python's zip.",
           "Summarize the plot of Hamlet in two sentences.", "What is the difference between a list and a tuple?",
           "Give a recipe for pancakes.", "Why is the sky blue?", "Describe a binary search.")


@dataclass(frozen=True)
class Workload:
    """What the job's actors run: the engine as they build it, and how much a worker decodes."""
    model: str
    mode: str = "auto"
    weights: str = "auto"
    dtype: str = "auto"
    batch: int = 16
    tokens: int = 32

    def engine(self, threads: int):
        from specee_core import SpecEEEngine

        torch.set_num_threads(threads)
        return SpecEEEngine.from_pretrained(self.model, dtype=self.dtype, weights=self.weights,
                                            max_batch_size=self.batch)


def layouts(cpus: int) -> list[tuple[int, int]]:
    """(actors, threads per actor) that use every core: a in the divisors of cpus, up to MAX_ACTORS."""
    if cpus < 1:
        raise ValueError(f"cpus must be >= 1, got {cpus}")
    return [(a, cpus // a) for a in range(1, min(cpus, MAX_ACTORS) + 1) if cpus % a == 0]


def local_cpus() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def measure_layout(w: Workload, actors: int, threads: int, timeout_s: float = 300.0) -> float:
    """Tokens/s of `actors` worker processes of `threads` threads each, decoding w's batch at once."""
    cmd = [sys.executable, "-m", "pipeline.actor_plan", "--worker", json.dumps({**asdict(w), "threads": threads})]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    procs = [subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
             for _ in range(actors)]
    try:
        deadline = time.monotonic() + timeout_s
        for p in procs:  # each loads and warms up, then waits for the others
            line = p.stdout.readline().strip()
            if line != "ready" or time.monotonic() > deadline:
                raise RuntimeError(f"an actor-plan worker did not start (said {line!r}, exit {p.poll()})")
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        got = [json.loads(p.stdout.readline()) for p in procs]
    finally:  # a worker exits once it has answered; one that has not is stopped
        for p in procs:
            try:
                p.stdin.close()
                p.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                p.kill()
                p.wait()
    return sum(g["tokens"] for g in got) / max(g["seconds"] for g in got)


def _worker(spec: dict) -> None:
    threads = spec.pop("threads")
    w = Workload(**spec)
    from specee_core import SamplingParams

    engine = w.engine(threads)
    texts = [PROMPTS[i % len(PROMPTS)] for i in range(w.batch)]
    prompts = [engine.chat_prompt([{"role": "user", "content": t}]) for t in texts] if engine.has_chat_template else texts
    engine.generate(prompts, mode=w.mode, sampling_params=SamplingParams(max_new_tokens=4))  # warm up
    print("ready", flush=True)
    sys.stdin.readline()
    t0 = time.perf_counter()
    res = engine.generate(prompts, mode=w.mode, sampling_params=SamplingParams(max_new_tokens=w.tokens, ignore_eos=True))
    print(json.dumps({"tokens": sum(len(r.token_ids) for r in res), "seconds": time.perf_counter() - t0}), flush=True)


def plan_layout(w: Workload, cpus: int | None = None, root=None, measure=measure_layout) -> dict:
    """{"actors", "threads", "tokens_per_s": {"<a>x<t>": rate}, "reason"}: the measured best layout of this machine's
    cores for w, from the cache when it was measured before (measure: how a layout is timed)."""
    from specee_core.model.config import ModelConfig
    from specee_core.model.loader import find_model_dir

    cpus = cpus or local_cpus()
    c = ModelConfig.from_file(find_model_dir(w.model) / "config.json")
    key = {"actor_plan_version": VERSION, "machine": machine_name(torch.device("cpu")), "torch": torch.__version__,
           "cpus": cpus, "workload": asdict(w), "model_shape": [c.num_hidden_layers, c.hidden_size,
                                                                c.intermediate_size, c.vocab_size]}

    def measure_all() -> dict:
        options = layouts(cpus)
        if len(options) > 1 and measure is measure_layout:
            before = torch.get_num_threads()
            try:  # the other plans each thread count needs, measured here alone: the workers read them
                for t in sorted({t for _, t in options}):
                    engine = w.engine(t)
                    if w.mode == "auto":
                        engine.prepare_plan([w.batch])
                    del engine
            finally:
                torch.set_num_threads(before)
        t0 = time.perf_counter()
        rates = {f"{a}x{t}": (measure(w, a, t) if len(options) > 1 else 0.0) for a, t in options}
        best = max(options, key=lambda o: rates[f"{o[0]}x{o[1]}"])
        shown = ", ".join(f"{k} {v:.1f}" for k, v in rates.items())
        plan = {"actors": best[0], "threads": best[1], "tokens_per_s": rates,
                "reason": f"{best[0]} actors x {best[1]} threads on {cpus} cores: the fastest measured here "
                          f"(tokens/s, actors x threads: {shown})" if len(options) > 1 else
                          f"one actor of {cpus} thread(s): the only layout"}
        log.info("actor plan: %s (measured in %.0f s)", plan["reason"], time.perf_counter() - t0)
        return plan

    return measured_once(key, measure_all, "actor plan", root, CACHE_FOLDER)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="a measuring worker (internal), or print this machine's plan")
    ap.add_argument("--worker", help="(internal) the workload to decode, JSON")
    ap.add_argument("--model", default="models/smollm2-135m-instruct")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--mode", default="auto")
    args = ap.parse_args()
    if args.worker:
        logging.basicConfig(level=logging.WARNING)
        _worker(json.loads(args.worker))
    else:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        print(json.dumps(plan_layout(Workload(args.model, mode=args.mode, batch=args.batch)), indent=1))
