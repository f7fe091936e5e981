"""Mode auto's measured costs: what a verify forward of T rows per sequence and a draft-head step cost on the
machine at hand, per batch size (CostTable), measured once per machine, model, dtype, torch version and thread
count (measure_costs) and cached under $SPECEE_CACHE/plans (load_costs, save_costs)."""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specee_core.machine import cache_path, machine_name, save_measured

log = logging.getLogger(__name__)

T_GRID = (1, 2, 3, 5, 9, 17)  # verify rows per sequence that are measured; others interpolated (near-linear in T)
PLAN_VERSION = 3  # bump when what is measured changes: older cache files are then measured again


@dataclass
class CostTable:
    """Milliseconds measured on one machine. verify[b][i]: one base forward (every layer, final norm,
    LM head, argmax) over b rows of T_GRID[i] tokens each, with a tree mask when T > 1 (T = 1 is a dense
    step); draft[b]: one draft-head level over b rows (the draft layer and its LM head)."""
    key: dict  # machine, model, dtype, torch, threads: what the numbers are valid for
    verify: dict[int, list[float]] = field(default_factory=dict)
    draft: dict[int, float] = field(default_factory=dict)
    tokens: tuple[int, ...] = T_GRID

    def verify_ms(self, b: int, t: int) -> float:
        """Cost of a forward over b rows of t tokens: linear between measured t, beyond the largest
        measured t and between measured batch sizes; proportional beyond the largest measured b."""
        return _interp_batch(self.verify, b, lambda row: _interp(self.tokens[: len(row)], row, t))

    def draft_ms(self, b: int) -> float:
        if b <= 0 or not self.draft:
            return 0.0
        return _interp_batch({k: [v] for k, v in self.draft.items()}, b, lambda row: row[0])

    def pair_ms(self) -> float:
        """What the draft head takes per (token, feature) pair it catches up on, before any catching up was
        timed: a draft level's cost per row at the largest batch measured (close to what a pair costs when
        catching up is timed)."""
        if not self.draft:
            return 0.0
        b = max(self.draft)
        return self.draft[b] / b

    def to_json(self) -> dict:
        return {"key": self.key, "tokens": list(self.tokens),
                "verify_ms": {str(b): [round(x, 3) for x in v] for b, v in sorted(self.verify.items())},
                "draft_ms": {str(b): round(v, 3) for b, v in sorted(self.draft.items())}}

    @classmethod
    def from_json(cls, d: dict) -> CostTable:
        """ValueError unless d is a table this version wrote: T a prefix of T_GRID, per batch size a
        non-empty row of positive milliseconds no longer than T, positive draft milliseconds."""
        tokens = tuple(d["tokens"])
        if not tokens or tokens != T_GRID[: len(tokens)]:
            raise ValueError(f"tokens {list(tokens)} is not a prefix of {list(T_GRID)}")
        verify = {int(b): [float(x) for x in v] for b, v in d["verify_ms"].items()}
        draft = {int(b): float(v) for b, v in d["draft_ms"].items()}
        for b, row in verify.items():
            if b < 1 or not 0 < len(row) <= len(tokens) or not all(0 < x < 1e7 for x in row):
                raise ValueError(f"verify_ms for batch {b}: {row}")
        if any(b < 1 or not 0 < v < 1e7 for b, v in draft.items()):
            raise ValueError(f"draft_ms: {draft}")
        return cls(key=d["key"], tokens=tokens, verify=verify, draft=draft)

    def lacks(self, b: int, tokens: int, draft: bool) -> bool:
        """Whether batch size b needs measuring for verify forwards up to `tokens` (and a draft level)."""
        need = len([t for t in T_GRID if t <= max(tokens, 2)])
        return len(self.verify.get(b, ())) < need or (draft and b not in self.draft)

    def merge(self, other: CostTable) -> None:
        """Take other's measurements where they go further than this table's (another process's)."""
        for b, row in other.verify.items():
            if len(row) > len(self.verify.get(b, ())):
                self.verify[b] = row
        for b, v in other.draft.items():
            self.draft.setdefault(b, v)
        if len(other.tokens) > len(self.tokens):
            self.tokens = other.tokens


def _interp(xs, ys, x: float) -> float:
    """Piecewise-linear through (xs, ys), extended linearly past both ends (ys >= 0)."""
    if len(xs) == 1:
        return ys[0] * x / xs[0]
    for i in range(1, len(xs)):
        if x <= xs[i] or i == len(xs) - 1:
            x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
            return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))
    raise AssertionError("unreachable")


def _interp_batch(table: dict[int, list[float]], b: int, at) -> float:
    sizes = sorted(table)
    if not sizes:
        raise ValueError("the cost table holds no measurements")
    if b in table:
        return at(table[b])
    if b > sizes[-1]:
        return at(table[sizes[-1]]) * b / sizes[-1]
    lo = max((s for s in sizes if s < b), default=None)
    hi = min(s for s in sizes if s > b)
    if lo is None:
        return at(table[hi])
    return at(table[lo]) + (at(table[hi]) - at(table[lo])) * (b - lo) / (hi - lo)


def monotone(ys: list[float]) -> list[float]:
    """The closest non-decreasing sequence (pool adjacent violators): more rows never cost less, so a
    dip in the timings is noise."""
    blocks: list[list[float]] = []  # [sum, count]
    for y in ys:
        blocks.append([y, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, c = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += c
    return [s / c for s, c in blocks for _ in range(int(c))]



def cost_key(model, dtype: torch.dtype, device: torch.device) -> dict:
    """What a table's numbers depend on; its hash names the cache file."""
    c = model.config
    shape = (c.num_hidden_layers, c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads,
             c.vocab_size)
    return {"plan_version": PLAN_VERSION, "machine": machine_name(device), "torch": torch.__version__,
            "threads": torch.get_num_threads() if device.type == "cpu" else None, "dtype": str(dtype).removeprefix("torch."),
            "model_shape": list(shape), **_weights_key(model), **c.architecture_key()}


def _weights_key(model) -> dict:
    """Low-bit weights: their format; where the CPU kernel runs the decode layers (low-bit weights, and dense ones
    whose layers it fuses), its source hash: the costs are the kernel's, and a new kernel is measured anew."""
    key = {"weights": model.weight_format} if model.weight_format in ("q4", "q8", "gguf") else {}
    if key or model.fused_layers:
        from kernels.cpu_ext import source_digest

        key["kernel"] = source_digest()
    return key


def load_costs(key: dict, root: str | Path | None = None) -> CostTable:
    """The cached table for key, or an empty one (also when the cache file is unreadable)."""
    path = cache_path(key, root)
    try:
        if path.is_file():
            table = CostTable.from_json(json.loads(path.read_text()))
            if table.key == key:
                return table
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        log.warning("%s: unreadable cost table (%s: %s); measuring again", path, type(e).__name__, e)
    return CostTable(key=key)


def save_costs(table: CostTable, root: str | Path | None = None) -> Path | None:
    """Write the table (atomically); None, with a warning, where the cache cannot be written (the plan
    then lives in this process only)."""
    return save_measured(cache_path(table.key, root), table.to_json(), "cost table")


@torch.inference_mode()
def measure_costs(table: CostTable, model, draft, batch: int, max_tokens: int, prefix: int = 192,
                  repeats: int = 4) -> None:
    """Measure verify forwards of `batch` rows for T_GRID up to max_tokens (rounds interleaved over T so
    drift hits every T alike; the fastest of each, made non-decreasing in T) and one draft-head level,
    into table. The fastest, not the median: on a shared VM noise only ever adds time, and a slow stretch
    that spoils most samples of the dense step makes drafting look cheap beside it. Seconds on a CPU."""
    longest = T_GRID[len(table.verify.get(batch, ())) - 1] if batch in table.verify else 2
    tokens = tuple(t for t in T_GRID if t <= max(max_tokens, longest, 2))  # never less than measured before
    dev = model.device
    prefix = max(1, min(prefix, model.config.max_position_embeddings - tokens[-1] - 1))
    cache = model.new_cache(batch, prefix + tokens[-1])
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (batch, prefix + tokens[-1]), generator=gen)
    rows = torch.arange(batch)
    base = torch.full((batch,), prefix)
    kv_gen = torch.Generator(device=dev).manual_seed(0)
    cache.randomize(kv_gen)  # a prompt's K/V (random: no prefill to run)
    cache.truncate(rows, base)

    def verify(t: int) -> None:
        x = ids[:, prefix : prefix + t].to(dev)
        pos = (prefix + torch.arange(t)).expand(batch, t).to(dev)
        tree = None if t == 1 else torch.tril(torch.ones(t, t, dtype=torch.bool)).expand(batch, t, t)
        h = model.forward(x, pos, cache, None, tree=tree)
        model.lm_head(model.final_norm(h)).max(-1).indices.cpu()
        cache.truncate(rows, base)

    samples: dict[int, list[float]] = {t: [] for t in tokens}
    for rnd in range(repeats + 1):  # round 0 warms up
        for t in (tokens if rnd % 2 else tokens[::-1]):
            _sync(dev)
            t0 = time.perf_counter()
            verify(t)
            _sync(dev)
            if rnd:
                samples[t].append((time.perf_counter() - t0) * 1e3)
    table.verify[batch] = monotone([min(samples[t]) for t in tokens])
    if len(tokens) > len(table.tokens):
        table.tokens = tokens
    if draft is not None:
        table.draft[batch] = _measure_draft(draft, model, batch, prefix, ids, repeats)


def _measure_draft(draft, model, batch: int, prefix: int, ids: torch.Tensor, repeats: int) -> float:
    """Milliseconds of one draft-head step (one token per row, after `prefix` cached) and its top token: the
    fastest of `repeats`, as for the verify forwards."""
    dev = model.device
    cache = draft.new_cache(batch, prefix + 1)
    feats = torch.zeros(batch, prefix, model.config.hidden_size, dtype=model.dtype, device=dev)
    draft.forward(cache, ids[:, :prefix].to(dev), feats, torch.arange(prefix).expand(batch, prefix).to(dev), None)
    tok, f = ids[:, prefix : prefix + 1].to(dev), feats[:, :1]
    pos = torch.full((batch, 1), prefix, device=dev)
    rows, base = torch.arange(batch), torch.full((batch,), prefix)
    times = []
    for rnd in range(repeats + 2):
        _sync(dev)
        t0 = time.perf_counter()
        out = draft.forward(cache, tok, f, pos, None)
        draft.top_log_probs(out, 1)[1].cpu()
        _sync(dev)
        cache.truncate(rows, base)
        if rnd >= 2:
            times.append((time.perf_counter() - t0) * 1e3)
    return min(times)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
