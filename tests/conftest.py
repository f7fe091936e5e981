"""Shared fixtures: tiny random Llama checkpoints written by transformers' save_pretrained."""
from __future__ import annotations

import ast
import contextlib
import os
import shutil
import sys
import threading
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _one_parse_at_a_time():
    """ast.parse under one lock for the test process. CPython 3.11.7 (the CI machine's) shares the AST converter's
    recursion counter between threads (gh-106905, fixed in 3.11.8): two parses at once, one in a test (pytest's
    assertion rewriting of a late import, a layout test, tools.make_prompts) and one on another thread of the
    process, raised "SystemError: AST constructor recursion depth mismatch" in two clean-clone runs."""
    if not (3, 11) <= sys.version_info[:3] < (3, 11, 8):
        return
    lock, parse = threading.RLock(), ast.parse

    def parse_alone(*args, **kwargs):
        with lock:
            return parse(*args, **kwargs)

    ast.parse = parse_alone


_one_parse_at_a_time()

REPO = Path(__file__).resolve().parents[1]
BUNDLED = REPO / "models" / "specee-tiny"
torch.set_num_threads(min(2, torch.get_num_threads()))
THREADS = torch.get_num_threads()


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """Every test starts with the suite's thread count: a job's main() sets the process's own (--threads) and
    would leave every later test on it (one thread made the rest of the suite run at half speed)."""
    yield
    if torch.get_num_threads() != THREADS:
        torch.set_num_threads(THREADS)


def make_hf_model(path: Path, *, layers: int = 4, hidden: int = 64, heads: int = 4, kv_heads: int = 4,
                  tied: bool = True, rope_scaling: dict | None = None, max_pos: int = 256, seed: int = 0,
                  dtype=torch.float32, max_shard_size: str | None = None, safe: bool = True,
                  qk_scale: float = 1.0, intermediate: int | None = None):
    """A random LlamaForCausalLM saved in HF layout with the bundled tokenizer beside it.
    qk_scale > 1 sharpens attention (query and key weights scaled), so outputs depend on positions."""
    from transformers import LlamaConfig, LlamaForCausalLM

    kw = {}
    if rope_scaling is not None:
        kw["rope_scaling"] = rope_scaling
    cfg = LlamaConfig(vocab_size=8192, hidden_size=hidden, intermediate_size=intermediate or hidden * 3 - 8,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=max_pos, tie_word_embeddings=tied, rms_norm_eps=1e-5,
                      bos_token_id=0, eos_token_id=1, **kw)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(dtype).eval()
    with torch.no_grad():  # random init is too flat to exercise anything: sharpen the logits
        model.lm_head.weight.mul_(8) if not tied else model.model.embed_tokens.weight.mul_(4)
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(qk_scale)
            layer.self_attn.k_proj.weight.mul_(qk_scale)
    save_kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **save_kw)
    if not safe:  # the legacy format (transformers 5 writes safetensors only)
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, path / "pytorch_model.bin")
        (path / "model.safetensors").unlink()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUNDLED / f, path / f)
    return model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    make_hf_model(path, layers=4, hidden=64, heads=4, kv_heads=2, tied=False)
    return path


@contextlib.contextmanager
def drafting_plan(engine):
    """mode="auto" on engine with a table where drafting pays (verifying more tokens costs next to nothing) and no
    learning from wall time (StepPolicy(decay=1): nor the measured check): which steps draft then depends on the
    acceptance seen, not on this machine's speed at the moment. The engine's own plan comes back after."""
    from specee_core.spec.costs import T_GRID, CostTable
    from specee_core.step.policy import StepPolicy

    sizes = (1, 2, 4, 8, 16, 32, 64)
    flat = CostTable(key={"synthetic": True}, verify={b: [10.0 + 0.02 * t for t in T_GRID] for b in sizes},
                     draft={b: 0.5 for b in sizes})
    plan = engine.spec_plan()
    measured, times = plan.costs, plan.times
    plan.costs, plan.times = flat, StepPolicy(decay=1.0)
    try:
        yield plan
    finally:
        plan.costs, plan.times = measured, times


def add_early_exit_files(path: Path, *, k: int = 4, seed: int = 0, offline=(1, 2)) -> None:
    """Random (untrained) draft head, predictors after every layer, and a schedule beside a model."""
    from specee_core.model.config import ModelConfig
    from specee_core.early_exit.predictors import ExitMLP, PredictorBank
    from specee_core.early_exit.scheduler import Schedule
    from specee_core.draft.head import DraftHead

    cfg = ModelConfig.from_file(path / "config.json")
    torch.manual_seed(seed)
    DraftHead(cfg).save(path / "draft")
    PredictorBank.from_mlps(k, {l: ExitMLP(3 * k) for l in range(1, cfg.num_hidden_layers)}).save(path / "predictors.safetensors")
    Schedule(num_layers=cfg.num_hidden_layers, offline_layers=list(offline)).save(path / "schedule.json")


@pytest.fixture(scope="session")
def ee_model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-ee")
    make_hf_model(path, layers=4, hidden=64, heads=4, kv_heads=2, tied=True, seed=1)
    add_early_exit_files(path)
    return path


@pytest.fixture(scope="session")
def bundled_fp32():
    """The bundled trained model in fp32 with SpecEE's pay-off gate off: the gate runs dense stretches per
    batch, so a row's steps would depend on the batch it shares; gated off, every step is a SpecEE step and
    a row exits alike shared and alone."""
    from specee_core import SpecEEEngine

    return SpecEEEngine.from_pretrained(BUNDLED, dtype="float32", gate="off")


# short code prompts for the bundled (code-trained) model
CODE_PROMPTS = ["def add(a, b):\n", "import os\n", "class Point:\n    def __init__(self", "for i in range(10):\n",
                "x = [1, 2, 3]\n", "with open(path) as f:\n", "return sorted(", "try:\n    import json\n"]


@pytest.fixture(scope="session")
def code_ids(bundled_fp32):
    """CODE_PROMPTS' token ids."""
    return [bundled_fp32.encode_prompt(p) for p in CODE_PROMPTS]



RAY_FIXTURE = "ray_cluster"


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray on loopback with 2 CPUs, shared by every test that asks for it (the batch job, the
    processor, chaos, Serve): one start instead of one per module. The tests that use it run last
    (pytest_collection_modifyitems), so the rest of the suite runs without Ray's processes beside it."""
    import ray

    from pipeline.local_ray import init_ray

    if not ray.is_initialized():
        init_ray("local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: RAY_FIXTURE in item.fixturenames)  # stable: each module's order is kept


KERNEL_BUILDS: list = []  # the background builds pytest_sessionstart started


def pytest_sessionstart(session):
    """The two C++ kernel builds (this CPU's and the AVX2 one, ~30 s each on one core) start at once, each in a
    process of its own: the tests that load them find them built, or wait on torch's build lock. In sequence,
    on first use, they cost the suite a minute on a clean machine; side by side, half."""
    import subprocess
    import sys

    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        return
    code = "import sys; from kernels.cpu_ext import lowbit_cpu; lowbit_cpu(avx2_only=sys.argv[1] == 'avx2')"
    for isa in ("native", "avx2"):
        KERNEL_BUILDS.append(subprocess.Popen([sys.executable, "-c", code, isa], cwd=REPO,
                                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))


def pytest_sessionfinish(session):
    for p in KERNEL_BUILDS:  # never killed mid-build: that would leave torch's build lock behind
        p.wait()
