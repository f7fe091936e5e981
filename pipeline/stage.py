"""The generation stage: a stateful callable that loads one SpecEE engine per Ray actor and
turns a batch of prompt rows into output rows (one per input row, failures included)."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import pyarrow as pa

from specee_core import PromptError, SpecEEEngine
from specee_core.engine import MODES
from specee_core.scheduler import Schedule
from specee_core.spec_decode import SpecOptions

log = logging.getLogger(__name__)

# One output row per input row. Error rows keep id, prompt, mode, wave and error; the rest is null.
OUTPUT_SCHEMA = pa.schema([
    ("id", pa.string()),
    ("prompt", pa.string()),
    ("completion", pa.string()),
    ("finish_reason", pa.string()),
    ("prompt_tokens", pa.int32()),
    ("completion_tokens", pa.int32()),
    ("exit_layers", pa.list_(pa.int16())),  # per generated token: decoder layers run (1-based)
    ("avg_layers", pa.float64()),
    ("latency_s", pa.float64()),  # end to end, the row's share of its engine batch
    ("ttft_s", pa.float64()),
    ("tokens_per_s", pa.float64()),
    ("mode", pa.string()),
    ("schedule_version", pa.int32()),  # null unless mode is specee
    ("num_layers", pa.int16()),
    ("retune_histogram", pa.list_(pa.int32())),  # [L] what the scheduler update rule consumes; null if none
    ("wave", pa.int32()),
    ("run_id", pa.string()),
    ("error", pa.string()),  # null when the row succeeded
])

# Test hook: the first actor call that finds this marker file missing creates it and kills its
# own process after generating, before returning (an actor lost mid-wave, work in flight).
CRASH_ONCE_ENV = "SPECEE_PIPELINE_CRASH_ONCE"


@dataclass(frozen=True)
class StageConfig:
    """How each actor loads its engine and generates."""
    model: str
    mode: str = "dense"
    device: str = "cpu"
    dtype: str | None = None  # float32 | bfloat16 | float16; None: float32
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    batch_size: int = 16  # rows per actor call, also the engine's max batch
    torch_threads: int | None = None  # None: the CPUs Ray gave the actor, at least 1
    chat: bool | None = None  # prompt = a user message through the chat template; None: when the model has one
    engine_options: dict = field(default_factory=dict)  # early-exit options (EarlyExitOptions), specee only
    spec: dict = field(default_factory=dict)  # speculative decoding options (SpecOptions: proposer, depth), spec only

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.spec:
            if self.mode != "spec":
                raise ValueError(f"spec options {self.spec} apply to mode='spec' only, mode is {self.mode!r}")
            SpecOptions(**self.spec)  # bad names and values fail here, not in every actor
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.torch_threads is not None and self.torch_threads < 1:
            raise ValueError(f"torch_threads must be >= 1, got {self.torch_threads}")


class GenerateRows:
    """map_batches callable: one engine per actor, one PROMPT_SCHEMA batch per call."""

    def __init__(self, cfg: StageConfig, schedule: Schedule | None, run_id: str):
        import ray
        import torch

        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1) if ray.is_initialized() else 1
        torch.set_num_threads(cfg.torch_threads or max(1, int(cpus)))
        self.cfg = cfg
        self.run_id = run_id
        early_exit = cfg.engine_options if cfg.mode == "specee" else {}
        self.engine = SpecEEEngine.from_pretrained(cfg.model, device=cfg.device, dtype=cfg.dtype,
                                                   max_batch_size=cfg.batch_size, **early_exit)
        if cfg.mode == "specee" and schedule is not None:
            self.engine.set_schedule(schedule)
        self.schedule_version = None if cfg.mode != "specee" or self.engine.schedule is None \
            else self.engine.schedule.version
        self.num_layers = self.engine.config.num_hidden_layers
        self.chat = self.engine.has_chat_template if cfg.chat is None else cfg.chat
        if self.chat and not self.engine.has_chat_template:
            raise ValueError(f"chat=True but {cfg.model} has no chat template")
        log.info("actor pid %d: %s on %s, mode %s, schedule v%s", os.getpid(), cfg.model, cfg.device, cfg.mode,
                 self.schedule_version)

    def __call__(self, batch: pa.Table) -> pa.Table:
        ids = batch["id"].to_pylist()
        prompts = batch["prompt"].to_pylist()
        input_errors = batch["input_error"].to_pylist()
        waves = batch["wave"].to_pylist()
        rows: list[dict | None] = [None] * len(ids)
        runnable, texts = [], {}
        for i, (prompt, error) in enumerate(zip(prompts, input_errors)):
            if error is not None:  # the reader could not make a prompt of the row
                rows[i] = self._error_row(ids[i], prompt, waves[i], f"InputError: {error}")
                continue
            try:  # one row at a time, so that one bad prompt does not fail the batch
                texts[i] = self._prompt_text(prompt)
                self.engine.encode_prompt(texts[i])
                runnable.append(i)
            except PromptError as e:
                rows[i] = self._error_row(ids[i], prompt, waves[i], f"PromptError: {e}")
        for i, result in zip(runnable, self._generate([texts[i] for i in runnable])):
            if isinstance(result, Exception):
                rows[i] = self._error_row(ids[i], prompts[i], waves[i], f"{type(result).__name__}: {result}")
            else:
                rows[i] = self._row(ids[i], prompts[i], waves[i], result)
        maybe_crash_once()
        return pa.Table.from_pylist(rows, schema=OUTPUT_SCHEMA)

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

    def _generate(self, prompts: list[str]) -> list:
        """GenerationResults, or for a prompt that fails when run alone its exception."""
        if not prompts:
            return []
        try:
            return self.engine.generate(prompts, **self._sampling())
        except Exception as e:  # noqa: BLE001 -- an engine failure must cost its rows, not the job
            if len(prompts) == 1:
                return [e]
            log.exception("batch of %d failed; running its rows one by one", len(prompts))
        return [r for p in prompts for r in self._generate([p])]

    def _sampling(self) -> dict:
        c = self.cfg
        return dict(max_new_tokens=c.max_new_tokens, temperature=c.temperature, top_p=c.top_p, top_k=c.top_k,
                    stop=list(c.stop) or None, seed=c.seed, mode=c.mode, spec=dict(c.spec) or None)

    def _row(self, row_id: str, prompt: str, wave: int, r) -> dict:
        return {
            **self._common(row_id, prompt, wave),
            "completion": r.text, "finish_reason": r.finish_reason, "prompt_tokens": r.prompt_tokens,
            "completion_tokens": len(r.token_ids), "exit_layers": r.exit_layers,
            "avg_layers": r.stats["avg_layers"], "latency_s": r.metrics["e2e_latency_s"],
            "ttft_s": r.metrics["ttft_s"], "tokens_per_s": r.metrics["tokens_per_s"],
            "retune_histogram": r.stats.get("retune_histogram") if self.cfg.mode == "specee" else None,
        }

    def _error_row(self, row_id: str, prompt: str | None, wave: int, error: str) -> dict:
        return {**self._common(row_id, prompt, wave), "error": error}

    def _common(self, row_id: str, prompt: str | None, wave: int) -> dict:
        return {"id": row_id, "prompt": prompt, "mode": self.cfg.mode, "schedule_version": self.schedule_version,
                "num_layers": self.num_layers, "wave": wave, "run_id": self.run_id}


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
