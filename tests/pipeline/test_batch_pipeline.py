"""The batch pipeline on a real (local, loopback, 2-CPU) Ray cluster with real Parquet files and
tiny random models: bad rows, input formats, resume (lost, damaged and edited rows, the manifest, the
lock), retrying error rows, a crashed actor, live re-tuning, every mode, the CLI and analyze."""
from __future__ import annotations

import json
import logging
import shutil
import warnings
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray
import torch

from pipeline.batch import BatchConfig, run
from pipeline.prompts import read_prompts
from pipeline.stage import CRASH_ON_ENV, CRASH_ONCE_ENV, HANG_ON_ENV, OUTPUT_SCHEMA, StageConfig
from tests.conftest import BUNDLED, REPO, make_hf_model

MAX_NEW = 4
GOOD = ["def add(a, b):\n", "import os\n", "class Point:\n    def __init__(self", "for i in range(10):\n",
        "x = [1, 2, 3]\n", "with open(path) as f:\n", "return sorted(", "try:\n    import json\n"]


pytestmark = pytest.mark.usefixtures("ray_cluster")  # tests/conftest.py


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model")
    make_hf_model(path, layers=2, hidden=64, heads=4, kv_heads=2, max_pos=64)
    return path


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def config(model_dir: Path, input, output: Path, **kw) -> BatchConfig:
    stage = StageConfig(model=str(model_dir), mode="dense", dtype="float32", max_new_tokens=MAX_NEW, batch_size=4)
    return BatchConfig(input=[str(p) for p in (input if isinstance(input, list) else [input])], output=str(output),
                       stage=stage, show_progress=False, **kw)


def read_output(output: Path) -> pd.DataFrame:
    return pd.read_parquet(output)  # what a user does: the metadata beside the rows is skipped


def test_ray_listens_on_loopback():
    assert ray.get_runtime_context().gcs_address.startswith("127.0.0.1:")
    assert {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}


# rows that set their own sampling (vLLM's names: columns of their own or sampling_params), three of them badly
OWN_SAMPLING = [{"id": "max2", "prompt": GOOD[6], "max_tokens": 2},
                {"id": "no-eos", "prompt": GOOD[7], "sampling_params": {"max_tokens": 3, "ignore_eos": True}},
                {"id": "hot", "prompt": GOOD[0], "sampling_params": {"max_tokens": 3, "temperature": 0.8, "seed": 1, "n": 2}},
                {"id": "bad-max", "prompt": GOOD[1], "max_tokens": "x"},
                {"id": "bad-temp", "prompt": GOOD[2], "temperature": -1},
                {"id": "not-yet", "prompt": GOOD[3], "sampling_params": {"best_of": 2}},
                {"id": "logprobs", "prompt": GOOD[4], "sampling_params": {"max_tokens": 3, "logprobs": 2}},
                {"id": "json", "prompt": GOOD[5], "max_tokens": 8, "response_format": {
                    "type": "json_schema", "json_schema": {"name": "a", "schema": {"enum": ["yes", "no"]}}}}]


@pytest.fixture(scope="module")
def jsonl_run(tmp_path_factory, model_dir):
    """One dense run over good rows, every kind of bad row, and rows with their own sampling."""
    tmp = tmp_path_factory.mktemp("jsonl")
    bad = [{"id": "not-a-string", "prompt": 123}, {"id": "empty", "prompt": ""}, {"id": "missing"},
           {"id": "too-long", "prompt": "word " * 200}, "{not json"]
    src = write_jsonl(tmp / "prompts.jsonl", [{"prompt": p} for p in GOOD[:6]] + bad + OWN_SAMPLING)
    cfg = config(model_dir, src, tmp / "out", rows_per_file=3)
    return cfg, run(cfg), tmp / "out"


def test_jsonl_to_parquet_with_error_rows(jsonl_run):
    cfg, summary, out = jsonl_run
    df = read_output(out).set_index("id")
    good = [f"prompts.jsonl:{i}" for i in range(6)]
    assert sorted(df.index) == sorted(good + ["not-a-string", "empty", "missing", "too-long", "prompts.jsonl:10"] +
                                      [r["id"] for r in OWN_SAMPLING])
    assert pq.read_schema(next(out.glob("part-*.parquet"))) == OUTPUT_SCHEMA
    assert len(df) == 19 and sorted(p.name for p in out.iterdir() if not p.name.startswith("part-")) == \
        ["_specee_manifest.json", "_summary.json"]  # dense: no schedules; the lock is gone with the job
    ok = df.loc[good]
    assert ok["error"].isna().all() and (ok["completion_tokens"] <= MAX_NEW).all()
    assert all(list(layers) == [2] * int(n) for layers, n in zip(ok["exit_layers"], ok["completion_tokens"]))
    assert (ok["avg_layers"] == 2).all() and (ok["mode"] == "dense").all() and ok["schedule_version"].isna().all()
    assert set(ok["finish_reason"]) <= {"stop", "length"}
    errors = df["error"].dropna()
    assert errors["not-a-string"] == "InputError: prompt must be a string, got int"
    assert errors["missing"] == "InputError: no 'prompt' value"
    assert errors["prompts.jsonl:10"].startswith("InputError: invalid JSON")
    assert errors["empty"] == "PromptError: prompt is empty"
    assert errors["too-long"].startswith("PromptError: prompt has") and "context holds 64" in errors["too-long"]
    assert df.loc[list(errors.index), "completion"].isna().all()
    assert (df.loc[list(errors.index), "error_kind"] == "input").all() and ok["error_kind"].isna().all()
    assert df["request_hash"].str.fullmatch("[0-9a-f]{32}").all()
    assert summary["rows"] == summary["rows_this_run"] == 19 and summary["errors"] == 8
    assert summary["error_kinds"] == {"input": 8}
    assert summary["avg_layers"] == 2 and summary["est_speedup_upper_bound"] == 1
    assert summary["completion_tokens"] == int(df["completion_tokens"].sum())
    assert json.loads((out / "_summary.json").read_text())["run_id"] == summary["run_id"]
    assert not list(out.glob(".*"))


def test_rows_with_their_own_sampling_in_the_job(jsonl_run, model_dir):
    """The job (dense, through the processor) honours each row's own sampling from the input file: a greedy row
    with max_tokens 2 is the engine's own answer at 2 tokens, ignore_eos runs to its max_tokens, a sampled row
    stays within its own, a JSON schema row answers in its schema;
    a value of the wrong type, out of range, or a parameter the engine lacks costs its row, not the job."""
    from specee_core import SpecEEEngine

    _, _, out = jsonl_run
    df = read_output(out).set_index("id")
    engine = SpecEEEngine.from_pretrained(model_dir, dtype="float32")
    ref = engine.generate([GOOD[6]], max_new_tokens=2, mode="dense")[0]
    assert df.loc["max2", "completion"] == ref.text and df.loc["max2", "completion_tokens"] == len(ref.token_ids) <= 2
    assert df.loc["no-eos", "completion_tokens"] == 3 and df.loc["no-eos", "finish_reason"] == "length"
    assert pd.isna(df.loc["hot", "error"]) and 1 <= df.loc["hot", "completion_tokens"] <= 3
    hot = df.loc["hot", "choices"]  # n = 2, sampled: both in the Parquet column, the first the row's completion
    assert [c["index"] for c in hot] == [0, 1] and hot[0]["completion"] == df.loc["hot", "completion"]
    assert all(1 <= c["completion_tokens"] <= 3 for c in hot) and df.loc["max2", "choices"] is None
    assert df.loc["bad-max", "error"] == "InputError: sampling parameter max_tokens='x': expected a number"
    assert df.loc["bad-temp", "error"].startswith("InputError: sampling parameters temperature=-1: temperature must")
    assert df.loc["not-yet", "error"] == "InputError: sampling parameter best_of=2 is not supported yet (only 1)"
    lps = df.loc["logprobs", "logprobs"]  # the Parquet column: one struct per generated token
    assert len(lps) == df.loc["logprobs", "completion_tokens"] and all(len(e["top_logprobs"]) == 2 for e in lps)
    assert df.loc["max2", "logprobs"] is None  # not asked
    assert json.loads(df.loc["json", "completion"]) in ("yes", "no")  # its own response_format, in dense


def test_row_metrics_are_the_rows_own(jsonl_run):
    """latency and time to first token belong to the row; batch_* columns to the engine call it ran
    in; tokens/s in the summary is the tokens over the span of those calls."""
    cfg, summary, out = jsonl_run
    df = read_output(out)
    ok = df[df["error"].isna()]
    assert (ok["ttft_s"] > 0).all() and (ok["ttft_s"] <= ok["latency_s"]).all()
    assert (ok["latency_s"] <= ok["batch_s"] + 1e-6).all()
    sizes = df.groupby("batch_id")["id"].count()
    assert (df["batch_rows"] == df["batch_id"].map(sizes)).all()  # every row of a call came back, once
    assert set(df["batch_rows"]) <= set(range(1, cfg.stage.batch_size + 1))
    assert df.groupby("batch_id")[["batch_started_at", "batch_s", "worker"]].nunique().eq(1).all().all()
    span = (df["batch_started_at"] + df["batch_s"]).max() - df["batch_started_at"].min()
    assert summary["generate_s"] == pytest.approx(span, abs=1e-3)
    assert summary["tokens_per_s"] == pytest.approx(ok["completion_tokens"].sum() / span, rel=1e-3)
    assert 0 < summary["generate_s"] < summary["wall_s"]


def part_ids(path: Path) -> list[str]:
    return pq.read_table(path, columns=["id"])["id"].to_pylist()


def test_resume_skips_written_ids(jsonl_run, tmp_path, model_dir):
    """A resume generates exactly the rows not in the output: those of a part file that never made it, of
    one damaged since (set aside), and a row whose prompt was edited under its id (its old row removed);
    a rerun with other settings stops naming them, and a folder another job holds is refused."""
    from pipeline.output_lock import FolderLocked, OutputLock

    cfg, first, out = jsonl_run
    resumed = tmp_path / "out"
    shutil.copytree(out, resumed)
    parts = sorted(resumed.glob("part-*.parquet"))
    lost, damaged = part_ids(parts[0]), part_ids(parts[1])
    parts[0].unlink()  # the job died before this file was renamed into place ...
    (resumed / f".{parts[0].name}.crashed-run.tmp").write_bytes(b"PAR1 half")  # ... while writing it
    parts[1].write_bytes(parts[1].read_bytes()[:200])  # a file damaged since
    edited = part_ids(parts[2])[0]  # a row whose prompt is edited in the input, under the same id
    lines = Path(cfg.input[0]).read_text().splitlines()
    line = int(edited.split(":")[1]) if edited.startswith("prompts.jsonl:") else \
        next(k for k, text in enumerate(lines) if f'"id": {json.dumps(edited)}' in text)
    lines[line] = json.dumps({"id": edited, "prompt": "def edited():\n"})
    (tmp_path / "in").mkdir()
    src = write_jsonl(tmp_path / "in" / "prompts.jsonl", lines)
    kept = {p.name: p.stat().st_mtime_ns for p in parts[3:]}

    again = run(config(model_dir, src, resumed))
    assert again["rows_this_run"] == len(lost) + len(damaged) + 1 and again["rows"] == first["rows"]
    assert again["regenerated"] == {"changed_requests": 1, "error_rows": 0}
    assert again["set_aside"] == [f"_{parts[1].name}.corrupt"]
    df = read_output(resumed).set_index("id")
    assert df.index.is_unique and set(df.index) == set(read_output(out)["id"])
    assert df.loc[edited, "prompt"] == "def edited():\n" and df.loc[edited, "run_id"] == again["run_id"]
    assert edited not in part_ids(parts[2])  # rewritten without its old row
    assert {p.name: p.stat().st_mtime_ns for p in parts[3:]} == kept
    assert not list(resumed.glob(".*"))

    nothing = run(config(model_dir, src, resumed))
    assert nothing["rows_this_run"] == 0 and nothing["rows"] == first["rows"]
    shorter = config(model_dir, src, resumed)
    shorter.stage = replace(shorter.stage, max_new_tokens=2)
    with pytest.raises(ValueError, match=f"output folder {resumed} was written with max_new_tokens=4; this job has "
                                         f"max_new_tokens=2; pass --overwrite-config"):
        run(shorter)
    with OutputLock(resumed, "another-job"), pytest.raises(FolderLocked, match="in use by run another-job"):
        run(config(model_dir, src, resumed))


def test_retry_errors_generates_the_error_rows_again(jsonl_run, tmp_path, model_dir):
    """retry_errors on a finished job: its error rows run again and replace the old ones (the part files
    holding them rewritten without them), every id once; the input's faults fail again, as kind input."""
    cfg, first, out = jsonl_run
    again_dir = tmp_path / "out"
    shutil.copytree(out, again_dir)
    before = read_output(again_dir)
    errors = set(before.loc[before["error"].notna(), "id"])
    untouched = {p.name: p.stat().st_mtime_ns for p in again_dir.glob("part-*.parquet") if not set(part_ids(p)) & errors}
    summary = run(config(model_dir, cfg.input, again_dir, retry_errors=True))
    assert summary["rows_this_run"] == len(errors) == 8 and summary["regenerated"] == {"changed_requests": 0,
                                                                                       "error_rows": 8}
    df = read_output(again_dir)
    assert df["id"].is_unique and set(df["id"]) == set(before["id"])
    assert set(df.loc[df["error"].notna(), "id"]) == errors and summary["error_kinds"] == {"input": 8}
    assert set(df.loc[df["id"].isin(errors), "run_id"]) == {summary["run_id"]}
    assert {p.name: p.stat().st_mtime_ns for p in again_dir.glob("part-*.parquet") if p.name in untouched} == untouched


def test_csv_and_parquet_inputs(tmp_path, model_dir):
    csv = tmp_path / "p.csv"
    csv.write_text('id,prompt\n,"def f(x):\n    return x"\n0042,"a, b"\n7,\n')
    rows = read_prompts(str(csv)).take_all()  # in any order: Ray Data yields blocks as they finish
    # ids stay text, empty ids get file:row
    assert {r["id"]: r["prompt"] for r in rows} == {"p.csv:0": "def f(x):\n    return x", "0042": "a, b", "7": ""}
    assert len(rows) == 3

    # Parquet rows with their own sampling: an int column with nulls, a struct column; beside them a truncated
    # file, which the job names in its summary (on every run) while it writes the other file's rows
    folder = tmp_path / "parquet"
    folder.mkdir()
    pq.write_table(pa.table({"text": GOOD[:5], "other": list(range(5)), "max_tokens": [1, None, 2, None, None],
                             "sampling_params": [{"ignore_eos": True}, None, {"ignore_eos": True}, None, None]}),
                   folder / "p.parquet")
    (folder / "truncated.parquet").write_bytes((folder / "p.parquet").read_bytes()[:300])
    # a pool that holds every CPU of the cluster (2 x 1.0) must not starve Ray Data's own tasks
    cfg = config(model_dir, folder, tmp_path / "out", prompt_column="text", num_actors=2, cpus_per_actor=1.0)
    summary = run(cfg)
    df = read_output(tmp_path / "out")
    # rows come back as their batches finish (two actors here): compare by id
    assert dict(zip(df["id"], df["prompt"])) == {f"p.parquet:{i}": GOOD[i] for i in range(5)}
    assert summary["errors"] == 0 and df["completion"].notna().all()
    tokens = dict(zip(df["id"], df["completion_tokens"]))
    assert (tokens["p.parquet:0"], tokens["p.parquet:2"]) == (1, 2) and tokens["p.parquet:1"] <= MAX_NEW
    again = run(cfg)  # a resume: nothing to do, the truncated file named again
    assert again["rows_this_run"] == 0 and again["rows"] == 5
    for s in (summary, again):
        assert [u["file"] for u in s["unreadable_inputs"]] == ["truncated.parquet"]
        assert s["unreadable_inputs"][0]["error"].startswith("ArrowInvalid: ") and "(after 0 rows)" in \
            s["unreadable_inputs"][0]["error"]


def test_killed_actor_loses_and_duplicates_nothing(tmp_path, model_dir):
    """The actor process dies after generating a batch, before returning it: Ray restarts the
    same actor (new process) and retries its batches (max_restarts=-1, max_task_retries). Ray Data's
    pool keeps the actors' constructor arguments in the object store and Ray may warn that the
    restart could fail (ray-project/ray#53727), but the dataset holds those objects while it runs:
    the restart works."""
    src = write_jsonl(tmp_path / "p.jsonl", [{"id": f"r{i}", "prompt": p} for i, p in enumerate(GOOD)])
    marker = tmp_path / "crashed"
    cfg = config(model_dir, src, tmp_path / "out", num_actors=1,
                 runtime_env={"env_vars": {CRASH_ONCE_ENV: str(marker)}})
    summary = run(cfg)
    assert marker.exists()  # the crash did happen
    df = read_output(tmp_path / "out")
    assert sorted(df["id"]) == sorted(f"r{i}" for i in range(len(GOOD))) and df["id"].is_unique
    assert summary["rows"] == len(GOOD) and summary["errors"] == 0
    actors = df["worker"].str.split(":").str[0]
    assert actors.nunique() == 1  # one actor, restarted in place, not a second one


def test_rows_that_kill_or_hang_their_process_become_error_rows_with_batches_in_flight(tmp_path, model_dir):
    """Two poisonous rows in one batch, a row that hangs in the next and a batch of good rows, in one actor that
    takes two batches at once (batches of 4; each death restarts a process, so the test keeps to three bad rows:
    scripts/probe_faults.py runs the larger probes on SmolLM2). A death takes the batches in flight with it, and
    each counts one (the hung batch alone counts a hang): the crashing batch dies twice in its actor, the hanging
    one is stopped at the per-batch timeout, then each runs in a quarantined child process (whole, unless it hung)
    and row by row; a good batch charged twice beside them runs whole there. The job finishes by itself, every
    good row once, each bad row an error row saying why."""
    good = [{"id": f"g{i}", "prompt": GOOD[i % len(GOOD)]} for i in range(8)]
    rows = [good[0], {"id": "p1", "prompt": "POISON"}, good[1], {"id": "p2", "prompt": "POISON"},
            {"id": "h1", "prompt": "HANG"}, *good[2:5], *good[5:8]]
    src = write_jsonl(tmp_path / "p.jsonl", rows)
    cfg = config(model_dir, src, tmp_path / "out", num_actors=1,
                 runtime_env={"env_vars": {CRASH_ON_ENV: "POISON", HANG_ON_ENV: "HANG"}})
    # a tiny model's batch takes < 1 s
    cfg.stage = replace(cfg.stage, batch_timeout_s=3.0, row_attempts=1, max_concurrent_batches=2)
    summary = run(cfg)
    df = read_output(tmp_path / "out").set_index("id")
    assert sorted(df.index) == sorted(r["id"] for r in rows) and df.index.is_unique
    for bad in ("p1", "p2"):
        assert df.loc[bad, "error"].startswith("WorkerDied: the engine process died running 1 row(s)"), bad
    assert "within 3 s (the per-batch timeout)" in df.loc["h1", "error"]
    assert (df.loc[["p1", "p2", "h1"], "error_kind"] == "input").all()
    assert df.loc[[r["id"] for r in good], "error"].isna().all() and summary["errors"] == 3
    # (the errors name a row dying alone: only the quarantine runs a row alone in a process of its own)
    assert max(e["peak_batches_in_flight"] for e in summary["engines"]) == 2  # an actor had two batches at once


class LogLines(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


# (spec with the draft head through the CLI: test_every_mode_with_predictors)
@pytest.mark.parametrize("mode_args, mode", [([], "auto"), (["--mode", "spec", "--spec-proposer", "lookup"], "spec")])
def test_generate_cli(tmp_path, model_dir, capsys, mode_args, mode):
    from jobs import generate
    from specee_core import SpecEEEngine

    csv = tmp_path / "in.csv"
    csv.write_text("prompt\n" + "".join(f'"{p}"\n' for p in GOOD) + '""\n')
    ray_data_log = LogLines()
    logging.getLogger("ray.data").addHandler(ray_data_log)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            summary = generate.main(["--input", str(csv), "--output", str(tmp_path / "out"), "--model",
                                     str(model_dir), "--max-new-tokens", "6", "--limit", "6", "--num-actors", "1",
                                     "--batch-size", "3", "--dtype", "float32", "--no-progress", *mode_args])
    finally:
        logging.getLogger("ray.data").removeHandler(ray_data_log)
    # Ray says what it deprecates in our calls as a warning pointing at them (ray_remote_args) or a log line
    # (concurrency): neither is left
    ours = [f"{w.filename}: {w.message}" for w in caught if issubclass(w.category, DeprecationWarning)
            and Path(w.filename).is_relative_to(REPO) and ".venv" not in Path(w.filename).parts]
    assert not ours
    assert not [line for line in ray_data_log.lines if "deprecated" in line]
    printed = capsys.readouterr().out
    assert json.loads(printed[printed.index("{"):]) == summary
    assert summary["mode"] == mode and summary["rows"] == 6  # --limit: the first 6 rows in file order
    df = read_output(tmp_path / "out").sort_values("id")
    assert list(df["id"]) == [f"in.csv:{i}" for i in range(6)]
    assert (df["mode"] == mode).all() and df["schedule_version"].isna().all()
    # greedy in fp32: spec answers exactly what dense decoding does
    dense = SpecEEEngine.from_pretrained(model_dir, dtype="float32").generate(list(df["prompt"]), max_new_tokens=6, mode="dense")
    assert list(df["completion"]) == [r.text for r in dense]


def test_the_default_job_equals_dense_on_held_out_instructions(tmp_path):
    """The main job as a user starts it (no --mode: auto), on SmolLM2 in fp32 over held-out instructions
    none of the project's training prompts share: every completion is dense's; the summary names the
    dtype and the plan the engine measured, with the steps it chose."""
    from jobs import generate
    from specee_core import SpecEEEngine
    from tests.test_smollm2 import MODEL, need_model

    need_model()
    rows = [json.loads(line) for line in (REPO / "prompts" / "instructions_heldout.jsonl").read_text().splitlines()]
    src = write_jsonl(tmp_path / "heldout.jsonl", [{"id": f"h{i}", "prompt": r["prompt"]} for i, r in
                                                   enumerate(rows[-4:])])
    summary = generate.main(["--input", str(src), "--output", str(tmp_path / "out"), "--model", str(MODEL),
                             "--max-new-tokens", "24", "--num-actors", "1", "--dtype", "float32", "--no-progress"])
    assert summary["mode"] == "auto" and summary["dtype"] == "float32" and summary["errors"] == 0
    assert summary["weights"] == "fp32" and summary["engines"][0]["weight_mb"] > 500  # recorded beside the dtype
    plan = summary["engines"][0]["plan"]
    assert plan["costs"]["verify_ms"]["16"][0] > 0 and sum(plan["steps_chosen"].values()) > 0
    df = read_output(tmp_path / "out").sort_values("id")
    engine = SpecEEEngine.from_pretrained(MODEL, dtype="float32")
    dense = engine.generate([engine.chat_prompt([{"role": "user", "content": p}]) for p in df["prompt"]],
                            max_new_tokens=24, mode="dense")
    assert list(df["completion"]) == [r.text for r in dense]


def test_analyze_stats_and_png(jsonl_run, tmp_path):
    from jobs import analyze

    cfg, summary, out = jsonl_run
    result = analyze.main([str(out), "--png", str(tmp_path / "hist.png")])
    assert (result["rows"], result["errors"], result["avg_layers"]) == (19, 8, 2.0)
    assert result["error_kinds"] == {"InputError": 6, "PromptError": 2}
    [run_stats] = result["per_run"]
    assert run_stats["run_id"] == summary["run_id"] and run_stats["tokens"] == summary["completion_tokens"]
    assert run_stats["tokens_per_s"] == pytest.approx(summary["tokens_per_s"], rel=1e-3)  # one meaning
    assert [v["schedule_version"] for v in result["per_schedule_version"]] == [None]  # dense
    png = tmp_path / "hist.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
    default = analyze.main([str(out)])  # the default plot sits beside the rows, hidden from Parquet readers
    assert Path(default["png"]) == out / "_exit_layers.png" and len(read_output(out)) == 19


def test_specee_retunes_within_one_run_without_new_actors(tmp_path):
    """specee on a tiny model with random predictors that always exit (threshold 0) and an
    exploration step every 2nd token: exploring, the first layer always accepts, so the store
    re-tunes the wrong start [3] to [1] while the run goes on; the same two actors (one process
    each) pick the new version up between batches, rows record it, and every version is saved."""
    from specee_core.early_exit.scheduler import Schedule
    from tests.conftest import add_early_exit_files

    model = tmp_path / "model"
    make_hf_model(model, layers=4, hidden=64, heads=4, kv_heads=2, max_pos=64, seed=1)
    add_early_exit_files(model, offline=(3,))
    rows = [{"id": f"r{i:02d}", "prompt": GOOD[i % len(GOOD)]} for i in range(24)]
    src = write_jsonl(tmp_path / "p.jsonl", rows)
    stage = StageConfig(model=str(model), mode="specee", max_new_tokens=6, batch_size=2,
                        engine_options={"threshold": 0.0, "explore_every": 2})
    summary = run(BatchConfig(input=[str(src)], output=str(tmp_path / "out"), stage=stage, num_actors=2,
                              retune_every_tokens=6, show_progress=False))
    saved = {int(p.stem[1:]): Schedule.load(p).offline_layers for p in (tmp_path / "out" / "_schedules").glob("v*.json")}
    assert saved == {0: [3], 1: [1]}  # the rule keeps [1] after that: no new version without a change
    assert summary["final_schedule"]["version"] == 1 and summary["schedule_store"]["retunes"] > 1
    df = read_output(tmp_path / "out")
    assert sorted(df["id"]) == [r["id"] for r in rows] and df["error"].isna().all() and (df["mode"] == "specee").all()
    assert set(df["schedule_version"]) == {0, 1}  # rows ran with the start and with the re-tuned version
    assert df["worker"].nunique() == 2  # two actors, one process each: nothing reloaded the model
    for _, own in df.sort_values("batch_started_at").groupby("worker"):
        assert own["schedule_version"].is_monotonic_increasing
    assert all(h is not None and len(h) == 4 for h in df["retune_histogram"])
    per_version = {v["schedule_version"]: v for v in summary["schedule_store"]["per_version"]}
    assert sum(v["rows"] for v in per_version.values()) == 24 and set(per_version) == {0, 1}
    assert summary["avg_layers"] < 4 and summary["est_speedup_upper_bound"] > 1


@pytest.mark.parametrize("mode_args", [["--mode", "specee", "--threshold", "0.5"],
                                       ["--mode", "spec", "--spec-proposer", "draft", "--spec-width", "2"],
                                       ["--mode", "spec", "--spec-t3", "--spec-width", "4", "--threshold", "0.5"]])
def test_every_mode_with_predictors(tmp_path, ee_model_dir, mode_args):
    """The modes that need a draft head or predictors, through the CLI on a model that has both:
    every row answered, by the asked mode; SpecEE rows carry a schedule version, the others none."""
    from jobs import generate

    src = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in GOOD[:6]])
    summary = generate.main(["--input", str(src), "--output", str(tmp_path / "out"), "--model", str(ee_model_dir),
                             "--max-new-tokens", "5", "--num-actors", "1", "--batch-size", "3", "--dtype", "float32",
                             "--no-progress", *mode_args])
    df = read_output(tmp_path / "out")
    assert len(df) == 6 and df["error"].isna().all() and summary["errors"] == 0
    assert (df["mode"] == mode_args[1]).all() and (df["completion_tokens"] >= 1).all()
    assert df["schedule_version"].notna().all() == (mode_args[1] == "specee")


def test_a_mode_the_model_cannot_run_fails_the_job_at_start(tmp_path, ee_model_dir, model_dir):
    """Options no row could run with stop the job with the engine's reason, not 6 error rows."""
    from jobs import generate

    src = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in GOOD[:6]])
    args = ["--input", str(src), "--max-new-tokens", "3", "--num-actors", "1", "--no-progress"]
    with pytest.raises(RuntimeError, match="could not start: ValueError: t3 .* use width=4"):
        generate.main([*args, "--output", str(tmp_path / "a"), "--model", str(ee_model_dir), "--mode", "spec",
                       "--spec-t3"])
    with pytest.raises(FileNotFoundError, match="needs predictors.safetensors beside the model"):
        generate.main([*args, "--output", str(tmp_path / "b"), "--model", str(model_dir), "--mode", "specee"])
    assert not list((tmp_path / "a").glob("part-*")) and not list((tmp_path / "b").glob("part-*"))


@pytest.mark.skipif(not (BUNDLED / "predictors.safetensors").is_file(),
                    reason="needs the bundled model with its draft head, predictors and schedule")
def test_specee_retune_moves_a_wrong_schedule_towards_the_profile(tmp_path):
    from specee_core.early_exit.scheduler import Schedule

    profile = Schedule.load(BUNDLED / "schedule.json")
    num_layers = profile.num_layers
    k = len(profile.offline_layers)
    # the layers the profile likes least: the deepest ones outside it
    wrong_layers = [l for l in range(num_layers - 1, 0, -1) if l not in profile.offline_layers][:k]
    wrong = Schedule(num_layers=num_layers, offline_layers=wrong_layers, window=profile.window,
                     offsets=profile.offsets, version=0, source="test-wrong")
    wrong.save(tmp_path / "wrong.json")
    stage = StageConfig(model=str(BUNDLED), mode="specee", max_new_tokens=12, batch_size=6,
                        engine_options={"explore_every": 4})
    cfg = BatchConfig(input=[str(BUNDLED.parents[1] / "prompts" / "sample_prompts.jsonl")],
                      output=str(tmp_path / "out"), stage=stage, limit=36, num_actors=1, retune_every_tokens=96,
                      schedule=str(tmp_path / "wrong.json"), show_progress=False)
    summary = run(cfg)

    def distance(s: Schedule) -> int:
        return len(set(s.offline_layers) ^ set(profile.offline_layers))

    final = Schedule(**summary["final_schedule"])
    assert final.version > 0 and distance(final) < distance(wrong)
    df = read_output(tmp_path / "out")
    assert (df["mode"] == "specee").all() and df["retune_histogram"].notna().any()
    assert df["schedule_version"].max() > 0 and df["worker"].nunique() == 1
    assert summary["avg_layers"] < num_layers


def test_actor_resources_share_the_cpus(model_dir, tmp_path):
    from pipeline.batch import actor_resources

    assert actor_resources(config(model_dir, "x.jsonl", tmp_path, num_actors=2)) == {"num_cpus": 1.0, "num_gpus": 0}
    assert actor_resources(config(model_dir, "x.jsonl", tmp_path, num_actors=4)) == {"num_cpus": 0.5, "num_gpus": 0}
    gpu = BatchConfig(input=["x.jsonl"], output=str(tmp_path), stage=StageConfig(model="m", device="cuda"))
    assert actor_resources(gpu) == {"num_cpus": 1, "num_gpus": 1}


def test_live_audit_closes_a_layer_made_bad_on_purpose(tmp_path):
    """The bundled model with a calibration that certifies every layer, and layer 1's predictor
    sabotaged to fire on every token (a token decided after 1 of 16 layers is mostly wrong). With
    --max-disagreement 0.02 and every step audited, the store sees layer 1's disagreements pass the
    tolerance at 95% confidence and publishes a version with the layer closed; rows record their
    version, rows on the new version never exit at layer 1, and the summary and jobs.analyze report
    the audited disagreement with its bound."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from jobs import analyze, generate
    from specee_core.early_exit.calibration import CALIBRATION_FILE
    from tests.test_calibration import certify_all

    model = tmp_path / "model"
    shutil.copytree(BUNDLED, model)
    tensors = load_file(model / "predictors.safetensors")
    with safe_open(str(model / "predictors.safetensors"), framework="pt") as f:
        meta = f.metadata()
    tensors["layer.1.b2"] = torch.full_like(tensors["layer.1.b2"], 50.0)  # sigmoid = 1: always fires
    save_file(tensors, str(model / "predictors.safetensors"), metadata=meta)
    layers = json.loads(meta["layers"])
    certify_all(layers, strict=True).save(model / CALIBRATION_FILE)  # every layer may exit above 0.9999
    rows = [{"id": f"r{i:02d}", "prompt": GOOD[i % len(GOOD)]} for i in range(24)]
    src = write_jsonl(tmp_path / "p.jsonl", rows)
    out = tmp_path / "out"
    summary = generate.main(["--input", str(src), "--output", str(out), "--model", str(model), "--mode", "specee",
                             "--max-new-tokens", "8", "--num-actors", "2", "--batch-size", "2", "--dtype", "float32",
                             "--max-disagreement", "0.02", "--audit-fraction", "1.0", "--no-progress"])
    audit = summary["audit"]
    assert audit["max_disagreement"] == 0.02 and 1 in audit["closed"]
    assert audit["closed"][1]["lower_bound"] > 0.02
    assert summary["final_schedule"]["disabled_layers"] == [1] and 1 not in summary["final_schedule"]["offline_layers"]
    df = read_output(out)
    assert sorted(df["id"]) == [r["id"] for r in rows] and df["error"].isna().all()
    closed_in = audit["closed"][1]["closed_in_version"]
    later = df[df["schedule_version"] >= closed_in]
    assert len(later) > 0 and all(1 not in list(e) for e in later["exit_layers"])
    assert all(len(a) == 16 for a in df["audit_exits"])
    result = analyze.main([str(out)])
    by_version = {v["schedule_version"]: v for v in result["audit_per_schedule_version"]}
    assert by_version[0]["disagreement"] > 0.02 and by_version[0]["audit_exits"] > 0
    assert by_version[0]["upper_bound"] >= by_version[0]["disagreement"]
