"""The batch generation driver: prompt files -> Ray Data actor pool -> Parquet, in waves.

Each wave is one Ray Data execution over the rows whose id hashes to it, through a pool of
actors that each load the engine once. Between waves the driver sums the wave's exit
statistics and re-tunes the predictor schedule with the scheduler's own update rule
(specee_core.scheduler.retune); the next wave's actors start with the new version. Rows
already in the output are skipped, so rerunning a crashed job finishes it.
"""
from __future__ import annotations

import logging
import math
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import pyarrow as pa
import pyarrow.compute as pc
import ray
import ray.data

from pipeline.output import OutputDir
from pipeline.prompts import read_prompts, rows_to_do
from pipeline.stage import OUTPUT_SCHEMA, GenerateRows, StageConfig
from specee_core.early_exit import initial_schedule
from specee_core.scheduler import Schedule, retune

log = logging.getLogger(__name__)


@dataclass
class BatchConfig:
    input: list[str]
    output: str
    stage: StageConfig
    waves: int = 4
    num_actors: int = 2
    cpus_per_actor: float | None = None  # None: 1 with a GPU, else the cluster's CPUs shared among actors
    gpus_per_actor: float | None = None  # None: 1 when stage.device is cuda, else 0
    input_format: str | None = None  # jsonl | csv | parquet; None: from the file extensions
    prompt_column: str = "prompt"
    id_column: str = "id"
    limit: int | None = None  # only the first `limit` rows, in file order
    schedule: str | None = None  # specee: start from this schedule JSON instead of the model's
    retune_min_tokens: int = 1  # re-tune only after a wave with at least this many early exits
    rows_per_file: int = 1000
    flush_every_s: float = 60.0  # also write a part file this often, so a crash loses little work
    runtime_env: dict | None = None  # for the actors, e.g. {"env_vars": {...}}
    show_progress: bool = True

    def __post_init__(self) -> None:
        self.input = [self.input] if isinstance(self.input, str) else list(self.input)
        if not self.input:
            raise ValueError("no input paths given")
        for name in ("waves", "num_actors", "rows_per_file", "retune_min_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.cpus_per_actor is not None and self.cpus_per_actor <= 0:
            raise ValueError(f"cpus_per_actor must be > 0, got {self.cpus_per_actor}")
        if self.schedule is not None and self.stage.mode != "specee":
            raise ValueError(f"a schedule only applies to mode='specee', mode is {self.stage.mode!r}")


@dataclass
class WaveStats:
    """What the driver accumulates from the output rows of one wave."""
    num_layers: int | None = None
    rows: int = 0
    errors: int = 0
    completion_tokens: int = 0
    layer_tokens: float = 0.0  # sum over tokens of layers run
    retune_histogram: list[int] | None = None  # [L] summed over rows that carry one
    schedule_version: int | None = None  # the schedule the wave ran with

    def add(self, rows: pa.Table) -> None:
        d = rows.select(["error", "completion_tokens", "avg_layers", "num_layers", "retune_histogram"]).to_pydict()
        for err, n, avg, layers, hist in zip(d["error"], d["completion_tokens"], d["avg_layers"], d["num_layers"],
                                             d["retune_histogram"]):
            self.rows += 1
            self.num_layers = self.num_layers or layers
            if err is not None:
                self.errors += 1
                continue
            self.completion_tokens += n
            self.layer_tokens += avg * n
            if hist is not None:
                if self.retune_histogram is None:
                    self.retune_histogram = [0] * len(hist)
                if len(hist) != len(self.retune_histogram):
                    raise ValueError(f"retune histograms of {len(hist)} and {len(self.retune_histogram)} bins")
                self.retune_histogram = [a + b for a, b in zip(self.retune_histogram, hist)]

    def merge(self, other: WaveStats) -> None:
        self.num_layers = self.num_layers or other.num_layers
        for name in ("rows", "errors", "completion_tokens", "layer_tokens"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def summary(self) -> dict:
        return {"schedule_version": self.schedule_version, "rows": self.rows, "errors": self.errors,
                "completion_tokens": self.completion_tokens,
                "avg_layers": None if self.avg_layers is None else round(self.avg_layers, 4)}

    @property
    def avg_layers(self) -> float | None:
        return self.layer_tokens / self.completion_tokens if self.completion_tokens else None


def next_schedule(schedule: Schedule, stats: WaveStats, min_tokens: int = 1) -> Schedule:
    """The schedule for the next wave: re-tuned from the wave's histogram, or unchanged when the
    rows carried none (dense mode, an engine without the statistic) or too few exits."""
    if stats.retune_histogram is None:
        return schedule
    return retune(schedule, stats.retune_histogram, min_tokens=min_tokens)


def actor_resources(cfg: BatchConfig) -> dict:
    """num_cpus / num_gpus per actor: one GPU and one CPU each on GPUs, else an equal share of
    the cluster's CPUs (fractional: two actors on two CPUs get 1 each, four get 0.5)."""
    gpus = cfg.gpus_per_actor if cfg.gpus_per_actor is not None else (1 if cfg.stage.device.startswith("cuda") else 0)
    if cfg.cpus_per_actor is not None:
        cpus = cfg.cpus_per_actor
    elif gpus:
        cpus = 1
    else:
        total = ray.cluster_resources().get("CPU", 1)
        cpus = max(0.25, math.floor(4 * total / cfg.num_actors) / 4)
    return {"num_cpus": cpus, "num_gpus": gpus}


def starting_schedule(cfg: BatchConfig, out: OutputDir) -> Schedule | None:
    """specee: the latest schedule in the output (a rerun continues re-tuning), else cfg.schedule,
    else the one the engine starts with. dense and spec: None."""
    if cfg.stage.mode != "specee":
        return None
    latest = out.latest_schedule()
    if latest is not None:
        if cfg.schedule:
            log.warning("output already has schedules: continuing from v%d, not %s", latest.version, cfg.schedule)
        return latest
    schedule = Schedule.load(cfg.schedule) if cfg.schedule else initial_schedule(Path(cfg.stage.model))
    out.save_schedule(schedule)
    return schedule


class Progress:
    """Rows done of total and generated tokens per second (tqdm on stderr)."""

    def __init__(self, total: int, enabled: bool):
        from tqdm import tqdm

        self.bar = tqdm(total=total, unit="row", disable=not enabled, dynamic_ncols=True)
        self.t0 = time.perf_counter()
        self.tokens = 0

    def update(self, rows: int, tokens: int, wave: int) -> None:
        self.tokens += tokens
        self.bar.set_postfix(wave=wave, tok_s=f"{self.tokens / max(time.perf_counter() - self.t0, 1e-9):.1f}",
                             refresh=False)
        self.bar.update(rows)

    def close(self) -> None:
        self.bar.close()


def run(cfg: BatchConfig) -> dict:
    """Generate every input row not yet in cfg.output; return the summary (also saved as JSON)."""
    t0 = time.perf_counter()
    if cfg.show_progress:  # ours counts rows and tokens over all waves; Ray Data's would restart per wave
        ray.data.DataContext.get_current().enable_progress_bars = False
    out = OutputDir(cfg.output)
    out.prepare()
    run_id = time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]
    done = out.done_ids()
    schedule = starting_schedule(cfg, out)
    inputs = read_prompts(cfg.input, waves=cfg.waves, input_format=cfg.input_format, prompt_column=cfg.prompt_column,
                          id_column=cfg.id_column, limit=cfg.limit).materialize()
    inputs.context.execution_options.preserve_order = False  # file order mattered for --limit only: applied
    todo = Counter()
    for batch in inputs.select_columns(["id", "wave"]).iter_batches(batch_format="pyarrow", batch_size=None):
        todo.update(w for i, w in zip(batch["id"].to_pylist(), batch["wave"].to_pylist()) if i not in done)
    resources = actor_resources(cfg)
    log.info("run %s: %d rows to do in %d waves (%d already in %s); %d actors with %s; mode %s", run_id,
             sum(todo.values()), cfg.waves, len(done), out.root, cfg.num_actors, resources, cfg.stage.mode)

    progress = Progress(sum(todo.values()), cfg.show_progress)
    try:
        waves, schedule = run_waves(
            cfg.waves, schedule, out, cfg.retune_min_tokens,
            lambda wave, sched: run_wave(cfg, inputs, wave, todo[wave], done, sched, run_id, resources, out, progress))
    finally:
        progress.close()
    total = WaveStats()
    for stats in waves:
        total.merge(stats)
    summary = summarize(cfg, out, run_id, total, waves, schedule, time.perf_counter() - t0)
    out.write_summary(summary)
    return summary


def run_waves(n_waves: int, schedule: Schedule | None, out: OutputDir, min_tokens: int,
              run_one: Callable[[int, Schedule | None], WaveStats]) -> tuple[list[WaveStats], Schedule | None]:
    """The wave loop: run_one(wave, schedule) generates a wave; between waves the schedule is
    re-tuned from that wave's statistics, saved as schedules/v<N>.json and used by the next."""
    waves = []
    for wave in range(n_waves):
        stats = run_one(wave, schedule)
        stats.schedule_version = None if schedule is None else schedule.version
        waves.append(stats)
        if schedule is None or wave == n_waves - 1:
            continue
        new = next_schedule(schedule, stats, min_tokens)
        if new.version != schedule.version:
            path = out.save_schedule(new)
            log.info("after wave %d: schedule v%d %s -> v%d %s (%s)", wave, schedule.version, schedule.offline_layers,
                     new.version, new.offline_layers, path)
        schedule = new
    return waves, schedule


def run_wave(cfg: BatchConfig, inputs: ray.data.Dataset, wave: int, n_todo: int, done: frozenset[str],
             schedule: Schedule | None, run_id: str, resources: dict, out: OutputDir,
             progress: Progress) -> WaveStats:
    """Generate one wave's remaining rows, writing a part file every rows_per_file rows."""
    stats = WaveStats()
    if n_todo == 0:
        log.info("wave %d: nothing to do", wave)
        return stats
    # The wave's rows are selected before any actor exists: actors holding every CPU cannot then
    # starve a read or filter task, so the pool may take the whole cluster.
    todo = rows_to_do(inputs, wave, done).materialize()
    rows = todo.map_batches(
        GenerateRows,
        fn_constructor_kwargs={"cfg": cfg.stage, "schedule": schedule, "run_id": run_id},
        batch_size=cfg.stage.batch_size,
        batch_format="pyarrow",
        # all actors start at once; the wave begins as soon as one is ready (GPU nodes may still be booting)
        compute=ray.data.ActorPoolStrategy(min_size=1, max_size=cfg.num_actors, initial_size=cfg.num_actors),
        runtime_env=cfg.runtime_env,
        **resources,
    )
    buffer: list[pa.Table] = []
    seq, last_flush = 0, time.perf_counter()

    def flush() -> None:
        nonlocal buffer, seq, last_flush
        if buffer:
            path = out.write_part(pa.concat_tables(buffer), f"part-{run_id}-w{wave:03d}-{seq:05d}.parquet")
            log.debug("wrote %s", path.name)
            buffer, seq, last_flush = [], seq + 1, time.perf_counter()

    for block in rows.iter_batches(batch_format="pyarrow", batch_size=None):
        block = block.cast(OUTPUT_SCHEMA)
        stats.add(block)
        buffer.append(block)
        progress.update(block.num_rows, int(pc.sum(block["completion_tokens"]).as_py() or 0), wave)
        if sum(t.num_rows for t in buffer) >= cfg.rows_per_file or time.perf_counter() - last_flush > cfg.flush_every_s:
            flush()
    flush()
    if stats.rows != n_todo:  # Ray Data delivers each block once; anything else is a bug worth stopping for
        raise RuntimeError(f"wave {wave}: expected {n_todo} rows, got {stats.rows}")
    log.info("wave %d: %d rows, %d errors, %d tokens, avg layers %s", wave, stats.rows, stats.errors,
             stats.completion_tokens, None if stats.avg_layers is None else round(stats.avg_layers, 2))
    return stats


def summarize(cfg: BatchConfig, out: OutputDir, run_id: str, run_stats: WaveStats, waves: list[WaveStats],
              schedule: Schedule | None, wall_s: float) -> dict:
    """Totals over every row in the output, plus this run's throughput."""
    everything = WaveStats()
    table = out.read_rows(columns=["error", "completion_tokens", "avg_layers", "num_layers", "retune_histogram"])
    if table is not None:
        everything.add(table)
    avg = everything.avg_layers
    return {
        "output": str(out.root),
        "run_id": run_id,
        "mode": cfg.stage.mode,
        "model": cfg.stage.model,
        "rows": everything.rows,
        "errors": everything.errors,
        "completion_tokens": everything.completion_tokens,
        "rows_this_run": run_stats.rows,
        "tokens_this_run": run_stats.completion_tokens,
        "wall_s": round(wall_s, 3),
        "tokens_per_s": round(run_stats.completion_tokens / wall_s, 2) if wall_s > 0 else None,
        "num_layers": everything.num_layers,
        "avg_layers": None if avg is None else round(avg, 4),
        "est_speedup_upper_bound": None if avg is None else round(everything.num_layers / avg, 4),
        "est_speedup_note": "num_layers / avg_layers: counts decoder layers only, not the draft head and "
                            "predictors, so real speed-up is lower",
        "final_schedule": None if schedule is None else asdict(schedule),
        "waves": [{"wave": w, **stats.summary()} for w, stats in enumerate(waves)],
    }
