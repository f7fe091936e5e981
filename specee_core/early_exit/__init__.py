"""Speculative early exit (SpecEE): speculators, exit predictors, their layer schedule and calibrated
thresholds, the early-exit decode step, and the training data for the predictors."""
