"""The SpecEE engine: loading, batched prefill and the decode loop (the only place that
advances positions). Dense decoding runs every layer; mode="specee" hands each decode step
to the early-exit stepper (specee_core.early_exit.step)."""
from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from specee_core.model.config import ModelConfig, resolve_dtype
from specee_core.model.loader import find_model_dir, load_model, load_tokenizer
from specee_core.model.model import LlamaModel
from specee_core.decode.plan import (CostTable, Planner, SpecPlan, StepTimes, choose_dtype, cost_key, could_pay,
                                     load_costs)
from specee_core.decode.sampling import SamplingParams, sample
from specee_core.decode.state import Batch
from specee_core.decode.stepper import StepEngine, StepOutput, StepperFactory

log = logging.getLogger(__name__)

MODES = ("auto", "dense", "specee", "spec")


class PromptError(ValueError):
    """A prompt the engine cannot run (wrong type, empty, longer than the context)."""


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop string) | "length"
    exit_layers: list[int]  # per generated token: layers run (1-based); num_layers in dense mode
    prompt_tokens: int
    metrics: dict = field(default_factory=dict)  # ttft_s, tpot_s, e2e_latency_s, tokens_per_s, ...
    stats: dict = field(default_factory=dict)  # early-exit statistics (histogram, average layers, ...)


@dataclass
class EngineOptions:
    max_batch_size: int = 32
    context_len: int | None = None  # default: the model's max_position_embeddings

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")


class SpecEEEngine:
    def __init__(self, model: LlamaModel, tokenizer, options: EngineOptions | None = None, early_exit=None,
                 draft_head=None):
        self.model = model
        self.tokenizer = tokenizer
        self.options = options or EngineOptions()
        self.early_exit = early_exit  # specee_core.early_exit.step.EarlyExit, when draft/predictors are present
        self.draft_head = draft_head  # specee_core.early_exit.speculators.DraftHead, when draft/ is present
        self._draft_runner = None  # its DraftSpeculator for modes spec and auto, built on first use
        self._plans: dict[tuple[int, bool], SpecPlan] = {}  # mode="auto": per (deepest chain, draft head)
        self._costs: CostTable | None = None  # the plans' measured cost table, loaded on first use
        self._step_times = StepTimes()  # what steps really take against that table, learned while decoding
        self.dtype_reason = ""  # why the model's dtype was chosen (from_pretrained with dtype="auto")
        self.weights_reason = ""  # why its weight format was chosen (from_pretrained with weights="auto")
        c = model.config
        self.context_len = self.options.context_len or default_context_len(c)
        eos = set(c.eos_token_id)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_ids = eos
        self._cache_memory = None  # the KV allocation kept between calls
        self._cache = None  # the cache of the last batch (a view of that memory)

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def schedule(self):
        """The active predictor schedule (specee_core.early_exit.scheduler.Schedule), or None without predictors."""
        return None if self.early_exit is None else self.early_exit.schedule

    def with_options(self, **early_exit_options) -> SpecEEEngine:
        """An engine sharing this one's weights with some early-exit options changed
        (threshold, verify, kv_mode, ...: see specee_core.early_exit.step.EarlyExitOptions)."""
        if self.early_exit is None:
            raise ValueError("this engine has no predictors: early-exit options do not apply")
        twin = SpecEEEngine(self.model, self.tokenizer, self.options, self.early_exit.with_options(**early_exit_options),
                            self.draft_head)
        twin.dtype_reason, twin.weights_reason = self.dtype_reason, self.weights_reason
        return twin

    def set_schedule(self, schedule) -> None:
        """Switch to another predictor schedule (the Ray pipeline does this between batches)."""
        if self.early_exit is None:
            raise ValueError("this engine has no predictors: a schedule cannot be set")
        if schedule.num_layers != self.model.num_layers:
            raise ValueError(f"schedule is for {schedule.num_layers} layers, the model has {self.model.num_layers}")
        self.early_exit.schedule = schedule

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str = "cpu", dtype="auto", weights: str = "auto",
                        **options) -> SpecEEEngine:
        """Load the model and tokenizer from a local HF-layout directory, plus the draft head,
        predictors and schedule stored beside it when present. dtype "auto": bf16 where the hardware
        computes it natively (CUDA, CPUs with avx512_bf16/AMX), else fp32 (specee_core.decode.plan.choose_dtype);
        float32 equals transformers token for token. weights (specee_core.model.quant.WEIGHT_FORMATS): "auto"
        (with dtype "auto": the checkpoint's own low-bit format where it has one and its kernel is
        faster here at max_batch_size rows; else the matrices in dtype), "fp32" / "bf16" (sets the
        dtype), "q8" / "q4" (quantized at load; activations in fp32 unless dtype says otherwise).
        options: EngineOptions fields and early-exit options (see specee_core.early_exit.step.EarlyExitOptions)."""
        from specee_core.model.quant import LOW_BIT, WEIGHT_FORMATS, dtype_name
        from specee_core.model.weight_plan import choose_weights

        if weights != "auto" and weights not in WEIGHT_FORMATS:
            raise ValueError(f"weights={weights!r}: expected 'auto' or one of {WEIGHT_FORMATS}")
        engine_opts = {k: options.pop(k) for k in list(options) if k in EngineOptions.__dataclass_fields__}
        reason = weights_reason = ""
        chosen = weights
        if weights in ("fp32", "bf16"):
            want = torch.float32 if weights == "fp32" else torch.bfloat16
            if dtype not in ("auto", None) and resolve_dtype(dtype) != want:
                raise ValueError(f"weights={weights!r} with dtype={dtype!r}: the format is the dtype; pass one")
            dtype, chosen, weights_reason = want, None, f"{weights}: asked for"
        elif weights in LOW_BIT:
            weights_reason = f"{weights}: asked for"
            if dtype == "auto":
                dtype, reason = torch.float32, f"float32: the {weights} kernels compute in fp32"
        if dtype == "auto":
            dtype, reason = choose_dtype(device)
            if weights == "auto":
                batch = EngineOptions(**engine_opts).max_batch_size
                config = ModelConfig.from_file(find_model_dir(path) / "config.json")
                chosen, act, weights_reason = choose_weights(find_model_dir(path), config, torch.device(device),
                                                             dtype, batch)
                if chosen is not None and act != dtype:
                    dtype, reason = act, f"{dtype_name(act)}: the {chosen} kernels were fastest with it"
        elif weights == "auto":
            chosen, weights_reason = None, "the dtype asked for"
        model = load_model(path, device=device, dtype=dtype, weights=chosen)
        tokenizer = load_tokenizer(path)
        from specee_core.early_exit.step import load_draft_head, load_early_exit

        model_dir = find_model_dir(path)
        draft_head = load_draft_head(model_dir, model)
        early_exit = load_early_exit(model_dir, model, tokenizer, draft_head, **options)
        engine = cls(model, tokenizer, EngineOptions(**engine_opts), early_exit, draft_head)
        name = str(model.dtype).removeprefix("torch.")
        engine.dtype_reason = reason or (f"{name}: asked for" if dtype is not None else f"{name}: the loader's default")
        engine.weights_reason = f"{model.weight_format}: {weights_reason}" if weights_reason == "the dtype asked for" \
            else weights_reason
        return engine

    # ---- input checks -----------------------------------------------------------------------
    @property
    def has_chat_template(self) -> bool:
        return getattr(self.tokenizer, "chat_template", None) is not None

    def chat_prompt(self, messages: list[dict]) -> str:
        """The prompt text of a conversation ([{"role", "content"}, ...]) through the tokenizer's chat
        template, ending where the assistant's answer starts. ValueError without a template or when the
        template rejects the messages."""
        if not self.has_chat_template:
            raise ValueError("this model's tokenizer has no chat template: send plain prompts")
        tok = self.tokenizer
        try:
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - jinja raises whatever the template's author wrote
            raise ValueError(f"the chat template rejected the messages: {e}") from None
        # a template that writes BOS itself, then tokenized with BOS added again: keep one
        if self._tokenizer_adds_bos and text.startswith(tok.bos_token):
            text = text[len(tok.bos_token):]
        return text

    @functools.cached_property
    def _tokenizer_adds_bos(self) -> bool:
        tok = self.tokenizer
        return bool(tok.bos_token) and tok("a")["input_ids"][:1] == [tok.bos_token_id]

    def encode_prompt(self, prompt) -> list[int]:
        """Token ids of one prompt; PromptError when it cannot run."""
        if not isinstance(prompt, str):
            raise PromptError(f"prompt must be a string, got {type(prompt).__name__}")
        if not prompt:
            raise PromptError("prompt is empty")
        ids = self.tokenizer(prompt)["input_ids"]
        if len(ids) >= self.context_len:
            raise PromptError(f"prompt has {len(ids)} tokens; the context holds {self.context_len} "
                              f"(prompt plus at least one new token)")
        return ids

    # ---- generation -------------------------------------------------------------------------
    def generate(self, prompts: list[str], max_new_tokens: int = 128, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, stop: list[str] | str | None = None,
                 seed: int | None = None, mode: str = "auto", ignore_eos: bool = False,
                 on_token: Callable[[int, int], None] | None = None, spec: dict | None = None,
                 max_disagreement: float | None = None) -> list[GenerationResult]:
        """Generate a completion for each prompt, in batches of options.max_batch_size.

        mode: "auto" (default; lossless: per step a dense step or speculative decoding, whichever the
        measured plan expects to be faster), "dense", "spec" (speculative decoding with a fixed shape:
        spec options) or "specee" (early exit: lossy, only when asked for).

        on_token(prompt_index, token_id) is called for every generated token as it is chosen
        (streaming); tokens after a stop string are still reported, the final text is cut. An
        exception raised by on_token cancels the call and propagates (the cache is reset per call).

        max_disagreement (mode "specee"): exit thresholds calibrated so that at most this share of
        exited tokens differs from the full model's choice (specee_core.early_exit.calibration); None: the
        engine's own setting."""
        if isinstance(prompts, str):
            raise PromptError("prompts must be a list of strings, got a single string")
        factory, headroom = self.stepper_factory(mode, spec, max_disagreement)
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                top_k=top_k, stop=stop or [], seed=seed,
                                ignore_eos=ignore_eos)
        ids = []
        for i, p in enumerate(prompts):
            try:
                ids.append(self.encode_prompt(p))
            except PromptError as e:
                raise PromptError(f"prompt {i}: {e}") from None
        return self.run(ids, params, factory, on_token, mode=mode, cache_headroom=headroom)

    def weights_info(self) -> dict:
        """The weight format in use, why, and its resident bytes (recorded beside the dtype everywhere)."""
        from specee_core.model.quant import weight_bytes

        return {"weights": self.model.weight_format, "weights_reason": self.weights_reason,
                "weight_mb": round(weight_bytes(self.model.w) / 1e6, 1), "quant_error": self.model.w.quant_error}

    def stepper_factory(self, mode: str = "auto", spec: dict | None = None, max_disagreement: float | None = None):
        """The stepper factory of a mode (None: dense) and the KV slots it needs past a row's last token.
        Raises ValueError for a mode or options this engine cannot run, before any prompt is."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if mode == "specee" and self.early_exit is None:
            raise ValueError("mode='specee' needs predictors and a speculator: none were found beside the model")
        if spec and mode not in ("spec", "auto"):
            raise ValueError(f"spec options apply to mode='spec' or 'auto' only, mode is {mode!r}")
        if max_disagreement is not None and mode != "specee":
            raise ValueError(f"max_disagreement applies to mode='specee' only (the other modes are lossless), "
                             f"mode is {mode!r}")
        if mode == "specee":
            ee = self.early_exit
            if max_disagreement is not None and max_disagreement != ee.options.max_disagreement:
                ee = ee.with_options(max_disagreement=max_disagreement)
            if not ee.exit_layers():  # no layer may exit (tolerance, audit): dense, without draft or predictors
                return None, 0
            return ee.new_stepper, 0
        if mode in ("spec", "auto"):
            return self._spec_factory(spec or {}, planned=mode == "auto")
        return None, 0

    def spec_plan(self, spec: dict | None = None) -> SpecPlan:
        """mode="auto"'s plan (the measured cost table and the limits of its shapes) for spec options
        `spec` (depth: the deepest chain; proposer). Costs are measured when a batch size first needs them
        (prepare_plan measures ahead) and cached per machine, model, dtype, torch version and threads."""
        opts = self._spec_options(spec or {}, planned=True)
        has_draft = self._uses_draft(opts)
        key = (opts.depth, has_draft)
        if key not in self._plans:
            if self._costs is None:  # one table for every plan of this engine: they measure the same forwards
                self._costs = load_costs(cost_key(self.model, self.model.dtype, self.device))
            self._plans[key] = SpecPlan(dtype=str(self.model.dtype).removeprefix("torch."),
                                        dtype_reason=self.dtype_reason, max_depth=opts.depth, has_draft=has_draft,
                                        costs=self._costs, times=self._step_times)
        return self._plans[key]

    def prepare_plan(self, batch_sizes: list[int], spec: dict | None = None) -> SpecPlan:
        """Measure (or load) mode="auto"'s costs for these batch sizes now rather than on the first batch."""
        plan = self.spec_plan(spec)
        for b in batch_sizes:
            plan.ensure(self.model, self._draft_speculator() if plan.has_draft else None, b)
        return plan

    def _spec_options(self, spec: dict, planned: bool):
        from specee_core.spec.spec_decode import SpecOptions

        unknown = set(spec) - set(SpecOptions.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown spec options {sorted(unknown)}: expected {sorted(SpecOptions.__dataclass_fields__)}")
        opts = SpecOptions(**spec)
        if opts.proposer == "draft" and self.draft_head is None:
            raise ValueError("spec proposer 'draft' needs a draft head beside the model (draft/)")
        if planned and (opts.t3 or opts.width > 1):
            raise ValueError("mode='auto' plans chains and stays lossless: t3 and width > 1 need mode='spec'")
        return opts

    def _uses_draft(self, opts) -> bool:
        return opts.proposer == "draft" or (opts.proposer == "auto" and self.draft_head is not None)

    def _draft_speculator(self):
        from specee_core.early_exit.speculators import DraftSpeculator

        if self._draft_runner is None:  # the draft layer's weights, prepared once
            self._draft_runner = DraftSpeculator(self.draft_head, self.model, k=1)
        return self._draft_runner

    def _spec_factory(self, spec: dict, planned: bool):
        """The stepper factory of mode="spec" (options: specee_core.spec.spec_decode.SpecOptions fields) or,
        planned, of mode="auto", and the cache slots a verify chunk may need past a row's last token (rows
        are padded to one width)."""
        from specee_core.spec.spec_decode import DraftHeadProposer, LookupProposer, SpecStepper

        opts = self._spec_options(spec, planned)
        use_draft = self._uses_draft(opts)
        if use_draft:
            self._draft_speculator()
        if not use_draft:
            opts.nodes = opts.depth  # prompt lookup drafts chains
        t3 = None
        if opts.t3:
            if not use_draft or self.early_exit is None:
                raise ValueError("spec option t3 needs a draft head and exit predictors beside the model")
            from specee_core.spec.t3 import T3

            t3 = T3.of(self.early_exit, opts.width)
        plan = self.spec_plan(spec) if planned else None

        def factory(engine, batch, cache, prefill_hidden, lens):
            if planned:
                n = len(batch.prompt_ids)
                plan.ensure(self.model, self._draft_runner if use_draft else None, n)
                if (not use_draft and opts.lookup == "off") or not could_pay(plan.costs, 1, opts.depth, use_draft):
                    return DenseStepper(engine, batch, cache, prefill_hidden, lens)  # nothing could gain: dense
                lookup = None if opts.lookup == "off" else LookupProposer()
                proposer = DraftHeadProposer(self._draft_runner, opts.tree) if use_draft else LookupProposer()
                return SpecStepper(proposer, engine, batch, cache, prefill_hidden, lens, depth=opts.depth,
                                   planner=Planner(plan.costs, n, opts.depth, use_draft, plan.times), lookup=lookup)
            if use_draft:
                lookup = None if opts.lookup == "off" else LookupProposer()
                proposer = DraftHeadProposer(self._draft_runner, opts.tree, lookup, lookup_first=opts.lookup == "first")
            else:
                proposer = LookupProposer()
            return SpecStepper(proposer, engine, batch, cache, prefill_hidden, lens, depth=opts.depth, t3=t3,
                               step_budget=opts.step_budget)

        return factory, opts.nodes + (opts.depth if use_draft and opts.lookup == "merge" else 0) + 1

    def run(self, prompt_ids: list[list[int]], params: SamplingParams, new_stepper: StepperFactory | None = None,
            on_token: Callable[[int, int], None] | None = None, mode: str | None = None,
            cache_headroom: int = 0) -> list[GenerationResult]:
        """Lower-level generate over token ids: new_stepper(engine, batch, cache, prefill_hidden, lens)
        builds the batch's Stepper (specee_core.decode.stepper; None: dense), whose step returns what it
        decided for the alive rows. mode names
        the results' stats["mode"] (default: "dense" without a stepper, else "specee"); cache_headroom:
        KV slots allocated past each batch's longest row."""
        mode = mode or ("dense" if new_stepper is None else "specee")
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        out: list[GenerationResult] = []
        bs = self.options.max_batch_size
        for s in range(0, len(prompt_ids), bs):
            report = None if on_token is None else (lambda b, tok, _s=s: on_token(_s + b, tok))
            out += self._generate_batch(prompt_ids[s : s + bs], params, new_stepper, generator, report, mode,
                                        cache_headroom)
        return out

    def _get_cache(self, batch: int, max_len: int):
        """An empty cache of exactly `batch` rows, on memory kept between calls (grown when too small)."""
        c = self._cache_memory
        if c is None or c.batch < batch or c.max_len < max_len:
            grown = (batch, max_len) if c is None else (max(batch, c.batch), max(max_len, c.max_len))
            self._cache_memory = c = self.model.new_cache(*grown)
        self._cache = c.first_rows(batch)
        return self._cache

    @torch.inference_mode()
    def _generate_batch(self, prompt_ids: list[list[int]], params: SamplingParams, new_stepper: StepperFactory | None,
                        generator: torch.Generator | None, on_token=None, mode: str = "dense",
                        cache_headroom: int = 0) -> list[GenerationResult]:
        t0 = time.perf_counter()
        model, dev = self.model, self.device
        n = len(prompt_ids)
        lens = torch.tensor([len(p) for p in prompt_ids])
        max_new = [min(params.max_new_tokens, self.context_len - len(p)) for p in prompt_ids]
        cache = self._get_cache(n, int(max(len(p) + m for p, m in zip(prompt_ids, max_new))) + cache_headroom)

        # prefill: right-padded, every layer, never early exit
        t_max = int(lens.max())
        tokens = torch.zeros(n, t_max, dtype=torch.int64)
        for b, p in enumerate(prompt_ids):
            tokens[b, : len(p)] = torch.tensor(p)
        positions = torch.arange(t_max).expand(n, t_max)
        h = model.forward(tokens.to(dev), positions.to(dev), cache, n_valid=lens)
        last = h[torch.arange(n, device=dev), (lens - 1).to(dev)]  # [B, D]
        first = sample(model.logits(last), params, generator)

        batch = Batch(prompt_ids=prompt_ids, params=params, max_new=max_new, generated=[[] for _ in range(n)],
                      exit_layers=[[] for _ in range(n)], finish=[None] * n, texts=[None] * n,
                      positions=lens.clone(), next_tokens=first, last_hidden=last, t_done=[0.0] * n,
                      on_token=on_token, mode=mode)
        stepper = (new_stepper or DenseStepper)(self, batch, cache, h, lens)
        del h
        batch.t_first = time.perf_counter()
        self._record(batch, list(range(n)), [[t] for t in first.tolist()], [[model.num_layers]] * n)

        while alive := batch.alive():
            rows = torch.tensor(alive, device=dev) if (len(alive) < cache.batch) else None
            self._commit(batch, alive, rows, stepper.step(alive, rows, generator))
        return [self._result(batch, b, t0, stepper) for b in range(n)]

    def _commit(self, batch: Batch, alive: list[int], rows: torch.Tensor | None, out: StepOutput) -> None:
        """Take a step's decisions into the batch: each row's last token is fed next (with its hidden
        state), its tokens are recorded."""
        last = torch.tensor([block[-1] for block in out.tokens], device=self.device)
        if rows is None:  # every row of the cache is alive
            batch.next_tokens.copy_(last)
            if out.hidden is not None:
                batch.last_hidden.copy_(out.hidden)
        else:
            batch.next_tokens[rows] = last
            if out.hidden is not None:
                batch.last_hidden[rows] = out.hidden
        self._record(batch, alive, out.tokens, out.layers)

    def _record(self, batch: Batch, alive: list[int], toks: list[list[int]], layers: list[list[int]]) -> None:
        """Append each alive row's new tokens (one, or a verified block), advance positions, and settle
        finished rows: no token after a row's stop (EOS, stop string, max_new) is kept."""
        now = time.perf_counter()
        for b, block, block_layers in zip(alive, toks, layers):
            for tok, layer in zip(block, block_layers):
                if batch.finish[b] is None:
                    self._record_one(batch, b, tok, layer, now)

    def _record_one(self, batch: Batch, b: int, tok: int, layer: int, now: float) -> None:
        """Append one token to row b, advance its position, and settle the row if it finished."""
        batch.generated[b].append(tok)
        if batch.on_token is not None:
            batch.on_token(b, tok)
        batch.exit_layers[b].append(layer)
        # the token just chosen is fed next, right after the prompt and the tokens before it: the
        # prefill's token goes in at position len(prompt), not one past it
        batch.positions[b] = len(batch.prompt_ids[b]) + len(batch.generated[b]) - 1
        if tok in self.eos_ids and not batch.params.ignore_eos:
            batch.finish[b] = "stop"
        elif batch.stop_matchers[b].stops:
            # the whole id list is decoded (a character split across tokens comes out right); only
            # the new tail is searched
            text = self.tokenizer.decode(batch.generated[b], skip_special_tokens=True)
            cut = batch.stop_matchers[b].update(text)
            if cut >= 0:
                batch.texts[b] = text[:cut]
                batch.finish[b] = "stop"
        if batch.finish[b] is None and len(batch.generated[b]) >= batch.max_new[b]:
            batch.finish[b] = "length"
        if batch.finish[b] is not None:
            batch.t_done[b] = now

    def _result(self, batch: Batch, b: int, t0: float, stepper, t_first: float | None = None) -> GenerationResult:
        """Row b's result; t0: when its work started, t_first: when its first token came (default: the batch's)."""
        ids = batch.generated[b]
        text = batch.texts[b] if batch.texts[b] is not None else self.tokenizer.decode(ids, skip_special_tokens=True)
        n_tok = len(ids)
        t_first = batch.t_first if t_first is None else t_first
        ttft = t_first - t0
        e2e = batch.t_done[b] - t0
        decode_s = batch.t_done[b] - t_first
        metrics = {
            "ttft_s": ttft,
            "tpot_s": decode_s / max(n_tok - 1, 1),  # mean inter-token latency after the first token
            "e2e_latency_s": e2e,
            "tokens_per_s": n_tok / e2e if e2e > 0 else 0.0,
            "decode_tokens_per_s": (n_tok - 1) / decode_s if decode_s > 0 else 0.0,
        }
        layers = batch.exit_layers[b]
        stats = exit_stats(layers, self.model.num_layers)
        stats["mode"] = batch.mode
        stats.update(stepper.row_stats(b))
        # what the scheduler's update rule should consume: unbiased exploration exits when taken
        stats["retune_histogram"] = stats.get("explore_histogram") or stats["exit_histogram"]
        return GenerationResult(text=text, token_ids=ids, finish_reason=batch.finish[b], exit_layers=layers,
                                prompt_tokens=len(batch.prompt_ids[b]), metrics=metrics, stats=stats)


def default_context_len(c: ModelConfig) -> int:
    """max_position_embeddings, stretched by the factor of dynamic (NTK) RoPE, which extrapolates."""
    if c.rope_type == "dynamic":
        return int(c.max_position_embeddings * c.rope_scaling["factor"])
    return c.max_position_embeddings


def exit_stats(exit_layers: list[int], num_layers: int) -> dict:
    """Histogram (index = layers run, 1..L) and average layers of one request's tokens."""
    hist = [0] * (num_layers + 1)
    for l in exit_layers:
        hist[l] += 1
    n = max(len(exit_layers), 1)
    avg = sum(exit_layers) / n
    return {"exit_histogram": hist[1:], "avg_layers": avg, "layer_fraction": avg / num_layers}

class DenseStepper:
    """mode="dense": one token per row per step through every layer."""

    def __init__(self, engine: StepEngine, batch: Batch, cache, prefill_hidden: torch.Tensor, lens: torch.Tensor):
        self.model, self.batch, self.cache = engine.model, batch, cache

    def step(self, alive: list[int], rows: torch.Tensor | None, generator) -> StepOutput:
        batch, m = self.batch, self.model
        if rows is None:  # every row of the cache is alive: no gathers
            fed, positions = batch.next_tokens, batch.positions
        else:
            fed, positions = batch.next_tokens[rows], batch.positions[torch.tensor(alive)]
        h = m.forward(fed.unsqueeze(1), positions.unsqueeze(1).to(m.device), self.cache, rows)[:, 0]  # [N, D]
        toks = sample(m.logits(h), batch.params, generator)
        return StepOutput([[t] for t in toks.tolist()], [[m.num_layers]] * len(alive), h)

    def row_stats(self, b: int) -> dict:
        return {}

    def admit(self, rows: list[int], prefill_hidden: torch.Tensor, lens: torch.Tensor) -> None:
        pass  # no per-row state
