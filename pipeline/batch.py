"""The batch generation job: prompt files -> pipeline.processor -> Parquet, in one streaming pass.

Ray Data reads the prompt files as a stream of blocks; a filter drops the ids already in the output
(resume), and the rest go through the processor (pipeline.processor: prepare, engine actors in Ray
Data's actor pool that load the model once and live for the whole run). The driver iterates the
output rows as Ray Data streams them and writes them as part files; rows reach a file only after
their batch returned, so a lost actor (restarted by Ray, its batch rerun) neither loses nor
duplicates rows. In SpecEE mode the processor's schedule store actor (pipeline.schedule_store)
gathers each batch's exit statistics and re-tunes the predictor schedule every N generated tokens;
engines pick up new versions between batches, every row records the version it ran with, and the
driver saves each version under _schedules/.

The output folder (pipeline.output) is held by one job at a time (pipeline.output_lock) and records
what its rows were generated with (pipeline.manifest): a resume with other settings stops, naming
them. A resume regenerates the rows whose request (prompt, own sampling) changed under their id,
and with retry_errors the error rows; their old rows are removed from the folder first, so every
id is there once.
"""
from __future__ import annotations

import logging
import time
import uuid
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import ray
import ray.data

from pipeline.manifest import MANIFEST, check_manifest, job_manifest
from pipeline.output import DoneIds, OutputDir, OutputIndex, digest
from pipeline.output_lock import OutputLock
from pipeline.processor_config import share_resources
from pipeline.prompts import MAX_PROMPT_CHARS, prompt_rows, read_prompts, unreadable_files
from pipeline.stage import OUTPUT_SCHEMA, WORKER_DIED, StageConfig
from specee_core.early_exit.step import initial_schedule
from specee_core.early_exit.scheduler import Schedule

log = logging.getLogger(__name__)


@dataclass
class BatchConfig:
    input: list[str]
    output: str
    stage: StageConfig
    num_actors: int | None = 2  # None: measured (with_measured_layout)
    cpus_per_actor: float | None = None  # None: 1 with a GPU, else the cluster's CPUs shared among actors
    gpus_per_actor: float | None = None  # None: 1 when stage.device is cuda, else 0
    input_format: str | None = None  # jsonl | csv | parquet; None: from the file extensions
    prompt_column: str = "prompt"
    id_column: str = "id"
    limit: int | None = None  # only the first `limit` rows, in file order
    max_prompt_chars: int = MAX_PROMPT_CHARS  # a longer prompt is an error row, refused before it is tokenized
    schedule: str | None = None  # specee: start from this schedule JSON instead of the model's
    retune_every_tokens: int = 1024  # specee: re-tune after this many generated tokens
    retune_min_exits: int = 1  # ... when at least this many of them exited early
    rows_per_file: int = 1000
    flush_every_s: float = 60.0  # also write a part file this often, so a crash loses little work
    runtime_env: dict | None = None  # for the actors, e.g. {"env_vars": {...}}
    show_progress: bool = True
    retry_errors: bool = False  # generate the error rows already in the output again (their old rows removed)
    overwrite_config: bool = False  # write into an output whose manifest records other settings

    def __post_init__(self) -> None:
        self.input = [self.input] if isinstance(self.input, str) else list(self.input)
        if not self.input:
            raise ValueError("no input paths given")
        for name in ("num_actors", "rows_per_file", "retune_every_tokens", "retune_min_exits", "max_prompt_chars"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.cpus_per_actor is not None and self.cpus_per_actor <= 0:
            raise ValueError(f"cpus_per_actor must be > 0, got {self.cpus_per_actor}")
        if self.schedule is not None and self.stage.mode != "specee":
            raise ValueError(f"a schedule only applies to mode='specee', mode is {self.stage.mode!r}")


@dataclass
class RowStats:
    """Counts over output rows; `generate_s` spans the first batch's start to the last batch's end,
    the one clock every tokens/s of the job is measured on."""
    num_layers: int | None = None
    rows: int = 0
    errors: int = 0
    error_kinds: dict = field(default_factory=dict)  # error_kind -> error rows
    completion_tokens: int = 0
    layer_tokens: float = 0.0  # sum over tokens of layers run
    first_start: float | None = None
    last_end: float | None = None

    def add(self, rows: pa.Table) -> None:
        d = rows.select(["error", "completion_tokens", "avg_layers", "num_layers", "batch_started_at",
                         "batch_s", "error_kind"]).to_pydict()
        for err, n, avg, layers, start, dur, kind in zip(*d.values()):
            self.rows += 1
            self.num_layers = self.num_layers or layers
            if start is not None:
                self.first_start = start if self.first_start is None else min(self.first_start, start)
                end = start + (dur or 0.0)
                self.last_end = end if self.last_end is None else max(self.last_end, end)
            if err is not None:
                self.errors += 1
                self.error_kinds[kind] = self.error_kinds.get(kind, 0) + 1
                continue
            self.completion_tokens += n
            self.layer_tokens += avg * n

    @property
    def avg_layers(self) -> float | None:
        return self.layer_tokens / self.completion_tokens if self.completion_tokens else None

    def generate_s(self, now: float | None = None) -> float | None:
        if self.first_start is None:
            return None
        return (now if now is not None else self.last_end) - self.first_start

    def tokens_per_s(self, now: float | None = None) -> float | None:
        s = self.generate_s(now)
        return self.completion_tokens / s if s else None


DEFAULT_ACTORS = 2  # num_actors None where the layout is not measured (GPUs, several nodes)


def with_measured_layout(cfg: BatchConfig) -> BatchConfig:
    """cfg with num_actors None resolved: on CPU, when the cluster is one machine and nothing else fixes the
    actors' CPUs, the measured layout of its cores (pipeline.actor_plan: how many engine actors, how many threads
    each; measured once per machine and workload, cached); elsewhere DEFAULT_ACTORS."""
    if cfg.num_actors is not None:
        return cfg
    st = cfg.stage
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    cpus = int(ray.cluster_resources().get("CPU", 0))
    if st.device != "cpu" or len(nodes) != 1 or cfg.cpus_per_actor is not None or cpus < 1:
        return replace(cfg, num_actors=DEFAULT_ACTORS)
    from pipeline.actor_plan import Workload, plan_layout

    plan = plan_layout(Workload(st.model, mode=st.mode, weights=st.weights, dtype=st.dtype, batch=st.batch_size),
                       cpus=cpus)
    log.info("engine actors: %s", plan["reason"])
    return replace(cfg, num_actors=plan["actors"], cpus_per_actor=cpus / plan["actors"],
                   stage=replace(st, torch_threads=st.torch_threads or plan["threads"]))


def actor_resources(cfg: BatchConfig) -> dict:
    return share_resources(cfg.stage.device, cfg.cpus_per_actor, cfg.gpus_per_actor, cfg.num_actors)


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
    """Rows done and generated tokens per second (tqdm on stderr), on the job's one clock."""

    def __init__(self, total: int, enabled: bool):
        from tqdm import tqdm

        self.bar = tqdm(total=total, unit="row", disable=not enabled, dynamic_ncols=True)

    def update(self, rows: int, stats: RowStats, version: int | None) -> None:
        rate = stats.tokens_per_s(time.time())
        post = {"tokens_per_s": f"{rate:.1f}" if rate else "-"}
        if version is not None:
            post["schedule"] = f"v{version}"
        self.bar.set_postfix(post, refresh=False)
        self.bar.update(rows)

    def close(self) -> None:
        self.bar.close()


@dataclass
class Resume:
    """What a run does about the rows already in the output."""
    total: int  # input rows to generate in this run
    replace: np.ndarray  # [R] OutputIndex positions of written rows to generate again (removed first)
    changed: int  # of them, rows whose request (prompt, own sampling) changed under their id
    errors: int  # of them, error rows retried (retry_errors)
    unreadable: list[dict] = field(default_factory=list)  # input files not read to their end: {"file", "error"}


def plan_resume(inputs: ray.data.Dataset, index: OutputIndex, retry_errors: bool) -> Resume:
    """One read of the input's ids and request hashes against the output's rows, noting the input files that
    could not be read to their end. ValueError naming some ids when an id is in the input twice."""
    total, changed, errors = 0, 0, 0
    replace, seen, unreadable = [], [], []
    for block in inputs.iter_batches(batch_format="pyarrow", batch_size=None):
        unreadable += unreadable_files(block)
        block = prompt_rows(block)
        ids = block["id"].to_pylist()
        seen.append(np.array([digest(i) for i in ids], dtype="S16"))
        at = index.find(ids)
        found = at >= 0
        total += int((~found).sum())
        if not found.any():
            continue
        at = at[found]
        hashes = block["request_hash"].to_pylist()
        asked = np.array([bytes.fromhex(hashes[i]) if hashes[i] else b"" for i in np.flatnonzero(found)], dtype="S16")
        stale = (index.hashes[at] != asked) & (index.hashes[at] != b"")  # b"": a row without a hash is kept
        retry = index.errors[at] & ~stale if retry_errors else np.zeros(len(at), dtype=bool)
        replace.append(at[stale | retry])
        changed, errors = changed + int(stale.sum()), errors + int(retry.sum())
        total += int((stale | retry).sum())
    check_unique_ids(inputs, np.concatenate(seen) if seen else np.zeros(0, dtype="S16"))
    return Resume(total, np.concatenate(replace) if replace else np.zeros(0, dtype=np.int64), changed, errors,
                  unreadable)


def check_unique_ids(inputs: ray.data.Dataset, digests: np.ndarray, show: int = 5) -> None:
    """ValueError naming up to `show` ids that the input holds more than once (digests: every input row's)."""
    ordered = np.sort(digests)
    twice = np.unique(ordered[1:][ordered[1:] == ordered[:-1]])
    if not len(twice):
        return
    wanted, names = set(twice.tolist()), []
    for block in inputs.iter_batches(batch_format="pyarrow", batch_size=None):  # only now: name them
        ids = prompt_rows(block)["id"].to_pylist()
        names += [i for i in dict.fromkeys(ids) if digest(i) in wanted and i not in names]
        if len(names) >= show:
            break
    raise ValueError(f"the input holds {len(twice)} id(s) more than once, e.g. {', '.join(map(repr, names[:show]))}: "
                     f"each id is one output row, and a resume skips the ids already written; give each row its "
                     f"own id (or none: then <file>:<row>)")


class Writer:
    """Buffers output rows and writes a part file every rows_per_file rows or flush_every_s seconds."""

    def __init__(self, out: OutputDir, run_id: str, rows_per_file: int, flush_every_s: float):
        self.out, self.run_id = out, run_id
        self.rows_per_file, self.flush_every_s = rows_per_file, flush_every_s
        self.buffer: list[pa.Table] = []
        self.seq, self.last_flush = 0, time.perf_counter()

    def add(self, table: pa.Table) -> None:
        self.buffer.append(table)
        # a quarantine's verdict (a row that killed or hung its process) cost process deaths to reach: it is
        # written at once, so that a lost driver does not lose it and the rerun does not die on the row again
        verdict = pc.any(pc.starts_with(table["error"].fill_null(""), WORKER_DIED)).as_py() if table.num_rows else False
        if verdict or sum(t.num_rows for t in self.buffer) >= self.rows_per_file or self.due():
            self.flush()

    def due(self) -> bool:
        return bool(self.buffer) and time.perf_counter() - self.last_flush > self.flush_every_s

    def flush(self) -> None:
        if self.buffer:
            path = self.out.write_part(pa.concat_tables(self.buffer), f"part-{self.run_id}-{self.seq:05d}.parquet")
            log.debug("wrote %s", path.name)
            self.buffer, self.seq = [], self.seq + 1
        self.last_flush = time.perf_counter()


class SavedVersions:
    """The driver's copy of the store's versions: asks for new ones without waiting, saves each."""

    def __init__(self, store, out: OutputDir, start: Schedule | None):
        self.store, self.out = store, out
        self.latest = None if start is None else start.version
        self.pending = None

    def poll(self, wait: bool = False) -> None:
        if self.store is None or self.latest is None:
            return
        if self.pending is None:
            self.pending = self.store.since.remote(self.latest)
        ready, _ = ray.wait([self.pending], timeout=None if wait else 0)
        if not ready:
            return
        try:
            versions = ray.get(self.pending)
        except ray.exceptions.RayError as e:
            log.warning("schedule store lost (%s): no more re-tuning in this run", e)
            self.store = None
            return
        finally:
            self.pending = None
        for v in versions:
            path = self.out.save_schedule(Schedule(**v))
            log.info("schedule v%d %s saved (%s)", v["version"], v["offline_layers"], path)
            self.latest = v["version"]


def run(cfg: BatchConfig) -> dict:
    """Generate every input row not yet in cfg.output (and those to generate again: a changed request,
    retry_errors); return the summary (also saved as _summary.json). The output folder is locked while
    it runs (pipeline.output_lock.FolderLocked when another job has it)."""
    t0 = time.time()
    ray.data.DataContext.get_current().enable_progress_bars = False  # ours counts rows and tokens/s
    if not (Path(cfg.stage.model) / "config.json").is_file():
        raise FileNotFoundError(f"model not found: {cfg.stage.model} has no config.json")
    cfg = with_measured_layout(cfg)
    run_id = time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]
    out = OutputDir(cfg.output, tag=run_id)
    out.prepare()
    with OutputLock(out.root, run_id):
        return run_locked(cfg, out, run_id, t0)


def run_locked(cfg: BatchConfig, out: OutputDir, run_id: str, t0: float) -> dict:
    """run(), holding the output folder: every check before any work, then the rows."""
    out.remove_temps()
    manifest = job_manifest(cfg.stage, cfg.input, input_format=cfg.input_format, prompt_column=cfg.prompt_column,
                            id_column=cfg.id_column, run_id=run_id)
    manifest = check_manifest(out.root, manifest, has_rows=bool(out.part_files()), overwrite=cfg.overwrite_config)
    index = out.index()  # every part file read whole once: an unreadable one is set aside here
    inputs = read_prompts(cfg.input, input_format=cfg.input_format, prompt_column=cfg.prompt_column,
                          id_column=cfg.id_column, limit=cfg.limit, max_prompt_chars=cfg.max_prompt_chars)
    resume = plan_resume(inputs, index, cfg.retry_errors)
    for bad in resume.unreadable:  # named again in the summary; their other rows are generated
        log.warning("input file %s could not be read to its end: %s", bad["file"], bad["error"])
    out.write_json(out.root / MANIFEST, manifest)
    if index.duplicates:
        log.warning("%s holds %d rows whose id an earlier row has: removing them",
                    out.root, sum(map(len, index.duplicates.values())))
    stale = index.rows_at(resume.replace)
    for path, rows in index.duplicates.items():
        stale.setdefault(path, set()).update(rows)
    out.drop_rows(stale)  # before any new row: every id in the folder once, whenever this run stops
    done = index.done_ids(without=resume.replace)
    schedule = starting_schedule(cfg, out)
    total = resume.total
    log.info("run %s: %d rows to do (%d already in %s, %d of them again: %d changed requests, %d error rows); "
             "%d actors with %s; mode %s", run_id, total, len(index), out.root, len(resume.replace), resume.changed,
             resume.errors, cfg.num_actors, actor_resources(cfg), cfg.stage.mode)
    stats = RowStats()
    writer = Writer(out, run_id, cfg.rows_per_file, cfg.flush_every_s)
    progress = Progress(total, cfg.show_progress)

    def sink(rows: pa.Table) -> None:
        stats.add(rows)
        writer.add(rows)
        progress.update(rows.num_rows, stats, pc.max(rows["schedule_version"]).as_py())

    try:
        # nothing left to do (a finished job run again): no engine is loaded
        store_state, engine_info = run_processor(cfg, run_id, inputs, done, schedule, out, sink, writer) if total \
            else (None, [])
    finally:
        writer.flush()  # complete rows are kept even when the run stops with an error
        progress.close()
    if stats.rows != total:  # each row comes back once; anything else is a bug worth stopping for
        raise RuntimeError(f"expected {total} rows, got {stats.rows}")
    summary = summarize(cfg, out, run_id, stats, store_state, time.time() - t0, engine_info)
    summary["regenerated"] = {"changed_requests": resume.changed, "error_rows": resume.errors}
    summary["set_aside"] = [p.name for p in out.set_aside_files]
    summary["unreadable_inputs"] = resume.unreadable
    out.write_summary(summary)
    return summary


def processor_config(cfg: BatchConfig, out: OutputDir, schedule: Schedule | None):
    """The job's settings as the processor's (specee: starting from the schedule saved in the output)."""
    from pipeline.processor import ProcessorConfig

    st = cfg.stage
    return ProcessorConfig(model_source=st.model, mode=st.mode, max_new_tokens=st.max_new_tokens,
                           concurrency=cfg.num_actors, batch_size=st.batch_size, num_cpus=cfg.cpus_per_actor,
                           num_gpus=cfg.gpus_per_actor, device=st.device, dtype=st.dtype, weights=st.weights,
                           temperature=st.temperature, top_p=st.top_p, top_k=st.top_k, stop=st.stop, seed=st.seed,
                           apply_chat_template=st.chat, max_prompt_chars=cfg.max_prompt_chars,
                           engine_kwargs={**st.engine_options, **st.core_options}, spec=dict(st.spec),
                           torch_threads=st.torch_threads,
                           kv_cache_gb=st.kv_cache_gb, prefix_cache=st.prefix_cache,
                           batch_timeout_s=st.batch_timeout_s, row_attempts=st.row_attempts,
                           max_concurrent_batches=st.max_concurrent_batches,
                           retune_every_tokens=cfg.retune_every_tokens, retune_min_exits=cfg.retune_min_exits,
                           schedule=None if schedule is None else str(out.schedule_path(schedule.version)),
                           runtime_env=cfg.runtime_env)


def skip_done(done: DoneIds) -> Callable[[pa.Table], pa.Table]:
    """A Ray Data batch function keeping the prompt rows (pipeline.prompts.prompt_rows) whose id is not in done."""
    def keep(block: pa.Table) -> pa.Table:
        block = prompt_rows(block)
        return block.filter(pa.array(~done.mask(block["id"].to_pylist()))) if block.num_rows and len(done) else block
    return keep


def run_processor(cfg: BatchConfig, run_id: str, inputs: ray.data.Dataset, done: DoneIds, schedule: Schedule | None,
                  out: OutputDir, sink: Callable[[pa.Table], None], writer: Writer) -> tuple[dict | None, list[dict]]:
    """read -> pipeline.processor -> rows to sink, as Ray Data streams them. Returns the schedule store's
    state and what the engines ran with."""
    from pipeline.processor import build_processor

    processor = build_processor(processor_config(cfg, out, schedule), run_id=run_id)
    todo = inputs.map_batches(skip_done(done), batch_format="pyarrow", batch_size=None, num_cpus=0)
    rows = processor(todo)
    versions = SavedVersions(processor.store, out, schedule)
    came_back = 0
    try:
        try:
            for block in rows.iter_batches(batch_format="pyarrow", batch_size=None):
                if block.num_rows:
                    came_back += block.num_rows
                    sink(block.select(OUTPUT_SCHEMA.names).cast(OUTPUT_SCHEMA))
                if writer.due():
                    writer.flush()
                versions.poll()
        except Exception as e:
            reason = start_failure(e)
            if reason is not None and not came_back:
                raise RuntimeError(f"an engine actor could not start: {reason}") from e
            raise
        versions.poll(wait=True)
        return (processor.schedule_state() if versions.store is not None else None), processor.engines()
    finally:
        processor.shutdown()


def start_failure(e: BaseException) -> str | None:
    """The reason an engine actor's constructor raised, when that is what e (from Ray Data) reports."""
    text = str(e)
    if "creation task" not in text and "__init__" not in text:
        return None
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else text


def summarize(cfg: BatchConfig, out: OutputDir, run_id: str, this_run: RowStats, store_state: dict | None,
              wall_s: float, engine_info: list[dict] | None = None) -> dict:
    """Totals over every row in the output, plus this run's throughput on the job's one clock."""
    everything = RowStats()
    table = out.read_rows(columns=["error", "completion_tokens", "avg_layers", "num_layers", "batch_started_at",
                                   "batch_s", "error_kind"])
    if table is not None:
        everything.add(table)
    avg = everything.avg_layers
    gen_s = this_run.generate_s()
    latest = out.latest_schedule()
    return {
        "output": str(out.root),
        "run_id": run_id,
        "mode": cfg.stage.mode,
        "model": cfg.stage.model,
        "rows": everything.rows,
        "errors": everything.errors,
        "error_kinds": everything.error_kinds,  # "input": the rows' own; "machine": worth retry_errors
        "completion_tokens": everything.completion_tokens,
        "rows_this_run": this_run.rows,
        "tokens_this_run": this_run.completion_tokens,
        "wall_s": round(wall_s, 3),
        "generate_s": None if gen_s is None else round(gen_s, 3),
        "tokens_per_s": None if not gen_s else round(this_run.completion_tokens / gen_s, 2),
        "rows_per_s": None if not gen_s else round(this_run.rows / gen_s, 3),
        "tokens_per_s_note": "generated tokens per second from this run's first engine batch start to its last "
                             "batch end (the progress bar's and jobs.analyze's clock); wall_s adds start-up",
        "num_actors": cfg.num_actors,
        "num_layers": everything.num_layers,
        "avg_layers": None if avg is None else round(avg, 4),
        "est_speedup_upper_bound": None if avg is None else round(everything.num_layers / avg, 4),
        "est_speedup_note": "num_layers / avg_layers: counts decoder layers only, not the draft head and "
                            "predictors, so real speed-up is lower",
        "final_schedule": None if cfg.stage.mode != "specee" or latest is None else asdict(latest),
        "schedule_store": store_state,
        # specee with a tolerance: the live audit's disagreement per layer with its upper bound, layers closed
        "audit": None if store_state is None else store_state.get("audit"),
        "dtype": engine_info[0]["dtype"] if engine_info else None,
        "kv_memory": engine_info[0].get("kv_memory") if engine_info else None,  # an engine's KV budget at start
        "weights": engine_info[0]["weights"] if engine_info else None,
        "engines": engine_info,  # per actor: dtype and why, the machine, in mode auto the plan and its choices
    }
