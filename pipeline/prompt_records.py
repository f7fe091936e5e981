"""Prompt files to records, row by row: what one row holds never costs another row.

Each reader yields lists of records in file order, one per input row (the rows that default ids count): a
dict of the row's fields, or a BadRow saying why the row could not be read (with the fields that could be,
for its id). What a damaged file holds before the damage is read; the damage itself raises, and
pipeline.prompts names the file in the job's report.

- JSONL: one JSON object per line (blank lines are skipped and not counted). Lines are read as bytes and no
  more than max_line_bytes of one are held: a longer line is skipped unparsed. A line that is not valid
  UTF-8 is a BadRow naming the byte; its text is decoded with surrogateescape so that its id still reads.
- CSV: Python's csv module (strict about quotes) over the same bounded lines. pyarrow's CSV reader fails a
  whole block on one malformed row, and its skip handler drops the row without its place among the rows,
  which default ids count; here a record that does not parse (an unclosed quote, a line past the limit) is
  a BadRow for its first line and parsing starts again at the line after it, and a row with the wrong
  number of fields is a BadRow. Cells of sampling columns are read as numbers or booleans where they parse
  as such (pyarrow's inference did the same per column), as text otherwise.
- Parquet: pyarrow, a batch at a time; a batch holding text that is not valid UTF-8 is read row by row.
"""
from __future__ import annotations

import codecs
import csv
import io
import json
import re
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterator

import pyarrow as pa

ROWS_PER_BLOCK = 1024
# csv cells that mean "not set" in a sampling column (pyarrow's null values, the common ones)
CSV_NULLS = frozenset({"", "null", "NULL", "NA", "N/A", "n/a", "NaN", "nan", "None"})
CSV_BOOLS = {"true": True, "True": True, "TRUE": True, "false": False, "False": False, "FALSE": False}
CSV_INT = re.compile(r"[+-]?[0-9]{1,18}")  # within int64, so no cell reaches an unbounded int()
CSV_FLOAT = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")


@dataclass
class BadRow:
    """A row the reader could not read: why, and the fields it could read (for the row's id), if any."""
    reason: str
    fields: dict | None = None


class LineTooLong(ValueError):
    def __init__(self, length: int, limit: int):
        super().__init__(f"a line of {length:,} bytes, more than the {limit:,} a row may take")


class MissingColumn(ValueError):
    """The file has no prompt column: the job stops before any work (most likely a wrong prompt column name)."""


def lines(f, max_bytes: int) -> Iterator[bytes | int]:
    """f's lines as bytes with their line ends; a line longer than max_bytes as its length in bytes, skipped
    without ever holding more than max_bytes of it."""
    buf = io.BufferedReader(f, buffer_size=1 << 20)
    while line := buf.readline(max_bytes + 1):
        if len(line) <= max_bytes or line.endswith(b"\n"):
            yield line
            continue
        length = len(line)
        while not line.endswith(b"\n") and (line := buf.readline(1 << 20)):
            length += len(line)
        yield length


def decode(line: bytes) -> tuple[str, str | None]:
    """The line's text and, when it is not valid UTF-8, what is wrong (the text then holds the bad bytes as
    surrogates, which every later check refuses)."""
    try:
        return line.decode("utf-8"), None
    except UnicodeDecodeError as e:
        return (line.decode("utf-8", "surrogateescape"),
                f"the row is not valid UTF-8 (byte 0x{line[e.start]:02x} at byte {e.start} of its line)")


def jsonl_records(f, max_line_bytes: int) -> Iterator[list]:
    records = []
    for k, line in enumerate(lines(f, max_line_bytes)):
        if isinstance(line, int):
            rec = BadRow(str(LineTooLong(line, max_line_bytes)))
        else:
            if k == 0:
                line = line.removeprefix(codecs.BOM_UTF8)
            if not line.strip():
                continue
            rec = json_record(line)
        records.append(rec)
        if len(records) == ROWS_PER_BLOCK:
            yield records
            records = []
    if records:
        yield records


def json_record(line: bytes) -> dict | BadRow:
    text, wrong = decode(line)
    try:
        rec = json.loads(text)
    except json.JSONDecodeError as e:
        return BadRow(wrong or f"invalid JSON ({e.msg} at column {e.colno})")
    except (ValueError, RecursionError) as e:  # an integer past 4300 digits, nesting past the recursion limit
        return BadRow(wrong or f"invalid JSON ({str(e)[:200]})")
    if not isinstance(rec, dict):
        return BadRow(wrong or f"expected a JSON object per line, got {type(rec).__name__}")
    return rec if wrong is None else BadRow(wrong, rec)


@dataclass
class Lines:
    """Decoded lines for csv.reader, keeping those of the record being read: a record that fails is given
    back less its first line, and a record may hold at most max_bytes."""
    raw: Iterator[bytes | int]
    max_bytes: int
    pending: deque = field(default_factory=deque)  # (text, what is wrong) given back, read before raw
    taken: list = field(default_factory=list)  # (text, what is wrong) of the record being read
    taken_bytes: int = 0

    def __iter__(self):
        return self

    def __next__(self) -> str:
        if self.pending:
            line = self.pending.popleft()
        else:
            raw = next(self.raw)
            if isinstance(raw, int):
                raise LineTooLong(raw, self.max_bytes)
            line = decode(raw)
        self.taken.append(line)
        self.taken_bytes += len(line[0])
        if self.taken_bytes > self.max_bytes:
            raise LineTooLong(self.taken_bytes, self.max_bytes)
        return line[0]

    def done(self) -> str | None:
        """The record was read: what is wrong with its bytes, if anything."""
        wrong = next((w for _, w in self.taken if w), None)
        self.taken, self.taken_bytes = [], 0
        return wrong

    def give_back(self) -> None:
        """The record failed: its lines after the first are read again, as the next records."""
        self.pending.extendleft(reversed(self.taken[1:]))
        self.taken, self.taken_bytes = [], 0


def csv_records(f, max_line_bytes: int, check: Callable[[list[str]], None], text_columns: tuple[str, ...],
                columns: tuple[str, ...]) -> Iterator[list]:
    """Records of the CSV file f: text_columns (id, prompt) as text, the other `columns` (sampling) by
    csv_value; columns the job does not read are left out. check(header) raises for a header without the
    prompt column."""
    # csv's field limit is a process-wide setting; the reader tasks run nothing else that reads CSV
    csv.field_size_limit(max(csv.field_size_limit(), max_line_bytes))
    source = Lines(lines(f, max_line_bytes), max_line_bytes)
    reader = csv.reader(source, strict=True)
    header, records = None, []
    while True:
        try:
            row = next(reader)
        except StopIteration:
            break
        except (csv.Error, LineTooLong) as e:
            if header is None:
                raise
            source.give_back()
            records.append(BadRow(f"a malformed CSV row ({e})"))
        else:
            wrong = source.done()
            if header is None:
                header = [name.removeprefix("\ufeff") if k == 0 else name for k, name in enumerate(row)]
                check(header)
                continue
            if not row:  # a blank line: not a row
                continue
            if wrong is not None:
                records.append(BadRow(wrong, csv_fields(header, row, text_columns, columns)))
            elif len(row) != len(header):
                records.append(BadRow(f"a CSV row of {len(row)} fields under a header of {len(header)}"))
            else:
                records.append(csv_fields(header, row, text_columns, columns))
        if len(records) == ROWS_PER_BLOCK:
            yield records
            records = []
    if records:
        yield records


def csv_fields(header: list[str], row: list[str], text_columns: tuple[str, ...], columns: tuple[str, ...]) -> dict:
    return {name: cell if name in text_columns else csv_value(cell) for name, cell in zip(header, row)
            if name in text_columns or name in columns}


def csv_value(cell: str):
    """A sampling column's cell: None, a bool, an int (within int64), a float, or the text itself."""
    if cell in CSV_NULLS:
        return None
    if cell in CSV_BOOLS:
        return CSV_BOOLS[cell]
    if CSV_INT.fullmatch(cell):
        return int(cell)
    if CSV_FLOAT.fullmatch(cell):
        return float(cell)
    return cell


def parquet_records(f, check: Callable[[list[str]], None], columns: tuple[str, ...]) -> Iterator[list]:
    """Records of the Parquet file f, `columns` only (those it has)."""
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(f)
    names = pf.schema_arrow.names
    check(names)
    for batch in pf.iter_batches(batch_size=ROWS_PER_BLOCK, columns=[c for c in columns if c in names]):
        try:
            yield batch.to_pylist()
        except UnicodeDecodeError:  # a writer that did not check its text: only its rows are lost
            yield [parquet_row(batch, i) for i in range(batch.num_rows)]


def parquet_row(batch: pa.RecordBatch, i: int) -> dict | BadRow:
    try:
        return batch.slice(i, 1).to_pylist()[0]
    except UnicodeDecodeError as e:
        return BadRow(f"the row holds text that is not valid UTF-8 ({e.reason} at byte {e.start})")
