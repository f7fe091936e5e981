"""generate() decode tokens/s with every default (bf16 weights here), per mode at batch 1 and 16, best of 3:
the side-by-sides of docs/bench_core_side_by_side.json and docs/bench_proposer_side_by_side.json ran this in a
worktree of each commit, interleaved.

    python scripts/generate_speed.py [mode ...]   # from the root of the checkout to measure; default: dense auto
"""
import json
import os
import sys
import time

import torch

sys.path.insert(0, ".")
from jobs.cli import git_commit  # noqa: E402
from specee_core import SpecEEEngine  # noqa: E402

torch.set_num_threads(2)
# SPECEE_BENCH_WEIGHTS pins the weight format (side by sides: "auto" measures, and may pick another format per run)
e = SpecEEEngine.from_pretrained("models/smollm2-135m-instruct", max_batch_size=16,
                                 weights=os.environ.get("SPECEE_BENCH_WEIGHTS", "auto"))
qs = ["Write a Python function that reverses a string.", "What is the capital of France?", "Explain recursion briefly.",
      "List three fruits.", "How do airplanes fly?", "Describe a cat.", "What is 17 times 3?", "Name a famous painter."]
ps = [e.chat_prompt([{"role": "user", "content": q + f" ({i})"}]) for i, q in enumerate(qs * 2)]
out = {"git_commit": git_commit(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
       "weights": e.model.weight_format, "dtype": str(e.model.dtype)}
for mode in sys.argv[1:] or ("dense", "auto"):
    for b in (1, 16):
        e.generate(ps[:b], max_new_tokens=8, mode=mode, ignore_eos=True)
        best = 0.0
        for _ in range(3):
            r = e.generate(ps[:b], max_new_tokens=64, mode=mode, ignore_eos=True)
            best = max(best, sum(x.metrics["decode_tokens_per_s"] for x in r) / len(r) * b)
        out[f"{mode}_b{b}"] = round(best, 1)
print(json.dumps(out))
