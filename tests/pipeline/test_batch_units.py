"""Units of the batch pipeline without a Ray cluster: the prompt reader's rows, the schedule
store, the done-id set, the output directory (durable parts, corrupt parts, rows replaced, the
manifest), the resume plan, the stage with a fake engine, batches in flight over one engine."""
from __future__ import annotations

import json
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from pipeline.batch import BatchConfig, RowStats, plan_resume
from pipeline.output import DoneIds, OutputDir
from pipeline.prompt_records import BadRow
from pipeline.prompts import PROMPT_SCHEMA, infer_format, to_prompt_table
from pipeline.schedule_store import ScheduleStore
from pipeline.stage import OUTPUT_SCHEMA, ROW_SCHEMA, StageConfig
from specee_core.early_exit.scheduler import Schedule

REPO = Path(__file__).resolve().parents[2]
L = 8


def rows(errors: list[str | None], tokens: int = 4, start: float = 100.0, batch_s: float = 2.0) -> pa.Table:
    """Output rows of one engine call."""
    return pa.Table.from_pylist([
        {"id": f"r{i}", "completion_tokens": None if e else tokens, "avg_layers": None if e else 5.0,
         "num_layers": L, "error": e, "error_kind": e and ("machine" if e.startswith("WorkerDied") else "input"),
         "batch_started_at": start, "batch_s": batch_s}
        for i, e in enumerate(errors)], schema=OUTPUT_SCHEMA)


def test_prompt_rows_get_stable_ids_and_input_errors():
    t = to_prompt_table([{"prompt": "a"}, {"id": 7, "prompt": "b"}, {"prompt": 3}, {"id": "x"},
                         BadRow("invalid JSON"), {"id": "", "prompt": ""}], "dir/f.jsonl", 10)
    assert t.schema == PROMPT_SCHEMA
    assert t["id"].to_pylist() == ["dir/f.jsonl:10", "7", "dir/f.jsonl:12", "x", "dir/f.jsonl:14", "dir/f.jsonl:15"]
    assert t["prompt"].to_pylist() == ["a", "b", None, None, None, ""]  # "" is the engine's to reject
    assert t["input_error"].to_pylist() == [None, None, "prompt must be a string, got int", "no 'prompt' value",
                                            "invalid JSON", None]


def test_request_hash_covers_the_prompt_and_the_rows_own_sampling():
    def hashes(records):
        return to_prompt_table(records, "f.jsonl", 0)["request_hash"].to_pylist()

    a, same, reordered, edited, sampled, other = hashes([
        {"id": "1", "prompt": "p", "max_tokens": 4, "temperature": 0.5},
        {"id": "2", "prompt": "p", "max_tokens": 4, "temperature": 0.5},  # the id is not part of it
        {"id": "1", "prompt": "p", "sampling_params": {"temperature": 0.5, "max_tokens": 4}},
        {"id": "1", "prompt": "p ", "max_tokens": 4, "temperature": 0.5},
        {"id": "1", "prompt": "p", "max_tokens": 5, "temperature": 0.5},
        {"id": "1", "prompt": 7}])
    assert a == same == reordered and len(a) == 32
    assert len({a, edited, sampled, other}) == 4


def test_infer_format(tmp_path):
    (tmp_path / "a.csv").write_text("prompt\nx\n")
    assert infer_format([str(tmp_path / "a.csv")]) == "csv"
    assert infer_format([str(tmp_path)]) == "csv"
    (tmp_path / "b.parquet").write_bytes(b"")
    with pytest.raises(ValueError, match="input format"):
        infer_format([str(tmp_path)])


def test_row_stats_count_good_rows_on_one_clock():
    s = RowStats()
    s.add(rows([None, None, "PromptError: x"], start=100.0, batch_s=2.0))
    s.add(rows([None, "WorkerDied: x"], start=101.0, batch_s=3.0))
    assert (s.rows, s.errors, s.completion_tokens, s.num_layers, s.avg_layers) == (5, 2, 12, L, 5.0)
    assert s.error_kinds == {"input": 1, "machine": 1}
    assert s.generate_s() == 4.0 and s.tokens_per_s() == 3.0  # 12 tokens from t=100 to t=104
    assert s.tokens_per_s(now=106.0) == 2.0
    assert RowStats().tokens_per_s() is None


def test_store_retunes_every_n_tokens_and_versions_only_changes():
    store = ScheduleStore({"num_layers": 4, "offline_layers": [3], "version": 0}, retune_every_tokens=10)
    assert store.latest(None)["offline_layers"] == [3] and store.latest(0) is None
    assert store.report(0, 2, 6, 24.0, [6, 0, 0, 0]) == 0  # 6 tokens: not yet
    assert store.report(0, 2, 6, 24.0, [4, 0, 0, 2]) == 1  # 12 >= 10: the rule picks layer 1
    assert store.latest(0)["offline_layers"] == [1] and store.latest(1) is None
    assert store.report(1, 1, 10, 10.0, [10, 0, 0, 0]) == 1  # re-tuned again, same layers: no new version
    assert store.report(1, 1, 10, 40.0, [0, 0, 0, 10]) == 1  # no early exit at all: kept
    assert store.report(None, 1, 0, 0.0, None) == 1  # a batch of error rows carries no histogram
    state = store.state()
    assert [v["version"] for v in state["versions"]] == [0, 1] and state["retunes"] == 3
    assert [v["offline_layers"] for v in store.since(0)] == [[1]] and store.since(1) == []
    per = {v["schedule_version"]: v for v in state["per_version"]}
    assert per[0]["rows"] == 4 and per[0]["tokens"] == 12 and per[0]["avg_layers"] == 4.0
    assert per[1]["tokens"] == 20 and per[None]["rows"] == 1
    with pytest.raises(ValueError, match="bins"):
        store.report(1, 1, 1, 1.0, [1, 2, 3])
    assert ScheduleStore(None).report(None, 3, 9, 9.0, None) is None  # dense: statistics only


def test_store_walks_a_wrong_schedule_to_the_profile():
    """The store with a simulated engine. A token that could exit at layer t (60% at 2, 30% at 3,
    10% at 5: the profile picks [2, 3]) exits at the first active layer >= t, active = predictor
    layers and their neighbours (the online level explores) and the last layer. The histogram a
    wrong schedule produces is biased towards it; re-tuning still walks to the profile:
    [5, 7] -> [4, 5] -> [3, 5] -> [2, 3]."""
    store = ScheduleStore(asdict_schedule([5, 7]), retune_every_tokens=100)
    for _ in range(5):
        current = Schedule(**store.latest(None))
        active = {l + o for l in current.offline_layers for o in (-1, 0, 1)} | {L}
        hist = [0] * L
        for t, count in ((2, 60), (3, 30), (5, 10)):
            hist[min(l for l in active if l >= t) - 1] += count
        store.report(current.version, 1, 100, 300.0, hist)
    walk = [v["offline_layers"] for v in store.state()["versions"]]
    assert walk == [[5, 7], [4, 5], [3, 5], [2, 3]]


def asdict_schedule(layers: list[int]) -> dict:
    from dataclasses import asdict

    return asdict(Schedule(num_layers=L, offline_layers=layers))


def test_done_ids():
    done = DoneIds.of([pa.chunked_array([["a", "b"]]), pa.chunked_array([["c", "a"]]), pa.chunked_array([[]], pa.string())])
    assert len(done) == 3 and "a" in done and "x" not in done
    assert done.mask(["c", "x", "b", "é"]).tolist() == [True, False, True, False]
    assert DoneIds.of([]).mask(["a"]).tolist() == [False] and "a" not in DoneIds.of([])
    ids = [f"file.jsonl:{i}" for i in range(5000)]
    big = DoneIds.of([pa.chunked_array([ids[::2]])])
    assert big.mask(ids).tolist() == [i % 2 == 0 for i in range(5000)]
    assert big.digests.nbytes == 16 * 2500


def test_output_reads_back_with_pandas_and_part_files_are_durable(tmp_path, monkeypatch):
    out = OutputDir(tmp_path, tag="run-b")
    out.prepare()
    table = pa.Table.from_pylist([{"id": "a", "mode": "dense"}, {"id": "b", "mode": "dense"}], schema=OUTPUT_SCHEMA)
    synced = []
    real_fsync = __import__("os").fsync
    monkeypatch.setattr("os.fsync", lambda fd: synced.append(fd) or real_fsync(fd))
    out.write_part(table, "part-r-00000.parquet")
    assert len(synced) == 2  # the file, then its folder (the rename)
    (tmp_path / ".part-r-00001.parquet.run-a.tmp").write_bytes(b"half a file")  # a crashed job's, mid-write
    (tmp_path / ".part-r-00002.parquet.run-b.tmp").write_bytes(b"this job's")
    out.save_schedule(Schedule(num_layers=L, offline_layers=[2], version=3))
    out.write_summary({"rows": 2})
    (tmp_path / "_exit_layers.png").write_bytes(b"\x89PNG")
    assert sorted(pd.read_parquet(tmp_path)["id"]) == ["a", "b"]  # metadata and temp files are skipped
    assert "a" in out.index().done_ids() and len(out.index()) == 2
    assert out.latest_schedule().version == 3 and json.loads(out.summary.read_text()) == {"rows": 2}
    out.remove_temps()  # another job's temporary files go, this job's stay
    assert sorted(p.name for p in tmp_path.glob(".*")) == [".part-r-00002.parquet.run-b.tmp"]
    assert len(out.part_files()) == 1
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "parts").mkdir()
    with pytest.raises(ValueError, match="earlier version"):
        OutputDir(tmp_path / "old").prepare()


def part(out: OutputDir, name: str, ids: list[str], errors: dict | None = None, hashes: dict | None = None):
    errors, hashes = errors or {}, hashes or {}
    return out.write_part(pa.Table.from_pylist(
        [{"id": i, "completion": i.upper(), "error": errors.get(i), "request_hash": hashes.get(i, f"{k:032x}")}
         for k, i in enumerate(ids)], schema=OUTPUT_SCHEMA), name)


def test_an_unreadable_part_file_is_set_aside_and_its_rows_count_as_not_written(tmp_path, caplog):
    out = OutputDir(tmp_path)
    good = part(out, "part-r-00000.parquet", ["a", "b"])
    cut = part(out, "part-r-00001.parquet", ["c"])
    flipped = part(out, "part-r-00002.parquet", ["d", "e"])
    cut.write_bytes(cut.read_bytes()[:-30])  # the footer lost
    data = bytearray(flipped.read_bytes())
    at = data.index(b"D")  # a value of the completion column: a plain read returns "E"; the page checksum tells
    data[at] ^= 0x01
    flipped.write_bytes(bytes(data))
    index = out.index()
    assert sorted(p.name for p in out.set_aside_files) == ["_part-r-00001.parquet.corrupt",
                                                          "_part-r-00002.parquet.corrupt"]
    assert "cannot be read" in caplog.text and "_part-r-00001.parquet.corrupt" in caplog.text
    assert out.part_files() == [good] and len(index) == 2 and list(index.find(["a", "c", "d"]) >= 0) == [True, False, False]
    assert sorted(pd.read_parquet(tmp_path)["id"]) == ["a", "b"]  # the set-aside files are skipped


def test_rows_replaced_leave_each_id_once(tmp_path):
    out = OutputDir(tmp_path)
    first = part(out, "part-r-00000.parquet", ["a", "b", "c"], errors={"b": "PromptError: x"})
    second = part(out, "part-r-00001.parquet", ["d"])
    third = part(out, "part-r-00002.parquet", ["a", "e"])  # "a" again: a folder written before ids were unique
    index = out.index()
    assert len(index) == 5 and index.duplicates == {third: {0}}
    at = index.find(["b", "d", "zz"])
    assert at[2] == -1 and index.errors[at[0]] and not index.errors[at[1]]
    rows = index.rows_at(at[:2])
    assert rows == {first: {1}, second: {0}}
    rows[third] = index.duplicates[third]
    assert out.drop_rows(rows) == 3
    assert not second.exists()  # no row left: removed
    assert sorted(pd.read_parquet(tmp_path)["id"]) == ["a", "c", "e"]
    assert pq_ids(first) == ["a", "c"] and pq_ids(third) == ["e"] and not list(tmp_path.glob(".*"))
    assert sorted(index.done_ids(without=at[:2]).mask(["a", "b", "d", "e"]).tolist()) == [False, False, True, True]


def pq_ids(path: Path) -> list[str]:
    import pyarrow.parquet as pq

    return pq.read_table(path, columns=["id"])["id"].to_pylist()


class FakeDataset:
    """ray.data.Dataset's iter_batches over PROMPT_SCHEMA blocks."""

    def __init__(self, *blocks: list[dict]):
        self.blocks = [to_prompt_table(b, "f.jsonl", 0) for b in blocks]

    def iter_batches(self, **kw):
        return iter(self.blocks)


def test_resume_plan_regenerates_changed_requests_and_retried_errors(tmp_path):
    prompts = {"a": "x", "b": "y", "c": "z"}
    out = OutputDir(tmp_path)
    hashes = {i: to_prompt_table([{"prompt": p}], "f", 0)["request_hash"][0].as_py() for i, p in prompts.items()}
    part(out, "part-r-00000.parquet", ["a", "b", "c"], errors={"c": "WorkerDied: x"}, hashes=hashes)
    index = out.index()
    inputs = FakeDataset([{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y, edited"}],
                         [{"id": "c", "prompt": "z"}, {"id": "new", "prompt": "w"}])
    plan = plan_resume(inputs, index, retry_errors=False)
    assert (plan.total, plan.changed, plan.errors) == (2, 1, 0)  # new, and b (its prompt changed)
    assert index.rows_at(plan.replace) == {out.part_files()[0]: {1}}
    retry = plan_resume(inputs, index, retry_errors=True)
    assert (retry.total, retry.changed, retry.errors) == (3, 1, 1)
    assert index.rows_at(retry.replace) == {out.part_files()[0]: {1, 2}}
    sampled = FakeDataset([{"id": "a", "prompt": "x", "max_tokens": 3}])  # the row's own sampling changed
    assert plan_resume(sampled, index, retry_errors=False).changed == 1


def test_duplicate_input_ids_stop_the_job_naming_them(tmp_path):
    inputs = FakeDataset([{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"}],
                         [{"id": "a", "prompt": "z"}, {"id": "c", "prompt": "w"}, {"id": "c", "prompt": "v"}])
    with pytest.raises(ValueError, match=r"the input holds 2 id\(s\) more than once, e.g. 'a', 'c'"):
        plan_resume(inputs, OutputDir(tmp_path).index(), retry_errors=False)


def manifest_of(tmp_path: Path, model: Path, **stage) -> dict:
    from pipeline.manifest import job_manifest

    (tmp_path / "in").mkdir(exist_ok=True)
    (tmp_path / "in" / "p.jsonl").write_text('{"prompt": "x"}\n')
    return job_manifest(StageConfig(model=str(model), **stage), [str(tmp_path / "in" / "p.jsonl")],
                        input_format=None, prompt_column="prompt", id_column="id", run_id="r")


def test_manifest_names_the_differences_and_overwrite_keeps_the_old_one(tmp_path, monkeypatch):
    from pipeline.manifest import MANIFEST, check_manifest

    monkeypatch.setenv("SPECEE_CACHE", str(tmp_path / "cache"))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"weights")
    folder = tmp_path / "out"
    folder.mkdir()
    old = manifest_of(tmp_path, model, max_new_tokens=64, mode="dense")
    assert old["input_files"] == ["p.jsonl"] and set(old["model_files"]) == {"config.json", "model.safetensors"}
    assert check_manifest(folder, old, has_rows=False, overwrite=False) == {**old, "earlier": []}
    (folder / MANIFEST).write_text(json.dumps(old))
    same = manifest_of(tmp_path, model, max_new_tokens=64, mode="dense")
    assert check_manifest(folder, same, has_rows=True, overwrite=False)["written_by"] == same["written_by"]
    new = manifest_of(tmp_path, model, max_new_tokens=32, mode="dense")
    with pytest.raises(ValueError) as e:
        check_manifest(folder, new, has_rows=True, overwrite=False)
    assert str(e.value) == (f"output folder {folder} was written with max_new_tokens=64; this job has "
                            f"max_new_tokens=32; pass --overwrite-config (BatchConfig.overwrite_config) to write "
                            f"into it anyway")
    (model / "model.safetensors").write_bytes(b"other w")  # same size: the content tells
    with pytest.raises(ValueError, match="model file model.safetensors=sha256:[0-9a-f]{12}; this job has max_new"):
        check_manifest(folder, manifest_of(tmp_path, model, max_new_tokens=32, mode="dense"), has_rows=True,
                       overwrite=False)
    kept = check_manifest(folder, new, has_rows=True, overwrite=True)
    assert kept["sampling"]["max_new_tokens"] == 32 and kept["earlier"][0]["sampling"]["max_new_tokens"] == 64
    assert check_manifest(folder, new, has_rows=False, overwrite=False)["sampling"]["max_new_tokens"] == 32
    (folder / MANIFEST).unlink()
    with pytest.raises(ValueError, match="has part files but no _specee_manifest.json"):
        check_manifest(folder, new, has_rows=True, overwrite=True)


def test_weight_hashes_are_of_the_content_and_cached(tmp_path):
    import os

    from pipeline.manifest import model_files_sha256

    (tmp_path / "m" / "draft").mkdir(parents=True)
    (tmp_path / "m" / ".git").mkdir()
    for name, data in (("config.json", b"{}"), ("model.safetensors", b"aaaa"), ("draft/model.safetensors", b"bbbb"),
                       ("tokenizer.json", b"{}"), ("README.md", b"x"), (".git/old.bin", b"x")):
        (tmp_path / "m" / name).write_bytes(data)
    cache = tmp_path / "cache.json"
    first = model_files_sha256(tmp_path / "m", cache=cache)
    assert set(first) == {"config.json", "tokenizer.json", "model.safetensors", "draft/model.safetensors"}
    assert first["model.safetensors"] != first["draft/model.safetensors"]  # same size, other content
    weights = tmp_path / "m" / "model.safetensors"
    st = weights.stat()
    weights.write_bytes(b"cccc")
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert model_files_sha256(tmp_path / "m", cache=cache) == first  # same path, size, mtime: from the cache
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert model_files_sha256(tmp_path / "m", cache=cache)["model.safetensors"] != first["model.safetensors"]


def test_config_validation(tmp_path):
    with pytest.raises(ValueError, match="mode must be one of auto, dense, specee, spec"):
        StageConfig(model="m", mode="fast")
    with pytest.raises(ValueError, match="unknown dtype 'fp8': expected one of auto, float32, bfloat16, float16"):
        StageConfig(model="m", dtype="fp8")
    assert (StageConfig(model="m").mode, StageConfig(model="m").dtype) == ("auto", "auto")
    assert StageConfig(model="m", mode="spec", spec={"proposer": "lookup", "depth": 2}).spec["depth"] == 2
    with pytest.raises(ValueError, match="apply to mode='spec' or 'auto' only"):
        StageConfig(model="m", mode="dense", spec={"depth": 2})
    with pytest.raises(ValueError, match="depth"):
        StageConfig(model="m", mode="spec", spec={"depth": 0})
    stage = StageConfig(model="m")
    with pytest.raises(ValueError, match="retune_every_tokens"):
        BatchConfig(input=["x"], output=str(tmp_path), stage=stage, retune_every_tokens=0)
    with pytest.raises(ValueError, match="schedule only applies"):
        BatchConfig(input=["x"], output=str(tmp_path), stage=stage, schedule="s.json")
    assert not BatchConfig(input=["x"], output=str(tmp_path), stage=stage).retry_errors
    with pytest.raises(ValueError, match="local or mounted"):
        OutputDir("s3://bucket/out")


def test_sample_prompts_are_bundled_and_reproducible(tmp_path):
    from tools.make_prompts import PromptsConfig, build

    bundled = [json.loads(line) for line in (REPO / "prompts" / "sample_prompts.jsonl").read_text().splitlines()]
    assert len(bundled) == 300 and len({r["id"] for r in bundled}) == 300
    assert all(isinstance(r["prompt"], str) and 3 <= r["prompt"].count("\n") <= 8 for r in bundled)
    small = build(PromptsConfig(out=tmp_path / "p.jsonl", count=5))
    again = build(PromptsConfig(out=tmp_path / "q.jsonl", count=5))
    assert small == again and (tmp_path / "p.jsonl").read_bytes() == (tmp_path / "q.jsonl").read_bytes()


def test_cluster_yaml_passes_the_launcher_schema():
    import yaml
    from ray.autoscaler._private.util import prepare_config, validate_config

    cfg = prepare_config(yaml.safe_load((REPO / "cluster.yaml").read_text()))  # what `ray up` does first
    validate_config(cfg)
    workers = cfg["available_node_types"]["gpu_worker"]
    assert workers["min_workers"] == 0 and workers["max_workers"] >= 1
    assert any("pip install -q -e ~/specee" in c for c in cfg["worker_setup_commands"])


def test_the_job_is_lossless_by_default_even_with_predictors(tmp_path):
    from jobs.generate import build_config, parse_args

    (tmp_path / "predictors.safetensors").write_bytes(b"")
    args = parse_args(["--output", str(tmp_path / "out"), "--model", str(tmp_path)])
    cfg = build_config(args)
    assert (cfg.stage.mode, cfg.stage.dtype, cfg.stage.engine_options) == ("auto", "auto", {})
    assert (cfg.retry_errors, cfg.overwrite_config) == (False, False)
    again = build_config(parse_args(["--output", "o", "--model", str(tmp_path), "--retry-errors", "--overwrite-config"]))
    assert (again.retry_errors, again.overwrite_config) == (True, True)
    specee = build_config(parse_args(["--output", "o", "--model", str(tmp_path), "--mode", "specee"]))
    assert specee.stage.mode == "specee" and specee.stage.engine_options == {"explore_every": 8}
    assert parse_args(["--output", "o"]).input == [str(REPO / "prompts" / "instructions_heldout.jsonl")]


def test_the_jobs_kv_budget_and_prefix_cache_reach_each_engine(tmp_path):
    from jobs.generate import build_config, parse_args
    from pipeline.batch import processor_config
    from pipeline.stage import GenerateRows
    from tests.conftest import BUNDLED

    cfg = build_config(parse_args(["--output", str(tmp_path / "out"), "--model", str(BUNDLED), "--mode", "dense",
                                   "--kv-cache-gb", "0.05", "--no-prefix-cache", "--num-actors", "3",
                                   "--max-concurrent-batches", "3"]))
    processor = processor_config(cfg, OutputDir(cfg.output), None)
    stage = processor.stage()
    assert (stage.kv_cache_gb, stage.prefix_cache, stage.engines_per_node) == (0.05, False, 3)
    compute = processor.compute()  # three calls at once per actor, on threads, and no more sent to it
    assert (compute.max_concurrent_calls_per_actor, compute.max_tasks_in_flight_per_actor) == (3, 3)
    assert compute.enable_true_multi_threading and stage.max_concurrent_batches == 3
    core = GenerateRows(stage, "run-1").engine.core
    assert core.prefix is None
    assert core.budget.capacity == int(0.05 * 2**30) // core.budget.block_bytes
    assert core.min_lane_rows == core.max_rows == 16  # a lane has room for the next batches' rows
    alone = GenerateRows(StageConfig(model=str(BUNDLED), mode="dense", max_concurrent_batches=1), "run-2").engine.core
    assert alone.prefix is not None and alone.min_lane_rows == 1  # one call at a time: lanes sized to its rows
    with pytest.raises(ValueError, match="max_concurrent_batches must be an int >= 1, got 0"):
        StageConfig(model="m", max_concurrent_batches=0)


@pytest.mark.parametrize("flag, value, choices", [("--mode", "fast", "'auto', 'dense', 'spec', 'specee'"),
                                                  ("--dtype", "fp8", "'auto', 'float32', 'bfloat16', 'float16'")])
def test_a_bad_mode_or_dtype_names_the_choices(flag, value, choices, capsys):
    from jobs.generate import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--output", "o", flag, value])
    assert f"invalid choice: '{value}' (choose from {choices})" in capsys.readouterr().err


class FakeEngine:
    """SpecEEEngine's public surface as the stage uses it, with a schedule and retune histograms."""

    def __init__(self, num_layers: int = 4):
        from types import SimpleNamespace

        self.config = SimpleNamespace(num_hidden_layers=num_layers)
        self.schedule = Schedule(num_layers=num_layers, offline_layers=[3], version=0)
        self.calls = []
        self.has_chat_template = False

    def set_schedule(self, schedule: Schedule) -> None:
        self.schedule = schedule

    def stepper_factory(self, mode: str, spec: dict | None):
        return None, 0

    def encode_prompt(self, prompt) -> list[int]:
        from specee_core import PromptError

        if not prompt:
            raise PromptError("prompt is empty")
        return [1] * len(prompt)

    def submit(self, prompts: list[str], **kw) -> Future:
        out = Future()
        try:
            out.set_result(self.generate(prompts, **kw))
        except Exception as e:  # noqa: BLE001 -- the engine's Future carries the error
            out.set_exception(e)
        return out

    def generate(self, prompts: list[str], **kw):
        from specee_core import GenerationResult

        self.calls.append((list(prompts), kw))
        if "poison" in prompts and len(prompts) > 1:
            raise RuntimeError("CUDA error: something broke")
        if prompts == ["poison"]:
            raise RuntimeError("still broken")
        n = self.config.num_hidden_layers
        return [GenerationResult(text=p.upper(), token_ids=[5, 6], finish_reason="length", exit_layers=[1, n],
                                 prompt_tokens=len(p), metrics={"e2e_latency_s": 0.5, "ttft_s": 0.1,
                                                                "tokens_per_s": 4.0},
                                 stats={"avg_layers": (1 + n) / 2, "retune_histogram": [1, 0, 0, 1]})
                for p in prompts]


def test_stage_uses_its_schedule_and_isolates_failing_rows(monkeypatch, tmp_path):
    """GenerateRows in-process with a fake engine: the given schedule is set on the engine, rows
    carry its version, the retune histogram and their batch's columns, a prompt the engine rejects
    and a prompt that breaks its batch each cost one row."""
    from pipeline.stage import GenerateRows

    engine = FakeEngine()
    monkeypatch.setattr("pipeline.stage.SpecEEEngine.from_pretrained", lambda *a, **kw: engine)
    schedule = Schedule(num_layers=4, offline_layers=[1, 2], version=7)
    stage = GenerateRows(StageConfig(model=str(tmp_path), mode="specee", max_new_tokens=2), "run-1", schedule=schedule)
    assert engine.schedule is schedule
    batch = pa.table({"id": ["a", "b", "c", "d", "e"], "prompt": ["x", "", None, "poison", "yz"],
                      "input_error": [None, None, "prompt must be a string, got int", None, None]})
    out = stage(batch)
    assert out.schema == ROW_SCHEMA
    rows = {r["id"]: r for r in out.to_pylist()}
    assert rows["a"]["completion"] == "X" and rows["e"]["completion"] == "YZ"
    assert rows["a"]["schedule_version"] == 7 and rows["a"]["mode"] == "specee" and rows["a"]["run_id"] == "run-1"
    assert rows["a"]["retune_histogram"] == [1, 0, 0, 1] and rows["a"]["exit_layers"] == [1, 4]
    assert rows["a"]["avg_layers"] == 2.5 and rows["a"]["completion_tokens"] == 2 and rows["a"]["latency_s"] == 0.5
    assert rows["a"]["ttft_s"] == 0.1
    assert rows["b"]["error"] == "PromptError: prompt is empty"
    assert rows["c"]["error"] == "InputError: prompt must be a string, got int"
    assert rows["d"]["error"] == "RuntimeError: still broken" and rows["d"]["completion"] is None
    assert [rows[i]["error_kind"] for i in "abcde"] == [None, "input", "input", "input", None]
    assert all(rows[i]["error"] is None for i in "ae")
    with pytest.raises(FileNotFoundError, match=f"{tmp_path / 'elsewhere'}: no such model directory on node "):
        GenerateRows(StageConfig(model=str(tmp_path / "elsewhere"), mode="dense"), "run-1")
    assert {r["batch_id"] for r in rows.values()} == {f"local:{__import__('os').getpid()}-1"}
    assert {r["batch_rows"] for r in rows.values()} == {5} and rows["b"]["batch_s"] == rows["a"]["batch_s"] > 0
    assert rows["d"]["schedule_version"] == 7 and rows["d"]["run_id"] == "run-1"  # error rows keep the context
    assert engine.calls[0][0] == ["x", "poison", "yz"] and engine.calls[0][1]["mode"] == "specee"
    assert [p.max_new_tokens for p in engine.calls[0][1]["sampling_params"]] == [2, 2, 2]
    assert stage(batch.slice(0, 1)).to_pylist()[0]["batch_id"].endswith("-2")
    died = stage.error_rows(batch.slice(0, 1), "WorkerDied: x").to_pylist()[0]  # a row that kept killing its actor
    assert (died["error"], died["error_kind"]) == ("WorkerDied: x", "machine")


def test_error_kind_tells_the_machines_fault_from_the_rows():
    import torch

    from pipeline.stage import error_kind

    assert error_kind(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")) == "machine"
    assert error_kind(RuntimeError("CUDA error: an illegal memory access was encountered")) == "machine"
    assert error_kind(MemoryError()) == "machine"
    assert error_kind(ValueError("unsupported JSON schema keyword")) == "input"


def test_stage_runs_prompts_through_the_chat_template(tmp_path):
    """A model with a chat template: each row's prompt is the user's message (chat=None means auto);
    the row keeps the raw prompt, the completion is what the engine answers to the rendered chat."""
    import json

    from pipeline.stage import GenerateRows
    from specee_core import SpecEEEngine
    from tests.conftest import make_hf_model

    make_hf_model(tmp_path, layers=2, hidden=64, heads=4, kv_heads=2)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    template = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": template}))
    stage = GenerateRows(StageConfig(model=str(tmp_path), max_new_tokens=6, dtype="float32"), "run-1")
    assert stage.chat
    batch = pa.table({"id": ["a", "b"], "prompt": ["Reverse a string.", ""], "input_error": [None, None]})
    rows = {r["id"]: r for r in stage(batch).to_pylist()}
    engine = SpecEEEngine.from_pretrained(tmp_path, dtype="float32")
    rendered = engine.chat_prompt([{"role": "user", "content": "Reverse a string."}])
    assert rendered.startswith("<|user|>\nReverse a string.") and rendered.endswith("<|assistant|>\n")
    expect = engine.generate([rendered], max_new_tokens=6, mode="dense")[0]
    assert rows["a"]["prompt"] == "Reverse a string." and rows["a"]["completion"] == expect.text
    assert rows["a"]["prompt_tokens"] == len(engine.encode_prompt(rendered))
    assert rows["b"]["error"].startswith("PromptError")
    plain = GenerateRows(StageConfig(model=str(tmp_path), max_new_tokens=6, chat=False, dtype="float32"), "run-2")
    assert plain(batch).to_pylist()[0]["prompt_tokens"] == len(engine.encode_prompt("Reverse a string."))


def test_the_engine_gate_drains_the_batches_in_flight_before_exclusive_work():
    """Exclusive work (a new schedule, a failed call's rows alone) waits for the shared users in flight, new
    shared users wait behind it, and on_idle runs whenever the last user leaves."""
    from pipeline.inflight import EngineGate

    idle = []
    gate = EngineGate(on_idle=lambda: idle.append(time.monotonic()))
    order: list[str] = []
    first_in, second_queued = threading.Event(), threading.Event()

    def exclusive() -> None:
        with gate.exclusive():
            order.append("exclusive")

    def late_shared() -> None:
        second_queued.set()
        with gate.shared():
            order.append("late shared")

    with gate.shared():
        with gate.shared():
            assert gate.peak == 2
        first_in.set()
        ex = threading.Thread(target=exclusive)
        ex.start()
        while not gate._queued:  # the exclusive user is waiting for this shared one
            time.sleep(0.001)
        late = threading.Thread(target=late_shared)
        late.start()
        second_queued.wait()
        time.sleep(0.05)
        order.append("shared leaves")
    ex.join(5)
    late.join(5)
    assert order == ["shared leaves", "exclusive", "late shared"]
    assert len(idle) == 3  # after the shared users, after the exclusive one, after the late one


def test_plan_steps_count_each_lanes_running_totals_once():
    """Results carry their lane planner's running totals when the row finished; a lane shared by two calls must
    count once, by its latest totals, whatever order the results come back in; lanes folded when idle stay counted."""
    from types import SimpleNamespace

    from pipeline.inflight import PlanSteps

    def res(lane, dense, depth2):
        return SimpleNamespace(stats={"lane": lane, "plan_steps": {"dense": dense, "depth_2": depth2}})

    steps = PlanSteps()
    steps.add([res(7, 10, 4), res(7, 12, 5)])  # call A's rows in lane 7
    steps.add([res(7, 15, 9), res(8, 3, 0), SimpleNamespace(stats={"avg_layers": 4})])  # call B: lane 7 again, and 8
    steps.add([res(7, 11, 5)])  # a row of lane 7 that finished earlier, returned late
    assert steps.totals() == {"dense": 18, "depth_2": 9}
    steps.fold()  # idle: lanes 7 and 8 ended
    steps.add([res(9, 2, 1)])
    assert steps.totals() == {"dense": 20, "depth_2": 10}


def hold_first_decoding_step(core) -> threading.Event:
    """The engine's thread holds on after its first step with rows decoding until the next request is submitted, so
    that a second call comes while the first decodes however fast the first would end. Returns the event that step
    sets."""
    decoding, next_in = threading.Event(), threading.Event()
    step, submit = core.step, core.submit

    def held_step():
        ended = step()
        if core.load[0] and not decoding.is_set():
            decoding.set()
            next_in.wait(60)
        return ended

    def noted_submit(request):
        try:
            return submit(request)
        finally:  # refused too: the call came
            if decoding.is_set():
                next_in.set()

    core.step, core.submit = held_step, noted_submit
    return decoding


def test_batches_in_flight_share_the_engines_steps_and_count_them_once():
    """Two calls of the stage at once (two threads; the second while the first decodes) on the real engine in mode
    auto with a plan that drafts: the second call's rows join the first's lane and return first, every row is what
    dense decoding answers (fp32, greedy: auto is lossless), and the planner's steps are counted once per lane
    (summed per call, the lane both calls shared would count twice)."""
    from pipeline.stage import GenerateRows
    from specee_core import SpecEEEngine
    from tests.conftest import BUNDLED, drafting_plan

    stage = GenerateRows(StageConfig(model=str(BUNDLED), mode="auto", dtype="float32", batch_size=8,
                                     max_concurrent_batches=2), "run-1")
    prompts = ["def add(a, b):\n", "import os\n", "class Point:\n", "for i in range(10):\n", "x = [1, 2, 3]\n",
               "with open(path) as f:\n", "return sorted(", "try:\n    import json\n"]

    def batch(ids: list[int], tokens: int) -> pa.Table:
        own = json.dumps({"max_tokens": tokens, "ignore_eos": True})
        return pa.table({"id": [f"r{i}" for i in ids], "prompt": [prompts[i] for i in ids],
                         "input_error": [None] * len(ids), "_sampling": [own] * len(ids)})

    out = {}
    decoding = hold_first_decoding_step(stage.engine.core)
    with drafting_plan(stage.engine):
        first = threading.Thread(target=lambda: out.update(a=stage(batch([0, 1, 2, 3], 40))))
        first.start()
        assert decoding.wait(60), "the first call's rows never decoded"
        out["b"] = stage(batch([4, 5, 6, 7], 8))
        running_then = stage.engine.core.load[0]
        first.join(60)
    a, b = out["a"].to_pylist(), out["b"].to_pylist()
    assert running_then > 0 and stage.gate.peak == 2  # the first call still decoding when the second returned
    assert b[0]["batch_started_at"] > a[0]["batch_started_at"]
    assert b[0]["batch_started_at"] + b[0]["batch_s"] < a[0]["batch_started_at"] + a[0]["batch_s"]
    assert all(r["error"] is None for r in a + b) and len({r["batch_id"] for r in a + b}) == 2
    engine = SpecEEEngine.from_pretrained(BUNDLED, dtype="float32")
    for rows, tokens in ((a, 40), (b, 8)):
        dense = engine.generate([r["prompt"] for r in rows], max_new_tokens=tokens, ignore_eos=True, mode="dense")
        assert [r["completion"] for r in rows] == [d.text for d in dense]
    chosen = stage.describe()["plan"]["steps_chosen"]
    assert chosen.get("depth_1", 0) + chosen.get("depth_2", 0) + chosen.get("depth_3", 0) + \
        chosen.get("depth_4", 0) > 0  # the plan drafted: its counts are what is checked
    # one lane from the engine's first iteration to its last, decoding in each: its planner chose a step per
    # iteration (per call, its running totals would count the steps both calls shared twice, or a call's last row's
    # totals instead of the lane's)
    assert sum(chosen.values()) == stage.engine.core.steps


def test_a_call_that_raises_reruns_its_rows_alone_once_the_calls_in_flight_are_done():
    """A call whose engine submission raises (a row's logit_bias names a token outside the vocabulary) while another
    call decodes: its rows run again one at a time once the other call is done (nothing beside them, so a row
    cannot fail for a neighbour), the bad row becomes its own error row, every other row is dense's answer."""
    from pipeline.stage import GenerateRows
    from specee_core import SpecEEEngine
    from tests.conftest import BUNDLED, CODE_PROMPTS

    stage = GenerateRows(StageConfig(model=str(BUNDLED), mode="dense", dtype="float32", batch_size=8, max_new_tokens=4,
                                     max_concurrent_batches=2), "run-1")
    long = json.dumps({"max_tokens": 40, "ignore_eos": True})
    bad = json.dumps({"max_tokens": 4, "logit_bias": {str(10**7): 1.0}})
    first = pa.table({"id": ["a0", "a1"], "prompt": CODE_PROMPTS[:2], "input_error": [None] * 2,
                      "_sampling": [long] * 2})
    second = pa.table({"id": ["b0", "bad", "b1"], "prompt": CODE_PROMPTS[2:5], "input_error": [None] * 3,
                       "_sampling": [None, bad, None]})
    out = {}
    thread = threading.Thread(target=lambda: out.update(a=stage(first)))
    decoding = hold_first_decoding_step(stage.engine.core)
    thread.start()
    assert decoding.wait(60), "the first call's rows never decoded"
    b = {r["id"]: r for r in stage(second).to_pylist()}
    thread.join(60)
    a = out["a"].to_pylist()
    assert b["bad"]["error"].startswith("ValueError: token ids [10000000]") and b["bad"]["error_kind"] == "input"
    # 4 tokens beside 40 would end first: alone, they waited for the first call to end
    assert b["b0"]["batch_started_at"] + b["b0"]["batch_s"] > a[0]["batch_started_at"] + a[0]["batch_s"]
    engine = SpecEEEngine.from_pretrained(BUNDLED, dtype="float32")
    assert [r["completion"] for r in a] == [d.text for d in engine.generate(CODE_PROMPTS[:2], max_new_tokens=40,
                                                                            ignore_eos=True, mode="dense")]
    dense = engine.generate([CODE_PROMPTS[2], CODE_PROMPTS[4]], max_new_tokens=stage.cfg.max_new_tokens, mode="dense")
    assert [b["b0"]["completion"], b["b1"]["completion"]] == [d.text for d in dense]
