"""Decoding: the engine (batched prefill and the decode loop), the per-row batch state, the step contract
between the loop and a decode step, sampling, stop strings, continuous batching and the measured plan of
mode auto."""
