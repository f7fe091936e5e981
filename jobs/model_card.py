"""Write <model>/MODEL_CARD.md from the logs the training jobs left beside the model.

    python -m jobs.model_card --model models/specee-tiny
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from jobs.cli import parse_config

REPRODUCE = """make corpus tokenizer base draft predictors schedule   # or, step by step:
python -m jobs.build_corpus --out data/corpus
python -m jobs.train_tokenizer --corpus data/corpus --out models/specee-tiny --vocab-size 8192
python -m jobs.train_base --out models/specee-tiny --time-budget-min 100 --ckpt-every-s 180
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


def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(CardConfig, __doc__, argv)
    (cfg.model / "MODEL_CARD.md").write_text(render(cfg))
    print(f"wrote {cfg.model / 'MODEL_CARD.md'}")


if __name__ == "__main__":
    main()
