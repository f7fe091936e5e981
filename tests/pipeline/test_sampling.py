"""Per-row sampling without a Ray cluster: vLLM's names to SamplingParams (pipeline.sampling), the reader
that carries them from files, the prepare stage that checks them, and the engine stage that runs a batch of
rows with different parameters in one engine call."""
from __future__ import annotations

import json

import pandas as pd
import pyarrow as pa
import pytest

from pipeline.prompts import to_prompt_table
from pipeline.sampling import row_fields, to_sampling
from specee_core import SamplingParams
from tests.conftest import REPO

DEFAULTS = SamplingParams(max_new_tokens=8, temperature=0.0, stop=["\n\n"])


def sampling(row: dict) -> SamplingParams:
    return to_sampling(row_fields(row), DEFAULTS)


def test_vllm_names_map_to_the_engines():
    p = sampling({"sampling_params": {"max_tokens": 5, "temperature": 0.7, "top_p": 0.9, "top_k": -1, "seed": 3},
                  "stop": ["END"], "ignore_eos": True})
    assert p == SamplingParams(max_new_tokens=5, temperature=0.7, top_p=0.9, top_k=0, seed=3, stop=["END"],
                               ignore_eos=True)
    assert sampling({"max_tokens": 4.0, "temperature": None}) == SamplingParams(max_new_tokens=4, stop=["\n\n"])
    assert sampling({"sampling_params": '{"max_tokens": 2, "n": 1, "presence_penalty": 0}'}).max_new_tokens == 2
    assert row_fields({"prompt": "x", "id": "a"}) == {}  # nothing of its own: the defaults
    full = sampling({"sampling_params": json.dumps({
        "presence_penalty": 0.5, "frequency_penalty": 1.0, "repetition_penalty": 1.2, "min_tokens": 2,
        "stop_token_ids": [7], "logit_bias": {"12": -5}, "logprobs": 3,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}})})
    assert (full.presence_penalty, full.frequency_penalty, full.repetition_penalty, full.min_tokens) == (0.5, 1.0, 1.2, 2)
    assert full.stop_token_ids == [7] and full.logit_bias == {12: -5.0} and full.logprobs == 3
    assert full.structured == {"type": "json_schema", "schema": {"type": "object"}}
    assert sampling({"structured_outputs": {"choice": ["yes", "no"]}}).structured == {"type": "choice",
                                                                                     "choices": ["yes", "no"]}
    assert sampling({"guided_decoding": {"json": '{"type": "object"}'}}).structured["schema"] == {"type": "object"}
    assert sampling({"response_format": {"type": "text"}}).structured is None


@pytest.mark.parametrize("row, message", [
    ({"max_tokens": "x"}, "max_tokens='x': expected a number"),
    ({"max_tokens": 2.5}, "max_tokens=2.5: expected an integer"),
    ({"temperature": -1}, "temperature=-1: temperature must be a number >= 0"),
    ({"sampling_params": {"top_p": 1.5}}, "top_p must be in"),
    ({"temperature": float("inf")}, "expected a finite number"),
    ({"stop": [1]}, r"stop=\[1\]: expected a string or a list of strings"),
    ({"ignore_eos": "yes"}, "ignore_eos='yes': expected true or false"),
    ({"sampling_params": {"best_of": 2}}, r"best_of=2 is not supported yet \(only 1\)"),
    ({"n": 0}, r"n=0: expected an integer in 1..16"),
    ({"sampling_params": {"n": 17}}, r"n=17: expected an integer in 1..16"),
    ({"n": 2.5}, r"n=2.5: expected an integer"),
    ({"response_format": {"type": "xml"}}, "response_format type must be"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "takes one of"),
    ({"logit_bias": {"x": 1}}, r"expected an object of token id \(0..2147483647\) -> number"),
    ({"stop_token_ids": [1.5]}, "expected a list of token ids"),
    # what passes str.isdigit but not int(), and numbers past float or int64: refused, never an OverflowError
    ({"logit_bias": {"²": 1}}, r"logit_bias=\{'²': 1\}: expected an object of token id"),
    ({"logit_bias": {"1" * 4400: 1}}, "expected an object of token id"),
    ({"logit_bias": {"12": 10 ** 400}}, "expected an object of token id"),
    ({"temperature": 10 ** 400}, "expected a number within 64 bits"),
    ({"seed": 2 ** 70}, "expected a number within 64 bits"),
    ({"max_tokens": 1e300}, "expected a number within 64 bits"),
    ({"stop_token_ids": [10 ** 40]}, "expected a list of token ids"),
    ({"structured_outputs": {"choice": 5}}, "choice takes a list of strings, got int"),
    ({"structured_outputs": {"json": "[" * 100_000}}, "structured_outputs json is not a JSON object"),
    ({"frequency_penalty": 3}, "frequency_penalty must be"),
    ({"response_format": {"type": "json_object"}, "guided_decoding": {"regex": "a"}}, "one structured-output"),
    ({"sampling_params": {"max_new_tokens": 3}}, "'max_new_tokens' is not supported"),
    ({"sampling_params": "{oops"}, "sampling_params is not a JSON object"),
    ({"sampling_params": [1]}, "sampling_params must be a dict"),
    ({"max_tokens": 3, "sampling_params": {"max_tokens": 4}}, "max_tokens is set twice"),
])
def test_bad_or_unsupported_values_name_the_parameter(row, message):
    with pytest.raises(ValueError, match=message):
        sampling(row)


def test_the_reader_carries_a_rows_sampling_as_text():
    """Values of any type fit the reader's one schema (JSON text); a row set twice differently fails there."""
    t = to_prompt_table([{"prompt": "a", "max_tokens": 3}, {"prompt": "b", "sampling_params": {"max_tokens": "x"}},
                         {"prompt": "c"}, {"prompt": "d", "temperature": 0.5, "sampling_params": {"temperature": 1}}],
                        "f.jsonl", 0)
    assert [json.loads(s) if s else None for s in t["sampling_params"].to_pylist()] == \
        [{"max_tokens": 3}, {"max_tokens": "x"}, None, None]
    assert t["input_error"].to_pylist()[:3] == [None, None, None] and "set twice" in t["input_error"][3].as_py()


def test_prepare_rows_checks_each_rows_sampling_and_messages():
    """The processor's prepare stage in-process: messages (Ray Data LLM's column) and a list in prompt both
    render through the chat template, a row without an id gets one, each row's sampling is resolved once
    (or its reason kept), rows that set nothing carry no parameters (the engine's defaults), and a column
    of mixed types (5 and "x", as Ray Data holds them within a block) is carried on as Python objects."""
    from pipeline.processor import PrepareRows

    prep = PrepareRows(str(REPO / "models" / "smollm2-135m-instruct"), chat=None, defaults=DEFAULTS)
    msgs = [{"role": "user", "content": "Hi"}]
    batch = pd.DataFrame({"id": ["a", None, "c", "d", "e"],
                          "prompt": [None, "plain", None, msgs, "x"],
                          "messages": [msgs, None, [{"role": "user", "content": 5}], None, None],
                          "sampling_params": [{"max_tokens": 2}, None, None, None, '{"best_of": 2}'],
                          "max_tokens": [None, "x", None, 3, None], "topic": ["t"] * 5})
    out = prep(batch).to_pylist()
    a, b, c, d, e = out
    assert a["prompt"] == a["text"] and a["text"] == d["text"] and a["input_error"] is None
    assert json.loads(a["_sampling"]) == {"max_tokens": 2} and json.loads(d["_sampling"]) == {"max_tokens": 3}
    assert b["input_error"] == "sampling parameter max_tokens='x': expected a number" and b["id"]
    assert [r["max_tokens"] for r in out] == [None, "x", None, 3, None]
    assert c["input_error"] == "chat messages must be {'role': str, 'content': str} objects"
    assert e["input_error"] == "sampling parameter best_of=2 is not supported yet (only 1)"
    assert [r["topic"] for r in out] == ["t"] * 5 and a["sampling_params"] == {"max_tokens": 2}
    with pytest.raises(ValueError, match="needs a 'messages' or a 'prompt' column"):
        prep(pd.DataFrame({"question": ["q"]}))


def test_one_engine_call_per_batch_with_each_rows_parameters(monkeypatch, tmp_path):
    """GenerateRows with the prepare stage's per-row parameters: one generate call for the batch, one
    SamplingParams per runnable row (the config's where a row set none)."""
    from pipeline.stage import GenerateRows, StageConfig
    from tests.pipeline.test_batch_units import FakeEngine

    engine = FakeEngine()
    monkeypatch.setattr("pipeline.stage.SpecEEEngine.from_pretrained", lambda *a, **kw: engine)
    stage = GenerateRows(StageConfig(model=str(tmp_path), mode="dense", max_new_tokens=6), "run-1")
    own = json.dumps({"max_tokens": 3, "temperature": 0.5})  # what the prepare stage writes
    three = json.dumps({"n": 3, "temperature": 0.5, "seed": 5})
    batch = pa.table({"id": ["a", "b", "c", "d"], "prompt": ["x", "y", "z", "w"],
                      "input_error": [None, "bad", None, None], "_sampling": [own, None, None, three]})
    rows = {r["id"]: r for r in stage(batch).to_pylist()}
    assert rows["b"]["error"] == "InputError: bad" and rows["a"]["completion"] == "X"
    [(prompts, kw)] = engine.calls
    assert prompts == ["x", "z", "w", "w", "w"] and kw["mode"] == "dense"  # n = 3: the prompt three times
    assert [(p.max_new_tokens, p.temperature, p.seed) for p in kw["sampling_params"]] == \
        [(3, 0.5, None), (6, 0.0, None), (6, 0.5, 5), (6, 0.5, 6), (6, 0.5, 7)]  # choice k: seed + k
    assert rows["a"]["choices"] is None
    assert [(c["index"], c["completion"]) for c in rows["d"]["choices"]] == [(0, "W"), (1, "W"), (2, "W")]
    assert rows["d"]["completion"] == "W"
