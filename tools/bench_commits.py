"""This checkout against another commit, side by side: the engine as a job builds it at each batch size, and the
batch job, in processes that alternate between the two trees round by round (a machine's speed moves over minutes;
alternating spreads that over both). What a change that should not change speed (a refactor) is checked with.

    python -m tools.bench_commits --base HEAD~3 --out docs/bench_commits.json
    python -m tools.bench_commits --base 3de8f50 --sizes 1,8,16,32 --rounds 3 --job-limit 96

The base commit is checked out in a temporary worktree (git worktree add --detach), removed at the end. Both sides
load the same model directory (--model: this checkout's, absolute); each process imports its own tree's code
(its working directory and PYTHONPATH). Per size: decode tokens/s of --tokens new tokens (ignore_eos) for N
held-out chat prompts at once (N=1: 4 prompts one after another), two timed calls after a warm-up, in mode --mode;
the batch job: `jobs.generate` with its defaults over --job-limit held-out prompts, its generating tokens/s. Prints
(and with --out writes) JSON with both commits and the machine.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from jobs.cli import emit_json, git_commit

REPO = Path(__file__).resolve().parents[1]

# run in each tree: only the public API, which both sides have
CHILD = r"""
import json, sys, time
import torch
from specee_core import SamplingParams, SpecEEEngine
model, n, mode, tokens, threads = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
torch.set_num_threads(threads)
rows = [json.loads(l) for l in open("prompts/instructions_heldout.jsonl")]
engine = SpecEEEngine.from_pretrained(model, max_batch_size=n)
prompts = [engine.chat_prompt([{"role": "user", "content": r["prompt"]}]) for r in rows[:max(n, 4)]]
sp = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
if mode == "auto":
    engine.prepare_plan([n])
engine.generate(prompts[:n], sampling_params=sp, mode=mode)
out = []
for _ in range(2):
    t = time.perf_counter()
    if n == 1:
        made = sum(len(engine.generate([p], sampling_params=sp, mode=mode)[0].token_ids) for p in prompts[:4])
    else:
        made = sum(len(r.token_ids) for r in engine.generate(prompts[:n], sampling_params=sp, mode=mode))
    out.append(made / (time.perf_counter() - t))
print(json.dumps({"tokens_per_s": out, "weights": engine.weights_reason}))
"""


def run_in(tree: Path, args: list[str], timeout: float = 1800) -> str:
    env = {**os.environ, "PYTHONPATH": str(tree), "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run([sys.executable, *args], cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:3])} in {tree} failed:\n{out.stderr[-2000:]}")
    return out.stdout


def engine_speed(tree: Path, model: str, n: int, mode: str, tokens: int, threads: int) -> list[float]:
    last = run_in(tree, ["-c", CHILD, model, str(n), mode, str(tokens), str(threads)]).strip().splitlines()[-1]
    return json.loads(last)["tokens_per_s"]


def job_speed(tree: Path, model: str, limit: int, tokens: int) -> dict:
    out = Path(tempfile.mkdtemp(prefix="bench_commits_job_"))
    try:
        run_in(tree, ["-m", "jobs.generate", "--model", model, "--output", str(out / "gen"), "--address", "local",
                      "--max-new-tokens", str(tokens), "--limit", str(limit), "--no-progress"])
        s = json.loads((out / "gen" / "_summary.json").read_text())
        return {k: s.get(k) for k in ("tokens_per_s", "wall_s", "completion_tokens", "num_actors", "weights")}
    finally:
        shutil.rmtree(out, ignore_errors=True)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="the commit to compare with (any git revision)")
    p.add_argument("--model", default=str(REPO / "models" / "smollm2-135m-instruct"))
    p.add_argument("--sizes", default="1,8,16,32")
    p.add_argument("--mode", default="auto")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--job-limit", type=int, default=96, help="held-out prompts of the batch job (0: no batch job)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    import torch

    from specee_core.machine import machine_facts

    base = subprocess.run(["git", "rev-parse", "--short", a.base], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout.strip()
    wt = Path(tempfile.mkdtemp(prefix="bench_commits_")) / base
    subprocess.run(["git", "worktree", "add", "--detach", "-q", str(wt), base], cwd=REPO, check=True)
    sides = {"base": wt, "this": REPO}
    sizes = [int(s) for s in a.sizes.split(",")]
    speed: dict[str, dict[int, list[float]]] = {s: {n: [] for n in sizes} for s in sides}
    jobs: dict[str, list[dict]] = {s: [] for s in sides}
    try:
        for r in range(a.rounds):
            order = list(sides) if r % 2 == 0 else list(sides)[::-1]
            for n in sizes:
                for side in order:
                    got = engine_speed(sides[side], a.model, n, a.mode, a.tokens, a.threads)
                    speed[side][n] += got
                    print(f"[bench_commits] round {r + 1} N={n} {side}: {[round(x, 1) for x in got]} tokens/s",
                          flush=True)
            if a.job_limit:
                for side in order:
                    jobs[side].append(job_speed(sides[side], a.model, a.job_limit, a.tokens))
                    print(f"[bench_commits] round {r + 1} batch job {side}: {jobs[side][-1]['tokens_per_s']} tokens/s",
                          flush=True)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(wt)], cwd=REPO, check=False)
    med = {s: {n: statistics.median(v) for n, v in speed[s].items()} for s in sides}
    result = {"benchmark": "tools.bench_commits", "git_commit": git_commit(), "base_commit": base,
              "config": vars(a), "machine": machine_facts(torch.device("cpu")), "torch": torch.__version__,
              "cpu_capability": torch.backends.cpu.get_cpu_capability(),
              "engine": {str(n): {"base_median": round(med["base"][n], 1), "this_median": round(med["this"][n], 1),
                                  "this_over_base": round(med["this"][n] / med["base"][n], 3),
                                  "base": [round(x, 1) for x in speed["base"][n]],
                                  "this": [round(x, 1) for x in speed["this"][n]]} for n in sizes}}
    if a.job_limit:
        jm = {s: statistics.median(j["tokens_per_s"] for j in jobs[s]) for s in sides}
        result["batch_job"] = {"base_median": jm["base"], "this_median": jm["this"],
                               "this_over_base": round(jm["this"] / jm["base"], 3), "runs": jobs}
    return emit_json(result, a.out)


if __name__ == "__main__":
    main()
