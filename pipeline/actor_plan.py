"""How a CPU job splits this machine's cores among engine actors: a actors of t threads each (a x t = the cores),
measured once per machine and workload, and cached.

Which layout decodes more tokens per second depends on the machine (cores, memory bandwidth), the model, the
weight format, the mode and the batch size: one engine of all the threads shares its Python and its per-step
work among none, two engines of half the threads each split the memory bandwidth. So it is measured: for each
layout, a worker processes (plain subprocesses: no Ray; each an engine with t threads, built as the job builds
its actors; one actor of every core runs in this process) load and warm up once, then decode the same batch of
prompts at once on each of the layout's turns, the layouts taking turns; a turn's rate is their tokens over the
slowest one's seconds, a layout's the median of its turns. Before that the machine's other plans (weight format,
the auto mode's costs) are measured in this process for each thread count, alone, so the workers read them and
time only decoding.
The result is cached under $SPECEE_CACHE/actor_plans (specee_core.machine.cache_path), keyed by machine, torch,
cores, model shape and workload; one process at a time measures (measuring_lock).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import torch

from specee_core.machine import machine_name, measured_once

log = logging.getLogger(__name__)
CACHE_FOLDER = "actor_plans"
VERSION = 3
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
    tokens: int = 16  # a turn's new tokens per row (the turns, not one long run, carry the measurement)

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


ROUNDS = 3  # turns each layout takes at most, alternating with the others
DECIDED_MARGIN = {1: 1.3, 2: 1.1}  # after that many turns each, a lead this wide ends the measurement


def _prompts(engine, batch: int) -> list[str]:
    texts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
    return [engine.chat_prompt([{"role": "user", "content": t}]) for t in texts] if engine.has_chat_template else texts


def _decode(engine, w: Workload, prompts: list[str]) -> dict:
    from specee_core import SamplingParams

    t0 = time.perf_counter()
    params = SamplingParams(max_new_tokens=w.tokens, ignore_eos=True)
    res = engine.generate(prompts, mode=w.mode, sampling_params=params)
    return {"tokens": sum(len(r.token_ids) for r in res), "seconds": time.perf_counter() - t0}


def _warm_up(engine, w: Workload, prompts: list[str]) -> None:
    from specee_core import SamplingParams

    engine.generate(prompts, mode=w.mode, sampling_params=SamplingParams(max_new_tokens=4))


class _Workers:
    """`actors` worker processes of `threads` threads each, each an engine as the job's actors build it: started
    (load, warm-up) once, then on every turn all decode w's batch at once; the turn's rate is their tokens over
    the slowest one's seconds."""

    def __init__(self, w: Workload, actors: int, threads: int, timeout_s: float):
        cmd = [sys.executable, "-m", "pipeline.actor_plan", "--worker", json.dumps({**asdict(w), "threads": threads})]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        self.timeout_s = timeout_s
        self.procs = [subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
                      for _ in range(actors)]

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        for p in self.procs:  # each loads and warms up, then waits for a turn
            line = p.stdout.readline().strip()
            if line != "ready" or time.monotonic() > deadline:
                raise RuntimeError(f"an actor-plan worker did not start (said {line!r}, exit {p.poll()})")

    def turn(self) -> float:
        for p in self.procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        got = [json.loads(p.stdout.readline()) for p in self.procs]
        return sum(g["tokens"] for g in got) / max(g["seconds"] for g in got)

    def close(self) -> None:  # a worker exits when its input ends; one that does not is stopped
        for p in self.procs:
            try:
                p.stdin.close()
                p.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                p.kill()
                p.wait()


def measure_layouts(w: Workload, options: list[tuple[int, int]], rounds: int = ROUNDS, timeout_s: float = 300.0,
                    engine=None) -> dict[str, list[float]]:
    """{"<a>x<t>": tokens/s per turn}: each layout decodes w's batch `rounds` times, the layouts taking turns (the
    order alternating), so the machine's drift hits each alike. One actor of every core decodes in this process
    (engine: one built for it already); each other layout's worker processes start once, side by side, while
    this one loads and warms up (nothing is timed until every one is ready)."""
    before = torch.get_num_threads()
    sets = {(a, t): _Workers(w, a, t, timeout_s) for a, t in options if a > 1}
    try:
        here = next(((a, t) for a, t in options if a == 1), None)
        prompts = None
        if here is not None:
            engine = engine or w.engine(here[1])
            torch.set_num_threads(here[1])
            prompts = _prompts(engine, w.batch)
            _warm_up(engine, w, prompts)
        for s in sets.values():
            s.wait_ready()
        rates: dict[str, list[float]] = {f"{a}x{t}": [] for a, t in options}
        for rnd in range(rounds):
            if rnd and _decided(rates, rnd):
                break
            for a, t in (options if rnd % 2 == 0 else options[::-1]):
                if a == 1:
                    torch.set_num_threads(t)
                    got = _decode(engine, w, prompts)
                    rates[f"{a}x{t}"].append(got["tokens"] / got["seconds"])
                else:
                    rates[f"{a}x{t}"].append(sets[a, t].turn())
        return rates
    finally:
        for s in sets.values():
            s.close()
        torch.set_num_threads(before)


def _decided(rates: dict[str, list[float]], turns: int) -> bool:
    """Whether the layouts' turns so far settle it: the leader's median ahead of every other's by
    DECIDED_MARGIN[turns] (a wide lead after one turn each, a narrower one after two); a near tie takes every
    round."""
    margin = DECIDED_MARGIN.get(turns)
    if margin is None:
        return False
    med = sorted((statistics.median(v) for v in rates.values()), reverse=True)
    return len(med) < 2 or med[0] >= margin * med[1]


def _worker(spec: dict) -> None:
    threads = spec.pop("threads")
    w = Workload(**spec)
    engine = w.engine(threads)
    prompts = _prompts(engine, w.batch)
    _warm_up(engine, w, prompts)
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() != "go":
            break
        print(json.dumps(_decode(engine, w, prompts)), flush=True)


def plan_layout(w: Workload, cpus: int | None = None, root=None, measure=measure_layouts) -> dict:
    """{"actors", "threads", "tokens_per_s": {"<a>x<t>": median rate}, "rounds", "reason"}: the measured best layout
    of this machine's cores for w, from the cache when it was measured before (measure(w, options): each layout's
    rates, turn by turn)."""
    from specee_core.model.config import ModelConfig
    from specee_core.model.loader import find_model_dir

    cpus = cpus or local_cpus()
    c = ModelConfig.from_file(find_model_dir(w.model) / "config.json")
    key = {"actor_plan_version": VERSION, "machine": machine_name(torch.device("cpu")), "torch": torch.__version__,
           "cpus": cpus, "workload": asdict(w), "model_shape": [c.num_hidden_layers, c.hidden_size,
                                                                c.intermediate_size, c.vocab_size]}

    def measure_all() -> dict:
        options = layouts(cpus)
        if len(options) == 1:
            return {"actors": 1, "threads": cpus, "tokens_per_s": {}, "rounds": {},
                    "reason": f"one actor of {cpus} thread(s): the only layout"}
        t0 = time.perf_counter()
        if measure is measure_layouts:
            before = torch.get_num_threads()
            kept = None
            try:  # the other plans each thread count needs, measured here alone: the workers read them
                for t in sorted({t for _, t in options}):
                    engine = w.engine(t)
                    if w.mode == "auto":
                        engine.prepare_plan([w.batch])
                    if t == cpus:  # one actor of every core: it decodes in this process
                        kept = engine
                    del engine
            finally:
                torch.set_num_threads(before)
            log.info("actor plan: the weight and cost plans of %s threads measured in %.0f s",
                     sorted({t for _, t in options}), time.perf_counter() - t0)
            t0 = time.perf_counter()
            runs = measure(w, options, engine=kept)
            del kept
        else:
            runs = measure(w, options)
        rates = {k: statistics.median(v) for k, v in runs.items()}
        best = max(options, key=lambda o: rates[f"{o[0]}x{o[1]}"])
        shown = ", ".join(f"{k} {v:.1f}" for k, v in rates.items())
        plan = {"actors": best[0], "threads": best[1], "tokens_per_s": rates,
                "rounds": {k: [round(x, 1) for x in v] for k, v in runs.items()},
                "reason": f"{best[0]} actors x {best[1]} threads on {cpus} cores: the fastest measured here "
                          f"(tokens/s, medians of {len(next(iter(runs.values())))} turn(s) taken in alternation, "
                          f"actors x threads: {shown})"}
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
