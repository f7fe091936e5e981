"""Decoding: the engine (loading, modes, generate), its one core (the scheduler and decode loop over a KV budget
with a prefix cache: core, memory) and the dense decode step the other steps fall back to (dense)."""
