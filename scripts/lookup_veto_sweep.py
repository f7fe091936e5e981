"""The lookup veto's effect on the calibration tokens: per shortest lookup n-gram (0 = no veto) and tolerance,
the layers the certified thresholds let exit and the layers run, simulated on the calibration decode data
with the engine's rules (shallowest firing layer; no exit right after an exit: Stepper.no_chain).

    python scripts/lookup_veto_sweep.py [runs/train_predictors/exit_data_calib.pt] [models/smollm2-135m-instruct]

The decode data holds the calibration prompts' steps batch by batch (16 rows, every row 95 decode steps,
step-major within a batch); the script checks that layout against the draft's record (its first feature is
whether the row's previous top candidate was right). Prints JSON with the commit and the CPU capability.
"""
import json
import subprocess
import sys
from pathlib import Path

import torch

from jobs.train_predictors import calibration_counts
from specee_core.early_exit.calibration import Calibration
from specee_core.early_exit.predictors import PredictorBank

data = torch.load(sys.argv[1] if len(sys.argv) > 1 else "runs/train_predictors/exit_data_calib.pt", weights_only=True)
model = Path(sys.argv[2] if len(sys.argv) > 2 else "models/smollm2-135m-instruct")
bank = PredictorBank.load(model / "predictors.safetensors")
L, S = data["z"].shape[1] + 1, len(data["final"])
steps, batch = 95, 16
rows = S // steps
assert rows * steps == S, (S, steps)
prev = torch.full((S,), -1)  # the same row's previous step
i = 0
for b0 in range(0, rows, batch):
    nb = min(batch, rows - b0)
    idx = torch.arange(i, i + nb * steps).view(steps, nb)
    prev[idx[1:]] = idx[:-1]
    i += nb * steps
has = prev >= 0
last_hit = (data["cand"][prev[has], 0] == data["final"][prev[has]]).float()
assert torch.equal(data["record"][has, 0], last_hit), "the decode data's layout is not the one assumed"

out = {"commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
       "cpu_capability": torch.backends.cpu.get_cpu_capability(), "tokens": S, "prompts": rows, "runs": []}
for n in (0, 1, 2, 3):
    p_exit, agree, veto = calibration_counts(data, bank, n)
    cal = Calibration.count(p_exit, agree, prompts=rows, veto=veto or None, lookup_veto=n or None)
    for eps in (0.01, 0.02, 0.05, 0.1):
        th = {l: c.threshold for l, c in cal.thresholds(eps).items() if c.threshold is not None}
        layer, exited = cal.exit_layers(th, L).tolist(), [False] * S
        for t in range(S):  # no exit right after an exit (in step order: prev[t] < t)
            if prev[t] >= 0 and exited[prev[t]]:
                layer[t] = L
            exited[t] = layer[t] < L
        lay = torch.tensor(layer)
        ex = lay < L
        bad = sum(int(not cal.agree[t, cal.layers.index(int(lay[t]))]) for t in ex.nonzero().flatten().tolist())
        run = {"min_ngram": n, "eps": eps, "layers_run": round(lay.float().mean().item() / L, 4),
               "exits": int(ex.sum()), "disagreement": round(bad / max(int(ex.sum()), 1), 4), "thresholds": th}
        if veto:
            run["vetoed_share"] = round(torch.stack(list(veto.values())).float().mean().item(), 4)
        out["runs"].append(run)
        print(json.dumps(run), flush=True)
print(json.dumps(out))
