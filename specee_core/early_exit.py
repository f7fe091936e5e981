"""Speculative early exit (placeholder loader until the predictors land)."""
from __future__ import annotations


def load_early_exit(model_dir, model, tokenizer, **options):
    if options:
        raise TypeError(f"unknown engine options: {sorted(options)}")
    return None
