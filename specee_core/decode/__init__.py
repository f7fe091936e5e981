"""Decoding: the engine (loading, modes, generate), its one core (the scheduler and decode loop over a KV budget
with a prefix cache: core over requests and lanes, memory; runner: the core on a thread of its own) and mode dense's
stepper (dense, over specee_core.step.dense)."""
