"""Speculative decoding: acceptance, the planner, the propose-verify-commit decode step (drafts from
specee_core.draft), and T3 (early exit inside verification)."""
