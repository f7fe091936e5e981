"""The batch job's fault probes on SmolLM2, each a real `python -m jobs.generate` process (one engine actor):

1. poison: 6 good rows and 2 rows whose prompt kills the engine process (SPECEE_PIPELINE_CRASH_ON), batch 8;
2. spread: 3 such rows over two batches of 8 and one row that hangs (SPECEE_PIPELINE_HANG_ON), a 60 s
   per-batch timeout;
3. kill: 64 rows, 8 per part file; the driver is SIGKILLed once 3 part files exist, then the job is resumed;
   the resume is then repeated with another --max-new-tokens (refused, naming the difference) and with one
   prompt edited under its old id (that row alone is generated again).

Prints one JSON object: per probe the wall time, the return code, rows, error rows and what each says.

    python scripts/probe_faults.py > docs/probe_faults.json
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

REPO = Path(__file__).resolve().parents[1]
QUESTIONS = [json.loads(line)["prompt"] for line in open(REPO / "prompts" / "instructions_heldout.jsonl")]


def job(out: Path, src: Path, *extra: str, env: dict | None = None, wait: bool = True):
    cmd = [sys.executable, "-m", "jobs.generate", "--input", str(src), "--output", str(out), "--num-actors", "1",
           "--address", "local", "--no-progress", "--max-new-tokens", "16", "--batch-size", "8", *extra]
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    return proc.communicate() + (proc.returncode,) if wait else proc


def write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def verdict(out: Path, wall: float, rc: int, stderr: str) -> dict:
    df = pd.read_parquet(out)
    bad = df[df["error"].notna()]
    return {"wall_s": round(wall, 1), "returncode": rc, "rows": len(df), "ids_unique": bool(df["id"].is_unique),
            "error_rows": {r.id: r.error[:140] for r in bad.itertuples()},
            "stderr_tail": stderr.strip().splitlines()[-1][:300] if rc else None}


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="probe-faults-"))
    report = {"machine": subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu."
                                         "get_cpu_capability())"], capture_output=True, text=True).stdout.strip(),
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                       text=True).stdout.strip()}
    good = [{"id": f"g{i}", "prompt": q} for i, q in enumerate(QUESTIONS[:12])]
    crash = {"SPECEE_PIPELINE_CRASH_ON": "POISON", "SPECEE_PIPELINE_HANG_ON": "HANG"}

    rows = good[:3] + [{"id": "p1", "prompt": "POISON"}] + good[3:6] + [{"id": "p2", "prompt": "POISON"}]
    t0 = time.perf_counter()
    _, err, rc = job(tmp / "poison", write(tmp / "poison.jsonl", rows), env=crash)
    report["poison"] = verdict(tmp / "poison", time.perf_counter() - t0, rc, err)

    rows = (good[:2] + [{"id": "p1", "prompt": "POISON"}] + good[2:4] + [{"id": "p2", "prompt": "POISON"}]
            + good[4:6] + good[6:8] + [{"id": "p3", "prompt": "POISON"}, {"id": "h1", "prompt": "HANG"}] + good[8:12])
    t0 = time.perf_counter()
    _, err, rc = job(tmp / "spread", write(tmp / "spread.jsonl", rows), "--batch-timeout", "60", env=crash)
    report["spread"] = verdict(tmp / "spread", time.perf_counter() - t0, rc, err)

    many = [{"id": f"k{i}", "prompt": QUESTIONS[i % len(QUESTIONS)]} for i in range(64)]
    src = write(tmp / "kill.jsonl", many)
    out = tmp / "kill"
    t0 = time.perf_counter()
    proc = job(out, src, "--rows-per-file", "8", wait=False)
    while len(list(out.glob("part-*.parquet"))) < 3 and proc.poll() is None:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_with = len(list(out.glob("part-*.parquet")))
    _, err, rc = job(out, src, "--rows-per-file", "8")
    report["kill"] = {"parts_when_killed": killed_with, **verdict(out, time.perf_counter() - t0, rc, err)}
    _, err, rc = job(out, src, "--rows-per-file", "8", "--max-new-tokens", "8")
    report["kill"]["resume_other_max_new_tokens"] = {"returncode": rc, "says": err.strip().splitlines()[-1][:300]}
    edited = many[:5] + [{"id": "k5", "prompt": "Name a Python keyword."}] + many[6:]
    _, err, rc = job(out, write(tmp / "kill.jsonl", edited), "--rows-per-file", "8")
    df = pd.read_parquet(out).set_index("id")
    report["kill"]["edited_prompt"] = {"returncode": rc, "ids_unique": bool(df.index.is_unique), "rows": len(df),
                                       "k5_prompt": df.loc["k5", "prompt"]}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
