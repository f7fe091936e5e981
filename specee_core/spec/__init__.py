"""Speculative decoding: acceptance, mode auto's measured costs and its choice of each step (costs, expected, plan),
the propose-verify-commit decode step (drafts from specee_core.draft), and T3 (early exit inside verification)."""
