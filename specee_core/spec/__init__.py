"""Speculative decoding: proposers (the draft head's token trees, prompt lookup), acceptance, the
propose-verify-commit decode step, and T3 (early exit inside verification)."""
