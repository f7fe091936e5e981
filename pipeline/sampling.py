"""Per-row sampling parameters: what a row asks for -> specee_core.SamplingParams.

A row sets its own sampling with vLLM's names, as a Ray Data LLM row does: in one `sampling_params`
column (a dict, an Arrow struct, or the text of a JSON object, e.g. from CSV) or in columns of their
own (`max_tokens`, `temperature`, ...). What a row leaves unset (no such column, or null) takes the
processor's defaults. A value the engine refuses, or a parameter the processor does not take yet, makes
the row an error row (InputError); it is never ignored.

Two steps: `row_fields` gathers a row's fields (the reader runs it on file records, the processor's
prepare stage on Dataset rows) and `to_sampling` maps them to SamplingParams: the one place that
knows which names the engine takes.
"""
from __future__ import annotations

import json
import math
from dataclasses import replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the reader's tasks use row_fields only: they need not import torch
    from specee_core import SamplingParams

# vLLM's name -> SamplingParams field, for the parameters a row may set
SUPPORTED = {"max_tokens": "max_new_tokens", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
             "min_p": "min_p",
             "seed": "seed", "stop": "stop", "ignore_eos": "ignore_eos", "presence_penalty": "presence_penalty",
             "frequency_penalty": "frequency_penalty", "repetition_penalty": "repetition_penalty",
             "min_tokens": "min_tokens", "stop_token_ids": "stop_token_ids", "logit_bias": "logit_bias",
             "logprobs": "logprobs",
             # structured output: OpenAI's response_format, vLLM's structured_outputs (guided_decoding, its
             # older name): SamplingParams.structured (structured_spec)
             "response_format": "structured", "structured_outputs": "structured", "guided_decoding": "structured"}
# vLLM sampling parameters a row may not set yet, with the values that mean "off": a row may state those; any
# other value makes it an error row
NOT_YET = {"best_of": (1,), "prompt_logprobs": (), "bad_words": ([],),
           "allowed_token_ids": (), "include_stop_str_in_output": (False,), "truncate_prompt_tokens": ()}
STRUCTURED = ("response_format", "structured_outputs", "guided_decoding")
COLUMN = "sampling_params"  # the column holding all of them at once
CHOICES = "n"  # completions of the row's prompt (1..MAX_CHOICES): not a SamplingParams field (choices())
MAX_CHOICES = 16
ROW_COLUMNS = (*SUPPORTED, CHOICES, *NOT_YET)  # columns of their own that a row's sampling is read from
INTS = ("max_tokens", "top_k", "seed", "min_tokens", "logprobs", CHOICES)
INT64 = 2 ** 63  # integers beyond 64 bits are refused: no torch call or seed takes them
MAX_TOKEN_ID = 2 ** 31 - 1  # token ids index a vocabulary (int32 at most)


def row_fields(row: dict) -> dict:
    """The sampling fields a row (plain Python values) sets: its `sampling_params` (a dict, or a JSON
    object's text) and its columns named like a sampling parameter, nulls dropped. ValueError when
    sampling_params is not an object or a parameter is set both ways with different values."""
    nested = row.get(COLUMN)
    if isinstance(nested, str):
        try:
            nested = json.loads(nested)
        except json.JSONDecodeError as e:
            raise ValueError(f"{COLUMN} is not a JSON object ({e.msg} at column {e.colno})") from None
        except (ValueError, RecursionError):  # an integer past 4300 digits, nesting past the recursion limit
            raise ValueError(f"{COLUMN} is not a JSON object a row can hold") from None
    if nested is None:
        nested = {}
    if not isinstance(nested, dict):
        raise ValueError(f"{COLUMN} must be a dict of vLLM sampling parameters, got {type(nested).__name__}")
    fields = {k: v for k, v in nested.items() if v is not None}
    for name in ROW_COLUMNS:
        value = row.get(name)
        if value is None:
            continue
        if name in fields and fields[name] != value:
            raise ValueError(f"{name} is set twice: {value!r} in its column, {fields[name]!r} in {COLUMN}")
        fields[name] = value
    return fields


def to_sampling(fields: dict, defaults: SamplingParams) -> SamplingParams:
    """defaults with the row's fields (vLLM's names) applied. ValueError naming the parameter for a value the
    engine refuses or a parameter a row may not set yet (NOT_YET, or a name it does not know); ValueError and
    nothing else, whatever the fields hold (every conversion below follows a check that it cannot fail).

    The one mapping from a row's names to the engine's: a parameter the engine learns goes from NOT_YET to
    SUPPORTED (and SamplingParams), here."""
    unknown = [k for k in fields if k not in SUPPORTED and k not in NOT_YET and k != CHOICES]
    if unknown:
        raise ValueError(f"sampling parameter {unknown[0]!r} is not supported (supported: {', '.join(SUPPORTED)})")
    for name, value in fields.items():
        if name in NOT_YET and not any(value == off and type(value) is not bool for off in NOT_YET[name]):
            raise ValueError(f"sampling parameter {name}={value!r} is not supported yet"
                             + (f" (only {NOT_YET[name][0]!r})" if NOT_YET[name] else ""))
    choices(fields)
    changes = {}
    for name, value in fields.items():
        if name not in SUPPORTED:
            continue
        if name in INTS and isinstance(value, float) and value.is_integer():
            value = int(value)  # an int column with nulls reaches pandas as floats
        if name == "top_k" and value == -1:
            value = 0  # vLLM's "off"
        if name in ("stop", "stop_token_ids") and isinstance(value, (list, tuple)):
            value = [int(v) if name == "stop_token_ids" and isinstance(v, float) and v.is_integer() else v
                     for v in value]
        wrong = kind_error(name, value)
        if wrong:
            raise ValueError(f"sampling parameter {name}={value!r}: expected {wrong}")
        if name == "logit_bias":  # keys arrive as text from JSON (OpenAI's), values as numbers (kind_error)
            value = {token_id(k): float(v) for k, v in value.items() if v is not None}
        if name in STRUCTURED:
            value = structured_spec(name, value)
            if value is None:  # response_format text: unconstrained
                continue
            if "structured" in changes:
                raise ValueError(f"sampling parameter {name}: a row takes one structured-output constraint")
        changes[SUPPORTED[name]] = value
    try:
        return replace(defaults, **changes)  # SamplingParams.__post_init__ checks the ranges
    except (ValueError, TypeError, RecursionError) as e:
        given = ", ".join(f"{k}={v!r}" for k, v in fields.items() if k in SUPPORTED)
        raise ValueError(f"sampling parameters {given}: {e}") from None



def choices(fields: dict) -> int:
    """How many completions a row asks of its prompt (vLLM's and OpenAI's n; 1 when unset). ValueError unless an
    integer in 1..MAX_CHOICES."""
    n = fields.get(CHOICES, 1)
    if isinstance(n, float) and n.is_integer():
        n = int(n)  # an int column with nulls reaches pandas as floats
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_CHOICES:
        raise ValueError(f"sampling parameter n={n!r}: expected an integer in 1..{MAX_CHOICES}")
    return n


def choice_params(params: SamplingParams, k: int) -> SamplingParams:
    """Choice k's sampling among a prompt's n: sampled with a seed, its own seed + k (as vLLM seeds them), so each
    choice is reproducible whatever runs beside it; otherwise the prompt's."""
    if k == 0 or params.seed is None or params.greedy:
        return params
    return replace(params, seed=params.seed + k)


def structured_spec(name: str, value) -> dict | None:
    """A row's structured-output request -> SamplingParams.structured (None: none). response_format is
    OpenAI's ({"type": "text" | "json_object" | "json_schema", "json_schema": {"schema": ...}}); structured_outputs
    and guided_decoding are vLLM's ({"json": schema} | {"regex": ...} | {"choice": [...]} | {"grammar": ...} |
    {"json_object": true}). JSON text (a file's column) is read as JSON. ValueError naming what is wrong."""
    if isinstance(value, str):
        value = json_value(value, name)
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be an object, got {type(value).__name__}")
    value = {k: v for k, v in value.items() if v is not None}  # an Arrow struct's absent fields
    if name == "response_format":
        kind = value.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return {"type": "json_object"}
        if kind == "json_schema":
            inner = value.get("json_schema") or {}
            schema = inner.get("schema") if isinstance(inner, dict) else None
            schema = json_value(schema, f"{name} json_schema.schema") if isinstance(schema, str) else schema
            if not isinstance(schema, dict):
                raise ValueError("response_format json_schema needs json_schema.schema (an object)")
            return {"type": "json_schema", "schema": schema}
        raise ValueError(f"response_format type must be text, json_object or json_schema, got {kind!r}")
    if len(value) != 1:
        raise ValueError(f"{name} takes one of json, regex, choice, grammar, json_object; got {sorted(value)}")
    (kind, arg), = value.items()
    if kind == "json":
        schema = json_value(arg, f"{name} json") if isinstance(arg, str) else arg
        return {"type": "json_schema", "schema": schema}
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "regex":
        return {"type": "regex", "pattern": arg}
    if kind == "choice":
        if not isinstance(arg, list):
            raise ValueError(f"{name} choice takes a list of strings, got {type(arg).__name__}")
        return {"type": "choice", "choices": list(arg)}
    if kind == "grammar":
        return {"type": "grammar", "grammar": arg}
    raise ValueError(f"{name} takes one of json, regex, choice, grammar, json_object; got {kind!r}")


def json_value(text: str, name: str):
    """text parsed as JSON; ValueError naming `name` when it is not JSON (or nests past the recursion limit)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        raise ValueError(f"{name} is not a JSON object") from None


def token_id(key) -> int | None:
    """A logit_bias key as a token id (JSON's keys are text: ASCII digits only, "²" is no digit here), or None
    when it is not one."""
    if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= len(str(MAX_TOKEN_ID)):
        key = int(key)
    return key if type(key) is int and 0 <= key <= MAX_TOKEN_ID else None


def number_error(value, integer: bool = False) -> str | None:
    """What value must be, when it is not a usable number (an integer, with integer); None when it is."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "a number"
    if integer and not isinstance(value, int):
        return "an integer"
    if isinstance(value, int):  # no float() of a 4,000-digit integer, which overflows
        return None if -INT64 <= value < INT64 else "a number within 64 bits"
    return None if math.isfinite(value) else "a finite number"


def kind_error(name: str, value) -> str | None:
    """What a SUPPORTED parameter must be, when value is not that kind (SamplingParams checks the ranges)."""
    if name in STRUCTURED:
        return None  # structured_spec checks these
    if name == "logit_bias":
        ok = isinstance(value, dict) and all(token_id(k) is not None and number_error(v) is None
                                             for k, v in value.items() if v is not None)
        return None if ok else f"an object of token id (0..{MAX_TOKEN_ID}) -> number"
    if name == "stop_token_ids":
        ok = isinstance(value, list) and all(type(v) is int and 0 <= v <= MAX_TOKEN_ID for v in value)
        return None if ok else "a list of token ids"
    if name == "ignore_eos":
        return None if isinstance(value, bool) else "true or false"
    if name == "stop":
        ok = isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value))
        return None if ok else "a string or a list of strings"
    return number_error(value, integer=name in INTS)
