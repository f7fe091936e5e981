"""Speculative decoding: greedy mode="spec" equals dense token for token; the tree-attention verify
forward equals running each root-to-node path on its own; KV of accepted nodes is kept exactly."""
from __future__ import annotations

import pytest
import torch

from specee_core import SamplingParams, SpecEEEngine, load_model
from specee_core.spec.acceptance import accept_greedy
from specee_core.draft.tree import Draft
from tests.conftest import BUNDLED, make_hf_model

CODE = ["import os\nimport sys\n\n\ndef main(argv=None):\n", "class Point:\n    def __init__(self, x, y):\n",
        "    def __repr__(self):\n        return", "for key, value in sorted(items.items()):\n",
        "x = [1, 2, 3]\ny = [1, 2, 3]\nz = [1, 2,"]


@pytest.fixture(scope="module")
def tiny():
    return SpecEEEngine.from_pretrained(BUNDLED, dtype="float32")


@pytest.fixture(scope="module")
def sharp_model_dir(tmp_path_factory):
    """A random config whose outputs depend on positions (sharp attention, llama3 rope)."""
    path = tmp_path_factory.mktemp("spec-sharp")
    make_hf_model(path, layers=3, hidden=96, heads=6, kv_heads=2, qk_scale=6.0, max_pos=512,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    return path


@pytest.mark.parametrize("proposer,shape", [
    ("draft", {"depth": 1, "lookup": "off"}), ("draft", {"depth": 4, "lookup": "off"}),
    ("draft", {"depth": 4, "width": 3, "nodes": 10, "lookup": "off"}),
    ("draft", {"depth": 4, "width": 2, "nodes": 6, "lookup": "merge"}), ("draft", {"depth": 4, "lookup": "first"}),
    ("lookup", {"depth": 1}), ("lookup", {"depth": 4})])
def test_greedy_spec_equals_dense_on_the_bundled_model(tiny, proposer, shape):
    dense = tiny.generate(CODE, max_new_tokens=40, ignore_eos=True, mode="dense")
    shape = {**shape, "step_budget": None}  # every row drafts in full, however many rows
    spec = tiny.generate(CODE, max_new_tokens=40, ignore_eos=True, mode="spec", spec={"proposer": proposer, **shape})
    single = [tiny.generate([p], max_new_tokens=40, ignore_eos=True, mode="spec",
                            spec={"proposer": proposer, **shape})[0] for p in CODE[:2]]
    assert [r.token_ids for r in spec] == [r.token_ids for r in dense]
    assert [r.token_ids for r in single] == [r.token_ids for r in dense[:2]]
    accepted = sum(r.stats["mean_accepted"] * r.stats["spec_steps"] for r in spec)
    assert accepted > 20, "drafts were hardly ever accepted: the acceptance path went untested"
    assert all(r.stats["mode"] == "spec" and r.stats["spec_steps"] < 40 for r in spec)


@pytest.mark.parametrize("shape", [{"depth": 5, "width": 8, "nodes": 12, "lookup": "off"},
                                   {"depth": 5, "width": 4, "nodes": 12, "lookup": "first"}], ids=["wide", "t3-shape"])
def test_a_row_at_the_end_of_a_full_lane_has_room_for_the_draft_heads_whole_expansion(tiny, shape):
    """The lane is sized to the row's prompt + max_tokens + the stepper's headroom exactly (256 slots): the
    draft head's expansion ((depth - 1) * width nodes past the root, every row to the batch's deepest level)
    must fit in it, as the verify chunk must. Guards a KV overflow that failed a whole lane (H100, batch 64)."""
    m = 24
    spec = {"proposer": "draft", **shape, "step_budget": None}
    headroom = tiny.stepper_factory("spec", spec, None)[1]
    words = " ".join(["import os", "x = [1, 2, 3]", "def main(argv=None):", "class Point:"] * 60)
    ids = tiny.tokenizer(words, add_special_tokens=False)["input_ids"]
    length = tiny.core.min_slots - headroom - m  # prompt + max_tokens + headroom = the lane's 256 slots
    prompt = tiny.tokenizer.decode(ids[: length - 1])
    prompts = [prompt, *CODE[:2]]  # other rows keep drafting at full depth while the long one ends
    assert len(tiny.encode_prompt(prompt)) <= length
    dense = tiny.generate(prompts, max_new_tokens=m, ignore_eos=True, mode="dense")
    got = tiny.generate(prompts, max_new_tokens=m, ignore_eos=True, mode="spec", spec=spec)
    assert [r.token_ids for r in got] == [r.token_ids for r in dense]


def test_greedy_spec_equals_dense_on_a_position_sensitive_random_model(sharp_model_dir):
    engine = SpecEEEngine.from_pretrained(sharp_model_dir, dtype="float32")
    prompts = [p * 3 for p in CODE]  # repetitive: prompt lookup finds continuations
    dense = engine.generate(prompts, max_new_tokens=24, ignore_eos=True, mode="dense")
    spec = engine.generate(prompts, max_new_tokens=24, ignore_eos=True, mode="spec", spec={"depth": 5})
    assert [r.token_ids for r in spec] == [r.token_ids for r in dense]


def test_stops_hold_inside_an_accepted_block(tiny):
    dense = tiny.generate(CODE, max_new_tokens=40, ignore_eos=True, mode="dense")
    # max_new_tokens not a multiple of a block, EOS and a stop string in the middle of blocks
    for n in (1, 2, 7):
        spec = tiny.generate(CODE, max_new_tokens=n, ignore_eos=True, mode="spec", spec={"depth": 4})
        assert [r.token_ids for r in spec] == [r.token_ids[:n] for r in dense]
    eos = dense[0].token_ids[9]
    saved = tiny.eos_ids
    tiny.eos_ids = saved | {eos}
    try:
        d = tiny.generate(CODE, max_new_tokens=40, mode="dense")
        s = tiny.generate(CODE, max_new_tokens=40, mode="spec", spec={"depth": 4})
    finally:
        tiny.eos_ids = saved
    assert [r.token_ids for r in s] == [r.token_ids for r in d]
    assert s[0].finish_reason == "stop" and s[0].token_ids[-1] == eos and len(s[0].token_ids) <= 10
    stop = dense[1].text[8:11]
    d = tiny.generate(CODE, max_new_tokens=40, stop=[stop], mode="dense")
    s = tiny.generate(CODE, max_new_tokens=40, stop=[stop], mode="spec", spec={"depth": 4})
    assert [(r.text, r.finish_reason, r.token_ids) for r in s] == [(r.text, r.finish_reason, r.token_ids) for r in d]


def test_tree_verify_equals_each_path_run_alone_and_keep_leaves_the_path(sharp_model_dir):
    """A tree root -> {a -> {c, d}, b}: each node's output from one tree forward equals the output of
    its root-to-node path fed after the prefix; keeping path root-b compacts the cache to what
    feeding root, b after the prefix writes."""
    model = load_model(sharp_model_dir)
    prefix = torch.randint(2, 8000, (1, 30))
    tokens = torch.tensor([[11, 12, 13, 14, 15]])  # root, a, b, c, d
    draft = Draft(tokens=tokens, parent=torch.tensor([[-1, 0, 0, 1, 1]]), valid=torch.ones(1, 5, dtype=torch.bool))
    depth, anc = draft.depth_and_ancestors()
    assert depth.tolist() == [[0, 1, 1, 2, 2]]
    cache = model.new_cache(1, 64)
    model.forward(prefix, torch.arange(30)[None], cache)
    h = model.forward(tokens, 30 + depth, cache, tree=anc)
    for node, path in ((0, [0]), (1, [0, 1]), (2, [0, 2]), (3, [0, 1, 3]), (4, [0, 1, 4])):
        alone = model.new_cache(1, 64)
        model.forward(prefix, torch.arange(30)[None], alone)
        ref = model.forward(tokens[:, path], torch.arange(30, 30 + len(path))[None], alone)
        torch.testing.assert_close(h[0, node], ref[0, -1], atol=1e-5, rtol=1e-5)
    cache.keep(None, torch.tensor([30]), torch.tensor([[0, 2]]), torch.tensor([2]))
    assert cache.lengths[:, 0].tolist() == [32] * model.num_layers
    alone = model.new_cache(1, 64)
    model.forward(prefix, torch.arange(30)[None], alone)
    model.forward(tokens[:, [0, 2]], torch.arange(30, 32)[None], alone)
    torch.testing.assert_close(cache.k[:, :, :, :32], alone.k[:, :, :, :32], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache.v[:, :, :, :32], alone.v[:, :, :, :32], atol=1e-5, rtol=1e-5)


def test_greedy_acceptance_takes_the_longest_agreeing_path():
    draft = Draft(tokens=torch.tensor([[5, 7, 8, 9, 4]]), parent=torch.tensor([[-1, 0, 0, 1, 2]]),
                  valid=torch.ones(1, 5, dtype=torch.bool))
    # base's choice after each node: after root 8 (node 2 agrees, node 1 not), after node 2: 4 (node 4 agrees)
    v = accept_greedy(draft, torch.tensor([[8, 9, 4, 0, 6]]))
    assert v.accepted == [[2, 4]] and v.tokens == [[8, 4, 6]]
    v = accept_greedy(draft, torch.tensor([[3, 9, 4, 0, 6]]))  # nothing agrees: the bonus token alone
    assert v.accepted == [[]] and v.tokens == [[3]]


def test_a_lookup_chain_joins_the_tree_where_it_agrees_and_branches_where_it_parts():
    tree = Draft(tokens=torch.tensor([[5, 7, 8, 9], [5, 7, 8, 9]]), parent=torch.tensor([[-1, 0, 0, 1], [-1, 0, 0, 1]]),
                 valid=torch.tensor([[True] * 4, [True, True, True, False]]))
    merged = tree.with_chains([[7, 9, 3], [7, 9]])  # row 1's node 3 is padding: its 9 is new
    assert merged.tokens.tolist() == [[5, 7, 8, 9, 3], [5, 7, 8, 9, 9]]
    assert merged.parent.tolist() == [[-1, 0, 0, 1, 3], [-1, 0, 0, 1, 1]]
    assert merged.valid.tolist() == [[True] * 5, [True, True, True, False, True]]
    depth, _ = merged.depth_and_ancestors()
    assert depth.tolist() == [[0, 1, 1, 2, 3], [0, 1, 1, 0, 2]]


def test_spec_rejects_what_it_cannot_do(tiny, tmp_path):
    with pytest.raises(ValueError, match="depth"):
        tiny.generate(CODE[:1], max_new_tokens=4, mode="spec", spec={"depth": 0})
    with pytest.raises(ValueError, match="unknown spec options"):
        tiny.generate(CODE[:1], max_new_tokens=4, mode="spec", spec={"depht": 3})
    with pytest.raises(ValueError, match="mode='spec' or 'auto' only"):
        tiny.generate(CODE[:1], max_new_tokens=4, spec={"depth": 3}, mode="dense")
    make_hf_model(tmp_path, layers=2, hidden=64, heads=4, kv_heads=2)
    with pytest.raises(ValueError, match="draft head"):
        SpecEEEngine.from_pretrained(tmp_path, dtype="float32").generate(CODE[:1], max_new_tokens=4, mode="spec",
                                                         spec={"proposer": "draft"})


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    assert counts[probs == 0].sum() == 0, "a sample fell where the target puts no mass"
    keep = probs > 0
    exp = probs[keep] * n
    return float(((counts[keep] - exp) ** 2 / exp).sum())


@pytest.mark.parametrize("shape", [{"depth": 2, "width": 3, "nodes": 5}], ids=["tree"])
def test_sampled_spec_keeps_the_base_distribution_end_to_end(tiny, shape):
    """top_k=3 sampling, 3 tokens, rows at two temperatures in one batch (half seeded, half drawing from torch's
    generator): per temperature the empirical joint of spec mode (draft head, depth 2, a tree; a drafted token
    kept where it is the row's own draw) against the exact joint from the base model, by chi-square over the 27
    cells. (A chain's sampled rows equal dense's token for token: test_smollm2 and test_continuous.)"""
    prompt = CODE[1]
    m = tiny.model
    ids = tiny.encode_prompt(prompt)

    def dist(seq, temperature):  # the base's top-3 distribution after seq
        with torch.inference_mode():
            logits = m.logits(m.forward(torch.tensor([seq]), torch.arange(len(seq))[None], m.new_cache(1, 64))[0, -1])
        top = logits.topk(3)
        return top.indices.tolist(), (top.values / temperature).softmax(-1).tolist()

    def joint(temperature):
        exact = {}
        t1s, p1 = dist(ids, temperature)
        for a, pa in zip(t1s, p1):
            t2s, p2 = dist(ids + [a], temperature)
            for b, pb in zip(t2s, p2):
                t3s, p3 = dist(ids + [a, b], temperature)
                for c, pc in zip(t3s, p3):
                    exact[(a, b, c)] = pa * pb * pc
        return exact

    temps, n = (1.0, 0.6), 600
    params = [SamplingParams(max_new_tokens=4, temperature=temps[i % 2], top_k=3, ignore_eos=True,
                             seed=i if i % 4 < 2 else None) for i in range(2 * n)]
    torch.manual_seed(0)
    wide = SpecEEEngine.from_pretrained(BUNDLED, dtype="float32", max_batch_size=2 * n)  # every row in one lane
    runs = wide.generate([prompt] * (2 * n), mode="spec", spec={"proposer": "draft", "step_budget": None, **shape},
                         sampling_params=params)
    assert sum(r.stats["mean_accepted"] * r.stats["spec_steps"] for r in runs) > 100  # drafts were accepted
    for k, t in enumerate(temps):
        exact = joint(t)
        cells = sorted(exact)
        counts = torch.zeros(len(cells))
        for r in runs[k::2]:
            key = tuple(r.token_ids[:3])
            assert key in exact, f"{key}: outside the top-3 support"
            counts[cells.index(key)] += 1
        probs = torch.tensor([exact[c] for c in cells])
        assert chi_square(counts, probs / probs.sum()) < 60.0, t  # 26 degrees of freedom, p ~ 2e-4
        other = torch.tensor([v for _, v in sorted(joint(temps[1 - k]).items())])
        assert chi_square(counts, other / other.sum()) > 60.0  # the other temperature's joint is told apart


def test_t3_switched_off_equals_dense_and_switched_on_exits_inside_verification(tiny):
    """spec + T3 with a threshold no predictor reaches runs every layer and equals dense; with threshold
    0 every scored block exits at a scheduled layer, the skipped layers get the kept nodes' KV, and
    decoding carries on to max_new_tokens with fewer layers per token."""
    ee = tiny.early_exit
    L = tiny.model.num_layers
    shape = {"proposer": "draft", "depth": 3, "width": ee.predictors.k, "nodes": 8, "t3": True, "step_budget": None,
             "lookup": "off"}
    dense = tiny.generate(CODE, max_new_tokens=24, ignore_eos=True, mode="dense")
    try:
        tiny.early_exit = ee.with_options(threshold=2.0)
        off = tiny.generate(CODE, max_new_tokens=24, ignore_eos=True, mode="spec", spec=shape)
        tiny.early_exit = ee.with_options(threshold=0.0)
        on = tiny.generate(CODE, max_new_tokens=24, ignore_eos=True, mode="spec", spec=shape)
    finally:
        tiny.early_exit = ee
    assert [r.token_ids for r in off] == [r.token_ids for r in dense]
    assert all(l == L for r in off for l in r.exit_layers)
    first = min(set(ee.schedule.offline_layers) & set(ee.predictors.layers))
    assert all(len(r.token_ids) == 24 for r in on)
    assert sum(l == first for r in on for l in r.exit_layers) > 24, "blocks should exit at the first scored layer"
    with pytest.raises(ValueError, match="width"):
        tiny.generate(CODE[:1], max_new_tokens=4, mode="spec", spec={**shape, "width": ee.predictors.k + 1})


def test_the_step_budget_trims_drafts_for_large_batches_and_drafting_resumes_as_rows_finish(tiny):
    """step_budget 6 over 5 rows leaves no draft (dense steps, pairs pending in the draft head); when
    EOS has ended three rows, the two left may draft 2 nodes each again, from the pending pairs. The
    output stays dense's; a budget of 1 never drafts."""
    dense = tiny.generate(CODE, max_new_tokens=40, ignore_eos=True, mode="dense")
    running = set(dense[3].token_ids) | set(dense[4].token_ids)
    eos = {next(t for t in r.token_ids[4:] if t not in running) for r in dense[:3]}  # rows 0-2 end early
    saved = tiny.eos_ids
    tiny.eos_ids = saved | eos
    try:
        d = tiny.generate(CODE, max_new_tokens=40, mode="dense")
        s = tiny.generate(CODE, max_new_tokens=40, mode="spec", spec={"proposer": "draft", "depth": 4, "step_budget": 6, "lookup": "off"})
        none = tiny.generate(CODE, max_new_tokens=40, mode="spec", spec={"proposer": "draft", "depth": 4, "step_budget": 1})
    finally:
        tiny.eos_ids = saved
    assert [r.token_ids for r in s] == [r.token_ids for r in d] == [r.token_ids for r in none]
    assert [len(r.token_ids) == 40 for r in s] == [False, False, False, True, True]
    assert all(r.stats["mean_accepted"] > 0.2 for r in s[3:])  # they drafted once the others were gone
    assert all(r.stats["mean_accepted"] == 0 for r in none)


def test_t3_gives_draft_confidence_predictors_each_nodes_candidate_probabilities(tiny, monkeypatch):
    """Predictors of feature set "zpdq" inside verification get, per scored node, the draft's
    probabilities of that node's candidates (best first, a distribution's top-k); predictors that fire
    on any confidence exit like threshold 0, ones that never fire equal dense. Predictors that also read
    the draft's record ("zpdqh") get an empty one for every node, and the same exits."""
    from specee_core.early_exit import step as ee_step
    from specee_core.early_exit.predictors import HIDDEN, LayerPredictor, PredictorBank

    ee, L = tiny.early_exit, tiny.model.num_layers
    k = ee.predictors.k

    def bank(tau: float, features: str = "zpdq") -> PredictorBank:  # fires iff the draft's top probability > tau
        w1 = torch.zeros(HIDDEN, (5 if features == "zpdqh" else 4) * k)
        w1[0, 3 * k] = 1.0
        w2 = torch.zeros(1, HIDDEN)
        w2[0, 0] = 100.0
        return PredictorBank(k, {l: LayerPredictor(w1.clone(), torch.zeros(HIDDEN), w2.clone(),
                                                   torch.tensor([-100.0 * tau])) for l in ee.predictors.layers},
                             features=features)

    seen, records = [], []
    real_init = ee_step.CandidateScorer.__init__
    monkeypatch.setattr(ee_step.CandidateScorer, "__init__",
                        lambda self, m, cand, backend, q=None, *rest: seen.append(q) or records.append(rest[1:])
                        or real_init(self, m, cand, backend, q, *rest))
    shape = {"proposer": "draft", "depth": 3, "width": k, "nodes": 8, "t3": True, "step_budget": None, "lookup": "off"}
    dense = tiny.generate(CODE[:2], max_new_tokens=16, ignore_eos=True, mode="dense")
    opts = ee.with_options(threshold=0.5).options
    try:
        tiny.early_exit = ee_step.EarlyExit(tiny.model, ee.draft, ee.source, bank(1.5), ee.schedule, opts)
        never = tiny.generate(CODE[:2], max_new_tokens=16, ignore_eos=True, mode="spec", spec=shape)
        tiny.early_exit = ee_step.EarlyExit(tiny.model, ee.draft, ee.source, bank(0.0), ee.schedule, opts)
        always = tiny.generate(CODE[:2], max_new_tokens=16, ignore_eos=True, mode="spec", spec=shape)
        records.clear()
        tiny.early_exit = ee_step.EarlyExit(tiny.model, ee.draft, ee.source, bank(0.0, "zpdqh"), ee.schedule, opts)
        with_record = tiny.generate(CODE[:2], max_new_tokens=16, ignore_eos=True, mode="spec", spec=shape)
    finally:
        tiny.early_exit = ee
    assert [r.token_ids for r in never] == [r.token_ids for r in dense]
    first = min(set(ee.schedule.offline_layers) & set(ee.predictors.layers))
    assert sum(l == first for r in always for l in r.exit_layers) > 8
    q = torch.cat([x for x in seen if x is not None])
    assert len(q) > 0 and bool((q > 0).all()) and bool((q.sum(-1) <= 1 + 1e-5).all())
    assert bool((q[:, :-1] >= q[:, 1:]).all())  # best first
    given = [r[0] for r in records if r and r[0] is not None]
    assert given and all(bool((r == 0).all()) for r in given)
    assert [r.exit_layers for r in with_record] == [r.exit_layers for r in always]


def test_a_long_backlog_is_fed_apart_with_the_same_draft_features(tiny, monkeypatch):
    """The proposer queues a row's prompt pairs at admission and feeds every queued pair with the next draft;
    a row with a long backlog beside rows with a few pairs is fed in a chunk of its own (one chunk would pad
    every row to the longest). Apart or together, the draft head's cache and the features it predicts agree
    (to fp32 rounding), in the rows' order."""
    from specee_core.draft import proposer as proposer_module
    from specee_core.draft.proposer import Proposer

    draft = tiny.draft
    d = tiny.model.config.hidden_size
    backlog = [3, 40, 2, 25]  # rows 1 and 3 are fed apart from 0 and 2

    def fed(apart: int):
        monkeypatch.setattr(proposer_module, "FEED_APART", apart)
        prop = Proposer(draft, len(backlog), 64, tiny.model.device)
        gen = torch.Generator().manual_seed(1)
        for b, c in enumerate(backlog):
            prop.push([b], [torch.randint(0, tiny.model.config.vocab_size, (c,), generator=gen).tolist()],
                      [torch.randn(c, d, generator=gen)])
        assert prop.backlog(list(range(len(backlog)))) == sum(backlog) and prop.backlog([1, 3]) == 65
        synced, counts, f = prop._feed(list(range(len(backlog))))
        caught_up, pairs = prop.take_catch_up()
        # the time spent on long backlogs is kept apart from the step's (the planner weighs what drafting costs
        # a step), with the pairs fed then; a feed of a few pairs per row is a step's own work
        assert (caught_up > 0) == (max(backlog) > apart) and prop.take_catch_up() == (0.0, 0)
        assert pairs == sum(c for c in backlog if c > apart) and prop.backlog(list(range(len(backlog)))) == 0
        prop.push([0], [[1]], [torch.randn(1, d, generator=gen)])
        prop._feed([0])
        assert prop.take_catch_up() == (0.0, 0)
        return synced, counts, f, prop.cache

    s1, c1, f1, cache1 = fed(16)
    s2, c2, f2, cache2 = fed(1000)  # every row in one chunk
    assert c1.tolist() == c2.tolist() == backlog and s1.tolist() == s2.tolist() == [0] * 4
    torch.testing.assert_close(f1, f2, rtol=1e-4, atol=1e-5)
    assert cache1.lengths.tolist() == cache2.lengths.tolist()
    for b, c in enumerate(backlog):
        torch.testing.assert_close(cache1.k[:, b, :, :c], cache2.k[:, b, :, :c], rtol=1e-4, atol=1e-5)
