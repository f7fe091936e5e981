"""The decoder, written for decoding: fused QKV and gate/up weights, a layer-by-layer API (embed, layer i, final
norm, LM head) so a caller can stop after any layer. One decoder for every architecture (config.py): Llama's layer,
with what the config switches on (biases, q/k norms, sliding windows, per-layer RoPE, GeGLU, norms around attention
and the MLP, an embedding scale); the fused CPU kernel runs the decode steps of the layers it computes
(config.kernel_layers: in fp32 all with RoPE on whole heads, in bf16 Llama's)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from specee_core.model.config import ModelConfig
from specee_core.model.kv_cache import KVCache
from specee_core.model.quant import NATIVE, HoldSwitch, QuantLinear, QuantWeight, embedding, cpu_kernel, take_rows
from specee_core.model.rope import RotaryEmbedding, apply_rope


Weight = torch.Tensor | QuantWeight  # a matrix in the model dtype, or low-bit blocks (specee_core.model.quant)


@dataclass
class LayerWeights:
    input_norm: torch.Tensor | None  # [D]; None = no norm (EAGLE-1's draft layer skips it)
    wqkv: Weight  # [(H + 2 Hkv) hd, D]
    bqkv: torch.Tensor | None  # [(H + 2 Hkv) hd]
    wo: Weight  # [D, H hd]
    bo: torch.Tensor | None  # [D]
    post_norm: torch.Tensor  # [D]
    w_gate_up: Weight  # [2 I, D]
    b_gate_up: torch.Tensor | None  # [2 I]
    w_down: Weight  # [D, I]
    b_down: torch.Tensor | None  # [D]
    q_norm: torch.Tensor | None = None  # [hd]: an RMSNorm over each head's q before RoPE (config.qk_norm)
    k_norm: torch.Tensor | None = None  # [hd]
    attn_out_norm: torch.Tensor | None = None  # [D]: on o_proj's output before the residual add (sandwich_norm)
    mlp_out_norm: torch.Tensor | None = None  # [D]: on down_proj's output before the residual add


@dataclass
class ModelWeights:
    embed: Weight  # [V, D]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [D]
    lm_head: Weight  # [V, D]; the embedding itself when tied
    # low-bit weights quantized at load: ||W - dequant(Q)|| / ||W|| over every quantized matrix (0.0:
    # the checkpoint's values were already those blocks, as a GGUF's are); None: nothing was quantized
    quant_error: float | None = None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as HF Llama computes it: in fp32, cast back to x's dtype before the weight
    (bit-compatible in bf16/fp16)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class RMSNorm:
    """rms_norm with a fixed weight [D], in fewer kernels than the formula's eight. fp32 on CPU: one
    fused layer_norm of [x, -x] with weight [w, w], whose mean is zero by construction, so its variance
    is mean(x^2) (equal to rms_norm within fp32 rounding; faster than torch's rms_norm there). Other
    dtypes: torch's fused rms_norm on the fp32 copy, cast back, times the weight: bit-identical to HF's
    formula (tested). upcast (Gemma's norm; its fp32 weight is 1 + w, folded at load): the weight multiplies
    the fp32 copy before the cast, as Gemma's RMSNorm computes."""

    def __init__(self, weight: torch.Tensor, eps: float, upcast: bool = False):
        self.weight, self.eps, self.upcast = weight, eps, upcast
        self.fused = weight.dtype == torch.float32 and weight.device.type == "cpu"
        self.ln_weight = torch.cat((weight, weight)) if self.fused else None  # [2D]
        self.shape = weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            if self.fused:
                d = x.shape[-1]
                return F.layer_norm(torch.cat((x, -x), dim=-1), (2 * d,), self.ln_weight, None, self.eps)[..., :d]
            return F.rms_norm(x, self.shape, self.weight, self.eps)
        if self.upcast:
            return (F.rms_norm(x.float(), self.shape, None, self.eps) * self.weight.float()).to(x.dtype)
        return F.rms_norm(x.float(), self.shape, None, self.eps).to(x.dtype) * self.weight


def _can_pack(w: torch.Tensor) -> bool:
    return (w.device.type == "cpu" and w.dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class Linear:
    """y = x @ w.T (+ b) for a weight w [out, in]. On CPU in bf16 the weight is also kept in oneDNN's
    blocked layout, packed on first use: its GEMV reads memory about twice as fast as the plain
    layout's at decode sizes (1-16 rows), with bit-identical results. Elsewhere: F.linear."""

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None = None, pack: bool | None = None):
        self.w, self.b = w, b
        self.pack = _can_pack(w) if pack is None else pack
        self._packed: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.pack:
            return F.linear(x, self.w, self.b)
        if self._packed is None:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(self.w, 1)
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.b, "none", [], "")


def make_linear(w: Weight, b: torch.Tensor | None = None) -> Linear | QuantLinear:
    """The Linear variant for a weight's format: a plain (or oneDNN-packed) matrix, or low-bit blocks."""
    return QuantLinear(w, b) if isinstance(w, QuantWeight) else Linear(w, b)


def _rows(w: Weight, start: int) -> Weight:
    return w.rows(slice(start, None)) if isinstance(w, QuantWeight) else w[start:]


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": gelu_tanh}  # the gated MLP's (config.hidden_act)


@dataclass
class LayerLinears:
    qkv: Linear | QuantLinear
    o: Linear | QuantLinear
    gate_up: Linear | QuantLinear
    down: Linear | QuantLinear
    kv: Linear | QuantLinear  # the K/V rows of qkv alone (write_kv, for layers an exit skipped)
    act: Callable[[torch.Tensor], torch.Tensor] = F.silu  # of the gate (ACTIVATIONS)

    @staticmethod
    def of(lw: LayerWeights, q_size: int, dtype: torch.dtype, kernel_layer: bool = True,
           act: Callable[[torch.Tensor], torch.Tensor] = F.silu) -> LayerLinears:
        """The layer's linears. On CPU, for a layer the fused kernel computes (kernel_layer: config.kernel_layers)
        without biases, decode steps run the layer in one C++ call: low-bit ones (Q4_1 / Q8_0 planes, GGUF blocks)
        with fp32 activations (FusedLowbitLinears), dense fp32 matrices and oneDNN-packed bf16 ones
        (FusedDenseLinears)."""
        kv_bias = None if lw.bqkv is None else lw.bqkv[q_size:]
        lins = (make_linear(lw.wqkv, lw.bqkv), make_linear(lw.wo, lw.bo), make_linear(lw.w_gate_up, lw.b_gate_up),
                make_linear(lw.w_down, lw.b_down), make_linear(_rows(lw.wqkv, q_size), kv_bias))
        main = lins[:4]
        if not kernel_layer or any(lin.b is not None for lin in main) or cpu_kernel() is None:
            return LayerLinears(*lins, act=act)
        if (all(isinstance(lin, QuantLinear) and not lin.qw.act8 for lin in main)
                and dtype == torch.float32
                and lins[0].qw.device.type == "cpu"):
            return FusedLowbitLinears(*lins, act=act)
        if all(type(lin) is Linear and lin.w.device.type == "cpu" and lin.w.dtype == dtype
               and (dtype == torch.float32 or dtype == torch.bfloat16 and lin.pack) for lin in main):
            return FusedDenseLinears(*lins, act=act)
        return LayerLinears(*lins, act=act)

    # the three pieces of a layer around attention; FusedLowbitLinears runs each as one kernel call
    def qkv_normed(self, h: torch.Tensor, norm: RMSNorm | None) -> torch.Tensor:
        """qkv(norm(h)) for h [N, T, D] -> [N, T, (H + 2 Hkv) hd]."""
        return self.qkv(h if norm is None else norm(h))

    def o_add(self, o: torch.Tensor, h: torch.Tensor, out_norm: RMSNorm | None = None) -> torch.Tensor:
        """h + o_proj(o) for attention output o [N, T, H hd] and the residual h [N, T, D]; out_norm: h +
        out_norm(o_proj(o)) (Gemma's norm after attention)."""
        return h + (self.o(o) if out_norm is None else out_norm(self.o(o)))

    def mlp(self, h: torch.Tensor, norm: RMSNorm, out_norm: RMSNorm | None = None) -> torch.Tensor:
        """h + down(act(gate) * up) with (gate, up) = gate_up(norm(h)); out_norm: on down's output (Gemma)."""
        gate, up = self.gate_up(norm(h)).chunk(2, dim=-1)
        y = self.down(self.act(gate).mul_(up))
        return h + (y if out_norm is None else out_norm(y))


@dataclass
class FusedLayerLinears(LayerLinears):
    """Linears whose whole layer, for a decode step or a drafted chunk, is one C++ call (decode_layer; a model's
    layers together: DecoderModel._fused_stack). planes(): the kernel's weight arguments."""

    _planes: list[list[torch.Tensor]] | None = field(default=None, repr=False)  # decode_layer's, made once

    def _prefill(self, x: torch.Tensor) -> bool:
        """x's rows are a prefill's (the layer then runs its pieces op by op)."""
        return False

    def planes(self) -> list[list[torch.Tensor]]:
        raise NotImplementedError

    def formats(self) -> list[str]:
        """Per linear (qkv, o, gate_up, down): the GGUF block format its planes() are, or "" (planes, dense)."""
        return ["", "", "", ""]

    def decode_layer(self, h: torch.Tensor, norms: tuple[RMSNorm, RMSNorm], rope: tuple[torch.Tensor, torch.Tensor],
                     slot: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], heads: tuple[int, int],
                     scale: float, tree: torch.Tensor | None, form) -> torch.Tensor:
        """The whole layer for h [N, T, D] in one kernel call: rope the layer's (cos, sin) [N, 1, T, hd]; slot
        (keys, values, starts, cache rows or None), row r's K/V written from slot starts[r] on (the caller advances
        the cache); tree [N, T, T] bool: which of the chunk's tokens each one sees (None: causal); form: the
        kernel's LayerForm of this layer (DecoderModel._kernel_form)."""
        out = cpu_kernel().decode_layer(_rows2d(h), norms[0].weight, norms[1].weight, norms[0].eps, *self.planes(),
                                          *rope, *slot, *heads, scale, tree, form)
        return out.view(h.shape)


@dataclass
class FusedDenseLinears(FusedLayerLinears):
    """Dense matrices on CPU (fp32; bf16 in oneDNN's packed layout) whose decode layer is one C++ call: the norms,
    RoPE, attention, SiLU and residual adds between the GEMMs as plain loops, the GEMMs the ops the Python layer
    calls (F.linear, mkldnn's linear on the packed weight). In bf16 each elementwise op rounds as its ATen op does,
    so the two paths agree up to fp32 reassociation (tests/test_quant.py)."""

    def planes(self) -> list[list[torch.Tensor]]:
        if self._planes is None:
            for lin in (self.qkv, self.o, self.gate_up, self.down):
                if lin.pack and lin._packed is None:
                    lin._packed = torch.ops.mkldnn._reorder_linear_weight(lin.w, 1)
            self._planes = [[lin._packed if lin.pack else lin.w] for lin in (self.qkv, self.o, self.gate_up, self.down)]
        return self._planes


@dataclass
class FusedLowbitLinears(FusedLayerLinears):
    """Low-bit linears (Q4_1 / Q8_0 planes, GGUF block formats, a file's mix of them) whose decode layer is one C++
    call, and whose layer pieces (norm + qkv, o + residual, the whole SwiGLU MLP) on planes are one C++ call each
    (kernels/lowbit_cpu.cpp): the norm, SiLU and residual adds between the GEMVs go through ATen from C++
    instead of a dozen Python-dispatched ops. Same math as LayerLinears' (tested against it). From the
    rows where dequantize + GEMM is faster (prefill: QuantLinear.dense_from), the pieces run unfused; so do the
    pieces over block formats, GeGLU and output norms (QuantLinear's ops)."""

    def _prefill(self, x: torch.Tensor) -> bool:
        return self.qkv.dense_from(x.numel() // x.shape[-1])  # (on in every prefill whose linears hold bf16 copies)

    def qkv_normed(self, h: torch.Tensor, norm: RMSNorm | None) -> torch.Tensor:
        if norm is None or self._prefill(h) or self.qkv.qw.blocks:
            return super().qkv_normed(h, norm)
        w = self.qkv.qw
        return cpu_kernel().norm_linear(_rows2d(h), norm.weight, norm.eps, w.qs, w.d, w.m).view(*h.shape[:-1], -1)

    def o_add(self, o: torch.Tensor, h: torch.Tensor, out_norm: RMSNorm | None = None) -> torch.Tensor:
        if self._prefill(h) or out_norm is not None or self.o.qw.blocks:
            return super().o_add(o, h, out_norm)
        w = self.o.qw
        return cpu_kernel().linear_add(_rows2d(o), w.qs, w.d, w.m, _rows2d(h)).view(h.shape)

    def mlp(self, h: torch.Tensor, norm: RMSNorm, out_norm: RMSNorm | None = None) -> torch.Tensor:
        if (self._prefill(h) or out_norm is not None or self.act is not F.silu or self.gate_up.qw.blocks
                or self.down.qw.blocks):
            return super().mlp(h, norm, out_norm)
        gu, dn = self.gate_up.qw, self.down.qw
        return cpu_kernel().mlp(_rows2d(h), norm.weight, norm.eps, gu.qs, gu.d, gu.m, dn.qs, dn.d, dn.m).view(h.shape)

    def planes(self) -> list[list[torch.Tensor]]:
        """The kernel's arguments for qkv, o, gate_up and down: each (qs, d) or (qs, d, m), or a block format's
        bytes (qs) alone (formats() names it)."""
        if self._planes is None:
            self._planes = [[t for t in (lin.qw.qs, lin.qw.d, lin.qw.m) if t is not None]
                            for lin in (self.qkv, self.o, self.gate_up, self.down)]
        return self._planes

    def formats(self) -> list[str]:
        return [lin.qw.fmt if lin.qw.blocks else "" for lin in (self.qkv, self.o, self.gate_up, self.down)]


def _rows2d(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()


class DecoderModel:
    """The decoder of every supported architecture (config.py), layer by layer."""

    def __init__(self, config: ModelConfig, weights: ModelWeights, device: torch.device | str, dtype: torch.dtype):
        self.config = config
        self.w = weights
        self.device = torch.device(device)
        self.dtype = dtype
        # CPU half precision keeps K/V in fp32 and attends in fp32: torch's CPU attention kernel is 3-6x
        # slower in bf16 than in fp32 at decode sizes, and the upcast of bf16 K/V is exact
        half_on_cpu = self.device.type == "cpu" and dtype in (torch.bfloat16, torch.float16)
        self.kv_dtype = torch.float32 if half_on_cpu else dtype
        self.rope = RotaryEmbedding(config, self.device)
        c = config
        eps, upcast = c.rms_norm_eps, c.norm_offset

        def norms(name: str) -> list[RMSNorm | None]:
            return [None if getattr(lw, name) is None else RMSNorm(getattr(lw, name), eps, upcast) for lw in weights.layers]

        self.input_norms = norms("input_norm")
        self.post_norms = norms("post_norm")  # before the MLP
        self.q_norms, self.k_norms = norms("q_norm"), norms("k_norm")
        self.attn_out_norms, self.mlp_out_norms = norms("attn_out_norm"), norms("mlp_out_norm")
        self.norm = RMSNorm(weights.norm, eps, upcast)
        # Gemma's embedding scale, rounded to the dtype as transformers rounds it
        self.embed_scale = None if c.embed_scale == 1.0 else torch.tensor(c.embed_scale).to(self.device, dtype)
        self.q_size = c.num_attention_heads * c.head_dim
        self.linears = [LayerLinears.of(lw, self.q_size, dtype, c.kernel_layers(dtype), ACTIVATIONS[c.hidden_act])
                        for lw in weights.layers]
        self.head = make_linear(weights.lm_head)
        self.prefilling = HoldSwitch()  # on during a prefill forward (hold_for_prefill)
        self.held_bytes = 0
        self.qk_heads = c.num_attention_heads + c.num_key_value_heads  # heads RoPE rotates
        self.all_heads = self.qk_heads + c.num_key_value_heads
        self.qk_split = (c.num_attention_heads, c.num_key_value_heads)
        self.scale = c.scale
        self.gqa = c.num_attention_heads != c.num_key_value_heads
        self.windows = [c.window(i) for i in range(self.num_layers)]  # per layer: its sliding window or None
        self.rope_index = [c.rope_index(i) for i in range(self.num_layers)]
        self.multi_rope = len(c.ropes()) > 1
        # the stack of layers in one call takes Llama layers (no LayerForm) over planes or dense matrices
        self._stackable = (all(isinstance(lin, FusedLayerLinears) and not any(lin.formats()) for lin in self.linears)
                           and all(n is not None for n in self.input_norms) and c.llama_layers)
        self._stack = None  # kernels' LayerStack, bound on first use
        self._forms: list[tuple | None] = [None] * self.num_layers  # per layer: (window, its kernel LayerForm)

    @property
    def weight_format(self) -> str:
        """How the layers' matrices are stored and multiplied: "q4" / "q8" / "q4a8" / "q8a8" (specee_core.model.quant)
        or the dtype ("fp32", "bf16", "fp16"); "gguf" where any matrix is in a GGUF block format (a file's mix)."""
        mats = [m for layer in self.w.layers for m in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down)]
        if any(isinstance(m, QuantWeight) and m.blocks for m in mats):
            return NATIVE
        w = self.w.layers[0].wqkv
        return w.format if isinstance(w, QuantWeight) else {torch.float32: "fp32", torch.bfloat16: "bf16",
                                                          torch.float16: "fp16"}[w.dtype]

    @property
    def fused_layers(self) -> bool:
        """Decode steps run each layer as one call of the CPU kernel (kernels/layer_cpu.cpp): their speed is its."""
        return any(isinstance(lin, FusedLayerLinears) for lin in self.linears)

    @property
    def num_layers(self) -> int:
        """The decoder layers this model holds: config.num_hidden_layers, or 1 for a draft head's layer."""
        return len(self.w.layers)

    def new_cache(self, batch: int, max_len: int, room: int = 256) -> KVCache:
        """A cache of max_len slots a row; the sliding-window layers keep their window plus `room` slots (the most a
        forward writes at once: more grows them)."""
        c = self.config
        return KVCache(self.num_layers, batch, c.num_key_value_heads, max_len, c.head_dim, self.kv_dtype, self.device,
                       self.windows, room)

    # ---- the layer-by-layer API -------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [N, T] -> hidden [N, T, D] (times the config's embed_scale)."""
        h = embedding(input_ids, self.w.embed, self.dtype)
        return h if self.embed_scale is None else h * self.embed_scale

    def head_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """LM-head rows ids [...] -> [..., D] in the model dtype (dequantized when the head is low-bit)."""
        return take_rows(self.w.lm_head, ids, self.dtype)

    def rope_for(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [N, T] -> (cos, sin) [N, R, T, rd], computed once per step for all layers (R: the RoPE tables,
        1 unless local layers have their own; rd: the rotary dims, head_dim unless partial)."""
        return self.rope(positions, self.dtype)

    def _layer_rope(self, i: int, rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's (cos, sin) [N, 1, T, rd] of rope_for's."""
        if not self.multi_rope:
            return rope
        r = self.rope_index[i]
        return rope[0][:, r : r + 1], rope[1][:, r : r + 1]

    def _rotate_qk(self, i: int, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """(q [N, H, T, hd], k [N, Hkv, T, hd]) of layer i from qkv [N, H + 2 Hkv, T, hd]: normed per head where the
        config says (q_norm / k_norm), rotated."""
        cos, sin = self._layer_rope(i, rope)
        if self.q_norms[i] is None:
            return apply_rope(qkv[:, : self.qk_heads], cos, sin).split(self.qk_split, dim=1)  # one rotation for q, k
        h = self.qk_split[0]
        return (apply_rope(self.q_norms[i](qkv[:, :h]), cos, sin),
                apply_rope(self.k_norms[i](qkv[:, h : self.qk_heads]), cos, sin))

    def layer(self, i: int, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: KVCache,
              rows: torch.Tensor | None = None, n_valid: torch.Tensor | None = None,
              tree: torch.Tensor | None = None) -> torch.Tensor:
        """Run decoder layer i on hidden h [N, T, D] of cache rows `rows` [N] (None = all rows); tree
        [N, T, T] bool: the chunk is a draft tree, node j attends to the nodes i with tree[:, j, i]."""
        c, lin = self.config, self.linears[i]
        n, t, _ = h.shape
        if (n_valid is None and isinstance(lin, FusedLayerLinears) and self.input_norms[i] is not None
                and (t == 1 or tree is not None and tree.shape[-1] == t) and not lin._prefill(h)):
            host_rows = None if rows is None else rows.cpu()  # a step, or a draft verified, in one C++ call
            k, v, starts = cache.decode_slots(i, host_rows, t)
            h = lin.decode_layer(h, (self.input_norms[i], self.post_norms[i]), self._layer_rope(i, rope),
                                 (k, v, starts, host_rows), self.qk_split, self.scale,
                                 None if tree is None else tree.to(h.device).contiguous(), self._kernel_form(i))
            cache.advance(i, host_rows, t)
            return h
        qkv = lin.qkv_normed(h, self.input_norms[i]).view(n, t, self.all_heads, c.head_dim).transpose(1, 2)
        q, k = self._rotate_qk(i, qkv, rope)
        keys, values, mask, causal = cache.append(i, rows, k, qkv[:, self.qk_heads :], n_valid, tree, self.windows[i])
        o = F.scaled_dot_product_attention(q.to(keys.dtype), keys, values, attn_mask=mask, is_causal=causal,
                                           scale=self.scale, enable_gqa=self.gqa)
        h = lin.o_add(o.transpose(1, 2).reshape(n, t, self.q_size).to(h.dtype), h, self.attn_out_norms[i])
        return lin.mlp(h, self.post_norms[i], self.mlp_out_norms[i])

    def _kernel_form(self, i: int):
        """Layer i's LayerForm for the fused kernel (its q/k and output norms, activation, window, block formats),
        made once per window (tests switch the windows off)."""
        window = self.windows[i] or 0
        if self._forms[i] is None or self._forms[i][0] != window:
            weight = (lambda norm: None if norm is None else norm.weight)
            form = cpu_kernel().LayerForm(
                q_norm=weight(self.q_norms[i]), k_norm=weight(self.k_norms[i]),
                attn_out_norm=weight(self.attn_out_norms[i]), mlp_out_norm=weight(self.mlp_out_norms[i]),
                act=self.config.hidden_act, window=window, fmts=self.linears[i].formats())
            self._forms[i] = (window, form)
        return self._forms[i][1]

    def write_kv(self, i: int, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: KVCache,
                 rows: torch.Tensor | None = None, n_valid: torch.Tensor | None = None) -> None:
        """Store layer i's K/V computed from hidden h [N, T, D] without running the layer
        (T3: the layers an exit inside verification skipped); n_valid [N]: see KVCache.append."""
        c = self.config
        n, t, _ = h.shape
        x = self.input_norms[i](h)
        kv = self.linears[i].kv(x)
        k, v = kv.view(n, t, 2 * c.num_key_value_heads, c.head_dim).transpose(1, 2).chunk(2, dim=1)
        if self.k_norms[i] is not None:
            k = self.k_norms[i](k)
        cache.append(i, rows, apply_rope(k, *self._layer_rope(i, rope)), v, n_valid)  # no attention: no window

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(h)

    def lm_head(self, h_normed: torch.Tensor) -> torch.Tensor:
        """[..., D] -> logits [..., V]."""
        return self.head(h_normed)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.final_norm(h))

    # ---- whole passes -----------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                rows: torch.Tensor | None = None, n_valid: torch.Tensor | None = None,
                tree: torch.Tensor | None = None) -> torch.Tensor:
        """All layers over input_ids [N, T]; returns the last hidden state [N, T, D] (before the final norm).
        tree [N, T, T]: the tokens are a draft tree (see layer)."""
        return self.layers(self.embed(input_ids), self.rope_for(positions), cache, rows, n_valid, tree)

    def layers(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: KVCache,
               rows: torch.Tensor | None = None, n_valid: torch.Tensor | None = None,
               tree: torch.Tensor | None = None) -> torch.Tensor:
        """Every decoder layer over hidden h [N, T, D] (forward without the embedding): in one C++ call where
        the pass allows it (_fused_stack), else layer by layer."""
        if (fused := self._fused_stack(h, cache, rows, n_valid, tree)) is not None:  # every layer in one C++ call
            stack, starts, host_rows = fused
            n, t, _ = h.shape
            out = stack.forward(_rows2d(h), *rope, cache.k, cache.v, starts, host_rows,
                                None if tree is None else tree.to(h.device).contiguous())
            cache.advance_all(host_rows, t)
            return out.view(n, t, -1)
        self.prefilling.on = self.held_bytes > 0 and n_valid is not None  # a prompt's chunk (only prefill passes n_valid)
        try:
            for i in range(self.num_layers):
                h = self.layer(i, h, rope, cache, rows, n_valid, tree)
        finally:
            self.prefilling.on = False
        return h

    def hold_for_prefill(self) -> int:
        """Prefill through bf16 copies of the layers' low-bit matrices (QuantLinear.hold); decode steps and
        verification keep the blocks. Returns the bytes held in all."""
        for lin in self.linears:
            for q in (lin.qkv, lin.o, lin.gate_up, lin.down):
                if isinstance(q, QuantLinear) and not q.qw.act8:
                    self.held_bytes += q.hold(self.prefilling)
        return self.held_bytes

    def hold_head(self) -> int:
        """Every call of the LM head (a decode step's, a verification's, a prefill's last tokens: all alike, so the
        lossless modes still equal dense) through a bf16 copy of its low-bit matrix: at many rows a bf16 GEMM on
        bf16 units is faster than the blocks' fp32 kernel (weight_plan times both). Returns the bytes held in all."""
        if isinstance(self.head, QuantLinear) and not self.head.qw.act8:
            self.held_bytes += self.head.hold(HoldSwitch(on=True, rows=1))
        return self.held_bytes

    def _fused_stack(self, h: torch.Tensor, cache: KVCache, rows: torch.Tensor | None, n_valid, tree):
        """(the C++ layer stack, each row's cache length, rows on the host) when this pass can take the stack:
        every layer fused (low-bit, fp32 activations, normed), a step or a drafted chunk (T = 1, or a tree over the
        T tokens) of decode size, each row at one length in every layer with room for the chunk; else None (rows
        are not copied to the host then: a device's pass does not wait on it)."""
        n, t, _ = h.shape
        if (n_valid is not None or (t > 1 and (tree is None or tree.shape[-1] != t))
                or type(cache) is not KVCache or cache.k is None or not self._stackable
                or self.linears[0]._prefill(h)):
            return None
        rows = None if rows is None else rows.cpu()
        starts = cache.row_lengths(rows)
        if starts is None or int(starts.max()) + t > cache.max_len:  # (the layers' own path says what overflowed)
            return None
        if self._stack is None:
            c = self.config
            planes = [lin.planes() for lin in self.linears]  # per layer: (qkv, o, gate_up, down) planes
            self._stack = cpu_kernel().LayerStack(
                [norm.weight for norm in self.input_norms], [norm.weight for norm in self.post_norms],
                *([p[j] for p in planes] for j in range(4)),
                self.input_norms[0].eps, c.num_attention_heads, c.num_key_value_heads, self.scale)
        return self._stack, starts, rows
