"""Write <model>/MODEL_CARD.md from the logs the training jobs left beside the model.

    python -m jobs.model_card --model models/specee-tiny
    python -m jobs.model_card --model models/smollm2-135m-instruct

A model imported from a GGUF file (specee_import.json beside it) gets a card for its SpecEE
artifacts: the base file and its sha256, the distilled training data, the draft head's
held-out and decode hit rates, the predictors, the oracle exit depth and the schedule.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from jobs.cli import parse_config

REPRODUCE = """make corpus tokenizer base draft predictors schedule   # or, step by step:
python -m jobs.build_corpus --out data/corpus
python -m tools.train_tokenizer --corpus data/corpus --out models/specee-tiny --vocab-size 8192
python -m tools.train_base --out models/specee-tiny --time-budget-min 100 --ckpt-every-s 180
python -m jobs.train_draft --model models/specee-tiny --epochs 2
python -m jobs.train_predictors --model models/specee-tiny
python -m jobs.profile_schedule --model models/specee-tiny
python -m jobs.model_card --model models/specee-tiny"""


@dataclass
class CardConfig:
    model: Path = Path("models/specee-tiny")
    corpus: Path = Path("data/corpus")


def load_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def render(cfg: CardConfig) -> str:
    if (cfg.model / "specee_import.json").is_file():
        return render_imported(cfg.model)
    m = cfg.model
    config = load_json(m / "config.json")
    log = load_json(m / "train_log.json")
    manifest = load_json(cfg.corpus / "manifest.json")
    draft = load_json(m / "draft" / "config.json").get("specee", {})
    preds = load_json(m / "predictors_report.json")
    schedule = load_json(m / "schedule.json")
    held = log.get("heldout", {})
    size_mb = sum(f.stat().st_size for f in m.rglob("*.safetensors")) / 1e6
    lines = [
        f"# {m.name}", "",
        "A small Llama-architecture model trained from scratch on the Python standard library, shipped so "
        "that SpecEE's demo, tests and benchmarks run offline on a model whose middle layers already "
        "know many tokens. It writes plausible-looking Python; it is not a useful code model.", "",
        "## Architecture", "",
        f"- {config.get('num_hidden_layers')} decoder layers, hidden {config.get('hidden_size')}, "
        f"{config.get('num_attention_heads')} heads ({config.get('num_key_value_heads')} KV heads), "
        f"MLP {config.get('intermediate_size')}, vocab {config.get('vocab_size')} (byte-level BPE), "
        f"context {config.get('max_position_embeddings')}, tied embeddings, RoPE theta {config.get('rope_theta', 10000)}",
        f"- {log.get('params', 0) / 1e6:.1f}M parameters; weights in bf16 safetensors ({size_mb:.1f} MB with draft and predictors)", "",
        "## Training", "",
        f"- Corpus: `.py` files of the Python {manifest.get('python_version', '?')} standard library "
        f"({manifest.get('train', {}).get('bytes', 0) / 1e6:.1f} MB train, {manifest.get('heldout', {}).get('bytes', 0) / 1e6:.1f} MB held out "
        f"= {manifest.get('heldout_byte_share', 0):.1%}), split by module; held-out modules: "
        f"{', '.join(manifest.get('held_out_modules', []))}",
        f"- File-list hashes (sha256): train `{manifest.get('train', {}).get('file_list_sha256', '?')[:16]}`, "
        f"held-out `{manifest.get('heldout', {}).get('file_list_sha256', '?')[:16]}`",
        f"- {log.get('steps')} steps, {log.get('tokens_seen', 0) / 1e6:.2f}M tokens seen, "
        f"{log.get('train_time_s', 0) / 60:.0f} min on {log.get('device')} (torch {log.get('torch')})",
        f"- AdamW, peak lr {log.get('config', {}).get('lr')}, cosine to 10%, batch {log.get('config', {}).get('batch_size')} x "
        f"{log.get('config', {}).get('seq_len')} tokens", "",
        "## Held-out quality (256 windows of 512 tokens)", "",
        f"- loss {held.get('loss', float('nan')):.3f} nats/token, perplexity {held.get('ppl', float('nan')):.1f}, "
        f"{held.get('bits_per_byte', float('nan')):.3f} bits/byte",
        f"- greedy next-token accuracy {held.get('next_token_acc', float('nan')):.1%}", "",
        "## SpecEE artifacts", "",
        f"- `draft/`: EAGLE-1-layout draft head; held-out teacher-forced hit rate top-1 "
        f"{draft.get('heldout', {}).get('heldout_top1', float('nan')):.1%}, top-4 {draft.get('heldout', {}).get('heldout_top4', float('nan')):.1%}",
        f"- `predictors.safetensors`: one exit MLP per layer 1..{config.get('num_hidden_layers', 1) - 1}, trained on "
        f"{preds.get('steps', '?')} decode steps; oracle exit depth {preds.get('oracle_layer_fraction', float('nan')):.1%} of layers",
        f"- `schedule.json`: offline predictor layers {schedule.get('offline_layers')}, online window "
        f"{schedule.get('window')} with offsets {schedule.get('offsets')}", "",
    ]
    if preds.get("layers"):
        lines += ["| layer | positive rate | precision | recall |", "|---|---|---|---|"]
        for layer, r in preds["layers"].items():
            lines.append(f"| {layer} | {r['positive_rate']:.2f} | {r['precision']:.2f} | {r['recall']:.2f} |")
        lines.append("")
    lines += ["## Reproduce", "", "```", REPRODUCE, "```", ""]
    return "\n".join(lines)


def pct(x) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def lookup_veto_note(cal: dict) -> str:
    """The calibration's lookup veto, in words (empty without one)."""
    veto = cal.get("lookup_veto")
    if not veto:
        return ""
    shares = list(veto.get("vetoed", {}).values())
    return (f"; certified under the lookup veto (no exit against prompt lookup's token after a match of >= "
            f"{veto['min_ngram']} tokens: lookup matches on {pct(veto.get('matched'))} of the steps, and contradicts the "
            f"exit's token on {pct(sum(shares) / len(shares) if shares else None)}, mean over the layers)")


def exit_rule(profile: dict) -> str:
    """How a profiling run decided exits: a calibrated tolerance or a raw threshold."""
    if profile.get("max_disagreement") is not None:
        return f"thresholds calibrated to max_disagreement {profile['max_disagreement']}"
    return f"threshold {profile.get('threshold')}"


def render_imported(m: Path) -> str:
    """The card of a GGUF-imported model's SpecEE artifacts, from specee_import.json, the draft head's
    config, predictors_report.json, schedule.json and schedule_report.json."""
    record = load_json(m / "specee_import.json")
    config = load_json(m / "config.json")
    meta = load_json(m / "draft" / "config.json").get("specee", {})
    held, dcfg = meta.get("heldout", {}), meta.get("config", {})
    train = held.get("train", {})
    distill = train.get("distill_manifest", {})
    preds = load_json(m / "predictors_report.json")
    schedule = load_json(m / "schedule.json")
    prof = load_json(m / "schedule_report.json")
    spec = preds.get("speculator", {})
    cal = preds.get("calibration", {})
    decode, whole = spec.get("draft", {}), spec.get("draft_whole_vocab", {})
    draft_mb = sum(f.stat().st_size for f in (m / "draft").glob("*")) / 1e6
    k = dcfg.get("k", "4")
    n_layers = config.get("num_hidden_layers")
    lines = [
        f"# {m.name}: SpecEE artifacts", "",
        "SpecEE's draft head, per-layer exit predictors and predictor schedule for SmolLM2-135M-Instruct. "
        "The base weights are not in the repository: `make model` (jobs.import_gguf) converts them from the "
        "GGUF file below and checks its sha256. All numbers below are read from the training jobs' logs.", "",
        "## Base model", "",
        f"- `{record.get('source')}`, sha256 `{record.get('sha256')}`, {record.get('size', 0):,} bytes "
        f"(tensor types {record.get('quant_types')}), dequantized to {record.get('stored_dtype')} safetensors "
        f"(gguf {record.get('gguf_version')}, transformers {record.get('transformers_version')})",
        f"- {n_layers} decoder layers, hidden {config.get('hidden_size')}, {config.get('num_attention_heads')} heads "
        f"({config.get('num_key_value_heads')} KV heads), MLP {config.get('intermediate_size')}, vocab "
        f"{config.get('vocab_size')}, tied embeddings: {config.get('tie_word_embeddings')}; chat template from the GGUF", "",
        "## Training data", "",
        f"- Prompts: `{distill.get('prompts')}` for the draft head, `{preds.get('prompts')}` for the predictors "
        f"(tools.make_instructions: one user message per documented function "
        f"of standard-library modules outside the held-out list). Held-out modules, never trained on: "
        f"{', '.join(distill.get('held_out_modules_excluded', []))}. `prompts/instructions_heldout.jsonl` (those "
        "modules) and HumanEval were never used for training.",
        f"- Self-distillation (jobs.make_distill_data): the model's own {distill.get('decoding')} answers "
        f"({distill.get('dtype')}, chat template, at most {distill.get('max_new_tokens')} new tokens) to "
        f"{distill.get('rows')} prompts: {distill.get('prompt_tokens', 0):,} prompt and "
        f"{distill.get('answer_tokens', 0):,} answer tokens, {distill.get('seconds', 0) / 60:.0f} min of decoding",
        f"- Draft head: {train.get('train_rows')} of those rows ({train.get('train_tokens', 0):,} tokens, "
        f"sequences prompt + answer); {train.get('heldout_rows')} rows held out by a hash of the id for evaluation",
        f"- Predictors: full-depth greedy decoding ({preds.get('dtype')}, {preds.get('weights', preds.get('dtype'))} "
        f"weights) of {preds.get('num_prompts')} training prompts the draft never saw (drawn from the rows of "
        f"`{preds.get('prompts')}` after its first {preds.get('exclude_first', 0)}), {preds.get('steps')} decode steps",
        f"- Calibration: {cal.get('prompts')} further training prompts never used to train the predictors, "
        f"{cal.get('tokens')} decode steps (`calibration.safetensors`)" + lookup_veto_note(cal),
        f"- Schedule: {prof.get('num_prompts')} training prompts x {prof.get('max_new_tokens')} tokens in SpecEE mode "
        f"with every predictor on ({exit_rule(prof)})", "",
        "## Draft head (`draft/`)", "",
        f"- EAGLE-1 layout (one decoder layer over [token embedding; base feature]), bf16, {draft_mb:.1f} MB; "
        f"ranks the {held.get('subset_size', 'whole vocabulary')} most frequent answer tokens "
        f"({pct(held.get('draft_vocab_token_coverage'))} of the training answers' tokens)",
        f"- Trained {train.get('steps')} steps ({dcfg.get('epochs')} epochs planned, batch {dcfg.get('batch_size')}, "
        f"lr {dcfg.get('lr')}) in {train.get('train_time_s', 0) / 60:.0f} min on base features computed in "
        f"{train.get('feature_dtype')} ({train.get('features_s', 0) / 60:.0f} min)",
        "",
        f"| hit rate of the base model's greedy token | top-1 | top-{k} |", "|---|---|---|",
        f"| teacher-forced, held-out answers ({held.get('positions')} positions), frequent-token subset | "
        f"{pct(held.get('subset_top1'))} | {pct(held.get(f'subset_top{k}'))} |",
        f"| teacher-forced, held-out answers, whole vocabulary | {pct(held.get('heldout_top1'))} | "
        f"{pct(held.get(f'heldout_top{k}'))} |",
        f"| decoding ({decode.get('steps')} steps), frequent-token subset | {pct(decode.get('top1'))} | {pct(decode.get('topk'))} |",
        f"| decoding, whole vocabulary | {pct(whole.get('top1'))} | {pct(whole.get('topk'))} |", "",
        "## Exit predictors (`predictors.safetensors`)", "",
        (f"- One MLP (5k={5 * int(k)} -> 512 -> 1) per layer 1..{n_layers - 1 if n_layers else '?'} over the candidates' "
         "logits at the layer, their softmax, its shift from the layer below, the draft's own probabilities of them "
         "and the draft's recent record (its top candidate right one and two steps back, its hit rate over four; "
         "feature set zpdqh)" if preds.get("features") == "zpdqh" else
         f"- One MLP (4k={4 * int(k)} -> 512 -> 1) per layer 1..{n_layers - 1 if n_layers else '?'} over the candidates' "
         "logits at the layer, their softmax, its shift from the layer below and the draft's own probabilities of them "
         "(feature set zpdq)" if preds.get("features") == "zpdq" else
         f"- One MLP (3k={3 * int(k)} -> 512 -> 1) per layer 1..{n_layers - 1 if n_layers else '?'} (the paper's features)")
        + ("; an exit emits the draft's top candidate, label: that candidate is the full-depth token"
           if preds.get("exit_token") == "draft" else
           "; an exit emits the layer's argmax among the draft's candidates, label: that argmax is the full-depth token")
        + "; validated on a random 20% of the decode steps",
        f"- Oracle exit depth (the first layer from which every deeper layer's label holds): "
        f"{preds.get('oracle_avg_layers', float('nan')):.1f} layers, {pct(preds.get('oracle_layer_fraction'))} of the model", "",
        "| layer | positive rate | predicted rate | precision | recall |", "|---|---|---|---|---|",
    ]
    for layer, r in preds.get("layers", {}).items():
        lines.append(f"| {layer} | {r['positive_rate']:.2f} | {r['predicted_rate']:.2f} | {r['precision']:.2f} | {r['recall']:.2f} |")
    if cal:
        lines += ["", "## Calibrated thresholds (`calibration.safetensors`)", "",
                  "Per tolerance (`max_disagreement`, confidence 0.95): the layers that may exit and their thresholds "
                  "(specee_core.early_exit.calibration; every other layer never exits at that tolerance).", "",
                  "| tolerance | layers: threshold |", "|---|---|"]
        for eps, th in cal.get("thresholds", {}).items():
            ok = {l: t for l, t in th.items() if t is not None}
            lines.append(f"| {eps} | {', '.join(f'{l}: {t:g}' for l, t in ok.items()) or 'none'} |")
    lines += [
        "", "## Schedule (`schedule.json`)", "",
        f"- Offline predictor layers {schedule.get('offline_layers')} (the layers covering {pct(prof.get('coverage'))} "
        f"of the profiled early exits), online window {schedule.get('window')} with offsets {schedule.get('offsets')}",
        f"- Profiling with every predictor on: {prof.get('tokens')} tokens, {prof.get('avg_layers_all_predictors', float('nan')):.1f} "
        f"layers per token on average; exit histogram (layers run 1..{n_layers}): {prof.get('exit_histogram')}", "",
        "## Reproduce", "", "```",
        "make model   # jobs.import_gguf",
        f"python -m jobs.make_distill_data --model {m} --prompts {distill.get('prompts')} --out {dcfg.get('data')} "
        f"--limit {distill.get('rows')} --max-new-tokens {distill.get('max_new_tokens')} --batch-size 16 --dtype {distill.get('dtype')}",
        f"python -m jobs.train_draft --model {m} --data {dcfg.get('data')} --feature-dtype {dcfg.get('feature_dtype')} "
        f"--seq-len {dcfg.get('seq_len')} --batch-size {dcfg.get('batch_size')} --epochs {dcfg.get('epochs')} "
        f"--train-windows {dcfg.get('train_windows')} --time-budget-min {dcfg.get('time_budget_min')}",
        f"python -m jobs.train_predictors --model {m} --dtype {preds.get('dtype')} --weights {preds.get('weights')} "
        f"--prompts {preds.get('prompts')} --exclude-first {preds.get('exclude_first', 0)} "
        f"--num-prompts {preds.get('num_prompts')} --calib-prompts {cal.get('prompts', 0)} "
        f"--max-new-tokens {preds.get('max_new_tokens')} --epochs {preds.get('epochs')} "
        f"--max-samples {preds.get('max_samples')} --lookup-veto {cal.get('lookup_veto', {}).get('min_ngram', 0)}",
        f"python -m jobs.profile_schedule --model {m} --dtype {prof.get('dtype')} --weights {prof.get('weights')} "
        f"--prompts {prof.get('prompts')} --num-prompts {prof.get('num_prompts')} "
        f"--max-new-tokens {prof.get('max_new_tokens')}"
        + (f" --max-disagreement {prof['max_disagreement']}" if prof.get("max_disagreement") else ""),
        f"python -m jobs.model_card --model {m}", "```", "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(CardConfig, __doc__, argv)
    (cfg.model / "MODEL_CARD.md").write_text(render(cfg))
    print(f"wrote {cfg.model / 'MODEL_CARD.md'}")


if __name__ == "__main__":
    main()
