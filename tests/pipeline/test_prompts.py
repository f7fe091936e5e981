"""Hostile input files: each format's reader row by row (pipeline.prompt_records), the checks that make a row
an error row (pipeline.prompts), and the batch job on a real Ray over a JSONL file and a CSV file holding such
rows beside good ones: every good row written once, every bad row an error row, and a rerun that does not stop.
(A truncated Parquet file beside a good one: tests/pipeline/test_batch_pipeline.py's Parquet job.)"""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.prompt_records import BadRow, csv_records, jsonl_records, parquet_records
from pipeline.prompts import ERROR_PROMPT_CHARS, PROMPT_SCHEMA, request_hash, to_prompt_table


def jsonl_rows(data: bytes, max_line_bytes: int = 1 << 16, **kw) -> list[dict]:
    records = [r for block in jsonl_records(pa.BufferReader(data), max_line_bytes) for r in block]
    return to_prompt_table(records, "f.jsonl", 0, **kw).to_pylist()


def csv_rows(data: bytes) -> list[dict]:
    def check(names):
        assert "prompt" in names

    records = [r for block in csv_records(pa.BufferReader(data), 1 << 16, check, ("id", "prompt"), ("max_tokens",))
               for r in block]
    return to_prompt_table(records, "f.csv", 0).to_pylist()


def test_each_bad_jsonl_line_is_its_own_input_error():
    """A lone surrogate, invalid UTF-8 (the line's id kept), a line past the limit (never parsed), nesting past the
    recursion limit, an integer past Python's digit limit, a non-object: each row an error naming its fault, the
    rows around them read, and every text the table holds valid Unicode."""
    lines = [json.dumps({"id": "a", "prompt": "good"}).encode(),
             json.dumps({"id": "surrogate", "prompt": "cut \ud83d"}).encode(),  # json writes it as "\\ud83d"
             b'{"id": "latin1", "prompt": "caf\xe9"}',
             b'{"prompt": "' + b"x" * 70_000 + b'"}',
             b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",
             b'{"prompt": 1' + b"0" * 4400 + b"}",
             b"[1, 2]",
             b"",  # blank: not a row
             json.dumps({"id": "\udc00", "prompt": "an id that is no text"}).encode(),
             json.dumps({"id": "z", "prompt": "last", "max_tokens": 2}).encode()]
    rows = jsonl_rows(b"\n".join(lines) + b"\n")
    assert [r["id"] for r in rows] == ["a", "surrogate", "latin1", "f.jsonl:3", "f.jsonl:4", "f.jsonl:5",
                                       "f.jsonl:6", "f.jsonl:7", "z"]
    errors = [r["input_error"] for r in rows]
    assert errors[0] is None and errors[-1] is None and rows[-1]["sampling_params"] == '{"max_tokens": 2}'
    assert errors[1] == "the prompt is not valid Unicode: a lone surrogate U+D83D at character 4"
    assert errors[2] == "the row is not valid UTF-8 (byte 0xe9 at byte 31 of its line)"
    assert errors[3] == "a line of 70,015 bytes, more than the 65,536 a row may take"
    assert errors[4].startswith("invalid JSON (maximum recursion depth exceeded")
    assert errors[5].startswith("invalid JSON (Exceeds the limit (4300 digits)")
    assert errors[6] == "expected a JSON object per line, got list"
    assert errors[7] == "the id is not valid Unicode: a lone surrogate U+DC00 at character 0"
    assert [r["prompt"] for r in rows[1:4]] == ["cut \\ud83d", "caf\\udce9", None]  # stored as their escapes
    pa.Table.from_pylist(rows, schema=PROMPT_SCHEMA)  # every text is valid UTF-8
    assert jsonl_rows(b"\n".join(lines)) == rows  # the same ids and hashes on every read: resume holds


def test_each_bad_csv_row_is_its_own_input_error_and_parsing_goes_on():
    """An unclosed quote is an error row for its line, and the lines it swallowed are read again as rows; a row of
    the wrong width and one with invalid UTF-8 are error rows (the latter under its own id); sampling cells are
    read as numbers."""
    data = (b'id,prompt,max_tokens\nc0,import os,2\nc1,"unclosed,3\nc2,return sorted(,\nc3,x,y,z\n'
            b'c4,"for i in range(10):",2.0\nc5,caf\xe9,\n')
    rows = csv_rows(data)
    assert [r["id"] for r in rows] == ["c0", "f.csv:1", "c2", "f.csv:3", "c4", "c5"]
    errors = {r["id"]: r["input_error"] for r in rows}
    assert errors["f.csv:1"] == "a malformed CSV row (',' expected after '\"')"
    assert errors["f.csv:3"] == "a CSV row of 4 fields under a header of 3"
    assert errors["c5"] == "the row is not valid UTF-8 (byte 0xe9 at byte 6 of its line)"
    assert [errors[i] for i in ("c0", "c2", "c4")] == [None] * 3
    assert [r["sampling_params"] for r in rows if r["id"] in ("c0", "c2", "c4")] == \
        ['{"max_tokens": 2}', None, '{"max_tokens": 2.0}']
    assert csv_rows(b"") == [] and csv_rows(b'id,prompt\n"c0","unclosed at the end\n') == [
        {"id": "f.csv:0", "prompt": None, "input_error": "a malformed CSV row (unexpected end of data)",
         "sampling_params": None, "request_hash": request_hash(None, None), "file_error": None}]


def test_parquet_text_that_is_not_utf8_costs_its_row_and_damage_raises(tmp_path):
    """A writer that did not check its text: that row is an error row, the others read; a truncated file raises
    (the datasource names it in the job's report, tested with the job)."""
    prompts = pa.array([b"good", b"caf\xe9", b"also good"], pa.binary()).view(pa.string())  # Arrow checks nothing
    pq.write_table(pa.table({"id": ["a", "b", "c"], "prompt": prompts}), tmp_path / "p.parquet")
    records = [r for block in parquet_records(pa.OSFile(str(tmp_path / "p.parquet")), lambda names: None,
                                              ("id", "prompt")) for r in block]
    rows = to_prompt_table(records, "p.parquet", 0).to_pylist()
    assert [(r["id"], r["input_error"]) for r in rows] == [
        ("a", None), ("p.parquet:1", "the row holds text that is not valid UTF-8 (unexpected end of data at byte 3)"),
        ("c", None)]
    (tmp_path / "cut.parquet").write_bytes((tmp_path / "p.parquet").read_bytes()[:100])
    with pytest.raises(pa.ArrowInvalid):
        next(parquet_records(pa.OSFile(str(tmp_path / "cut.parquet")), lambda names: None, ("id", "prompt")))


def test_a_prompt_past_the_limit_is_refused_by_its_length_and_keeps_a_prefix():
    """A prompt over max_prompt_chars is an error row holding its first ERROR_PROMPT_CHARS characters, hashed by
    its length and that prefix (not whole); prompts within the limit hash as before."""
    long = "p" * (ERROR_PROMPT_CHARS + 10)
    rows = to_prompt_table([{"prompt": long}, {"prompt": long[:-1] + "q"}, {"prompt": long + "p"}, {"prompt": "ok"}],
                           "f.jsonl", 0, max_prompt_chars=ERROR_PROMPT_CHARS).to_pylist()
    assert rows[0]["input_error"] == f"the prompt has {len(long):,} characters, more than max_prompt_chars=65,536"
    assert rows[0]["prompt"] == long[:ERROR_PROMPT_CHARS]
    assert rows[0]["request_hash"] == rows[1]["request_hash"] != rows[2]["request_hash"]
    assert rows[3]["input_error"] is None and rows[3]["request_hash"] == request_hash("ok", None)
    assert BadRow("x").fields is None


# ---- the batch job on a real Ray ---------------------------------------------------------------------------

MAX_NEW = 3
GOOD = ["import os", "return sorted(", "x = [1]"]


def config(model_dir: Path, input, output: Path):
    from pipeline.batch import BatchConfig
    from pipeline.stage import StageConfig

    stage = StageConfig(model=str(model_dir), mode="dense", dtype="float32", max_new_tokens=MAX_NEW, batch_size=4)
    return BatchConfig(input=[str(input)], output=str(output), stage=stage, num_actors=1, show_progress=False)


def run_twice(cfg) -> tuple[dict, dict, pd.DataFrame]:
    """The job, then the job again on its output (a resume: nothing left to do, no engine loaded)."""
    from pipeline.batch import run

    first = run(cfg)
    again = run(cfg)
    assert again["rows_this_run"] == 0 and again["rows"] == first["rows"]
    return first, again, pd.read_parquet(cfg.output)


def check_rows(df: pd.DataFrame, good: list[str], bad: list[str]) -> pd.DataFrame:
    """Every good row written once and fine, every bad row an error row of kind input, no prompt past 1 MB."""
    assert df["id"].is_unique and sorted(df["id"]) == sorted(good + bad)
    df = df.set_index("id")
    assert df.loc[good, "error"].isna().all() and (df.loc[good, "completion_tokens"] >= 1).all()
    assert df.loc[bad, "error"].str.startswith("InputError: ").all() and (df.loc[bad, "error_kind"] == "input").all()
    assert df["prompt"].fillna("").map(lambda p: len(p.encode())).max() <= 1 << 20
    return df


@pytest.mark.usefixtures("ray_cluster")
def test_the_job_over_hostile_jsonl_and_csv_writes_every_good_row_and_resumes(tmp_path, tiny_model_dir):
    # JSONL: a lone surrogate, invalid UTF-8, a 100 MB prompt (a line past the limit: never parsed, its row under
    # <file>:<row>) and a 2M-character prompt (parsed, refused by its length, a prefix kept) beside good rows
    src = tmp_path / "p.jsonl"
    with open(src, "wb") as f:
        for i, p in enumerate(GOOD):
            f.write(json.dumps({"id": f"g{i}", "prompt": p}).encode() + b"\n")
        f.write(json.dumps({"id": "surrogate", "prompt": "\ud83d"}).encode() + b"\n")
        f.write(b'{"id": "latin1", "prompt": "caf\xe9"}\n')
        f.write(b'{"id": "huge", "prompt": "' + b"x" * (100 << 20) + b'"}\n')
        f.write(json.dumps({"id": "long", "prompt": "y" * 2_000_000}).encode() + b"\n")
    first, _, df = run_twice(config(tiny_model_dir, src, tmp_path / "out-jsonl"))
    df = check_rows(df, [f"g{i}" for i in range(3)], ["surrogate", "latin1", "p.jsonl:5", "long"])
    assert "lone surrogate U+D83D" in df.loc["surrogate", "error"] and "not valid UTF-8" in df.loc["latin1", "error"]
    assert "bytes, more than" in df.loc["p.jsonl:5", "error"] and pd.isna(df.loc["p.jsonl:5", "prompt"])
    assert df.loc["long", "prompt"] == "y" * ERROR_PROMPT_CHARS and "max_prompt_chars" in df.loc["long", "error"]
    assert first["unreadable_inputs"] == [] and first["error_kinds"] == {"input": 4}

    # CSV: an unclosed quote (the lines it swallowed read again as rows) and a row of the wrong width
    src = tmp_path / "p.csv"
    src.write_text(f'id,prompt\nc0,{GOOD[0]}\nc1,"unclosed\nc2,{GOOD[1]}\nc3,x,y\nc4,"{GOOD[2]}"\n')
    _, _, df = run_twice(config(tiny_model_dir, src, tmp_path / "out-csv"))
    check_rows(df, ["c0", "c2", "c4"], ["p.csv:1", "p.csv:3"])
