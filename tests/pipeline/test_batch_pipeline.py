"""The batch pipeline on a real (local, 2-CPU) Ray cluster with real Parquet files and tiny
random models: bad rows, input formats, resume, a crashed actor, the CLI and analyze."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray

from pipeline.batch import BatchConfig, run
from pipeline.prompts import read_prompts, wave_of
from pipeline.stage import CRASH_ONCE_ENV, OUTPUT_SCHEMA, StageConfig
from tests.conftest import BUNDLED, make_hf_model

MAX_NEW = 4
GOOD = ["def add(a, b):\n", "import os\n", "class Point:\n    def __init__(self", "for i in range(10):\n",
        "x = [1, 2, 3]\n", "with open(path) as f:\n", "return sorted(", "try:\n    import json\n"]


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model")
    make_hf_model(path, layers=2, hidden=64, heads=4, kv_heads=2, max_pos=64)
    return path


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def config(model_dir: Path, input, output: Path, **kw) -> BatchConfig:
    stage = StageConfig(model=str(model_dir), mode="dense", max_new_tokens=MAX_NEW, batch_size=4)
    return BatchConfig(input=[str(p) for p in (input if isinstance(input, list) else [input])], output=str(output),
                       stage=stage, show_progress=False, **kw)


def read_output(output: Path) -> pd.DataFrame:
    files = sorted((output / "parts").glob("part-*.parquet"))
    return pd.concat([pd.read_parquet(f) for f in files], ignore_index=True)


@pytest.fixture(scope="module")
def jsonl_run(tmp_path_factory, model_dir):
    """One dense run over good rows and every kind of bad row, in two waves."""
    tmp = tmp_path_factory.mktemp("jsonl")
    bad = [{"id": "not-a-string", "prompt": 123}, {"id": "empty", "prompt": ""}, {"id": "missing"},
           {"id": "too-long", "prompt": "word " * 200}, "{not json"]
    src = write_jsonl(tmp / "prompts.jsonl", [{"prompt": p} for p in GOOD[:6]] + bad)
    cfg = config(model_dir, src, tmp / "out", waves=2, rows_per_file=3)
    return cfg, run(cfg), tmp / "out"


def test_jsonl_to_parquet_with_error_rows(jsonl_run):
    cfg, summary, out = jsonl_run
    df = read_output(out).set_index("id")
    good = [f"prompts.jsonl:{i}" for i in range(6)]
    assert sorted(df.index) == sorted(good + ["not-a-string", "empty", "missing", "too-long", "prompts.jsonl:10"])
    assert pq.read_schema(next((out / "parts").glob("*.parquet"))) == OUTPUT_SCHEMA
    ok = df.loc[good]
    assert ok["error"].isna().all() and (ok["completion_tokens"] <= MAX_NEW).all()
    assert all(list(layers) == [2] * int(n) for layers, n in zip(ok["exit_layers"], ok["completion_tokens"]))
    assert (ok["avg_layers"] == 2).all() and (ok["mode"] == "dense").all() and ok["schedule_version"].isna().all()
    assert set(ok["finish_reason"]) <= {"stop", "length"} and (ok["latency_s"] > 0).all()
    assert list(df["wave"]) == [wave_of(i, 2) for i in df.index]
    errors = df["error"].dropna()
    assert errors["not-a-string"] == "InputError: prompt must be a string, got int"
    assert errors["missing"] == "InputError: no 'prompt' value"
    assert errors["prompts.jsonl:10"].startswith("InputError: invalid JSON")
    assert errors["empty"] == "PromptError: prompt is empty"
    assert errors["too-long"].startswith("PromptError: prompt has") and "context holds 64" in errors["too-long"]
    assert df.loc[list(errors.index), "completion"].isna().all()
    assert summary["rows"] == summary["rows_this_run"] == 11 and summary["errors"] == 5
    assert summary["avg_layers"] == 2 and summary["est_speedup_upper_bound"] == 1
    assert summary["completion_tokens"] == int(ok["completion_tokens"].sum())
    assert json.loads((out / "summary.json").read_text())["run_id"] == summary["run_id"]
    assert not (out / "schedules").exists()  # dense: nothing to re-tune
    assert not list((out / "parts").glob(".*"))


def test_resume_skips_written_ids(jsonl_run, tmp_path, model_dir):
    cfg, first, out = jsonl_run
    resumed = tmp_path / "out"
    shutil.copytree(out, resumed)
    parts = sorted((resumed / "parts").glob("part-*.parquet"))
    lost = pq.read_table(parts[0], columns=["id"])["id"].to_pylist()
    parts[0].unlink()  # the job died before this file was renamed into place ...
    (resumed / "parts" / f".{parts[0].name}.tmp").write_bytes(b"PAR1 half")  # ... while writing it
    kept = {p.name: p.stat().st_mtime_ns for p in parts[1:]}

    again = run(config(model_dir, cfg.input, resumed, waves=2))
    assert again["rows_this_run"] == len(lost) and again["rows"] == first["rows"]
    df = read_output(resumed)
    assert df["id"].is_unique and set(df["id"]) == set(read_output(out)["id"])
    assert {p.name: p.stat().st_mtime_ns for p in parts[1:]} == kept
    assert not list((resumed / "parts").glob(".*"))

    nothing = run(config(model_dir, cfg.input, resumed, waves=2))
    assert nothing["rows_this_run"] == 0 and nothing["rows"] == first["rows"]


def test_csv_and_parquet_inputs(tmp_path, model_dir):
    csv = tmp_path / "p.csv"
    csv.write_text('id,prompt\n,"def f(x):\n    return x"\n0042,"a, b"\n7,\n')
    rows = read_prompts(str(csv)).take_all()  # in any order: Ray Data yields blocks as they finish
    # ids stay text, empty ids get file:row
    assert {r["id"]: r["prompt"] for r in rows} == {"p.csv:0": "def f(x):\n    return x", "0042": "a, b", "7": ""}
    assert len(rows) == 3

    pq.write_table(pa.table({"text": GOOD[:5], "other": list(range(5))}), tmp_path / "p.parquet")
    # a pool that holds every CPU of the cluster (2 x 1.0) must not starve Ray Data's own tasks
    cfg = config(model_dir, tmp_path / "p.parquet", tmp_path / "out", waves=1, prompt_column="text", num_actors=2,
                 cpus_per_actor=1.0)
    summary = run(cfg)
    df = read_output(tmp_path / "out")
    assert sorted(df["id"]) == [f"p.parquet:{i}" for i in range(5)] and list(df["prompt"]) == GOOD[:5]
    assert summary["errors"] == 0 and df["completion"].notna().all()


def test_killed_actor_loses_and_duplicates_nothing(tmp_path, model_dir):
    """The actor process dies after generating a batch, before returning it: Ray restarts the
    actor and retries the batch (Ray Data's actor defaults: max_restarts=-1, max_task_retries=-1)."""
    src = write_jsonl(tmp_path / "p.jsonl", [{"id": f"r{i}", "prompt": p} for i, p in enumerate(GOOD)])
    marker = tmp_path / "crashed"
    cfg = config(model_dir, src, tmp_path / "out", waves=1, num_actors=1,
                 runtime_env={"env_vars": {CRASH_ONCE_ENV: str(marker)}})
    summary = run(cfg)
    assert marker.exists()  # the crash did happen
    df = read_output(tmp_path / "out")
    assert sorted(df["id"]) == sorted(f"r{i}" for i in range(len(GOOD))) and df["id"].is_unique
    assert summary["rows"] == len(GOOD) and summary["errors"] == 0


@pytest.mark.parametrize("mode_args, mode", [([], "dense"), (["--mode", "spec", "--spec-depth", "3"], "spec")])
def test_generate_cli(tmp_path, model_dir, capsys, mode_args, mode):
    from jobs import generate
    from specee_core import SpecEEEngine

    csv = tmp_path / "in.csv"
    csv.write_text("prompt\n" + "".join(f'"{p}"\n' for p in GOOD) + '""\n')
    summary = generate.main(["--input", str(csv), "--output", str(tmp_path / "out"), "--model", str(model_dir),
                             "--waves", "1", "--max-new-tokens", "6", "--limit", "6", "--num-actors", "1",
                             "--batch-size", "3", "--dtype", "float32", "--no-progress", *mode_args])
    printed = capsys.readouterr().out
    assert json.loads(printed[printed.index("{"):]) == summary
    assert summary["mode"] == mode and summary["rows"] == 6  # --limit: the first 6 rows in file order
    df = read_output(tmp_path / "out").sort_values("id")
    assert list(df["id"]) == [f"in.csv:{i}" for i in range(6)]
    assert (df["mode"] == mode).all() and df["schedule_version"].isna().all()
    # greedy in fp32: spec answers exactly what dense decoding does
    dense = SpecEEEngine.from_pretrained(model_dir).generate(list(df["prompt"]), max_new_tokens=6)
    assert list(df["completion"]) == [r.text for r in dense]


def test_analyze_stats_and_png(jsonl_run, tmp_path):
    from jobs import analyze

    cfg, summary, out = jsonl_run
    result = analyze.main([str(out), "--png", str(tmp_path / "hist.png")])
    assert (result["rows"], result["errors"], result["avg_layers"]) == (11, 5, 2.0)
    assert result["error_kinds"] == {"InputError": 3, "PromptError": 2}
    assert [w["wave"] for w in result["per_wave"]] == [0, 1] and sum(w["rows"] for w in result["per_wave"]) == 11
    assert sum(w["tokens"] for w in result["per_wave"]) == summary["completion_tokens"]
    assert [v["schedule_version"] for v in result["per_schedule_version"]] == [None]  # dense
    png = tmp_path / "hist.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000


def test_specee_waves_retune_the_schedule(tmp_path):
    """specee on a tiny model with random predictors that always exit (threshold 0) and an
    exploration step every 2nd token: exploring, the first layer always accepts, so the wrong
    start [3] is re-tuned to [1] after wave 0, each wave's actors run its version, and every
    version is saved."""
    from specee_core.scheduler import Schedule
    from tests.conftest import add_early_exit_files

    model = tmp_path / "model"
    make_hf_model(model, layers=4, hidden=64, heads=4, kv_heads=2, max_pos=64, seed=1)
    add_early_exit_files(model, offline=(3,))
    ids = []
    for i in range(100):  # two rows in each of the three waves
        if sum(wave_of(x, 3) == wave_of(f"r{i}", 3) for x in ids) < 2:
            ids.append(f"r{i}")
    src = write_jsonl(tmp_path / "p.jsonl", [{"id": i, "prompt": GOOD[k]} for k, i in enumerate(ids)])
    stage = StageConfig(model=str(model), mode="specee", max_new_tokens=6, batch_size=4,
                        engine_options={"threshold": 0.0, "explore_every": 2})
    summary = run(BatchConfig(input=[str(src)], output=str(tmp_path / "out"), stage=stage, waves=3, num_actors=1,
                              show_progress=False))
    assert [w["schedule_version"] for w in summary["waves"]] == [0, 1, 2]
    saved = {v: Schedule.load(tmp_path / "out" / "schedules" / f"v{v}.json").offline_layers for v in (0, 1, 2)}
    assert saved == {0: [3], 1: [1], 2: [1]}
    assert summary["final_schedule"]["version"] == 2
    df = read_output(tmp_path / "out")
    assert sorted(df["id"]) == sorted(ids) and df["error"].isna().all() and (df["mode"] == "specee").all()
    assert list(df["schedule_version"]) == list(df["wave"])  # wave w ran with version w
    assert all(h is not None and len(h) == 4 for h in df["retune_histogram"])
    assert summary["avg_layers"] < 4 and summary["est_speedup_upper_bound"] > 1


@pytest.mark.skipif(not (BUNDLED / "predictors.safetensors").is_file(),
                    reason="needs the bundled model with its draft head, predictors and schedule")
def test_specee_retune_moves_a_wrong_schedule_towards_the_profile(tmp_path):
    from specee_core.scheduler import Schedule

    profile = Schedule.load(BUNDLED / "schedule.json")
    num_layers = profile.num_layers
    k = len(profile.offline_layers)
    # the layers the profile likes least: the deepest ones outside it
    wrong_layers = [l for l in range(num_layers - 1, 0, -1) if l not in profile.offline_layers][:k]
    wrong = Schedule(num_layers=num_layers, offline_layers=wrong_layers, window=profile.window,
                     offsets=profile.offsets, version=0, source="test-wrong")
    wrong.save(tmp_path / "wrong.json")
    stage = StageConfig(model=str(BUNDLED), mode="specee", max_new_tokens=12, batch_size=12,
                        engine_options={"explore_every": 4})
    cfg = BatchConfig(input=[str(BUNDLED.parents[1] / "prompts" / "sample_prompts.jsonl")],
                      output=str(tmp_path / "out"), stage=stage, waves=3, limit=36, num_actors=1,
                      schedule=str(tmp_path / "wrong.json"), show_progress=False)
    summary = run(cfg)

    def distance(s: Schedule) -> int:
        return len(set(s.offline_layers) ^ set(profile.offline_layers))

    versions = [w["schedule_version"] for w in summary["waves"]]
    assert versions == sorted(versions) and versions[-1] > 0
    schedules = [Schedule.load(tmp_path / "out" / "schedules" / f"v{v}.json") for v in versions]
    assert distance(schedules[-1]) < distance(wrong)
    df = read_output(tmp_path / "out")
    assert (df["mode"] == "specee").all() and df["retune_histogram"].notna().any()
    assert set(df["schedule_version"]) == set(versions)
    assert summary["avg_layers"] < num_layers


def test_actor_resources_share_the_cpus(model_dir, tmp_path):
    from pipeline.batch import actor_resources

    assert actor_resources(config(model_dir, "x.jsonl", tmp_path, num_actors=2)) == {"num_cpus": 1.0, "num_gpus": 0}
    assert actor_resources(config(model_dir, "x.jsonl", tmp_path, num_actors=4)) == {"num_cpus": 0.5, "num_gpus": 0}
    gpu = BatchConfig(input=["x.jsonl"], output=str(tmp_path), stage=StageConfig(model="m", device="cuda"))
    assert actor_resources(gpu) == {"num_cpus": 1, "num_gpus": 1}
