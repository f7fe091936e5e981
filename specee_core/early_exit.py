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


def load_early_exit(model_dir: Path, model, tokenizer, **options) -> EarlyExit | None:
    """EarlyExit from the files beside the model, or None when there are no predictors."""
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
    draft = None
    if (model_dir / DRAFT_DIR / "config.json").is_file():
        draft = DraftSpeculator(DraftHead.load(model_dir / DRAFT_DIR, model.config), model, k=predictors.k)
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

    def __call__(self, h: torch.Tensor, sel: torch.Tensor, prev: torch.Tensor, pred) -> tuple[torch.Tensor, ...]:
        """h [n, D] pre-norm hidden of the rows `sel` [n] (indices into N), prev [n, K] ->
        (p_exit [n], prob [n, K], local_argmax [n] token ids)."""
        m = self.model
        if self.fused:
            from kernels import predictor_forward

            return predictor_forward(m.final_norm(h), self.cand[sel], m.w.lm_head, prev, pred.w1, pred.b1, pred.w2,
                                     pred.b2, backend="triton")
        hf = h.float()
        r = torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + m.config.rms_norm_eps)  # [n, 1]
        z = torch.bmm(self.w[sel], hf.unsqueeze(-1)).squeeze(-1) * r  # [n, K]
        p = z.softmax(-1)
        hidden = torch.relu(torch.addmm(pred.b1, torch.cat((z, p, p - prev), dim=-1), pred.w1.t()))
        p_exit = torch.sigmoid(torch.addmm(pred.b2, hidden, pred.w2.t()).squeeze(-1))
        return p_exit, p, self.cand[sel].gather(1, z.argmax(-1, keepdim=True)).squeeze(1)


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


class Stepper:
    """Decode steps of one batch in SpecEE mode. Rows exit independently; after an exit the
    remaining layers run only over the rows still active (compacted)."""

    def __init__(self, ee: EarlyExit, engine, batch, cache, prefill_hidden: torch.Tensor, lens: torch.Tensor):
        self.ee, self.engine, self.batch, self.cache = ee, engine, batch, cache
        self.model = m = engine.model
        n = len(batch.prompt_ids)
        self.histories = [list(p) for p in batch.prompt_ids]
        self.windows = [OnlineWindow(ee.schedule) for _ in range(n)]
        self.rows = [RowStats(explore_histogram=[0] * m.num_layers) for _ in range(n)]
        self.features = m.final_norm(batch.last_hidden)  # [B, D] feature of the last fed position
        self.has_pred = torch.zeros(m.num_layers + 1, dtype=torch.bool)
        self.has_pred[sorted(ee.predictors.layers)] = True
        self.pending: list[list[Pending]] = [[] for _ in range(n)]  # kv_mode="recompute"
        self.t_draft = self.t_pred = self.t_total = 0.0
        self.step_no = 0
        t0 = time.perf_counter()
        ee.speculator.start(batch.prompt_ids, m.final_norm(prefill_hidden), lens, cache.max_len)
        self.t_draft += time.perf_counter() - t0

    def _predictor_mask(self, alive: list[int], explore: bool) -> torch.Tensor:
        """[N, L+1] bool: row j runs the predictor after layer l."""
        L = self.model.num_layers
        if explore:
            return self.has_pred.expand(len(alive), L + 1)
        mask = torch.zeros(len(alive), L + 1, dtype=torch.bool)
        for j, b in enumerate(alive):
            mask[j, list(self.windows[b].active_layers())] = True
        return mask & self.has_pred

    def step(self, alive: list[int], rows: torch.Tensor | None, generator) -> tuple[list[int], list[int]]:
        t_start = time.perf_counter()
        ee, m, batch, cache = self.ee, self.model, self.batch, self.cache
        opts, L, dev = ee.options, m.num_layers, m.device
        for b in alive:  # bring histories up to date with the tokens recorded since the last step
            self.histories[b].extend(batch.generated[b][len(self.histories[b]) - len(batch.prompt_ids[b]):])
        n = len(alive)
        idx = torch.tensor(alive, device=dev)
        toks = batch.next_tokens[idx]
        cand = ee.speculator.propose(alive, self.histories, toks, self.features[idx])  # [N, K]
        t_spec = time.perf_counter()
        self.t_draft += t_spec - t_start

        explore = opts.explore_every > 0 and self.step_no % opts.explore_every == 0
        self.step_no += 1
        pmask = self._predictor_mask(alive, explore)
        h = m.embed(toks[:, None])  # [N, 1, D]
        cos, sin = m.rope_for(batch.positions[idx.cpu()].to(dev)[:, None])
        local = torch.arange(n)  # current active rows, as indices into alive
        cache_rows = rows
        prev = torch.zeros(n, ee.predictors.k, device=dev)
        out_tok = torch.empty(n, dtype=torch.int64, device=dev)
        out_layer = torch.full((n,), L, dtype=torch.int64)
        out_feat = torch.empty(n, m.config.hidden_size, dtype=m.dtype, device=dev)
        scorer = CandidateScorer(m, cand, opts.predictor_backend)
        compact = opts.skip == "row" or (opts.skip == "auto" and dev.type == "cuda")
        done = torch.zeros(n, dtype=torch.bool)  # "batch" policy: rows that exited but keep flowing

        t_pred = 0.0
        recompute = opts.kv_mode == "recompute"
        for i in range(L):
            if recompute:
                h = self._layer_with_pending(i, h, (cos, sin), [alive[r] for r in local.tolist()], cache_rows, idx)
            else:
                h = m.layer(i, h, (cos, sin), cache, cache_rows)
            layer = i + 1
            if layer == L:
                break
            sel = pmask[local, layer] & ~done[local]
            if not bool(sel.any()):
                continue
            tp = time.perf_counter()
            si = sel.nonzero().squeeze(1)  # into the active rows
            rows_sel = local[si]  # into alive
            hs = h[si.to(dev), 0]
            p_exit, prob, local_arg = scorer(hs, rows_sel.to(dev), prev[rows_sel.to(dev)], ee.predictors.layers[layer])
            prev[rows_sel.to(dev)] = prob
            for r in rows_sel.tolist():
                self.rows[alive[r]].predictor_calls += 1
            fire = (p_exit > opts.threshold).cpu()
            exit_at = None
            if bool(fire.any()):
                hf = m.final_norm(hs[fire.to(dev)])
                if opts.verify == "local" and batch.params.greedy:
                    tok = local_arg[fire.to(dev)]
                    ok = torch.ones(len(tok), dtype=torch.bool)
                else:  # one full LM-head product, only for the rows whose predictor fired
                    tok = sample(m.lm_head(hf), batch.params, generator)
                    ok = (tok[:, None] == cand[rows_sel[fire].to(dev)]).any(1).cpu() if batch.params.greedy \
                        else torch.ones(len(tok), dtype=torch.bool)
                if bool(ok.any()):
                    exit_at = si[fire][ok]  # into the active rows
                    exiting = local[exit_at]
                    out_tok[exiting.to(dev)] = tok[ok.to(dev)]
                    out_layer[exiting] = layer
                    out_feat[exiting.to(dev)] = hf[ok.to(dev)]
            t_pred += time.perf_counter() - tp
            if exit_at is None:
                continue
            if not compact:
                done[local[exit_at]] = True
                if not bool(done[local].all()):
                    continue
                exit_at = torch.arange(len(local))  # every row has exited: the batch skips the rest
            e_dev = exit_at.to(dev)
            if recompute:
                for j, r in zip(exit_at.tolist(), local[exit_at].tolist()):
                    b = alive[r]
                    self.pending[b].append(Pending(int(batch.positions[b]), layer, h[j, 0].clone()))
            if opts.kv_mode == "propagate":
                crows = idx[exit_at.to(dev)] if cache_rows is None else cache_rows[e_dev]
                rope_e = (cos[e_dev], sin[e_dev])
                for j in range(layer, L):
                    m.write_kv(j, h[e_dev], rope_e, cache, crows)
            keep = torch.ones(len(local), dtype=torch.bool)
            keep[exit_at] = False
            if not bool(keep.any()):
                local = local[keep]
                break
            k_dev = keep.to(dev)
            h, cos, sin, local = h[k_dev], cos[k_dev], sin[k_dev], local[keep]
            cache_rows = idx[local.to(dev)]
        if not compact and len(local):  # rows that exited but kept flowing are settled
            keep = ~done[local]
            h, local = h[keep.to(dev)], local[keep]
        if len(local):  # rows that ran every layer: the normal LM head
            hn = m.final_norm(h[:, 0])
            l_dev = local.to(dev)
            out_tok[l_dev] = sample(m.lm_head(hn), batch.params, generator)
            out_feat[l_dev] = hn
        self.t_pred += t_pred
        batch.next_tokens[idx] = out_tok
        self.features[idx] = out_feat
        layers = out_layer.tolist()
        for b, l in zip(alive, layers):
            self.windows[b].push(l)
            if explore:
                self.rows[b].explore_histogram[l - 1] += 1
        self.t_total += time.perf_counter() - t_start
        return out_tok.tolist(), layers

    def _layer_with_pending(self, i: int, h: torch.Tensor, rope, rows_b: list[int], cache_rows, idx):
        """Layer i for the current tokens h [n, 1, D] of batch rows rows_b, preceded in the same
        chunk by each row's pending positions that still lack layer i (position order)."""
        m = self.model
        waiting = [[p for p in self.pending[b] if p.next_layer == i] for b in rows_b]
        if not any(waiting):
            return m.layer(i, h, rope, self.cache, cache_rows)
        n, dev = len(rows_b), m.device
        t = 1 + max(len(w) for w in waiting)
        x = h.new_zeros(n, t, h.shape[-1])
        pos = torch.zeros(n, t, dtype=torch.int64)
        n_valid = torch.tensor([len(w) + 1 for w in waiting])
        for r, (b, w) in enumerate(zip(rows_b, waiting)):
            for k, p in enumerate(w):
                x[r, k], pos[r, k] = p.h, p.position
            x[r, len(w)], pos[r, len(w)] = h[r, 0], int(self.batch.positions[b])
        out = m.layer(i, x, m.rope_for(pos.to(dev)), self.cache, cache_rows, n_valid)
        for r, w in enumerate(waiting):
            for k, p in enumerate(w):
                p.h, p.next_layer = out[r, k], i + 1
        if i + 1 == m.num_layers:  # fully computed: nothing pending for these rows any more
            for b in rows_b:
                self.pending[b] = [p for p in self.pending[b] if p.next_layer < m.num_layers]
        return out[torch.arange(n, device=dev), (n_valid - 1).to(dev)].unsqueeze(1)

    def row_stats(self, b: int) -> dict:
        total = max(self.t_total, 1e-9)
        r = self.rows[b]
        explore = self.ee.options.explore_every > 0
        return {"predictor_calls": r.predictor_calls, "explore_histogram": r.explore_histogram if explore else None,
                "draft_time_share": self.t_draft / total, "predictor_time_share": self.t_pred / total,
                "schedule_version": self.ee.schedule.version}
