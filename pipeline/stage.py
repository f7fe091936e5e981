"""The generation stage: a stateful callable that loads one SpecEE engine per Ray actor and
turns a batch of prompt rows into output rows (one per input row, failures included). Several
batches may be in flight at once (pipeline.inflight): their rows share the engine's decode steps."""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import pyarrow as pa
import ray

from pipeline.inflight import EngineGate, PlanSteps
from pipeline.prompts import ERROR_PROMPT_CHARS, ERROR_TEXT_CHARS, bounded, valid_text
from pipeline.sampling import choice_params, choices, to_sampling
from specee_core import EngineOptions, PromptError, SamplingParams, SpecEEEngine
from specee_core.options import default
from specee_core.model.config import resolve_dtype
from specee_core.model.quant import WEIGHT_FORMATS
from specee_core.decode.engine import MODES
from specee_core.machine import machine_facts
from specee_core.early_exit.scheduler import Schedule
from specee_core.spec.spec_decode import SpecOptions

log = logging.getLogger(__name__)

LOGPROBS = pa.list_(pa.struct([("token", pa.int64()), ("logprob", pa.float64()),
                               ("top_logprobs", pa.list_(pa.struct([("token", pa.int64()), ("logprob", pa.float64())])))]))
# One output row per input row (GenerateRows). Error rows keep id, prompt, mode, run_id, the batch
# columns, error and error_kind; the rest is null. Row-level timings are the row's own; batch_* columns
# describe the engine batch the row ran in (the same on every row of that batch).
ROW_SCHEMA = pa.schema([
    ("id", pa.string()),
    ("prompt", pa.string()),
    ("completion", pa.string()),
    ("finish_reason", pa.string()),
    ("prompt_tokens", pa.int32()),
    ("cached_prompt_tokens", pa.int32()),  # of them, found in the engine's prefix cache (not prefilled)
    ("completion_tokens", pa.int32()),
    ("exit_layers", pa.list_(pa.int16())),  # per generated token: decoder layers run (1-based)
    # per generated token, when the row asks (logprobs: k): its log-probability and the k most likely tokens'
    ("logprobs", LOGPROBS),
    # when the row asks n > 1 completions: each of them, the first being the row's completion (the columns
    # above and below describe that one); null otherwise
    ("choices", pa.list_(pa.struct([("index", pa.int32()), ("completion", pa.string()),
                                    ("finish_reason", pa.string()), ("completion_tokens", pa.int32()),
                                    ("logprobs", LOGPROBS)]))),
    ("avg_layers", pa.float64()),
    # this row, from when its batch's rows were handed to the engine (waiting for a free engine row included, as
    # batches in flight share it): to its own last token, and to its first token
    ("latency_s", pa.float64()),
    ("ttft_s", pa.float64()),
    ("mode", pa.string()),
    ("schedule_version", pa.int32()),  # the SpecEE schedule the row ran with; null unless mode is specee
    ("num_layers", pa.int16()),
    ("retune_histogram", pa.list_(pa.int32())),  # [L] what the scheduler update rule consumes; null if none
    ("audit_exits", pa.list_(pa.int32())),  # [L] per exit layer: exits run on to full depth; null without audit
    ("audit_disagree", pa.list_(pa.int32())),  # [L] of them, those the full model would have chosen otherwise
    ("batch_id", pa.string()),  # <worker>-<n>: the actor call the row ran in
    ("batch_rows", pa.int32()),  # rows in that call
    ("batch_started_at", pa.float64()),  # unix seconds when that call started
    ("batch_s", pa.float64()),  # wall seconds of that call (every row of it; other calls in flight overlap it)
    # <actor id prefix>@<node id prefix>:<pid> of the engine actor (a restarted actor: a new pid, maybe another
    # node), then "/<pid>" for its quarantined child
    ("worker", pa.string()),
    ("run_id", pa.string()),
    ("error", pa.string()),  # null when the row succeeded
    ("error_kind", pa.string()),  # ERROR_KINDS: the row's own (input) or the machine's; null when it succeeded
])
# The batch job's part files: the rows plus the request hash the reader gave each input row
# (pipeline.prompts.request_hash, carried through the processor), which a resume compares
OUTPUT_SCHEMA = ROW_SCHEMA.append(pa.field("request_hash", pa.string()))
# input: the row's own (a bad prompt or sampling value, or an error its prompt raises whenever it runs
# alone): it fails again unless the row changes. machine: out of memory, a device error, a lost worker:
# the row may well succeed when run again (the batch job's retry_errors)
ERROR_KINDS = ("input", "machine")
WORKER_DIED = "WorkerDied"  # the error of a row that killed or hung its engine process (pipeline.quarantine)

# Test hook: the first actor call that finds this marker file missing creates it and kills its
# own process after generating, before returning (an actor lost mid-wave, work in flight).
CRASH_ONCE_ENV = "SPECEE_PIPELINE_CRASH_ONCE"
# Test hook: an actor call whose batch has a prompt equal to this value kills its process, every time.
CRASH_ON_ENV = "SPECEE_PIPELINE_CRASH_ON"
# Test hook: an actor call whose batch has a prompt equal to this value never returns (a hang).
HANG_ON_ENV = "SPECEE_PIPELINE_HANG_ON"
# EngineOptions a stage may set beside those it sets itself (batch size, KV budget, prefix cache)
CORE_OPTIONS = ("context_len", "prefill_chunk", "kv_block_size")


@dataclass(frozen=True)
class StageConfig:
    """How each actor loads its engine and generates."""
    model: str
    mode: str = "auto"  # lossless: dense or speculative decoding per step, by the measured plan
    device: str = "cpu"
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16; auto: bf16 where the hardware computes it natively
    weights: str = "auto"  # auto | fp32 | bf16 | q8 | q4 (specee_core.model.quant); auto: the checkpoint's own low-bit
    #                        format where it has one and it is faster here at batch_size, else the dtype
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    batch_size: int = default("max_batch_size")  # rows per actor call, also the engine's max batch
    torch_threads: int | None = None  # None: the CPUs Ray gave the actor, at least 1
    chat: bool | None = None  # prompt = a user message through the chat template; None: when the model has one
    engine_options: dict = field(default_factory=dict)  # early-exit options (EarlyExitOptions), specee only
    spec: dict = field(default_factory=dict)  # speculative decoding options (SpecOptions: proposer, depth): spec, auto
    engines_per_node: int = 1  # engine actors sharing a node: each takes its share of the default KV budget
    kv_cache_gb: float | None = None  # each engine's KV budget (EngineOptions.kv_cache_gb); None: that share
    prefix_cache: bool = True  # reuse full prompt blocks (a shared chat template, system prompt) across rows
    core_options: dict = field(default_factory=dict)  # more EngineOptions (CORE_OPTIONS), every mode
    # an engine call (one batch) still running after this many seconds is a hang: its process is stopped and
    # the batch runs again (pipeline.quarantine); None: no limit. 900 s is 20-50x what a batch of 16 rows of
    # 512 tokens takes on a 2-core CPU with a 135M model: raise it for long outputs on large models
    batch_timeout_s: float | None = 900.0
    # a row that kills or hangs a fresh engine process this many times, running alone, becomes an error row
    row_attempts: int = 2
    # batches in flight per engine (Ray Data LLM's max_concurrent_batches): the actor takes the next batch while
    # the engine still decodes the last rows of the current one, so those rows never decode alone; 1: one engine
    # call at a time (the default: two in flight ran slower than one on a 2-core CPU, docs/RESULTS.md).
    # A process that dies takes every batch in flight with it (pipeline.processor.EngineRows)
    max_concurrent_batches: int = 1

    def __post_init__(self) -> None:
        if self.batch_timeout_s is not None and not self.batch_timeout_s > 0:
            raise ValueError(f"batch_timeout_s must be > 0 or None, got {self.batch_timeout_s!r}")
        if not isinstance(self.row_attempts, int) or self.row_attempts < 1:
            raise ValueError(f"row_attempts must be an int >= 1, got {self.row_attempts!r}")
        if not isinstance(self.max_concurrent_batches, int) or self.max_concurrent_batches < 1:
            raise ValueError(f"max_concurrent_batches must be an int >= 1, got {self.max_concurrent_batches!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.dtype != "auto":
            resolve_dtype(self.dtype)  # a bad name fails here, naming the choices
        if self.weights != "auto" and self.weights not in WEIGHT_FORMATS:
            raise ValueError(f"weights must be 'auto' or one of {WEIGHT_FORMATS}, got {self.weights!r}")
        if self.spec:
            if self.mode not in ("spec", "auto"):
                raise ValueError(f"spec options {self.spec} apply to mode='spec' or 'auto' only, mode is {self.mode!r}")
            SpecOptions(**self.spec)  # bad names and values fail here, not in every actor
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.torch_threads is not None and self.torch_threads < 1:
            raise ValueError(f"torch_threads must be >= 1, got {self.torch_threads}")
        unknown = sorted(set(self.core_options) - set(CORE_OPTIONS))
        if unknown:
            raise ValueError(f"core_options takes {', '.join(CORE_OPTIONS)}; got {unknown}")
        self.engine()  # bad values fail here, not in every actor
        self.sampling()  # the defaults of every row that sets none: top_p, top_k, stop checked too

    def engine(self) -> EngineOptions:
        """The options each actor builds its engine with. With batches in flight a lane opens with room for every
        engine row: the next batches' rows join it as the current ones finish (sized to the rows waiting, it would
        keep a small batch's size for its life)."""
        return EngineOptions(max_batch_size=self.batch_size, engines_per_node=self.engines_per_node,
                             kv_cache_gb=self.kv_cache_gb, prefix_cache=self.prefix_cache,
                             min_lane_rows=self.batch_size if self.max_concurrent_batches > 1 else 1,
                             **self.core_options)

    def sampling(self) -> SamplingParams:
        """What a row runs with when it sets no sampling of its own (pipeline.sampling)."""
        return SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, stop=list(self.stop), seed=self.seed)


class GenerateRows:
    """One engine, loaded once, turning PROMPT_SCHEMA batches into ROW_SCHEMA rows: one engine call
    per batch, each row with its own SamplingParams (a `_sampling` column: the row's sampling fields as
    JSON, checked by the processor's prepare stage; null or absent: the config's).

    Thread-safe: calls from several threads (the batches in flight, up to cfg.max_concurrent_batches)
    hand their rows to the engine core at once (SpecEEEngine.submit), and the rows of every call share
    its decode steps; each call returns when its own last row finishes. What must not overlap other
    calls' rows waits for them (pipeline.inflight.EngineGate): a new schedule, and the rows of a call
    that raised, run again one at a time, alone.

    It runs inside each engine actor of pipeline.processor (EngineRows), which the batch job
    (pipeline.batch) uses too. In SpecEE mode it follows the run's schedule store: the latest
    version is fetched once at start, then picked up before each batch without waiting (a request
    is kept in flight and only read once answered) and applied once the rows in flight are done, and
    each batch's exit statistics are sent back without waiting either."""

    def __init__(self, cfg: StageConfig, run_id: str, store=None, schedule: Schedule | None = None):
        """store: the schedule store actor, or its name (None: none)."""
        import torch

        self.cfg = cfg
        self.run_id = run_id
        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1) if ray.is_initialized() else 1
        torch.set_num_threads(cfg.torch_threads or max(1, int(cpus)))
        self.worker = worker_name()
        self.batches = 0
        self._submitted = 0  # engine calls submitted: each call's admission priority
        early_exit = cfg.engine_options if cfg.mode == "specee" or cfg.spec.get("t3") else {}
        if not os.path.isdir(cfg.model):
            # on a cluster each node loads the model from its own disk: the path must exist on every node
            raise FileNotFoundError(f"{cfg.model}: no such model directory on node {socket.gethostname()} (every "
                                    f"node that runs an engine needs the model at this path: a shared filesystem, "
                                    f"or a copy at the same path)")
        self.engine = SpecEEEngine.from_pretrained(cfg.model, device=cfg.device, dtype=cfg.dtype, weights=cfg.weights,
                                                   **vars(cfg.engine()), **early_exit)
        self.engine.stepper_factory(cfg.mode, dict(cfg.spec) or None)  # a mode it cannot run fails here, not per row
        if cfg.mode == "auto":  # measured (or read from the cache) now, not in the first batch
            self.engine.prepare_plan([cfg.batch_size], dict(cfg.spec) or None)
        self.plan_steps = PlanSteps()  # mode auto: the planner's choices over every batch
        self.gate = EngineGate(on_idle=self.plan_steps.fold)
        self._lock = threading.Lock()  # the batch counter, the store's answer in flight
        self.defaults = cfg.sampling()
        self.num_layers = self.engine.config.num_hidden_layers
        self.chat = self.engine.has_chat_template if cfg.chat is None else cfg.chat
        if self.chat and not self.engine.has_chat_template:
            raise ValueError(f"chat=True but {cfg.model} has no chat template")
        self.store = None
        self._pending = None  # the store's answer to "anything newer than my version?", in flight
        if cfg.mode == "specee":
            if schedule is not None:
                self.engine.set_schedule(schedule)
            if store is not None:
                self.store = ray.get_actor(store) if isinstance(store, str) else store
                latest = self._newer_schedule(wait_s=60.0)
                if latest is not None:
                    self._set_schedule(latest)
        log.info("actor %s: %s on %s, mode %s, schedule v%s", self.worker, cfg.model, cfg.device, cfg.mode,
                 self._version())

    def _version(self) -> int | None:
        return None if self.cfg.mode != "specee" or self.engine.schedule is None else self.engine.schedule.version

    def _newer_schedule(self, wait_s: float = 0.0) -> Schedule | None:
        """The store's newer schedule if its answer is in (waiting at most wait_s), else None; asks again when
        no question is in flight."""
        with self._lock:
            if self.store is None:
                return None
            if self._pending is None:
                self._pending = self.store.latest.remote(self._version())
            ready, _ = ray.wait([self._pending], timeout=wait_s)
            if not ready:
                return None
            answer, self._pending = self._pending, None
            try:
                latest = ray.get(answer)
            except ray.exceptions.RayError as e:  # the store is gone: keep the version we have
                log.warning("actor %s: schedule store lost (%s); staying on v%s", self.worker, e, self._version())
                self.store = None
                return None
            return None if latest is None else Schedule(**latest)

    def _set_schedule(self, schedule: Schedule) -> None:
        if schedule.version > (self._version() or 0):  # two answers can be applied out of order
            self.engine.set_schedule(schedule)
            log.info("actor %s: schedule v%d %s", self.worker, schedule.version, schedule.offline_layers)

    def _take_schedule(self) -> None:
        """Apply the store's newer schedule, if its answer is in, once the rows in flight are done: a lane's
        exit layers are fixed when it opens, and each row records the one version it ran with."""
        latest = self._newer_schedule()
        if latest is not None:
            with self.gate.exclusive():
                self._set_schedule(latest)

    def _report(self, rows: list[dict]) -> None:
        """This batch's exit statistics to the store (per schedule version its rows ran with), without waiting."""
        if self.store is None:
            return
        by_version: dict[int | None, list[dict]] = {}
        for r in rows:
            by_version.setdefault(r["schedule_version"], []).append(r)
        for version, group in by_version.items():
            ok = [r for r in group if r["error"] is None]
            hists = [r["retune_histogram"] for r in ok if r.get("retune_histogram") is not None]
            hist = [sum(col) for col in zip(*hists)] if hists else None
            tokens = sum(r["completion_tokens"] for r in ok)
            layer_tokens = sum(r["avg_layers"] * r["completion_tokens"] for r in ok)
            audited = [r for r in ok if r.get("audit_exits") is not None]
            audit = None if not audited else ([sum(c) for c in zip(*(r["audit_exits"] for r in audited))],
                                              [sum(c) for c in zip(*(r["audit_disagree"] for r in audited))])
            self.store.report.remote(version, len(group), tokens, layer_tokens, hist, audit)

    def describe(self) -> dict:
        """What this engine runs with: dtype (and why), the batches in flight it takes and, in mode auto, the
        measured plan and its choices."""
        e = self.engine
        out = {"dtype": str(e.model.dtype).removeprefix("torch."), "dtype_reason": e.dtype_reason,
               **e.weights_info(), "machine": machine_facts(e.device), "worker": self.worker,
               "node": ray.get_runtime_context().get_node_id() if ray.is_initialized() else None,
               "kv_memory": e.core.memory(), "max_concurrent_batches": self.cfg.max_concurrent_batches}
        if self.cfg.mode == "auto":
            out["plan"] = {**e.spec_plan(dict(self.cfg.spec) or None).to_json([self.cfg.batch_size]),
                           "steps_chosen": self.plan_steps.totals()}
        return out

    def __call__(self, batch: pa.Table) -> pa.Table:
        """batch's output rows (ROW_SCHEMA), one per input row, in its order; any thread."""
        started_at, t0 = time.time(), time.perf_counter()
        self._take_schedule()
        version = self._version()  # of the rows that do not run; those that do record their own
        ids = batch["id"].to_pylist()
        prompts = batch["prompt"].to_pylist()
        # the processor's prepare stage renders the text to run beside the prompt as given
        to_run = batch["text"].to_pylist() if "text" in batch.column_names else prompts
        input_errors = batch["input_error"].to_pylist()
        sampling = batch["_sampling"].to_pylist() if "_sampling" in batch.column_names else [None] * len(ids)
        maybe_crash_on(prompts)
        rows: list[dict | None] = [None] * len(ids)
        runnable, texts, params, counts = [], {}, [], []
        for i, (prompt, error) in enumerate(zip(prompts, input_errors)):
            if error is not None:  # the reader could not make a prompt of the row
                rows[i] = self._error_row(ids[i], prompt, f"InputError: {error}", "input")
                continue
            try:  # one row at a time, so that one bad prompt or value does not fail the batch
                fields = {} if sampling[i] is None else json.loads(sampling[i])
                p, n = (to_sampling(fields, self.defaults) if fields else self.defaults), choices(fields)
                texts[i] = self._prompt_text(to_run[i])
                self.engine.encode_prompt(texts[i])
            except PromptError as e:
                rows[i] = self._error_row(ids[i], prompt, f"PromptError: {e}", "input")
                continue
            except ValueError as e:  # the prepare stage checked these: only a caller that skipped it gets here
                rows[i] = self._error_row(ids[i], prompt, f"InputError: {e}", "input")
                continue
            runnable.append(i)
            params.append(p)
            counts.append(n)
        # a row asking n completions runs n times in a row (the copies share its prompt's KV through the prefix
        # cache), choice k seeded with seed + k
        results = iter(self._generate([texts[i] for i, n in zip(runnable, counts) for _ in range(n)],
                                      [choice_params(p, k) for p, n in zip(params, counts) for k in range(n)]))
        for i, n in zip(runnable, counts):
            got = [next(results) for _ in range(n)]
            failed = next((r for r, _ in got if isinstance(r, Exception)), None)
            if failed is not None:
                rows[i] = self._error_row(ids[i], prompts[i], f"{type(failed).__name__}: {failed}",
                                          error_kind(failed))
            else:
                rows[i] = self._row(ids[i], prompts[i], got[0][0], [r for r, _ in got] if n > 1 else None)
            rows[i]["schedule_version"] = got[0][1]
        common = {**self._common(batch.num_rows, started_at, version), "batch_s": time.perf_counter() - t0}
        rows = [{**common, **r} for r in rows]
        self._report(rows)
        maybe_crash_once()
        return pa.Table.from_pylist(rows, schema=ROW_SCHEMA)

    def _common(self, rows: int, started_at: float, version: int | None) -> dict:
        """The columns every row of one call shares (a new batch_id per call); a row that ran has its own
        schedule_version."""
        with self._lock:
            self.batches += 1
            n = self.batches
        return {"mode": self.cfg.mode, "schedule_version": version, "num_layers": self.num_layers,
                "batch_id": f"{self.worker}-{n}", "batch_rows": rows, "batch_started_at": started_at,
                "worker": self.worker, "run_id": self.run_id}

    def error_rows(self, batch: pa.Table, error: str, kind: str = "machine") -> pa.Table:
        """ROW_SCHEMA error rows for every row of batch, without running it (a row that keeps killing
        its process)."""
        common = {**self._common(batch.num_rows, time.time(), self._version()), "batch_s": 0.0}
        return pa.Table.from_pylist([{**common, **self._error_row(i, p, error, kind)} for i, p in
                                     zip(batch["id"].to_pylist(), batch["prompt"].to_pylist())], schema=ROW_SCHEMA)

    def _prompt_text(self, prompt) -> str:
        """What the engine runs for a row's prompt: the prompt itself, or in chat mode the chat template
        around it as the user's message."""
        if not self.chat:
            return prompt
        if not isinstance(prompt, str) or not prompt:
            raise PromptError(f"prompt must be a non-empty string, got {prompt!r:.40}")
        try:
            return self.engine.chat_prompt([{"role": "user", "content": prompt}])
        except ValueError as e:
            raise PromptError(str(e)) from None

    def _generate(self, prompts: list[str], params: list[SamplingParams]) -> list[tuple]:
        """Per prompt, its GenerationResult or, for a prompt that fails when run alone, its exception, and the
        schedule version it ran with. The prompts join the rows the engine decodes for the other calls in
        flight; if the call raises (a failed step costs every row of its lane, whichever call they came from),
        they run again one at a time with nothing beside them."""
        if not prompts:
            return []
        try:
            with self.gate.shared():
                version = self._version()
                results = self._submit(prompts, params).result()
                self.plan_steps.add(results)  # before leaving: an idle gate folds the lanes seen
            return [(r, version) for r in results]
        except Exception:  # noqa: BLE001 -- an engine failure must cost its rows, not the job
            log.exception("a call of %d prompts failed; running them one at a time, alone", len(prompts))
        out = []
        with self.gate.exclusive():
            version = self._version()
            for p, s in zip(prompts, params):
                try:
                    results = self._submit([p], [s]).result()
                    self.plan_steps.add(results)
                    out.append((results[0], version))
                except Exception as e:  # noqa: BLE001 -- the prompt's own failure: an error row
                    out.append((e, version))
        return out

    def _submit(self, prompts: list[str], params: list[SamplingParams]) -> Future:
        """The prompts onto the engine, behind every call submitted before (priority: first come, first served),
        so that a call's rows take free rows before a later call's and the earliest call returns first while
        the later ones already decode beside it."""
        with self._lock:
            self._submitted += 1
            order = self._submitted
        return self.engine.submit(prompts, mode=self.cfg.mode, spec=dict(self.cfg.spec) or None, sampling_params=params,
                                  priority=order)

    def _row(self, row_id: str, prompt: str, r, every: list | None = None) -> dict:
        """The output row of result r (every: all n > 1 results of the row's prompt, r first)."""
        return {
            "id": row_id, "prompt": prompt, "error": None,
            "completion": r.text, "finish_reason": r.finish_reason, "prompt_tokens": r.prompt_tokens,
            "cached_prompt_tokens": r.cached_prompt_tokens, "completion_tokens": len(r.token_ids), "exit_layers": r.exit_layers,
            "logprobs": logprob_rows(r.logprobs),
            "choices": None if every is None else [
                {"index": k, "completion": c.text, "finish_reason": c.finish_reason,
                 "completion_tokens": len(c.token_ids), "logprobs": logprob_rows(c.logprobs)} for k, c in enumerate(every)],
            "avg_layers": r.stats["avg_layers"], "latency_s": r.metrics["e2e_latency_s"],
            "ttft_s": r.metrics["ttft_s"],
            "retune_histogram": r.stats.get("retune_histogram") if self.cfg.mode == "specee" else None,
            "audit_exits": r.stats.get("audit_exits"), "audit_disagree": r.stats.get("audit_disagree"),
        }

    @staticmethod
    def _error_row(row_id: str, prompt: str | None, error: str, kind: str) -> dict:
        """An error row keeps a bounded prefix of its prompt and of its message, as valid text."""
        if prompt is not None:
            prompt = valid_text(prompt[:ERROR_PROMPT_CHARS])
        return {"id": row_id, "prompt": prompt, "error": valid_text(bounded(error, ERROR_TEXT_CHARS)),
                "error_kind": kind}


def logprob_rows(entries: list[dict] | None) -> list[dict] | None:
    """A result's logprobs as the LOGPROBS column holds them."""
    if entries is None:
        return None
    return [{"token": e["token"], "logprob": e["logprob"],
             "top_logprobs": [{"token": t, "logprob": lp} for t, lp in e["top_logprobs"]]} for e in entries]


def error_kind(e: BaseException) -> str:
    """Whose fault an engine exception for a row run alone is (ERROR_KINDS): the machine's for running out
    of memory, a device error or a lost Ray worker, else the row's own (it raises again when rerun)."""
    import torch

    text = str(e)
    if isinstance(e, (MemoryError, torch.cuda.OutOfMemoryError, ray.exceptions.RayError)) or \
            "out of memory" in text.lower() or "CUDA error" in text or "device-side assert" in text:
        return "machine"
    return "input"


def worker_name() -> str:
    """<actor id prefix>@<node id prefix>:<pid> inside an actor, local:<pid> elsewhere."""
    ctx = ray.get_runtime_context() if ray.is_initialized() else None
    actor = ctx.get_actor_id() if ctx is not None else None
    return f"{actor[:8]}@{ctx.get_node_id()[:8]}:{os.getpid()}" if actor else f"local:{os.getpid()}"


def maybe_crash_on(prompts: list) -> None:
    poison = os.environ.get(CRASH_ON_ENV)
    if poison and poison in prompts:
        log.warning("%s: killing actor process %d", CRASH_ON_ENV, os.getpid())
        os._exit(1)
    hang = os.environ.get(HANG_ON_ENV)
    if hang and hang in prompts:
        log.warning("%s: process %d hangs", HANG_ON_ENV, os.getpid())
        threading.Event().wait()


def maybe_crash_once() -> None:
    marker = os.environ.get(CRASH_ONCE_ENV)
    if not marker:
        return
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    log.warning("%s: killing actor process %d", CRASH_ONCE_ENV, os.getpid())
    os._exit(1)
