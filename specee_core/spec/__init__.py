"""Speculative decoding: acceptance, mode auto's measured costs and its choice of a step's shape (costs, expected,
plan; whether to draft at all is specee_core.step.policy's rule), the propose-verify-commit decode step (drafts from
specee_core.draft), and T3 (early exit inside verification)."""
