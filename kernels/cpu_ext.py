"""Builds and loads kernels/lowbit_cpu.cpp (the CPU low-bit GEMV; it includes lowbit_i8.cpp, layer_cpu.cpp and
kquant_cpu.cpp, one translation unit) on first use.

torch.utils.cpp_extension compiles it with the machine's g++ and ninja (~35 s, once; cached under
$SPECEE_CACHE/torch_extensions, or ~/.cache/specee/torch_extensions, keyed by the source's hash and
the CPU's capability, so a machine with other SIMD never loads another's build). -march=native: the
build uses what this CPU has; -ffp-contract=off: dequantize() rounds d*q and then adds m, as gguf's
reference does, so its values equal transformers' dequantization bit for bit. The avx2_only build
also turns off AVX-VNNI and AVX512-VNNI (-mno-avxvnni -mno-avx512vnni; AVX512-VNNI goes with
-mno-avx512f anyway): the int8-activation kernels then run the vpmaddubsw path of AVX2-only CPUs
(AMD EPYC before Zen 4), not the VNNI one a newer CPU would compile. The flags are part of the build's
name, so a change of flags builds anew.
"""
from __future__ import annotations

import hashlib
import logging
import os
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

# the module and what it includes (one translation unit: lowbit_cpu.cpp includes the other two sources)
SOURCES = tuple(Path(__file__).with_name(n) for n in ("lowbit_cpu.cpp", "lowbit_i8.cpp", "layer_cpu.cpp",
                                                      "kquant_cpu.cpp"))
HEADER = Path(__file__).with_name("lowbit_cpu.h")


class CpuKernelUnavailable(RuntimeError):
    """The C++ kernel cannot be built here (no compiler or ninja); callers fall back to the reference."""


def _build_dir() -> Path:
    root = os.environ.get("SPECEE_CACHE") or str(Path.home() / ".cache" / "specee")
    return Path(root) / "torch_extensions"


def source_digest() -> str:
    """The kernel source's hash: names the build, and keys measured costs (a new kernel times anew)."""
    return hashlib.sha256(b"".join(p.read_bytes() for p in (HEADER, *SOURCES))).hexdigest()[:12]


@lru_cache(maxsize=2)
def lowbit_cpu(avx2_only: bool = False) -> ModuleType:
    """The compiled module (q4_linear, q8_linear, their int8-activation twins q4_linear_i8, q8_linear_i8 and
    quantize_rows_i8, dequantize, blocks_linear and blocks_dequantize for GGUF's block formats, the fused layer
    pieces, simd, simd_i8). Raises
    CpuKernelUnavailable. avx2_only: a build without AVX-512 (tests its AVX2 path on an AVX-512 machine)."""
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        raise CpuKernelUnavailable("ninja is not installed (pip install ninja)")
    cflags = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"]
    # torch told to dispatch AVX2 code (ATEN_CPU_CAPABILITY=avx2 on an AVX-512 machine, how benchmarks stand in
    # for an AVX2-only CPU): the kernel follows, without AVX-512
    avx2_only = avx2_only or torch.backends.cpu.get_cpu_capability() == "AVX2"
    if avx2_only:
        cflags += ["-mno-avx512f", "-mno-avx512vnni", "-mno-avxvnni"]
    # the checkout's folder too: two checkouts of one source would otherwise rewrite one build.ninja (its paths)
    # and rebuild each other's module in turn
    digest = hashlib.sha256((source_digest() + " ".join(cflags) + str(SOURCES[0].parent)).encode()).hexdigest()[:12]
    isa = "avx2" if avx2_only else torch.backends.cpu.get_cpu_capability().lower()
    name = f"specee_lowbit_{isa}_{digest}"
    build = _build_dir() / name
    try:
        build.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # an unwritable cache: build in a temporary directory (this process only)
        import tempfile

        log.warning("cannot create %s (%s); building the kernel in a temporary directory", build, e)
        build = Path(tempfile.mkdtemp(prefix=f"{name}-"))
    try:
        with _build_lock(build):
            mod = cpp_extension.load(name=name, sources=[str(SOURCES[0])], build_directory=str(build),
                                     extra_cflags=cflags,
                                     extra_ldflags=["-fopenmp"], verbose=False)
    except (OSError, RuntimeError, ImportError) as e:  # no compiler, failed build
        raise CpuKernelUnavailable(f"building {', '.join(p.name for p in SOURCES)} failed: {e}") from e
    log.info("low-bit CPU kernel %s loaded (%s, int8 activations: %s)", name, mod.simd(), mod.simd_i8())
    return mod


@contextmanager
def _build_lock(build: Path):
    """Held around torch's build of the module. torch guards a build with a lock file it deletes when done, and
    waits forever while one exists: a build killed mid-way (a timeout, ^C) would hang every later process. This
    flock dies with its holder, so whoever holds it knows any torch lock file left is stale, and removes it."""
    import fcntl

    with open(build / ".specee_build.lock", "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX)
        except OSError:  # a filesystem without flock: torch's own lock as it is
            yield
            return
        stale = build / "lock"
        if stale.exists():
            log.warning("removing %s, left by a build of the kernel that did not finish", stale)
            stale.unlink(missing_ok=True)
        yield


def available() -> bool:
    """Whether the CPU kernel builds and loads here (builds it on the first call)."""
    try:
        lowbit_cpu()
    except CpuKernelUnavailable as e:
        log.warning("%s; low-bit linears use the plain-torch reference", e)
        return False
    return True
