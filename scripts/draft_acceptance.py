"""Tokens per verify step of lossless speculative decoding with two draft heads on the same base model.

    python scripts/draft_acceptance.py OLD_MODEL_DIR NEW_MODEL_DIR

Each directory is a model directory (base weights + draft/); e.g. the old draft: a copy of
models/smollm2-135m-instruct with draft/ from `git show <commit>:models/smollm2-135m-instruct/draft/...`.
8 held-out instructions x 64 greedy tokens, fp32 activations on q4 weights; prints JSON.
"""
import json, subprocess, sys

import torch

from specee_core import SpecEEEngine
from jobs.make_distill_data import read_prompts, render_prompt
torch.set_num_threads(1)
rows = read_prompts("prompts/instructions_heldout.jsonl")[:8]
out = {"commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
       "cpu_capability": torch.backends.cpu.get_cpu_capability(), "prompts": 8, "max_new_tokens": 64}
engines = {name: SpecEEEngine.from_pretrained(path, dtype="float32", weights="q4") for name, path in
           [("old draft", sys.argv[1]), ("new draft", sys.argv[2])]}
prompts = [render_prompt(next(iter(engines.values())), r["prompt"]) for r in rows]
for shape in ({"depth": 4, "width": 1}, {"depth": 5, "width": 4, "nodes": 12}):
    for name, eng in engines.items():
        res = eng.generate(prompts, max_new_tokens=64, mode="spec", spec={"proposer": "draft", "step_budget": None, **shape})
        tps = [r.stats["mean_tokens_per_step"] for r in res]
        out[f"{name} {shape}"] = round(sum(tps) / len(tps), 3)
        print(name, shape, out[f"{name} {shape}"], flush=True)
print(json.dumps(out))
