"""Speculative early exit: the decode step that stops a row at a middle layer once its
predictor fires and the token is verified against the proposer's candidates.

Files beside the model (all optional; predictors are what turns the mode on):
    predictors.safetensors   per-layer exit MLPs (+ k and the layer list in its metadata)
    draft/                   EAGLE-1-layout draft head (config.json + weights)
    schedule.json            the offline predictor layers (specee_core.early_exit.scheduler.Schedule)
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import fields, replace
from pathlib import Path

import torch

from specee_core.early_exit.calibration import CALIBRATION_FILE, Calibration, calibrate_command
from specee_core.early_exit.options import EarlyExitOptions
from specee_core.step.policy import PayOffGate
from specee_core.early_exit.predictors import DraftRecord, PredictorBank
from specee_core.early_exit.scheduler import OnlineWindow, Schedule
from specee_core.early_exit.walk import CandidateScorer, Decisions, Pending, Proposal, RowStats, Walk
from specee_core.draft.head import DraftHead, DraftModel
from specee_core.draft.lookup import lookup_tokens, lookup_veto
from specee_core.draft.proposer import Proposer
from specee_core.step.stepper import StepOutput

log = logging.getLogger(__name__)

PREDICTORS_FILE, DRAFT_DIR, SCHEDULE_FILE = "predictors.safetensors", "draft", "schedule.json"


class EarlyExit:
    """What mode="specee" needs: the candidates' source (source "draft": the draft head's, "lookup": prompt
    lookup's completed from the draft head's when there is one), predictors, schedule, options."""

    def __init__(self, model, draft: DraftModel | None, source: str, predictors: PredictorBank, schedule: Schedule,
                 options: EarlyExitOptions, calibration: Calibration | None = None, model_dir: Path | None = None):
        if source == "draft" and draft is None:
            raise ValueError("candidates from the draft head need a draft head")
        if predictors.reads_draft_prob and source != "draft":
            raise ValueError(f"these predictors read the draft head's confidence in its candidates (feature set "
                             f"{predictors.features!r}); prompt lookup has none: use speculator='draft' "
                             f"(or 'auto'), or predictors trained with --speculator lookup")
        self.model = model
        self.draft, self.source = draft, source
        self.predictors = predictors.to(model.device)
        self.schedule = schedule
        self.options = options
        self.calibration = calibration
        self.model_dir = model_dir
        self.thresholds = self._thresholds()
        # the calibrated thresholds hold under the rule they were certified with: an exit whose token contradicts
        # prompt lookup's (n-gram of at least this many tokens) is not taken (calibration.Calibration.lookup_veto)
        self.lookup_veto = None if options.max_disagreement is None else calibration.lookup_veto
        self.gated = options.gate == "measured" or (options.gate == "auto" and model.device.type != "cuda")
        self._expected_skip: float | None = None

    def with_options(self, **changes) -> EarlyExit:
        """The same candidates, predictors and schedule with some options changed."""
        opts = replace(self.options, **changes)
        return EarlyExit(self.model, self.draft, self.source, self.predictors, self.schedule, opts, self.calibration,
                         self.model_dir)

    def _thresholds(self) -> dict[int, float]:
        """Exit threshold per predictor layer (a layer missing here never exits): calibrated for
        max_disagreement when it is set, else the raw threshold everywhere."""
        opts = self.options
        if opts.max_disagreement is None:
            return {l: opts.threshold for l in self.predictors.layers}
        if self.calibration is None:
            raise ValueError(f"max_disagreement needs {CALIBRATION_FILE} beside the predictors in "
                             f"{self.model_dir or 'the model directory'}; make it with: "
                             f"{calibrate_command(self.model_dir or '<model dir>')}")
        cal = self.calibration.thresholds(opts.max_disagreement, opts.confidence)
        return {l: c.threshold for l, c in cal.items() if c.threshold is not None and l in self.predictors.layers}

    def expected_skip(self) -> float | None:
        """Layers per token that exits at these thresholds skip on the calibration tokens (each exiting at
        the shallowest layer whose predictor fires); None without a calibration file. The pay-off gate's
        prior."""
        cal = self.calibration
        if cal is None:
            return None
        if self._expected_skip is None:
            L, layers = self.model.num_layers, self.exit_layers()
            exit_at = cal.exit_layers({l: t for l, t in self.thresholds.items() if l in layers}, L)
            self._expected_skip = float((L - exit_at).float().mean())
        return self._expected_skip

    def exit_layers(self) -> frozenset[int]:
        """The layers where a row may exit now: a threshold and not disabled by the schedule (the audit)."""
        return frozenset(self.thresholds) - frozenset(self.schedule.disabled_layers)

    def new_stepper(self, engine, batch, cache, prefill_hidden: torch.Tensor, lens: torch.Tensor) -> EarlyExitStepper:
        return EarlyExitStepper(self, engine, batch, cache, prefill_hidden, lens)


def initial_schedule(model_dir: str | Path) -> Schedule:
    """The schedule an engine loaded from model_dir starts with: schedule.json beside the model,
    else a predictor at every layer that has one."""
    model_dir = Path(model_dir)
    if (model_dir / SCHEDULE_FILE).is_file():
        return Schedule.load(model_dir / SCHEDULE_FILE)
    if not (model_dir / PREDICTORS_FILE).is_file():
        raise FileNotFoundError(f"mode='specee' needs {PREDICTORS_FILE} beside the model in {model_dir}")
    from specee_core.model.config import ModelConfig

    layers = sorted(PredictorBank.load(model_dir / PREDICTORS_FILE).layers)
    num_layers = ModelConfig.from_file(model_dir / "config.json").num_hidden_layers
    return Schedule(num_layers=num_layers, offline_layers=layers, source="predictors")


def load_draft_head(model_dir: Path, model) -> DraftHead | None:
    """The draft head in draft/ beside the model, or None."""
    path = Path(model_dir) / DRAFT_DIR
    return DraftHead.load(path, model.config) if (path / "config.json").is_file() else None


def load_early_exit(model_dir: Path, model, tokenizer, draft: DraftModel | None = None,
                    **options) -> EarlyExit | None:
    """EarlyExit from the files beside the model, or None when there are no predictors. draft: the
    already loaded draft head (None: none)."""
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
    schedule = replace(schedule, window=schedule.window if opts.window is None else opts.window,
                       offsets=schedule.offsets if opts.offsets is None else opts.offsets)
    if opts.speculator == "draft" and draft is None:
        raise FileNotFoundError(f"speculator='draft' but no draft head at {model_dir / DRAFT_DIR}")
    source = "lookup" if opts.speculator == "lookup" or draft is None else "draft"
    calibration = Calibration.load(model_dir / CALIBRATION_FILE) if (model_dir / CALIBRATION_FILE).is_file() else None
    return EarlyExit(model, draft, source, predictors, schedule, opts, calibration, model_dir)


def _scheduled(layer: int, walk: Walk) -> list[int]:
    """The rows of walk.h whose predictor runs after `layer` (still deciding: not exited)."""
    return [r for r, j in enumerate(walk.running) if layer in walk.pred_layers[j] and not walk.done[j]]


def _index(indices: list[int], count: int, device) -> torch.Tensor | None:
    """An index tensor for the sorted `indices` into `count` rows; None when they are all of them."""
    return None if len(indices) == count else torch.tensor(indices, device=device)


class EarlyExitStepper:
    """Decode steps of one batch in SpecEE mode. Rows exit independently; with skip "row" the
    remaining layers run only over the rows still running (compacted).

    A step reads as: propose (the proposer's K candidates), walk the layers, decide exits at
    the layers a row's predictor is scheduled for (exited rows leave the walk, their skipped
    layers' KV computed with the row's next full-depth token), the normal LM head for the rows that ran every layer, and
    commit (the stepper's own features and online windows; the engine commits the StepOutput).

    Per-row bookkeeping (which rows are running, exited, evaluated at a layer) is kept in Python
    lists: at decode batch sizes that is cheaper than the dozens of tiny tensor ops per layer it
    replaces; tensors index only the hidden states, candidates and outputs."""

    def __init__(self, ee: EarlyExit, engine, batch, cache, prefill_hidden: torch.Tensor, lens: torch.Tensor):
        self.ee, self.engine, self.batch, self.cache = ee, engine, batch, cache
        self.model = m = engine.model
        opts = ee.options
        n = batch.size
        self.windows = [OnlineWindow(ee.schedule) for _ in range(n)]
        self.rows = [RowStats.empty(m.num_layers) for _ in range(n)]
        self.thresholds = ee.thresholds
        self.pred_layers = ee.exit_layers()
        self.compact = opts.skip == "row" or (opts.skip == "auto" and m.device.type == "cuda")
        self.pending: list[list[Pending]] = [[] for _ in range(n)]  # exited positions' skipped layers, to run
        # per row: its last token exited early, so the draft head was fed an exit layer's feature for
        # this step, not the full model's. Predictors that read the draft's confidence ("zpdq") were
        # trained and calibrated on full-model features only, and trust it: such a row does not exit
        # this step (exits chained on exit features disagreed far beyond the tolerance)
        self.features = m.final_norm(batch.last_hidden)  # [B, D] feature of each row's last fed position
        self.exited_last = [False] * n
        self.no_chain = ee.predictors.reads_draft_prob
        self.record = DraftRecord(n) if ee.predictors.reads_record else None
        self._chunk_rope: tuple = ((), None)  # (positions, rope) of the last recompute chunk
        self.t_draft = self.t_pred = self.t_total = 0.0
        self.step_no = 0
        self.dense_steps = 0  # steps the gate ran dense in this batch
        # the engine's policy times SpecEE's costs once per EarlyExit (these options), then the gate decides from the exits
        self.gate = PayOffGate(engine.policy, ee, m.num_layers, prior_skip=ee.expected_skip()) if ee.gated else None
        self.proposer = Proposer(ee.draft, n, cache.max_len, m.device)  # its own draft cache and lookup index

    def caches(self) -> list:
        return self.proposer.caches()

    def admit(self, rows: list[int], prefill_hidden: torch.Tensor, lens: torch.Tensor) -> None:
        batch, m = self.batch, self.model
        for b in rows:
            self.windows[b] = OnlineWindow(self.ee.schedule)
            self.rows[b] = RowStats.empty(m.num_layers)
            self.pending[b] = []
            self.exited_last[b] = False
        if self.record is not None:
            self.record.clear(rows)
        idx = torch.tensor(rows, device=m.device)
        self.features[idx] = m.final_norm(batch.last_hidden[idx])
        t0 = time.perf_counter()
        self.proposer.admit(batch, rows, prefill_hidden, lens)
        self.t_draft += time.perf_counter() - t0

    def _predictor_layers(self, alive: list[int], explore: bool) -> list[frozenset[int]]:
        """Per alive row: the layers after which its predictor runs this step. With a tolerance, every
        layer the calibration lets exit (a handful, chosen on held-out data: the schedule's offline level,
        profiled at one tolerance, would leave another tolerance's layers to the online level alone);
        with the raw threshold, the two-level schedule's."""
        none = frozenset()
        if explore or self.ee.options.max_disagreement is not None:
            return [none if self.exited_last[b] else self.pred_layers for b in alive]
        return [none if self.exited_last[b] else self.pred_layers & frozenset(self.windows[b].active_layers())
                for b in alive]

    def step(self, alive: list[int], rows: torch.Tensor | None) -> StepOutput:
        t_start = time.perf_counter()
        if self.gate is not None and self.gate.dense_next():
            result, layer_s = self._dense_step(alive, rows)
            dt = time.perf_counter() - t_start
            self.t_total += dt
            self.dense_steps += 1
            self.gate.record_dense(dt, layer_s)
            return result
        prop = self._propose(alive, rows)
        self.t_draft += time.perf_counter() - t_start
        walk, out = self._start(prop, rows)
        L = self.model.num_layers
        for i in range(L):
            if 0 < i < L - 1:
                self._probs_below(i + 1, walk)
            walk.h = self._run_layer(i, prop, walk)
            if i + 1 < L:
                exits = self._decide_exits(i + 1, prop, walk, out)
                if exits and prop.audit:  # decided, but every layer still runs (exact KV, nothing pending)
                    for r in exits:
                        walk.done[walk.running[r]] = True
                elif exits:
                    self._leave(i + 1, exits, prop, walk)
                    if not walk.running:
                        break
        if prop.audit:
            self._audit(walk, prop, out)
        self._full_depth(walk, out, alive)
        self._commit(prop, out)
        dt = time.perf_counter() - t_start
        self.t_total += dt
        if self.gate is not None:  # the layers the exits skipped (would have, in an audited step)
            L = self.model.num_layers
            skipped = (sum(L - l for l in out.layers) / len(out.layers) if self.compact
                       else L - max(out.layers))
            self.gate.record_specee(skipped, None if prop.audit else dt)
        return self._output(out, alive)

    def _output(self, out: Decisions, alive: list[int]) -> StepOutput:
        """The step's tokens and layers; with logprobs asked for, each token's from the LM head over the hidden
        state it was chosen from (an exit layer's for an exited token: one more LM-head product per row)."""
        toks = out.tokens.tolist()
        lps = None
        if any(self.batch.sampling[b].logprobs is not None for b in alive):
            lps = self.batch.step_logprobs(self.model.lm_head(out.hidden), alive, toks)
        return StepOutput([[t] for t in toks], [[l] for l in out.layers], normed=out.hidden, logprobs=lps)

    def _dense_step(self, alive: list[int], rows: torch.Tensor | None) -> tuple[StepOutput, float]:
        """A step of the gate's: every layer for every row (the pending positions of earlier exits too: why it is not
        the plain dense step), no draft and no predictors; the proposer takes the step's pairs in with its next candidates.
        Returns the step's output and the seconds spent in the layers."""
        idx, toks = self._fed(alive, rows)
        if self.record is not None:  # no proposals: the rows' records start over after the stretch
            self.record.clear(alive)
        prop = Proposal(alive, idx, toks, cand=toks[:, None], draft_prob=None, record=None, lookup=None,
                        explore=False, audit=False)
        walk, out = self._start(prop, rows)
        walk.pred_layers = [frozenset()] * len(alive)
        t0 = time.perf_counter()
        for i in range(self.model.num_layers):
            walk.h = self._run_layer(i, prop, walk)
        layer_s = time.perf_counter() - t0
        self._full_depth(walk, out, alive)
        self._commit(prop, out)
        return self._output(out, alive), layer_s

    def _fed(self, alive: list[int], rows: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(the alive rows' index on the device, None when every batch row is alive; the tokens [N] they feed
        now). Each row's pair (that token, its previous feature) joins the draft head's queue."""
        idx = None if rows is None else torch.tensor(alive, device=self.model.device)  # rows None: all alive
        toks = self.batch.next_tokens if idx is None else self.batch.next_tokens[idx]
        if self.proposer.draft is not None:
            feats = self.features if idx is None else self.features[idx]
            self.proposer.push(alive, [[t] for t in toks.tolist()], list(feats.split(1)))
        return idx, toks

    def _propose(self, alive: list[int], rows: torch.Tensor | None) -> Proposal:
        """The proposer's candidates for the alive rows."""
        opts = self.ee.options
        idx, toks = self._fed(alive, rows)
        cand, q = self.proposer.candidates(alive, self.batch, self.ee.predictors.k, self.ee.source)
        record = None if self.record is None else self.record.step(alive, toks.tolist(), cand).to(cand.device)
        lookup = None
        if self.ee.lookup_veto is not None:
            followers = self.proposer.followers(alive, self.batch)
            lookup = lookup_tokens(followers, self.ee.lookup_veto).to(cand.device)
        explore = opts.explore_every > 0 and self.step_no % opts.explore_every == 0
        f = opts.audit_fraction  # steps s with floor((s + 1) f) > floor(s f): a share f, evenly spread
        audit = f > 0 and math.floor((self.step_no + 1) * f) > math.floor(self.step_no * f)
        self.step_no += 1
        return Proposal(alive, idx, toks, cand, q if self.ee.predictors.reads_draft_prob else None, record, lookup,
                        explore, audit)

    def _start(self, prop: Proposal, rows: torch.Tensor | None) -> tuple[Walk, Decisions]:
        """Every step row runs from the embedding; nothing is decided yet."""
        m, dev, n = self.model, self.model.device, len(prop.alive)
        positions = self.batch.positions if rows is None else self.batch.positions[torch.tensor(prop.alive)]
        walk = Walk(h=m.embed(prop.tokens[:, None]), rope=m.rope_for(positions.to(dev)[:, None]),
                    running=list(range(n)), cache_rows=rows,
                    pred_layers=self._predictor_layers(prop.alive, prop.explore),
                    scorer=CandidateScorer(m, prop.cand, self.ee.options.predictor_backend, prop.draft_prob,
                                           self.ee.predictors.exit_token, prop.record),
                    prev=torch.zeros(n, self.ee.predictors.k, device=dev), done=[False] * n)
        out = Decisions(tokens=torch.empty(n, dtype=torch.int64, device=dev), layers=[m.num_layers] * n,
                        hidden=torch.empty(n, m.config.hidden_size, dtype=m.dtype, device=dev),
                        choice=torch.empty(n, dtype=torch.int64, device=dev))
        return walk, out

    def _run_layer(self, i: int, prop: Proposal, walk: Walk) -> torch.Tensor:
        """Layer i for the running rows, preceded by their pending positions (an exited position's skipped layers
        run in the same chunk as the next token that runs them: exact KV, and on weight-bound hardware a 2-token
        chunk costs about one token)."""
        return self._layer_with_pending(i, walk.h, walk.rope, [prop.alive[j] for j in walk.running], walk.cache_rows)

    def _probs_below(self, layer: int, walk: Walk) -> None:
        """Before layer `layer` runs: the candidate probabilities of the layer below, for the rows whose
        predictor runs at `layer` (its feature p - prev compares adjacent layers, as in training)."""
        sel = _scheduled(layer, walk)
        if not sel:
            return
        dev = self.model.device
        js = [walk.running[r] for r in sel]
        sel_dev, js_dev = _index(sel, len(walk.running), dev), _index(js, len(walk.prev), dev)
        probs = walk.scorer.probs(walk.h[:, 0] if sel_dev is None else walk.h[sel_dev, 0], js_dev)
        if js_dev is None:
            walk.prev = probs
        else:
            walk.prev[js_dev] = probs

    def _decide_exits(self, layer: int, prop: Proposal, walk: Walk, out: Decisions) -> list[int]:
        """The predictors scheduled after `layer` for the running rows; a row exits when its
        predictor fires and its token is verified. Writes the exits' decisions into out; returns
        them as rows of walk.h."""
        sel = _scheduled(layer, walk)
        if not sel:
            return []
        t0 = time.perf_counter()
        fired, h_fired, local = self._score(layer, sel, prop, walk)
        exits = self._verify(layer, fired, h_fired, local, prop, walk, out) if fired else []
        self.t_pred += time.perf_counter() - t0
        return exits

    def _score(self, layer: int, sel: list[int], prop: Proposal, walk: Walk
               ) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """Runs the predictor of `layer` for the rows sel of h. Returns the rows (of h) whose
        predictor fired, their hidden states [F, D] and the tokens their exits would emit [F]."""
        dev = self.model.device
        js = [walk.running[r] for r in sel]  # the same rows, as step rows
        sel_dev, js_dev = _index(sel, len(walk.running), dev), _index(js, len(prop.alive), dev)
        hs = walk.h[:, 0] if sel_dev is None else walk.h[sel_dev, 0]  # [S, D]
        prev = walk.prev if js_dev is None else walk.prev[js_dev]
        p_exit, prob, local = walk.scorer(hs, js_dev, prev, self.ee.predictors.layers[layer])
        for j in js:
            self.rows[prop.alive[j]].predictor_calls += 1
        fire = p_exit > self.thresholds[layer]
        if prop.lookup is not None:  # the calibration's rule: no exit against prompt lookup's token
            fire &= ~lookup_veto(local, prop.lookup if js_dev is None else prop.lookup[js_dev])
        fired = [q for q, f in enumerate(fire.tolist()) if f]  # positions in sel
        if len(fired) == len(sel):
            return sel, hs, local
        if not fired:
            return [], hs[:0], local[:0]
        f_dev = torch.tensor(fired, device=dev)
        return [sel[q] for q in fired], hs[f_dev], local[f_dev]

    def _verify(self, layer: int, fired: list[int], h_fired: torch.Tensor, local: torch.Tensor, prop: Proposal,
                walk: Walk, out: Decisions) -> list[int]:
        """Of the rows `fired` (of h, hidden h_fired [F, D], exit tokens `local` [F]), those whose token is
        verified exit at `layer`: "local" takes the predictors' exit token (greedy); "full" (and
        sampling) samples the full LM head and, greedy, accepts it only among the candidates. Each row by its
        own sampling: a sampled row draws its token from the exit layer's distribution."""
        m, dev = self.model, self.model.device
        hn = m.final_norm(h_fired)  # [F, D]
        js = [walk.running[r] for r in fired]  # as step rows
        greedy = [self.batch.sampling[prop.alive[j]].greedy for j in js]
        local_exit = self.ee.options.verify == "local"
        if local_exit and all(greedy):
            tok, ok, choice = local, [True] * len(fired), local
        else:  # one full LM-head product, only for the rows whose predictor fired
            logits = m.lm_head(hn)
            tok = self.batch.choose(logits, [prop.alive[j] for j in js])
            choice = logits.argmax(-1)
            in_cand = (tok[:, None] == prop.cand[torch.tensor(js, device=dev)]).any(1).tolist()
            ok = [c or not g for c, g in zip(in_cand, greedy)]
            if local_exit:  # greedy rows take their predictor's exit token, as in an all-greedy step
                g_idx = torch.tensor([a for a, g in enumerate(greedy) if g], dtype=torch.int64, device=dev)
                tok[g_idx] = choice[g_idx] = local[g_idx]
                ok = [True if g else o for o, g in zip(ok, greedy)]
        accepted = [a for a, good in enumerate(ok) if good]  # positions in fired
        if not accepted:
            return []
        exits = [fired[a] for a in accepted]  # rows of h
        exiting = torch.tensor([walk.running[r] for r in exits], device=dev)  # as step rows
        a_dev = _index(accepted, len(fired), dev)
        out.tokens[exiting] = tok if a_dev is None else tok[a_dev]
        out.hidden[exiting] = hn if a_dev is None else hn[a_dev]
        out.choice[exiting] = choice if a_dev is None else choice[a_dev]
        for r in exits:
            out.layers[walk.running[r]] = layer
        return exits

    def _leave(self, layer: int, exits: list[int], prop: Proposal, walk: Walk) -> None:
        """The rows `exits` of h exited at `layer`. Skip "row": they leave the walk now; "batch":
        they keep running until every running row has exited, then all leave. Rows that leave
        keep their hidden state for their skipped layers' KV (Pending), and h is compacted to the rest."""
        if not self.compact:
            for r in exits:
                walk.done[walk.running[r]] = True
            if not all(walk.done[j] for j in walk.running):
                return
            exits = list(range(len(walk.running)))  # every row has exited: the batch skips the rest
        self._skipped_kv(layer, exits, prop, walk)
        leaving = set(exits)
        keep = [r for r in range(len(walk.running)) if r not in leaving]
        if not keep:
            walk.running = []
            return
        k_dev = torch.tensor(keep, device=self.model.device)
        walk.h, walk.rope = walk.h[k_dev], (walk.rope[0][k_dev], walk.rope[1][k_dev])
        walk.running = [walk.running[r] for r in keep]
        walk.cache_rows = torch.tensor([prop.alive[j] for j in walk.running], device=self.model.device)

    def _skipped_kv(self, layer: int, exits: list[int], prop: Proposal, walk: Walk) -> None:
        """KV of layers `layer`.. for the leaving rows `exits` of h: their hidden state is kept (Pending) to run
        those layers with the row's next full-depth token."""
        for r in exits:
            b = prop.alive[walk.running[r]]
            self.pending[b].append(Pending(int(self.batch.positions[b]), layer, walk.h[r, 0].clone()))

    def _audit(self, walk: Walk, prop: Proposal, out: Decisions) -> None:
        """An audited step: the rows that exited ran every layer anyway; count, per exit layer,
        whether the full model's argmax is the token their exit chose."""
        audited = [r for r, j in enumerate(walk.running) if walk.done[j]]
        if not audited:
            return
        m, dev = self.model, self.model.device
        js = [walk.running[r] for r in audited]
        full = m.lm_head(m.final_norm(walk.h[torch.tensor(audited, device=dev), 0])).argmax(-1)
        agree = (full == out.choice[torch.tensor(js, device=dev)]).tolist()
        for j, ok in zip(js, agree):
            stats, l = self.rows[prop.alive[j]], out.layers[j]
            stats.audit_exits[l - 1] += 1
            stats.audit_disagree[l - 1] += 0 if ok else 1

    def _full_depth(self, walk: Walk, out: Decisions, alive: list[int]) -> None:
        """The rows that ran every layer get the normal LM head (rows that exited but kept running
        under skip "batch" keep their exit's decision)."""
        m, dev = self.model, self.model.device
        if walk.running:  # exited rows still in the walk (skip "batch", or an audited step)
            still = [r for r, j in enumerate(walk.running) if not walk.done[j]]
            if len(still) < len(walk.running):
                walk.h = walk.h[torch.tensor(still, dtype=torch.long, device=dev)]
                walk.running = [walk.running[r] for r in still]
        if not walk.running:
            return
        hn = m.final_norm(walk.h[:, 0])
        tok = self.batch.choose(m.lm_head(hn), [alive[j] for j in walk.running])
        r_dev = _index(walk.running, len(out.layers), dev)
        if r_dev is None:
            out.tokens, out.hidden = tok, hn
        else:
            out.tokens[r_dev] = tok
            out.hidden[r_dev] = hn

    def _commit(self, prop: Proposal, out: Decisions) -> None:
        """The stepper's own state after a step: each row's feature for the draft head and its online window of exit layers (the engine commits tokens and positions)."""
        if prop.idx is None:
            self.features.copy_(out.hidden)
        else:
            self.features[prop.idx] = out.hidden
        L = self.model.num_layers
        for b, l in zip(prop.alive, out.layers):
            self.exited_last[b] = self.no_chain and l < L
            self.windows[b].push(l)
            if prop.explore:
                self.rows[b].explore_histogram[l - 1] += 1

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
        explore, audit = self.ee.options.explore_every > 0, self.ee.options.audit_fraction > 0
        gate = self.gate
        return {"predictor_calls": r.predictor_calls, "explore_histogram": r.explore_histogram if explore else None,
                "gated_dense_steps": None if gate is None else self.dense_steps,
                "audit_exits": r.audit_exits if audit else None, "audit_disagree": r.audit_disagree if audit else None,
                "draft_time_share": self.t_draft / total, "predictor_time_share": self.t_pred / total,
                "schedule_version": self.ee.schedule.version}
