"""The engine as a Ray Data processor: Dataset -> Dataset, in Ray Data LLM's shape.

    import ray
    from pipeline import ProcessorConfig, build_processor

    processor = build_processor(ProcessorConfig(model="models/smollm2-135m-instruct", mode="auto",
                                                max_new_tokens=64, concurrency=2, batch_size=16))
    out = processor(ray.data.read_json("prompts.jsonl"))   # columns id, prompt
    out.write_parquet("out/")

Input rows need `id` and `prompt`: a string (through the model's chat template as the user's message
when the model has one, unless chat=False) or a list of chat messages ({"role", "content"}). Stages:
1. an optional user `preprocess` (row -> row, Dataset.map);
2. prepare (light CPU actors: the tokenizer loaded once each): the chat template, validation;
   a row that cannot be a prompt keeps its reason in `input_error`;
3. the engine: an actor pool (`map_batches` with `concurrency`, `batch_size`, `num_cpus` /
   `num_gpus`); each actor loads one engine (pipeline.stage.GenerateRows) and turns a batch into one
   output row per input row: `completion`, `error` (null unless the row failed: InputError,
   PromptError, or the engine's exception for that row alone) and the per-row statistics the batch job
   writes (pipeline.stage.OUTPUT_SCHEMA). Detokenizing happens in the engine, as tokens are chosen,
   because stop strings are matched on the text. The input's other columns are carried through;
4. an optional user `postprocess` (row -> row), run in the engine actors on their output rows (the
   engine's columns keep their types even where a batch holds only error rows).

In mode "specee" the processor starts a schedule store actor (pipeline.schedule_store) on its first
call: engines report exit statistics to it, pick up re-tuned versions (and, with a tolerance, the
audit's closed layers) between batches, and each row records the version it ran with.
`processor.schedule_state()` returns the store's state after the dataset has run.

Fault tolerance is Ray Data's own, plus a ledger: the engine actors restart when they die (max_restarts
-1) and a batch that was running on a dead actor runs again on another (`max_task_retries`). A RunLedger
actor records which calls started and never finished, so the rerun of a batch that died runs its rows one
by one, and a row that killed its process ROW_DEATHS times alone becomes an error row ("WorkerDied: ...")
instead of failing the dataset. An engine *exception* never fails it either: it costs only its rows (error
rows). Ray warns that actors whose constructor arguments live in the object store may not restart
(ray-project/ray#53727); measured here (tests/pipeline/test_chaos.py: engine processes SIGKILLed mid-run,
the schedule store too) they do restart while the dataset runs, and every row comes back exactly once.
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np
import pandas as pd
import pyarrow as pa
import ray

from pipeline.stage import OUTPUT_SCHEMA, GenerateRows, StageConfig

log = logging.getLogger(__name__)

INTERNAL = ("input_error", "text")  # columns the processor adds for its own stages


@dataclass(frozen=True)
class ProcessorConfig:
    model: str
    mode: str = "auto"  # auto (lossless, measured) | dense | spec | specee (lossy: early exit)
    max_new_tokens: int = 64
    concurrency: int = 1  # engine actors
    batch_size: int = 16  # rows per engine call, also the engine's max batch
    num_cpus: float | None = None  # per engine actor; None: the cluster's CPUs shared among the actors
    num_gpus: float | None = None  # per engine actor; None: 1 when device is cuda, else 0
    device: str = "cpu"
    dtype: str = "auto"
    weights: str = "auto"
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    chat: bool | None = None  # string prompts through the chat template; None: when the model has one
    engine_options: dict = field(default_factory=dict)  # early-exit options (EarlyExitOptions)
    spec: dict = field(default_factory=dict)  # speculative decoding options (SpecOptions)
    torch_threads: int | None = None
    kv_cache_gb: float | None = None  # each engine actor's KV budget, GiB; None: a share of free memory / concurrency
    prefix_cache: bool = True  # reuse full prompt blocks across rows (chat template, system prompt)
    # a batch whose actor died runs again this often (then fails the dataset): the first rerun splits it
    # into single rows, and a row that killed its process twice alone becomes an error row on the third
    max_task_retries: int = 3
    retune_every_tokens: int = 1024  # specee: the schedule store re-tunes after this many tokens
    retune_min_exits: int = 1  # ... when at least this many of them exited early
    schedule: str | None = None  # specee: start from this schedule JSON (default: the model's)
    runtime_env: dict | None = None  # for the engine actors, e.g. {"env_vars": {...}}

    def __post_init__(self) -> None:
        self.stage()  # every engine setting is checked here, once, not in each actor
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.max_task_retries < 0:
            raise ValueError(f"max_task_retries must be >= 0, got {self.max_task_retries}")
        if self.schedule is not None and self.mode != "specee":
            raise ValueError(f"a schedule only applies to mode='specee', mode is {self.mode!r}")

    def stage(self) -> StageConfig:
        """The engine actors' settings (the prepare stage renders chat prompts, so the engine does not)."""
        return StageConfig(model=self.model, mode=self.mode, device=self.device, dtype=self.dtype,
                           weights=self.weights, max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                           top_p=self.top_p, top_k=self.top_k, stop=tuple(self.stop), seed=self.seed,
                           batch_size=self.batch_size, torch_threads=self.torch_threads, chat=False,
                           engine_options=dict(self.engine_options), spec=dict(self.spec),
                           engines_per_node=self.concurrency, kv_cache_gb=self.kv_cache_gb,
                           prefix_cache=self.prefix_cache)

    def resources(self) -> dict:
        from pipeline.batch import share_resources

        return share_resources(self.device, self.num_cpus, self.num_gpus, self.concurrency)


class PrepareRows:
    """Stage 2: the prompt text of each row (chat template), or why there is none. Loads only the
    tokenizer."""

    def __init__(self, model: str, chat: bool | None):
        from specee_core.model.loader import load_tokenizer

        self.tok = load_tokenizer(model)
        has_template = getattr(self.tok, "chat_template", None) is not None
        self.chat = has_template if chat is None else chat
        if self.chat and not has_template:
            raise ValueError(f"chat=True but {model} has no chat template")

    def __call__(self, batch: pd.DataFrame) -> pa.Table:
        # pandas batches: Ray Data concatenates them without casting, where Arrow blocks of one column typed
        # null (a block whose prompts are all missing) and string cannot be concatenated
        for name in ("id", "prompt"):
            if name not in batch.columns:
                raise ValueError(f"the processor's input needs columns 'id' and 'prompt'; got {list(batch.columns)}")
        texts, errors, shown = [], [], []
        # a reader that already found a row unusable (pipeline.prompts' input_error) keeps its reason
        given = batch["input_error"].tolist() if "input_error" in batch.columns else [None] * len(batch)
        for prompt, reason in zip(batch["prompt"].tolist(), given):
            prompt = to_python(prompt)
            text, error = (None, reason) if not is_missing(reason) else self._text(prompt)
            texts.append(text)
            errors.append(error)
            shown.append(prompt if isinstance(prompt, str) or prompt is None else json.dumps(prompt)[:10000])
        ids = [None if is_missing(i) else str(i) for i in batch["id"].tolist()]
        keep = [c for c in batch.columns if c not in ("id", "prompt", *INTERNAL)]
        return pa.table({"id": pa.array(ids, pa.string()), "prompt": pa.array(shown, pa.string()),
                         "text": pa.array(texts, pa.string()), "input_error": pa.array(errors, pa.string()),
                         **{c: pa.array([to_python(v) for v in batch[c].tolist()]) for c in keep}})

    def _text(self, prompt) -> tuple[str | None, str | None]:
        if isinstance(prompt, str):
            if not prompt:  # the engine refuses it: a PromptError, as in Serve
                return prompt, None
            return (self._render([{"role": "user", "content": prompt}]) if self.chat else (prompt, None))
        if isinstance(prompt, (list, tuple)) and prompt:
            if not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                       for m in prompt):
                return None, "chat messages must be {'role': str, 'content': str} objects"
            return self._render([{"role": m["role"], "content": m["content"]} for m in prompt])
        return None, f"prompt must be a string or a list of chat messages, got {type(prompt).__name__}"

    def _render(self, messages: list[dict]) -> tuple[str | None, str | None]:
        if getattr(self.tok, "chat_template", None) is None:
            return None, "chat messages need a model with a chat template"
        try:
            text = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - jinja raises whatever the template's author wrote
            return None, f"the chat template rejected the messages: {e}"
        bos = self.tok.bos_token
        if bos and text.startswith(bos) and self.tok("a")["input_ids"][:1] == [self.tok.bos_token_id]:
            text = text[len(bos):]  # the tokenizer adds BOS itself: keep one
        return text, None


ROW_DEATHS = 2  # a row whose process died this often while it ran alone becomes an error row


class RunLedger:
    """One per processor (a named actor, no CPU): which engine calls started and never finished, and
    what each engine runs with.

    An engine actor that dies takes its call with it; Ray Data restarts the actor and runs the call
    again. The ledger lets the rerun know: a batch that was started before and never finished runs
    row by row, each row recorded alone, and a row that killed its process ROW_DEATHS times alone
    comes back as an error row instead of running again. So one poisonous prompt costs its own row,
    not its batch mates or the dataset, while an actor lost for any other reason (a node gone, a
    kill) only costs a rerun. If the ledger itself is lost it restarts empty: calls then run whole,
    as on their first try."""

    def __init__(self):
        self.started: dict[str, int] = {}  # key -> starts that did not finish
        self.engines: dict[str, dict] = {}  # worker -> what it runs with (GenerateRows.describe)

    def begin(self, key: str) -> int:
        """Record a start of `key`; returns how many earlier starts never finished."""
        n = self.started.get(key, 0)
        self.started[key] = n + 1
        return n

    def end(self, key: str) -> None:
        self.started.pop(key, None)

    def engine(self, worker: str, info: dict) -> None:
        self.engines[worker] = info

    def engine_infos(self) -> list[dict]:
        return list(self.engines.values())


class EngineRows:
    """Stage 3: one engine per actor (pipeline.stage.GenerateRows); the input's own columns are
    carried through to the output rows. A call that an earlier attempt died in runs row by row
    (RunLedger)."""

    def __init__(self, stage: StageConfig, run_id: str, store=None, ledger=None,
                 postprocess: Callable[[dict], dict] | None = None):
        """store, ledger: the schedule store and RunLedger actors (handles: the dataset holding them keeps
        them alive while it runs, even when the Processor that made them is gone) or None."""
        self.rows = GenerateRows(stage, run_id, store)
        self.postprocess = postprocess
        self.ledger = ledger
        self._describe()

    def _describe(self) -> None:
        if self.ledger is not None:
            self.ledger.engine.remote(self.rows.worker, self.rows.describe())

    def _begin(self, key: str) -> int:
        if self.ledger is None:
            return 0
        try:
            return ray.get(self.ledger.begin.remote(key))
        except ray.exceptions.RayError as e:  # the ledger is gone: run as a first try
            log.warning("run ledger lost (%s)", e)
            self.ledger = None
            return 0

    def _end(self, key: str) -> None:
        if self.ledger is not None:
            self.ledger.end.remote(key)

    def _generate(self, mine: pa.Table) -> pa.Table:
        """The engine's rows for mine; row by row when an earlier start of this call never finished."""
        ids = mine["id"].to_pylist()
        key = "batch:" + hashlib.blake2b("\x00".join(map(str, ids)).encode(), digest_size=16).hexdigest()
        if self._begin(key) == 0:
            out = self.rows(mine)
        else:
            log.warning("a call of %d rows died before: running its rows one by one", len(ids))
            out = pa.concat_tables([self._alone(mine.slice(i, 1)) for i in range(len(ids))])
        self._end(key)
        if self.rows.cfg.mode == "auto":  # the plan's choices so far (other modes: as described at start)
            self._describe()
        return out

    def _alone(self, row: pa.Table) -> pa.Table:
        key = f"row:{row['id'][0].as_py()}"
        deaths = self._begin(key)
        if deaths >= ROW_DEATHS:
            out = self.rows.error_rows(row, f"WorkerDied: the engine process died {deaths} times running this "
                                            f"row alone (and before that with its batch)")
        else:
            out = self.rows(row)
        self._end(key)
        return out

    def __call__(self, batch: pd.DataFrame) -> pa.Table:
        mine = pa.table({c: pa.array([None if is_missing(v) else v for v in batch[c].tolist()], pa.string())
                         for c in ("id", "prompt", "text", "input_error")})
        out = self._generate(mine)
        for name in batch.columns:
            if name not in OUTPUT_SCHEMA.names and name not in INTERNAL:
                out = out.append_column(name, pa.array([to_python(v) for v in batch[name].tolist()]))
        if self.postprocess is None:
            return out
        # the user's postprocess runs here, on typed rows, and the engine's columns keep their types: a
        # batch whose completions are all null (error rows) must not become a column of Arrow type null
        rows = [self.postprocess(r) for r in out.to_pylist()]
        names = list(dict.fromkeys(k for r in rows for k in r))
        types = {f.name: f.type for f in OUTPUT_SCHEMA}
        return pa.table({n: pa.array([r.get(n) for r in rows], types.get(n)) for n in names})


def is_missing(v) -> bool:
    """None, NaN or pandas' NA (how pandas batches hold a missing cell)."""
    return v is None or (not isinstance(v, (str, bytes, list, dict, np.ndarray)) and bool(pd.isna(v)))


def to_python(v):
    """A pandas cell as plain Python: numpy arrays (Arrow lists) as lists, NaN as None."""
    if isinstance(v, np.ndarray):
        return [to_python(x) for x in v.tolist()]
    if isinstance(v, dict):
        return {k: to_python(x) for k, x in v.items()}
    return None if is_missing(v) else v


def blocks_of(ds: ray.data.Dataset, rows: int) -> ray.data.Dataset:
    """ds re-cut into blocks of at most `rows` rows (Ray Data's streaming repartition), so that each engine
    task runs one batch: its rows stream out as soon as it ends (a task over a larger block would hold
    every output row until its last batch) and an actor lost mid-task costs one batch's rerun.

    The repartition asks for no CPU: by default its tasks want one, and when the engine actors hold every
    CPU of the cluster (2 actors on 2 cores) they could never run and the dataset would wait forever.
    Ray's repartition() takes no remote args, so they are set on its logical operator."""
    ds = ds.repartition(target_num_rows_per_block=rows, strict=True)  # not strict: ragged batches (5, 11 rows)
    op = ds._logical_plan.dag
    if type(op).__name__ != "StreamingRepartition" or not isinstance(getattr(op, "ray_remote_args", None), dict):
        raise RuntimeError(f"this Ray's repartition() made {type(op).__name__}: pipeline.processor.blocks_of "
                           f"needs updating for ray {ray.__version__}")
    op.ray_remote_args["num_cpus"] = 0
    return ds


class Processor:
    """Dataset -> Dataset (see the module docstring). Build it with build_processor."""

    def __init__(self, config: ProcessorConfig, preprocess: Callable[[dict], dict] | None = None,
                 postprocess: Callable[[dict], dict] | None = None, run_id: str | None = None):
        self.config, self.preprocess, self.postprocess = config, preprocess, postprocess
        self.run_id = run_id or time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]
        self.store = None
        self.store_name = None
        self.ledger = None

    def __call__(self, ds: ray.data.Dataset) -> ray.data.Dataset:
        cfg = self.config
        # the user's preprocess and the prepare stage reserve no CPU: they are light next to the
        # engine, whose actors may hold every CPU of the cluster while the stream still flows
        if self.preprocess is not None:
            ds = ds.map(self.preprocess, num_cpus=0)
        ds = ds.map_batches(PrepareRows, fn_constructor_kwargs={"model": cfg.model, "chat": cfg.chat},
                            batch_format="pandas", concurrency=1, num_cpus=0, batch_size=cfg.batch_size)
        ds = blocks_of(ds, cfg.batch_size)
        ds = ds.map_batches(EngineRows, fn_constructor_kwargs={"stage": cfg.stage(), "run_id": self.run_id,
                                                               "store": self._store(), "ledger": self._ledger(),
                                                               "postprocess": self.postprocess},
                            batch_format="pandas", batch_size=cfg.batch_size,
                            # one batch at a time per actor: a block queued behind a busy actor (Ray Data's
                            # default is several in flight) waits a whole batch while another actor idles;
                            # measured: 2 blocks of 16 rows both went to the first actor ready, the other idle
                            compute=ray.data.ActorPoolStrategy(size=cfg.concurrency, max_tasks_in_flight_per_actor=1),
                            max_task_retries=cfg.max_task_retries, **cfg.resources(),
                            **({"runtime_env": cfg.runtime_env} if cfg.runtime_env else {}))
        return ds

    def _store(self):
        """specee: the schedule store actor (started on the first call), else None."""
        cfg = self.config
        if cfg.mode != "specee":
            return None
        if self.store is None:
            from pathlib import Path

            from pipeline.schedule_store import remote_store
            from specee_core.early_exit.scheduler import Schedule
            from specee_core.early_exit.step import initial_schedule

            opts = cfg.engine_options
            start = Schedule.load(cfg.schedule) if cfg.schedule else initial_schedule(Path(cfg.model))
            self.store_name = f"specee-schedule-{self.run_id}"
            self.store = remote_store(self.store_name, start, cfg.retune_every_tokens, cfg.retune_min_exits,
                                      opts.get("max_disagreement"), opts.get("confidence", 0.95))
        return self.store

    def _ledger(self):
        if self.ledger is None:
            self.ledger = ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)(RunLedger) \
                .options(name=f"specee-ledger-{self.run_id}").remote()
        return self.ledger

    def schedule_state(self) -> dict | None:
        """specee: the schedule store's versions, per-version statistics and audit; None otherwise (or
        when the store was lost)."""
        if self.store is None:
            return None
        try:
            return ray.get(self.store.state.remote(), timeout=60)
        except (ray.exceptions.RayError, TimeoutError) as e:
            log.warning("schedule store lost (%s): no store state", e)
            return None

    def engines(self) -> list[dict]:
        """What each engine actor ran with (GenerateRows.describe; in mode auto the plan and its choices)."""
        if self.ledger is None:
            return []
        try:
            return ray.get(self.ledger.engine_infos.remote(), timeout=60)
        except (ray.exceptions.RayError, TimeoutError) as e:
            log.warning("run ledger lost (%s): no engine descriptions", e)
            return []

    def shutdown(self) -> None:
        """Stop the processor's helper actors (the schedule store, the ledger) once its datasets have run."""
        for a in (self.store, self.ledger):
            if a is not None:
                ray.kill(a)
        self.store = self.ledger = None

    def config_json(self) -> dict:
        return asdict(self.config)


def build_processor(config: ProcessorConfig, preprocess: Callable[[dict], dict] | None = None,
                    postprocess: Callable[[dict], dict] | None = None, run_id: str | None = None) -> Processor:
    """A callable Dataset -> Dataset running the engine over rows with `id` and `prompt` (Ray Data
    LLM's build_llm_processor shape); preprocess / postprocess: optional row -> row functions; run_id:
    what the rows' run_id column says (default: a new id)."""
    return Processor(config, preprocess, postprocess, run_id)
