"""The engine as a Ray Data processor (pipeline.processor) on the real model, on a local loopback Ray:
bad rows among good ones, row-for-row equality with the engine called directly, user pre/post
processing, chat messages, Parquet out, Ray Data LLM's documented example run as it is, and rows that each
set their own sampling. (Lost actors, crashing and hanging rows: the batch job's tests, which run through
this processor.)"""
from __future__ import annotations

import json

import jsonschema
import pandas as pd
import pytest
import ray

from pipeline import ProcessorConfig, build_processor
from specee_core import SpecEEEngine
from tests.conftest import REPO

SMOLLM2 = REPO / "models" / "smollm2-135m-instruct"
QUESTIONS = ["Write a Python function that reverses a string.", "What does os.path.join do?",
             "Name three built-in types.", "How do I open a file for reading?", "Explain list comprehensions.",
             "What is a tuple?"]
SETTINGS = dict(mode="dense", dtype="float32", weights="q4", max_new_tokens=8, batch_size=4)


pytestmark = pytest.mark.usefixtures("ray_cluster")  # tests/conftest.py


@pytest.fixture(scope="module")
def engine():
    return SpecEEEngine.from_pretrained(SMOLLM2, dtype="float32", weights="q4", max_batch_size=4)


def test_a_users_dataset_through_the_processor(tmp_path, engine):
    """A user's rows (their own column names, mapped by preprocess) with bad rows among good ones: one
    output row per input row, completions equal to the engine's own, errors where the rows were bad,
    the user's columns and postprocess carried through, Parquet that pandas reads."""
    rows = [{"qid": f"q{i}", "question": q, "topic": "python"} for i, q in enumerate(QUESTIONS)]
    rows += [{"qid": "empty", "question": "", "topic": "bad"}, {"qid": "none", "question": None, "topic": "bad"},
             {"qid": "long", "question": "word " * 9000, "topic": "bad"}]
    processor = build_processor(ProcessorConfig(model_source=str(SMOLLM2), concurrency=1, **SETTINGS),
                                preprocess=lambda r: {"id": r["qid"], "prompt": r["question"], "topic": r["topic"]},
                                postprocess=lambda r: {**r, "chars": len(r["generated_text"] or "")})
    out = processor(ray.data.from_items(rows))
    out.write_parquet(str(tmp_path / "out"))
    df = pd.read_parquet(tmp_path / "out").set_index("id")
    assert sorted(df.index) == sorted(r["qid"] for r in rows)
    chat = [engine.chat_prompt([{"role": "user", "content": q}]) for q in QUESTIONS]
    expect = engine.generate(chat, max_new_tokens=8, mode="dense")
    for i, r in enumerate(expect):
        row = df.loc[f"q{i}"]
        assert pd.isna(row["error"]) and row["generated_text"] == r.text and row["prompt"] == QUESTIONS[i]
        assert row["num_generated_tokens"] == len(r.token_ids) and row["chars"] == len(r.text)
        assert row["completion"] == r.text and row["completion_tokens"] == len(r.token_ids)  # deprecated aliases
        assert row["topic"] == "python" and row["mode"] == "dense"
    assert df.loc["empty", "error"] == "PromptError: prompt is empty"
    assert df.loc["none", "error"].startswith("InputError: prompt must be a string")
    assert df.loc["long", "error"].startswith("PromptError:") and "context" in df.loc["long", "error"]
    assert (df.loc[["empty", "none", "long"], "topic"] == "bad").all()


def test_ray_data_llms_documented_example_runs_after_changing_its_import():
    """Ray Data LLM's basic example (ray-project/ray doc/source/data/doc_code/working-with-llms/
    basic_llm_example.py, shown on docs.ray.io's "Working with LLMs") as it is written there, with only its
    import changed and model_source pointing at SmolLM2, over its one row."""
    from pipeline import ProcessorConfig as vLLMEngineProcessorConfig, build_processor as build_llm_processor

    # Basic vLLM configuration
    config = vLLMEngineProcessorConfig(
        model_source=str(SMOLLM2),
        engine_kwargs={
            "enable_chunked_prefill": True,
            "max_num_batched_tokens": 4096,  # Reduce if CUDA OOM occurs
            "max_model_len": 16384,
        },
        concurrency=1,
        batch_size=64,
    )

    processor = build_llm_processor(
        config,
        preprocess=lambda row: dict(
            messages=[
                {"role": "system", "content": "You are a bot that responds with haikus."},
                {"role": "user", "content": row["item"]},
            ],
            sampling_params=dict(
                temperature=0.3,
                max_tokens=250,
            ),
        ),
        postprocess=lambda row: dict(
            answer=row["generated_text"],
            **row,  # This will return all the original columns in the dataset.
        ),
    )

    items = ["Start of the haiku is: Complete this for me..."]
    ds = ray.data.from_items(items)
    ds = processor(ds)
    rows = ds.take_all()

    assert len(rows) == 1 and all(r["error"] is None for r in rows)
    assert [r["messages"][1]["content"] for r in rows] == items  # columns carried to postprocess
    for r in rows:
        assert r["answer"] == r["generated_text"] and r["generated_text"].strip()
        assert 0 < r["num_generated_tokens"] <= 250 and r["num_input_tokens"] > 0
        assert r["sampling_params"] == {"temperature": 0.3, "max_tokens": 250}
        assert "You are a bot that responds with haikus." in r["prompt"]  # the text the engine ran, as in Ray
        assert r["mode"] == "auto" and r["id"]  # no id given: one made up


JSON_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 30}},
               "required": ["answer"], "additionalProperties": False}
# Rows that set their own sampling, Ray Data LLM's way (sampling_params) and in columns of their own; the rest
# take the config's (SETTINGS: 8 tokens, greedy). One row asks for a bad value, one for what the engine lacks.
OWN_SAMPLING = [
    {"id": "max3", "messages": [{"role": "user", "content": QUESTIONS[0]}],
     "sampling_params": {"max_tokens": 3, "temperature": 0.0}},
    {"id": "stop", "prompt": QUESTIONS[1], "max_tokens": 12, "stop": [" "]},
    {"id": "no-eos", "prompt": QUESTIONS[2], "max_tokens": 5, "ignore_eos": True},
    {"id": "hot", "prompt": QUESTIONS[3],
     "sampling_params": {"max_tokens": 6, "temperature": 0.9, "top_p": 0.9, "top_k": 40, "seed": 7}},
    {"id": "default", "prompt": QUESTIONS[4]},
    {"id": "n1", "prompt": QUESTIONS[5], "sampling_params": {"n": 1, "max_tokens": 4}},  # n=1: what it does anyway
    {"id": "chat", "messages": [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "What is a tuple?"}]},
    {"id": "bad", "prompt": QUESTIONS[0], "temperature": -1.0},
    {"id": "logprobs", "prompt": QUESTIONS[1], "sampling_params": {"max_tokens": 6, "logprobs": 2}},
    {"id": "json", "prompt": QUESTIONS[2], "max_tokens": 40, "response_format": {
        "type": "json_schema", "json_schema": {"name": "a", "schema": JSON_SCHEMA}}},
    {"id": "not-yet", "prompt": QUESTIONS[3], "sampling_params": {"best_of": 2}},
    {"id": "n2", "prompt": QUESTIONS[5], "n": 2, "max_tokens": 4},  # greedy: both choices are the greedy text
    {"id": "bad-chat", "messages": [{"role": "user", "content": None}]},
]
# what each greedy row must equal: the engine called directly with the same parameters
GREEDY = {"max3": dict(max_new_tokens=3), "stop": dict(max_new_tokens=12, stop=[" "]),
          "no-eos": dict(max_new_tokens=5, ignore_eos=True), "default": dict(max_new_tokens=8),
          "n1": dict(max_new_tokens=4), "chat": dict(max_new_tokens=8)}


def test_rows_with_their_own_sampling(engine):
    """Each row runs with its own max_tokens, temperature, stop, ignore_eos, logprobs and response_format (one
    engine call per batch, rows of equal parameters sharing a lane), in mode auto: greedy rows, chat messages
    among them, equal the engine called directly in dense with the same parameters (auto is lossless), the
    sampled row stays within its own max_tokens, a bad value, a parameter the engine lacks and bad chat
    messages each cost their own row. concurrency is Ray Data's autoscaling pool. (The same in dense, on the
    batch job's rows: tests/pipeline/test_batch_pipeline.py::test_rows_with_their_own_sampling_in_the_job.)"""
    mode = "auto"
    cfg = ProcessorConfig(model_source=str(SMOLLM2), **{**SETTINGS, "mode": mode}, concurrency=(1, 2))
    # rows, not to_pandas(): Ray Data's to_pandas cannot join a block where a list column (messages) is set
    # and a later one where it is null throughout (ray.data.from_items(OWN_SAMPLING).to_pandas() fails alike)
    df = pd.DataFrame(build_processor(cfg)(ray.data.from_items(OWN_SAMPLING)).take_all()).set_index("id")
    assert sorted(df.index) == sorted(r["id"] for r in OWN_SAMPLING) and (df["mode"] == mode).all()
    chats = {r["id"]: r.get("messages") or [{"role": "user", "content": r["prompt"]}] for r in OWN_SAMPLING}
    for rid, params in GREEDY.items():
        ref = engine.generate([engine.chat_prompt(chats[rid])], mode="dense", **params)[0]
        row = df.loc[rid]
        assert pd.isna(row["error"]) and row["generated_text"] == ref.text, (rid, row["generated_text"], ref.text)
        assert row["num_generated_tokens"] == len(ref.token_ids) <= params["max_new_tokens"]
    assert df.loc["no-eos", "num_generated_tokens"] == 5 and df.loc["no-eos", "finish_reason"] == "length"
    assert df.loc["stop", "finish_reason"] == "stop" and " " not in df.loc["stop", "generated_text"]
    assert df.loc["chat", "prompt"] == engine.chat_prompt(chats["chat"])  # messages: the text the engine ran
    assert pd.isna(df.loc["hot", "error"]) and 1 <= df.loc["hot", "num_generated_tokens"] <= 6
    assert df.loc["bad", "error"].startswith("InputError: sampling parameters temperature=-1.0")
    assert df.loc["not-yet", "error"] == "InputError: sampling parameter best_of=2 is not supported yet (only 1)"
    two = df.loc["n2", "choices"]
    assert [c["index"] for c in two] == [0, 1] and df.loc["n1", "choices"] is None
    assert [c["completion"] for c in two] == [df.loc["n1", "generated_text"]] * 2  # the same prompt and max_tokens
    assert df.loc["n2", "generated_text"] == two[0]["completion"]
    assert "chat messages must be" in df.loc["bad-chat", "error"]
    assert df.loc[["bad", "not-yet", "bad-chat"], "generated_text"].isna().all()
    lps = df.loc["logprobs", "logprobs"]  # asked: one entry per generated token; the others: none
    assert len(lps) == df.loc["logprobs", "num_generated_tokens"] and all(len(e["top_logprobs"]) == 2 for e in lps)
    assert df.loc["default", "logprobs"] is None
    jsonschema.validate(json.loads(df.loc["json", "generated_text"]), JSON_SCHEMA)


def test_bad_settings_fail_before_any_row():
    with pytest.raises(ValueError, match="mode must be one of"):
        ProcessorConfig(model_source=str(SMOLLM2), mode="fast")
    with pytest.raises(ValueError, match="concurrency must be >= 1"):
        ProcessorConfig(model_source=str(SMOLLM2), concurrency=0)


def test_ray_data_llm_names_and_the_old_ones():
    """Ray Data LLM's settings: vLLM's engine_kwargs read as the engine's (or refused, by name), concurrency
    as (min, max), accelerator_type onto CUDA; the old names still work, each with a DeprecationWarning."""
    cfg = ProcessorConfig(model_source=str(SMOLLM2), concurrency=(1, 3), accelerator_type="L4",
                          engine_kwargs={"max_model_len": 2048, "max_num_batched_tokens": 256, "dtype": "half",
                                         "enable_prefix_caching": False, "enable_chunked_prefill": True,
                                         "tensor_parallel_size": 1, "threshold": 0.8})
    stage = cfg.stage()
    assert stage.core_options == {"context_len": 2048, "prefill_chunk": 256}
    assert stage.engine_options == {"threshold": 0.8}
    assert (stage.dtype, stage.prefix_cache, stage.device, stage.engines_per_node) == ("float16", False, "cuda", 3)
    assert cfg.resources() == {"num_cpus": 1, "num_gpus": 1, "accelerator_type": "L4"}
    assert (cfg.compute().min_size, cfg.compute().max_size) == (1, 3)
    for kwargs, match in [({"gpu_memory_utilization": 0.9}, "'gpu_memory_utilization' has no equivalent"),
                          ({"tensor_parallel_size": 2}, "tensor_parallel_size=2: the engine runs only 1")]:
        with pytest.raises(ValueError, match=match):
            ProcessorConfig(model_source=str(SMOLLM2), engine_kwargs=kwargs)
    with pytest.raises(ValueError, match="concurrency must be >= 1"):
        ProcessorConfig(model_source=str(SMOLLM2), concurrency=(2, 1))
    with pytest.deprecated_call(match="use model_source="), pytest.deprecated_call(match="use engine_kwargs="), \
            pytest.deprecated_call(match="use apply_chat_template="):
        old = ProcessorConfig(model=str(SMOLLM2), mode="specee", engine_options={"threshold": 0.5}, chat=False)
    assert (old.model_source, old.engine_kwargs, old.apply_chat_template) == (str(SMOLLM2), {"threshold": 0.5}, False)
    assert old.stage().engine_options == {"threshold": 0.5} and old.model is None
