"""The engine as a Ray Data processor (pipeline.processor) on the real model, on a local loopback Ray:
bad rows among good ones, row-for-row equality with the engine called directly, user pre/post
processing, chat messages, Parquet out, and an engine actor lost mid-batch."""
from __future__ import annotations

import pandas as pd
import pytest
import ray

from pipeline import ProcessorConfig, build_processor
from pipeline.stage import CRASH_ONCE_ENV
from specee_core import SpecEEEngine
from tests.conftest import REPO

SMOLLM2 = REPO / "models" / "smollm2-135m-instruct"
QUESTIONS = ["Write a Python function that reverses a string.", "What does os.path.join do?",
             "Name three built-in types.", "How do I open a file for reading?", "Explain list comprehensions.",
             "What is a tuple?"]
SETTINGS = dict(mode="dense", dtype="float32", weights="q4", max_new_tokens=8, batch_size=4)


pytestmark = pytest.mark.usefixtures("ray_cluster")  # tests/pipeline/conftest.py


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
    processor = build_processor(ProcessorConfig(model=str(SMOLLM2), concurrency=1, **SETTINGS),
                                preprocess=lambda r: {"id": r["qid"], "prompt": r["question"], "topic": r["topic"]},
                                postprocess=lambda r: {**r, "chars": len(r["completion"] or "")})
    out = processor(ray.data.from_items(rows))
    out.write_parquet(str(tmp_path / "out"))
    df = pd.read_parquet(tmp_path / "out").set_index("id")
    assert sorted(df.index) == sorted(r["qid"] for r in rows)
    chat = [engine.chat_prompt([{"role": "user", "content": q}]) for q in QUESTIONS]
    expect = engine.generate(chat, max_new_tokens=8, mode="dense")
    for i, r in enumerate(expect):
        row = df.loc[f"q{i}"]
        assert pd.isna(row["error"]) and row["completion"] == r.text and row["prompt"] == QUESTIONS[i]
        assert row["completion_tokens"] == len(r.token_ids) and row["chars"] == len(r.text)
        assert row["topic"] == "python" and row["mode"] == "dense"
    assert df.loc["empty", "error"] == "PromptError: prompt is empty"
    assert df.loc["none", "error"].startswith("InputError: prompt must be a string")
    assert df.loc["long", "error"].startswith("PromptError:") and "context" in df.loc["long", "error"]
    assert (df.loc[["empty", "none", "long"], "topic"] == "bad").all()


def test_chat_messages(engine):
    msgs = [{"id": "ok", "prompt": [{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "What is a tuple?"}]},
            {"id": "bad", "prompt": [{"role": "user", "content": None}]}]
    out = build_processor(ProcessorConfig(model=str(SMOLLM2), **SETTINGS))(ray.data.from_items(msgs))
    df = out.to_pandas().set_index("id")
    ref = engine.generate([engine.chat_prompt(msgs[0]["prompt"])], max_new_tokens=8, mode="dense")[0]
    assert df.loc["ok", "completion"] == ref.text and pd.isna(df.loc["ok", "error"])
    assert "chat messages must be" in df.loc["bad", "error"]


def test_an_engine_actor_lost_mid_batch(tmp_path):
    """Ray Data's fault tolerance as the processor sets it: the actor that dies after generating its
    first batch (before returning it) is restarted, the batch runs again, and every row comes out
    exactly once."""
    marker = tmp_path / "crashed"
    rows = [{"id": f"r{i:02d}", "prompt": QUESTIONS[i % len(QUESTIONS)]} for i in range(12)]
    cfg = ProcessorConfig(model=str(SMOLLM2), concurrency=1, runtime_env={"env_vars": {CRASH_ONCE_ENV: str(marker)}},
                          **SETTINGS)
    df = build_processor(cfg)(ray.data.from_items(rows)).to_pandas()
    assert marker.exists()  # an actor did die
    assert sorted(df["id"]) == [r["id"] for r in rows] and df["error"].isna().all()
    assert df["worker"].nunique() >= 1


def test_bad_settings_fail_before_any_row():
    with pytest.raises(ValueError, match="mode must be one of"):
        ProcessorConfig(model=str(SMOLLM2), mode="fast")
    with pytest.raises(ValueError, match="concurrency must be >= 1"):
        ProcessorConfig(model=str(SMOLLM2), concurrency=0)
