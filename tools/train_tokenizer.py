"""Train a byte-level BPE tokenizer on the corpus and save it in HF layout.

    python -m tools.train_tokenizer --corpus data/corpus --out models/specee-tiny --vocab-size 8192

The saved tokenizer.json / tokenizer_config.json load offline through transformers'
AutoTokenizer and through the engine. Encoding prepends BOS, as Llama tokenizers do.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from jobs.build_corpus import iter_texts

BOS, EOS = "<s>", "</s>"


@dataclass
class TokenizerConfig:
    corpus: Path
    out: Path
    vocab_size: int = 8192

    def __post_init__(self) -> None:
        self.corpus, self.out = Path(self.corpus), Path(self.out)
        if not 4096 <= self.vocab_size <= 8192:
            raise ValueError(f"vocab_size must be in [4096, 8192], got {self.vocab_size}")
        if not (self.corpus / "train.jsonl").is_file():
            raise FileNotFoundError(f"{self.corpus / 'train.jsonl'} not found: run jobs.build_corpus first")


def train(cfg: TokenizerConfig):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    tok.train_from_iterator(iter_texts(cfg.corpus / "train.jsonl"), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=EOS, clean_up_tokenization_spaces=False
    )
    cfg.out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(cfg.out)
    return fast


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", default="data/corpus")
    p.add_argument("--out", default="models/specee-tiny")
    p.add_argument("--vocab-size", type=int, default=8192)
    args = p.parse_args(argv)
    fast = train(TokenizerConfig(corpus=args.corpus, out=args.out, vocab_size=args.vocab_size))
    sample = "def main(argv=None):\n    return 0\n"
    ids = fast(sample)["input_ids"]
    print(json.dumps({"vocab_size": len(fast), "sample_tokens": len(ids), "sample_bytes": len(sample)}))


if __name__ == "__main__":
    main()
