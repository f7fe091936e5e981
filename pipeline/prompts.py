"""Prompt datasets for the batch pipeline: JSONL, CSV or Parquet files read with Ray Data.

A file holds a `prompt` column and an optional `id` column. Rows without an id get
`<file name>:<row number>` (the name relative to the input directory, rows counted from 0), so
ids are the same on every run and a rerun can skip what is already written. A row may also set its
own sampling (pipeline.sampling: a `sampling_params` object or columns such as `max_tokens`,
`temperature`); the reader passes what it sets on as JSON text in `sampling_params`, so that rows of
any types fit one schema, and the processor reads it. Each row also gets a `request_hash` of its prompt
and its own sampling fields: the batch job stores it with the row's output and regenerates a row
whose request changed under the same id.

The reader never fails on a row (pipeline.prompt_records reads each format row by row): a row that
cannot be read, a prompt that is missing, not a string, not valid Unicode or longer than
max_prompt_chars, or an id that cannot be one is kept, with the reason in `input_error`, and the
generation stage turns it into an error row ("InputError: ..."). A too-long prompt is measured before
it is hashed whole or tokenized, and a row with an error keeps at most ERROR_PROMPT_CHARS of its
prompt. A file that cannot be read to its end (truncated, corrupt, not its format) gives the rows
before the damage and then one row naming it in `file_error`, which the job reports and never runs;
a file without the prompt column stops the read (MissingColumn).
"""
from __future__ import annotations

import csv
import functools
import hashlib
import json
import logging
import posixpath
import warnings
from pathlib import Path
from typing import Iterator

import pyarrow as pa
import pyarrow.compute as pc
import ray.data
from ray.data.datasource import FileBasedDatasource

from pipeline.prompt_records import BadRow, MissingColumn, csv_records, jsonl_records, parquet_records
from pipeline.sampling import COLUMN as SAMPLING_COLUMN, ROW_COLUMNS as SAMPLING_COLUMNS, row_fields

log = logging.getLogger(__name__)

# What the reader yields: one row per input row, bad ones included. sampling_params: the row's own
# sampling fields as JSON text (null: none; pipeline.sampling.row_fields); request_hash: request_hash().
# file_error: set only on the one row that stands for a file that could not be read to its end (its id is
# the file's name; unreadable_files)
PROMPT_SCHEMA = pa.schema([("id", pa.string()), ("prompt", pa.string()), ("input_error", pa.string()),
                           ("sampling_params", pa.string()), ("request_hash", pa.string()),
                           ("file_error", pa.string())])
FORMATS = {"jsonl": ("jsonl", "json"), "csv": ("csv",), "parquet": ("parquet",)}
# A longer prompt is refused (an error row) before it is hashed whole or tokenized: more text than a
# 128k-token context holds, so no prompt a model here can run is refused
MAX_PROMPT_CHARS = 1_000_000
# An error row keeps at most this much of its prompt (at most 256 KiB of UTF-8): enough to tell which it was
ERROR_PROMPT_CHARS = 65_536
ERROR_TEXT_CHARS = 4_096  # and of its error message, which may quote a value of the row
MAX_ID_CHARS = 4_096  # a longer id makes its row an error row under <file>:<row>
# JSON may spend 12 bytes on one character ("\ud83d\ude00"): a line this long holds any prompt within the
# limit, plus room for its id and sampling; a longer line is skipped unparsed (its row an error row)
JSON_BYTES_PER_CHAR = 12
LINE_SLACK_BYTES = 1 << 20
READ_TASKS = 4  # concurrent read tasks (each reads whole files)
# Ray Data warns, when the stream starts, that fewer files than READ_TASKS cannot use them all: true, harmless
warnings.filterwarnings("ignore", message="The maximum number of concurrent tasks", category=UserWarning)
NODE_ID_LABEL = "ray.io/node-id"  # every Ray node carries its id under this label


def infer_format(paths: list[str]) -> str:
    """The format named by the files' extensions (a local directory is looked into)."""
    suffixes = set()
    for p in paths:
        local = Path(strip_scheme(p))
        files = sorted(local.iterdir()) if local.is_dir() else [local]
        suffixes |= {f.suffix.lstrip(".").lower() for f in files if not f.name.startswith((".", "_"))}
    found = {fmt for fmt, exts in FORMATS.items() if suffixes & set(exts)}
    if len(found) != 1:
        raise ValueError(f"cannot tell the input format of {paths} from the extensions {sorted(suffixes)}: "
                         f"pass input_format, one of {sorted(FORMATS)}")
    return found.pop()


def strip_scheme(path: str) -> str:
    return path.split("://", 1)[1] if "://" in path else path


def id_root(paths: list[str]) -> str:
    """The directory that file names in default ids are relative to (scheme stripped, as Ray
    Data hands paths to the reader)."""
    dirs = []
    for p in paths:
        bare = strip_scheme(p)
        is_dir = Path(bare).is_dir() if "://" not in p else not posixpath.splitext(bare)[1]
        dirs.append(bare.rstrip("/") if is_dir else posixpath.dirname(bare))
    return posixpath.commonpath(dirs) if dirs else ""


class PromptDatasource(FileBasedDatasource):
    """Reads prompt files in order, numbering rows per file, into PROMPT_SCHEMA blocks."""

    def __init__(self, paths: list[str], *, fmt: str, prompt_column: str = "prompt", id_column: str = "id",
                 max_prompt_chars: int = MAX_PROMPT_CHARS, **file_based_kwargs):
        if fmt not in FORMATS:
            raise ValueError(f"input format must be one of {sorted(FORMATS)}, got {fmt!r}")
        super().__init__(paths, file_extensions=list(FORMATS[fmt]), **file_based_kwargs)
        self._fmt = fmt
        self._root = id_root(paths)
        self._prompt_column = prompt_column
        self._id_column = id_column
        self._max_prompt_chars = max_prompt_chars
        self._unopened: dict[str, OSError] = {}  # path -> why it could not be opened (in one read task)

    def _open_input_source(self, filesystem, path: str, **open_args) -> pa.NativeFile:
        try:
            if self._fmt == "parquet":  # the footer is at the end: Parquet needs random access
                return filesystem.open_input_file(path)
            return super()._open_input_source(filesystem, path, **open_args)
        except (FileNotFoundError, PermissionError, IsADirectoryError) as e:  # gone or closed since it was listed
            self._unopened[path] = e
            return pa.BufferReader(b"")

    def _read_stream(self, f: pa.NativeFile, path: str) -> Iterator[pa.Table]:
        name = posixpath.relpath(path, self._root) if self._root and path.startswith(self._root) else \
            posixpath.basename(path)
        row = 0
        try:
            if path in self._unopened:
                raise self._unopened.pop(path)
            for records in self._records(f, path):
                yield to_prompt_table(records, name, row, self._prompt_column, self._id_column,
                                      self._max_prompt_chars)
                row += len(records)
        except MissingColumn:
            raise
        except (pa.ArrowException, OSError, ValueError, EOFError, csv.Error) as e:
            if any(p in str(e) for p in self._data_context.retried_io_errors):
                raise  # Ray Data reads the file again
            reason = f"{type(e).__name__}: {str(e)[:ERROR_TEXT_CHARS]}"
            log.warning("input file %s cannot be read past row %d (%s): its later rows are not generated",
                        name, row, reason)
            yield file_error_table(name, f"{reason} (after {row} rows)")

    def _records(self, f: pa.NativeFile, path: str) -> Iterator[list]:
        sampling = (SAMPLING_COLUMN, *SAMPLING_COLUMNS)
        line_bytes = JSON_BYTES_PER_CHAR * self._max_prompt_chars + LINE_SLACK_BYTES
        if self._fmt == "jsonl":
            return jsonl_records(f, line_bytes)
        check = functools.partial(self._check_columns, path=path)
        if self._fmt == "csv":
            return csv_records(f, line_bytes, check, (self._id_column, self._prompt_column), sampling)
        return parquet_records(f, check, (self._id_column, self._prompt_column, *sampling))

    def _check_columns(self, names: list[str], path: str) -> None:
        if self._prompt_column not in names:
            raise MissingColumn(f"{path}: no {self._prompt_column!r} column (columns: {names[:50]})")


def to_prompt_table(records: list, name: str, start: int, prompt_column: str = "prompt", id_column: str = "id",
                    max_prompt_chars: int = MAX_PROMPT_CHARS) -> pa.Table:
    """PROMPT_SCHEMA rows from parsed records (dicts, or BadRow); records[k] is row start + k of file
    `name`. Total: whatever a record holds, it becomes one row."""
    rows = [prompt_row(rec, f"{name}:{start + k}", prompt_column, id_column, max_prompt_chars)
            for k, rec in enumerate(records)]
    columns = list(zip(*rows)) if rows else [()] * 5
    return pa.table({"id": columns[0], "prompt": columns[1], "input_error": columns[2], "sampling_params": columns[3],
                     "request_hash": columns[4], "file_error": [None] * len(rows)}, schema=PROMPT_SCHEMA)


def prompt_row(rec: dict | BadRow, default_id: str, prompt_column: str, id_column: str,
               max_prompt_chars: int) -> tuple:
    """(id, prompt, input_error, sampling_params, request_hash) of one record, every text valid Unicode."""
    error = None
    if isinstance(rec, BadRow):
        error, rec = rec.reason, rec.fields or {}
    rid, id_error = row_id(rec.get(id_column), default_id)
    prompt = rec.get(prompt_column)
    too_long = isinstance(prompt, str) and len(prompt) > max_prompt_chars
    error = error or id_error
    if error is None and prompt is None:
        error = f"no {prompt_column!r} value"
    elif error is None and not isinstance(prompt, str):
        error = f"prompt must be a string, got {type(prompt).__name__}"
    elif error is None and too_long:
        error = f"the prompt has {len(prompt):,} characters, more than max_prompt_chars={max_prompt_chars:,}"
    elif error is None:
        error = text_error(prompt, "the prompt")
    fields = None
    if error is None:
        try:
            fields = row_fields(rec)
            error = text_error(json.dumps(fields, ensure_ascii=False, default=repr), "the row's sampling")
        except (ValueError, TypeError, RecursionError) as e:
            error, fields = str(e), None
    # a prompt past the limit is hashed by its length and first characters: an edit that changes neither
    # leaves an error row that the edit would not have made a good one
    asked = {"prompt_chars": len(prompt), "prompt_prefix": prompt[:ERROR_PROMPT_CHARS]} if too_long else prompt
    try:
        digest = request_hash(asked, fields)
    except (ValueError, TypeError, RecursionError):  # only a row refused above gets here: no request to compare
        digest = request_hash(f"unhashable {type(prompt).__name__}", None)
    # values of any type (a bad one included) as text: repr for what JSON cannot hold, and the
    # processor says what is wrong with it
    sampling = json.dumps(fields, default=repr) if fields else None
    if error is None:
        return rid, prompt, None, sampling, digest
    shown = valid_text(prompt[:ERROR_PROMPT_CHARS]) if isinstance(prompt, str) else None
    return rid, shown, valid_text(bounded(error, ERROR_TEXT_CHARS)), sampling, digest


def row_id(value, default: str) -> tuple[str, str | None]:
    """The row's id and, for a value that cannot be one, the reason (the row then takes the default id)."""
    if value is None or (isinstance(value, str) and not value):
        return default, None
    try:
        text = value if isinstance(value, str) else str(value)
    except ValueError as e:  # an int past Python's digit limit for str()
        return default, f"the id cannot be read as text ({e})"
    if len(text) > MAX_ID_CHARS:
        return default, f"the id has {len(text):,} characters, more than {MAX_ID_CHARS:,}"
    wrong = text_error(text, "the id")
    return (default, wrong) if wrong else (text, None)


def text_error(text: str, what: str) -> str | None:
    """Why text is not valid Unicode (a lone surrogate: JSON's "\\ud83d" escape, UTF-16 cut mid-pair), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"{what} is not valid Unicode: a lone surrogate U+{ord(text[e.start]):04X} at character {e.start:,}"
    return None


def valid_text(text: str) -> str:
    """text with any lone surrogate written as its escape (\\ud83d), so that it can be stored."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def bounded(text: str, chars: int) -> str:
    return text if len(text) <= chars else text[:chars] + "…"


def file_error_table(name: str, reason: str) -> pa.Table:
    """The row standing for a file that could not be read to its end (unreadable_files)."""
    return pa.table({"id": [name], "prompt": [None], "input_error": [None], "sampling_params": [None],
                     "request_hash": [None], "file_error": [valid_text(reason)]}, schema=PROMPT_SCHEMA)


def unreadable_files(block: pa.Table) -> list[dict]:
    """The files in block that could not be read to their end: [{"file", "error"}]."""
    if "file_error" not in block.column_names or block["file_error"].null_count == block.num_rows:
        return []
    bad = block.filter(pc.is_valid(block["file_error"]))
    return [{"file": f, "error": e} for f, e in zip(bad["id"].to_pylist(), bad["file_error"].to_pylist())]


def prompt_rows(block: pa.Table) -> pa.Table:
    """block's prompt rows: without the rows standing for unreadable files, and without their column."""
    if "file_error" not in block.column_names:
        return block
    rows = block.filter(pc.is_null(block["file_error"])) if block["file_error"].null_count < block.num_rows else block
    return rows.drop_columns(["file_error"])


def request_hash(prompt, sampling: dict | None) -> str:
    """What a row asks for, as 32 hex digits: its prompt as read (any type) and its own sampling fields,
    independent of their order. Job-level settings are not in it (pipeline.manifest compares those). A lone
    surrogate is hashed as such (surrogatepass), so a row that holds one hashes the same on every run."""
    text = json.dumps([prompt, sampling or {}], sort_keys=True, default=repr, ensure_ascii=False)
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def read_prompts(paths: str | list[str], *, input_format: str | None = None, prompt_column: str = "prompt",
                 id_column: str = "id", limit: int | None = None,
                 max_prompt_chars: int = MAX_PROMPT_CHARS) -> ray.data.Dataset:
    """The prompt rows (PROMPT_SCHEMA) of paths (files or directories), as a lazy stream.

    Local paths are read on the driver's node, so a file that exists only there (e.g. in a
    `ray job submit --working-dir`) is still found on a cluster. With limit, the first `limit`
    rows in file order are kept (deterministic across reruns: the dataset preserves order). A prompt longer
    than max_prompt_chars characters is an error row."""
    paths = [paths] if isinstance(paths, str) else list(paths)
    if not paths:
        raise ValueError("no input paths given")
    if not isinstance(max_prompt_chars, int) or max_prompt_chars < 1:
        raise ValueError(f"max_prompt_chars must be an int >= 1, got {max_prompt_chars!r}")
    fmt = input_format or infer_format(paths)
    paths = [p if "://" in p else str(Path(p).resolve()) for p in paths]
    source = PromptDatasource(paths, fmt=fmt, prompt_column=prompt_column, id_column=id_column,
                              max_prompt_chars=max_prompt_chars)
    pin = {}
    if any("://" not in p for p in paths):  # local files may exist on this node only
        pin["label_selector"] = {NODE_ID_LABEL: ray.get_runtime_context().get_node_id()}
    # No CPUs for the read tasks: parsing text is light next to generation, and the engine actors may
    # hold every CPU of the cluster while the stream still has to be read.
    ds = ray.data.read_datasource(source, num_cpus=0, concurrency=READ_TASKS, **pin)
    if limit is not None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        ds.context.execution_options.preserve_order = True
        ds = ds.limit(limit)
    return ds
