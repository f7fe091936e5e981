"""Serve throughput with the app's defaults: `serve run pipeline.serve:app` from the checkout it runs in, 16 concurrent
chat completions x 64 tokens (greedy), a warm-up wave and 3 timed waves; prints JSON (tokens/s per wave).
docs/bench_core_side_by_side.json ran it in a worktree of each commit, interleaved.

    python scripts/serve_throughput.py
"""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx

sys.path.insert(0, ".")
from tools.probe_serve_memory import start_server  # noqa: E402

url = "http://127.0.0.1:8000"
srv = start_server(url)
try:
    qs = ["Write a story about a cat.", "Explain how rain forms.", "List ten fruits and their colors.",
          "Describe a busy market.", "How do computers store numbers?", "Write a poem about the sea.",
          "Explain photosynthesis.", "Describe your ideal city."]
    def one(i, res):
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": qs[i % 8] + f" ({i})"}],
                       "max_tokens": 64, "temperature": 0}, timeout=300).json()
        res[i] = r["usage"]["completion_tokens"]
    waves = []
    for w in range(4):
        res = [0] * 16
        th = [threading.Thread(target=one, args=(i, res)) for i in range(16)]
        t = time.time()
        for x in th: x.start()
        for x in th: x.join()
        dt = time.time() - t
        if w:
            waves.append(round(sum(res) / dt, 1))
    print(json.dumps({"cwd": os.getcwd(), "tokens_per_s_per_wave": waves, "best": max(waves)}))
finally:
    os.killpg(srv.pid, signal.SIGINT)
    try:
        srv.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(srv.pid, signal.SIGKILL)
