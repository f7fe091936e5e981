"""Decoding: the engine (loading, modes, generate), its one core (scheduler and decode loop over a KV
budget with a prefix cache), the per-row state, the step contract between the loop and a decode step,
sampling, stop strings and the measured plan of mode auto."""
