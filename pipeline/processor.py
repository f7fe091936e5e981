"""The engine as a Ray Data processor: Dataset -> Dataset, in Ray Data LLM's shape and names.

    import ray
    from pipeline import ProcessorConfig, build_processor

    processor = build_processor(
        ProcessorConfig(model_source="models/smollm2-135m-instruct", concurrency=2, batch_size=16),
        preprocess=lambda row: dict(messages=[{"role": "user", "content": row["question"]}],
                                    sampling_params=dict(temperature=0.3, max_tokens=250)),
        postprocess=lambda row: dict(answer=row["generated_text"], **row))
    processor(ray.data.read_json("questions.jsonl")).write_parquet("out/")

A pipeline written for Ray Data LLM runs after changing its import to `from pipeline import
ProcessorConfig as vLLMEngineProcessorConfig, build_processor as build_llm_processor`
(tests/pipeline/test_processor.py runs Ray's documented example so).

Input rows need `messages` (chat messages, {"role", "content"}, through the model's chat template) or
`prompt`: a string (through the chat template as the user's message when the model has one, unless
apply_chat_template=False) or a list of chat messages. `id` is optional (a new one where missing). A row
may set its own sampling with vLLM's names, in `sampling_params` or columns of their own (max_tokens,
temperature, top_p, top_k, min_p, seed, stop, ignore_eos, ...; pipeline.sampling); the rest take the config's.
Stages:
1. an optional user `preprocess` (row -> row, Dataset.map);
2. prepare (light CPU actors: the tokenizer loaded once each): the chat template, the row's sampling,
   validation; a row that cannot run keeps its reason in `input_error`;
3. the engine: an actor pool (`map_batches` with `concurrency`, `batch_size`, `num_cpus` /
   `num_gpus`); each actor loads one engine (pipeline.stage.GenerateRows) and turns a batch into one
   engine call and one output row per input row, with up to `max_concurrent_batches` batches in flight
   (threads of the actor whose rows share the engine's decode steps: a batch's last rows decode beside
   the next batch's first, not alone): `generated_text`, `num_input_tokens`,
   `num_generated_tokens` (Ray Data LLM's names), `error` (null unless the row failed: InputError,
   PromptError, WorkerDied, or the engine's exception for that row alone), `error_kind` ("input": the
   row's own, "machine": out of memory, a device error, a lost worker; pipeline.stage.error_kind) and the
   per-row statistics the batch job writes (pipeline.stage.ROW_SCHEMA, whose `completion`, `prompt_tokens` and `completion_tokens`
   the rows keep as deprecated aliases). `prompt` is the text the engine ran for chat messages, the
   prompt as given otherwise. Detokenizing happens in the engine, as tokens are chosen, because stop
   strings are matched on the text. The input's other columns are carried through;
4. an optional user `postprocess` (row -> row), run in the engine actors on their output rows (the
   engine's columns keep their types even where a batch holds only error rows), on the threads of the
   batches in flight: it may run for two batches at once.

In mode "specee" the processor starts a schedule store actor (pipeline.schedule_store) on its first
call: engines report exit statistics to it, pick up re-tuned versions (and, with a tolerance, the
audit's closed layers) between batches, and each row records the version it ran with.
`processor.schedule_state()` returns the store's state after the dataset has run.

Fault tolerance is Ray Data's own, plus a ledger: the engine actors restart when they die (max_restarts
-1) and the batches that were running on a dead actor run again (`max_task_retries`). A call that
runs past `batch_timeout_s` (a hang) stops its process, as a crash would. A RunLedger actor records which
calls started and never finished: a call that hung, or whose process died twice, runs again in a quarantine
(pipeline.quarantine: a child process of the actor with its own engine), whole (unless it hung), then row by
row, and a
row that kills or hangs a fresh process `row_attempts` times alone becomes an error row ("WorkerDied:
...", error_kind "input"), whatever the number of such rows. A death takes every batch in flight in the
process with it, and each is charged one (EngineRows says how). An engine *exception* never fails the
dataset either: it costs only its rows (error rows). Ray warns that actors whose constructor arguments live in the object store may not restart
(ray-project/ray#53727); measured here (tests/pipeline/test_chaos.py: engine processes SIGKILLed mid-run,
the schedule store too) they do restart while the dataset runs, and every row comes back exactly once.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
import time
import uuid
from typing import Callable

import numpy as np
import pandas as pd
import pyarrow as pa
import ray
from ray.data.extensions import ArrowPythonObjectArray

from pipeline.inflight import EngineGate
from pipeline.processor_config import ProcessorConfig
from pipeline.prompts import ERROR_PROMPT_CHARS, ERROR_TEXT_CHARS, MAX_PROMPT_CHARS, bounded, text_error, valid_text
from pipeline.quarantine import Died, Quarantine
from pipeline.sampling import COLUMN as SAMPLING_COLUMN, ROW_COLUMNS as SAMPLING_COLUMNS, row_fields, to_sampling
from pipeline.stage import OUTPUT_SCHEMA, WORKER_DIED, GenerateRows, StageConfig
from specee_core import SamplingParams

log = logging.getLogger(__name__)

INTERNAL = ("input_error", "text", "_sampling")  # columns the processor adds for its own stages
# Ray Data LLM's names of the engine's columns -> ROW_SCHEMA's (the batch job's files keep those)
RAY_DATA_LLM_COLUMNS = {"generated_text": "completion", "num_input_tokens": "prompt_tokens",
                        "num_generated_tokens": "completion_tokens"}


class PrepareRows:
    """Stage 2: the prompt text of each row (chat template) and its sampling, or why there is none.
    Loads only the tokenizer."""

    def __init__(self, model: str, chat: bool | None, defaults: SamplingParams,
                 max_prompt_chars: int = MAX_PROMPT_CHARS):
        """chat: string prompts through the chat template (None: when the model has one); defaults: the
        sampling of rows that set none; max_prompt_chars: a longer prompt (or messages) is an error row, before
        any template or tokenizer sees it."""
        from specee_core.model.loader import load_tokenizer

        self.tok = load_tokenizer(model)
        has_template = getattr(self.tok, "chat_template", None) is not None
        self.chat = has_template if chat is None else chat
        if self.chat and not has_template:
            raise ValueError(f"apply_chat_template=True but {model} has no chat template")
        self.defaults = defaults
        self.max_prompt_chars = max_prompt_chars

    def __call__(self, batch: pd.DataFrame) -> pa.Table:
        # pandas batches: Ray Data concatenates them without casting, where Arrow blocks of one column typed
        # null (a block whose prompts are all missing) and string cannot be concatenated
        if "prompt" not in batch.columns and "messages" not in batch.columns:
            raise ValueError(f"the processor's input needs a 'messages' or a 'prompt' column; "
                             f"got {list(batch.columns)}")
        n = len(batch)
        column = {c: batch[c].tolist() if c in batch.columns else [None] * n
                  for c in ("id", "prompt", "messages", "input_error")}
        own = [c for c in (SAMPLING_COLUMN, *SAMPLING_COLUMNS) if c in batch.columns]
        sampling_cells = {c: batch[c].tolist() for c in own}
        texts, errors, shown, sampling = [], [], [], []
        for i in range(n):
            prompt, messages = to_python(column["prompt"][i]), to_python(column["messages"][i])
            reason = column["input_error"][i]  # a reader that already found the row unusable (pipeline.prompts)
            if not is_missing(reason):
                text, error = None, reason
            elif (wrong := unusable_text(prompt, messages, self.max_prompt_chars)) is not None:
                text, error = None, wrong
            elif messages is not None:  # Ray Data LLM's column: its rendering is the row's prompt
                text, error = self._chat(messages, "messages")
                prompt = text if text is not None else json.dumps(messages, default=repr)[:10000]
            else:
                text, error = self._text(prompt)
            params = None
            if error is None:
                try:
                    got = row_fields({c: to_python(sampling_cells[c][i]) for c in own})
                    to_sampling(got, self.defaults)  # checked here; the engine stage maps them again
                    params = json.dumps(got) if got else None
                except (ValueError, TypeError, RecursionError) as e:  # TypeError: a value JSON cannot hold
                    error = str(e)
            texts.append(text)
            errors.append(None if error is None else valid_text(bounded(error, ERROR_TEXT_CHARS)))
            sampling.append(params)
            if not isinstance(prompt, str) and prompt is not None:
                prompt = json.dumps(prompt, default=repr)[:10000]
            shown.append(prompt if error is None or prompt is None else valid_text(prompt[:ERROR_PROMPT_CHARS]))
        ids = [uuid.uuid4().hex if is_missing(i) else valid_text(str(i)) for i in column["id"]]  # id is optional
        keep = [c for c in batch.columns if c not in ("id", "prompt", *INTERNAL)]
        return pa.table({"id": pa.array(ids, pa.string()), "prompt": pa.array(shown, pa.string()),
                         "text": pa.array(texts, pa.string()), "input_error": pa.array(errors, pa.string()),
                         "_sampling": pa.array(sampling, pa.string()),
                         **{c: arrow_column([to_python(v) for v in batch[c].tolist()]) for c in keep}})

    def _text(self, prompt) -> tuple[str | None, str | None]:
        if isinstance(prompt, str):
            if not prompt:  # the engine refuses it: a PromptError, as in Serve
                return prompt, None
            return (self._render([{"role": "user", "content": prompt}]) if self.chat else (prompt, None))
        if isinstance(prompt, (list, tuple)) and prompt:
            return self._chat(prompt, "prompt")
        return None, f"prompt must be a string or a list of chat messages, got {type(prompt).__name__}"

    def _chat(self, messages, name: str) -> tuple[str | None, str | None]:
        if not isinstance(messages, (list, tuple)) or not messages:
            return None, f"{name} must be a non-empty list of chat messages, got {messages!r:.60}"
        if not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                   for m in messages):
            return None, "chat messages must be {'role': str, 'content': str} objects"
        return self._render([{"role": m["role"], "content": m["content"]} for m in messages])

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


def unusable_text(prompt, messages, max_chars: int) -> str | None:
    """Why a row's prompt or messages cannot run, found before anything renders or tokenizes them: more than
    max_chars characters in all, or text that is not valid Unicode (a lone surrogate)."""
    texts = []
    for value in (prompt, messages):
        if isinstance(value, str):
            texts.append(value)
        elif isinstance(value, (list, tuple)):
            texts += [m.get(k) for m in value if isinstance(m, dict) for k in ("role", "content")
                      if isinstance(m.get(k), str)]
    chars = sum(map(len, texts))
    if chars > max_chars:
        return f"the prompt has {chars:,} characters, more than max_prompt_chars={max_chars:,}"
    return next((wrong for t in texts if (wrong := text_error(t, "the prompt")) is not None), None)


# a batch runs this often in its actor, then in a Quarantine: most deaths are the machine's (a lost or killed
# worker), and a rerun in place costs no second engine
IN_PLACE_TRIES = 2


class RunLedger:
    """One per processor (a named actor, no CPU): which engine calls started and never finished, and
    what each engine runs with.

    An engine actor that dies takes its call with it; Ray Data restarts the actor and runs the call
    again. The ledger lets the rerun know how many earlier starts of the call died, so that a call that
    hung, or died IN_PLACE_TRIES times, runs again in a pipeline.quarantine.Quarantine (a child process),
    where rows that kill or hang their process become error rows without costing the actor, its batch
    mates or the dataset. If the ledger itself is lost it restarts empty: calls then run as on their first try."""

    def __init__(self):
        self.started: dict[str, int] = {}  # key -> starts that did not finish
        self.hangs: set[str] = set()  # keys a start of which overran the per-batch timeout
        self.verdicts: dict[str, str] = {}  # row id -> the error of a row that killed or hung its process alone
        self.engines: dict[str, dict] = {}  # worker -> what it runs with (GenerateRows.describe)

    def begin(self, key: str, ids: list[str]) -> tuple[int, bool, dict[str, str]]:
        """Record a start of `key` (a call over rows `ids`); returns how many earlier starts never finished,
        whether one hung, and the verdicts already reached on its rows (a call can run again after it
        finished, when its actor died before the answer left it)."""
        n = self.started.get(key, 0)
        self.started[key] = n + 1
        return n, key in self.hangs, {i: self.verdicts[i] for i in ids if i in self.verdicts}

    def hung(self, key: str) -> None:
        self.hangs.add(key)

    def verdict(self, row_id: str, error: str) -> None:
        self.verdicts[row_id] = error

    def end(self, key: str) -> None:
        self.started.pop(key, None)
        self.hangs.discard(key)

    def engine(self, worker: str, info: dict) -> None:
        self.engines[worker] = info

    def engine_infos(self) -> list[dict]:
        return list(self.engines.values())


class EngineRows:
    """Stage 3: one engine per actor (pipeline.stage.GenerateRows); the input's own columns are
    carried through to the output rows. A call runs under the per-batch timeout (a hang stops the
    process, as a crash would); a call that hung, or died IN_PLACE_TRIES times, runs again in a Quarantine
    (RunLedger).

    Calls run on up to max_concurrent_batches threads of the actor at once (Ray Data's
    max_concurrent_calls_per_actor), their rows decoding side by side in the one engine. A process that
    dies, by a crash or stopped at a call's timeout, takes every call in flight with it; how that is charged:
    - each call in flight had told the ledger it began, and Ray Data runs each again: each counts a death
      (RunLedger.begin), whichever call's row was the cause, so a call beside a crashing one may run in
      quarantine too; there it runs whole, alone, and succeeds at the cost of one engine load;
    - only the call whose timer fired is marked hung (its rerun skips the whole-batch try); the others
      count a death as for a crash;
    - the quarantine narrows the fault down: the call whole in a process of its own, then its rows one by
      one. Calls that reach it take turns (one child process per actor), and no call runs in place
      meanwhile: a neighbour's crash cannot take the quarantine's progress with it, and the child has the
      actor's CPUs.
    Every call that started and did not return runs again, and rows reach the output only with their call's
    return: every row once, whatever the number of calls in flight."""

    def __init__(self, stage: StageConfig, run_id: str, store=None, ledger=None,
                 postprocess: Callable[[dict], dict] | None = None):
        """store, ledger: the schedule store and RunLedger actors (handles: the dataset holding them keeps
        them alive while it runs, even when the Processor that made them is gone) or None."""
        self.rows = GenerateRows(stage, run_id, store)
        self.postprocess = postprocess
        self.ledger = ledger
        self.quarantine: Quarantine | None = None
        # calls in place share the actor; a call in the quarantine has it alone (calls behind it wait, before their
        # timeout starts)
        self._placement = EngineGate()
        self._calls = threading.Lock()
        self._in_flight = self._peak = self._peak_described = 0  # calls of this actor running now, the most at once
        self._describe()

    def _describe(self) -> None:
        if self.ledger is not None:
            self._peak_described = self._peak
            self.ledger.engine.remote(self.rows.worker, {**self.rows.describe(), "peak_batches_in_flight": self._peak})

    def _begin(self, key: str, ids: list[str]) -> tuple[int, bool, dict[str, str]]:
        if self.ledger is None:
            return 0, False, {}
        try:
            return ray.get(self.ledger.begin.remote(key, ids))
        except ray.exceptions.RayError as e:  # the ledger is gone: run as a first try
            log.warning("run ledger lost (%s)", e)
            self.ledger = None
            return 0, False, {}

    def _hung(self, key: str) -> None:
        """Tell the ledger this call hung (the process is about to stop itself): its rerun runs quarantined."""
        if self.ledger is not None:
            try:
                ray.get(self.ledger.hung.remote(key), timeout=10)
            except (ray.exceptions.RayError, TimeoutError) as e:
                log.warning("could not record the hang in the run ledger (%s)", e)

    def _end(self, key: str) -> None:
        if self.ledger is not None:
            self.ledger.end.remote(key)

    def _generate(self, mine: pa.Table) -> pa.Table:
        """The engine's rows for mine: here, or in the quarantine when earlier starts of this call died."""
        ids = mine["id"].to_pylist()
        key = "batch:" + hashlib.blake2b("\x00".join(map(str, ids)).encode(), digest_size=16).hexdigest()
        deaths, hung, known = self._begin(key, ids)
        todo = mine if not known else mine.filter(pa.array([i not in known for i in ids]))
        if not todo.num_rows:
            out = todo
        elif deaths < IN_PLACE_TRIES and not hung:
            with self._placement.shared(), deadline(self.rows.cfg.batch_timeout_s, len(ids), lambda: self._hung(key)):
                out = self.rows(todo)
        else:
            log.warning("a call of %d rows %s: running it in a quarantined process", len(ids),
                        "hung" if hung else f"died {deaths} time(s)")
            with self._placement.exclusive():
                try:
                    out = self._quarantined(todo, whole=not hung)
                finally:  # its engine would double this actor's memory for the rest of the run
                    if self.quarantine is not None:
                        self.quarantine.close()
        if known:  # rows judged before (this call ran already, its answer lost with its actor): not run again
            judged = [self.rows.error_rows(mine.slice(r, 1), known[i], kind="input") for r, i in enumerate(ids)
                      if i in known]
            out = pa.concat_tables([out, *judged]) if out.num_rows else pa.concat_tables(judged)
        self._end(key)
        # the plan's choices so far in mode auto, and a new peak of calls in flight (else: as described at start)
        if self.rows.cfg.mode == "auto" or self._peak > self._peak_described:
            self._describe()
        return out

    def _quarantined(self, mine: pa.Table, whole: bool) -> pa.Table:
        """mine in a child process: whole (unless it hung: a hang would cost another timeout), then if that
        dies row by row, each row up to row_attempts deaths before it becomes an error row. With the actor to
        itself (_placement)."""
        cfg = self.rows.cfg
        if self.quarantine is None:
            self.quarantine = Quarantine(cfg, self.rows.run_id, cfg.batch_timeout_s, self.rows.worker)
        if whole:
            try:
                return self.quarantine.run(mine)
            except Died as e:
                log.warning("the whole call died in quarantine too (%s): its rows one by one", e)
        rows = []
        for i in range(mine.num_rows):
            row = mine.slice(i, 1)
            for attempt in range(1, cfg.row_attempts + 1):
                try:
                    rows.append(self.quarantine.run(row))
                    break
                except Died as e:
                    log.warning("row %s: %s (attempt %d of %d)", row["id"][0].as_py(), e, attempt, cfg.row_attempts)
                    if attempt == cfg.row_attempts:
                        # it fails again unless the row changes: its own ("input"), not the machine's
                        error = f"{WORKER_DIED}: {e}; {attempt} time(s) running this row alone in a fresh process"
                        if self.ledger is not None:
                            self.ledger.verdict.remote(row["id"][0].as_py(), error)
                        rows.append(self.rows.error_rows(row, error, kind="input"))
        return pa.concat_tables(rows)

    def __call__(self, batch: pd.DataFrame) -> pa.Table:
        mine = pa.table({c: pa.array([None if is_missing(v) else v for v in batch[c].tolist()], pa.string())
                         for c in ("id", "prompt", "text", "input_error", "_sampling")})
        with self._calls:
            self._in_flight += 1
            self._peak = max(self._peak, self._in_flight)
        try:
            out = self._generate(mine)
        finally:
            with self._calls:
                self._in_flight -= 1
        for name, same in RAY_DATA_LLM_COLUMNS.items():
            out = out.append_column(name, out[same])
        for name in batch.columns:
            if name not in out.column_names and name not in INTERNAL:
                out = out.append_column(name, arrow_column([to_python(v) for v in batch[name].tolist()]))
        if self.postprocess is None:
            return out
        # the user's postprocess runs here, on typed rows, and the engine's columns keep their types: a
        # batch whose completions are all null (error rows) must not become a column of Arrow type null
        rows = [self.postprocess(r) for r in out.to_pylist()]
        names = list(dict.fromkeys(k for r in rows for k in r))
        types = {f.name: f.type for f in OUTPUT_SCHEMA}
        types.update({name: types[same] for name, same in RAY_DATA_LLM_COLUMNS.items()})
        return pa.table({n: pa.array([r.get(n) for r in rows], types[n]) if n in types else
                         arrow_column([r.get(n) for r in rows]) for n in names})


@contextlib.contextmanager
def deadline(timeout_s: float | None, rows: int, on_hang: Callable[[], None]):
    """Stop this process if the block takes longer than timeout_s (after calling on_hang): a hung engine call
    cannot be interrupted from another thread, and a process that dies is what the actor pool recovers from
    (the call runs again, in a quarantine; the other calls in flight run again too)."""
    if timeout_s is None:
        yield
        return

    def hung() -> None:
        on_hang()
        log.error("an engine call of %d rows is still running after %g s (the per-batch timeout): stopping "
                  "process %d", rows, timeout_s, os.getpid())
        logging.shutdown()
        os._exit(3)

    timer = threading.Timer(timeout_s, hung)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


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


def arrow_column(values: list) -> pa.Array:
    """A carried column as Arrow: its own type, or where its values have none in common (5 and "x") Ray Data's
    column of pickled Python objects, as Ray Data itself stores such a column."""
    try:
        return pa.array(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, UnicodeEncodeError):
        return ArrowPythonObjectArray.from_objects(values)  # UnicodeEncodeError: text with a lone surrogate


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
        stage = cfg.stage()
        ds = ds.map_batches(PrepareRows, fn_constructor_kwargs={"model": cfg.model_source,
                                                                "chat": cfg.apply_chat_template,
                                                                "defaults": stage.sampling(),
                                                                "max_prompt_chars": cfg.max_prompt_chars},
                            batch_format="pandas", compute=ray.data.ActorPoolStrategy(size=1), num_cpus=0,
                            batch_size=cfg.batch_size)
        ds = blocks_of(ds, cfg.batch_size)
        # compute: up to max_concurrent_batches calls at once per actor, on threads of their own
        ds = ds.map_batches(EngineRows, fn_constructor_kwargs={"stage": stage, "run_id": self.run_id,
                                                               "store": self._store(), "ledger": self._ledger(),
                                                               "postprocess": self.postprocess},
                            batch_format="pandas", batch_size=cfg.batch_size, compute=cfg.compute(),
                            **cfg.resources(), **({"runtime_env": cfg.runtime_env} if cfg.runtime_env else {}),
                            # -1 is Ray Data's own default for an actor pool; a bound goes in as a remote arg
                            **({} if cfg.max_task_retries == -1 else {"max_task_retries": cfg.max_task_retries}))
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

            opts = cfg.engine_kwargs
            start = Schedule.load(cfg.schedule) if cfg.schedule else initial_schedule(Path(cfg.model_source))
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


def build_processor(config: ProcessorConfig, preprocess: Callable[[dict], dict] | None = None,
                    postprocess: Callable[[dict], dict] | None = None, run_id: str | None = None) -> Processor:
    """A callable Dataset -> Dataset running the engine over rows with `messages` or `prompt` (Ray Data
    LLM's build_processor / build_llm_processor); preprocess / postprocess: optional row -> row functions;
    run_id: what the rows' run_id column says (default: a new id)."""
    return Processor(config, preprocess, postprocess, run_id)
