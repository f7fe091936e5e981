"""Model configuration read from an HF-layout config.json: one decoder, the architectures as its settings.

Llama, Mistral, Qwen2/2.5, Qwen3, Gemma 3 (text) and Phi-3 are the same pre-norm decoder with a few switches
(transformers' config fields name them): q/k/v biases (Qwen2), RMSNorms on each head's q and k (Qwen3,
Gemma 3), sliding-window attention on all or some layers (Mistral, Qwen2's `use_sliding_window`, Gemma 3's
local layers, Phi-3), a RoPE base of their own for the local layers (Gemma 3), rotary on part of each head
(Phi-3's `partial_rotary_factor`), GeGLU instead of SwiGLU, norms on attention's and the MLP's outputs, an
embedding scale and a query scale (Gemma 3). Checkpoint layouts (Phi-3's fused qkv_proj / gate_up_proj) are
the loader's business (ARCHITECTURES names them); the decoder never branches on an architecture's name.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3")
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
LAYER_TYPES = ("full_attention", "sliding_attention")
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


@dataclass(frozen=True)
class Architecture:
    """One transformers model_type the decoder runs: its class names, the checkpoint's layout of the attention and
    MLP matrices, and the defaults of its transformers config class for the fields read here (save_pretrained
    leaves out every field equal to its class default, so a config.json alone does not say them)."""

    model_type: str
    classes: tuple[str, ...]
    defaults: dict
    fused_qkv: bool = False  # self_attn.qkv_proj / mlp.gate_up_proj (Phi-3) instead of q/k/v_proj, gate/up_proj


_COMMON = {"rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu", "rope_theta": 10000.0,
           "attention_bias": False, "mlp_bias": False, "sliding_window": None}
ARCHITECTURES: dict[str, Architecture] = {a.model_type: a for a in (
    Architecture("llama", ("LlamaForCausalLM",), {**_COMMON, "max_position_embeddings": 2048}),
    Architecture("mistral", ("MistralForCausalLM",),
                 {**_COMMON, "max_position_embeddings": 131072, "sliding_window": 4096}),
    Architecture("qwen2", ("Qwen2ForCausalLM",),
                 {**_COMMON, "max_position_embeddings": 32768, "use_sliding_window": False, "sliding_window": 4096,
                  "max_window_layers": 28}),
    Architecture("qwen3", ("Qwen3ForCausalLM",),
                 {**_COMMON, "max_position_embeddings": 32768, "head_dim": 128, "use_sliding_window": False,
                  "sliding_window": 4096, "max_window_layers": 28}),
    Architecture("gemma3_text", ("Gemma3ForCausalLM",),
                 {**_COMMON, "max_position_embeddings": 131072, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
                  "tie_word_embeddings": True, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10000.0,
                  "query_pre_attn_scalar": 256, "sliding_window": 4096, "sliding_window_pattern": 6,
                  "final_logit_softcapping": None, "attn_logit_softcapping": None,
                  "use_bidirectional_attention": False, "eos_token_id": 1, "bos_token_id": 2}),
    Architecture("phi3", ("Phi3ForCausalLM",),
                 {**_COMMON, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "partial_rotary_factor": 1.0},
                 fused_qkv=True),
)}


def supported_architectures() -> str:
    """The architectures the engine runs, for error messages: "LlamaForCausalLM (llama), ..."."""
    return ", ".join(f"{'/'.join(a.classes)} ({a.model_type})" for a in ARCHITECTURES.values())


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


def _rope_type(scaling: dict) -> str:
    return scaling.get("rope_type", scaling.get("type", "default"))


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
    rope_theta: float = 10000.0  # RoPE of the full-attention layers (every layer unless local_rope_theta is set)
    rope_scaling: dict = field(default_factory=dict)  # {"rope_type": ..., "factor": ...}; empty = default
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # biases on q, k and v (Qwen2; Llama's attention_bias)
    o_bias: bool = False  # a bias on the attention output (Llama's attention_bias)
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    torch_dtype: str | None = None
    architecture: str = "llama"  # the transformers model_type (ARCHITECTURES): the checkpoint's names and layout
    hidden_act: str = "silu"  # the gated MLP's activation: SwiGLU ("silu") or GeGLU ("gelu_pytorch_tanh")
    norm_offset: bool = False  # RMSNorm weights stored as w and applied as (1 + w), in fp32 before the cast (Gemma)
    qk_norm: bool = False  # an RMSNorm over each head's q and k before RoPE (Qwen3, Gemma 3)
    sandwich_norm: bool = False  # RMSNorms on attention's and the MLP's outputs before each residual add (Gemma 3)
    embed_scale: float = 1.0  # embeddings times this (Gemma: sqrt(hidden_size))
    query_scale: float | None = None  # attention's softmax scale; None: head_dim ** -0.5
    sliding_window: int | None = None  # a local layer's query sees this many slots, itself included
    layer_types: list[str] = field(default_factory=list)  # per layer, LAYER_TYPES; [] = all full_attention
    local_rope_theta: float | None = None  # RoPE base of the sliding layers when it differs (Gemma 3); None: rope_theta
    local_rope_scaling: dict = field(default_factory=dict)
    partial_rotary_factor: float = 1.0  # RoPE rotates the first head_dim * this dims of each head (Phi-3)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"config {name} must be a positive int, got {getattr(self, name)!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture {self.architecture!r} is not supported: expected one of {list(ARCHITECTURES)}")
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"activation {self.hidden_act!r} is not supported: expected one of {SUPPORTED_ACTIVATIONS}")
        for scaling in (self.rope_scaling, self.local_rope_scaling):
            if _rope_type(scaling) not in SUPPORTED_ROPE_TYPES:
                raise ValueError(f"rope_scaling type {_rope_type(scaling)!r} is not supported: expected one of "
                                 f"{SUPPORTED_ROPE_TYPES}")
        self.rope_scaling = {**self.rope_scaling, "rope_type": _rope_type(self.rope_scaling)}
        self.local_rope_scaling = {**self.local_rope_scaling, "rope_type": _rope_type(self.local_rope_scaling)}
        if self.layer_types and (len(self.layer_types) != self.num_hidden_layers
                                 or not set(self.layer_types) <= set(LAYER_TYPES)):
            raise ValueError(f"layer_types must name one of {LAYER_TYPES} per layer ({self.num_hidden_layers}), got "
                             f"{self.layer_types!r}")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window <= 0):
            raise ValueError(f"sliding_window must be a positive int or None, got {self.sliding_window!r}")
        if "sliding_attention" in self.layer_types and self.sliding_window is None:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is None")
        rotary = self.head_dim * self.partial_rotary_factor
        if not 0 < self.partial_rotary_factor <= 1 or int(rotary) % 2:
            raise ValueError(f"partial_rotary_factor {self.partial_rotary_factor} must give an even number of rotary "
                             f"dims in (0, head_dim {self.head_dim}]")

    @property
    def rope_type(self) -> str:
        return self.rope_scaling["rope_type"]

    @property
    def rotary_dim(self) -> int:
        """The dims of each head RoPE rotates (the first ones; the rest pass through)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def scale(self) -> float:
        """Attention's softmax scale."""
        return self.head_dim ** -0.5 if self.query_scale is None else self.query_scale

    def window(self, layer: int) -> int | None:
        """Layer's sliding window (slots a query sees, itself included), or None for full attention."""
        if self.sliding_window is None or (self.layer_types and self.layer_types[layer] != "sliding_attention"):
            return None
        return self.sliding_window

    def ropes(self) -> list[tuple[float, dict]]:
        """The RoPE tables the layers use, (base, scaling) each: the full-attention one first, then the local
        layers' where it differs (Gemma 3)."""
        full = (self.rope_theta, self.rope_scaling)
        local = (self.local_rope_theta, self.local_rope_scaling)
        return [full] if self.local_rope_theta is None or local == full else [full, local]

    def rope_index(self, layer: int) -> int:
        """Which of ropes() layer uses."""
        return 1 if len(self.ropes()) > 1 and self.window(layer) is not None else 0

    @property
    def llama_layers(self) -> bool:
        """Every layer computes what a Llama layer does: SwiGLU, plain RMSNorms before attention and the MLP only,
        full attention, RoPE on whole heads from one table."""
        return (self.hidden_act == "silu" and not (self.norm_offset or self.qk_norm or self.sandwich_norm)
                and self.sliding_window is None and self.partial_rotary_factor == 1.0 and len(self.ropes()) == 1)

    def kernel_layers(self, dtype: torch.dtype) -> bool:
        """Every layer is one the fused CPU kernel (kernels/layer_cpu.cpp's decode_layer) computes in dtype: in fp32
        any with RoPE on whole heads (q/k norms, output norms, GeGLU, sliding windows and a RoPE table per layer
        type are its LayerForm; (1 + w) norms are folded at load); in bf16 a Llama layer alone. Biases are the
        weights' business (model.LayerLinears.of)."""
        return self.partial_rotary_factor == 1.0 if dtype == torch.float32 else self.llama_layers

    def architecture_key(self) -> dict:
        """What a measured cost depends on beyond the sizes measured plans key on, for architectures other than
        Llama (a Llama model's cached plans keep their keys): the architecture and the head size."""
        return {} if self.architecture == "llama" else {"architecture": self.architecture, "head_dim": self.head_dim}

    def draft_layer_config(self) -> ModelConfig:
        """The config of an EAGLE draft layer over this model: a plain Llama layer (SwiGLU, full attention, no
        biases, the full-attention RoPE on the same rotary dims) of the model's sizes."""
        return replace(self, hidden_act="silu", norm_offset=False, qk_norm=False, sandwich_norm=False, qkv_bias=False,
                       o_bias=False, mlp_bias=False, query_scale=None, sliding_window=None, layer_types=[],
                       local_rope_theta=None, local_rope_scaling={})

    @classmethod
    def from_dict(cls, d: dict, source: str = "config") -> ModelConfig:
        """A transformers config.json's fields (the architecture's class defaults for those it leaves out)."""
        arch = ARCHITECTURES.get(d.get("model_type"))
        archs = d.get("architectures") or []
        if arch is None or (archs and not set(archs) & set(arch.classes)):
            raise ValueError(f"{source}: model_type {d.get('model_type')!r} / architectures {archs} is not an "
                             f"architecture this engine runs (supported: {supported_architectures()})")
        dflt = arch.defaults

        def get(key: str, default=None):
            return d[key] if key in d else dflt.get(key, default)

        for key in ("final_logit_softcapping", "attn_logit_softcapping"):
            if get(key) is not None:
                raise ValueError(f"{source}: {key}={get(key)} is not supported (soft-capped logits)")
        if get("use_bidirectional_attention"):
            raise ValueError(f"{source}: use_bidirectional_attention is not supported (a causal decoder only)")
        try:
            layers, hidden, heads = d["num_hidden_layers"], d["hidden_size"], d["num_attention_heads"]
            head_dim = get("head_dim") or hidden // heads
            full_rope, local_rope = cls._rope_of(d, arch)
            window, layer_types = cls._windows_of(d, arch, layers)
            eos = get("eos_token_id")
            gemma = arch.model_type == "gemma3_text"
            rope_extra = full_rope.pop("partial_rotary_factor", None)
            return cls(
                vocab_size=d["vocab_size"], hidden_size=hidden, intermediate_size=d["intermediate_size"],
                num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=d.get("num_key_value_heads") or heads, head_dim=head_dim,
                max_position_embeddings=get("max_position_embeddings", 2048),
                rms_norm_eps=get("rms_norm_eps", 1e-6), rope_theta=float(full_rope.pop("rope_theta")),
                rope_scaling=full_rope, tie_word_embeddings=get("tie_word_embeddings", False),
                qkv_bias=arch.model_type == "qwen2" or bool(get("attention_bias", False)),
                o_bias=bool(get("attention_bias", False)), mlp_bias=bool(get("mlp_bias", False)),
                bos_token_id=get("bos_token_id"),
                eos_token_id=[] if eos is None else [eos] if isinstance(eos, int) else list(eos),
                torch_dtype=d.get("dtype") or d.get("torch_dtype"), architecture=arch.model_type,
                hidden_act=get("hidden_activation") or get("hidden_act", "silu"), norm_offset=gemma,
                qk_norm=arch.model_type in ("qwen3", "gemma3_text"), sandwich_norm=gemma,
                embed_scale=math.sqrt(hidden) if gemma else 1.0,
                query_scale=get("query_pre_attn_scalar") ** -0.5 if gemma else None,
                sliding_window=window, layer_types=layer_types,
                local_rope_theta=None if local_rope is None else float(local_rope.pop("rope_theta")),
                local_rope_scaling=local_rope or {},
                partial_rotary_factor=float(rope_extra if rope_extra is not None else get("partial_rotary_factor", 1.0)),
            )
        except KeyError as e:
            raise ValueError(f"{source}: missing required field {e.args[0]!r}") from None
        except TypeError as e:
            raise ValueError(f"{source}: malformed field ({e})") from None

    @staticmethod
    def _rope_of(d: dict, arch: Architecture) -> tuple[dict, dict | None]:
        """(full-attention RoPE, local layers' RoPE or None), each a scaling dict with rope_theta inside.
        transformers >= 5 writes rope_parameters (rope_theta inside; Gemma 3: one per layer type); older configs
        rope_scaling + rope_theta (+ Gemma 3's rope_local_base_freq)."""
        params = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if "full_attention" in params or "sliding_attention" in params:  # per layer type
            full = dict(params.get("full_attention") or {})
            local = dict(params.get("sliding_attention") or {})
        else:
            full, local = dict(params), None
        full.setdefault("rope_theta", d.get("rope_theta", arch.defaults["rope_theta"]))
        if "rope_local_base_freq" in arch.defaults:  # Gemma 3: its local layers' base
            local = local if local is not None else {}
            local.setdefault("rope_theta", d.get("rope_local_base_freq", arch.defaults["rope_local_base_freq"]))
        return full, local

    @staticmethod
    def _windows_of(d: dict, arch: Architecture, layers: int) -> tuple[int | None, list[str]]:
        """(sliding window or None, layer types): Qwen2/3 use the window only with use_sliding_window, on the layers
        from max_window_layers; Gemma 3 on all but every sliding_window_pattern-th; others on every layer."""
        dflt = arch.defaults
        window = d.get("sliding_window", dflt.get("sliding_window"))
        if "use_sliding_window" in dflt and not d.get("use_sliding_window", dflt["use_sliding_window"]):
            window = None
        types = d.get("layer_types")
        if types is None:
            if window is None:
                types = []
            elif "max_window_layers" in dflt:
                first = d.get("max_window_layers", dflt["max_window_layers"])
                types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
            elif "sliding_window_pattern" in dflt:
                every = d.get("sliding_window_pattern", d.get("_sliding_window_pattern", dflt["sliding_window_pattern"]))
                types = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(layers)]
            else:
                types = ["sliding_attention"] * layers
        types = list(types)
        if window is None or "sliding_attention" not in types:
            return None, []
        return int(window), types

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
