"""KV memory with a budget: the engine core's block accounting and its prefix cache.

The budget is in blocks of `block_size` token slots of one row (every layer's keys and values, the
draft head's included). A lane's KV cache (rows x slots, contiguous per row so attention and the fused
decode kernel read it in place) holds rows x slots / block_size blocks; it takes blocks as its rows
grow and gives them back when it shrinks or empties. Cached prefix blocks take blocks too. Nothing is
allocated that the budget has not granted.

Prefix cache (as vLLM's): a full block of prompt tokens is keyed by a hash chained over every token
before it, so a key names the whole prefix up to the block's end. It holds the block's keys and values
in every layer and the last layer's hidden states (what the draft head and SpecEE's stepper read of a
prompt; the draft head's own KV is recomputed from them, one layer). Entries are evicted least recently
used when the budget needs their blocks.

HeapTrim: the host allocator (glibc's malloc) keeps freed pages inside its heap; with cached blocks living long
among each step's short-lived activations, the heap's free pages grew to several times the budget. The core hands
them back to the system every few seconds of stepping.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import logging
import os
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

DEFAULT_MEMORY_SHARE = 0.15  # of the memory free at start, split over the engines of a node


def default_kv_bytes(device: torch.device, engines_per_node: int = 1) -> int:
    """The KV budget of one engine when none is given: DEFAULT_MEMORY_SHARE of the memory free now
    (device memory on CUDA, MemAvailable on the host otherwise), divided by the engines the node runs."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    else:
        free = _host_available()
    return int(DEFAULT_MEMORY_SHARE * free / max(engines_per_node, 1))


def _host_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


class HeapTrim:
    """malloc_trim(0) at most every `every_s` seconds (call maybe() once per step); nothing where the C library
    has no malloc_trim (not glibc)."""

    def __init__(self, every_s: float = 5.0):
        self.every_s = every_s
        self._last = time.monotonic()
        self._trim = None
        try:
            self._trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):
            pass

    def maybe(self) -> None:
        if self._trim is not None and time.monotonic() - self._last >= self.every_s:
            self._trim(0)
            self._last = time.monotonic()


class KVBudget:
    """Blocks of KV memory: `capacity` in all, `used` granted. A grant is a count of blocks of
    `block_bytes` each (block_size slots of one row in every cache of a lane). row_bytes(slots): the bytes a row of
    that many slots holds (default: slots * slot_bytes; less where sliding-window layers keep only their window)."""

    def __init__(self, capacity_bytes: int, block_size: int, slot_bytes: int, row_bytes=None):
        if block_size < 1:
            raise ValueError(f"kv_block_size must be >= 1, got {block_size}")
        self.block_size, self.slot_bytes = block_size, slot_bytes
        self.block_bytes = block_size * slot_bytes
        self.row_bytes = row_bytes
        self.capacity = capacity_bytes // self.block_bytes  # blocks
        if self.capacity < 1:
            raise ValueError(f"a KV budget of {capacity_bytes} bytes holds no block of {self.block_bytes} bytes")
        self.used = 0

    def blocks(self, slots: int) -> int:
        """Blocks covering `slots` slots of one row."""
        if self.row_bytes is not None:
            return -(-self.row_bytes(slots) // self.block_bytes)
        return -(-slots // self.block_size)

    def free(self) -> int:
        return self.capacity - self.used

    def take(self, blocks: int) -> bool:
        if blocks > self.free():
            return False
        self.used += blocks
        return True

    def give(self, blocks: int) -> None:
        self.used -= blocks
        assert self.used >= 0, "KV budget: more blocks given back than taken"

    def report(self) -> dict:
        return {"kv_blocks": self.capacity, "kv_blocks_used": self.used, "kv_block_size": self.block_size,
                "kv_budget_mb": round(self.capacity * self.block_bytes / 2**20, 1),
                "kv_used_mb": round(self.used * self.block_bytes / 2**20, 1)}


@dataclass
class PrefixBlock:
    k: torch.Tensor  # [L, Hkv, S_b, hd] keys of the block's tokens in every layer
    v: torch.Tensor  # [L, Hkv, S_b, hd]
    hidden: torch.Tensor  # [S_b, D] the last layer's hidden states (before the final norm)
    windowed: bool = True  # whether the sliding-window layers' K/V are here (zeros where the row had dropped them)


def block_hashes(tokens: list[int], block_size: int, limit: int) -> list[bytes]:
    """Keys of the full blocks within tokens[:limit]: key j hashes the key before it and block j's tokens."""
    keys, prev = [], b""
    for j in range(limit // block_size):
        h = hashlib.blake2b(prev, digest_size=16)
        h.update(torch.tensor(tokens[j * block_size : (j + 1) * block_size], dtype=torch.int64).numpy().tobytes())
        prev = h.digest()
        keys.append(prev)
    return keys


class PrefixCache:
    """Full prompt blocks kept for reuse across rows and requests, within the engine's KVBudget (one
    budget block per cached block: its slot bytes and hidden states are within a lane slot's)."""

    def __init__(self, budget: KVBudget, window: int = 0):
        self.budget = budget
        self.window = window  # the model's longest sliding window: a prefix must end in blocks that hold it
        self.blocks: OrderedDict[bytes, PrefixBlock] = OrderedDict()  # least recently used first
        self.hits = self.queries = 0  # prompt tokens of placed rows found here / in all

    def __len__(self) -> int:
        return len(self.blocks)

    def keys(self, tokens: list[int]) -> list[bytes]:
        """Keys of the blocks a row with these tokens may take from the cache: its full blocks, leaving at
        least one token to compute (its logits choose the next token)."""
        return block_hashes(tokens, self.budget.block_size, len(tokens) - 1)

    def match(self, tokens: list[int], keys: list[bytes]) -> list[PrefixBlock]:
        """The cached blocks of the longest cached prefix of tokens (keys: self.keys(tokens))."""
        found = []
        for key in keys:
            blk = self.blocks.get(key)
            if blk is None:
                break
            self.blocks.move_to_end(key)
            found.append(blk)
        if self.window:  # the windowed layers read the prefix's last `window` slots: its blocks there must hold them
            last = -(-self.window // self.budget.block_size)
            while found and not all(b.windowed for b in found[-last:]):
                found.pop()
        return found

    def insert(self, tokens: list[int], read) -> None:
        """Cache the full blocks of tokens not cached yet; read(start, end) -> PrefixBlock of those slots.
        Stops where the budget has no block left, even after evicting every other entry."""
        bs = self.budget.block_size
        for j, key in enumerate(block_hashes(tokens, bs, len(tokens))):
            if key in self.blocks:
                self.blocks.move_to_end(key)
                continue
            if not self.budget.take(1) and not (self.evict(1) and self.budget.take(1)):
                return
            self.blocks[key] = read(j * bs, (j + 1) * bs)

    def evict(self, blocks: int) -> bool:
        """Give up to `blocks` least recently used blocks back to the budget; whether any was."""
        n = min(blocks, len(self.blocks))
        for _ in range(n):
            self.blocks.popitem(last=False)
        self.budget.give(n)
        return n > 0

    def clear(self) -> None:
        self.evict(len(self.blocks))
