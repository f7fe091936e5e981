"""weights="auto": which weight format (and activation dtype) a checkpoint runs in on this machine.

The checkpoint's own low-bit format is a candidate only where it has one (a GGUF conversion whose
matrices were Q4_1 / Q8_0 blocks: quantizing them again gives back exactly those blocks, so nothing is
approximated). It is chosen when a step's linears, timed here on random weights of the model's shapes
at the batch size in use, are faster than the dtype's dense ones. The same blocks with int8 activations
(q4a8: llama.cpp's arithmetic) are not a candidate: on SmolLM2 their greedy outputs part from fp32's
sooner than bf16's do (docs/RESULTS.md, "int8 activations"); ask for them by name. Pure functions of what
was measured; the reason string says it.
"""
from __future__ import annotations

import logging
import statistics
import time

import torch

from specee_core.machine import machine_name, measured_once
from specee_core.model.model import make_linear
from specee_core.model.quant import QK, cpu_kernel, dtype_name, random_weight

log = logging.getLogger(__name__)
CACHE_FOLDER = "weight_plans"  # beside the plans' cost tables (specee_core.machine.cache_path)
VERSION = 2  # a change to what time_step_linears measures, or to its file, bumps it


def checkpoint_format(model_dir) -> tuple[str | None, str]:
    """The low-bit format the checkpoint's layer matrices came in: "q4" / "q8" when model_dir is a
    conversion of a GGUF whose quantized tensors are all Q4_1 / Q8_0 (its import record says so; the
    values then quantize back into the file's own blocks exactly), else None. With a description."""
    from specee_core.model.gguf import ImportRecord

    rec = ImportRecord.read(model_dir)
    if rec is None:
        return None, "float checkpoint"
    quant = {t: n for t, n in rec.quant_types.items() if t not in ("F32", "F16", "BF16")}
    layer_types = {t for t in quant if t != "Q8_0"} or set(quant)  # the Q8_0 one is the embedding
    fmt = {frozenset({"Q4_1"}): "q4", frozenset({"Q8_0"}): "q8"}.get(frozenset(layer_types))
    return fmt, f"{rec.source} ({', '.join(f'{n} {t}' for t, n in sorted(quant.items()))})"


def time_step_linears(config, batch: int, fmt: str | None, dtype: torch.dtype, repeats: int = 3) -> float:
    """ms of a decode step's linears (every layer's, distinct weights so they stream from memory as in a
    real step, and the LM head: q8 with a low-bit fmt) over `batch` rows of random weights in fmt (None:
    dense in dtype), activations in dtype."""
    c, gen = config, torch.Generator().manual_seed(0)
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    layer = [(q + 2 * kv, c.hidden_size), (c.hidden_size, q), (2 * c.intermediate_size, c.hidden_size),
             (c.hidden_size, c.intermediate_size)]
    shapes = layer * c.num_hidden_layers + [(c.vocab_size, c.hidden_size)]
    fmts = [fmt] * (len(shapes) - 1) + [None if fmt is None else "q8a8" if fmt.endswith("a8") else "q8"]
    lins = [make_linear(random_weight(o, i, f, dtype, gen)) for (o, i), f in zip(shapes, fmts)]
    xs = {i: torch.randn(batch, i, generator=gen).to(dtype) for _, i in shapes}
    samples = []
    for rnd in range(repeats + 1):
        t = time.perf_counter()
        for lin, (_, i) in zip(lins, shapes):
            lin(xs[i])
        if rnd:  # round 0 warms up (and packs oneDNN weights)
            samples.append((time.perf_counter() - t) * 1e3)
    return statistics.median(samples)


def choose_weights(model_dir, config, device: torch.device, dtype: torch.dtype,
                   batch: int) -> tuple[str | None, torch.dtype, str]:
    """weights "auto": the checkpoint's own low-bit format when it has one (so nothing is approximated)
    and its linears run faster here, at `batch` rows, than the same shapes in `dtype`; else None (the
    matrices in dtype). Returns (format or None, activation dtype, reason). The low-bit format is timed
    with fp32 activations and, where dtype is bf16, with bf16 activations (bf16 dot products over the
    weights rounded to bf16: what the bf16 engine computes, from a quarter of the bytes). Measured on
    random weights of the model's shapes (5 s for a 135M model on 2 cores), once per machine, model shape,
    dtype and batch size (measured_linears)."""
    fmt, source = checkpoint_format(model_dir)
    name = dtype_name(dtype)
    if fmt is None:
        return None, dtype, f"{name}: {source}; low-bit formats would change outputs (ask with weights=q8/q4)"
    if device.type != "cpu":
        return None, dtype, f"{name}: low-bit weights are chosen on CPU only; ask with weights={fmt}"
    if cpu_kernel() is None:
        return None, dtype, f"{name}: the low-bit CPU kernel does not build here"
    c = config
    if any(i % QK for i in (c.hidden_size, c.intermediate_size, c.num_attention_heads * c.head_dim)):
        return None, dtype, f"{name}: the model's input dims are not multiples of {QK}"
    ms = measured_linears(c, batch, fmt, dtype, device)
    (best_fmt, best_act) = min(ms, key=ms.get)
    measured = ", ".join(f"{f or name}{'' if f is None or f.endswith('a8') else ' + ' + dtype_name(a)} {t:.1f}"
                         for (f, a), t in ms.items())
    measured = f"linears ms per step at batch {batch} here: {measured}"
    if best_fmt is None:
        return None, dtype, f"{name}: faster than the checkpoint's {fmt} ({measured})"
    acts = "int8" if best_fmt.endswith("a8") else dtype_name(best_act)
    return best_fmt, best_act, f"{best_fmt} with {acts} activations: the checkpoint's own blocks, {source}; {measured}"


def measured_linears(config, batch: int, fmt: str, dtype: torch.dtype, device: torch.device,
                     root=None) -> dict[tuple[str | None, torch.dtype], float]:
    """{(fmt or None, activation dtype): ms of a step's linears}: the low-bit format with fp32 activations (and
    bf16 ones where dtype is bf16), and the dense matrices in dtype. Measured once per machine, torch, thread
    count, model shape, dtype, batch size and kernel source, under the machine's measuring lock (engines
    starting side by side would time each other), and cached: every later engine start reads it."""
    from kernels.cpu_ext import source_digest

    c = config
    key = {"weight_plan_version": VERSION, "machine": machine_name(device), "torch": torch.__version__,
           "threads": torch.get_num_threads(), "dtype": dtype_name(dtype), "batch": batch, "format": fmt,
           "kernel": source_digest(), "model_shape": [c.num_hidden_layers, c.hidden_size, c.intermediate_size,
                                                      c.num_attention_heads, c.num_key_value_heads, c.vocab_size]}

    def measure() -> dict:
        acts = [torch.float32] + ([torch.bfloat16] if dtype == torch.bfloat16 else [])
        ms = {(fmt, a): time_step_linears(c, batch, fmt, a) for a in acts}
        ms[(None, dtype)] = time_step_linears(c, batch, None, dtype)
        return ms

    return measured_once(key, measure, "weight timings", root, CACHE_FOLDER,
                         encode=lambda ms: [[f, dtype_name(a), t] for (f, a), t in ms.items()],
                         decode=lambda rows: {(f, getattr(torch, a)): float(t) for f, a, t in rows})
