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

Fault tolerance is Ray Data's own: the engine actors restart when they die (max_restarts -1) and a
batch that was running on a dead actor runs again on another (`max_task_retries`). A batch whose
actor dies `max_task_retries + 1` times in a row (a row that kills its process) fails the dataset,
as any Ray Data task does; an engine *exception* never does: it costs only its rows (error rows).
"""
from __future__ import annotations

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
    max_task_retries: int = 2  # a batch whose actor died runs again this often, then fails the dataset
    retune_every_tokens: int = 1024  # specee: the schedule store re-tunes after this many tokens
    runtime_env: dict | None = None  # for the engine actors, e.g. {"env_vars": {...}}

    def __post_init__(self) -> None:
        self.stage()  # every engine setting is checked here, once, not in each actor
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.max_task_retries < 0:
            raise ValueError(f"max_task_retries must be >= 0, got {self.max_task_retries}")

    def stage(self) -> StageConfig:
        """The engine actors' settings (the prepare stage renders chat prompts, so the engine does not)."""
        return StageConfig(model=self.model, mode=self.mode, device=self.device, dtype=self.dtype,
                           weights=self.weights, max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                           top_p=self.top_p, top_k=self.top_k, stop=tuple(self.stop), seed=self.seed,
                           batch_size=self.batch_size, torch_threads=self.torch_threads, chat=False,
                           engine_options=dict(self.engine_options), spec=dict(self.spec))

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
        for prompt in batch["prompt"].tolist():
            prompt = to_python(prompt)
            text, error = self._text(prompt)
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
            if not prompt:
                return None, "prompt is empty"
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


class EngineRows:
    """Stage 3: one engine per actor (pipeline.stage.GenerateRows); the input's own columns are
    carried through to the output rows."""

    def __init__(self, stage: StageConfig, run_id: str, store: str | None,
                 postprocess: Callable[[dict], dict] | None = None):
        self.rows = GenerateRows(stage, run_id, store)
        self.postprocess = postprocess

    def __call__(self, batch: pd.DataFrame) -> pa.Table:
        mine = pa.table({c: pa.array([None if is_missing(v) else v for v in batch[c].tolist()], pa.string())
                         for c in ("id", "prompt", "text", "input_error")})
        out = self.rows(mine)
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


class Processor:
    """Dataset -> Dataset (see the module docstring). Build it with build_processor."""

    def __init__(self, config: ProcessorConfig, preprocess: Callable[[dict], dict] | None = None,
                 postprocess: Callable[[dict], dict] | None = None):
        self.config, self.preprocess, self.postprocess = config, preprocess, postprocess
        self.run_id = time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]
        self.store = None
        self.store_name = None

    def __call__(self, ds: ray.data.Dataset) -> ray.data.Dataset:
        cfg = self.config
        # the user's preprocess and the prepare stage reserve no CPU: they are light next to the
        # engine, whose actors may hold every CPU of the cluster while the stream still flows
        if self.preprocess is not None:
            ds = ds.map(self.preprocess, num_cpus=0)
        ds = ds.map_batches(PrepareRows, fn_constructor_kwargs={"model": cfg.model, "chat": cfg.chat},
                            batch_format="pandas", concurrency=1, num_cpus=0, batch_size=cfg.batch_size)
        ds = ds.map_batches(EngineRows, fn_constructor_kwargs={"stage": cfg.stage(), "run_id": self.run_id,
                                                               "store": self._store(),
                                                               "postprocess": self.postprocess},
                            batch_format="pandas", batch_size=cfg.batch_size, concurrency=cfg.concurrency,
                            max_task_retries=cfg.max_task_retries, **cfg.resources(),
                            **({"runtime_env": cfg.runtime_env} if cfg.runtime_env else {}))
        return ds

    def _store(self) -> str | None:
        """specee: the schedule store's name (started on the first call), else None."""
        cfg = self.config
        if cfg.mode != "specee":
            return None
        if self.store is None:
            from pathlib import Path

            from pipeline.schedule_store import remote_store
            from specee_core.early_exit.step import initial_schedule

            opts = cfg.engine_options
            self.store_name = f"specee-schedule-{self.run_id}"
            self.store = remote_store(self.store_name, initial_schedule(Path(cfg.model)), cfg.retune_every_tokens, 1,
                                      opts.get("max_disagreement"), opts.get("confidence", 0.95))
        return self.store_name

    def schedule_state(self) -> dict | None:
        """specee: the schedule store's versions, per-version statistics and audit; None otherwise."""
        return None if self.store is None else ray.get(self.store.state.remote())

    def config_json(self) -> dict:
        return asdict(self.config)


def build_processor(config: ProcessorConfig, preprocess: Callable[[dict], dict] | None = None,
                    postprocess: Callable[[dict], dict] | None = None) -> Processor:
    """A callable Dataset -> Dataset running the engine over rows with `id` and `prompt` (Ray Data
    LLM's build_llm_processor shape); preprocess / postprocess: optional row -> row functions."""
    return Processor(config, preprocess, postprocess)
