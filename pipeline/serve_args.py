"""The Serve app's arguments (ServeArgs: `serve run pipeline.serve:app key=value ...` or serve_config.yaml's
`args:`), validated once, and what they make of a deployment: each replica's resources, how many replicas share a
node's memory, the replica count fixed or autoscaled."""
import json
import math
import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pipeline.openai_protocol import MAX_JSON_DEPTH
from pipeline.serve_access import read_keys_file
from specee_core.options import OPTION_NAMES, EngineOptions, default

REPO = Path(__file__).resolve().parents[1]
API_KEYS_ENV = "SPECEE_API_KEYS"  # comma-separated; the api_keys argument when it is not given
API_KEYS_FILE_ENV = "SPECEE_API_KEYS_FILE"  # the api_keys_file argument when it is not given
ROUTE_HEADROOM = 16  # requests Serve hands a replica beyond its admission: health, metrics, model list, 429s
SERVE_MAX_REPLICAS = 100  # Serve's default max_replicas when autoscaling


class ServeArgs(BaseModel):
    """Arguments of the app builder: `serve run pipeline.serve:app key=value ...` (values arrive as
    strings and are converted) or `args:` in serve_config.yaml."""
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str = Field(default_factory=lambda: os.environ.get("SPECEE_MODEL", "models/smollm2-135m-instruct"))
    model_name: str | None = None  # the name clients send; default: the model directory's name
    # auto (lossless: dense or speculative steps, whichever the plan measured here expects to be faster)
    mode: Literal["auto", "dense", "specee", "spec"] = Field(
        default_factory=lambda: os.environ.get("SPECEE_MODE") or "auto")
    device: str = "cpu"
    # auto: bf16 where the hardware computes it natively (CUDA, CPUs with avx512_bf16/AMX), else float32
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # auto: the checkpoint's own low-bit format (a GGUF's Q4_1) where its kernel is faster here, else the dtype
    weights: Literal["auto", "fp32", "bf16", "q8", "q4"] = "auto"
    # more SpecEEEngine.from_pretrained options: EngineOptions' (context_len, kv_cache_gb, kv_block_size,
    # prefix_cache, engines_per_node) and early-exit options (EarlyExitOptions)
    engine_options: dict = Field(default_factory=dict)
    max_batch_size: int = Field(default("max_batch_size"), ge=1)  # rows decoding at once
    prefill_chunk: int = Field(default("prefill_chunk"), ge=1)  # prompt tokens prefilled per step (one lane)
    max_tokens_limit: int | None = Field(None, ge=1)  # default: the context length - 1
    stall_timeout_s: float = Field(600.0, gt=0)  # a decode step running longer fails the health check
    num_cpus: float = Field(1.0, gt=0)  # per replica
    num_gpus: float | None = Field(None, ge=0)  # per replica; default: 1 when device is cuda, else 0
    # replicas: a fixed count, or "auto" (autoscaled on ongoing requests, bounded by the three below;
    # giving any of those three autoscales too)
    num_replicas: int | Literal["auto"] | None = None  # default: 1, or auto with the fields below
    min_replicas: int | None = Field(None, ge=0)  # default 1 (Serve's)
    max_replicas: int | None = Field(None, ge=1)  # default 100 (Serve's)
    target_ongoing_requests: float | None = Field(None, gt=0)  # per replica; default: max_batch_size
    # clients must send `Authorization: Bearer <one of these>` (401 otherwise); empty: no authentication
    api_keys: list[str] = Field(default_factory=lambda: os.environ.get(API_KEYS_ENV, ""))
    # more keys, one a line (blank lines and # comments skipped), read when the app is built
    api_keys_file: str | None = Field(default_factory=lambda: os.environ.get(API_KEYS_FILE_ENV) or None)
    # serve without API keys although Serve listens beyond loopback (refused otherwise); logs a warning
    allow_open: bool = False
    max_json_depth: int = Field(MAX_JSON_DEPTH, ge=4)  # nesting of arrays and objects in a body
    max_prompts_per_request: int = Field(64, ge=1)  # a /v1/completions prompt list
    max_request_tokens: int = Field(65536, ge=1)  # prompt tokens + max_tokens, summed over a request's prompts
    max_stop_chars: int = Field(256, ge=1)  # per stop string (OpenAI's count limit of 4 applies too)
    max_chars_per_token: int = Field(32, ge=1)  # a prompt longer than context x this is refused untokenized
    max_queued_requests: int = Field(64, ge=0)  # waiting beyond max_batch_size running ones: 429 past this
    max_schema_bytes: int = Field(65536, ge=64)  # a structured-output constraint (schema, pattern, choices) as JSON
    grammar_timeout_s: float = Field(10.0, gt=0)  # compiling one constraint: a 400 past this

    @field_validator("api_keys", mode="before")
    @classmethod
    def _keys(cls, v):
        keys = v.split(",") if isinstance(v, str) else v
        return [k.strip() for k in keys if k and k.strip()]

    @field_validator("num_replicas", mode="before")
    @classmethod
    def _replicas(cls, v):
        if v is None or v == "auto":
            return v
        if isinstance(v, str) and v.strip().isascii() and v.strip().isdigit():  # from the command line
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"num_replicas must be a whole number >= 1 or 'auto', got {v!r}")
        return v

    @model_validator(mode="after")
    def _keys_file(self) -> "ServeArgs":
        if self.api_keys_file:
            self.api_keys = [*self.api_keys, *read_keys_file(self.api_keys_file)]
        return self

    @model_validator(mode="after")
    def _replicas_and_resources(self) -> "ServeArgs":
        scaling = {k: getattr(self, k) for k in ("min_replicas", "max_replicas", "target_ongoing_requests")
                   if getattr(self, k) is not None}
        if scaling and isinstance(self.num_replicas, int):
            raise ValueError(f"{', '.join(scaling)} autoscale the replicas, but num_replicas={self.num_replicas} "
                             f"fixes their count: set num_replicas=auto or leave it out")
        if self.min_replicas is not None and self.max_replicas is not None and self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas={self.min_replicas} is more than max_replicas={self.max_replicas}")
        cuda = self.device.split(":")[0] == "cuda"
        if self.num_gpus is None:
            self.num_gpus = 1.0 if cuda else 0.0
        elif self.num_gpus > 0 and not cuda:
            raise ValueError(f"num_gpus={self.num_gpus:g} reserves GPUs for replicas that run on "
                             f"device={self.device!r}: set device=cuda, or leave num_gpus out")
        return self

    @model_validator(mode="after")
    def _engine_options(self) -> "ServeArgs":
        from specee_core.early_exit.options import EarlyExitOptions

        own = {"max_batch_size", "prefill_chunk", "min_lane_rows"} & set(self.engine_options)
        if own:
            raise ValueError(f"engine_options {sorted(own)}: max_batch_size and prefill_chunk are arguments of their "
                             f"own; a replica's lanes always have room for max_batch_size rows")
        early = {f for f in EarlyExitOptions.__dataclass_fields__}
        unknown = set(self.engine_options) - set(OPTION_NAMES) - early
        if unknown:
            raise ValueError(f"engine_options {sorted(unknown)}: not an engine option (EngineOptions: "
                             f"{', '.join(OPTION_NAMES)}; or an early-exit option: {', '.join(sorted(early))})")
        self.engine(engines_per_node=self.engine_options.get("engines_per_node", 1))  # bad values fail here, once
        EarlyExitOptions(**{k: v for k, v in self.engine_options.items() if k in early})
        return self

    def engine(self, engines_per_node: int) -> EngineOptions:
        """The options each replica builds its engine with (engines_per_node: the replicas sharing its node's
        memory, unless engine_options sets it or a KV budget). Lanes open with room for max_batch_size rows:
        a request's rows decode beside those of requests that arrive after it."""
        opts = {k: v for k, v in self.engine_options.items() if k in OPTION_NAMES}
        if "kv_cache_gb" not in opts:
            opts.setdefault("engines_per_node", engines_per_node)
        return EngineOptions(max_batch_size=self.max_batch_size, prefill_chunk=self.prefill_chunk,
                             min_lane_rows=self.max_batch_size, **opts)

    def early_exit_options(self) -> dict:
        """The engine_options that are early-exit options (EarlyExitOptions)."""
        return {k: v for k, v in self.engine_options.items() if k not in OPTION_NAMES}

    @property
    def autoscaling(self) -> bool:
        """Whether the replicas are autoscaled (num_replicas auto, or any autoscaling field given)."""
        return self.num_replicas == "auto" or any(
            v is not None for v in (self.min_replicas, self.max_replicas, self.target_ongoing_requests))

    @field_validator("model")
    @classmethod
    def _model_dir(cls, v: str) -> str:
        # absolute, so replicas find it whatever their working directory is
        p = Path(v).expanduser()
        for cand in ([p] if p.is_absolute() else [Path.cwd() / p, REPO / p]):
            if cand.is_dir():
                return str(cand.resolve())
        raise ValueError(f"model directory {v!r} not found (looked in {Path.cwd()} and {REPO})")

    @field_validator("engine_options", mode="before")
    @classmethod
    def _json_options(cls, v):
        return json.loads(v) if isinstance(v, str) else v  # from the command line: a JSON object


def replicas_per_node(args: ServeArgs, node_cpus: float, node_gpus: float) -> int:
    """The most replicas of this app that can share one node's memory: its CPUs (or, on CUDA, one GPU's share)
    over a replica's, capped by the replica count (fixed, or autoscaling's maximum). The default KV budget of each
    is its share of the free memory, so together they never take more than one engine would."""
    if isinstance(args.num_replicas, int):
        most = args.num_replicas
    else:
        most = (args.max_replicas or SERVE_MAX_REPLICAS) if args.autoscaling else 1
    if args.device.split(":")[0] == "cuda":  # device memory: the replicas that share one GPU
        fit = math.floor(1 / args.num_gpus) if 0 < args.num_gpus < 1 else 1
    else:
        fit = math.floor(node_cpus / args.num_cpus) if node_cpus else most
    return max(1, min(most, fit))


def node_resources() -> tuple[float, float]:
    """(CPUs, GPUs) of the Ray node this process runs on; (0, 0) outside Ray."""
    import ray

    if not ray.is_initialized():
        return 0.0, 0.0
    me = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node.get("NodeID") == me:
            res = node.get("Resources", {})
            return float(res.get("CPU", 0)), float(res.get("GPU", 0))
    return 0.0, 0.0


def deployment_options(args: ServeArgs) -> dict:
    """SpecEEServer.options(...) for these args: each replica's CPUs and GPUs, how many requests Serve hands it,
    and the replica count, fixed or autoscaled (Serve's defaults for what is not given, except
    target_ongoing_requests: max_batch_size, a full batch per replica before another one starts)."""
    actor = {"num_cpus": args.num_cpus}
    if args.num_gpus:
        actor["num_gpus"] = args.num_gpus
    # above the app's own admission (running + queued): past that a request gets the app's 429 with Retry-After,
    # never a wait unseen in Serve's queue and then the proxy's 503
    options: dict = {"ray_actor_options": actor,
                     "max_ongoing_requests": args.max_batch_size + args.max_queued_requests + ROUTE_HEADROOM}
    if args.autoscaling:
        scaling = {"min_replicas": args.min_replicas, "max_replicas": args.max_replicas,
                   "target_ongoing_requests": args.target_ongoing_requests or args.max_batch_size}
        options["num_replicas"] = "auto"
        options["autoscaling_config"] = {k: v for k, v in scaling.items() if v is not None}
    elif args.num_replicas is not None:
        options["num_replicas"] = args.num_replicas
    return options
