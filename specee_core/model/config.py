"""Model configuration read from an HF-layout config.json."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3")
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


def resolve_dtype(dtype: str | torch.dtype | None, default: torch.dtype = torch.float32) -> torch.dtype:
    """Map a dtype name or torch.dtype to one of fp32 / bf16 / fp16; raise on anything else."""
    if dtype is None:
        return default
    if isinstance(dtype, torch.dtype):
        if dtype in DTYPES.values():
            return dtype
    elif isinstance(dtype, str) and dtype.removeprefix("torch.") in DTYPES:
        return DTYPES[dtype.removeprefix("torch.")]
    raise ValueError(f"unknown dtype {dtype!r}: expected one of auto, float32, bfloat16, float16")


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict = field(default_factory=dict)  # {"rope_type": ..., "factor": ...}; empty = default
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    torch_dtype: str | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"config {name} must be a positive int, got {getattr(self, name)!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")
        rope_type = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_scaling type {rope_type!r} is not supported: expected one of {SUPPORTED_ROPE_TYPES}")
        self.rope_scaling = {**self.rope_scaling, "rope_type": rope_type}

    @property
    def rope_type(self) -> str:
        return self.rope_scaling["rope_type"]

    @classmethod
    def from_dict(cls, d: dict, source: str = "config") -> ModelConfig:
        archs = d.get("architectures") or []
        if d.get("model_type") != "llama" or (archs and not set(archs) & set(SUPPORTED_ARCHITECTURES)):
            raise ValueError(f"{source}: model_type {d.get('model_type')!r} / architectures {archs} is not "
                             f"Llama-family (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        heads = d["num_attention_heads"]
        # transformers >= 5 writes rope_parameters (with rope_theta inside); older configs rope_scaling + rope_theta.
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", d.get("rope_theta", 10000.0))
        eos = d.get("eos_token_id")
        try:
            return cls(
                vocab_size=d["vocab_size"], hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
                num_hidden_layers=d["num_hidden_layers"], num_attention_heads=heads,
                num_key_value_heads=d.get("num_key_value_heads") or heads,
                head_dim=d.get("head_dim") or d["hidden_size"] // heads,
                max_position_embeddings=d.get("max_position_embeddings", 2048),
                rms_norm_eps=d.get("rms_norm_eps", 1e-6), rope_theta=float(theta), rope_scaling=rope,
                tie_word_embeddings=d.get("tie_word_embeddings", False),
                attention_bias=d.get("attention_bias", False), mlp_bias=d.get("mlp_bias", False),
                bos_token_id=d.get("bos_token_id"),
                eos_token_id=[] if eos is None else [eos] if isinstance(eos, int) else list(eos),
                torch_dtype=d.get("dtype") or d.get("torch_dtype"),
            )
        except KeyError as e:
            raise ValueError(f"{source}: missing required field {e.args[0]!r}") from None

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"config not found: {path}")
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        return cls.from_dict(d, source=str(path))
