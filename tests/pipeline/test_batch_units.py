"""Pieces of the batch pipeline that need no Ray cluster: prompt rows, wave assignment, the
driver's re-tune loop fed with synthetic histograms, output files, sample prompts."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest

from pipeline.batch import BatchConfig, WaveStats, next_schedule, run_waves
from pipeline.output import OutputDir
from pipeline.prompts import PROMPT_SCHEMA, infer_format, to_prompt_table, wave_of
from pipeline.stage import OUTPUT_SCHEMA, StageConfig
from specee_core.scheduler import Schedule

REPO = Path(__file__).resolve().parents[2]
L = 8


def rows(hists: list[list[int] | None], errors: list[str | None] | None = None, tokens: int = 4) -> pa.Table:
    """Output rows carrying the given retune histograms (None: the row has none)."""
    errors = errors or [None] * len(hists)
    return pa.Table.from_pylist([
        {"id": f"r{i}", "completion_tokens": None if e else tokens, "avg_layers": None if e else 5.0,
         "num_layers": L, "retune_histogram": h, "error": e}
        for i, (h, e) in enumerate(zip(hists, errors))], schema=OUTPUT_SCHEMA)


def test_prompt_rows_get_stable_ids_and_input_errors():
    t = to_prompt_table([{"prompt": "a"}, {"id": 7, "prompt": "b"}, {"prompt": 3}, {"id": "x"},
                         {"__input_error": "invalid JSON"}, {"id": "", "prompt": ""}], "dir/f.jsonl", 10)
    assert t.schema == PROMPT_SCHEMA
    assert t["id"].to_pylist() == ["dir/f.jsonl:10", "7", "dir/f.jsonl:12", "x", "dir/f.jsonl:14", "dir/f.jsonl:15"]
    assert t["prompt"].to_pylist() == ["a", "b", None, None, None, ""]  # "" is the engine's to reject
    assert t["input_error"].to_pylist() == [None, None, "prompt must be a string, got int", "no 'prompt' value",
                                            "invalid JSON", None]


def test_waves_are_a_stable_hash_of_the_id():
    assert [wave_of(f"f.jsonl:{i}", 4) for i in range(6)] == [wave_of(f"f.jsonl:{i}", 4) for i in range(6)]
    assert wave_of("abc", 4) == 2  # crc32, not Python's per-process salted hash
    counts = [0] * 4
    for i in range(400):
        counts[wave_of(str(i), 4)] += 1
    assert min(counts) > 60


def test_infer_format(tmp_path):
    (tmp_path / "a.csv").write_text("prompt\nx\n")
    assert infer_format([str(tmp_path / "a.csv")]) == "csv"
    assert infer_format([str(tmp_path)]) == "csv"
    (tmp_path / "b.parquet").write_bytes(b"")
    with pytest.raises(ValueError, match="input format"):
        infer_format([str(tmp_path)])


def test_wave_stats_sum_histograms_of_good_rows_only():
    s = WaveStats()
    s.add(rows([[1, 2, 0, 0, 0, 0, 0, 1], None, [9, 9, 9, 9, 9, 9, 9, 9]], errors=[None, None, "PromptError: x"]))
    assert (s.rows, s.errors, s.completion_tokens, s.num_layers) == (3, 1, 8, L)
    assert s.retune_histogram == [1, 2, 0, 0, 0, 0, 0, 1]
    assert s.avg_layers == 5.0
    with pytest.raises(ValueError, match="bins"):
        s.add(rows([[1, 2, 3]]))


def test_next_schedule_keeps_the_schedule_without_histograms():
    sched = Schedule(num_layers=L, offline_layers=[6, 7])
    stats = WaveStats()
    stats.add(rows([None, None]))  # dense rows, or an engine that reports no retune histogram
    assert next_schedule(sched, stats) is sched
    stats = WaveStats()
    stats.add(rows([[0] * (L - 1) + [5]]))  # no early exit at all: too few to re-tune
    assert next_schedule(sched, stats) is sched


def test_retune_loop_moves_a_wrong_schedule_to_the_profile(tmp_path):
    """The driver's wave loop with a simulated engine. A token that could exit at layer t (60%
    at 2, 30% at 3, 10% at 5: the profile picks [2, 3]) exits at the first active layer >= t,
    active = predictor layers and their neighbours (the online level explores) and the last
    layer. The histogram a wrong schedule produces is biased towards it; re-tuning still walks
    to the profile: [5, 7] -> [4, 5] -> [3, 5] -> [2, 3]."""
    profile = [2, 3]
    out = OutputDir(tmp_path)
    out.prepare()

    def run_one(wave: int, schedule: Schedule) -> WaveStats:
        active = {l + o for l in schedule.offline_layers for o in (-1, 0, 1)} | {L}
        hist = [0] * L
        for t, count in ((2, 60), (3, 30), (5, 10)):
            hist[min(l for l in active if l >= t) - 1] += count
        stats = WaveStats()
        stats.add(rows([hist]))
        return stats

    wrong = Schedule(num_layers=L, offline_layers=[5, 7], version=0)
    waves, final = run_waves(4, wrong, out, 1, run_one)
    assert [w.schedule_version for w in waves] == [0, 1, 2, 3]
    assert final.version == 3 and final.offline_layers == profile
    saved = sorted(p.name for p in out.schedules.glob("v*.json"))
    assert saved == ["v1.json", "v2.json", "v3.json"]  # v0 is the caller's (run() saves the initial one)
    assert Schedule.load(out.schedules / "v3.json").offline_layers == profile
    distances = [len(set(Schedule.load(out.schedule_path(v)).offline_layers) ^ set(profile)) for v in (1, 2, 3)]
    assert distances[-1] == 0 and distances == sorted(distances, reverse=True)


def test_dense_loop_has_no_schedule(tmp_path):
    out = OutputDir(tmp_path)
    waves, final = run_waves(3, None, out, 1, lambda w, s: WaveStats(rows=1))
    assert final is None and [w.schedule_version for w in waves] == [None] * 3
    assert not out.schedules.exists()


def test_part_files_are_atomic_and_tmp_files_ignored(tmp_path):
    out = OutputDir(tmp_path)
    out.prepare()
    table = pa.Table.from_pylist([{"id": "a", "mode": "dense"}, {"id": "b", "mode": "dense"}], schema=OUTPUT_SCHEMA)
    out.write_part(table, "part-r-w000-00000.parquet")
    (out.parts / ".part-r-w000-00001.parquet.tmp").write_bytes(b"half a file")  # a crash mid-write
    assert out.done_ids() == {"a", "b"}
    out.prepare()
    assert [p.name for p in out.parts.iterdir()] == ["part-r-w000-00000.parquet"]


def test_config_validation(tmp_path):
    with pytest.raises(ValueError, match="mode"):
        StageConfig(model="m", mode="fast")
    assert StageConfig(model="m", mode="spec", spec={"proposer": "lookup", "depth": 2}).spec["depth"] == 2
    with pytest.raises(ValueError, match="apply to mode='spec' only"):
        StageConfig(model="m", mode="dense", spec={"depth": 2})
    with pytest.raises(ValueError, match="depth"):
        StageConfig(model="m", mode="spec", spec={"depth": 0})
    stage = StageConfig(model="m")
    with pytest.raises(ValueError, match="waves"):
        BatchConfig(input=["x"], output=str(tmp_path), stage=stage, waves=0)
    with pytest.raises(ValueError, match="schedule only applies"):
        BatchConfig(input=["x"], output=str(tmp_path), stage=stage, schedule="s.json")
    with pytest.raises(ValueError, match="local or mounted"):
        OutputDir("s3://bucket/out")


def test_sample_prompts_are_bundled_and_reproducible(tmp_path):
    from jobs.make_prompts import PromptsConfig, build

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


def test_default_mode_follows_the_model(tmp_path):
    from jobs.generate import build_config, parse_args

    args = parse_args(["--output", str(tmp_path / "out"), "--model", str(tmp_path)])
    assert build_config(args).stage.mode == "dense"
    (tmp_path / "predictors.safetensors").write_bytes(b"")
    cfg = build_config(args)
    assert cfg.stage.mode == "specee" and cfg.stage.engine_options == {"explore_every": 8}
    assert parse_args(["--output", "o"]).input == [str(REPO / "prompts" / "instructions_heldout.jsonl")]


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

    def encode_prompt(self, prompt) -> list[int]:
        from specee_core import PromptError

        if not prompt:
            raise PromptError("prompt is empty")
        return [1] * len(prompt)

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


def test_stage_uses_the_wave_schedule_and_isolates_failing_rows(monkeypatch):
    """GenerateRows in-process with a fake engine: the wave's schedule is set on the engine, rows
    carry its version and the retune histogram, a prompt the engine rejects and a prompt that
    breaks its batch each cost one row."""
    from pipeline.stage import GenerateRows

    engine = FakeEngine()
    monkeypatch.setattr("pipeline.stage.SpecEEEngine.from_pretrained", lambda *a, **kw: engine)
    wave_schedule = Schedule(num_layers=4, offline_layers=[1, 2], version=7)
    stage = GenerateRows(StageConfig(model="m", mode="specee", max_new_tokens=2), wave_schedule, "run-1")
    assert engine.schedule is wave_schedule
    batch = pa.table({"id": ["a", "b", "c", "d", "e"], "prompt": ["x", "", None, "poison", "yz"],
                      "input_error": [None, None, "prompt must be a string, got int", None, None],
                      "wave": pa.array([1] * 5, pa.int32())})
    out = stage(batch)
    assert out.schema == OUTPUT_SCHEMA
    rows = {r["id"]: r for r in out.to_pylist()}
    assert rows["a"]["completion"] == "X" and rows["e"]["completion"] == "YZ"
    assert rows["a"]["schedule_version"] == 7 and rows["a"]["mode"] == "specee" and rows["a"]["run_id"] == "run-1"
    assert rows["a"]["retune_histogram"] == [1, 0, 0, 1] and rows["a"]["exit_layers"] == [1, 4]
    assert rows["a"]["avg_layers"] == 2.5 and rows["a"]["completion_tokens"] == 2 and rows["a"]["latency_s"] == 0.5
    assert rows["b"]["error"] == "PromptError: prompt is empty"
    assert rows["c"]["error"] == "InputError: prompt must be a string, got int"
    assert rows["d"]["error"] == "RuntimeError: still broken" and rows["d"]["completion"] is None
    assert all(rows[i]["error"] is None for i in "ae")
    assert engine.calls[0][0] == ["x", "poison", "yz"] and engine.calls[0][1]["mode"] == "specee"
    assert engine.calls[0][1]["max_new_tokens"] == 2

    stats = WaveStats()
    stats.add(out)
    assert (stats.rows, stats.errors, stats.retune_histogram) == (5, 3, [2, 0, 0, 2])
    assert next_schedule(wave_schedule, stats).version == 8


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
    stage = GenerateRows(StageConfig(model=str(tmp_path), max_new_tokens=6), None, "run-1")
    assert stage.chat
    batch = pa.table({"id": ["a", "b"], "prompt": ["Reverse a string.", ""], "input_error": [None, None],
                      "wave": pa.array([0, 0], pa.int32())})
    rows = {r["id"]: r for r in stage(batch).to_pylist()}
    engine = SpecEEEngine.from_pretrained(tmp_path)
    rendered = engine.chat_prompt([{"role": "user", "content": "Reverse a string."}])
    assert rendered.startswith("<|user|>\nReverse a string.") and rendered.endswith("<|assistant|>\n")
    expect = engine.generate([rendered], max_new_tokens=6)[0]
    assert rows["a"]["prompt"] == "Reverse a string." and rows["a"]["completion"] == expect.text
    assert rows["a"]["prompt_tokens"] == len(engine.encode_prompt(rendered))
    assert rows["b"]["error"].startswith("PromptError")
    plain = GenerateRows(StageConfig(model=str(tmp_path), max_new_tokens=6, chat=False), None, "run-2")
    assert plain(batch).to_pylist()[0]["prompt_tokens"] == len(engine.encode_prompt("Reverse a string."))
