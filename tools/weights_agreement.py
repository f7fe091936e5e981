"""How far each weight format's greedy outputs stay from the model's own weights with fp32 activations: the
numbers that decide which approximate formats weights="auto" may pick (specee_core.model.weight_plan).

The reference is the checkpoint's low-bit blocks (q4 for SmolLM2's GGUF) with fp32 activations, which equal
the fp32 model on those weights token for token. Each format decodes the same prompts greedily, in batches
of --batch-size as a job would: held-out chat instructions and HumanEval's prompts (chat, the evaluation's
stop strings). Per format and prompt set: identical completions, first divergence, token agreement
(specee_eval.metrics.agreement). Prints (and with --out writes) JSON with the commit and the machine.
A model without a chat template gets the instructions as plain prompts (and no HumanEval set).

With --llama-simple (llama.cpp's `llama-simple`, built from the same sources as llama-cpp-python: README,
"llama.cpp as a peer"), llama.cpp's greedy completion of each instruction on the model's GGUF file is scored
against the same reference: its text after the prompt, tokenized with the model's tokenizer, cut at the
reference's length (llama.cpp prints text, not ids; a token split differently in the re-tokenization counts
as a divergence there).

    python -m tools.weights_agreement --formats bf16,q4+bf16,q4a8 --out docs/weights_agreement_smollm2.json
    python -m tools.weights_agreement --model models/gemma3-270m --reference fp32 --formats auto,gguf,bf16 \
        --n-humaneval 0 --llama-simple llama.cpp/build/bin/llama-simple --out docs/weights_agreement_gemma3.json
"""
from __future__ import annotations

import argparse
import json
import logging
import subprocess
import time
from pathlib import Path

import torch

from jobs.cli import emit_json, git_commit
from specee_core import SamplingParams, SpecEEEngine
from specee_core.machine import machine_facts
from specee_core.model.gguf import imported_gguf
from specee_eval import humaneval, metrics

log = logging.getLogger(__name__)


def engine_kwargs(fmt: str, reference: str) -> dict:
    """from_pretrained's arguments of a format name: "bf16" (every matrix in bf16), "<planes>+bf16" (the
    checkpoint's blocks, bf16 activations), "q4a8" / "q8a8" (int8 activations), "fp32", "auto" (every default), or
    the reference's planes with fp32 activations. The reference runs in fp32 activations whatever its name."""
    if fmt == "auto":
        return {}
    if fmt in ("bf16", "fp32"):
        return {"weights": fmt, **({"dtype": "float32"} if fmt == reference == "fp32" else {})}
    if fmt.endswith("+bf16"):
        return {"weights": fmt.removesuffix("+bf16"), "dtype": "bfloat16"}
    return {"weights": fmt, "dtype": "float32"}


def prompt_sets(engine: SpecEEEngine, instructions: Path, n_instr: int, n_he: int) -> dict[str, tuple[list[str], list[str]]]:
    """{name: (prompts, stop strings)}: held-out chat instructions, and HumanEval's prompts as jobs.evaluate runs them."""
    rows = [json.loads(line) for line in instructions.read_text().splitlines()[:n_instr]]
    if not engine.has_chat_template:
        return {"instructions": ([r["prompt"] for r in rows], [])}
    sets = {"instructions": ([engine.chat_prompt([{"role": "user", "content": r["prompt"]}]) for r in rows], [])}
    if n_he:
        problems = humaneval.load_problems(n_he)
        sets["humaneval"] = ([humaneval.engine_prompt(p, engine.chat_prompt) for p in problems],
                             humaneval.stop_strings(True))
    return sets


def decode(engine: SpecEEEngine, prompts: list[str], stop: list[str], max_new: int, batch: int) -> list[list[int]]:
    """Greedy dense token ids of every prompt, batch rows at a time."""
    out = []
    for i in range(0, len(prompts), batch):
        got = engine.generate(prompts[i : i + batch], mode="dense",
                              sampling_params=SamplingParams(max_new_tokens=max_new, stop=list(stop)))
        out += [r.token_ids for r in got]
    return out


def llama_cpp_greedy(binary: Path, gguf: Path, engine: SpecEEEngine, prompts: list[str], max_new: int) -> list[list[int]]:
    """llama.cpp's greedy completion of each prompt (one llama-simple run each), as the model tokenizer's ids."""
    out = []
    for prompt in prompts:
        text = subprocess.run([str(binary), "-m", str(gguf), "-n", str(max_new), prompt], capture_output=True,
                              text=True, check=True, timeout=600).stdout
        at = text.find(prompt)
        if at < 0:
            raise RuntimeError(f"llama-simple's output does not hold the prompt: {text[:200]!r}")
        ids = engine.tokenizer.encode(text[at + len(prompt):], add_special_tokens=False)
        out.append(ids[:max_new])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/smollm2-135m-instruct")
    ap.add_argument("--reference", default="q4", help="the checkpoint's own blocks, run with fp32 activations")
    ap.add_argument("--formats", default="bf16,q4+bf16,q4a8")
    ap.add_argument("--instructions", type=Path, default=Path("prompts/instructions_heldout.jsonl"))
    ap.add_argument("--n-instructions", type=int, default=64)
    ap.add_argument("--n-humaneval", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--llama-simple", type=Path, help="llama.cpp's llama-simple: its greedy completions beside")
    ap.add_argument("--gguf", type=Path, help="the GGUF llama.cpp runs (default: the one the model was imported from)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    results: dict[str, dict] = {}
    ref_ids: dict[str, list[list[int]]] = {}
    sets = None
    for fmt in [args.reference, *args.formats.split(",")]:
        t0 = time.perf_counter()
        engine = SpecEEEngine.from_pretrained(args.model, max_batch_size=args.batch_size,
                                              **engine_kwargs(fmt, args.reference))
        sets = sets or prompt_sets(engine, args.instructions, args.n_instructions, args.n_humaneval)
        row = {"weights": engine.model.weight_format, "dtype": str(engine.model.dtype).removeprefix("torch.")}
        for name, (prompts, stop) in sets.items():
            ids = decode(engine, prompts, stop, args.max_new_tokens, args.batch_size)
            if fmt == args.reference:
                ref_ids[name] = ids
            row[name] = metrics.agreement(ref_ids[name], ids)
            row[name]["tokens"] = sum(len(x) for x in ids)
        row["seconds"] = round(time.perf_counter() - t0, 1)
        results[fmt] = row
        log.info("%s: %s", fmt, json.dumps(row))
        if args.llama_simple and fmt == args.reference:
            t0 = time.perf_counter()
            prompts = sets["instructions"][0]
            ids = llama_cpp_greedy(args.llama_simple, args.gguf or imported_gguf(args.model), engine, prompts,
                                   args.max_new_tokens)
            ref = [r[: len(x)] if len(x) < args.max_new_tokens else r for r, x in zip(ref_ids["instructions"], ids)]
            results["llama.cpp"] = {"instructions": {**metrics.agreement(ref, ids), "tokens": sum(map(len, ids))},
                                    "seconds": round(time.perf_counter() - t0, 1), "binary": str(args.llama_simple)}
            log.info("llama.cpp: %s", json.dumps(results["llama.cpp"]))
        del engine
    out = {"git_commit": git_commit(), "machine": machine_facts(torch.device("cpu")),
           "cpu_capability": torch.backends.cpu.get_cpu_capability(), "config": {k: str(v) for k, v in vars(args).items()},
           "reference": f"{args.reference} with fp32 activations", "formats": results}
    emit_json(out, args.out)


if __name__ == "__main__":
    main()
