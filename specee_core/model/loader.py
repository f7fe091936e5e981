"""Load an HF-layout checkpoint of a supported architecture (config.ARCHITECTURES) from a local directory.
Never downloads anything.

Reads config.json and one of: model.safetensors, model.safetensors.index.json (sharded), or
pytorch_model.bin (torch.load with weights_only=True). A .gguf file, or a directory holding one
.gguf and no config.json, is converted once into a cache directory (specee_core.model.gguf) and loaded
from there. A shard an index names must lie inside the model's directory (gguf.model_file). Every problem is
an error that names the file and what is wrong.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from specee_core.model.config import ARCHITECTURES, ModelConfig, resolve_dtype
from specee_core.model.gguf import model_file
from specee_core.model.model import LayerWeights, DecoderModel, ModelWeights, Weight
from kernels.ggml_blocks import as_q8_0
from specee_core.model.quant import ACT8, LOW_BIT, NATIVE, QK, QuantWeight, planes_of, quantize, squared_error

log = logging.getLogger(__name__)

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def find_model_dir(path: str | Path) -> Path:
    """The HF-layout directory for path: the directory itself, or the cached conversion of a
    .gguf file (given directly, or the only .gguf in a directory without config.json)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model directory not found: {path}")
    if path.is_file() and path.suffix == ".gguf":
        return _gguf_dir(path)
    if not path.is_dir():
        raise NotADirectoryError(f"model path is not a directory or a .gguf file: {path}")
    if not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) > 1:
            raise ValueError(f"{path}: no config.json and {len(ggufs)} .gguf files "
                             f"({', '.join(g.name for g in ggufs)}); pass the one to load")
        if ggufs:
            return _gguf_dir(ggufs[0])
    return path


def _gguf_dir(gguf_path: Path) -> Path:
    from specee_core.model.gguf import converted_dir

    model_dir = converted_dir(gguf_path)
    log.info("%s: loading its conversion in %s", gguf_path, model_dir)
    return model_dir


def read_state_dict(model_dir: Path) -> tuple[dict[str, torch.Tensor], dict[str, Path]]:
    """Return (tensors by name, file each came from)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    origin: dict[str, Path] = {}

    def add(file: Path, loaded: dict[str, torch.Tensor]) -> None:
        for name, t in loaded.items():
            tensors[name] = t
            origin[name] = file

    def load_one(file: Path) -> dict[str, torch.Tensor]:
        if not file.is_file():
            raise FileNotFoundError(f"weight file not found: {file}")
        try:
            if file.suffix == ".safetensors":
                return load_file(str(file))
            return torch.load(file, map_location="cpu", weights_only=True)
        except (OSError, RuntimeError, ValueError, SafetensorError, EOFError) as e:  # corrupt or truncated
            raise ValueError(f"{file}: cannot read weights ({type(e).__name__}: {e})") from e

    for name in WEIGHT_FILES:
        file = model_dir / name
        if not file.is_file():
            continue
        if name.endswith(".index.json"):
            try:
                weight_map = json.loads(file.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{file}: not a valid weight index ({e})") from None
            if not isinstance(weight_map, dict):
                raise ValueError(f"{file}: not a valid weight index (weight_map is a {type(weight_map).__name__}, "
                                 f"expected an object of tensor name -> shard file)")
            shards = {model_file(model_dir, shard, listed_in=file) for shard in weight_map.values()}
            for shard in sorted(shards):
                add(shard, load_one(shard))
        else:
            add(file, load_one(file))
        return tensors, origin
    raise FileNotFoundError(f"{model_dir}: no weights found (expected one of {', '.join(WEIGHT_FILES)})")


def build_weights(config: ModelConfig, tensors: dict[str, torch.Tensor], origin: dict[str, Path],
                  device: torch.device, dtype: torch.dtype, model_dir: Path, weights: str | None = None) -> ModelWeights:
    """weights "q4" / "q8": the layers' matrices quantized at load (specee_core.model.quant), the embedding /
    LM head in q8; "gguf" (NATIVE): every matrix in the GGUF file's own format (native_weight); anything else:
    every tensor in dtype. Norm weights of a (1 + w) architecture (Gemma) are
    stored as 1 + w, in fp32 (as Gemma's norm computes it)."""
    c = config
    q, kv, d, inter = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, c.hidden_size, c.intermediate_size
    fused = ARCHITECTURES[c.architecture].fused_qkv

    def get(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        t = tensors.get(name)
        if t is None:
            raise ValueError(f"{model_dir}: tensor {name!r} missing from the checkpoint")
        if tuple(t.shape) != shape:
            raise ValueError(f"{origin[name]}: tensor {name!r} has shape {tuple(t.shape)}, expected {shape} "
                             f"from config.json")
        return t

    def put(*parts: torch.Tensor | None) -> torch.Tensor | None:
        if parts[0] is None:
            return None
        t = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        return t.to(device=device, dtype=dtype).contiguous()

    def norm(name: str, size: int) -> torch.Tensor:
        t = get(name, (size,))
        return (1.0 + t.float()).to(device) if c.norm_offset else put(t)

    def mat(*parts: torch.Tensor, fmt: str | None = weights) -> Weight:
        if fmt == NATIVE:
            return native_weight(*parts)
        planes, act8 = planes_of(fmt)
        if planes is None:
            return put(*parts)
        if parts[0].shape[1] % QK:  # llama.cpp too keeps such a tensor in a float type
            kept_dense.append(f"{tuple(parts[0].shape)}")
            return put(*parts)
        w = parts[0].to(device) if len(parts) == 1 else torch.cat([p.to(device) for p in parts], dim=0)
        qw = quantize(w, planes)
        qw.act8 = act8
        e, n = squared_error(qw, w)
        err[0] += e
        err[1] += n
        return qw

    kept_dense: list[str] = []
    err = [0.0, 0.0]  # squared error and squared norm of the quantized matrices
    if weights == NATIVE:
        from specee_core.model.gguf import BLOCKS_FILE, read_blocks

        found = read_blocks(model_dir)
        if found is None:
            raise ValueError(f"weights={NATIVE!r}: {model_dir} has no {BLOCKS_FILE} (only the conversion of a GGUF file "
                             f"with block-format tensors has; import it again, or pass weights=q4/q8/None)")
        raw_blocks, gguf_types = found
        name_of = {id(t): n for n, t in tensors.items()}

    def q8_planes(part: torch.Tensor, name: str, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        """A Q8_0 / Q4_0 / Q5_0 matrix as Q8_0 planes (qs, d), its values exactly."""
        if kind == "Q8_0":
            qw = quantize(part.to(device), "q8")
            return qw.qs, qw.d
        return as_q8_0(raw_blocks[name].to(device), kind.lower())

    def native_weight(*parts: torch.Tensor) -> Weight:
        """The parts (one matrix, or q/k/v, gate/up put together) in the file's own format: its blocks where
        every part is stored in one block format, Q4_1 / Q8_0 planes (quantizing their values gives back the
        file's blocks exactly), Q8_0 planes for parts mixing Q4_0 / Q5_0 / Q8_0 (each exact in Q8_0), else dense
        in dtype (a float tensor, or parts of other mixed types)."""
        names = [name_of.get(id(p)) for p in parts]
        kinds = [gguf_types.get(n) for n in names]  # None: a float tensor
        kind = kinds[0] if len(set(kinds)) == 1 else None
        if kind is not None and all(n in raw_blocks for n in names):
            return QuantWeight(kind.lower(), torch.cat([raw_blocks[n] for n in names]).to(device).contiguous())
        if kind in ("Q4_1", "Q8_0"):
            return mat(*parts, fmt="q4" if kind == "Q4_1" else "q8")
        if (kind is None and set(kinds) <= {"Q4_0", "Q5_0", "Q8_0"} and all(p.shape[1] % QK == 0 for p in parts)
                and all(k == "Q8_0" or n in raw_blocks for n, k in zip(names, kinds))):
            # types that Q8_0 holds without loss (Gemma 3's q/k in Q5_0 with v in Q8_0): one q8 matrix
            planes = [q8_planes(p, n, k) for p, n, k in zip(parts, names, kinds)]
            return QuantWeight("q8", torch.cat([qs for qs, _ in planes]).contiguous(),
                               torch.cat([d for _, d in planes]).contiguous())
        kept_dense.append(f"{'+'.join(str(n) for n in names)} ({'/'.join(k or 'float' for k in kinds)})")
        return put(*parts)

    def qkv(a: str, kind: str) -> list[torch.Tensor]:  # q, k, v weights or biases (Phi-3: one fused tensor)
        sizes = {"weight": lambda o: (o, d), "bias": lambda o: (o,)}[kind]
        if fused:
            return [get(f"{a}qkv_proj.{kind}", sizes(q + 2 * kv))]
        return [get(f"{a}{x}_proj.{kind}", sizes(o)) for x, o in (("q", q), ("k", kv), ("v", kv))]

    def gate_up(m: str, kind: str) -> list[torch.Tensor]:  # gate then up (Phi-3: one fused tensor, in that order)
        sizes = {"weight": lambda o: (o, d), "bias": lambda o: (o,)}[kind]
        if fused:
            return [get(f"{m}gate_up_proj.{kind}", sizes(2 * inter))]
        return [get(f"{m}{x}_proj.{kind}", sizes(inter)) for x in ("gate", "up")]

    layers = []
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        sandwich = c.sandwich_norm  # Gemma: post_attention_layernorm is on attention's output; the MLP's is pre_feedforward
        layers.append(LayerWeights(
            input_norm=norm(p + "input_layernorm.weight", d),
            wqkv=mat(*qkv(a, "weight")),
            bqkv=put(*qkv(a, "bias")) if c.qkv_bias else None,
            wo=mat(get(a + "o_proj.weight", (d, q))),
            bo=put(get(a + "o_proj.bias", (d,))) if c.o_bias else None,
            post_norm=norm(p + ("pre_feedforward_layernorm.weight" if sandwich else "post_attention_layernorm.weight"), d),
            w_gate_up=mat(*gate_up(m, "weight")),
            b_gate_up=put(*gate_up(m, "bias")) if c.mlp_bias else None,
            w_down=mat(get(m + "down_proj.weight", (d, inter))),
            b_down=put(get(m + "down_proj.bias", (d,))) if c.mlp_bias else None,
            q_norm=norm(a + "q_norm.weight", c.head_dim) if c.qk_norm else None,
            k_norm=norm(a + "k_norm.weight", c.head_dim) if c.qk_norm else None,
            attn_out_norm=norm(p + "post_attention_layernorm.weight", d) if sandwich else None,
            mlp_out_norm=norm(p + "post_feedforward_layernorm.weight", d) if sandwich else None,
        ))
    # llama.cpp's choice for this head too (4 bits hurt it most), with the layers' activations
    head_fmt = NATIVE if weights == NATIVE else None if planes_of(weights)[0] is None else \
        "q8" + ("a8" if planes_of(weights)[1] else "")
    embed = mat(get("model.embed_tokens.weight", (c.vocab_size, d)), fmt=head_fmt)
    head = tensors.get("lm_head.weight")
    if head is None and not c.tie_word_embeddings:
        raise ValueError(f"{model_dir}: tensor 'lm_head.weight' missing and tie_word_embeddings is false")
    lm_head = embed if c.tie_word_embeddings or head is None else mat(get("lm_head.weight", (c.vocab_size, d)), fmt=head_fmt)
    if kept_dense and weights == NATIVE:
        log.info("%s: %d matrices kept in %s (float, or parts of mixed GGUF types): %s", model_dir, len(kept_dense),
                 dtype, "; ".join(kept_dense))
    elif kept_dense:
        log.warning("%s: %d matrices kept in %s, not %s: input dims not a multiple of %d (shapes %s)", model_dir,
                    len(kept_dense), dtype, weights, QK, ", ".join(sorted(set(kept_dense))))
    quant_error = (err[0] / err[1]) ** 0.5 if err[1] else None
    if quant_error is not None:
        log.info("%s: %s weights, relative quantization error %.3g", model_dir, weights, quant_error)
    return ModelWeights(embed=embed, layers=layers, norm=norm("model.norm.weight", d), lm_head=lm_head,
                        quant_error=quant_error)


def load_model(path: str | Path, device: str | torch.device = "cpu",
               dtype: str | torch.dtype | None = None, weights: str | None = None) -> DecoderModel:
    """Load config and weights from a local HF-layout directory. dtype None: fp32 on CPU, the
    checkpoint's own dtype on CUDA; "auto": bf16 where the hardware computes it natively, else fp32.
    weights: None (the matrices in dtype) or a low-bit format of specee_core.model.quant ("q8", "q4"; "q8a8",
    "q4a8": int8 activations in the linears), quantized at load; "gguf": a GGUF conversion's matrices in the file's
    own formats (Q4_K, Q6_K, Q5_0 ... blocks as stored); the activations stay in dtype elsewhere."""
    if weights is not None and weights not in (*LOW_BIT, *ACT8, NATIVE):
        raise ValueError(f"weights={weights!r}: expected None or one of {(*LOW_BIT, *ACT8, NATIVE)}")
    model_dir = find_model_dir(path)
    config = ModelConfig.from_file(model_dir / "config.json")
    device = torch.device(device)
    if dtype == "auto":
        from specee_core.machine import choose_dtype

        dtype = choose_dtype(device)[0]
    if dtype is None:
        dtype = resolve_dtype(config.torch_dtype) if device.type == "cuda" and config.torch_dtype else torch.float32
    dtype = resolve_dtype(dtype)
    tensors, origin = read_state_dict(model_dir)
    mw = build_weights(config, tensors, origin, device, dtype, model_dir, weights)
    log.info("loaded %s: %d layers, d=%d, %s%s on %s", model_dir, config.num_hidden_layers, config.hidden_size, dtype,
             f", {weights} weights" if weights else "", device)
    return DecoderModel(config, mw, device, dtype)


# tokenizer_config.json classes that are tokenizer.json run by the `tokenizers` library (what the GGUF import writes)
FAST_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(path: str | Path):
    """The tokenizer saved beside the model (tokenizer.json / tokenizer_config.json), offline.

    A tokenizer.json whose config names a fast class loads through that class: the same object AutoTokenizer
    returns, without AutoTokenizer's detour through the model's config classes (about 4 s of imports in a fresh
    process, paid by every engine actor, prepare actor and quarantined child)."""
    model_dir = find_model_dir(path)
    if not (model_dir / "tokenizer.json").is_file() and not (model_dir / "tokenizer_config.json").is_file():
        raise FileNotFoundError(f"{model_dir}: no tokenizer found (expected tokenizer.json or tokenizer_config.json)")
    config = model_dir / "tokenizer_config.json"
    try:
        named = json.loads(config.read_text()).get("tokenizer_class") if config.is_file() else None
    except json.JSONDecodeError as e:
        raise ValueError(f"{config}: not valid JSON ({e})") from e
    if named in FAST_TOKENIZER_CLASSES and (model_dir / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(model_dir), local_files_only=True)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
