"""Rotary position embeddings with the rope_scaling variants HF Llama configs use."""
from __future__ import annotations

import math

import torch

from specee_core.model.config import ModelConfig


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


class RotaryEmbedding:
    """cos/sin for given positions. Static variants use a precomputed table; 'dynamic' (NTK)
    recomputes the frequencies when the sequence grows past max_position_embeddings."""

    def __init__(self, config: ModelConfig, device: torch.device | str = "cpu", table_len: int | None = None):
        self.config = config
        self.dim = config.head_dim
        self.device = torch.device(device)
        inv_freq = base_inv_freq(config.rope_theta, self.dim, self.device)
        kind = config.rope_type
        if kind == "linear":
            inv_freq = inv_freq / config.rope_scaling["factor"]
        elif kind == "llama3":
            inv_freq = llama3_inv_freq(inv_freq, config.rope_scaling)
        self.inv_freq = inv_freq  # [hd/2]
        n = table_len or config.max_position_embeddings
        self.cos_table, self.sin_table = self._cos_sin(torch.arange(n, device=self.device), inv_freq)  # [n, hd]

    @staticmethod
    def _cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[..., None] * inv_freq  # [..., hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        half = inv_freq.shape[-1]
        sin = emb.sin()
        sin[..., :half].neg_()  # rotate-half's sign folded in: see apply_rope
        return emb.cos(), sin

    def dynamic_inv_freq(self, seq_len: int) -> torch.Tensor:
        c = self.config
        factor, max_pos = c.rope_scaling["factor"], c.max_position_embeddings
        base = c.rope_theta * ((factor * seq_len / max_pos) - (factor - 1)) ** (self.dim / (self.dim - 2))
        return base_inv_freq(base, self.dim, self.device)

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [N, T] -> (cos, signed sin), each [N, 1, T, hd] in dtype, ready to broadcast over
        heads; the sin's first half is negated, the form apply_rope takes."""
        max_pos = int(positions.max()) + 1
        if self.config.rope_type == "dynamic" and max_pos > self.config.max_position_embeddings:
            cos, sin = self._cos_sin(positions, self.dynamic_inv_freq(max_pos))
        elif max_pos <= self.cos_table.shape[0]:
            cos, sin = self.cos_table[positions], self.sin_table[positions]
        else:
            cos, sin = self._cos_sin(positions, self.inv_freq)
        return cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [N, H, T, hd]; rotate-half convention, as HF Llama checkpoints expect:
    x * cos + cat(-x2, x1) * sin, written as x * cos + cat(x2, x1) * cat(-sin1, sin2) (bit-identical,
    negation is exact) so the rotation is one roll instead of two slices, a negation and a cat."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin
