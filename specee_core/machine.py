"""Facts of the machine at hand that the rest of the engine reads: native bf16, the dtype "auto" picks,
and the facts every speed figure is published with. Below every other module."""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import os
import platform
from pathlib import Path
from typing import Callable, TypeVar

import torch

log = logging.getLogger(__name__)
T = TypeVar("T")


def native_bf16(device: torch.device) -> bool:
    """Whether the hardware computes bf16 natively: CUDA with bf16 support, or a CPU whose oneDNN
    has a bf16 path (avx512_bf16 / AMX). Without it bf16 GEMMs are emulated and slower than fp32."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            return torch.cuda.is_bf16_supported(including_emulation=False)  # T4, V100: emulated, not native
    return cpu_has_native_bf16()


def cpu_has_native_bf16() -> bool:
    """oneDNN's own check: avx512_bf16, AMX or (on Arm) bf16 dot products."""
    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def choose_dtype(device: torch.device | str) -> tuple[torch.dtype, str]:
    """dtype "auto": bf16 where the hardware computes it natively, else fp32; with the reason."""
    device = torch.device(device)
    if native_bf16(device):
        return torch.bfloat16, f"bfloat16: {machine_name(device)} computes bf16 natively"
    return torch.float32, f"float32: {machine_name(device)} has no native bf16 (bf16 would be emulated, slower)"


def machine_name(device: torch.device) -> str:
    """What the costs depend on: the GPU's name, or the CPU's SIMD capability and model."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {torch.backends.cpu.get_cpu_capability()} ({cpu_model()})"


@functools.lru_cache(maxsize=1)
def cpu_model() -> str:  # read once: /healthz asks for the machine facts on every probe
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def resident_memory(pid: int | str = "self") -> tuple[int, int]:
    """(resident bytes now, peak resident bytes) of a process (Linux /proc; (0, 0) elsewhere or once it is gone)."""
    got = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    got[line.split(":")[0]] = int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return got.get("VmRSS", 0), got.get("VmHWM", 0)


def machine_facts(device: torch.device | str = "cpu") -> dict:
    """The facts every speed figure is published with."""
    device = torch.device(device)
    facts = {"device": str(device), "machine": machine_name(device), "torch": torch.__version__,
             "threads": torch.get_num_threads(), "native_bf16": native_bf16(device)}
    if device.type == "cpu":
        facts["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    return facts


def cache_path(key: dict, root: str | Path | None = None, folder: str = "plans") -> Path:
    """Where what was measured under key is kept: $SPECEE_CACHE (or ~/.cache/specee)/folder/<hash of key>.json."""
    root = Path(root or os.environ.get("SPECEE_CACHE") or Path.home() / ".cache" / "specee").expanduser()
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return root / folder / f"{digest}.json"


def save_measured(path: Path, data: dict, what: str) -> Path | None:
    """Write data as JSON at path atomically (a reader never sees half a file); None, with a warning naming what,
    where the cache cannot be written (the measurement then lives in this process only)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)
        return path
    except OSError as e:
        log.warning("cannot cache the %s in %s (%s); it is kept in memory only", what, path.parent, e)
        return None


def measured_once(key: dict, measure: Callable[[], T], what: str, root: str | Path | None = None,
                  folder: str = "plans", encode: Callable[[T], object] = lambda v: v,
                  decode: Callable[[object], T] = lambda v: v) -> T:
    """What was measured under key: read from its cache file when the file holds this key; else measured under the
    machine's measuring lock (reading again first: another process may have measured it meanwhile) and saved
    (encode: to JSON; decode: back). An unreadable file is measured again, with a warning naming what."""
    path = cache_path(key, root, folder)

    def cached() -> T | None:
        try:
            saved = json.loads(path.read_text())
            return decode(saved["value"]) if saved["key"] == key else None
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            log.warning("%s: unreadable %s (%s: %s); measuring again", path, what, type(e).__name__, e)
            return None

    got = cached()
    if got is not None:
        return got
    with measuring_lock(key, root, folder):
        got = cached()
        if got is None:
            got = measure()
            save_measured(path, {"key": key, "value": encode(got)}, what)
    return got


@contextlib.contextmanager
def measuring_lock(key: dict, root: str | Path | None = None, folder: str = "plans"):
    """One process at a time measures a machine (engine actors side by side would time each other's
    load); the others wait, then read what it saved. No lock where the cache is not writable."""
    path = cache_path(key, root, folder).with_suffix(".lock")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path, "a")
    except OSError:
        yield
        return
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
