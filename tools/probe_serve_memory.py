"""Memory probe of the Serve app with its defaults: `serve run pipeline.serve:app` on loopback, then N
concurrent chat requests without max_tokens (so each may run to the end of the context), each at its own
temperature (each opens a lane of its own). Samples the machine's used memory (MemTotal - MemAvailable)
and /healthz while they run, for at most --seconds, then hangs up and stops the server.

    python -m tools.probe_serve_memory --out docs/serve_memory_probe.json
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import httpx

from jobs.cli import emit_json, parse_config


@dataclass
class Config:
    requests: int = 4
    seconds: float = 120.0  # how long the requests may run before the probe hangs up
    port: int = 8000
    out: str | None = None


def used_bytes() -> int:
    info = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, v = line.split(":")
            info[k] = int(v.split()[0]) * 1024
    return info["MemTotal"] - info["MemAvailable"]


def start_server(url: str, timeout_s: float = 600) -> subprocess.Popen:
    """`serve run pipeline.serve:app` with its defaults (a process group of its own), once /healthz answers."""
    serve_cli = os.path.join(os.path.dirname(sys.executable), "serve")
    server = subprocess.Popen([serve_cli, "run", "pipeline.serve:app"], start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t0 = time.time()
    while True:
        try:
            if httpx.get(f"{url}/healthz", timeout=5).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        if time.time() - t0 > timeout_s or server.poll() is not None:
            if server.poll() is None:
                os.killpg(server.pid, signal.SIGKILL)
            raise RuntimeError("the server did not become ready")
        time.sleep(2)


def run(cfg: Config) -> dict:
    from jobs.cli import git_commit
    from specee_core.machine import machine_facts

    url = f"http://127.0.0.1:{cfg.port}"
    server = start_server(url)
    try:
        time.sleep(3)
        ready = used_bytes()
        health = httpx.get(f"{url}/healthz", timeout=10).json()
        answers: list[dict] = [{} for _ in range(cfg.requests)]

        def ask(i: int) -> None:
            body = {"messages": [{"role": "user", "content": f"Write a long story about a lighthouse keeper, part {i}."}],
                    "temperature": 0.3 + 0.3 * i, "stream": True}
            chunks, start = 0, time.time()
            try:
                with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=cfg.seconds + 30) as r:
                    answers[i]["status"] = r.status_code
                    for line in r.iter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            chunks += 1
                        if time.time() - start > cfg.seconds:
                            answers[i]["hung_up"] = True
                            break
            except httpx.HTTPError as e:
                answers[i]["error"] = repr(e)
            answers[i].update(chunks=chunks, seconds=round(time.time() - start, 1))

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(cfg.requests)]
        for t in threads:
            t.start()
        peak, healthy, samples = ready, True, 0
        while any(t.is_alive() for t in threads):
            peak = max(peak, used_bytes())
            samples += 1
            try:
                healthy &= httpx.get(f"{url}/healthz", timeout=10).status_code == 200
            except httpx.HTTPError:
                healthy = False
            time.sleep(1.0)
        for t in threads:
            t.join()
        after = httpx.get(f"{url}/healthz", timeout=10).json()
    finally:
        os.killpg(server.pid, signal.SIGINT)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
    return {"probe": "tools.probe_serve_memory", "git_commit": git_commit(), "machine": machine_facts(),
            "config": vars(cfg), "used_gb_ready": round(ready / 2**30, 2),
            "peak_rise_gb": round((peak - ready) / 2**30, 2), "healthy_throughout": healthy, "samples": samples,
            "answers": answers, "kv_memory_ready": health.get("kv_memory"), "kv_memory_after": after.get("kv_memory")}


def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(Config, __doc__, argv)
    emit_json(run(cfg), cfg.out)


if __name__ == "__main__":
    main()
