"""The processor's settings (pipeline.processor), under Ray Data LLM's names where it has the setting.

Ray Data LLM's `engine_kwargs` are vLLM's engine arguments; here they are the engine's own keyword
arguments, and vLLM's names are read where the engine has the setting (VLLM_ENGINE_ARGS) or does what
they ask anyway (VLLM_AS_IS). Any other key fails when the config is made, naming it, rather than being
ignored.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field, fields

import ray

from pipeline.prompts import MAX_PROMPT_CHARS
from pipeline.stage import CORE_OPTIONS, StageConfig
from specee_core.options import default

# Ray Data LLM's engine_kwargs are vLLM's engine arguments. Those with an equivalent here, by name:
VLLM_ENGINE_ARGS = {"max_model_len": "context_len", "max_num_batched_tokens": "prefill_chunk",
                    "block_size": "kv_block_size", "enable_prefix_caching": "prefix_cache"}
VLLM_DTYPES = {"half": "float16", "float": "float32"}  # vLLM's other names of dtypes
# ... and those that ask for what the engine does anyway, with the values accepted (any other: ValueError)
VLLM_AS_IS = {"enable_chunked_prefill": (True,), "tensor_parallel_size": (1,), "pipeline_parallel_size": (1,),
              "trust_remote_code": (True, False)}  # the engine runs no code from the checkpoint
FLAT = ("dtype", "weights", "kv_cache_gb", "prefix_cache")  # engine arguments that are config fields too
DEPRECATED = {"model": "model_source", "engine_options": "engine_kwargs", "chat": "apply_chat_template"}


@dataclass(frozen=True)
class ProcessorConfig:
    """The processor's settings, under Ray Data LLM's names (vLLMEngineProcessorConfig) where it has the
    setting: model_source, engine_kwargs, concurrency, batch_size, max_concurrent_batches, accelerator_type,
    apply_chat_template, tokenize, detokenize, runtime_env. The old names model, engine_options and chat still
    work, with a DeprecationWarning."""
    model_source: str | None = None  # the model's directory (required)
    mode: str = "auto"  # auto (lossless, measured) | dense | spec | specee (lossy: early exit)
    # engine actors: n, or (min, max) for Ray Data's autoscaling actor pool
    concurrency: int | tuple[int, int] = 1
    batch_size: int = default("max_batch_size")  # rows per engine call, also the engine's max batch
    # engine calls in flight per actor (Ray Data LLM's name; pipeline.stage.StageConfig): the next batch's rows
    # decode beside the current one's last rows, not after them (default 1: see StageConfig)
    max_concurrent_batches: int = 1
    accelerator_type: str | None = None  # e.g. "L4", "H100": engine actors only on nodes with that GPU
    num_cpus: float | None = None  # per engine actor; None: the cluster's CPUs shared among the actors
    num_gpus: float | None = None  # per engine actor; None: 1 when device is cuda, else 0
    device: str | None = None  # None: cuda with an accelerator_type, else cpu
    dtype: str = "auto"
    weights: str = "auto"
    # what a row runs with when it sets no sampling of its own (pipeline.sampling: vLLM's names per row)
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    # string prompts as the user's message through the chat template; None: when the model has one
    # (chat messages always go through it)
    apply_chat_template: bool | None = None
    # a row whose prompt (or messages' text) is longer is an error row, refused before the chat template and the
    # tokenizer see it (pipeline.prompts.MAX_PROMPT_CHARS)
    max_prompt_chars: int = MAX_PROMPT_CHARS
    # accepted so that Ray Data LLM configs build: the engine tokenizes, and detokenizes as it goes (stop
    # strings are matched on text), whatever these say; no separate stage runs either way
    tokenize: bool = True
    detokenize: bool = True
    # the engine's keyword arguments: early-exit options (EarlyExitOptions), EngineOptions' context_len,
    # prefill_chunk, kv_block_size, and the fields in FLAT; vLLM's names where they have one here
    # (VLLM_ENGINE_ARGS, VLLM_AS_IS). Anything else fails here, naming it.
    engine_kwargs: dict = field(default_factory=dict)
    spec: dict = field(default_factory=dict)  # speculative decoding options (SpecOptions)
    torch_threads: int | None = None
    kv_cache_gb: float | None = None  # each engine actor's KV budget, GiB; None: a share of free memory / concurrency
    prefix_cache: bool = True  # reuse full prompt blocks across rows (chat template, system prompt)
    # a batch whose actor died runs again this often (then fails the dataset); -1: until it is done. A death
    # costs a retry of every batch queued on that actor, not only its own, so a bound fails jobs with a few bad
    # rows; unbounded is safe because a batch dies at most twice in place (once if it hung) before it runs in a
    # quarantined child process (pipeline.quarantine) that no row can take the actor down from
    max_task_retries: int = -1
    batch_timeout_s: float | None = 900.0  # an engine call running longer is a hang (StageConfig)
    row_attempts: int = 2  # a row that kills or hangs a fresh process this often alone: an error row
    retune_every_tokens: int = 1024  # specee: the schedule store re-tunes after this many tokens
    retune_min_exits: int = 1  # ... when at least this many of them exited early
    schedule: str | None = None  # specee: start from this schedule JSON (default: the model's)
    runtime_env: dict | None = None  # for the engine actors, e.g. {"env_vars": {...}}
    # deprecated names (DEPRECATED): read into the new ones
    model: str | None = None
    engine_options: dict | None = None
    chat: bool | None = None

    def __post_init__(self) -> None:
        self._take_deprecated()
        if not self.model_source:
            raise ValueError("model_source (the model's directory) is required")
        for name in ("tokenize", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if type(self.max_prompt_chars) is not int or self.max_prompt_chars < 1:
            raise ValueError(f"max_prompt_chars must be an int >= 1, got {self.max_prompt_chars!r}")
        self._set("concurrency", concurrency_range(self.concurrency))
        if self.device is None:
            self._set("device", "cuda" if self.accelerator_type else "cpu")
        elif self.accelerator_type and not self.device.startswith("cuda"):
            raise ValueError(f"accelerator_type={self.accelerator_type!r} needs device 'cuda', got {self.device!r}")
        self._take_engine_kwargs()
        self.stage()  # every engine setting is checked here, once, not in each actor
        if self.max_task_retries < -1:
            raise ValueError(f"max_task_retries must be >= 0, or -1 (until done), got {self.max_task_retries}")
        if self.schedule is not None and self.mode != "specee":
            raise ValueError(f"a schedule only applies to mode='specee', mode is {self.mode!r}")

    def _set(self, name: str, value) -> None:
        object.__setattr__(self, name, value)  # frozen: only __post_init__ normalizes

    def _take_deprecated(self) -> None:
        for old, new in DEPRECATED.items():
            value = getattr(self, old)
            if value is None:
                continue
            warnings.warn(f"ProcessorConfig({old}=...) is deprecated: use {new}= (Ray Data LLM's name)",
                          DeprecationWarning, stacklevel=4)
            current = getattr(self, new)
            if old == "engine_options":
                both = set(value) & set(current)
                if any(value[k] != current[k] for k in both):
                    raise ValueError(f"engine_options and engine_kwargs both set {sorted(both)}: use engine_kwargs")
                value = {**value, **current}
            elif current is not None and current != value:
                raise ValueError(f"{old}={value!r} and {new}={current!r}: set {new} only")
            self._set(new, value)
            self._set(old, None)

    def _take_engine_kwargs(self) -> None:
        """engine_kwargs under the engine's names: vLLM's translated, FLAT ones moved to their fields."""
        from specee_core.early_exit.options import EarlyExitOptions

        early = {f.name for f in fields(EarlyExitOptions)}
        kept = {}
        for name, value in self.engine_kwargs.items():
            if name in VLLM_AS_IS:
                if not any(value == ok and type(value) is type(ok) for ok in VLLM_AS_IS[name]):
                    raise ValueError(f"engine_kwargs {name}={value!r}: the engine runs only "
                                     f"{' or '.join(map(repr, VLLM_AS_IS[name]))}")
                continue
            name = VLLM_ENGINE_ARGS.get(name, name)
            if name == "dtype":
                value = VLLM_DTYPES.get(value, value)
            if name in FLAT:
                default = type(self).__dataclass_fields__[name].default
                if getattr(self, name) not in (default, value):
                    raise ValueError(f"{name} is set twice: {getattr(self, name)!r} and engine_kwargs {value!r}")
                self._set(name, value)
            elif name in CORE_OPTIONS or name in early:
                kept[name] = value
            else:
                raise ValueError(f"engine_kwargs {name!r} has no equivalent in this engine; it takes early-exit "
                                 f"options ({', '.join(sorted(early))}), {', '.join(CORE_OPTIONS + FLAT)} and "
                                 f"vLLM's {', '.join([*VLLM_ENGINE_ARGS, *VLLM_AS_IS])}")
        EarlyExitOptions(**{k: v for k, v in kept.items() if k in early})  # bad values fail here
        self._set("engine_kwargs", kept)

    @property
    def max_actors(self) -> int:
        return self.concurrency if isinstance(self.concurrency, int) else self.concurrency[1]

    def stage(self) -> StageConfig:
        """The engine actors' settings (the prepare stage renders chat prompts, so the engine does not)."""
        kw = self.engine_kwargs
        return StageConfig(model=self.model_source, mode=self.mode, device=self.device, dtype=self.dtype,
                           weights=self.weights, max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                           top_p=self.top_p, top_k=self.top_k, stop=tuple(self.stop), seed=self.seed,
                           batch_size=self.batch_size, torch_threads=self.torch_threads, chat=False,
                           engine_options={k: v for k, v in kw.items() if k not in CORE_OPTIONS},
                           core_options={k: v for k, v in kw.items() if k in CORE_OPTIONS}, spec=dict(self.spec),
                           engines_per_node=self.max_actors, kv_cache_gb=self.kv_cache_gb,
                           prefix_cache=self.prefix_cache, batch_timeout_s=self.batch_timeout_s,
                           row_attempts=self.row_attempts, max_concurrent_batches=self.max_concurrent_batches)

    def resources(self) -> dict:
        """num_cpus, num_gpus (and accelerator_type) of each engine actor."""
        out = share_resources(self.device, self.num_cpus, self.num_gpus, self.max_actors)
        return {**out, "accelerator_type": self.accelerator_type} if self.accelerator_type else out

    def compute(self) -> ray.data.ActorPoolStrategy:
        """The engine actors' pool: fixed at `concurrency`, or autoscaling between its (min, max); each actor
        runs max_concurrent_batches calls at once, on threads of its own (the engine core is thread-safe:
        their rows share its decode steps).

        A fixed pool sends an actor only the calls it runs at once: a block queued behind a busy actor (Ray
        Data's default is twice as many in flight) waits a whole batch while another actor idles. An autoscaling
        pool needs that queue: Ray Data adds an actor only when the tasks in flight average 1.75 per concurrent
        call of its actors (DataContext's actor_pool_util_upscaling_threshold), which a pool without a queue never
        reaches."""
        n = self.max_concurrent_batches
        calls = {"max_concurrent_calls_per_actor": n, "enable_true_multi_threading": True} if n > 1 else {}
        if isinstance(self.concurrency, int):
            return ray.data.ActorPoolStrategy(size=self.concurrency, max_tasks_in_flight_per_actor=n, **calls)
        low, high = self.concurrency
        return ray.data.ActorPoolStrategy(min_size=low, max_size=high, max_tasks_in_flight_per_actor=2 * n, **calls)


def share_resources(device: str, cpus: float | None, gpus: float | None, actors: int) -> dict:
    """num_cpus / num_gpus per engine actor (None: chosen): one GPU and one CPU each on GPUs, else an
    equal share of the cluster's CPUs (fractional: two actors on two CPUs get 1 each, four get 0.5)."""
    gpus = gpus if gpus is not None else (1 if device.startswith("cuda") else 0)
    if cpus is None:
        cpus = 1 if gpus else max(0.25, math.floor(4 * ray.cluster_resources().get("CPU", 1) / actors) / 4)
    return {"num_cpus": cpus, "num_gpus": gpus}


def concurrency_range(value) -> int | tuple[int, int]:
    """concurrency as Ray Data LLM takes it: an int n >= 1 or a pair (min, max) with 1 <= min <= max."""
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(type(v) is int for v in value) \
            and 1 <= value[0] <= value[1]:
        return (value[0], value[1])
    if type(value) is int and value >= 1:
        return value
    raise ValueError(f"concurrency must be >= 1: an int, or a pair (min, max) with 1 <= min <= max; got {value!r}")
