"""The SpecEE engine: loading, the modes and their options, and generate(), which hands its prompts to
the engine's one core (specee_core.decode.core: the scheduler and decode loop shared with the batch job
and Serve) and drains the results. Dense decoding runs every layer; mode="specee" hands each decode step
to the early-exit stepper (specee_core.early_exit.step)."""
from __future__ import annotations

import functools
import logging
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Callable

import torch

from specee_core.model.config import ModelConfig, resolve_dtype
from specee_core.model.kv_cache import window_slots
from specee_core.model.loader import find_model_dir, load_model, load_tokenizer
from specee_core.model.model import DecoderModel
from specee_core.machine import choose_dtype
from specee_core.options import EngineOptions
from specee_core.spec.costs import CostTable, cost_key, load_costs
from specee_core.spec.plan import Planner, SpecPlan, could_pay
from specee_core.step.policy import StepPolicy
from specee_core.decode.core import EngineCore
from specee_core.decode.request import Request
from specee_core.decode.runner import Runner
from specee_core.decode.dense import DenseStepper
from specee_core.decode.memory import default_kv_bytes
from specee_core.step.sampling import SamplingParams
from specee_core.step.state import GenerationResult, PromptError, TextRules
from specee_core.step.stepper import StepperFactory

log = logging.getLogger(__name__)

MODES = ("auto", "dense", "specee", "spec")


class SpecEEEngine:
    def __init__(self, model: DecoderModel, tokenizer, options: EngineOptions | None = None, early_exit=None,
                 draft=None):
        self.model = model
        self.tokenizer = tokenizer
        self.options = options or EngineOptions()
        self.early_exit = early_exit  # specee_core.early_exit.step.EarlyExit, when draft/predictors are present
        self.draft = draft  # specee_core.draft.head.DraftModel, when draft/ is present: every mode's draft head
        self._plans: dict[tuple[int, bool], SpecPlan] = {}  # mode="auto": per (deepest chain, draft head)
        self._costs: CostTable | None = None  # the plans' measured cost table, loaded on first use
        # what its steps really cost, learned while decoding: the drafting rule's and the early-exit gate's
        self.policy = StepPolicy()
        self.dtype_reason = ""  # why the model's dtype was chosen (from_pretrained with dtype="auto")
        self.weights_reason = ""  # why its weight format was chosen (from_pretrained with weights="auto")
        c = model.config
        self.context_len = self.options.context_len or default_context_len(c)
        eos = set(c.eos_token_id)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.rules = TextRules(frozenset(eos), self._decode, model.num_layers, self._grammar_tokenizer)
        self._core: EngineCore | None = None
        self._runner: Runner | None = None
        self._runner_lock = threading.Lock()

    @property
    def eos_ids(self) -> frozenset[int]:
        """The ids that end a row (the config's and the tokenizer's EOS)."""
        return self.rules.eos_ids

    @eos_ids.setter
    def eos_ids(self, ids) -> None:
        self.rules.eos_ids = frozenset(ids)  # every lane's Batch reads this one object

    @functools.cache  # noqa: B019 -- one per engine, for its life
    def _grammar_tokenizer(self):
        """The tokenizer as llguidance reads it (structured output): built once, on first use (~0.6 s)."""
        from llguidance.hf import from_tokenizer

        return from_tokenizer(self.tokenizer, n_vocab=self.config.vocab_size)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def slot_bytes(self) -> int:
        """KV bytes of one token slot of one row: every layer's keys and values, the draft head's layer,
        and a hidden state (what the prefix cache keeps beside the KV)."""
        c, m = self.config, self.model
        layers = m.num_layers + (1 if self.draft is not None else 0)
        return layers * self._kv_bytes() + c.hidden_size * torch.empty((), dtype=m.dtype).element_size()

    def _kv_bytes(self) -> int:
        """A layer's keys and values for one token."""
        c = self.config
        return 2 * c.num_key_value_heads * c.head_dim * torch.empty((), dtype=self.model.kv_dtype).element_size()

    def row_bytes(self, slots: int, room: int) -> int:
        """KV bytes a row of `slots` slots holds: slot_bytes() a slot, less the slots the sliding-window layers do not
        keep (KVCache: their window plus room)."""
        windows = self.model.windows
        dropped = (slots - window_slots(windows, slots, room)) * sum(1 for w in windows if w)
        return slots * self.slot_bytes() - dropped * self._kv_bytes()

    @property
    def core(self) -> EngineCore:
        """The engine core every generation runs on (made on first use; its KV budget from the options)."""
        if self._core is None:
            o = self.options
            kv = (int(o.kv_cache_gb * 2**30) if o.kv_cache_gb is not None
                  else default_kv_bytes(self.device, o.engines_per_node))
            self._core = EngineCore(self, max_rows=o.max_batch_size, prefill_chunk=o.prefill_chunk, kv_bytes=kv,
                                    block_size=o.kv_block_size, prefix_cache=o.prefix_cache,
                                    min_lane_rows=o.min_lane_rows)
            log.info("engine core: %d rows, KV budget %s", o.max_batch_size, self._core.budget.report())
        return self._core

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
        (threshold, verify, skip, ...: see specee_core.early_exit.options.EarlyExitOptions)."""
        if self.early_exit is None:
            raise ValueError("this engine has no predictors: early-exit options do not apply")
        twin = SpecEEEngine(self.model, self.tokenizer, self.options, self.early_exit.with_options(**early_exit_options),
                            self.draft)
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
        computes it natively (CUDA, CPUs with avx512_bf16/AMX), else fp32 (specee_core.machine.choose_dtype);
        float32 equals transformers token for token. weights (specee_core.model.quant.WEIGHT_FORMATS): "auto"
        (with dtype "auto": the checkpoint's own low-bit format where it has one and its kernel is
        faster here at max_batch_size rows, or at one row when max_batch_size is not given; else the
        matrices in dtype), "fp32" / "bf16" (sets the
        dtype), "q8" / "q4" (quantized at load; activations in fp32 unless dtype says otherwise), "q8a8" /
        "q4a8" (the same, the linears' activations quantized to int8 per block: llama.cpp's arithmetic), "gguf"
        (a GGUF file's matrices in its own formats: Q4_K, Q6_K, Q5_0 ... blocks as stored, fp32 activations).
        options: EngineOptions fields and early-exit options (see specee_core.early_exit.options.EarlyExitOptions)."""
        from specee_core.model.quant import ACT8, LOW_BIT, NATIVE, WEIGHT_FORMATS, dtype_name, holds_bf16
        from specee_core.model.weight_plan import choose_weights

        if weights != "auto" and weights not in WEIGHT_FORMATS:
            raise ValueError(f"weights={weights!r}: expected 'auto' or one of {WEIGHT_FORMATS}")
        engine_opts = {k: options.pop(k) for k in list(options) if k in EngineOptions.__dataclass_fields__}
        reason = weights_reason = ""
        chosen, hold, held_head = weights, False, False
        if weights in ("fp32", "bf16"):
            want = torch.float32 if weights == "fp32" else torch.bfloat16
            if dtype not in ("auto", None) and resolve_dtype(dtype) != want:
                raise ValueError(f"weights={weights!r} with dtype={dtype!r}: the format is the dtype; pass one")
            dtype, chosen, weights_reason = want, None, f"{weights}: asked for"
        elif weights in LOW_BIT or weights in ACT8 or weights == NATIVE:
            weights_reason = f"{weights}: asked for"
            if dtype == "auto":
                dtype, reason = torch.float32, f"float32: the {weights} kernels compute in fp32"
        if dtype == "auto":
            dtype, reason = choose_dtype(device)
            if weights == "auto":
                # the format is chosen for the batch size the engine is built for: max_batch_size when given
                # (a job's, Serve's), else one row: an engine built with every default serves one request at a time
                batch = engine_opts.get("max_batch_size", 1)
                config = ModelConfig.from_file(find_model_dir(path) / "config.json")
                chosen, act, held_head, weights_reason = choose_weights(find_model_dir(path), config,
                                                                        torch.device(device), dtype, batch)
                if chosen is not None and act != dtype:
                    hold = holds_bf16(dtype)
                    dtype, reason = act, f"{dtype_name(act)}: the {chosen} kernels were fastest with it"
        elif weights == "auto":
            chosen, weights_reason = None, "the dtype asked for"
        model = load_model(path, device=device, dtype=dtype, weights=chosen)
        if hold:  # (choose_weights picks low-bit weights on CPU only)
            mb = model.hold_for_prefill() / 1e6
            weights_reason += f"; prefill through bf16 copies of its matrices ({mb:.0f} MB; the dtype auto chose bf16)"
        if held_head:
            before = model.held_bytes
            mb = (model.hold_head() - before) / 1e6
            weights_reason += f"; the LM head through a bf16 copy ({mb:.0f} MB)"
        tokenizer = load_tokenizer(path)
        from specee_core.draft.head import DraftModel
        from specee_core.early_exit.step import load_draft_head, load_early_exit

        model_dir = find_model_dir(path)
        head = load_draft_head(model_dir, model)
        draft = None if head is None else DraftModel(head, model)
        early_exit = load_early_exit(model_dir, model, tokenizer, draft, **options)
        engine = cls(model, tokenizer, EngineOptions(**engine_opts), early_exit, draft)
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
                 max_disagreement: float | None = None,
                 sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[GenerationResult]:
        """Generate a completion for each prompt: they are queued on the engine core, which decodes up
        to options.max_batch_size of them at once (a row that finishes makes room for the next prompt).

        sampling_params (as vLLM's LLM.generate takes them): one SamplingParams for every prompt or one per
        prompt, in place of the keyword arguments max_new_tokens .. ignore_eos. Prompts of any parameters
        share decode steps (each row samples by its own).

        mode: "auto" (default; lossless: per step a dense step or speculative decoding, whichever the
        measured plan expects to be faster), "dense", "spec" (speculative decoding with a fixed shape:
        spec options) or "specee" (early exit: lossy, only when asked for).

        on_token(prompt_index, token_id) is called for every generated token as it is chosen (streaming;
        with a third argument, the token's logprob entry, when the sampling parameters ask for logprobs);
        tokens after a stop string are still reported, the final text is cut. An exception raised by
        on_token cancels the call and propagates.

        max_disagreement (mode "specee"): exit thresholds calibrated so that at most this share of
        exited tokens differs from the full model's choice (specee_core.early_exit.calibration); None: the
        engine's own setting."""
        requests, order = self._requests(prompts, max_new_tokens, temperature, top_p, top_k, stop, seed, mode,
                                         ignore_eos, on_token, spec, max_disagreement, sampling_params)
        return _in_order(len(prompts), order, self.core.run_all(requests))

    def submit(self, prompts: list[str], mode: str = "auto", spec: dict | None = None,
               max_disagreement: float | None = None,
               sampling_params: SamplingParams | list[SamplingParams] | None = None,
               on_token: Callable[[int, int], None] | None = None, priority: int = 0) -> Future:
        """generate without waiting (any thread): the prompts join the rows the engine core is decoding now,
        on its own thread (specee_core.decode.runner.Runner), and the Future's result is their
        GenerationResults in prompt order, or the first error of one. Calls made while others run share
        their decode steps; free rows go to the calls of the lowest priority first (then one row per call in
        turn). Bad prompts or options raise here, before anything is queued."""
        requests, order = self._requests(prompts, 128, 0.0, 1.0, 0, None, None, mode, False, on_token, spec,
                                         max_disagreement, sampling_params or SamplingParams())
        for r in requests:
            r.priority = priority
        futures = []
        try:
            for r in requests:
                futures.append(self.runner.submit(r))  # raises for a request that cannot run
        except BaseException:
            for r in requests[:len(futures)]:
                r.cancel()  # the call raised: none of its prompts stays queued
            raise
        out: Future = Future()
        left = [len(futures)]
        lock = threading.Lock()

        def one_done(_: Future) -> None:
            with lock:
                left[0] -= 1
                if left[0]:
                    return
            failed = next((f.exception() for f in futures if f.exception() is not None), None)
            if failed is not None:
                out.set_exception(failed)
            else:
                out.set_result(_in_order(len(prompts), order, [f.result() for f in futures]))

        for f in futures:
            f.add_done_callback(one_done)
        return out

    @property
    def runner(self) -> Runner:
        """The engine core stepping on its own thread (made on first use): what submit queues on."""
        with self._runner_lock:
            if self._runner is None:
                self._runner = Runner(self.core)
            return self._runner

    def _requests(self, prompts, max_new_tokens, temperature, top_p, top_k, stop, seed, mode, ignore_eos, on_token,
                  spec, max_disagreement, sampling_params) -> tuple[list[Request], list[list[int]]]:
        """generate's arguments as engine-core Requests (one per distinct SamplingParams; rows of every
        request share decode steps) and, per request, the prompt indices it holds."""
        if isinstance(prompts, str):
            raise PromptError("prompts must be a list of strings, got a single string")
        self.stepper_factory(mode, spec, max_disagreement)  # a mode or options it cannot run fail before any prompt
        if sampling_params is None:
            sampling_params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                             top_k=top_k, stop=stop or [], seed=seed, ignore_eos=ignore_eos)
        per_prompt = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(per_prompt) != len(prompts) or not all(isinstance(p, SamplingParams) for p in per_prompt):
            raise ValueError(f"sampling_params must be a SamplingParams or a list of one per prompt "
                             f"({len(prompts)}), got {sampling_params!r:.200}")
        ids = []
        for i, p in enumerate(prompts):
            try:
                ids.append(self.encode_prompt(p))
            except PromptError as e:
                raise PromptError(f"prompt {i}: {e}") from None
        groups: dict[str, list[int]] = {}  # equal parameters (their repr) -> prompt indices
        for i, p in enumerate(per_prompt):
            groups.setdefault(repr(p), []).append(i)
        requests = []
        for members in groups.values():
            hook = None if on_token is None else (lambda j, tok, *entry, m=members: on_token(m[j], tok, *entry))
            requests.append(Request([ids[i] for i in members], per_prompt[members[0]], mode, spec=spec,
                                    max_disagreement=max_disagreement, on_token=hook))
        return requests, list(groups.values())

    def weights_info(self) -> dict:
        """The weight format in use, why, and its resident bytes (recorded beside the dtype everywhere)."""
        from specee_core.model.quant import weight_bytes

        return {"weights": self.model.weight_format, "weights_reason": self.weights_reason,
                "weight_mb": round((weight_bytes(self.model.w) + self.model.held_bytes) / 1e6, 1),
                "quant_error": self.model.w.quant_error}

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
                                        costs=self._costs, times=self.policy)
        return self._plans[key]

    def prepare_plan(self, batch_sizes: list[int], spec: dict | None = None) -> SpecPlan:
        """Measure (or load) mode="auto"'s costs for these batch sizes now rather than on the first batch."""
        plan = self.spec_plan(spec)
        for b in batch_sizes:
            plan.ensure(self.model, self.draft if plan.has_draft else None, b)
        return plan

    def _spec_options(self, spec: dict, planned: bool):
        from specee_core.spec.spec_decode import SpecOptions

        unknown = set(spec) - set(SpecOptions.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown spec options {sorted(unknown)}: expected {sorted(SpecOptions.__dataclass_fields__)}")
        opts = SpecOptions(**spec)
        if opts.proposer == "draft" and self.draft is None:
            raise ValueError("spec proposer 'draft' needs a draft head beside the model (draft/)")
        if planned and (opts.t3 or opts.width > 1):
            raise ValueError("mode='auto' plans chains and stays lossless: t3 and width > 1 need mode='spec'")
        return opts

    def _uses_draft(self, opts) -> bool:
        return opts.proposer == "draft" or (opts.proposer == "auto" and self.draft is not None)

    def _spec_factory(self, spec: dict, planned: bool):
        """The stepper factory of mode="spec" (options: specee_core.spec.spec_decode.SpecOptions fields) or,
        planned, of mode="auto", and the cache slots a verify chunk may need past a row's last token (rows
        are padded to one width)."""
        from specee_core.spec.spec_decode import SpecStepper

        opts = self._spec_options(spec, planned)
        use_draft = self._uses_draft(opts)
        draft = self.draft if use_draft else None
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
            if not planned:
                return SpecStepper(draft, opts, engine, batch, cache, prefill_hidden, lens, t3=t3)
            n = batch.size
            plan.ensure(self.model, draft, n)
            if (not use_draft and opts.lookup == "off") or not could_pay(plan.costs, 1, opts.depth, use_draft):
                return DenseStepper(engine, batch, cache, prefill_hidden, lens)  # nothing could gain: dense
            return SpecStepper(draft, opts, engine, batch, cache, prefill_hidden, lens,
                               planner=Planner(plan.costs, n, opts.depth, use_draft, plan.times))

        verify = opts.nodes + (opts.depth if use_draft and opts.lookup == "merge" else 0)
        # the draft head's expansion writes `width` nodes per level below the root into its cache, every row to
        # the batch's deepest level (a row at its last token too): more than a verify chunk when width is wide
        drafted = (opts.depth - 1) * opts.width if use_draft else 0
        return factory, max(verify, drafted) + 1

    def run(self, prompt_ids: list[list[int]], params: SamplingParams, new_stepper: StepperFactory | None = None,
            on_token: Callable[[int, int], None] | None = None, mode: str | None = None,
            cache_headroom: int = 0, spec: dict | None = None,
            max_disagreement: float | None = None) -> list[GenerationResult]:
        """Lower-level generate over token ids, through the engine core. Without new_stepper: the mode's
        own decode step (mode, spec, max_disagreement as in generate). With it: new_stepper(engine, batch,
        cache, prefill_hidden, lens) builds a custom Stepper (specee_core.step.stepper; measurement
        probes) that needs cache_headroom KV slots past a row's last token; mode then only names the
        results' stats["mode"] (default "specee")."""
        custom = None if new_stepper is None else (new_stepper, cache_headroom)
        mode = mode or ("auto" if new_stepper is None else "specee")
        request = Request([list(p) for p in prompt_ids], params, mode, spec=spec, max_disagreement=max_disagreement,
                          on_token=on_token, stepper=custom)
        return self.core.run(request)


def _in_order(n: int, order: list[list[int]], got: list[list[GenerationResult]]) -> list[GenerationResult]:
    """Per-request results back in prompt order (order[r]: the prompt indices of request r)."""
    results: list[GenerationResult | None] = [None] * n
    for members, res in zip(order, got):
        for i, r in zip(members, res):
            results[i] = r
    return results

def default_context_len(c: ModelConfig) -> int:
    """max_position_embeddings, stretched by the factor of dynamic (NTK) RoPE, which extrapolates."""
    if c.rope_type == "dynamic":
        return int(c.max_position_embeddings * c.rope_scaling["factor"])
    return c.max_position_embeddings
