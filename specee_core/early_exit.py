"""Speculative early exit: the decode step that stops a row at a middle layer once its
predictor fires and the token is verified against the speculator's candidates.

Files beside the model (all optional; predictors are what turns the mode on):
    predictors.safetensors   per-layer exit MLPs (+ k and the layer list in its metadata)
    draft/                   EAGLE-1-layout draft head (config.json + weights)
    schedule.json            the offline predictor layers (specee_core.scheduler.Schedule)
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import torch

from specee_core.predictors import PredictorBank
from specee_core.sampling import sample
from specee_core.scheduler import OnlineWindow, Schedule
from specee_core.speculators import DraftHead, DraftSpeculator, PromptLookupSpeculator, Speculator
from specee_core.stepper import StepOutput

log = logging.getLogger(__name__)

PREDICTORS_FILE, DRAFT_DIR, SCHEDULE_FILE = "predictors.safetensors", "draft", "schedule.json"


@dataclass
class EarlyExitOptions:
    speculator: str = "auto"  # "draft" | "lookup" (prompt lookup, draft as fallback if present) | "auto"
    # exit when sigmoid(predictor) > threshold; > 1 switches exits off. 0.9, not the paper's 0.5:
    # on specee-tiny 0.5 agreed with dense on 60% of teacher-forced tokens, 0.9 on 84%
    threshold: float = 0.9
    verify: str = "local"  # "local": argmax among the k candidates | "full": LM-head argmax at the exit layer
    # skipped layers' KV: "propagate" (K/V from the exit hidden state) | "gap" (left empty) |
    # "recompute" (the missing layers run for the exited position in the same chunk as the next token
    # that runs them: exact KV; on weight-bound hardware a 2-token chunk costs about one token).
    # recompute by measurement on specee-tiny, batch 1, threshold 0.9: 63% positional agreement with
    # dense (42% identical sequences) at 63% of layers, propagate 26% (0%) at 66%, gap worse still
    kv_mode: str = "recompute"
    # "row": an exited row leaves the batch, later layers run over the rows still active (compacted),
    # so a batch gets cheaper as rows exit (large batches on a GPU). "batch": exited rows keep flowing
    # (their KV stays exact) and layers are skipped once every row has exited: on a weight-bound CPU
    # a layer costs the same for 5 rows as for 8, and compaction's KV gathers cost more than they save.
    # "auto": row on CUDA, batch elsewhere. Identical at batch 1.
    skip: str = "auto"
    window: int | None = None  # online window N; None = the schedule's
    offsets: tuple[int, ...] | None = None  # online offsets; None = the schedule's
    explore_every: int = 0  # every n-th step runs every predictor (unbiased stats for re-tuning); 0 = never
    predictor_backend: str = "auto"  # "auto" (Triton on CUDA) | "triton" | "torch"
    schedule: str | None = None  # path of a schedule JSON; None = schedule.json beside the model

    def __post_init__(self) -> None:
        checks = {"speculator": ("auto", "draft", "lookup"), "verify": ("local", "full"),
                  "kv_mode": ("propagate", "gap", "recompute"), "predictor_backend": ("auto", "triton", "torch"),
                  "skip": ("auto", "row", "batch")}
        for name, allowed in checks.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if not 0 <= self.threshold:
            raise ValueError(f"threshold must be >= 0, got {self.threshold}")
        if self.explore_every < 0:
            raise ValueError(f"explore_every must be >= 0, got {self.explore_every}")


class EarlyExit:
    """What mode="specee" needs: speculator, predictors, schedule, options."""

    def __init__(self, model, speculator: Speculator, predictors: PredictorBank, schedule: Schedule,
                 options: EarlyExitOptions):
        if speculator.k != predictors.k:
            raise ValueError(f"speculator proposes {speculator.k} candidates, predictors expect {predictors.k}")
        self.model = model
        self.speculator = speculator
        self.predictors = predictors.to(model.device)
        self.schedule = schedule
        self.options = options

    def with_options(self, **changes) -> EarlyExit:
        """The same speculator, predictors and schedule with some options changed."""
        opts = replace(self.options, **changes)
        return EarlyExit(self.model, self.speculator, self.predictors, self.schedule, opts)

    def new_stepper(self, engine, batch, cache, prefill_hidden: torch.Tensor, lens: torch.Tensor) -> Stepper:
        return Stepper(self, engine, batch, cache, prefill_hidden, lens)


def initial_schedule(model_dir: str | Path) -> Schedule:
    """The schedule an engine loaded from model_dir starts with: schedule.json beside the model,
    else a predictor at every layer that has one."""
    model_dir = Path(model_dir)
    if (model_dir / SCHEDULE_FILE).is_file():
        return Schedule.load(model_dir / SCHEDULE_FILE)
    if not (model_dir / PREDICTORS_FILE).is_file():
        raise FileNotFoundError(f"mode='specee' needs {PREDICTORS_FILE} beside the model in {model_dir}")
    from specee_core.config import ModelConfig

    layers = sorted(PredictorBank.load(model_dir / PREDICTORS_FILE).layers)
    num_layers = ModelConfig.from_file(model_dir / "config.json").num_hidden_layers
    return Schedule(num_layers=num_layers, offline_layers=layers, source="predictors")


def load_draft_head(model_dir: Path, model) -> DraftHead | None:
    """The draft head in draft/ beside the model, or None."""
    path = Path(model_dir) / DRAFT_DIR
    return DraftHead.load(path, model.config) if (path / "config.json").is_file() else None


def load_early_exit(model_dir: Path, model, tokenizer, draft_head: DraftHead | None = None,
                    **options) -> EarlyExit | None:
    """EarlyExit from the files beside the model, or None when there are no predictors. draft_head:
    the already loaded draft head (None: none)."""
    unknown = set(options) - {f.name for f in fields(EarlyExitOptions)}
    if unknown:
        raise TypeError(f"unknown engine options: {sorted(unknown)}")
    opts = EarlyExitOptions(**options)
    model_dir = Path(model_dir)
    if not (model_dir / PREDICTORS_FILE).is_file():
        return None
    predictors = PredictorBank.load(model_dir / PREDICTORS_FILE)
    schedule = Schedule.load(opts.schedule) if opts.schedule else initial_schedule(model_dir)
    if schedule.num_layers != model.num_layers:
        raise ValueError(f"schedule is for {schedule.num_layers} layers, the model has {model.num_layers}")
    schedule = Schedule(num_layers=schedule.num_layers, offline_layers=schedule.offline_layers,
                        window=schedule.window if opts.window is None else opts.window,
                        offsets=schedule.offsets if opts.offsets is None else opts.offsets,
                        version=schedule.version, source=schedule.source)
    draft = None if draft_head is None else DraftSpeculator(draft_head, model, k=predictors.k)
    if opts.speculator == "draft":
        if draft is None:
            raise FileNotFoundError(f"speculator='draft' but no draft head at {model_dir / DRAFT_DIR}")
        speculator: Speculator = draft
    elif opts.speculator == "lookup" or draft is None:
        speculator = PromptLookupSpeculator(k=predictors.k, fallback=draft)
    else:
        speculator = draft
    return EarlyExit(model, speculator, predictors, schedule, opts)


class CandidateScorer:
    """The exit test of one decode step for rows with candidates cand [N, K].

    On CUDA (or backend="triton") each call is one fused Triton launch (kernels.predictor).
    Otherwise the candidate LM-head rows are gathered once per step with the final RMSNorm's
    weight folded in, so a layer's test is a norm scalar, one batched dot product and the MLP:
    the same function as kernels.fused_predictor_reference, with fewer ops on the hot path."""

    def __init__(self, model, cand: torch.Tensor, backend: str):
        self.model, self.cand = model, cand
        dev = model.device
        self.fused = backend == "triton" or (backend == "auto" and dev.type == "cuda")
        if not self.fused:
            self.w = (model.w.lm_head[cand] * model.w.norm).float()  # [N, K, D]

    def __call__(self, h: torch.Tensor, sel: torch.Tensor | None, prev: torch.Tensor, pred) -> tuple[torch.Tensor, ...]:
        """h [n, D] pre-norm hidden of the rows `sel` [n] (indices into N; None = all N rows),
        prev [n, K] -> (p_exit [n], prob [n, K], local_argmax [n] token ids)."""
        m = self.model
        cand = self.cand if sel is None else self.cand[sel]
        if self.fused:
            from kernels import predictor_forward

            return predictor_forward(m.final_norm(h), cand, m.w.lm_head, prev, pred.w1, pred.b1, pred.w2,
                                     pred.b2, backend="triton")
        hf = h.float()
        r = torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + m.config.rms_norm_eps)  # [n, 1]
        w = self.w if sel is None else self.w[sel]
        z = torch.bmm(w, hf.unsqueeze(-1)).squeeze(-1) * r  # [n, K]
        p = z.softmax(-1)
        hidden = torch.relu(torch.addmm(pred.b1, torch.cat((z, p, p - prev), dim=-1), pred.w1.t()))
        p_exit = torch.sigmoid(torch.addmm(pred.b2, hidden, pred.w2.t()).squeeze(-1))
        return p_exit, p, cand.gather(1, z.argmax(-1, keepdim=True)).squeeze(1)


@dataclass
class Pending:
    """An exited position whose deeper layers still lack KV ("recompute"): its hidden state is
    the input of layer index `next_layer`."""
    position: int
    next_layer: int
    h: torch.Tensor  # [D]


@dataclass
class RowStats:
    predictor_calls: int = 0
    explore_histogram: list[int] = field(default_factory=list)


def _index(indices: list[int], count: int, device) -> torch.Tensor | None:
    """An index tensor for the sorted `indices` into `count` rows; None when they are all of them."""
    return None if len(indices) == count else torch.tensor(indices, device=device)


class Stepper:
    """Decode steps of one batch in SpecEE mode. Rows exit independently; with skip "row" the
    remaining layers run only over the rows still active (compacted).

    Per-row bookkeeping (which rows are active, exited, evaluated at a layer) is kept in Python
    lists: at decode batch sizes that is cheaper than the dozens of tiny tensor ops per layer it
    replaces; tensors index only the hidden states, candidates and outputs."""

    def __init__(self, ee: EarlyExit, engine, batch, cache, prefill_hidden: torch.Tensor, lens: torch.Tensor):
        self.ee, self.engine, self.batch, self.cache = ee, engine, batch, cache
        self.model = m = engine.model
        n = len(batch.prompt_ids)
        self.histories = [list(p) for p in batch.prompt_ids]
        self.windows = [OnlineWindow(ee.schedule) for _ in range(n)]
        self.rows = [RowStats(explore_histogram=[0] * m.num_layers) for _ in range(n)]
        self.features = m.final_norm(batch.last_hidden)  # [B, D] feature of the last fed position
        self.pred_layers = frozenset(ee.predictors.layers)
        self.pending: list[list[Pending]] = [[] for _ in range(n)]  # kv_mode="recompute"
        self._chunk_rope: tuple = ((), None)  # (positions, rope) of the last recompute chunk
        self.t_draft = self.t_pred = self.t_total = 0.0
        self.step_no = 0
        t0 = time.perf_counter()
        ee.speculator.start(batch.prompt_ids, m.final_norm(prefill_hidden), lens, cache.max_len)
        self.t_draft += time.perf_counter() - t0

    def _predictor_layers(self, alive: list[int], explore: bool) -> list[frozenset[int]]:
        """Per alive row: the layers after which its predictor runs this step."""
        if explore:
            return [self.pred_layers] * len(alive)
        return [self.pred_layers & frozenset(self.windows[b].active_layers()) for b in alive]

    def step(self, alive: list[int], rows: torch.Tensor | None, generator) -> StepOutput:
        t_start = time.perf_counter()
        ee, m, batch, cache = self.ee, self.model, self.batch, self.cache
        opts, L, dev = ee.options, m.num_layers, m.device
        for b in alive:  # bring histories up to date with the tokens recorded since the last step
            self.histories[b].extend(batch.generated[b][len(self.histories[b]) - len(batch.prompt_ids[b]):])
        n = len(alive)

        idx = None if rows is None else torch.tensor(alive, device=dev)  # rows None: every batch row is alive
        toks = batch.next_tokens if idx is None else batch.next_tokens[idx]
        cand = ee.speculator.propose(alive, self.histories, toks, self.features if idx is None else self.features[idx])
        t_spec = time.perf_counter()
        self.t_draft += t_spec - t_start

        explore = opts.explore_every > 0 and self.step_no % opts.explore_every == 0
        self.step_no += 1
        pred_layers = self._predictor_layers(alive, explore)
        h = m.embed(toks[:, None])  # [N, 1, D]
        positions = batch.positions if rows is None else batch.positions[torch.tensor(alive)]
        cos, sin = m.rope_for(positions.to(dev)[:, None])
        active = list(range(n))  # h's rows, as indices into alive
        cache_rows = rows
        prev = torch.zeros(n, ee.predictors.k, device=dev)  # last evaluated layer's candidate probabilities
        out_tok = torch.empty(n, dtype=torch.int64, device=dev)
        out_layer = [L] * n
        out_feat = torch.empty(n, m.config.hidden_size, dtype=m.dtype, device=dev)
        scorer = CandidateScorer(m, cand, opts.predictor_backend)
        compact = opts.skip == "row" or (opts.skip == "auto" and dev.type == "cuda")
        done = [False] * n  # "batch" policy: rows that exited but keep flowing

        t_pred = 0.0
        recompute = opts.kv_mode == "recompute"
        for i in range(L):
            if recompute:
                h = self._layer_with_pending(i, h, (cos, sin), [alive[j] for j in active], cache_rows)
            else:
                h = m.layer(i, h, (cos, sin), cache, cache_rows)
            layer = i + 1
            if layer == L:
                break
            sel = [r for r, j in enumerate(active) if layer in pred_layers[j] and not done[j]]  # rows of h
            if not sel:
                continue
            tp = time.perf_counter()
            js = [active[r] for r in sel]  # the same rows, as indices into alive
            sel_dev, js_dev = _index(sel, len(active), dev), _index(js, n, dev)
            hs = h[:, 0] if sel_dev is None else h[sel_dev, 0]
            p_exit, prob, local_arg = scorer(hs, js_dev, prev if js_dev is None else prev[js_dev],
                                             ee.predictors.layers[layer])
            if js_dev is None:
                prev = prob
            else:
                prev[js_dev] = prob
            for j in js:
                self.rows[alive[j]].predictor_calls += 1
            fired = [q for q, f in enumerate((p_exit > opts.threshold).tolist()) if f]  # positions in sel
            exit_rows = []  # rows of h that exit at this layer
            if fired:
                f_dev = _index(fired, len(sel), dev)
                hf = m.final_norm(hs if f_dev is None else hs[f_dev])
                if opts.verify == "local" and batch.params.greedy:
                    tok = local_arg if f_dev is None else local_arg[f_dev]
                    ok = [True] * len(fired)
                else:  # one full LM-head product, only for the rows whose predictor fired
                    tok = sample(m.lm_head(hf), batch.params, generator)
                    fired_cand = cand[torch.tensor([js[q] for q in fired], device=dev)]
                    ok = (tok[:, None] == fired_cand).any(1).tolist() if batch.params.greedy else [True] * len(fired)
                accepted = [a for a, good in enumerate(ok) if good]  # positions in fired
                if accepted:
                    exit_rows = [sel[fired[a]] for a in accepted]
                    exiting = torch.tensor([active[r] for r in exit_rows], device=dev)
                    a_dev = _index(accepted, len(fired), dev)
                    out_tok[exiting] = tok if a_dev is None else tok[a_dev]
                    out_feat[exiting] = hf if a_dev is None else hf[a_dev]
                    for r in exit_rows:
                        out_layer[active[r]] = layer
            t_pred += time.perf_counter() - tp
            if not exit_rows:
                continue
            if not compact:
                for r in exit_rows:
                    done[active[r]] = True
                if not all(done[j] for j in active):
                    continue
                exit_rows = list(range(len(active)))  # every row has exited: the batch skips the rest
            if recompute:
                for r in exit_rows:
                    b = alive[active[r]]
                    self.pending[b].append(Pending(int(batch.positions[b]), layer, h[r, 0].clone()))
            if opts.kv_mode == "propagate":
                e_dev = torch.tensor(exit_rows, device=dev)
                crows = torch.tensor([alive[active[r]] for r in exit_rows], device=dev)  # cache row = batch row
                rope_e = (cos[e_dev], sin[e_dev])
                for j in range(layer, L):
                    m.write_kv(j, h[e_dev], rope_e, cache, crows)
            leaving = set(exit_rows)
            keep = [r for r in range(len(active)) if r not in leaving]
            if not keep:
                active = []
                break
            k_dev = torch.tensor(keep, device=dev)
            h, cos, sin = h[k_dev], cos[k_dev], sin[k_dev]
            active = [active[r] for r in keep]
            cache_rows = torch.tensor([alive[j] for j in active], device=dev)
        if not compact and active:  # rows that exited but kept flowing are settled
            still = [r for r, j in enumerate(active) if not done[j]]
            if len(still) < len(active):
                h = h[torch.tensor(still, device=dev)]
                active = [active[r] for r in still]
        if active:  # rows that ran every layer: the normal LM head
            hn = m.final_norm(h[:, 0])
            a_dev = _index(active, n, dev)
            if a_dev is None:
                out_tok = sample(m.lm_head(hn), batch.params, generator)
                out_feat = hn
            else:
                out_tok[a_dev] = sample(m.lm_head(hn), batch.params, generator)
                out_feat[a_dev] = hn
        self.t_pred += t_pred
        if idx is None:
            self.features.copy_(out_feat)
        else:
            self.features[idx] = out_feat
        for b, l in zip(alive, out_layer):
            self.windows[b].push(l)
            if explore:
                self.rows[b].explore_histogram[l - 1] += 1
        self.t_total += time.perf_counter() - t_start
        return StepOutput([[t] for t in out_tok.tolist()], [[l] for l in out_layer])

    def _layer_with_pending(self, i: int, h: torch.Tensor, rope, rows_b: list[int], cache_rows):
        """Layer i for the current tokens h [n, 1, D] of batch rows rows_b, preceded in the same
        chunk by each row's pending positions that still lack layer i (position order)."""
        m = self.model
        waiting = [[p for p in self.pending[b] if p.next_layer == i] for b in rows_b]
        if not any(waiting):
            return m.layer(i, h, rope, self.cache, cache_rows)
        counts = [len(w) + 1 for w in waiting]
        t = max(counts)
        pad = [h.new_zeros(h.shape[-1])] if min(counts) < t else []
        # row r's chunk: its pending hidden states, the current token, zero padding up to t
        x = torch.stack([torch.stack([p.h for p in w] + [h[r, 0]] + pad * (t - c))
                         for r, (w, c) in enumerate(zip(waiting, counts))])  # [n, t, D]
        pos = tuple(tuple(p.position for p in w) + (int(self.batch.positions[b]),) * (1 + t - c)
                    for b, w, c in zip(rows_b, waiting, counts))
        if self._chunk_rope[0] != pos:  # successive layers usually share the chunk
            self._chunk_rope = (pos, m.rope_for(torch.tensor(pos, device=m.device)))
        # equal counts (always at batch 1): no per-row valid lengths, the cache's uniform path
        n_valid = None if min(counts) == t else torch.tensor(counts)
        out = m.layer(i, x, self._chunk_rope[1], self.cache, cache_rows, n_valid)
        for r, w in enumerate(waiting):
            for k, p in enumerate(w):
                p.h, p.next_layer = out[r, k], i + 1
        if i + 1 == m.num_layers:  # fully computed: nothing pending for these rows any more
            for b in rows_b:
                self.pending[b] = [p for p in self.pending[b] if p.next_layer < m.num_layers]
        if n_valid is None:  # the current token is every row's last
            return out[:, t - 1 :]
        current = torch.tensor([c - 1 for c in counts], device=m.device)
        return out[torch.arange(len(rows_b), device=m.device), current].unsqueeze(1)

    def row_stats(self, b: int) -> dict:
        total = max(self.t_total, 1e-9)
        r = self.rows[b]
        explore = self.ee.options.explore_every > 0
        return {"predictor_calls": r.predictor_calls, "explore_histogram": r.explore_histogram if explore else None,
                "draft_time_share": self.t_draft / total, "predictor_time_share": self.t_pred / total,
                "schedule_version": self.ee.schedule.version}
