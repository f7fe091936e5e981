"""Rotary position embeddings with the rope_scaling variants HF configs use; one table per RoPE base a model's
layers use (Gemma 3's local layers have their own), on all or the first part of each head (Phi-3)."""
from __future__ import annotations

import math

import torch

from specee_core.model.config import ModelConfig

TABLE_LEN = 8192  # positions precomputed per table; positions past it are computed per step (the same values)


def base_inv_freq(theta: float, dim: int, device=None) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_ctx = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RopeTable:
    """cos/sin of one RoPE base and scaling for given positions. Static variants use a precomputed table;
    'dynamic' (NTK) recomputes the frequencies when the sequence grows past max_position_embeddings."""

    def __init__(self, theta: float, scaling: dict, dim: int, max_pos: int, device: torch.device, table_len: int):
        self.theta, self.scaling, self.dim, self.max_pos, self.device = theta, scaling, dim, max_pos, device
        inv_freq = base_inv_freq(theta, dim, device)
        kind = scaling["rope_type"]
        if kind == "linear":
            inv_freq = inv_freq / scaling["factor"]
        elif kind == "llama3":
            inv_freq = llama3_inv_freq(inv_freq, scaling)
        self.inv_freq = inv_freq  # [rd/2]
        self.cos_table, self.sin_table = cos_sin(torch.arange(table_len, device=device), inv_freq)  # [n, rd]

    def dynamic_inv_freq(self, seq_len: int) -> torch.Tensor:
        factor = self.scaling["factor"]
        base = self.theta * ((factor * seq_len / self.max_pos) - (factor - 1)) ** (self.dim / (self.dim - 2))
        return base_inv_freq(base, self.dim, self.device)

    def __call__(self, positions: torch.Tensor, max_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [N, T] (max_pos: their largest + 1) -> (cos, signed sin) [N, T, rd] in fp32."""
        if self.scaling["rope_type"] == "dynamic" and max_pos > self.max_pos:
            return cos_sin(positions, self.dynamic_inv_freq(max_pos))
        if max_pos <= self.cos_table.shape[0]:
            return self.cos_table[positions], self.sin_table[positions]
        return cos_sin(positions, self.inv_freq)


def cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, signed sin) [..., rd] of positions [...]: the sin's first half negated (see apply_rope)."""
    freqs = positions.float()[..., None] * inv_freq  # [..., rd/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    half = inv_freq.shape[-1]
    sin = emb.sin()
    sin[..., :half].neg_()  # rotate-half's sign folded in: see apply_rope
    return emb.cos(), sin


class RotaryEmbedding:
    """The model's RoPE tables (config.ropes(): one, or the full-attention one and the local layers'), evaluated
    together once per step."""

    def __init__(self, config: ModelConfig, device: torch.device | str = "cpu", table_len: int | None = None):
        self.config = config
        self.dim = config.rotary_dim
        self.device = torch.device(device)
        n = table_len or min(config.max_position_embeddings, TABLE_LEN)
        self.tables = [RopeTable(theta, scaling, self.dim, config.max_position_embeddings, self.device, n)
                       for theta, scaling in config.ropes()]

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [N, T] -> (cos, signed sin), each [N, R, T, rd] in dtype (R: the tables, config.ropes();
        layer i takes [:, r : r + 1] with r = config.rope_index(i), which broadcasts over heads); the sin's first
        half is negated, the form apply_rope takes."""
        max_pos = int(positions.max()) + 1
        if len(self.tables) == 1:
            cos, sin = self.tables[0](positions, max_pos)
            return cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)
        pairs = [table(positions, max_pos) for table in self.tables]
        return (torch.stack([c for c, _ in pairs], dim=1).to(dtype), torch.stack([s for _, s in pairs], dim=1).to(dtype))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [N, H, T, hd]; rotate-half convention, as HF checkpoints expect:
    x * cos + cat(-x2, x1) * sin, written as x * cos + cat(x2, x1) * cat(-sin1, sin2) (bit-identical,
    negation is exact) so the rotation is one roll instead of two slices, a negation and a cat. cos of rd < hd
    dims (partial rotary): the first rd dims of each head rotate, the rest pass through."""
    rd = cos.shape[-1]
    if rd == x.shape[-1]:
        return x * cos + x.roll(rd // 2, -1) * signed_sin
    rot = x[..., :rd]
    return torch.cat((rot * cos + rot.roll(rd // 2, -1) * signed_sin, x[..., rd:]), dim=-1)
