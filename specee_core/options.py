"""The engine's options: one definition, one set of defaults, validated once.

Every surface builds its engine from these: `SpecEEEngine.from_pretrained(**options)`, the batch job's command
line (`jobs.generate`: a flag per field it exposes, with the help text below), the processor's `engine_kwargs`
and `batch_size` (`pipeline.processor_config`), the stage's `core_options` (`pipeline.stage`) and Serve's
arguments (`pipeline.serve_args`). Each field's `help` is what those surfaces print."""
from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields


def _opt(default, help: str):
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class EngineOptions:
    max_batch_size: int = _opt(16, "rows decoding at once in the engine core (the batch job's --batch-size, "
                                   "the processor's batch_size, Serve's max_batch_size)")
    context_len: int | None = _opt(None, "tokens a row may hold, prompt and output (default: the model's "
                                         "max_position_embeddings)")
    prefill_chunk: int = _opt(512, "prompt tokens prefilled per lane per iteration; the rest wait a step while "
                                   "the lane's other rows decode")
    kv_cache_gb: float | None = _opt(None, "the KV budget (the model's KV, the draft head's and the prefix "
                                           "cache), GiB; default: a share of the memory free at start, divided "
                                           "by engines_per_node")
    engines_per_node: int = _opt(1, "engines sharing this node's memory (actors, replicas): the default KV "
                                    "budget's divisor")
    kv_block_size: int = _opt(16, "token slots per block of the KV budget and the prefix cache")
    prefix_cache: bool = _opt(True, "reuse full prompt blocks (a chat template, a system prompt) across rows "
                                    "and requests")
    # 1 sizes a lane to the prompts waiting when it opens (a generate call's: every row decoding, steps
    # without gathers); max_batch_size leaves room for requests that arrive while it decodes (Serve, the batch
    # job's batches in flight)
    min_lane_rows: int = _opt(1, "rows a new lane has at least")

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "prefill_chunk", "engines_per_node", "kv_block_size", "min_lane_rows"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        ctx = self.context_len
        if ctx is not None and (isinstance(ctx, bool) or not isinstance(ctx, int) or ctx < 2):
            raise ValueError(f"context_len must be an int >= 2 (or None: the model's), got {self.context_len!r}")
        gb = self.kv_cache_gb
        if gb is not None and (isinstance(gb, bool) or not isinstance(gb, (int, float)) or not gb > 0):
            raise ValueError(f"kv_cache_gb must be > 0 (or None: a share of free memory), got {self.kv_cache_gb!r}")
        if not isinstance(self.prefix_cache, bool):
            raise ValueError(f"prefix_cache must be True or False, got {self.prefix_cache!r}")


OPTION_NAMES = tuple(f.name for f in fields(EngineOptions))


def default(name: str):
    """The default of EngineOptions' field `name` (what every surface's own default for it is)."""
    f = EngineOptions.__dataclass_fields__[name]
    assert f.default is not MISSING
    return f.default


def help_text(name: str) -> str:
    """The help of EngineOptions' field `name`, with its default."""
    f = EngineOptions.__dataclass_fields__[name]
    return f"{f.metadata['help']} (default: {f.default})" if f.default is not None else f.metadata["help"]
