"""Preallocated, batched KV cache whose valid length is tracked per layer and per row.

Slots, not positions: a row's keys for layer l live in slots [0, lengths[l, row]). RoPE is
applied before a key is stored, so a slot need not equal the token's position. That is what
lets early exit leave a layer's slot empty for a position ("gap" mode) or fill it later.
"""
from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        shape = (num_layers, batch, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, B, Hkv, S, hd]
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # [L, B, Hkv, S, hd]
        self.lengths = torch.zeros(num_layers, batch, dtype=torch.int64)  # [L, B] on the host
        self.device = torch.device(device)
        self.max_len = max_len

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    def append(self, layer: int, rows: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor,
               n_valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Store k, v [N, Hkv, T, hd] for `rows` (None = every row) after each row's valid slots,
        advance lengths by n_valid [N] (default T: padded tail tokens of a ragged chunk are
        written but not counted), and return (keys [N, Hkv, S, hd], values, mask [N, 1, T, S])
        where the mask lets query t of a row see slots <= start + t that are valid.
        """
        n, _, t, _ = k.shape
        start = self.lengths[layer] if rows is None else self.lengths[layer, rows.cpu()]  # [N] host
        count = torch.full((n,), t, dtype=torch.int64) if n_valid is None else n_valid.cpu()
        end_write = int(start.max()) + t
        if end_write > self.max_len:
            raise ValueError(f"KV cache overflow at layer {layer}: need {end_write} slots, have {self.max_len}")
        dev_start = start.to(self.device, non_blocking=True)
        ar = torch.arange(t, device=self.device)
        slots = dev_start[:, None] + ar  # [N, T]
        row_idx = torch.arange(n, device=self.device) if rows is None else rows
        kc, vc = self.k[layer], self.v[layer]
        # advanced indices around a slice: the indexed view is [N, T, Hkv, hd]
        kc[row_idx[:, None], :, slots] = k.transpose(1, 2)
        vc[row_idx[:, None], :, slots] = v.transpose(1, 2)
        new_len = start + count
        if rows is None:
            self.lengths[layer] = new_len
        else:
            self.lengths[layer, rows.cpu()] = new_len
        s = int(new_len.max()) if t == 1 else end_write
        if rows is None:
            keys, values = kc[:, :, :s], vc[:, :, :s]
        else:
            keys, values = kc[rows, :, :s], vc[rows, :, :s]
        key_slot = torch.arange(s, device=self.device)
        mask = (key_slot <= slots[:, :, None]) & (key_slot < new_len.to(self.device)[:, None, None])
        return keys, values, mask.unsqueeze(1)

    def reset(self) -> None:
        self.lengths.zero_()
