"""The one sampler every mode uses: logits processing (logit_bias, penalties, min_tokens) against a plain
reference; every lossless mode under penalties gives dense's greedy tokens; logprobs are the model's raw
distribution, equal across lossless modes; stop tokens end a row."""
from __future__ import annotations

import pytest
import torch

from specee_core import SamplingParams, SpecEEEngine
from specee_core.step.sampling import process_logits, token_counts
from tests.conftest import BUNDLED, drafting_plan

CODE = ["import os\nimport sys\n\n\ndef main(argv=None):\n", "class Point:\n    def __init__(self, x, y):\n",
        "for key, value in sorted(items.items()):\n", "x = [1, 2, 3]\ny = [1, 2, 3]\nz = [1, 2,"]


@pytest.fixture(scope="module")
def tiny():
    return SpecEEEngine.from_pretrained(BUNDLED, dtype="float32")


def process_texts(logits, params, texts, stop_ids, matchers=None, paths=None):
    """process_logits over (prompt, output) texts, one per logits row."""
    v = logits.shape[-1]
    seen = token_counts([prompt for prompt, _ in texts], v) > 0
    return process_logits(logits, params, [len(out) for _, out in texts], [stop_ids] * len(texts),
                          token_counts([out for _, out in texts], v), seen, matchers, paths)


def test_logits_processing_matches_a_plain_reference():
    """Each row by its own params (one row with all of them, one with others, one with none) against a plain
    loop over the vocabulary."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 12, generator=g) * 3
    p = SamplingParams(frequency_penalty=0.7, presence_penalty=0.4, repetition_penalty=1.5, logit_bias={2: 4.0, 9: -3.0},
                       min_tokens=2, stop_token_ids=[5])
    other = SamplingParams(frequency_penalty=-0.3, repetition_penalty=0.8, logit_bias={3: 1.0}, min_tokens=5)
    plain = SamplingParams()
    params = [p, other, plain, p]
    texts = [([1, 2], [3, 3, 4]), ([7], [7, 3]), ([0], [1, 1]), ([0], [11, 0, 11, 11])]
    got = process_texts(logits, params, texts, frozenset({5, 6}))
    want = logits.clone()
    for r, (prompt, output) in enumerate(texts):
        q = params[r]
        for v in range(12):
            x = want[r, v] + q.logit_bias.get(v, 0.0)
            if v in prompt or v in output:
                x = x / q.repetition_penalty if x > 0 else x * q.repetition_penalty
            c = output.count(v)
            x = x - q.frequency_penalty * c - (q.presence_penalty if c else 0.0)
            if len(output) < q.min_tokens and v in (5, 6):
                x = float("-inf")
            want[r, v] = x
    torch.testing.assert_close(got, want)
    assert got[2].equal(logits[2])  # a row that asks nothing keeps its logits
    assert process_texts(logits, [plain] * 4, texts, frozenset({5})) is logits  # nothing asked: untouched
    with pytest.raises(ValueError, match="frequency_penalty"):
        SamplingParams(frequency_penalty=3.0)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21)


PENALISED = dict(max_new_tokens=32, ignore_eos=True, frequency_penalty=0.9, presence_penalty=0.3,
                 repetition_penalty=1.3, logit_bias={13: 2.0})


@pytest.mark.parametrize("mode,spec", [
    ("spec", {"proposer": "draft", "depth": 4, "lookup": "off", "step_budget": None}),
    ("spec", {"proposer": "draft", "depth": 3, "width": 2, "nodes": 5, "lookup": "merge", "step_budget": None}),
    ("spec", {"proposer": "lookup", "depth": 4, "step_budget": None}),
    ("auto", None)], ids=["chain", "tree", "lookup", "auto"])
def test_penalties_keep_every_lossless_mode_equal_to_dense(tiny, penalised_dense, mode, spec):
    params = SamplingParams(**PENALISED)
    got = tiny.generate(CODE, mode=mode, spec=spec, sampling_params=params)
    assert [r.token_ids for r in got] == penalised_dense
    if mode == "spec":  # drafts were verified (and some accepted) under the penalties
        assert sum(r.stats["mean_accepted"] * r.stats["spec_steps"] for r in got) > 0


@pytest.fixture(scope="module")
def penalised_dense(tiny) -> list[list[int]]:
    dense = tiny.generate(CODE, mode="dense", sampling_params=SamplingParams(**PENALISED))
    plain = tiny.generate(CODE, mode="dense", max_new_tokens=32, ignore_eos=True)
    assert [r.token_ids for r in dense] != [r.token_ids for r in plain]  # the penalties act
    return [r.token_ids for r in dense]


def test_logprobs_are_the_models_raw_distribution_in_every_mode(tiny):
    params = SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=3)
    dense = tiny.generate(CODE[:2], mode="dense", sampling_params=params)
    m = tiny.model
    for prompt, r in zip(CODE[:2], dense):
        ids = tiny.encode_prompt(prompt) + r.token_ids
        with torch.inference_mode():
            h = m.forward(torch.tensor([ids]), torch.arange(len(ids))[None], m.new_cache(1, len(ids) + 1))
            ref = m.logits(h[0]).float().log_softmax(-1)[len(ids) - len(r.token_ids) - 1 : -1]  # before each token
        assert len(r.logprobs) == len(r.token_ids) == 12
        for j, (tok, e) in enumerate(zip(r.token_ids, r.logprobs)):
            assert e["token"] == tok and e["logprob"] == pytest.approx(ref[j, tok].item(), abs=1e-4)
            top = ref[j].topk(3)
            assert [t for t, _ in e["top_logprobs"]] == top.indices.tolist()
    for mode, spec in (("spec", {"proposer": "draft", "step_budget": None}), ("auto", None)):
        got = tiny.generate(CODE[:2], mode=mode, spec=spec, sampling_params=params)
        for a, b in zip(got, dense):
            assert a.token_ids == b.token_ids
            assert [e["logprob"] for e in a.logprobs] == pytest.approx([e["logprob"] for e in b.logprobs], abs=1e-4)
            assert [e["top_logprobs"][0][0] for e in a.logprobs] == [e["top_logprobs"][0][0] for e in b.logprobs]
    exits = tiny.generate(CODE[:2], mode="specee", sampling_params=params)  # the exit layer's distribution
    assert all(len(r.logprobs) == len(r.token_ids) for r in exits)
    assert tiny.generate(CODE[:1], mode="dense", max_new_tokens=3)[0].logprobs is None  # not asked: none


def test_stop_tokens_end_a_row_and_min_tokens_holds_them_back(tiny):
    base = tiny.generate(CODE[:1], mode="dense", max_new_tokens=16, ignore_eos=True)[0].token_ids
    stop = base[3]
    first = base.index(stop)
    r = tiny.generate(CODE[:1], mode="spec", sampling_params=SamplingParams(max_new_tokens=16, stop_token_ids=[stop]))[0]
    assert r.token_ids == base[: first + 1] and r.finish_reason == "stop"
    held = tiny.generate(CODE[:1], mode="dense", sampling_params=SamplingParams(
        max_new_tokens=16, stop_token_ids=[stop], min_tokens=first + 2))[0]
    assert stop not in held.token_ids[: first + 2]
    with pytest.raises(ValueError, match="SpecEE"):
        tiny.generate(CODE[:1], mode="specee", sampling_params=SamplingParams(frequency_penalty=1.0))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tiny.generate(CODE[:1], mode="dense", sampling_params=SamplingParams(logit_bias={10**7: 1.0}))


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "size": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "size"], "additionalProperties": False}


def test_the_mask_keeps_exactly_the_tokens_of_llguidances_bitmask(tiny):
    """mask_logits (rows along paths, some rows without a constraint) and allowed_tokens keep token t of row r
    exactly when bit t % 32 of word t // 32 of llguidance's mask after r's path is set (decoded here one token at
    a time), over the whole vocabulary; every kept token is one the matcher validates after the path."""
    from specee_core.step.grammar import _bitmask, allowed_tokens, mask_logits

    m = tiny.rules.grammar({"type": "json_schema", "schema": SCHEMA}).matcher()
    opening = tiny.tokenizer.encode('{"', add_special_tokens=False)
    paths, matchers = [[], opening, [], opening[:1]], [m, m, None, m]
    vocab = tiny.config.vocab_size
    logits = torch.randn(len(paths), vocab, generator=torch.Generator().manual_seed(1))
    masked = mask_logits(logits.clone(), matchers, paths)
    allowed = allowed_tokens(matchers, paths, vocab)
    rows, words = _bitmask(matchers, paths, vocab)
    for r, (matcher, path) in enumerate(zip(matchers, paths)):
        if matcher is None:
            want = [True] * vocab
        else:
            word = words[rows.index(r)].tolist()
            want = [bool((word[t // 32] >> (t % 32)) & 1) for t in range(vocab)]
            assert all(matcher.validate_tokens([*path, t]) == len(path) + 1 for t in range(vocab) if want[t])
        assert allowed[r].tolist() == want and 0 < sum(want)
        assert torch.isfinite(masked[r]).tolist() == want
        assert masked[r][allowed[r]].equal(logits[r][allowed[r]])
    assert sum(allowed[0].tolist()) < vocab  # the schema does refuse tokens


def test_forced_tokens_spell_the_bytes_only_the_grammar_allows(tiny):
    """Grammar.forced: at the start of the schema's object the key and its punctuation are forced; after a
    string value's closing quote the next key is; inside a free string nothing is; the matcher's state is left
    as it was; a path the grammar refuses forces nothing."""
    grammar = tiny.rules.grammar({"type": "json_schema", "schema": SCHEMA})
    m = grammar.matcher()
    tok = tiny.tokenizer
    start = grammar.forced(m, [], 16)
    assert tok.decode(start) == '{"name":"'
    assert grammar.forced(m, [], 2) == start[:2]
    inside = tok.encode('{"name":"ab', add_special_tokens=False)
    assert grammar.forced(m, inside, 16) == []
    closed = tok.encode('{"name":"ab"', add_special_tokens=False)
    assert tok.decode(grammar.forced(m, closed, 16)) == ',"size":'
    assert grammar.forced(m, tok.encode("[1]", add_special_tokens=False), 16) == []
    assert m.validate_tokens(start) == len(start)  # nothing was consumed
    assert grammar.forced(m, [], 0) == []


def test_greedy_masks_only_rows_whose_best_token_the_grammar_refuses(tiny):
    """Greedy under a grammar checks each row's best token and masks only the rows the grammar refuses it
    (grammar.only_disallowed_best): the same choices as masking every row, on rows along drafted paths of a
    JSON schema, some best tokens allowed and some not; when every best token is allowed the logits are the
    same tensor (no copy, no mask)."""
    from specee_core.step.grammar import mask_logits

    grammar = tiny.rules.grammar({"type": "json_schema", "schema": SCHEMA})
    m = grammar.matcher()
    tok = tiny.tokenizer
    opening = tok.encode('{"', add_special_tokens=False)
    paths = [[], opening, opening[:1], [], opening]
    matchers = [m] * len(paths)
    logits = torch.randn(len(paths), tiny.config.vocab_size, generator=torch.Generator().manual_seed(0))
    allowed_next = opening[len(paths[3]) : len(paths[3]) + 1][0]  # the token the grammar takes at row 3
    logits[3, allowed_next] = 100.0  # row 3's best token is allowed: it keeps its logits
    params = SamplingParams(structured={"type": "json_schema", "schema": SCHEMA})
    got = process_texts(logits, [params] * len(paths), [([], [])] * len(paths), frozenset(), matchers, paths)
    want = mask_logits(logits.clone(), matchers, paths)
    assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
    assert got[3].equal(logits[3]) and not want[0].equal(logits[0])  # row 0 was masked: its best was refused
    best_ok = torch.full_like(logits[:1], -5.0)
    best_ok[0, allowed_next] = 1.0
    assert process_texts(best_ok, [params], [([], [])], frozenset(), [m], [[]]) is best_ok


def test_structured_output_holds_and_keeps_every_lossless_mode_equal_to_dense(tiny):
    """A JSON schema: every row's text parses and validates; spec (chain, tree) and auto give dense's tokens
    under the same constraint (the mask follows each drafted path and rolls back); regex and choice hold too."""
    with drafting_plan(tiny):  # auto drafts (the forced keys among them) whatever this machine's speed
        structured_output_in_every_mode(tiny)


def structured_output_in_every_mode(tiny) -> None:
    import json

    import jsonschema

    params = SamplingParams(max_new_tokens=48, structured={"type": "json_schema", "schema": SCHEMA})
    dense = tiny.generate(CODE, mode="dense", sampling_params=params)
    for r in dense:
        jsonschema.validate(json.loads(r.text), SCHEMA)
        assert r.finish_reason == "stop"
    for mode, spec in (("spec", {"proposer": "draft", "depth": 4, "lookup": "off", "step_budget": None}),
                       ("spec", {"proposer": "draft", "depth": 3, "width": 2, "nodes": 5, "step_budget": None}),
                       ("auto", None)):
        got = tiny.generate(CODE, mode=mode, spec=spec, sampling_params=params)
        assert [r.token_ids for r in got] == [r.token_ids for r in dense], (mode, spec)
    assert sum(r.stats["forced_drafted"] for r in got) > 0  # auto verified the schema's forced keys as drafts
    for mode in ("spec", "auto"):
        sampled = tiny.generate(CODE, mode=mode, sampling_params=SamplingParams(
            max_new_tokens=48, temperature=1.0, seed=3, structured={"type": "json_schema", "schema": SCHEMA}))
        for r in sampled:
            jsonschema.validate(json.loads(r.text), SCHEMA)
    assert sum(r.stats["forced_drafted"] for r in sampled) > 0  # sampling too drafts the forced keys
    anything = tiny.generate(CODE[:1], mode="dense", sampling_params=SamplingParams(
        max_new_tokens=48, structured={"type": "json_object"}))[0]
    assert anything.text.startswith("{")  # any object: it may not close within max_tokens
    digits = tiny.generate(CODE[:2], mode="auto", sampling_params=SamplingParams(
        max_new_tokens=8, structured={"type": "regex", "pattern": "[0-9]{3}-[a-z]{2}"}))
    assert all(len(r.text) == 6 and r.text[:3].isdigit() and r.text[3] == "-" for r in digits)
    pick = tiny.generate(CODE[:2], mode="dense", sampling_params=SamplingParams(
        max_new_tokens=8, structured={"type": "choice", "choices": ["yes", "no"]}))
    assert all(r.text in ("yes", "no") for r in pick)
    with pytest.raises(ValueError, match="structured output"):
        SamplingParams(structured={"type": "xml"})
    with pytest.raises(ValueError, match="compile"):
        tiny.generate(CODE[:1], sampling_params=SamplingParams(structured={"type": "regex", "pattern": "(("}))


def test_each_row_draws_from_its_own_distribution():
    """choose over rows of other settings in one batch (greedy, temperature, top-k, top-p, min-p): over many keys a
    sampled row's draws follow a plain reference of its distribution (chi-square), a greedy row takes the argmax,
    and a row's draw depends on its key and index alone, not on the rows beside it."""
    from specee_core.step.sampling import RowSampling, choose, row_key
    from tests.test_spec_decode import chi_square

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(12, generator=g)
    settings = [SamplingParams(), SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, top_k=4),
                SamplingParams(temperature=1.0, top_p=0.7), SamplingParams(temperature=0.9, min_p=0.2)]

    def reference(p: SamplingParams) -> torch.Tensor:
        x = logits / p.temperature
        order = x.argsort(descending=True).tolist()
        keep = set(order[: p.top_k] if p.top_k else order)
        probs, acc = x.softmax(-1), 0.0
        for t in order:  # the smallest set of most likely tokens whose mass reaches top_p
            if acc >= p.top_p:
                keep.discard(t)
            acc += float(probs[t])
        keep = {t for t in keep if probs[t] >= p.min_p * probs.max()}
        y = torch.tensor([float(x[t]) if t in keep else float("-inf") for t in range(12)])
        return y.softmax(-1)

    n = 4000
    rows = RowSampling.of(settings * n, [row_key(s) for s in range(len(settings) * n)])
    drawn = choose(logits.expand(len(settings) * n, 12), rows, [7] * (len(settings) * n)).view(n, len(settings))
    assert (drawn[:, 0] == logits.argmax()).all()
    for c, p in enumerate(settings[1:], start=1):
        counts = torch.bincount(drawn[:, c], minlength=12).float()
        want = reference(p)
        assert chi_square(counts, want) < 32.9, p  # 11 degrees of freedom at most, p = 0.0005
        with pytest.raises(AssertionError):  # another row's distribution is told apart
            assert chi_square(counts, reference(settings[1 + c % 4])) < 32.9
    alone = choose(logits[None], RowSampling.of([settings[2]], [row_key(5)]), [7])
    beside = choose(torch.stack([logits.flip(0), logits]), RowSampling.of([settings[0], settings[2]], [1, row_key(5)]),
                    [3, 7])
    assert alone.item() == beside[1].item()
    assert len({choose(logits[None], RowSampling.of([settings[1]], [row_key(5)]), [i]).item() for i in range(40)}) > 3


def test_a_draw_past_the_head_follows_the_tail():
    """A flat distribution over 150 tokens, most of whose mass lies past the HEAD most likely tokens: draws
    follow it (chi-square, 149 degrees of freedom), head and tail alike."""
    from specee_core.step.sampling import HEAD, RowSampling, choose, row_key
    from tests.test_spec_decode import chi_square

    logits = torch.randn(150, generator=torch.Generator().manual_seed(1)) * 0.3
    n = 15000
    drawn = choose(logits.expand(n, 150), RowSampling.of([SamplingParams(temperature=1.0)] * n,
                                                          [row_key(s) for s in range(n)]), [3] * n)
    counts = torch.bincount(drawn, minlength=150).float()
    probs = logits.softmax(-1)
    head = probs.topk(HEAD).indices
    assert 1 - probs[head].sum() > 0.4  # much of it lies past the head
    assert chi_square(counts, probs) < 215.0  # p ~ 0.0005
    with pytest.raises(AssertionError):
        assert chi_square(counts, (logits * 1.5).softmax(-1)) < 215.0


def test_top_p_keeps_the_tokens_a_sort_of_the_whole_vocabulary_keeps():
    """top-p decided among the most likely NUCLEUS_FIRST tokens where they reach top_p, by a full sort where they
    do not (flat rows): the same kept tokens as sorting every row."""
    from specee_core.step.sampling import NUCLEUS_FIRST, _nucleus

    g = torch.Generator().manual_seed(0)
    logits = torch.cat([torch.randn(4, 2000, generator=g) * 4, torch.randn(4, 2000, generator=g) * 0.1])
    top_p = torch.tensor([0.1, 0.5, 0.9, 0.99] * 2)
    got = _nucleus(logits, top_p)
    sl, order = logits.sort(dim=-1, descending=True)
    p = sl.softmax(-1)
    want = logits.scatter(-1, order, sl.masked_fill(p.cumsum(-1) - p > top_p[:, None], float("-inf")))
    assert torch.equal(got.isinf(), want.isinf())
    kept = (~got.isinf()).sum(-1)
    assert kept[:4].max() < NUCLEUS_FIRST < kept[5:].min()  # both paths ran
