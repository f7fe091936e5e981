"""OpenAI wire format for the Serve app (pipeline/serve.py): request bodies parsed and validated
with pydantic, OpenAI-style error bodies, and response / stream-chunk builders. No Ray, no
engine: everything here is plain data, unit-tested in tests/serve/test_serve_protocol.py."""
import json
import logging
import math
import threading
import time
import uuid
from typing import Annotated, Any, Literal

import numpy as np
from pipeline.sampling import MAX_CHOICES
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

log = logging.getLogger(__name__)

INT64 = 2**63
MAX_STOP = 4  # OpenAI's limit on stop strings
MAX_JSON_DEPTH = 16  # the deepest request (chat content parts) nests 4
MAX_LOGPROBS = 20  # alternatives per token (OpenAI's top_logprobs limit; specee_core.step.sampling's too)
MAX_TOKEN_ID_DIGITS = 9  # a logit_bias key: no vocabulary reaches a billion tokens


class APIError(Exception):
    """An error returned to the client as {"error": {...}} with an HTTP status."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.code, self.type = message, status, param, code, type
        self.headers = headers or {}  # e.g. Retry-After with a 429, WWW-Authenticate with a 401

    def body(self) -> dict:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(message: str, *, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# ---- requests --------------------------------------------------------------------------------
def _check_text(value: str, what: str) -> str:
    """JSON escapes can carry lone surrogates (\\ud800) that no tokenizer can encode."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{what} is not valid Unicode (lone surrogate)") from None
    return value


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


# Parameters of OpenAI's API (and vLLM's) this server does not implement: the values that mean "off", and the
# message. Any other value is a 400: a parameter that would change the answer is never silently ignored.
UNSUPPORTED = {
    "best_of": ((None, 1), "only best_of=1 is supported"),
    "echo": ((None, False), "echo is not supported"),
    "suffix": ((None, ""), "suffix is not supported"),
    "tools": ((None, []), "tools (function calling) are not supported: send the request without them"),
    "functions": ((None, []), "functions (function calling) are not supported"),
    "tool_choice": ((None, "none"), "tool_choice is not supported (no tools)"),
    "function_call": ((None, "none"), "function_call is not supported (no functions)"),
    "audio": ((None,), "audio output is not supported"),
    "modalities": ((None, ["text"]), "only the text modality is supported"),
    "prediction": ((None,), "predicted outputs are not supported"),
    "reasoning_effort": ((None,), "reasoning_effort is not supported: the model does not reason apart"),
    "web_search_options": ((None,), "web search is not supported"),
    "store": ((None, False), "store is not supported: completions are not stored"),
    "use_beam_search": ((None, False), "beam search is not supported"),
    "include_stop_str_in_output": ((None, False), "include_stop_str_in_output is not supported"),
}
MAX_N = MAX_CHOICES  # choices per request (the request limits count every one), as the processor takes per row


def reject_unsupported(name: str, value):
    allowed, message = UNSUPPORTED[name]
    if not any(value == a and type(value) is type(a) for a in allowed):  # strict: 0 is not False
        raise ValueError(f"{message}, got {_short(value)}")
    return value


def _short(value, limit: int = 80) -> str:
    """repr(value) cut to `limit` characters: messages and logs never echo a client's megabytes."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: str | None = None
    schema_: dict = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format json_schema needs json_schema: {name, schema}")
        return self

    def structured(self) -> dict | None:
        """specee_core.SamplingParams.structured of this format (None for text)."""
        if self.type == "json_object":
            return {"type": "json_object"}
        if self.type == "json_schema":
            return {"type": "json_schema", "schema": self.json_schema.schema_}
        return None


class _SamplingRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions. strict: "5" is not an int and
    true is not 1, as in OpenAI's API; unknown fields are ignored (clients send extras like `user`).
    None means "the default", as OpenAI accepts explicit nulls."""
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)  # upper bound checked by the server: it depends on the model
    temperature: float | None = Field(None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=-1)  # extension (as in vLLM): -1 or 0 = off
    min_p: float | None = Field(None, ge=0, le=1, allow_inf_nan=False)  # extension (as in vLLM): 0 = off
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-INT64, lt=INT64)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1, le=MAX_N)
    presence_penalty: float | None = Field(None, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, ge=-2, le=2, allow_inf_nan=False)
    # token id (a decimal string, OpenAI's) -> bias. ASCII digits only: "²" passes str.isdigit but not int()
    logit_bias: dict[Annotated[str, Field(pattern=rf"^[0-9]{{1,{MAX_TOKEN_ID_DIGITS}}}$")],
                     Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False)]] | None = None
    # extensions, as in vLLM
    repetition_penalty: float | None = Field(None, gt=0, le=10, allow_inf_nan=False)
    min_tokens: int | None = Field(None, ge=0)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    ignore_eos: bool | None = None
    guided_regex: str | None = None  # vLLM's: the completion matches this regular expression
    guided_choice: list[str] | None = None  # vLLM's: the completion is one of these strings
    guided_json: dict | None = None  # vLLM's: the completion is JSON matching this schema
    response_format: ResponseFormat | None = None  # OpenAI's structured output (on completions too, as in vLLM)
    # known parameters this server does not implement (UNSUPPORTED): accepted only with the value that means "off"
    use_beam_search: Any = None
    include_stop_str_in_output: Any = None
    user: str | None = None
    mode: Literal["auto", "dense", "specee", "spec"] | None = None  # extension: override the server's decode mode
    # extension, mode specee: exit thresholds calibrated so that at most this share of exited tokens
    # differs from the full model's choice (specee_core.early_exit.calibration)
    max_disagreement: float | None = Field(None, gt=0, lt=1, allow_inf_nan=False)

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if v is None:
            return v
        stops = [v] if isinstance(v, str) else v
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences are allowed, got {len(stops)}")
        for s in stops:
            if not s:
                raise ValueError("stop sequences must be non-empty strings")
            _check_text(s, "stop")
        return v

    @property
    def top_logprobs_k(self) -> int | None:
        """The logprobs the request asks for: alternatives per token (0: the chosen token's alone), or None."""
        return None

    @field_validator("use_beam_search", "include_stop_str_in_output")
    @classmethod
    def _unsupported_sampling(cls, v, info: ValidationInfo):
        return reject_unsupported(info.field_name, v)

    @property
    def structured(self) -> dict | None:
        """The structured-output constraint asked for (response_format, guided_json, guided_regex, guided_choice),
        or None."""
        if self.response_format is not None and self.response_format.type != "text":
            return self.response_format.structured()
        if self.guided_json is not None:
            return {"type": "json_schema", "schema": self.guided_json}
        if self.guided_regex is not None:
            return {"type": "regex", "pattern": self.guided_regex}
        if self.guided_choice is not None:
            return {"type": "choice", "choices": self.guided_choice}
        return None

    @model_validator(mode="after")
    def _one_constraint(self):
        asked = [n for n in ("guided_json", "guided_regex", "guided_choice", "response_format")
                 if getattr(self, n) is not None and not (n == "response_format" and self.response_format.type == "text")]
        if len(asked) > 1:
            raise ValueError(f"at most one of guided_json, guided_regex, guided_choice and response_format, "
                             f"got {', '.join(asked)}")
        return self

    def sampling(self, max_tokens: int) -> dict:
        """Keyword arguments of specee_core.SamplingParams (OpenAI's defaults where the request is silent) and
        max_disagreement."""
        stop = self.stop if self.stop is None or isinstance(self.stop, list) else [self.stop]
        return {"max_new_tokens": max_tokens,
                "temperature": 1.0 if self.temperature is None else float(self.temperature),
                "top_p": 1.0 if self.top_p is None else float(self.top_p),
                "top_k": max(self.top_k or 0, 0), "min_p": float(self.min_p or 0.0), "stop": tuple(stop or ()),
                "seed": self.seed,
                "frequency_penalty": float(self.frequency_penalty or 0.0),
                "presence_penalty": float(self.presence_penalty or 0.0),
                "repetition_penalty": float(self.repetition_penalty or 1.0),
                "logit_bias": {int(t): float(b) for t, b in (self.logit_bias or {}).items()},
                "min_tokens": self.min_tokens or 0, "stop_token_ids": tuple(self.stop_token_ids or ()),
                "ignore_eos": bool(self.ignore_eos), "logprobs": self.top_logprobs_k, "structured": self.structured,
                "max_disagreement": self.max_disagreement}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str]
    echo: bool | None = None
    best_of: int | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # the most likely alternatives per token
    suffix: str | None = None

    @property
    def top_logprobs_k(self) -> int | None:
        return self.logprobs

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v):
        # checked before pydantic's union so the message names the real problem
        if isinstance(v, str):
            if not v:
                raise ValueError("prompt must not be empty")
            return _check_text(v, "prompt")
        if not isinstance(v, list):
            raise ValueError(f"prompt must be a string or a list of strings, got {type(v).__name__}")
        if not v:
            raise ValueError("prompt must not be an empty list")
        for i, p in enumerate(v):
            if isinstance(p, (int, list)):
                raise ValueError("token-id prompts are not supported: send text")
            if not isinstance(p, str):
                raise ValueError(f"prompt[{i}] must be a string, got {type(p).__name__}")
            if not p:
                raise ValueError(f"prompt[{i}] must not be empty")
            _check_text(p, f"prompt[{i}]")
        return v

    @field_validator("echo", "best_of", "suffix")
    @classmethod
    def _unsupported_completion(cls, v, info: ValidationInfo):
        return reject_unsupported(info.field_name, v)

    @property
    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        text = self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)
        return _check_text(text, "message content")


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name of max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list | None = None
    functions: list | None = None
    tool_choice: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    store: Any = None

    @field_validator("tools", "functions", "tool_choice", "function_call", "audio", "modalities", "prediction",
                     "reasoning_effort", "web_search_options", "store")
    @classmethod
    def _unsupported_chat(cls, v, info: ValidationInfo):
        return reject_unsupported(info.field_name, v)


    @model_validator(mode="after")
    def _max_tokens(self):
        if self.max_tokens is None:
            self.max_tokens = self.max_completion_tokens
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @property
    def top_logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_messages(self) -> list[dict]:
        """Messages as chat templates expect them: role and plain-text content."""
        out = []
        for m in self.messages:
            d = {"role": m.role, "content": m.text()}
            if m.name:
                d["name"] = m.name
            out.append(d)
        return out


def parse_body(raw: bytes, cls: type[BaseModel], max_depth: int = MAX_JSON_DEPTH) -> BaseModel:
    """Request bytes -> validated request; APIError (400) naming the problem otherwise. Nesting
    deeper than max_depth is refused before parsing (a recursive parser would hit the recursion
    limit on 10,000 nested arrays). Unknown top-level fields are ignored, as vLLM does, with a
    bounded warning (UnknownFieldLog)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(f"request body is not valid UTF-8 (byte {e.start})", code="invalid_encoding") from None
    if not text.strip():
        raise APIError("request body is empty: expected a JSON object", code="invalid_json")
    depth = json_depth(raw)
    if depth > max_depth:
        raise APIError(f"request body nests arrays and objects {depth} deep; the limit is {max_depth}",
                       code="json_too_deep")
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except (json.JSONDecodeError, ValueError, RecursionError) as e:
        raise APIError(f"request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise APIError(f"request body must be a JSON object, got {type(obj).__name__}", code="invalid_json")
    warn_unknown_fields(obj, cls)
    try:
        return cls.model_validate(obj)
    except ValidationError as e:
        raise validation_error(e) from None


class UnknownFieldLog:
    """Unknown top-level request fields, ignored as vLLM ignores them, reported in bounded log lines: at most one
    line per `period_s` seconds (naming a few fields of the latest request, each cut short, and how many requests
    had unknown fields since the last line). Nothing of a request is kept beyond its own line."""

    NAMES, NAME_CHARS = 5, 40

    def __init__(self, period_s: float = 60.0):
        self.period_s, self.last, self.requests = period_s, -math.inf, 0
        self.lock = threading.Lock()

    def note(self, unknown: list[str]) -> None:
        now = time.monotonic()
        with self.lock:
            self.requests += 1
            if now - self.last < self.period_s:
                return
            self.last, requests, self.requests = now, self.requests, 0
        names = ", ".join(_short(k, self.NAME_CHARS) for k in unknown[: self.NAMES])
        more = f" and {len(unknown) - self.NAMES} more" if len(unknown) > self.NAMES else ""
        log.warning("ignoring unknown request fields: %s%s (%d request(s) with unknown fields in the last %.0f s; "
                    "one line per %.0f s)", names, more, requests, self.period_s, self.period_s)


_unknown_fields = UnknownFieldLog()


def warn_unknown_fields(obj: dict, cls: type[BaseModel]) -> list[str]:
    """The request's top-level fields the API does not know (ignored), reported by UnknownFieldLog."""
    unknown = [k for k in obj if k not in cls.model_fields]
    if unknown:
        _unknown_fields.note(unknown)
    return unknown


def json_depth(raw: bytes) -> int:
    """The deepest nesting of arrays and objects in JSON bytes, strings skipped, without parsing:
    vectorized over the bytes (a 4 MB body takes milliseconds) and never recursive. Quotes escaped
    by an odd run of backslashes do not end a string; in UTF-8 no byte of a multi-byte character
    equals an ASCII bracket or quote."""
    b = np.frombuffer(raw, dtype=np.uint8)
    quotes = np.flatnonzero(b == 34)
    escaped = []
    for q in quotes[(quotes > 0) & (b[np.maximum(quotes - 1, 0)] == 92)].tolist():  # rare: count the run
        k = q - 1
        while k >= 0 and raw[k] == 92:
            k -= 1
        if (q - 1 - k) % 2:
            escaped.append(q)
    if escaped:
        quotes = np.setdiff1d(quotes, np.array(escaped), assume_unique=True)
    brackets = np.flatnonzero((b == 91) | (b == 123) | (b == 93) | (b == 125))
    brackets = brackets[np.searchsorted(quotes, brackets) % 2 == 0]  # an even number of quotes before: outside
    if not len(brackets):
        return 0
    step = np.where((b[brackets] == 91) | (b[brackets] == 123), 1, -1)
    return int(np.cumsum(step).max(initial=0))


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def validation_error(e: ValidationError) -> APIError:
    """The first field's pydantic error as an OpenAI error: param is the dotted field path. For a
    union (content: str | list[part]) the deepest error names the real problem."""
    errors = e.errors()
    field = errors[0]["loc"][:1]
    err = max((x for x in errors if x["loc"][:1] == field), key=lambda x: len(x["loc"]))
    loc = list(err["loc"])
    msg = err["msg"].removeprefix("Value error, ")
    if len(loc) > 1 and loc[0] == "logit_bias":  # the parameter is the map; the client's key goes in the message
        msg = f"token {_short(loc[1], 40)}: {msg}"
        loc = loc[:1]
    loc = [p for p in loc if not _is_union_tag(p)]
    param = _short(".".join(str(p) for p in loc), 200).strip("'") or None
    if err["type"] == "missing":
        return APIError(f"'{param}' is a required property", param=param, code="missing_required_parameter")
    text = msg if param is None or msg.startswith(param) else f"{param}: {msg}"
    return APIError(text, param=param, code="invalid_value" if err["type"] == "value_error" else "invalid_type")


def _is_union_tag(p) -> bool:
    """pydantic puts the union member tried into the error location: ('stop', 'list[str]', 0)."""
    return isinstance(p, str) and (p in {"str", "int", "float", "bool", "none", "TextPart", "StreamOptions"}
                                   or "[" in p or p.startswith("function-"))


def request_schema(cls: type[BaseModel]) -> dict:
    """The JSON schema of a request body with every definition inlined (no $ref: the OpenAPI document carries
    it as the operation's requestBody, and schema-driven clients and fuzzers read it whole)."""
    schema = cls.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node):
        if isinstance(node, dict):
            if "$ref" in node:
                return inline(defs[node["$ref"].rsplit("/", 1)[-1]])
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    return inline(schema)


def request_body(cls: type[BaseModel]) -> dict:
    """FastAPI openapi_extra publishing cls as a route's JSON body. The handlers read the raw body themselves
    (parse_body: size and depth limits before parsing, then cls), so the schema is declared, not inferred."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": request_schema(cls)}}}}


# ---- responses -------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; cached_tokens: prompt tokens whose KV came from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion_response(rid: str, model: str, choices: list[dict], usage: dict, specee: dict) -> dict:
    """choices: [{"text", "finish_reason", "logprobs" (optional)}] in order (prompt by prompt, n each)."""
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": i, "text": c["text"], "logprobs": c.get("logprobs"),
                         "finish_reason": c["finish_reason"]} for i, c in enumerate(choices)],
            "usage": usage, "specee": specee}


def chat_response(rid: str, model: str, choices: list[dict], usage: dict, specee: dict) -> dict:
    """choices: [{"text", "finish_reason", "logprobs" (optional)}], one per n."""
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": i, "message": {"role": "assistant", "content": c["text"]},
                         "logprobs": c.get("logprobs"), "finish_reason": c["finish_reason"]}
                        for i, c in enumerate(choices)],
            "usage": usage, "specee": specee}


def completion_chunk(rid: str, model: str, created: int, index: int, text: str,
                     finish_reason: str | None = None, logprobs: dict | None = None, **extra: Any) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}],
            **extra}


def chat_chunk(rid: str, model: str, created: int, index: int, delta: dict,
               finish_reason: str | None = None, logprobs: dict | None = None, **extra: Any) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}],
            **extra}


def chat_logprobs(entries: list[dict], token_text) -> dict:
    """GenerationResult.logprobs entries -> a chat choice's `logprobs` ({"content": [...]}, OpenAI's shape);
    token_text(id) -> the token's text."""
    def item(tok: int, lp: float) -> dict:
        text = token_text(tok)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(e["token"], e["logprob"]),
                         "top_logprobs": [item(t, lp) for t, lp in e["top_logprobs"]]} for e in entries]}


def completion_logprobs(entries: list[dict], token_text, offset: int = 0) -> dict:
    """GenerationResult.logprobs entries -> a completion choice's `logprobs` (the legacy shape: tokens,
    token_logprobs, top_logprobs as {token text: logprob}, text_offset from `offset`)."""
    tokens = [token_text(e["token"]) for e in entries]
    offsets, at = [], offset
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": tokens, "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{token_text(t): lp for t, lp in e["top_logprobs"]} for e in entries],
            "text_offset": offsets}


def usage_chunk(rid: str, model: str, created: int, obj: str, usage: dict) -> dict:
    """The last chunk when stream_options.include_usage is set: no choices, only usage."""
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage}


def sse(data: dict | str) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


def specee_summary(results: list, num_layers: int, mode: str, batch_size: int) -> dict:
    """The `specee` extension object: exit-layer statistics over every token of the response
    (histogram index i = tokens that ran i+1 layers), and the engine batch it ran in."""
    hist = [0] * num_layers
    for r in results:
        for i, c in enumerate(r.stats.get("exit_histogram", [])):
            hist[i] += c
    tokens = sum(hist)
    avg = sum((i + 1) * c for i, c in enumerate(hist)) / tokens if tokens else 0.0
    return {"mode": mode, "num_layers": num_layers, "avg_layers": avg,
            "layer_fraction": avg / num_layers if num_layers else 0.0, "exit_histogram": hist,
            "batch_size": batch_size}
