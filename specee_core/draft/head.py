"""The draft head: an EAGLE-1-style head (Linear over [token embedding; base feature], one Llama decoder
layer with its own KV cache, the base model's LM head). Checkpoints use EAGLE-1's layout (config.json +
`fc.*`, `layers.0.*` keys), so public EAGLE-1 heads load.

Features ("f") are the base model's hidden states after the final RMSNorm; EAGLE pairs the token x_t with
f_{t-1} and regresses f_t, whose LM-head top-k are the candidates for x_{t+1}.

DraftHead holds the trainable parameters (training, checkpoints); DraftModel is the head prepared for one
engine's model (weights only, shared by every lane; each lane's Proposer keeps the KV cache).
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specee_core.model.config import ModelConfig
from specee_core.model.kv_cache import KVCache
from specee_core.model.loader import read_state_dict
from specee_core.model.model import LayerWeights, DecoderModel, ModelWeights, make_linear, rms_norm
from specee_core.model.quant import quantize, select_rows
from specee_core.model.rope import apply_rope

log = logging.getLogger(__name__)


class DraftHead(nn.Module):
    """Trainable parameters of the draft head; the base model's embedding and LM head are shared
    and frozen. `forward` is the full-sequence (training) path; inference goes through
    `as_model()`, which reuses the engine's cached decoder layer."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        c = config
        d, q, kv, inter = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, c.intermediate_size
        self.config = c
        self.vocab_subset: torch.Tensor | None = None  # [V'] token ids the draft ranks; None = all
        self.fc = nn.Linear(2 * d, d, bias=True)
        self.wqkv = nn.Parameter(torch.empty(q + 2 * kv, d))
        self.wo = nn.Parameter(torch.empty(d, q))
        self.post_norm = nn.Parameter(torch.ones(d))
        self.w_gate_up = nn.Parameter(torch.empty(2 * inter, d))
        self.w_down = nn.Parameter(torch.empty(d, inter))
        for w in (self.wqkv, self.wo, self.w_gate_up, self.w_down):
            nn.init.normal_(w, std=0.02)
        with torch.no_grad():  # start near "the next feature is the current one"
            self.fc.weight.zero_()
            self.fc.weight[:, d:] = torch.eye(d)
            self.fc.bias.zero_()

    def layer_weights(self) -> LayerWeights:
        return LayerWeights(input_norm=None, wqkv=self.wqkv, bqkv=None, wo=self.wo, bo=None, post_norm=self.post_norm,
                            w_gate_up=self.w_gate_up, b_gate_up=None, w_down=self.w_down, b_down=None)

    def forward(self, emb: torch.Tensor, feat: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """emb, feat [N, T, D] (token x_{t+1}, feature f_t) -> predicted f_{t+1} [N, T, D], causal."""
        c = self.config
        n, t, _ = emb.shape
        h = self.fc(torch.cat((emb, feat), dim=-1))
        q, k, v = F.linear(h, self.wqkv).split((c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim,
                                                 c.num_key_value_heads * c.head_dim), dim=-1)
        q = apply_rope(q.view(n, t, -1, c.head_dim).transpose(1, 2), cos, sin)
        k = apply_rope(k.view(n, t, -1, c.head_dim).transpose(1, 2), cos, sin)
        v = v.view(n, t, -1, c.head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
        h = h + F.linear(o.transpose(1, 2).reshape(n, t, -1), self.wo)
        gate, up = F.linear(rms_norm(h, self.post_norm, c.rms_norm_eps), self.w_gate_up).chunk(2, dim=-1)
        return h + F.linear(F.silu(gate) * up, self.w_down)

    def state_dict_eagle(self) -> dict[str, torch.Tensor]:
        """EAGLE-1 key layout."""
        c = self.config
        q, kv, inter = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, c.intermediate_size
        wq, wk, wv = self.wqkv.detach().split((q, kv, kv))
        wg, wu = self.w_gate_up.detach().split((inter, inter))
        p = "layers.0."
        return {"fc.weight": self.fc.weight.detach(), "fc.bias": self.fc.bias.detach(),
                p + "self_attn.q_proj.weight": wq, p + "self_attn.k_proj.weight": wk, p + "self_attn.v_proj.weight": wv,
                p + "self_attn.o_proj.weight": self.wo.detach(), p + "mlp.gate_proj.weight": wg,
                p + "mlp.up_proj.weight": wu, p + "mlp.down_proj.weight": self.w_down.detach(),
                p + "post_attention_layernorm.weight": self.post_norm.detach()}

    def save(self, path: str | Path, meta: dict | None = None, vocab_subset: torch.Tensor | None = None) -> None:
        """EAGLE-1 layout; vocab_subset [V'] (token ids the draft ranks, optional) is stored
        beside the weights under its own key, which EAGLE loaders ignore."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        c = self.config
        cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": c.hidden_size,
               "intermediate_size": c.intermediate_size, "num_hidden_layers": 1,
               "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
               "head_dim": c.head_dim, "vocab_size": c.vocab_size, "max_position_embeddings": c.max_position_embeddings,
               "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "specee": meta or {}}
        (path / "config.json").write_text(json.dumps(cfg, indent=2))
        tensors = {k: v.contiguous().to(torch.bfloat16) for k, v in self.state_dict_eagle().items()}
        if vocab_subset is not None:
            tensors["vocab_subset"] = vocab_subset.to(torch.int64).contiguous()
        save_file(tensors, str(path / "model.safetensors"))

    @classmethod
    def load(cls, path: str | Path, base: ModelConfig) -> DraftHead:
        """Load a draft head in EAGLE-1 layout (ours or the public repository's) for base model `base`.
        A stored vocabulary subset ends up in head.vocab_subset (None when absent)."""
        path = Path(path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"draft head config not found: {path / 'config.json'}")
        tensors, origin = read_state_dict(path)
        head = cls(base)
        c = base
        d = c.hidden_size
        q, kv, inter = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, c.intermediate_size
        p = "layers.0."
        expect = {"fc.weight": (d, 2 * d), p + "self_attn.q_proj.weight": (q, d), p + "self_attn.k_proj.weight": (kv, d),
                  p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.o_proj.weight": (d, q),
                  p + "mlp.gate_proj.weight": (inter, d), p + "mlp.up_proj.weight": (inter, d),
                  p + "mlp.down_proj.weight": (d, inter), p + "post_attention_layernorm.weight": (d,)}
        for name, shape in expect.items():
            if name not in tensors:
                raise ValueError(f"{path}: draft tensor {name!r} missing")
            if tuple(tensors[name].shape) != shape:
                raise ValueError(f"{origin[name]}: draft tensor {name!r} has shape {tuple(tensors[name].shape)}, "
                                 f"expected {shape} for this base model")
        g = lambda k: tensors[k].float()  # noqa: E731
        with torch.no_grad():
            head.fc.weight.copy_(g("fc.weight"))
            head.fc.bias.copy_(g("fc.bias") if "fc.bias" in tensors else torch.zeros(d))
            head.wqkv.copy_(torch.cat([g(p + f"self_attn.{x}_proj.weight") for x in "qkv"]))
            head.wo.copy_(g(p + "self_attn.o_proj.weight"))
            head.w_gate_up.copy_(torch.cat([g(p + "mlp.gate_proj.weight"), g(p + "mlp.up_proj.weight")]))
            head.w_down.copy_(g(p + "mlp.down_proj.weight"))
            head.post_norm.copy_(g(p + "post_attention_layernorm.weight"))
        subset = tensors.get("vocab_subset")
        if subset is not None and (subset.dim() != 1 or int(subset.max()) >= c.vocab_size or int(subset.min()) < 0):
            raise ValueError(f"{origin['vocab_subset']}: vocab_subset must be token ids in [0, {c.vocab_size})")
        head.vocab_subset = subset
        return head.eval().requires_grad_(False)


MATRICES = ("wqkv", "wo", "w_gate_up", "w_down")  # a LayerWeights' matrices


class DraftModel:
    """The draft head on one engine's model, ready to run: its decoder layer in the model's dtype, the
    base's embedding and LM head shared. use_subset: rank only the head's vocab_subset (frequent tokens)
    with a smaller LM-head product, as FR-Spec does; rarer tokens then never become candidates. Holds no
    per-batch state: the caches it runs over are its callers' (Proposer)."""

    def __init__(self, head: DraftHead, model: DecoderModel, use_subset: bool = True):
        self.subset = head.vocab_subset.to(model.device) if use_subset and head.vocab_subset is not None else None
        self.subset_head = None if self.subset is None else make_linear(select_rows(model.w.lm_head, self.subset))  # [V', D]
        self.base = model
        dtype, dev = model.dtype, model.device
        lw = head.to(device=dev, dtype=dtype).layer_weights()
        lw = LayerWeights(**{f: (None if t is None else t.detach()) for f, t in vars(lw).items()})
        # a base running low-bit blocks with fp32 activations (CPU kernels): the draft's matrices in q8 too, a
        # quarter of fp32's bytes read per draft level. Lossless all the same: verification decides every token.
        self.weight_format = "q8" if model.weight_format in ("q4", "q8") and dtype == torch.float32 else None
        if self.weight_format is not None:
            lw = LayerWeights(**{f: quantize(t, "q8") if f in MATRICES else t for f, t in vars(lw).items()})
        fc = head.fc.weight.detach()
        self.fc = make_linear(fc if self.weight_format is None else quantize(fc, "q8"), head.fc.bias.detach())  # [D, 2D]
        # a plain Llama layer of the model's sizes, whatever the model's layers are (what DraftHead.forward trains)
        self.layer = DecoderModel(model.config.draft_layer_config(), ModelWeights(embed=model.w.embed, layers=[lw], norm=model.w.norm,
                                                           lm_head=model.w.lm_head), dev, dtype)

    def new_cache(self, rows: int, max_len: int) -> KVCache:
        return self.layer.new_cache(rows, max_len)

    def forward(self, cache: KVCache, tokens: torch.Tensor, feats: torch.Tensor, positions: torch.Tensor, rows,
                n_valid=None, tree: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [N, T], feats [N, T, D] at positions [N, T] of cache rows `rows` (None = all) -> draft output
        features [N, T, D], their K/V appended to cache; tree: see DecoderModel.layer."""
        m = self.layer
        h = self.fc(torch.cat((m.embed(tokens), feats), dim=-1))
        return m.layer(0, h, m.rope_for(positions), cache, rows, n_valid, tree)

    def top_log_probs(self, out: torch.Tensor, k: int, allowed: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft output features [..., D] -> (log-probabilities [..., k] fp32, token ids [..., k]) of the
        k most likely next tokens, best first (normalised over the frequent-token subset, when ranked).
        allowed [..., V] bool (structured output): only those tokens (a row allowing none of the ranked ones
        is left unmasked)."""
        logits = (self.base.lm_head(out) if self.subset is None else self.subset_head(out)).float()
        if allowed is not None:
            logits = _only(logits, allowed if self.subset is None else allowed[..., self.subset.cpu()])
        logp, idx = logits.log_softmax(-1).topk(k, dim=-1)
        return logp, (idx if self.subset is None else self.subset[idx])

    def full_logits(self, out: torch.Tensor, allowed: torch.Tensor | None = None) -> torch.Tensor:
        """Draft output features [N, D] -> logits [N, V] fp32 over the whole vocabulary (-inf outside the
        frequent-token subset, when the head ranks one; and outside allowed [N, V], when given)."""
        if self.subset is None:
            logits = self.base.lm_head(out).float()
        else:
            logits = torch.full((out.shape[0], self.base.config.vocab_size), float("-inf"), device=out.device)
            logits.index_copy_(1, self.subset, self.subset_head(out).float())
        return logits if allowed is None else _only(logits, allowed)


def _only(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """logits [..., V] with the tokens outside allowed [..., V] at -inf, except on rows allowing none of them."""
    allowed = allowed.to(logits.device)
    keep = allowed & torch.isfinite(logits)
    return torch.where(keep.any(-1, keepdim=True), logits.masked_fill(~allowed, float("-inf")), logits)
