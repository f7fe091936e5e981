"""Prompt datasets for the batch pipeline: JSONL, CSV or Parquet files read with Ray Data.

A file holds a `prompt` column and an optional `id` column. Rows without an id get
`<file name>:<row number>` (the name relative to the input directory, rows counted from 0), so
ids are the same on every run and a rerun can skip what is already written. A row may also set its
own sampling (pipeline.sampling: a `sampling_params` object or columns such as `max_tokens`,
`temperature`); the reader passes what it sets on as JSON text in `sampling_params`, so that rows of
any types fit one schema, and the processor reads it. Each row also gets a `request_hash` of its prompt
and its own sampling fields: the batch job stores it with the row's output and regenerates a row
whose request changed under the same id. The reader never fails on a row: a prompt
that is missing or not a string is kept, with the reason in `input_error`, and the generation stage
turns it into an error row ("InputError: ...").
"""
from __future__ import annotations

import hashlib
import io
import json
import logging
import posixpath
import warnings
from pathlib import Path
from typing import Iterator

import pyarrow as pa
import ray.data
from ray.data.datasource import FileBasedDatasource

from pipeline.sampling import COLUMN as SAMPLING_COLUMN, ROW_COLUMNS as SAMPLING_COLUMNS, row_fields

log = logging.getLogger(__name__)

# What the reader yields: one row per input row, bad ones included. sampling_params: the row's own
# sampling fields as JSON text (null: none; pipeline.sampling.row_fields); request_hash: request_hash().
PROMPT_SCHEMA = pa.schema([("id", pa.string()), ("prompt", pa.string()), ("input_error", pa.string()),
                           ("sampling_params", pa.string()), ("request_hash", pa.string())])
FORMATS = {"jsonl": ("jsonl", "json"), "csv": ("csv",), "parquet": ("parquet",)}
ROWS_PER_BLOCK = 1024
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
                 **file_based_kwargs):
        if fmt not in FORMATS:
            raise ValueError(f"input format must be one of {sorted(FORMATS)}, got {fmt!r}")
        super().__init__(paths, file_extensions=list(FORMATS[fmt]), **file_based_kwargs)
        self._fmt = fmt
        self._root = id_root(paths)
        self._prompt_column = prompt_column
        self._id_column = id_column

    def _open_input_source(self, filesystem, path: str, **open_args) -> pa.NativeFile:
        if self._fmt == "parquet":  # the footer is at the end: Parquet needs random access
            return filesystem.open_input_file(path)
        return super()._open_input_source(filesystem, path, **open_args)

    def _read_stream(self, f: pa.NativeFile, path: str) -> Iterator[pa.Table]:
        name = posixpath.relpath(path, self._root) if self._root and path.startswith(self._root) else \
            posixpath.basename(path)
        chunks = {"jsonl": self._jsonl_records, "csv": self._csv_records, "parquet": self._parquet_records}
        row = 0
        for records in chunks[self._fmt](f, path):
            yield to_prompt_table(records, name, row, self._prompt_column, self._id_column)
            row += len(records)

    def _jsonl_records(self, f: pa.NativeFile, path: str) -> Iterator[list[dict]]:
        records = []
        for line in io.TextIOWrapper(f, encoding="utf-8", errors="replace"):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                rec = {"__input_error": f"invalid JSON ({e.msg} at column {e.colno})"}
            if not isinstance(rec, dict):
                rec = {"__input_error": f"expected a JSON object per line, got {type(rec).__name__}"}
            records.append(rec)
            if len(records) == ROWS_PER_BLOCK:
                yield records
                records = []
        if records:
            yield records

    def _csv_records(self, f: pa.NativeFile, path: str) -> Iterator[list[dict]]:
        from pyarrow import csv

        # Keep both columns as text: a column of numbers must not turn ids or prompts into ints.
        types = {self._prompt_column: pa.string(), self._id_column: pa.string()}
        reader = csv.open_csv(f, convert_options=csv.ConvertOptions(column_types=types))
        self._check_columns(reader.schema.names, path)
        for batch in reader:
            yield batch.to_pylist()

    def _parquet_records(self, f: pa.NativeFile, path: str) -> Iterator[list[dict]]:
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(f)
        names = pf.schema_arrow.names
        self._check_columns(names, path)
        columns = [c for c in (self._id_column, self._prompt_column, SAMPLING_COLUMN, *SAMPLING_COLUMNS)
                   if c in names]
        for batch in pf.iter_batches(batch_size=ROWS_PER_BLOCK, columns=columns):
            yield batch.to_pylist()

    def _check_columns(self, names: list[str], path: str) -> None:
        if self._prompt_column not in names:
            raise ValueError(f"{path}: no {self._prompt_column!r} column (columns: {names})")


def to_prompt_table(records: list[dict], name: str, start: int, prompt_column: str = "prompt",
                    id_column: str = "id") -> pa.Table:
    """PROMPT_SCHEMA rows from parsed records; records[k] is row start + k of file `name`."""
    ids, prompts, errors, sampling, hashes = [], [], [], [], []
    for k, rec in enumerate(records):
        rid, prompt = rec.get(id_column), rec.get(prompt_column)
        error = rec.get("__input_error")
        if error is None and prompt is None:
            error = f"no {prompt_column!r} value"
        elif error is None and not isinstance(prompt, str):
            error = f"prompt must be a string, got {type(prompt).__name__}"
        fields = None
        if error is None:
            try:
                fields = row_fields(rec)
            except ValueError as e:
                error = str(e)
        ids.append(f"{name}:{start + k}" if rid is None or rid == "" else str(rid))
        prompts.append(prompt if error is None else None)
        errors.append(error)
        # values of any type (a bad one included) as text: repr for what JSON cannot hold, and the
        # processor says what is wrong with it
        sampling.append(json.dumps(fields, default=repr) if fields else None)
        hashes.append(request_hash(prompt, fields))
    return pa.table({"id": ids, "prompt": prompts, "input_error": errors, "sampling_params": sampling,
                     "request_hash": hashes}, schema=PROMPT_SCHEMA)


def request_hash(prompt, sampling: dict | None) -> str:
    """What a row asks for, as 32 hex digits: its prompt as read (any type) and its own sampling fields,
    independent of their order. Job-level settings are not in it (pipeline.manifest compares those)."""
    text = json.dumps([prompt, sampling or {}], sort_keys=True, default=repr, ensure_ascii=False)
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).hexdigest()


def read_prompts(paths: str | list[str], *, input_format: str | None = None, prompt_column: str = "prompt",
                 id_column: str = "id", limit: int | None = None) -> ray.data.Dataset:
    """The prompt rows (PROMPT_SCHEMA) of paths (files or directories), as a lazy stream.

    Local paths are read on the driver's node, so a file that exists only there (e.g. in a
    `ray job submit --working-dir`) is still found on a cluster. With limit, the first `limit`
    rows in file order are kept (deterministic across reruns: the dataset preserves order)."""
    paths = [paths] if isinstance(paths, str) else list(paths)
    if not paths:
        raise ValueError("no input paths given")
    fmt = input_format or infer_format(paths)
    paths = [p if "://" in p else str(Path(p).resolve()) for p in paths]
    source = PromptDatasource(paths, fmt=fmt, prompt_column=prompt_column, id_column=id_column)
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
