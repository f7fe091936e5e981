"""KV memory with a budget and the prefix cache (specee_core.decode.core, specee_core.decode.memory) on the
trained bundled model in fp32: rows preempted when the budget runs dry resume with the tokens they get
without preemption, in every lossless mode, and a stream sends no token twice; a row that could never
fit is refused at submission; cached prompt blocks give the same tokens as prefilling them."""
from __future__ import annotations

import pytest

from specee_core import PromptError
from specee_core.decode.core import EngineCore
from specee_core.decode.request import Request
from specee_core.step.sampling import SamplingParams
from tests.conftest import CODE_PROMPTS

SYSTEM = ("# utilities for parsing configuration files, reading and writing JSON, and checking paths\n"
          "import json\nimport os\nfrom pathlib import Path\n\n\ndef load(path):\n    with open(path) as f:\n"
          "        return json.load(f)\n\n\n")


@pytest.fixture(scope="module")
def engine(bundled_fp32):
    return bundled_fp32


def solo(engine, prompt, params, mode, spec):
    core = EngineCore(engine, max_rows=1, kv_bytes=256 << 20, prefix_cache=False)
    return core.run(Request([prompt], params, mode, spec))[0]


REGEX = {"type": "regex", "pattern": "([a-z]+ = [0-9]+\\n){40,80}"}  # structured output that keeps rows going


@pytest.mark.parametrize("mode, spec, structured", [
    ("dense", None, None), ("spec", None, None), ("spec", {"proposer": "lookup"}, None),
    ("spec", {"width": 2, "depth": 3}, None), ("spec", None, REGEX)])
def test_preempted_rows_resume_with_their_tokens(engine, code_ids, mode, spec, structured):
    """Two lanes of one step (the second request brings the mode's stepper factory as its own, which keys a
    lane of its own), each of which alone fits the budget and together do not: the newest rows are preempted as
    the lanes grow and resumed when memory is free again, each with the tokens it gets alone (the first lane's
    rows sample with their own seed: they draw the same after a resume; under structured output a resumed row
    takes its grammar state back)."""
    bs = 16
    core = EngineCore(engine, max_rows=2, prefill_chunk=64, kv_bytes=8 * bs * engine.slot_bytes(), block_size=bs,
                      prefix_cache=False)
    core.min_slots = 16
    streamed: dict[tuple[int, int], list[int]] = {}
    long_params = SamplingParams(max_new_tokens=56, ignore_eos=True, structured=structured, temperature=0.9, seed=3)
    reqs = [core.submit(Request([code_ids[0], code_ids[1]], long_params, mode, spec,
                                on_token=lambda i, t: streamed.setdefault((0, i), []).append(t))),
            core.submit(Request([code_ids[2], code_ids[3]], SamplingParams(max_new_tokens=56, structured=structured),
                                mode, spec, on_token=lambda i, t: streamed.setdefault((1, i), []).append(t),
                                stepper=engine.stepper_factory(mode, spec)))]
    steps = 0
    while not all(r.done for r in reqs):
        core.step()
        steps += 1
        assert steps < 2000
        assert core.budget.used <= core.budget.capacity
    assert core.preemptions > 0
    for k, req in enumerate(reqs):
        assert req.error is None
        for i, (p, got) in enumerate(zip(req.prompt_ids, req.results)):
            ref = solo(engine, p, req.params, mode, spec)
            assert (got.token_ids, got.text, got.finish_reason) == (ref.token_ids, ref.text, ref.finish_reason)
            assert streamed[(k, i)] == got.token_ids  # no token re-sent after a resume
    assert core.budget.used == 0  # every block went back


def test_a_row_that_could_never_fit_the_budget_is_refused_at_once(engine, code_ids):
    core = EngineCore(engine, max_rows=2, kv_bytes=4 * 16 * engine.slot_bytes(), block_size=16)
    with pytest.raises(PromptError, match="KV budget holds 4"):
        core.submit(Request([code_ids[0]], SamplingParams(max_new_tokens=100), "dense"))
    assert core.run(Request([code_ids[0]], SamplingParams(max_new_tokens=8), "dense"))[0].token_ids  # this one fits


@pytest.mark.parametrize("mode", ["dense", "spec", "specee"])
def test_prefix_cache_gives_the_same_tokens_as_prefilling(engine, mode):
    prompts = [engine.encode_prompt(SYSTEM + p) for p in CODE_PROMPTS]
    params = SamplingParams(max_new_tokens=24)
    got = {}
    for on in (False, True):
        core = EngineCore(engine, max_rows=2, prefill_chunk=512, kv_bytes=64 << 20, prefix_cache=on)
        got[on] = core.run(Request(prompts, params, mode))
    assert [r.token_ids for r in got[True]] == [r.token_ids for r in got[False]]
    assert [r.exit_layers for r in got[True]] == [r.exit_layers for r in got[False]]
    assert all(r.cached_prompt_tokens == 0 for r in got[False])
    shared = len(engine.encode_prompt(SYSTEM)) - 1
    # the first row computes the shared blocks; the others wait for them (not computing them twice) and find
    # them cached (whole blocks only)
    assert got[True][0].cached_prompt_tokens == 0
    for r in got[True][1:]:
        assert 0 < r.cached_prompt_tokens <= shared and r.cached_prompt_tokens % 16 == 0
        assert r.cached_prompt_tokens > shared - 16


def test_generate_reports_cached_prompt_tokens(engine):
    prompts = [SYSTEM + p for p in CODE_PROMPTS[:2]]
    engine.generate(prompts[:1], max_new_tokens=2, mode="dense")
    again = engine.generate(prompts, max_new_tokens=2, mode="dense")
    assert all(r.cached_prompt_tokens > 0 for r in again)
    assert engine.core.memory()["prefix_cache_blocks"] > 0


@pytest.mark.parametrize("mode", ["dense", "auto", "spec"])
def test_a_finished_lanes_kv_memory_is_freed_at_once(engine, mode):
    """When a lane's last row finishes its caches are freed then, not by the cyclic collector at some later step
    (of another call)."""
    import gc
    import weakref

    core = EngineCore(engine, max_rows=2, kv_bytes=256 << 20, prefix_cache=False)
    caches = []
    new_cache = engine.model.new_cache

    def tracked(*args, **kwargs):
        cache = new_cache(*args, **kwargs)
        caches.append(weakref.ref(cache.k))
        return cache

    engine.model.new_cache = tracked
    gc.disable()
    try:
        core.run(Request([engine.encode_prompt(p) for p in CODE_PROMPTS[:2]],
                         SamplingParams(max_new_tokens=8), mode, None))
        assert caches and all(ref() is None for ref in caches)
    finally:
        gc.enable()
        del engine.model.new_cache



def test_the_core_hands_the_heaps_free_pages_back_while_it_steps(engine, code_ids):
    """glibc's malloc keeps freed pages in its heap; with prefix blocks living long among each step's activations
    those pages grew the process to several times its KV budget. The core calls malloc_trim every few seconds of
    stepping (here: every step)."""
    core = EngineCore(engine, max_rows=2, kv_bytes=64 << 20)
    real = core.heap._trim
    assert real is not None, "malloc_trim not found (not glibc?)"
    calls = []
    core.heap.every_s = 0.0
    core.heap._trim = lambda pad: calls.append(pad) or real(pad)
    core.run(Request([code_ids[0]], SamplingParams(max_new_tokens=6, ignore_eos=True), "dense", None))
    assert len(calls) >= 5  # a step each: the prompt's, then a token each
