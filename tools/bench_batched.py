"""Batched decoding and prefill beside llama.cpp's own: `llama-batched-bench` (llama.cpp's tool, built from the
same sources as llama-cpp-python: README, "llama.cpp as a peer") on the same GGUF, and this engine at each batch
size N, built as a job builds it (`from_pretrained(model, max_batch_size=N)`, every other option its default, or
--weights). Prints (and with --out writes) JSON with the commit and the machine.

Per N, in one run, the peers alternating round by round:
- decode: N different held-out chat prompts at once (N=1: --batch1-prompts of them one after another),
  --tokens new tokens each (ignore_eos), tokens/s over the
  decode (the call after its last first token); llama.cpp: its text-generation speed S_TG at N parallel
  sequences of --tokens tokens after a --prompt-tokens prompt (its tokens/s do not depend on the text; ours do,
  through speculation: mode auto drafts from the prompts);
- prefill: N prompts of about --prompt-tokens tokens, prefix cache off, max_tokens 1: prompt tokens over the
  call's time to the last first token; llama.cpp: S_PP, its prompt-processing speed at N sequences.

    python -m tools.bench_batched --llama-bench /work/llamacpp-src/bb/bin/llama-batched-bench --out docs/bench_batched.json
    python -m tools.bench_batched --replot docs/bench_batched.json   # its plot again, from the JSON alone

With --out, a plot beside the JSON (.png): decode tokens/s per batch size for each variant and llama.cpp build, and
with modes auto and dense, auto / dense per round and their medians' ratio.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

import torch

from jobs.cli import emit_json, git_commit
from specee_core import SamplingParams, SpecEEEngine
from specee_core.machine import machine_facts
from specee_core.model.gguf import imported_gguf


def llama_batched(binary: Path, gguf: Path, sizes: list[int], prompt_tokens: int, tokens: int,
                  threads: int) -> dict[int, dict]:
    """{N: {"decode": S_TG, "prefill": S_PP}} from one llama-batched-bench run (its JSONL lines)."""
    ctx = max(sizes) * (prompt_tokens + tokens) + 64
    cmd = [str(binary), "-m", str(gguf), "-c", str(ctx), "-b", "2048", "-ub", "512", "-t", str(threads),
           "-npp", str(prompt_tokens), "-ntg", str(tokens), "-npl", ",".join(map(str, sizes)),
           "--output-format", "jsonl"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    got = {}
    for line in out.splitlines():
        line = line.strip()
        if line.startswith("{"):
            r = json.loads(line)
            got[int(r["pl"])] = {"decode": float(r["speed_tg"]), "prefill": float(r["speed_pp"])}
    missing = set(sizes) - set(got)
    if missing:
        raise RuntimeError(f"llama-batched-bench printed no result for {sorted(missing)}: {out[-2000:]}")
    return got


def chat_prompts(engine: SpecEEEngine, path: Path, n: int) -> list[str]:
    rows = [json.loads(line) for line in path.read_text().splitlines()][:n]
    if len(rows) < n:
        raise ValueError(f"{path} holds {len(rows)} prompts, {n} needed")
    if not engine.has_chat_template:  # a base model: the instructions as plain prompts
        return [r["prompt"] for r in rows]
    return [engine.chat_prompt([{"role": "user", "content": r["prompt"]}]) for r in rows]


def long_prompts(engine: SpecEEEngine, path: Path, n: int, tokens: int) -> list[list[int]]:
    """n different prompts of exactly `tokens` token ids (held-out instructions run together, cut)."""
    text = " ".join(json.loads(line)["prompt"] for line in path.read_text().splitlines())
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < n * tokens:
        raise ValueError(f"{path} holds {len(ids)} tokens, {n * tokens} needed")
    return [ids[i * tokens : (i + 1) * tokens] for i in range(n)]


def ours(engine: SpecEEEngine, decode_prompts: list[str], prefill_ids: list[list[int]], tokens: int,
         mode: str, one_at_a_time: bool = False) -> dict:
    """{"decode": tokens/s after the last first token, "prefill": prompt tokens/s to the last first token}."""
    sp = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    # batch 1: the prompts one after another (ours depends on the text through speculation); else all at once
    groups = [[p] for p in decode_prompts] if one_at_a_time else [decode_prompts]
    decoded, seconds = 0, 0.0
    for group in groups:
        t0 = time.perf_counter()
        res = engine.generate(group, mode=mode, sampling_params=sp)
        seconds += time.perf_counter() - t0 - max(r.metrics["ttft_s"] for r in res)
        decoded += sum(len(r.token_ids) - 1 for r in res)
    decode = decoded / max(seconds, 1e-9)
    t0 = time.perf_counter()
    res = engine.generate([engine.tokenizer.decode(p) for p in prefill_ids], mode=mode,
                          sampling_params=SamplingParams(max_new_tokens=1))
    prefill = sum(r.prompt_tokens for r in res) / max(max(r.metrics["ttft_s"] for r in res), 1e-9)
    return {"decode": decode, "prefill": prefill}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/smollm2-135m-instruct")
    ap.add_argument("--gguf", type=Path, help="default: the GGUF the model was imported from")
    ap.add_argument("--llama-bench", type=Path, action="append", default=[],
                    help="llama-batched-bench's binary (none: this engine alone); repeat it for several builds "
                         "(e.g. native and AVX2): each is run, and ours is compared with the fastest")
    ap.add_argument("--sizes", default="1,8,16,32")
    ap.add_argument("--weights", default="auto", help="comma-separated: each a variant of this engine")
    ap.add_argument("--mode", default="auto", help="comma-separated: each a variant (auto,dense: the default "
                    "mode beside dense decoding, interleaved)")
    ap.add_argument("--prompts", type=Path, default=Path("prompts/instructions_heldout.jsonl"))
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--batch1-prompts", type=int, default=8,
                    help="at N=1 ours decodes this many held-out prompts one after another")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, help="the JSON; its plot is written beside it (.png)")
    ap.add_argument("--replot", type=Path, help="only plot this JSON (written by this benchmark) beside it")
    args = ap.parse_args()
    if args.replot:
        print(plot_batched(json.loads(args.replot.read_text()), args.replot.with_suffix(".png")))
        return
    sizes = [int(s) for s in args.sizes.split(",")]
    weights = args.weights.split(",")
    modes = args.mode.split(",")
    # the variants: each weight format in each mode ("<weights>" with one mode, "<weights>/<mode>" with several)
    variants = [(w, m, w if len(modes) == 1 else f"{w}/{m}") for w in weights for m in modes]
    threads = torch.get_num_threads()
    # one build: "llama.cpp"; several: "llama.cpp:<its build folder>" each (bin/ is skipped)
    llama_builds = {("llama.cpp" if len(args.llama_bench) == 1 else
                     f"llama.cpp:{(b.parent.parent if b.parent.name == 'bin' else b.parent).name}"): b
                    for b in args.llama_bench}
    runs: dict[str, list[float]] = {}
    chosen: dict[str, dict] = {}
    for n in sizes:
        engines = {w: SpecEEEngine.from_pretrained(args.model, max_batch_size=n, weights=w, prefix_cache=False)
                   for w in weights}
        first = next(iter(engines.values()))
        dec = chat_prompts(first, args.prompts, n if n > 1 else args.batch1_prompts)
        pre = long_prompts(first, args.prompts, n, args.prompt_tokens)
        for w, e in engines.items():
            chosen[f"{w}@{n}"] = {"weights": e.model.weight_format, "dtype": str(e.model.dtype).removeprefix("torch.")}
        for w, m, _ in variants:
            # warm-up: the N rows for 16 tokens (kernels, oneDNN's primitives for this size's shapes, the plan's costs,
            # its first measured steps): a first call pays ~0.3 s more at 16 rows, once per process
            ours(engines[w], dec, pre[:1], 16, m, one_at_a_time=n == 1)
        for rnd in range(args.rounds):
            for build, binary in llama_builds.items():
                got = llama_batched(binary, args.gguf or imported_gguf(args.model), [n], args.prompt_tokens,
                                    args.tokens, threads)[n]
                for k, v in got.items():
                    runs.setdefault(f"{build}_{k}@{n}", []).append(v)
            for w, m, name in (variants if rnd % 2 == 0 else reversed(variants)):
                for k, v in ours(engines[w], dec, pre, args.tokens, m, one_at_a_time=n == 1).items():
                    runs.setdefault(f"{name}_{k}@{n}", []).append(v)
            print(json.dumps({k: round(v[-1], 1) for k, v in runs.items() if k.endswith(f"@{n}")}), flush=True)
        del engines
    med = {k: round(statistics.median(v), 1) for k, v in runs.items()}
    ratios, fastest = {}, {}
    if llama_builds:
        for n in sizes:
            for k in ("decode", "prefill"):
                fastest[f"{k}@{n}"] = max(llama_builds, key=lambda b: med[f"{b}_{k}@{n}"])
                for _, _, name in variants:  # against llama.cpp's fastest build at this size
                    ratios[f"{name}_{k}@{n}"] = round(med[f"{name}_{k}@{n}"] / med[f"{fastest[f'{k}@{n}']}_{k}@{n}"], 3)
    out = {"git_commit": git_commit(), "machine": machine_facts(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
           "config": {k: str(v) for k, v in vars(args).items()}, "engines": chosen,
           "tokens_per_s_median": med, "tokens_per_s_runs": {k: [round(x, 1) for x in v] for k, v in runs.items()},
           "ratio_to_llama_cpp": ratios, "llama_cpp_fastest_build": fastest,
           "note": "decode: N different prompts at once (N=1: batch1-prompts prompts one after another), tokens "
                   "after each row's first over the seconds after the last first token (llama.cpp: S_TG at N "
                   "parallel sequences); prefill: N prompts of prompt-tokens tokens, prefix cache off, to the last "
                   "first token (llama.cpp: S_PP); ratios against llama.cpp's fastest build at each size"}
    emit_json(out, args.out)
    if args.out:
        plot_batched(out, args.out.with_suffix(".png"))


def _decode_sizes(result: dict, name: str) -> list[int]:
    return sorted(int(k.rsplit("@", 1)[1]) for k in result["tokens_per_s_median"] if k.startswith(f"{name}_decode@"))


def plot_batched(result: dict, path: Path) -> Path:
    """Left: decode tokens/s (medians) against batch size, per variant and llama.cpp build. Right, where the run
    has modes auto and dense: each round's auto / dense per batch size, and the medians' ratio."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    med, runs = result["tokens_per_s_median"], result["tokens_per_s_runs"]
    names = sorted({k.rsplit("_decode@", 1)[0] for k in med if "_decode@" in k},
                   key=lambda n: (n.startswith("llama"), n))  # ours first
    pairs = sorted({(n.rsplit("/", 1)[0]) for n in names if n.endswith("/auto") and n[:-5] + "/dense" in names})
    fig, axes = plt.subplots(1, 2 if pairs else 1, figsize=(11 if pairs else 6, 4.2), squeeze=False)
    ax = axes[0][0]
    for name in names:
        sizes = _decode_sizes(result, name)
        ax.plot(sizes, [med[f"{name}_decode@{n}"] for n in sizes], marker="o", ls="--" if name.startswith("llama") else "-",
                label=name if name.startswith("llama") else f"weights {name.replace('/', ', mode ')}")
    ax.set_xscale("log", base=2)
    every = sorted({n for name in names for n in _decode_sizes(result, name)})
    ax.set_xticks(every, [str(n) for n in every])
    ax.set_xlabel("batch size (rows decoding at once)")
    ax.set_ylabel("decode tokens/s (median)")
    ax.legend(fontsize=7)
    if pairs:
        ax = axes[0][1]
        for w in pairs:
            sizes = _decode_sizes(result, f"{w}/auto")
            for i, n in enumerate(sizes):
                a, d = runs[f"{w}/auto_decode@{n}"], runs[f"{w}/dense_decode@{n}"]
                ax.scatter([i] * len(a), [x / y for x, y in zip(a, d)], color="tab:blue", s=14, alpha=0.6,
                           label="a round" if i == 0 else None)
                ax.scatter([i], [statistics.median(a) / statistics.median(d)], color="tab:red", marker="_", s=300,
                           label="medians" if i == 0 else None)
            ax.set_xticks(range(len(sizes)), [str(n) for n in sizes])
        ax.axhline(1.0, color="grey", lw=0.6)
        ax.axhline(0.95, color="grey", lw=0.6, ls=":")
        ax.set_xlabel("batch size")
        ax.set_ylabel("auto / dense decode tokens/s")
        ax.legend(fontsize=7)
    fig.suptitle(f"{Path(result['config']['model']).name}, {result['machine'].get('machine', '?')}, "
                 f"{result['machine'].get('threads', '?')} threads, commit {result['git_commit']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    main()
