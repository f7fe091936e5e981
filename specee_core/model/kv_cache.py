"""Preallocated, batched KV cache whose valid length is tracked per layer and per row.

Slots, not positions: a row's keys for layer l live in slots [0, lengths[l, row]). RoPE is
applied before a key is stored, so a slot need not equal the token's position. That is what
lets early exit fill a layer's slot for a position later, with the next token that runs the layer.

Sliding windows (a local layer's query sees the last `window` slots, itself included) are masks, counted in slots,
which are the positions in every lossless mode (a row's slots fill from 0 with its tokens in order). A windowed
layer keeps only the end of a row: its layers share a buffer of window_slots() slots a row (the longest window plus
`room`, the most a forward writes at once), and when a write would run past it, the row's windowed slots move to the
front, keeping the last `window` (shift[row] counts the slots dropped). Slots in the methods that take them from
outside (truncate, keep, read_slots, write_prefix, row_lengths) are the row's own (logical); `lengths` and the slots
the attention path works in (append, decode_slots, advance) are the buffers' (physical: logical - shift on
windowed layers). KVBudget counts what the buffers hold (Engine.row_bytes).
"""
from __future__ import annotations

import torch


def window_slots(windows: list[int | None], max_len: int, room: int) -> int:
    """Slots a row of the windowed layers' buffer holds: the longest window plus room, at most max_len (0: no
    windowed layer)."""
    keep = max((w for w in windows if w), default=0)
    return min(max_len, keep + room) if keep else 0


class KVCache:
    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, windows: list[int | None] | None = None,
                 room: int = 256):
        """windows: per layer its sliding window or None (every slot); room: slots a windowed layer holds beyond the
        longest window (a forward that writes more grows its buffer)."""
        windows = list(windows) if windows is not None else [None] * num_layers
        if len(windows) != num_layers:
            raise ValueError(f"{len(windows)} windows for {num_layers} layers")
        self._configure(windows, room)
        win = window_slots(windows, max_len, room)
        full = [i for i, w in enumerate(windows) if not w]
        groups = []
        for layers, slots in ((full, max_len), (self.windowed, win)):
            if layers:
                shape = (len(layers), batch, num_kv_heads, slots, head_dim)
                groups.append((layers, torch.zeros(shape, dtype=dtype, device=device),
                               torch.zeros(shape, dtype=dtype, device=device)))
        self._attach(groups, max_len)

    def _configure(self, windows: list[int | None], room: int) -> None:
        self.windows, self.room = windows, room
        self.windowed = [i for i, w in enumerate(windows) if w]  # the layers whose buffer keeps their window
        self.keep_slots = max((w for w in windows if w), default=0)  # what a windowed layer must keep
        self._windowed_mask = torch.tensor([1 if w else 0 for w in windows], dtype=torch.int64)  # [L]

    def _attach(self, groups: list[tuple[list[int], torch.Tensor, torch.Tensor]], max_len: int) -> None:
        """groups: (layers, k, v [len(layers), B, Hkv, S, hd]) of the full layers (S = max_len) and of the windowed
        ones (S = their buffer's slots)."""
        self.groups = groups
        num_layers, batch = len(self.windows), groups[0][1].shape[1]
        self.max_len = max_len
        # one tensor [L, B, Hkv, S, hd] for every layer where no layer is windowed (the fused stack takes it)
        self.k, self.v = (None, None) if self.keep_slots else (groups[0][1], groups[0][2])
        self.dtype, self.device = groups[0][1].dtype, groups[0][1].device
        self.lengths = torch.zeros(num_layers, batch, dtype=torch.int64)  # [L, B] on the host, physical
        self.shift = torch.zeros(batch, dtype=torch.int64)  # [B] slots dropped from a windowed layer's front
        # per layer: the length every row has, or None when rows differ (then slots are indexed per row)
        self.uniform: list[int | None] = [0] * num_layers
        # per-layer views, so the per-token hot path indexes a Python list, not a tensor
        self._k: list = [None] * num_layers
        self._v: list = [None] * num_layers
        for layers, k, v in groups:
            for j, i in enumerate(layers):
                self._k[i], self._v[i] = k[j], v[j]
        self._lens = list(self.lengths.unbind(0))
        self._last_mask: tuple = (None, None)  # ((T, start), mask) of the last chunk mask
        self._last_tree: tuple | None = None  # ((tree, start, S), mask) of the last tree chunk

    @property
    def window_len(self) -> int:
        """Slots a row of the windowed layers' buffer holds now (0: none is windowed)."""
        return self.groups[-1][1].shape[3] if self.keep_slots else 0

    def first_rows(self, n: int) -> KVCache:
        """An empty cache of n rows on this one's memory (a smaller batch reuses a larger allocation,
        and its steps still take the every-row fast path)."""
        if n > self.batch:
            raise ValueError(f"cache has {self.batch} rows, {n} requested")
        view = KVCache.__new__(KVCache)
        view._configure(self.windows, self.room)
        view._attach([(layers, k[:, :n], v[:, :n]) for layers, k, v in self.groups], self.max_len)
        return view

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s buffers (keys, values) [B, Hkv, S, hd]: S is max_len, or the windowed buffer's slots."""
        return self._k[layer], self._v[layer]

    def randomize(self, gen: torch.Generator) -> None:
        """Every slot's keys and values drawn from a normal distribution (timings: a prompt's K/V without a
        prefill)."""
        for _, k, v in self.groups:
            k.normal_(generator=gen), v.normal_(generator=gen)

    @property
    def batch(self) -> int:
        return self.groups[0][1].shape[1]

    def append(self, layer: int, rows: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor,
               n_valid: torch.Tensor | None = None, tree: torch.Tensor | None = None, window: int | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, bool]:
        """Store k, v [N, Hkv, T, hd] for `rows` (None = every row) after each row's valid slots,
        advance lengths by n_valid [N] (default T: padded tail tokens of a ragged chunk are
        written but not counted), and return (keys [N, Hkv, S, hd], values, mask, causal) for
        scaled_dot_product_attention: query t of a row may see the valid slots <= start + t, given
        either as a bool mask [N, 1, T, S] or, where that is all it says, mask None and causal
        True (a chunk from slot 0) or False (one token, every slot valid).
        tree [N, T, W] bool, W >= T (a draft tree): query j sees the row's valid slots before the last
        W and, of those W (the chunk is their end), the ones with tree[r, j, :] (its ancestors and
        itself) instead of the causal rule. W = T: the tree is the chunk itself (verification); the
        draft head grows its tree level by level, a chunk per level, so W spans earlier levels too.
        window (a sliding-window layer): a query at slot s also sees only slots > s - window (in a tree, s is the
        node's own position: its row's start plus its depth; W = T only).
        """
        n, _, t, _ = k.shape
        k, v = k.to(self.dtype), v.to(self.dtype)  # the cache may hold a wider dtype (fp32 for CPU bf16)
        if self.windows[layer]:
            self._make_room(layer, rows, t)
        if tree is not None:
            return self._append_tree(layer, rows, k, v, tree, window)
        start = self.uniform[layer]
        if rows is None and start is not None and (n_valid is None or start == 0):
            return self._append_uniform(layer, start, k, v, n_valid, window)
        return self._append_rows(layer, rows, k, v, n_valid, window)

    def decode_slots(self, layer: int, rows: torch.Tensor | None, tokens: int = 1
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For `tokens` new tokens of each of `rows` (host int64 [N]; None = all): (keys [B, Hkv, S, hd], values,
        starts [N] host int64), the layer's whole slot buffers and the first slot each row's tokens go to. A
        caller that writes them itself (a fused decode layer) then calls advance(layer, rows, tokens)."""
        if self.windows[layer]:
            self._make_room(layer, rows, tokens)
        starts = (self._lens[layer] if rows is None else self._lens[layer][rows]).clone()
        self._check_room(layer, int(starts.max()) + tokens)
        return self._k[layer], self._v[layer], starts

    def advance(self, layer: int, rows: torch.Tensor | None, tokens: int = 1) -> None:
        """`tokens` slots of each of rows (None = all) were written from its length on (see decode_slots): count
        them."""
        if rows is None:
            self._lens[layer].add_(tokens)
            if self.uniform[layer] is not None:
                self.uniform[layer] += tokens
        else:
            self.lengths[layer, rows] += tokens
            self._set_uniform(layer)

    def advance_all(self, rows: torch.Tensor | None, tokens: int) -> None:
        """advance() for every layer."""
        if rows is None:
            self.lengths.add_(tokens)
            self.uniform = [None if u is None else u + tokens for u in self.uniform]
        else:
            self.lengths[:, rows] += tokens
            for layer in range(len(self.uniform)):
                self._set_uniform(layer)

    def row_lengths(self, rows: torch.Tensor | None) -> torch.Tensor | None:
        """Each of rows' (None = all) length when every layer holds the same for it (host int64 [N]), else None."""
        lens = self.logical_lengths() if rows is None else self.logical_lengths()[:, rows]
        return lens[0].clone() if bool((lens == lens[:1]).all()) else None

    def logical_lengths(self) -> torch.Tensor:
        """[L, B] each layer's length of each row in the row's own slots (lengths plus what windowed layers dropped)."""
        if not self.keep_slots:
            return self.lengths
        return self.lengths + self.shift[None, :] * self._windowed_mask[:, None]

    def _check_room(self, layer: int, end: int) -> None:
        slots = self.window_len if self.windows[layer] else self.max_len
        if end > slots:
            raise ValueError(f"KV cache overflow at layer {layer}: need {end} slots, have {slots}")

    def _make_room(self, layer: int, rows: torch.Tensor | None, t: int) -> None:
        """Before windowed layer `layer` writes t slots to rows (None = all): a row that would run past the windowed
        buffer has every windowed layer's slots moved to the front, keeping the last keep_slots of its shortest
        one (what a window still sees); where that is not room enough (a chunk longer than `room`), the buffer
        grows."""
        cap = self.window_len
        longest = self.uniform[layer]
        if (longest if longest is not None else int(self._lens[layer].max())) + t <= cap:
            return  # (every row has room: the step's common case, one look)
        rows_host = torch.arange(self.batch) if rows is None else rows.cpu()
        lens = self.lengths[layer, rows_host]
        end = int((lens + self.shift[rows_host]).max()) + t
        if end > self.max_len:
            raise ValueError(f"KV cache overflow at layer {layer}: need {end} slots, have {self.max_len}")
        over = rows_host[lens + t > cap]
        if len(over) == 0:
            return
        self._compact(over.tolist())
        need = int(self.lengths[layer, rows_host].max()) + t
        if need > cap:
            self._realloc(self.max_len, need)

    def _compact(self, rows: list[int]) -> None:
        """Move each row's windowed slots to the front of its buffer, keeping the last keep_slots of its shortest
        windowed layer (the others keep as many more as they hold beyond it)."""
        layers = self.windowed
        _, k, v = self.groups[-1]
        for r in rows:
            held = self.lengths[layers, r]
            drop = int(held.min()) - self.keep_slots
            if drop <= 0:
                continue
            n = int(held.max()) - drop
            k[:, r, :, :n] = k[:, r, :, drop : drop + n].clone()
            v[:, r, :, :n] = v[:, r, :, drop : drop + n].clone()
            self.lengths[layers, r] -= drop
            self.shift[r] += drop
        for i in layers:
            self._set_uniform(i)

    def _append_uniform(self, layer: int, start: int, k, v, n_valid, window: int | None = None):
        """Every row at the same length: the write is a slice copy, and no mask is needed for one
        token or for a chunk from slot 0 (padded queries of a ragged chunk see garbage; ignored). A window
        shorter than the slots: one token attends to the window's slots alone, a chunk gets a mask."""
        t = k.shape[2]
        end = start + t
        self._check_room(layer, end)
        kc, vc = self._k[layer], self._v[layer]
        kc.narrow(2, start, t).copy_(k)
        vc.narrow(2, start, t).copy_(v)
        if n_valid is None:
            self._lens[layer].add_(t)
            self.uniform[layer] = end
        else:
            self._lens[layer].copy_(n_valid)
            self._set_uniform(layer)
        if window is not None and end <= window:
            window = None  # every query sees every slot before it
        if window is not None and t == 1:
            return kc.narrow(2, end - window, window), vc.narrow(2, end - window, window), None, False
        keys, values = kc.narrow(2, 0, end), vc.narrow(2, 0, end)
        if window is None and (t == 1 or start == 0):
            return keys, values, None, t > 1
        return keys, values, self._chunk_mask(t, start, window), False

    def _chunk_mask(self, t: int, start: int, window: int | None = None) -> torch.Tensor:
        """[1, 1, T, start + T] additive mask of a chunk after `start` valid slots: query j sees slots
        <= start + j (causal, bottom-right aligned), and > start + j - window with a window. Additive, not bool:
        attention would convert a bool mask on every call. The last one is kept: successive layers of a step
        mostly share it."""
        if self._last_mask[0] != (t, start, window):
            mask = torch.full((t, start + t), float("-inf"), dtype=self.dtype, device=self.device)
            if window is None:
                mask.triu_(diagonal=start + 1)
            else:
                slot, query = torch.arange(start + t, device=self.device), start + torch.arange(t, device=self.device)
                mask.masked_fill_((slot <= query[:, None]) & (slot > query[:, None] - window), 0.0)
            self._last_mask = ((t, start, window), mask.view(1, 1, t, start + t))
        return self._last_mask[1]

    def _append_rows(self, layer: int, rows, k, v, n_valid, window: int | None = None):
        n, _, t, _ = k.shape
        rows_host = None if rows is None else rows.cpu()
        start = self.lengths[layer].clone() if rows is None else self.lengths[layer, rows_host]  # [N] host
        new_len = start + (t if n_valid is None else n_valid.cpu())
        self._check_room(layer, int(new_len.max()))
        kc, vc = self._k[layer], self._v[layer]
        end_write = min(int(start.max()) + t, kc.shape[2])
        row_idx = torch.arange(n, device=self.device) if rows is None else rows
        if t == 1:
            dev_start = start.to(self.device, non_blocking=True)
            kc[row_idx, :, dev_start] = k[:, :, 0]
            vc[row_idx, :, dev_start] = v[:, :, 0]
        else:  # advanced indices around a slice: the indexed view is [N, T, Hkv, hd]
            slots = start[:, None] + torch.arange(t)  # [N, T] host
            if int(slots.max()) < kc.shape[2]:
                r, s, kt, vt = row_idx[:, None], slots.to(self.device), k.transpose(1, 2), v.transpose(1, 2)
            else:  # padding of a ragged chunk would run past the end: write the valid entries only
                keep = slots < new_len[:, None]  # [N, T]
                r = row_idx[:, None].expand(n, t)[keep.to(self.device)]
                s, kt, vt = slots[keep].to(self.device), k.transpose(1, 2)[keep], v.transpose(1, 2)[keep]
            kc[r, :, s] = kt
            vc[r, :, s] = vt
        if rows is None:
            self.lengths[layer] = new_len
        else:
            self.lengths[layer, rows_host] = new_len
        self._set_uniform(layer)
        s = int(new_len.max()) if t == 1 else end_write
        if rows is None:
            keys, values = kc[:, :, :s], vc[:, :, :s]
        else:
            keys, values = kc[rows, :, :s], vc[rows, :, :s]
        return keys, values, self._mask(start, t, s, new_len, window), False

    def _append_tree(self, layer: int, rows, k, v, tree: torch.Tensor, window: int | None = None):
        """tree [N, T, W] (W >= T) covers the last W slots up to the chunk's end: query j sees the row's
        slots before them and those x with tree[r, j, x - (end - W)]."""
        t, start_u = k.shape[2], self.uniform[layer]
        if rows is None and start_u is not None:  # every row at one length: a slice write
            keys, values, _, _ = self._append_uniform(layer, start_u, k, v, None)
            start = (start_u,)
        else:
            start = self.lengths[layer].clone() if rows is None else self.lengths[layer, rows.cpu()]  # [N] host
            keys, values, _, _ = self._append_rows(layer, rows, k, v, None)
            start = tuple(start.tolist())
        return keys, values, self._tree_mask(tree, start, t, keys.shape[2], window), False

    def _tree_mask(self, tree: torch.Tensor, start: tuple[int, ...], t: int, s: int,
                   window: int | None = None) -> torch.Tensor:
        """[N, 1, T, S] additive mask of a tree chunk written at slots start (one per row, or one for all).
        Every layer of a verify forward asks for the same mask: the last one is kept."""
        key = (tree, start, s, window)
        last = self._last_tree
        if last is not None and last[0][0] is tree and last[0][1:] == key[1:]:
            return last[1]
        n, _, w = tree.shape
        lo = torch.tensor(start, device=self.device).view(-1, 1, 1) + (t - w)  # [N or 1, 1, 1] first covered slot
        key_slot = torch.arange(s, device=self.device)
        rel = key_slot - lo  # [N, 1, S]
        covered = (rel >= 0) & (rel < w)
        seen = tree.to(self.device).gather(2, rel.clamp(0, w - 1).expand(n, t, s)) & covered
        visible = (rel < 0) | seen  # [N, T, S]
        if window is not None:  # a node's position: its chunk's first slot (the root) plus its depth
            if w != t:
                raise ValueError(f"a sliding window over a tree of {w} nodes written {t} at a time is not supported")
            depth = tree.to(self.device).sum(-1) - 1  # [N, T]
            pos_q = lo.view(-1, 1) + depth  # [N or 1 -> N, T]
            pos_k = torch.where(covered, lo.view(-1, 1, 1) + depth.gather(1, rel.clamp(0, w - 1).expand(n, 1, s)
                                                                           .view(n, s)).view(n, 1, s), key_slot)
            visible &= pos_k > pos_q[:, :, None] - window
        mask = torch.zeros(visible.shape, dtype=self.dtype, device=self.device).masked_fill_(~visible, float("-inf"))
        self._last_tree = (key, mask.unsqueeze(1))
        return self._last_tree[1]

    def keep(self, rows: torch.Tensor | None, start: torch.Tensor, nodes: torch.Tensor, count: torch.Tensor) -> None:
        """After verifying a chunk written at slots start [N] (host) of `rows` (None = all): keep, in every
        layer, the chunk's nodes [N, A] (chunk indices, ascending; entries past count [N] ignored) at
        consecutive slots start.. and set each row's length to start + count."""
        n, a = nodes.shape
        row_idx = torch.arange(n) if rows is None else rows.cpu()
        moved = (nodes != torch.arange(a)) & (torch.arange(a) < count[:, None])  # a chain keeps its prefix in place
        if bool(moved.any()):
            r = row_idx.to(self.device)[:, None]
            for layers, kb, vb in self.groups:
                first = start - self.shift[row_idx] if self.windows[layers[0]] else start  # the buffer's slots
                src = (first[:, None] + nodes.clamp(min=0)).to(self.device)
                dst = (first[:, None] + torch.arange(a)).to(self.device)
                for buf in (kb, vb):  # advanced indices around a slice: [N, A, L, Hkv, hd]
                    buf[:, r, :, dst] = buf[:, r, :, src].clone()
        self.truncate(row_idx, start + count)

    def truncate(self, rows: torch.Tensor, lengths: torch.Tensor, first_layer: int = 0) -> None:
        """Set the length of rows [N] (host) to lengths [N] (the rows' own slots) in every layer from first_layer on
        (entries past it are dropped). A row truncated to 0 in every layer starts over: nothing dropped."""
        lengths = lengths.expand(len(rows))
        if self.keep_slots:
            if first_layer == 0:
                self.shift[rows[lengths == 0]] = 0
            phys = lengths[None, :] - self.shift[rows][None, :] * self._windowed_mask[first_layer:, None]
            if bool((phys < 0).any()):
                raise ValueError("cannot truncate a row below the slots its windowed layers dropped")
            self.lengths[first_layer:, rows] = phys
        else:
            self.lengths[first_layer:, rows] = lengths.expand(self.lengths.shape[0] - first_layer, -1)
        same = (self.lengths == self.lengths[:, :1]).all(1).tolist()  # [L] every row at one length
        self.uniform = [int(n) if u else None for n, u in zip(self.lengths[:, 0].tolist(), same)]

    def _mask(self, start: torch.Tensor, t: int, s: int, new_len: torch.Tensor,
              window: int | None = None) -> torch.Tensor:
        """[N, 1, T, S]: query j of row r sees slot x when x <= start[r] + j and x < new_len[r] (and
        x > start[r] + j - window with a window; a padded query past new_len sees its own slot, so that no query
        sees nothing: a softmax over nothing is NaN, and NaN K/V in an uncounted slot would poison the masked
        products of later steps)."""
        key_slot = torch.arange(s, device=self.device)
        if t == 1 and window is None:
            return (key_slot < new_len.to(self.device)[:, None]).view(-1, 1, 1, s)
        slots = start.to(self.device)[:, None] + torch.arange(t, device=self.device)  # [N, T]
        mask = (key_slot <= slots[:, :, None]) & (key_slot < new_len.to(self.device)[:, None, None])
        if window is not None:
            mask &= key_slot > slots[:, :, None] - window
            mask |= key_slot == slots[:, :, None]
        return mask.unsqueeze(1)

    def _set_uniform(self, layer: int) -> None:
        lens = self.lengths[layer]
        first = int(lens[0])
        self.uniform[layer] = first if bool((lens == first).all()) else None

    @property
    def nbytes(self) -> int:
        return sum(2 * k.numel() * k.element_size() for _, k, _ in self.groups)

    def slot_bytes(self) -> int:
        """Bytes of one row's slot in every layer, keys and values."""
        _, k, _ = self.groups[0]
        return 2 * len(self.windows) * k.shape[2] * k.shape[4] * k.element_size()

    def resize(self, max_len: int) -> None:
        """Reallocate to max_len slots per row (the windowed layers' buffer: window_slots() of it), keeping every
        row's valid slots (max_len below a row's length is an error). The object stays the same, so whoever holds it
        sees the new memory."""
        longest = int(self.logical_lengths().max())
        if max_len < longest:
            raise ValueError(f"cannot shrink the cache to {max_len} slots: a row holds {longest}")
        win = window_slots(self.windows, max_len, self.room)
        if self.keep_slots and int(self.lengths[self.windowed].max()) > win:
            self._compact(list(range(self.batch)))
            win = max(win, int(self.lengths[self.windowed].max()))
        self._realloc(max_len, win)

    def _realloc(self, max_len: int, window_len: int) -> None:
        """New buffers of max_len slots (window_len for the windowed layers), every row's slots copied."""
        lengths, shift, uniform = self.lengths.clone(), self.shift.clone(), list(self.uniform)
        groups = []
        for layers, k, v in self.groups:
            slots = window_len if self.windows[layers[0]] else max_len
            keep = min(slots, k.shape[3])
            shape = (*k.shape[:3], slots, k.shape[4])
            nk, nv = k.new_zeros(shape), v.new_zeros(shape)
            nk[:, :, :, :keep].copy_(k[:, :, :, :keep])
            nv[:, :, :, :keep].copy_(v[:, :, :, :keep])
            groups.append((layers, nk, nv))
        self._attach(groups, max_len)
        self.lengths.copy_(lengths)
        self.shift.copy_(shift)
        self.uniform = uniform

    def holds(self, row: int, start: int) -> bool:
        """Whether the windowed layers still hold row `row`'s slots from `start` on (read_slots reads them)."""
        return not self.keep_slots or start >= int(self.shift[row])

    def read_slots(self, row: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of row `row`'s keys and values in slots [start, end) of every layer: [L, Hkv, end - start, hd] each
        (zeros in the windowed layers where they dropped those slots: see holds)."""
        if self.k is not None:
            return self.k[:, row, :, start:end].clone(), self.v[:, row, :, start:end].clone()
        _, k0, _ = self.groups[0]
        shape = (len(self.windows), k0.shape[2], end - start, k0.shape[4])
        out_k, out_v = k0.new_zeros(shape), k0.new_zeros(shape)
        for layers, k, v in self.groups:
            lo = start - (int(self.shift[row]) if self.windows[layers[0]] else 0)
            if lo >= 0:
                idx = torch.tensor(layers, device=self.device)
                out_k[idx], out_v[idx] = k[:, row, :, lo : lo + end - start], v[:, row, :, lo : lo + end - start]
        return out_k, out_v

    def write_prefix(self, row: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Row `row` starts over holding k, v [L, Hkv, T, hd] in slots [0, T) of every layer (a cached prefix); the
        windowed layers take its last keep_slots where all of it would leave no room."""
        t = k.shape[2]
        if t > self.max_len:
            raise ValueError(f"KV cache overflow: a prefix of {t} slots, have {self.max_len}")
        if self.k is not None:
            self.k[:, row, :, :t].copy_(k)
            self.v[:, row, :, :t].copy_(v)
            self.truncate(torch.tensor([row]), torch.tensor([t]))
            return
        shift = 0
        for layers, kb, vb in self.groups:
            idx = torch.tensor(layers, device=k.device)
            if self.windows[layers[0]]:
                shift = t - self.keep_slots if t > kb.shape[3] else 0
            first = shift if self.windows[layers[0]] else 0
            kb[:, row, :, : t - first].copy_(k[idx, :, first:])
            vb[:, row, :, : t - first].copy_(v[idx, :, first:])
        self.shift[row] = shift
        self.truncate(torch.tensor([row]), torch.tensor([t]))
