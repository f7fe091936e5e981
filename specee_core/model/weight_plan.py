"""weights="auto": which weight format (and activation dtype) a checkpoint runs in on this machine.

The checkpoint's own low-bit format is a candidate only where it has one (a GGUF conversion whose
matrices were Q4_1 / Q8_0 blocks: quantizing them again gives back exactly those blocks, so nothing is
approximated; or one with block formats such as Q4_K / Q6_K / Q5_0, kept in the file's bytes: "gguf"). It is
chosen, with fp32 activations, when decoding in it costs less per token than in the dtype's dense matrices, timed
here on random weights of the model's shapes at the batch size in use: a one-token step, or, for a model with a
draft head, a verified chain of 4 over the tokens the head's recorded acceptance expects it to commit, where that
is less (per_token_ms: mode auto drafts where drafting pays, and verification favours bf16's GEMMs). Prefill is
not in the race: where the dtype is bf16 the low-bit engine prefills through bf16 copies of its matrices
(QuantLinear.hold_for_prefill). The same blocks with int8 activations (q4a8:
llama.cpp's arithmetic) are not a candidate: on SmolLM2 their greedy outputs part from fp32's sooner than bf16's do
(docs/RESULTS.md, "int8 activations"); ask for them by name. Pure functions of what was measured; the reason string
says it.
"""
from __future__ import annotations

import logging
import statistics
import time
from pathlib import Path

import torch

from specee_core.machine import machine_name, measured_once
from specee_core.model.quant import NATIVE, QK, cpu_kernel, dtype_name, random_weight

log = logging.getLogger(__name__)
CACHE_FOLDER = "weight_plans"  # beside the plans' cost tables (specee_core.machine.cache_path)
VERSION = 6  # a change to what time_steps measures, or to its file, bumps it


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


def random_model(config, fmt: str | None, dtype: torch.dtype, gen: torch.Generator):
    """A DecoderModel of config's shapes and layers with random weights in fmt (None: dense in dtype; the LM head q8
    with a low-bit fmt, as a GGUF's is), activations in dtype, norms of ones: for timing and kernel tests."""
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
    return DecoderModel(c, ModelWeights(head, layers, norm(), head), "cpu", dtype)


def time_steps(config, batch: int, variants: list[tuple[str | None, torch.dtype]], repeats: int = 3,
               context: int = 64, tokens: tuple[int, ...] = (1,),
               drop_over: float = 1.5) -> dict[tuple[str | None, torch.dtype], dict[int, float]]:
    """{variant: {length: ms}} of decode steps over `batch` rows after `context` cached tokens each, one step of each
    length in `tokens` per round (1: a dense step; 4: a drafted chain verified): every decoder layer (the
    linears, norms, RoPE, attention and the K/V write, through the code path the engine takes for that format: the
    fused C++ layers for low-bit weights with fp32 activations) and the final norm and LM head (q8 with a low-bit
    fmt). Each variant (fmt or None: dense in its dtype; the activation dtype) is a model of the config's shapes
    with random weights; the rounds alternate over the variants so the machine's drift hits each alike. Distinct
    weights per layer stream from memory as in a real step. A variant over drop_over x the fastest after the first
    timed round is out of the race (by the sum over lengths): its one time stands."""
    gen = torch.Generator().manual_seed(0)
    rows = torch.arange(batch)
    base = torch.full((batch,), context)
    runs = {}
    for fmt, dtype in variants:
        model = random_model(config, fmt, dtype, gen)
        cache = model.new_cache(batch, context + max(tokens))
        cache.k.normal_(generator=gen), cache.v.normal_(generator=gen)  # a prompt's K/V: random, no prefill to run
        cache.truncate(rows, base)
        x = {t: torch.randn(batch, t, config.hidden_size, generator=gen).to(dtype) for t in tokens}
        chain = {t: torch.tril(torch.ones(t, t, dtype=torch.bool)).expand(batch, t, t) for t in tokens}
        runs[(fmt, dtype)] = (model, cache, x, chain)
    per_length: dict = {v: {t: [] for t in tokens} for v in variants}
    racing = list(variants)
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


def choose_weights(model_dir, config, device: torch.device, dtype: torch.dtype,
                   batch: int) -> tuple[str | None, torch.dtype, str]:
    """weights "auto": the checkpoint's own low-bit format when it has one (so nothing is approximated)
    and decoding in it, with fp32 activations, costs less per token here at `batch` rows than the same shapes in
    `dtype` (per_token_ms); else None (the matrices in dtype). Returns (format or None, activation dtype, reason).
    Measured on random weights of the model's shapes (a few seconds on 2 cores), once per machine, model shape,
    dtype and batch size (measured_steps)."""
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
    steps = measured_steps(c, batch, fmt, dtype, device)
    accept = draft_acceptance(model_dir)
    ms = {v: per_token_ms(lengths, accept) for v, lengths in steps.items()}
    (best_fmt, best_act) = min(ms, key=ms.get)
    measured = ", ".join(f"{f or name}{'' if f is None or f.endswith('a8') else ' + ' + dtype_name(a)} {t:.1f}"
                         f" ({lengths[1]:.1f} a step, {lengths[4]:.1f} a chain of 4)"
                         for ((f, a), t), lengths in zip(ms.items(), steps.values()))
    measured = (f"ms per token at batch {batch} here"
                f"{'' if accept is None else f' (draft head acceptance {accept:.2f})'}: {measured}")
    if best_fmt is None:
        return None, dtype, f"{name}: faster than the checkpoint's {fmt} ({measured})"
    acts = "int8" if best_fmt.endswith("a8") else dtype_name(best_act)
    return best_fmt, best_act, f"{best_fmt} with {acts} activations: the checkpoint's own blocks, {source}; {measured}"


def measured_steps(config, batch: int, fmt: str, dtype: torch.dtype, device: torch.device,
                     root=None) -> dict[tuple[str | None, torch.dtype], float]:
    """{(fmt or None, activation dtype): {1: ms of a decode step, 4: of a chain of 4 verified}}: the low-bit format
    with fp32 activations and the dense matrices in dtype. Measured once per machine, torch, thread count, model shape, dtype, batch size and kernel
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
        return time_steps(c, batch, [(fmt, torch.float32), (None, dtype)], tokens=(1, 4))

    return measured_once(key, measure, "weight timings", root, CACHE_FOLDER,
                         encode=lambda ms: [[f, dtype_name(a), t[1], t[4]] for (f, a), t in ms.items()],
                         decode=lambda rows: {(f, getattr(torch, a)): {1: float(t1), 4: float(t4)}
                                              for f, a, t1, t4 in rows})
