"""Speculative early exit (SpecEE): exit predictors over the proposer's candidates (specee_core.draft), their layer schedule and calibrated
thresholds, the early-exit decode step, and the training data for the predictors."""
