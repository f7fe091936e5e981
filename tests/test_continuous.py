"""Continuous batching (specee_core.decode.core) on the trained bundled model in fp32: every prompt of
requests that arrive while others decode, with chunked prefill, fewer rows than prompts, stop strings
and different lengths, gets exactly what it gets when run alone, in every mode; admission is fair
per request; cancellation frees rows; failures stay with their request."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from specee_core.decode.core import EngineCore
from specee_core.decode.request import CancelledRequest, Request
from specee_core.decode.runner import Runner
from specee_core.step.sampling import SamplingParams
from tests.conftest import CODE_PROMPTS


@pytest.fixture(scope="module")
def engine(bundled_fp32):
    return bundled_fp32


def alone(engine, prompt_ids, params, mode, spec):
    factory, headroom = engine.stepper_factory(mode, spec)
    return engine.run([prompt_ids], params, factory, mode=mode, cache_headroom=headroom)[0]


@pytest.mark.parametrize("mode, spec", [("dense", None), ("spec", {"proposer": "lookup"}), ("spec", None),
                                        ("spec", {"width": 2, "depth": 3}), ("specee", None)])
def test_rows_joining_a_running_batch_get_what_they_get_alone(engine, code_ids, mode, spec):
    sch = EngineCore(engine, max_rows=3, prefill_chunk=5)
    first = sch.submit(Request([code_ids[0], code_ids[1]], SamplingParams(max_new_tokens=12), mode, spec))
    sch.step()
    sch.step()  # the first request is decoding when the next ones arrive
    second = sch.submit(Request([code_ids[2]], SamplingParams(max_new_tokens=7, stop=["\n"]), mode, spec))
    sch.step()
    third = sch.submit(Request(code_ids[3:7], SamplingParams(max_new_tokens=20), mode, spec))
    steps = 0
    while not all(r.done for r in (first, second, third)):
        sch.step()
        steps += 1
        assert steps < 500
    for req in (first, second, third):
        assert req.error is None
        for p, got in zip(req.prompt_ids, req.results):
            ref = alone(engine, p, req.params, mode, spec)
            assert (got.token_ids, got.text, got.finish_reason) == (ref.token_ids, ref.text, ref.finish_reason)
            assert got.exit_layers == ref.exit_layers
    assert max(r.peak_batch for r in (first, second, third)) == 3 and not sch.lanes  # rows shared steps; lanes gone


def test_a_short_request_is_not_starved_by_a_long_one(engine, code_ids):
    """200 prompts arrive first, then one: the late request gets the next free row (turns per request),
    so it finishes long before the big one, which still ends with every result right."""
    sch = EngineCore(engine, max_rows=4, prefill_chunk=64)
    big = sch.submit(Request([code_ids[i % len(code_ids)] for i in range(200)], SamplingParams(max_new_tokens=6),
                             "dense"))
    sch.step()
    small = sch.submit(Request([code_ids[3]], SamplingParams(max_new_tokens=6), "dense"))
    steps_small = None
    steps = 0
    while not big.done:
        sch.step()
        steps += 1
        if small.done and steps_small is None:
            steps_small = steps
    assert steps_small is not None and steps_small <= 12 < steps
    assert small.results[0].token_ids == alone(engine, code_ids[3], small.params, "dense", None).token_ids
    assert all(r is not None for r in big.results)
    assert big.results[5].token_ids == alone(engine, code_ids[5], big.params, "dense", None).token_ids


def mixed_settings(n: int) -> list[SamplingParams]:
    """n requests' sampling, each its own: greedy, seeded draws of several temperatures, top-k / top-p / min-p,
    penalties, logit_bias, logprobs, and draws from torch's generator (no seed)."""
    kinds = [dict(), dict(temperature=0.8, seed=11), dict(temperature=1.2, top_k=20, seed=12),
             dict(temperature=0.6, top_p=0.8, seed=13), dict(temperature=1.0, min_p=0.1, seed=14, logprobs=2),
             dict(frequency_penalty=0.8, repetition_penalty=1.3), dict(temperature=0.9, presence_penalty=0.5, seed=15),
             dict(temperature=0.7), dict(logit_bias={13: 3.0}, temperature=0.5, seed=16)]
    return [SamplingParams(max_new_tokens=10 + i % 5, ignore_eos=True, **kinds[i % len(kinds)]) for i in range(n)]


@pytest.mark.parametrize("mode, spec", [("dense", None), ("spec", None), ("spec", {"proposer": "lookup"}),
                                        ("spec", {"width": 2, "depth": 3})])
def test_rows_of_any_sampling_share_one_step_and_draw_what_they_draw_alone(engine, code_ids, mode, spec):
    """16 requests, each with its own sampling, decode in one lane (one forward per step for all 16), and every
    greedy or seeded row gets exactly the tokens it gets alone in a core of one row, and in a lossless mode
    the tokens dense decoding gives it: a seeded row's draws depend on nothing but its seed."""
    params = mixed_settings(16)
    sch = EngineCore(engine, max_rows=16)
    reqs = [sch.submit(Request([code_ids[i % len(code_ids)]], p, mode, spec)) for i, p in enumerate(params)]
    sch.step()
    assert len(sch.lanes) == 1
    while not all(r.done for r in reqs):
        sch.step()
    assert max(r.peak_batch for r in reqs) == 16
    for req in reqs:
        assert req.error is None and len(req.results[0].token_ids) == req.params.max_new_tokens
        if req.params.seed is None and not req.params.greedy:
            continue  # drawn from torch's generator: nothing to compare
        ref = alone(engine, req.prompt_ids[0], req.params, mode, spec)
        assert req.results[0].token_ids == ref.token_ids, req.params
        assert req.results[0].token_ids == alone(engine, req.prompt_ids[0], req.params, "dense", None).token_ids
        if req.params.logprobs is not None:
            got, want = ([e["top_logprobs"] for e in r.logprobs] for r in (req.results[0], ref))
            assert [[t for t, _ in e] for e in got] == [[t for t, _ in e] for e in want]
            torch.testing.assert_close(torch.tensor([[v for _, v in e] for e in got]),
                                       torch.tensor([[v for _, v in e] for e in want]), atol=1e-4, rtol=0)


def test_the_prompts_of_one_call_share_one_lane_whatever_their_lengths(engine, code_ids):
    """A lane is as long as the longest of the rows waiting for it: a short prompt first and a long one after it
    (which would not fit the short one's power of two) decode in one lane, one forward per step for both."""
    short = code_ids[0]
    long = (code_ids[1] * 20)[:300 - len(short)]
    new = 256 - len(short) - 8  # the short row alone: a 256-slot lane; the long one needs 512
    assert len(short) + new <= 256 < len(long) + new <= engine.context_len
    sch = EngineCore(engine, max_rows=4, prefix_cache=False)
    req = sch.submit(Request([short, long], SamplingParams(max_new_tokens=new, ignore_eos=True), "dense"))
    sch.step()
    assert len(sch.lanes) == 1 and len(sch.lanes[0].rows) == 2
    while not req.done:
        sch.step()
    assert [len(r.token_ids) for r in req.results] == [new, new]


def test_cancel_frees_rows_and_a_failing_callback_ends_only_its_request(engine, code_ids):
    sch = EngineCore(engine, max_rows=2)
    long = sch.submit(Request([code_ids[0], code_ids[1]], SamplingParams(max_new_tokens=40, ignore_eos=True), "dense"))

    def broken(i, tok):
        raise RuntimeError("client gone")

    bad = sch.submit(Request([code_ids[2]], SamplingParams(max_new_tokens=5), "dense", on_token=broken))
    waiting = sch.submit(Request([code_ids[3]], SamplingParams(max_new_tokens=5), "dense"))
    for _ in range(3):
        sch.step()
    long.cancel()
    for _ in range(20):
        sch.step()
    assert long.done and isinstance(long.error, CancelledRequest)
    assert bad.done and isinstance(bad.error, RuntimeError)
    assert waiting.done and waiting.error is None  # got a row once the others left
    assert waiting.results[0].token_ids == alone(engine, code_ids[3], waiting.params, "dense", None).token_ids
    assert not sch.busy and sch.running_rows() == 0


def test_chunked_prefill_keeps_others_decoding(engine, code_ids):
    """A long prompt prefilled 8 tokens per step: the row already decoding makes a token every step."""
    sch = EngineCore(engine, max_rows=2, prefill_chunk=8)
    running = sch.submit(Request([code_ids[0]], SamplingParams(max_new_tokens=30, ignore_eos=True), "dense"))
    while not sch.lanes or sch.lanes[0].batch.n_generated(0) < 2:  # its own prefill done, decoding
        sch.step()
    long_prompt = engine.encode_prompt("".join(CODE_PROMPTS) * 2)
    late = sch.submit(Request([long_prompt], SamplingParams(max_new_tokens=4), "dense"))
    lane = sch.lanes[0]
    before = lane.batch.n_generated(0)
    prefill_steps = -(-len(long_prompt) // 8)
    for _ in range(prefill_steps):
        sch.step()
    assert lane.batch.n_generated(0) == before + prefill_steps  # one token per step throughout
    while not (running.done and late.done):
        sch.step()
    assert late.results[0].token_ids == alone(engine, long_prompt, late.params, "dense", None).token_ids
    assert running.results[0].token_ids == alone(engine, code_ids[0], running.params, "dense", None).token_ids


def test_runner_serves_threads(engine, code_ids):
    runner = Runner(EngineCore(engine, max_rows=4))
    futures = {}

    def client(i):
        futures[i] = runner.submit(Request([code_ids[i]], SamplingParams(max_new_tokens=6), "dense"))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
        time.sleep(0.01)
    for t in threads:
        t.join()
    for i, fut in futures.items():
        assert fut.result(timeout=60)[0].token_ids == alone(engine, code_ids[i], SamplingParams(max_new_tokens=6),
                                                            "dense", None).token_ids
    runner.check()
    with pytest.raises(ValueError, match="mode"):
        runner.submit(Request([code_ids[0]], SamplingParams(), "fast"))
    with pytest.raises(ValueError, match="empty"):
        runner.submit(Request([[]], SamplingParams(), "dense"))
    assert torch.is_inference_mode_enabled() is False


def test_runner_survives_callers_that_cancel_their_futures(engine, code_ids):
    """asyncio.wrap_future cancels the concurrent future when the awaiting task is cancelled (a client
    hanging up); the request ending later must not kill the runner's thread."""
    runner = Runner(EngineCore(engine, max_rows=2))
    req = Request([code_ids[0]], SamplingParams(max_new_tokens=200, ignore_eos=True), "dense")
    fut = runner.submit(req)
    assert fut.cancel() or fut.done()
    req.cancel()
    for _ in range(3):
        after = runner.submit(Request([code_ids[1]], SamplingParams(max_new_tokens=4), "dense"))
        assert after.result(timeout=60)[0].token_ids == alone(engine, code_ids[1], SamplingParams(max_new_tokens=4),
                                                               "dense", None).token_ids
    runner.check()


def test_a_submit_that_raises_leaves_none_of_its_prompts_decoding(engine):
    """SpecEEEngine.submit queues one request per distinct SamplingParams; when a later one cannot run (a token id
    outside the vocabulary), those queued before it are cancelled: no prompt of a call that raised decodes on for
    nobody (the batch job's calls in flight share the engine with whatever is left running)."""
    tokens = []
    params = [SamplingParams(max_new_tokens=400, ignore_eos=True),
              SamplingParams(max_new_tokens=4, logit_bias={10**7: 1.0})]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.submit(CODE_PROMPTS[:2], mode="dense", sampling_params=params, on_token=lambda i, t: tokens.append(t))
    until = time.monotonic() + 60
    while engine.core.busy and time.monotonic() < until:
        time.sleep(0.01)
    assert not engine.core.busy and len(tokens) < 10  # stopped within a step or two, not after 400 tokens
    again = engine.submit(CODE_PROMPTS[:1], mode="dense", sampling_params=SamplingParams(max_new_tokens=4))
    assert len(again.result(timeout=60)[0].token_ids) == 4


def test_lanes_grow_with_their_rows_and_give_their_memory_back(engine, code_ids):
    sch = EngineCore(engine, max_rows=2, kv_bytes=256 << 20, prefix_cache=False)
    req = sch.submit(Request([code_ids[2]], SamplingParams(max_new_tokens=300, ignore_eos=True), "dense"))
    caps = []
    while not req.done:
        sch.step()
        caps += [lane.capacity for lane in sch.lanes]
        assert sch.budget.used == sum(lane.blocks(sch.budget) for lane in sch.lanes)
    assert caps[0] == 256 and caps == sorted(caps) and caps[-1] > 256  # first 256 slots, grown as the row grew
    assert len(req.results[0].token_ids) == 300
    assert not sch.lanes and sch.budget.used == 0  # an emptied lane gives its blocks back


@pytest.mark.parametrize("lanes", [(("spec", {"depth": 3}), ("spec", {"depth": 4, "lookup": "off"})),
                                   (("specee", None), ("spec", None))], ids=["spec", "specee"])
def test_lanes_side_by_side_keep_their_own_draft_state(engine, code_ids, lanes):
    """Two lanes that draft with the draft head at once (their steps differ): each stepper drafts with its own
    draft cache (each lane's Proposer), so both give their solo results."""
    (mode_a, spec_a), (mode_b, spec_b) = lanes
    sch = EngineCore(engine, max_rows=2)
    short = sch.submit(Request([code_ids[0], code_ids[1]], SamplingParams(max_new_tokens=10), mode_a, spec_a))
    long = sch.submit(Request([code_ids[2], code_ids[3]], SamplingParams(max_new_tokens=60, ignore_eos=True), mode_b,
                              spec_b))
    sch.step()
    assert len(sch.lanes) == 2
    while not (short.done and long.done):
        sch.step()
    for req in (short, long):
        for p, got in zip(req.prompt_ids, req.results):
            assert got.token_ids == alone(engine, p, req.params, req.mode, req.spec).token_ids


def test_generate_takes_sampling_params_per_prompt(engine):
    """generate(sampling_params=[...]): every prompt decodes in one lane whatever its parameters, and each gets
    what a call with its own parameters gives (seeded sampling included); the results come back in the prompts'
    order."""
    greedy, short = SamplingParams(max_new_tokens=12), SamplingParams(max_new_tokens=4, stop=["\n"])
    sampled = SamplingParams(max_new_tokens=10, temperature=0.8, seed=7)
    params = [greedy, sampled, short, greedy]
    got = engine.generate(CODE_PROMPTS[:4], mode="dense", sampling_params=params)
    for prompt, p, r in zip(CODE_PROMPTS[:4], params, got):
        assert r.token_ids == engine.generate([prompt], mode="dense", sampling_params=p)[0].token_ids
    assert len(got[2].token_ids) <= 4
    with pytest.raises(ValueError, match="one per prompt"):
        engine.generate(CODE_PROMPTS[:2], sampling_params=[greedy])


def test_a_lower_priority_takes_free_rows_first_and_equal_ones_take_turns(engine, code_ids):
    """Request.priority: with two rows, a request of priority 1 submitted after one of priority 2 takes both rows
    and its prompts finish before the other's start (the batch job's earlier call first); at equal priorities the
    two requests take one row each."""
    for prio, first_rows in (((2, 1), {1: 2}), ((0, 0), {0: 1, 1: 1})):
        sch = EngineCore(engine, max_rows=2)
        started: dict[int, list[int]] = {0: [], 1: []}

        def note(k):
            return lambda i, tok: started[k].append(sch.steps) if len(started[k]) <= i else None

        reqs = [sch.submit(Request(code_ids[2 * k : 2 * k + 2], SamplingParams(max_new_tokens=6, ignore_eos=True),
                                   "dense", priority=prio[k], on_token=note(k))) for k in (0, 1)]
        sch.step()

        def rows_of(k: int) -> int:
            return sum(r.request is reqs[k] for lane in sch.lanes for r in lane.rows.values())

        assert {k: rows_of(k) for k in (0, 1) if rows_of(k)} == first_rows
        while not all(r.done for r in reqs):
            sch.step()
        if prio == (2, 1):
            assert max(started[1]) < min(started[0])  # the earlier priority's rows all started first
