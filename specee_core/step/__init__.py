"""What a decode step reads and returns: the per-row state (Batch), the contract between the engine core
and a decode step (Stepper, StepOutput), sampling and stop strings. Below early exit, speculative
decoding and the engine core, which all build on it."""
