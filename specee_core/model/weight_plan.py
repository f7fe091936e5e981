"""weights="auto": which weight format (and activation dtype) a checkpoint runs in on this machine.

The checkpoint's own low-bit format is a candidate only where it has one (a GGUF conversion whose
matrices were Q4_1 / Q8_0 blocks: quantizing them again gives back exactly those blocks, so nothing is
approximated; or one with block formats such as Q4_K / Q6_K / Q5_0, kept in the file's bytes: "gguf"). It is
chosen, with fp32 activations, when decoding in it costs less per token than in the dtype's dense matrices, timed
here on random weights of the model's shapes at the batch size in use: a one-token step, or, for a model with a
draft head, a verified chain of 4 over the tokens the head's recorded acceptance expects it to commit, where that
is less (per_token_ms: mode auto drafts where drafting pays, and verification favours bf16's GEMMs). Where the
dtype is bf16 a third variant races: the blocks with the LM head through a bf16 copy of its matrix (at many rows a
bf16 GEMM beats the head's fp32 kernel; DecoderModel.hold_head). Prefill is not in the race: where the dtype is bf16
the low-bit engine prefills through bf16 copies of its matrices (DecoderModel.hold_for_prefill). The same blocks with int8 activations (q4a8:
llama.cpp's arithmetic) are not a candidate: on SmolLM2 their greedy outputs part from fp32's sooner than bf16's do
(docs/RESULTS.md, "int8 activations"); ask for them by name. Pure functions of what was measured; the reason string
says it.
"""
from __future__ import annotations

import logging
import statistics
import time
from pathlib import Path
from typing import NamedTuple

import torch

from specee_core.machine import machine_name, measured_once
from specee_core.model.quant import NATIVE, QK, cpu_kernel, dtype_name, holds_bf16, random_weight

log = logging.getLogger(__name__)
CACHE_FOLDER = "weight_plans"  # beside the plans' cost tables (specee_core.machine.cache_path)
VERSION = 7  # a change to what time_steps measures, or to its file, bumps it


class Variant(NamedTuple):
    """A way to run a checkpoint: its matrices in fmt (None: dense in act), activations in act, and whether the LM
    head computes through a held bf16 copy of its low-bit matrix."""
    fmt: str | None
    act: torch.dtype
    held_head: bool = False

    def describe(self) -> str:
        if self.fmt is None:
            return dtype_name(self.act)
        acts = "" if self.fmt.endswith("a8") else f" + {dtype_name(self.act)}"
        return f"{self.fmt}{acts}{', bf16 head' if self.held_head else ''}"


class WeightChoice(NamedTuple):
    """choose_weights' answer: the format (None: the matrices in the activation dtype), the activation dtype, whether
    the LM head is held in bf16, and why."""
    fmt: str | None
    act: torch.dtype
    held_head: bool
    reason: str


def checkpoint_format(model_dir) -> tuple[str | None, str]:
    """The low-bit format the checkpoint's layer matrices came in: "q4" / "q8" when model_dir is a
    conversion of a GGUF whose quantized tensors are all Q4_1 / Q8_0 (its import record says so; the
    values then quantize back into the file's own blocks exactly), "gguf" when it holds block formats (Q4_K,
    Q6_K, Q5_0 ...) and their bytes were kept (gguf.BLOCKS_FILE), else None. With a description."""
    from specee_core.model.gguf import BLOCKS_FILE, ImportRecord, has_block_types

    rec = ImportRecord.read(model_dir)
    if rec is None:
        return None, "float checkpoint"
    quant = {t: n for t, n in rec.quant_types.items() if t not in ("F32", "F16", "BF16")}
    layer_types = {t for t in quant if t != "Q8_0"} or set(quant)  # the Q8_0 one is the embedding
    fmt = {frozenset({"Q4_1"}): "q4", frozenset({"Q8_0"}): "q8"}.get(frozenset(layer_types))
    if has_block_types(quant) and (Path(model_dir) / BLOCKS_FILE).is_file():
        fmt = NATIVE
    return fmt, f"{rec.source} ({', '.join(f'{n} {t}' for t, n in sorted(quant.items()))})"


def random_model(config, fmt: str | None, dtype: torch.dtype, gen: torch.Generator, held_head: bool = False):
    """A DecoderModel of config's shapes and layers with random weights in fmt (None: dense in dtype; the LM head q8
    with a low-bit fmt, as a GGUF's is, held in bf16 with held_head), activations in dtype, norms of ones: for timing
    and kernel tests."""
    from specee_core.model.model import LayerWeights, DecoderModel, ModelWeights

    c, d = config, config.hidden_size
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim

    def weight(o: int, i: int, f: str | None = fmt):
        if f == NATIVE:  # a Q4_K_M file's mix: Q4_K where the input dim holds super-blocks of 256, else Q5_0
            f = "q4_k" if i % 256 == 0 else "q5_0"
        return random_weight(o, i, f, dtype, gen)

    def norm() -> torch.Tensor:
        return torch.ones(d, dtype=dtype)

    def head_norm() -> torch.Tensor | None:
        return torch.ones(c.head_dim, dtype=dtype) if c.qk_norm else None

    def sandwich() -> torch.Tensor | None:
        return norm() if c.sandwich_norm else None

    layers = [LayerWeights(norm(), weight(q + 2 * kv, d), None, weight(d, q), None, norm(),
                           weight(2 * c.intermediate_size, d), None, weight(d, c.intermediate_size), None,
                           head_norm(), head_norm(), sandwich(), sandwich())
              for _ in range(c.num_hidden_layers)]
    head = weight(c.vocab_size, d, None if fmt is None else "q8a8" if fmt.endswith("a8") else "q8")  # gguf: Q8_0
    model = DecoderModel(c, ModelWeights(head, layers, norm(), head), "cpu", dtype)
    if held_head:
        model.hold_head()
    return model


def time_steps(config, batch: int, variants: list[Variant], repeats: int = 3, context: int = 64,
               tokens: tuple[int, ...] = (1,), drop_over: float = 1.5) -> dict[Variant, dict[int, float]]:
    """{variant: {length: ms}} of decode steps over `batch` rows after `context` cached tokens each, one step of each
    length in `tokens` per round (1: a dense step; 4: a drafted chain verified): every decoder layer (the
    linears, norms, RoPE, attention and the K/V write, through the code path the engine takes for that format: the
    fused C++ layers for low-bit weights with fp32 activations) and the final norm and LM head (q8 with a low-bit
    fmt, or its held bf16 copy). Each variant is a model of the config's shapes
    with random weights; the rounds alternate over the variants so the machine's drift hits each alike. Distinct
    weights per layer stream from memory as in a real step. A variant over drop_over x the fastest after the first
    timed round is out of the race (by the sum over lengths): its one time stands."""
    gen = torch.Generator().manual_seed(0)
    rows = torch.arange(batch)
    base = torch.full((batch,), context)
    runs = {}
    for v in map(Variant._make, variants):
        fmt, dtype = v.fmt, v.act
        model = random_model(config, fmt, dtype, gen, v.held_head)
        cache = model.new_cache(batch, context + max(tokens))
        cache.randomize(gen)  # a prompt's K/V: random, no prefill to run
        cache.truncate(rows, base)
        x = {t: torch.randn(batch, t, config.hidden_size, generator=gen).to(dtype) for t in tokens}
        chain = {t: torch.tril(torch.ones(t, t, dtype=torch.bool)).expand(batch, t, t) for t in tokens}
        runs[v] = (model, cache, x, chain)
    per_length: dict = {v: {t: [] for t in tokens} for v in runs}
    racing = list(runs)
    with torch.inference_mode():
        for rnd in range(repeats + 1):
            if rnd == 2:  # one timed round each: a variant far behind cannot win, it is timed no more
                first = {v: sum(ms[0] for ms in per_length[v].values()) for v in racing}  # the first timed round's
                racing = [v for v in racing if first[v] <= drop_over * min(first.values())]
            for v in (racing if rnd % 2 else racing[::-1]):
                model, cache, x, chain = runs[v]
                for t in tokens:
                    t0 = time.perf_counter()
                    rope = model.rope_for(context + torch.arange(t).expand(batch, t))
                    model.logits(model.layers(x[t], rope, cache, tree=None if t == 1 else chain[t]))
                    cache.truncate(rows, base)
                    if rnd:  # round 0 warms up (and packs oneDNN weights)
                        per_length[v][t].append((time.perf_counter() - t0) * 1e3)
    return {v: {t: statistics.median(ms) for t, ms in lengths.items()} for v, lengths in per_length.items()}


def draft_acceptance(model_dir) -> float | None:
    """The draft head's top-1 agreement with the model on held-out text, as its training recorded it (draft/config.json),
    or None without a head or the record."""
    import json

    try:
        rec = json.loads((Path(model_dir) / "draft" / "config.json").read_text())["specee"]["heldout"]  # DRAFT_DIR
        return float(rec["heldout_top1"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def per_token_ms(lengths: dict[int, float], acceptance: float | None) -> float:
    """ms per token of a variant's decoding: a one-token step's, or with a draft head of this top-1 acceptance, a
    verified chain of 4's over the tokens it is expected to commit (1 + a + a^2 + a^3) where that is less (mode auto
    drafts where it pays). Without a head, the one-token step: prompt lookup drafts too rarely to weigh."""
    ms = lengths[1]
    if acceptance is not None and 4 in lengths:
        ms = min(ms, lengths[4] / sum(acceptance ** i for i in range(4)))
    return ms


def choose_weights(model_dir, config, device: torch.device, dtype: torch.dtype, batch: int) -> WeightChoice:
    """weights "auto": the checkpoint's own low-bit format when it has one (so nothing is approximated)
    and decoding in it, with fp32 activations (its LM head held in bf16 where dtype is bf16 and that is faster), costs
    less per token here at `batch` rows than the same shapes in `dtype` (per_token_ms); else None (the matrices in
    dtype). Measured on random weights of the model's shapes (a few seconds on 2 cores), once per machine, model
    shape, dtype and batch size (measured_steps)."""
    fmt, source = checkpoint_format(model_dir)
    name = dtype_name(dtype)

    def dense(why: str) -> WeightChoice:
        return WeightChoice(None, dtype, False, f"{name}: {why}")

    if fmt is None:
        return dense(f"{source}; low-bit formats would change outputs (ask with weights=q8/q4)")
    if device.type != "cpu":
        return dense(f"low-bit weights are chosen on CPU only; ask with weights={fmt}")
    if cpu_kernel() is None:
        return dense("the low-bit CPU kernel does not build here")
    c = config
    if any(i % QK for i in (c.hidden_size, c.intermediate_size, c.num_attention_heads * c.head_dim)):
        return dense(f"the model's input dims are not multiples of {QK}")
    steps = measured_steps(c, batch, fmt, dtype, device)
    accept = draft_acceptance(model_dir)
    ms = {v: per_token_ms(lengths, accept) for v, lengths in steps.items()}
    best = min(ms, key=ms.get)
    measured = ", ".join(f"{v.describe()} {ms[v]:.1f} ({lengths[1]:.1f} a step, {lengths[4]:.1f} a chain of 4)"
                         for v, lengths in steps.items())
    measured = (f"ms per token at batch {batch} here"
                f"{'' if accept is None else f' (draft head acceptance {accept:.2f})'}: {measured}")
    if best.fmt is None:
        return dense(f"faster than the checkpoint's {fmt} ({measured})")
    acts = "int8" if best.fmt.endswith("a8") else dtype_name(best.act)
    head = ", the LM head through a bf16 copy" if best.held_head else ""
    return WeightChoice(best.fmt, best.act, best.held_head,
                        f"{best.fmt} with {acts} activations{head}: the checkpoint's own blocks, {source}; {measured}")


def measured_steps(config, batch: int, fmt: str, dtype: torch.dtype, device: torch.device,
                   root=None) -> dict[Variant, dict[int, float]]:
    """{Variant: {1: ms of a decode step, 4: of a chain of 4 verified}}: the low-bit format with fp32 activations,
    the same with its LM head held in bf16 where dtype is bf16 on bf16 units (holds_bf16), and the dense matrices in
    dtype. Measured once per machine, torch, thread count, model shape, dtype, batch size and kernel
    source, under the machine's measuring lock (engines starting side by side would time each other), and cached:
    every later engine start reads it."""
    from kernels.cpu_ext import source_digest

    c = config
    key = {"weight_plan_version": VERSION, "machine": machine_name(device), "torch": torch.__version__,
           "threads": torch.get_num_threads(), "dtype": dtype_name(dtype), "batch": batch, "format": fmt,
           "kernel": source_digest(), "model_shape": [c.num_hidden_layers, c.hidden_size, c.intermediate_size,
                                                      c.num_attention_heads, c.num_key_value_heads, c.vocab_size],
           **c.architecture_key()}

    def measure() -> dict:
        variants = [Variant(fmt, torch.float32), Variant(None, dtype)]
        if holds_bf16(dtype) and not fmt.endswith("a8"):
            variants.insert(1, Variant(fmt, torch.float32, True))
        return time_steps(c, batch, variants, tokens=(1, 4))

    return measured_once(key, measure, "weight timings", root, CACHE_FOLDER,
                         encode=lambda ms: [[v.fmt, dtype_name(v.act), v.held_head, t[1], t[4]] for v, t in ms.items()],
                         decode=lambda rows: {Variant(f, getattr(torch, a), bool(h)): {1: float(t1), 4: float(t4)}
                                              for f, a, h, t1, t4 in rows})
