"""Ray Serve app: an OpenAI-compatible HTTP endpoint around one SpecEEEngine per replica.

    serve run pipeline.serve:app                                   # SmolLM2 (make model); model=DIR or SPECEE_MODEL=...
    serve deploy serve_config.yaml

Routes: POST /v1/completions, POST /v1/chat/completions (when the tokenizer has a chat template),
GET /v1/models, GET /metrics (this replica's engine metrics in Prometheus' text format; Ray's metrics
port has them over all replicas), GET /health (200 {"status": "ok"} or 503: for probes and load
balancers), GET /healthz (the same status with what runs and why: dtype, machine, plan, KV memory).

Replicas: a GPU each when `device` is cuda (`num_gpus` to change it), `num_cpus`, and a fixed
`num_replicas` or autoscaling (`num_replicas=auto`, `min_replicas`, `max_replicas`,
`target_ongoing_requests`): deployment_options().

Batching: every request, streaming or not, runs through the engine's one core
(specee_core.decode.core, the same scheduler and decode loop as SpecEEEngine.generate and the batch
job): prompts join the running batch at decode-step boundaries, leave it when they finish, get free
rows in turn per request (a 1000-prompt request does not starve a 1-prompt one), long prompts are
prefilled in chunks between decode steps, and a prompt waits for its KV blocks in the engine's budget
(`engine_options` kv_cache_gb; prompt blocks already computed come from the prefix cache and are
reported as usage.prompt_tokens_details.cached_tokens). The core runs on one thread of its own (it
is not thread-safe), and JSON parsing, chat templating and tokenization run on a small pool of other
threads, so the event loop stays free to accept requests and answer /healthz.

Limits, each a 4xx with an OpenAI-style error body (ServeArgs): body size (413), JSON nesting depth,
prompts per request, characters per prompt before tokenizing, tokens per request, stop strings'
count and length, a structured-output constraint's size and compile time (400), requests waiting beyond
the running batch (429 with Retry-After: Serve hands a replica more requests than it admits), and with
`api_keys` set, a missing or wrong `Authorization: Bearer` on /v1 and /metrics (401; /health stays open,
/healthz answers only its status, /docs, /redoc and /openapi.json are off).

Unknown request fields are ignored (bounded log lines, kept nowhere); known OpenAI parameters that would
change the answer and are not implemented are a 400. /openapi.json publishes both request bodies' schemas.

Closed unless opened: when Serve's HTTP host (http_options.host) is not loopback and no API keys are set,
the builder and each replica refuse to start, unless allow_open=True (then they log a warning)."""
import asyncio
import json
import logging
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve import Application
from starlette.exceptions import HTTPException as StarletteHTTPException

from specee_core import PromptError, SpecEEEngine
from specee_core.decode.request import Request as EngineRequest
from specee_core.decode.runner import Runner
from specee_core.machine import machine_facts
from specee_core.step.sampling import SamplingParams
from specee_core.step.stops import cut_at_stop
from pipeline.openai_protocol import (APIError, ChatCompletionRequest, CompletionRequest, chat_chunk,
                                      chat_logprobs, chat_response, completion_chunk, completion_logprobs,
                                      completion_response, error_body, new_id, parse_body, request_body,
                                      specee_summary, sse, usage, usage_chunk)
from pipeline.serve_access import bearer_ok, check_exposure, serve_http_host
from pipeline.serve_args import ServeArgs, deployment_options, node_resources, replicas_per_node
from pipeline.serve_http import EventStream, engine_error, hung_up, read_body, request_id, rss_mb
from pipeline.serve_metrics import PROMETHEUS_TEXT, EngineMetrics
from pipeline.serve_requests import Admission, Submitted, Ticket, Work, pick_mode, sampling_params
from pipeline.stream_text import StreamText

# under ray.serve: Serve's replica log handler (file and console, with the request id) takes these too
log = logging.getLogger("ray.serve.specee")

INLINE_PARSE_BYTES = 64 << 10  # bodies up to this are parsed on the event loop, larger ones on a thread
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class _StreamCancelled(Exception):
    """Raised from on_token inside the engine thread to stop generating for a gone client."""


# openapi_url None: FastAPI adds no docs pages of its own; the replica serves them, off with api_keys set
# (docs_url stays the path Serve reports for them)
api = FastAPI(title="SpecEE OpenAI-compatible server", openapi_url=None)


@api.exception_handler(APIError)
async def _api_error(request: Request, e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


@api.exception_handler(RequestValidationError)
async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
    err = e.errors()[0] if e.errors() else {}
    param = ".".join(str(p) for p in err.get("loc", ())[1:]) or None
    return JSONResponse(error_body(f"{param}: {err.get('msg', 'invalid request')}", param=param), status_code=400)


@api.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
    msg = {404: f"unknown path {request.url.path}", 405: f"method {request.method} not allowed on {request.url.path}"}
    return JSONResponse(error_body(msg.get(e.status_code, str(e.detail)), code=str(e.status_code)),
                        status_code=e.status_code)


CLIENT_CLOSED = 499  # nginx's status for a request whose client hung up; nobody receives it


@api.exception_handler(Exception)
async def _server_error(request: Request, e: Exception) -> JSONResponse:
    if hung_up(e):
        log.info("request %s on %s: the client hung up", request_id(request), request.url.path)
        return JSONResponse(error_body("client closed the request", code="client_closed"), status_code=CLIENT_CLOSED)
    log.exception("unhandled error on %s (request %s)", request.url.path, request_id(request))
    return JSONResponse(error_body("internal server error", type="server_error"), status_code=500)


# (functions the replica calls are defined above it: Serve pickles the class by value where it is decorated)
@serve.deployment(max_queued_requests=256, health_check_period_s=5,
                  health_check_timeout_s=30, graceful_shutdown_timeout_s=30)
@serve.ingress(api)
class SpecEEServer:
    """One replica: loads the engine once, batches requests into it, answers in OpenAI's format."""

    def __init__(self, args: ServeArgs):
        # first, before the model loads (Serve retries a constructor that fails)
        host = serve_http_host()
        check_exposure(host, has_keys=bool(args.api_keys), allow_open=args.allow_open)
        # the default KV budget is a share of the node's free memory: one share for all the replicas it can hold
        options = args.engine(engines_per_node=replicas_per_node(args, *node_resources()))
        self.engine = SpecEEEngine.from_pretrained(args.model, device=args.device, dtype=args.dtype,
                                                   weights=args.weights, **vars(options), **args.early_exit_options())
        self.model_name = args.model_name or Path(args.model).name
        try:
            self.mode = self._pick_mode(args.mode)
        except ValueError as e:
            raise ValueError(f"{args.model}: {e}") from None
        self.max_batch_size = args.max_batch_size
        self.max_tokens_limit = args.max_tokens_limit or self.engine.context_len - 1
        tok = self.engine.tokenizer
        self.chat_template = getattr(tok, "chat_template", None)
        self._runner = Runner(self.engine.core, args.stall_timeout_s)
        # JSON parsing, chat templates and tokenization of big inputs: off the event loop, beside the engine
        self._cpu = ThreadPoolExecutor(max_workers=2, thread_name_prefix="specee-requests")
        self.args = args
        self._api_keys = [k.encode() for k in args.api_keys]
        self._admission = Admission(args.max_batch_size, args.max_queued_requests)
        self.replica_id = serve.get_replica_context().replica_id.to_full_id_str()  # = its actor's name
        self.metrics = EngineMetrics(self.model_name, self.engine.model.num_layers, args.max_batch_size,
                                     replica=self.replica_id)
        self.engine.generate(["Hello"], max_new_tokens=1, mode=self.mode)  # warm up; fail here, not on a request
        for mode in {"spec", "auto", self.mode}:  # build what each mode drafts with now, not on a request's thread
            self.engine.stepper_factory(mode)
        if self.mode == "auto":  # its costs, measured (or read from the cache) now, not on a request
            self.engine.prepare_plan([args.max_batch_size])
        # and the batching thread
        self._runner.submit(EngineRequest([self.engine.encode_prompt("Hello")], SamplingParams(max_new_tokens=2),
                                          self.mode)).result(timeout=600)
        log.info("serving %s as %r, mode=%s, context=%d, chat=%s, on host %s, api keys: %d", args.model,
                 self.model_name, self.mode, self.engine.context_len, self.chat_template is not None, host,
                 len(self._api_keys))

    # ---- health -------------------------------------------------------------------------------
    def check_health(self) -> None:
        """Called by Serve every health_check_period_s; raising makes Serve replace this replica."""
        self._runner.check()
        self._record_load()

    def _record_load(self) -> None:
        self.metrics.load(*self._runner.core.load)
        self.metrics.memory(self._runner.core.memory())

    def _unhealthy(self) -> JSONResponse | None:
        """The 503 both health routes answer when the engine is not healthy, else None."""
        try:
            self.check_health()
        except RuntimeError as e:  # the reason is the server's: logged, not answered
            log.warning("health check failed: %s", e)
            return JSONResponse({"status": "unhealthy"}, status_code=503)
        return None

    @api.get("/health")
    async def health(self) -> JSONResponse:
        """For probes and load balancers: {"status": "ok"} or the 503; no API key needed."""
        bad = self._unhealthy()
        return bad if bad is not None else JSONResponse({"status": "ok"})

    @api.get("/healthz")
    async def healthz(self, request: Request) -> JSONResponse:
        """The status, and what runs and why; with api_keys set, the latter only for a valid key."""
        if (bad := self._unhealthy()) is not None:
            return bad
        if not self._authorized(request):
            return JSONResponse({"status": "ok"})
        plan = self.engine.spec_plan()
        return JSONResponse({"status": "ok", "model": self.model_name, "mode": self.mode,
                             "dtype": plan.dtype, "dtype_reason": plan.dtype_reason, **self.engine.weights_info(),
                             "machine": machine_facts(self.engine.device),
                             "plan": plan.to_json([1, self.max_batch_size]),
                             "kv_memory": self._runner.core.memory(), "replica": self.replica_id, "rss_mb": rss_mb()})

    # ---- docs: FastAPI's pages, off with api_keys set (they list every route and argument) ---------------
    def _docs_root(self, request: Request) -> str:
        """Where the app is mounted (Serve's route prefix), for the pages' links; 404 with api_keys set."""
        if self._api_keys:
            raise StarletteHTTPException(404)
        return request.scope.get("root_path", "").rstrip("/")

    @api.get("/openapi.json", include_in_schema=False)
    async def openapi(self, request: Request) -> JSONResponse:
        root = self._docs_root(request)
        schema = request.app.openapi()
        return JSONResponse({**schema, "servers": [{"url": root}]} if root else schema)

    @api.get("/docs", include_in_schema=False)
    async def docs(self, request: Request) -> HTMLResponse:
        return get_swagger_ui_html(openapi_url=f"{self._docs_root(request)}/openapi.json",
                                   title=f"{api.title} - Swagger UI")

    @api.get("/redoc", include_in_schema=False)
    async def redoc(self, request: Request) -> HTMLResponse:
        return get_redoc_html(openapi_url=f"{self._docs_root(request)}/openapi.json", title=f"{api.title} - ReDoc")

    @api.get("/metrics")
    async def prometheus(self, request: Request) -> Response:
        """This replica's engine metrics in Prometheus' text format (Ray's metrics port has every replica's)."""
        self._authorize(request)
        self._record_load()  # the gauges as they are now, not at the last health check
        return Response(self.metrics.exposition(), media_type=PROMETHEUS_TEXT)

    @api.get("/v1/models")
    async def models(self, request: Request) -> dict:
        self._authorize(request)
        return {"object": "list", "data": [self._model_card()]}

    @api.get("/v1/models/{name:path}")
    async def model(self, name: str, request: Request) -> dict:
        self._authorize(request)
        self._check_model(name)
        return self._model_card()

    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": 0, "owned_by": "specee",
                "max_model_len": self.engine.context_len, "num_layers": self.engine.model.num_layers,
                "mode": self.mode, "chat": self.chat_template is not None}

    # ---- endpoints ----------------------------------------------------------------------------
    @api.post("/v1/completions", openapi_extra=request_body(CompletionRequest))
    async def completions(self, request: Request):
        self._authorize(request)
        req = await self._parse(request, CompletionRequest)
        prompts = req.prompts
        if len(prompts) > self.args.max_prompts_per_request:
            raise APIError(f"prompt is a list of {len(prompts)}; this server takes at most "
                           f"{self.args.max_prompts_per_request} per request", param="prompt", code="too_many_prompts")
        out = await self._complete(req, prompts, chat=False, default_max_tokens=COMPLETIONS_DEFAULT_MAX_TOKENS)
        if isinstance(out, StreamingResponse):
            return out
        return await self._respond(out, completion_response, completion_logprobs)

    @api.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionRequest))
    async def chat_completions(self, request: Request):
        self._authorize(request)
        if self.chat_template is None:
            raise APIError(f"model {self.model_name!r} has no chat template: use /v1/completions", status=404,
                           code="chat_not_supported")
        req = await self._parse(request, ChatCompletionRequest)
        out = await self._complete(req, None, chat=True, default_max_tokens=None)
        if isinstance(out, StreamingResponse):
            return out
        return await self._respond(out, chat_response, chat_logprobs)

    async def _respond(self, out: tuple, build, logprobs) -> JSONResponse:
        """_response, on a request thread when it renders logprobs (a token's text and its alternatives' for
        every token: work the event loop must not wait on)."""
        if any(r.logprobs is not None for r in out[3]):
            return await self._off_loop(self._response, out, build, logprobs)
        return self._response(out, build, logprobs)

    def _response(self, out: tuple, build, logprobs) -> JSONResponse:
        """The JSON body of a finished request (build: completion_response / chat_response; logprobs: the
        matching logprobs shape) from _complete's (id, mode, prompt tokens, results, batch size)."""
        rid, mode, n_prompt, results, batch_size = out
        choices = [{"text": r.text, "finish_reason": r.finish_reason,
                    "logprobs": None if r.logprobs is None else logprobs(r.logprobs, self._token_text)}
                   for r in results]
        return JSONResponse(build(rid, self.model_name, choices,
                                  usage(n_prompt, sum(len(r.token_ids) for r in results),
                                        sum(r.cached_prompt_tokens for r in results)),
                                  specee_summary(results, self.engine.model.num_layers, mode, batch_size)))

    def _token_text(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id])

    async def _complete(self, req, prompts: list[str] | None, *, chat: bool, default_max_tokens: int | None):
        """Admission, the checks that need the engine, and generation: a StreamingResponse for a stream
        (which then holds the admission ticket), else (id, mode, prompt tokens, results, batch size)."""
        ticket = self._admission.enter()
        try:
            if chat:
                prompts = [await self._render_chat(req)]
            n = req.n or 1
            if len(prompts) * n > self.args.max_prompts_per_request:
                raise APIError(f"{len(prompts)} prompt(s) x n={n} choices; this server takes at most "
                               f"{self.args.max_prompts_per_request} per request", param="n", code="too_many_prompts")
            mode, params, n_prompt, ids = await self._prepare(req, prompts, default_max_tokens=default_max_tokens,
                                                              n=n)
            # each prompt n times in a row: choices prompt by prompt, as OpenAI orders them; the copies share
            # the prompt's KV through the prefix cache
            work = Work(tuple(p for p in prompts for _ in range(n)), params, mode, tuple(i for i in ids for _ in range(n)))
            rid = new_id("chatcmpl" if chat else "cmpl")
            if req.stream:  # the ticket goes with the stream
                response, ticket = self._stream(rid, work, chat=chat, include_usage=req.include_usage,
                                                ticket=ticket), None
                return response
            results, batch_size = await self._generate(work)
            return rid, mode, n_prompt, results, batch_size
        finally:
            if ticket is not None:
                ticket.release()

    # ---- request checks -----------------------------------------------------------------------
    def _authorized(self, request: Request) -> bool:
        """Whether api_keys are unset or `Authorization: Bearer <key>` names one of them."""
        return not self._api_keys or bearer_ok(request.headers.get("authorization", ""), self._api_keys)

    def _authorize(self, request: Request) -> None:
        """With api_keys set: 401 unless `Authorization: Bearer <key>` names one of them."""
        if not self._authorized(request):
            raise APIError("missing or incorrect API key: send `Authorization: Bearer <key>`", status=401,
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    async def _parse(self, request: Request, cls):
        """The validated request; bodies past INLINE_PARSE_BYTES are parsed on a thread."""
        raw = await read_body(request)
        if len(raw) <= INLINE_PARSE_BYTES:
            return parse_body(raw, cls, self.args.max_json_depth)
        return await self._off_loop(parse_body, raw, cls, self.args.max_json_depth)

    async def _off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._cpu, fn, *args)

    def _check_chars(self, text: str, where: str, param: str) -> None:
        """Refuse, without tokenizing it, a text that cannot fit the context at max_chars_per_token."""
        limit = self.engine.context_len * self.args.max_chars_per_token
        if len(text) > limit:
            raise APIError(f"{where} has {len(text)} characters: more than this model's context of "
                           f"{self.engine.context_len} tokens can hold (at most {limit} characters)",
                           param=param, code="context_length_exceeded")

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(f"the model {name!r} does not exist; this server has {self.model_name!r}", status=404,
                           param="model", code="model_not_found")

    async def _prepare(self, req, prompts: list[str], default_max_tokens: int | None,
                       n: int = 1) -> tuple[str, dict, int, tuple]:
        """Checks that need the engine -> (mode, sampling() dict, prompt tokens in all, token ids per prompt)."""
        self._check_model(req.model)
        try:
            mode = self._pick_mode(req.mode or self.mode)
        except ValueError as e:
            raise APIError(str(e), param="mode", code="invalid_value") from None
        if req.max_disagreement is not None:
            self._check_tolerance(mode, req.max_disagreement)
        for stop in req.sampling(1)["stop"]:
            if len(stop) > self.args.max_stop_chars:
                raise APIError(f"a stop string has {len(stop)} characters; the limit is {self.args.max_stop_chars}",
                               param="stop", code="invalid_value")
        param = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
        for i, p in enumerate(prompts):
            self._check_chars(p, "prompt" if len(prompts) == 1 else f"prompt[{i}]", param)
        ids = await self._off_loop(self._encode, prompts, param)
        lengths = [len(i) for i in ids]
        room = self.engine.context_len - max(lengths)
        max_tokens = req.max_tokens or default_max_tokens or min(room, self.max_tokens_limit)
        if max_tokens > self.max_tokens_limit:
            raise APIError(f"max_tokens is {max_tokens}; this server allows at most {self.max_tokens_limit}",
                           param="max_tokens", code="invalid_value")
        if max_tokens > room:
            raise APIError(f"this model's maximum context length is {self.engine.context_len} tokens, but "
                           f"{max(lengths) + max_tokens} were requested ({max(lengths)} in the prompt, "
                           f"{max_tokens} for the completion): shorten the prompt or lower max_tokens",
                           param="max_tokens", code="context_length_exceeded")
        total = (sum(lengths) + max_tokens * len(prompts)) * n
        if total > self.args.max_request_tokens:
            raise APIError(f"the request asks for {total} tokens (({sum(lengths)} in its prompts + {max_tokens} x "
                           f"{len(prompts)} to generate) x n={n}); this server allows {self.args.max_request_tokens} "
                           f"per request", param="max_tokens", code="request_too_large")
        params = req.sampling(max_tokens)
        try:
            sampling = sampling_params(params)
        except ValueError as e:
            raise APIError(str(e), code="invalid_value") from None
        vocab = self.engine.config.vocab_size
        if any(t >= vocab for t in (*sampling.logit_bias, *sampling.stop_token_ids)):
            raise APIError(f"logit_bias and stop_token_ids take token ids below {vocab}", code="invalid_value",
                           param="logit_bias" if any(t >= vocab for t in sampling.logit_bias) else "stop_token_ids")
        if sampling.processes and mode == "specee":
            raise APIError("logit_bias, penalties, min_tokens and structured output apply in modes auto, dense and "
                           "spec, not specee", param="mode", code="invalid_value")
        if sampling.structured:
            await self._compile(sampling.structured)
        return mode, params, sum(lengths), tuple(tuple(i) for i in ids)

    async def _compile(self, spec: dict) -> None:
        """Compile a structured-output constraint on a request thread (the engine's grammar cache keeps it for the
        rows), so a bad, oversized or slow one is this request's 400 and the event loop never waits on it."""
        size = len(json.dumps(spec))
        if size > self.args.max_schema_bytes:
            raise APIError(f"the structured-output constraint is {size} bytes as JSON; this server takes at most "
                           f"{self.args.max_schema_bytes} (max_schema_bytes)", param="response_format",
                           code="invalid_value")
        try:
            await asyncio.wait_for(self._off_loop(self.engine.rules.grammar, spec), self.args.grammar_timeout_s)
        except ValueError as e:
            raise APIError(str(e), param="response_format", code="invalid_value") from None
        except TimeoutError:  # the compile goes on on its thread; its result stays in the bounded cache
            raise APIError(f"the structured-output constraint did not compile within {self.args.grammar_timeout_s:g} s "
                           f"(grammar_timeout_s): simplify it", param="response_format", code="invalid_value") from None

    def _check_tolerance(self, mode: str, eps: float) -> None:
        """A 400 unless the request's mode is specee and the model has a calibration for eps."""
        if mode != "specee":
            raise APIError(f"max_disagreement applies to mode 'specee' only (the other modes are lossless); "
                           f"the request runs in mode {mode!r}", param="max_disagreement", code="invalid_value")
        try:
            self.engine.stepper_factory("specee", None, eps)
        except ValueError as e:  # its text names files and commands of the server: logged, not sent
            log.warning("max_disagreement=%g refused: %s", eps, e)
            raise APIError(f"max_disagreement={eps:g} is not available: this server's model has no exit calibration "
                           f"for it; send the request without max_disagreement", param="max_disagreement",
                           code="invalid_value") from None

    def _encode(self, prompts: list[str], param: str) -> list[list[int]]:
        """The prompts' token ids (on a request thread); a prompt over the context is a 400."""
        ids = []
        for i, p in enumerate(prompts):
            try:
                ids.append(self.engine.encode_prompt(p))
            except PromptError as e:  # types and emptiness are checked already: this is the length
                where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
                raise APIError(f"{where}: {e}", param=param, code="context_length_exceeded") from None
        return ids

    def _pick_mode(self, requested: str | None) -> str:
        return pick_mode(requested, has_predictors=self.engine.early_exit is not None)

    async def _render_chat(self, req: ChatCompletionRequest) -> str:
        messages = req.template_messages()
        self._check_chars("".join(m["content"] for m in messages), "messages", "messages")
        try:
            return await self._off_loop(self.engine.chat_prompt, messages)
        except ValueError as e:
            raise APIError(f"messages: {e}", param="messages") from None

    # ---- engine calls -------------------------------------------------------------------------
    async def _generate(self, work: Work):
        """(results, the batch it ran in: the most rows decoding beside it); APIError on failure."""
        try:
            submitted = Submitted(self._runner, work.engine_requests())
        except ValueError as e:  # PromptError included
            raise engine_error(e) from None
        try:
            results = await submitted.results()
        except asyncio.CancelledError:  # the client went away: free its rows
            submitted.cancel()
            raise
        except Exception as e:  # noqa: BLE001 -- as the client sees it
            submitted.cancel()
            raise engine_error(e) from None
        self._finished(results, work.mode)
        return results, submitted.peak_batch or len(work.prompts)

    def _finished(self, results, mode: str) -> None:
        self.metrics.finished(results, mode)
        self._record_load()

    def _stream(self, rid: str, work: Work, *, chat: bool, include_usage: bool, ticket: Ticket) -> StreamingResponse:
        """Server-sent events in OpenAI's chunk format: text deltas as tokens are chosen, then a
        chunk per choice with finish_reason (the last one carries usage and specee), then [DONE]."""
        tok, model, created = self.engine.tokenizer, self.model_name, int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        prompts, params, mode = work.prompts, work.params, work.mode

        pending: list[list[dict]] = [[] for _ in prompts]  # per choice: logprob entries not sent yet
        offsets = [0] * len(prompts)  # per choice: characters sent (completions' text_offset)

        def chunk(i: int, text: str | None, finish: str | None = None, **extra) -> str:
            lps = None
            if pending[i]:  # the logprobs of the tokens this chunk's text comes from
                lps = (chat_logprobs(pending[i], self._token_text) if chat
                       else completion_logprobs(pending[i], self._token_text, offsets[i]))
                pending[i] = []
            offsets[i] += len(text or "")
            if chat:
                delta = {} if text is None else {"content": text}
                return sse(chat_chunk(rid, model, created, i, delta, finish, lps, **extra))
            return sse(completion_chunk(rid, model, created, i, text or "", finish, lps, **extra))

        # submitted here, before the 200: what the engine refuses (a row that can never fit the KV budget) is a 4xx
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancelled = threading.Event()

        def on_token(i: int, token_id: int, entry=None) -> None:  # engine thread
            if cancelled.is_set():
                raise _StreamCancelled
            loop.call_soon_threadsafe(queue.put_nowait, (i, token_id, entry))

        def done(f: asyncio.Future) -> None:
            if not f.cancelled():
                f.exception()  # retrieved here: a cancelled stream's error is expected
            queue.put_nowait(None)

        try:
            submitted = Submitted(self._runner, work.engine_requests(on_token))  # joins the running batch
        except ValueError as e:  # PromptError included
            raise engine_error(e) from None
        fut = submitted.future
        fut.add_done_callback(done)
        fut.add_done_callback(lambda _: ticket.release())

        async def events():
            texts = [StreamText(tok, params["stop"]) for _ in prompts]
            try:
                if chat:
                    yield sse(chat_chunk(rid, model, created, 0, {"role": "assistant", "content": ""}))
                while (item := await queue.get()) is not None:
                    i, token_id, entry = item
                    if entry is not None:
                        lp, ids, vals = entry
                        pending[i].append({"token": token_id, "logprob": lp, "top_logprobs": list(zip(ids, vals))})
                    if delta := texts[i].push(token_id):
                        yield chunk(i, delta)
                results = Submitted.joined(fut.result())
                self._finished(results, mode)
                u = usage(sum(r.prompt_tokens for r in results), sum(len(r.token_ids) for r in results),
                          sum(r.cached_prompt_tokens for r in results))
                batch = submitted.peak_batch or len(prompts)
                summary = specee_summary(results, self.engine.model.num_layers, mode, batch)
                for i, r in enumerate(results):
                    if rest := texts[i].finish(cut_at_stop(r.text, params["stop"])):
                        yield chunk(i, rest)
                    extra = {"usage": u, "specee": summary} if i == len(results) - 1 else {}
                    yield chunk(i, None, r.finish_reason, **extra)
                if include_usage:
                    yield sse(usage_chunk(rid, model, created, obj, u))
            except (GeneratorExit, asyncio.CancelledError):
                log.info("request %s (%s): the client hung up mid-stream; generation stops", request_id(), rid)
                raise
            except Exception as e:  # noqa: BLE001 -- the 200 is sent: the failure is an error event
                yield sse(engine_error(e).body())
            finally:
                cancelled.set()  # the client left (GeneratorExit / CancelledError) or we are done
                submitted.cancel()
            yield sse("[DONE]")

        gen = events()
        weakref.finalize(gen, submitted.cancel)  # a stream that never ran stops its rows, and its done callback
        weakref.finalize(gen, ticket.release)  # (or this) gives its place back
        return EventStream(gen, media_type="text/event-stream",
                           headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def app(args: dict) -> Application:
    """App builder for `serve run pipeline.serve:app [key=value ...]` and serve_config.yaml
    (`import_path: pipeline.serve:app`); args are ServeArgs fields."""
    a = args if isinstance(args, ServeArgs) else ServeArgs.model_validate(args or {})
    # refused here when Serve runs already (serve deploy builds in the cluster); each replica checks too
    check_exposure(serve_http_host(), has_keys=bool(a.api_keys), allow_open=a.allow_open)
    return SpecEEServer.options(**deployment_options(a)).bind(a)
