"""What a decode step reads and returns: the per-row state (Batch), the contract between the engine core
and a decode step (Stepper, StepOutput), the dense step every mode's dense steps run (dense), the step policy
(policy: an engine's measured step costs, the drafting rule and the early-exit gate), sampling and stop strings.
Below early exit, speculative decoding and the engine core, which all build on it."""
