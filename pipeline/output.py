"""The output directory of a batch job. `pd.read_parquet(<output>)` returns exactly its rows:

    <output>/part-<run>-<seq>.parquet     rows (OUTPUT_SCHEMA), one file per flush; each id once
    <output>/_specee_manifest.json        what the rows were generated with (pipeline.manifest)
    <output>/_specee_lock.json            the job writing the folder now (pipeline.output_lock)
    <output>/_part-….parquet.corrupt      a part file found unreadable, set aside (its rows are generated again)
    <output>/_schedules/v<N>.json         predictor schedules, one per version
    <output>/_summary.json                the last run's summary
    <output>/_exit_layers.png             jobs.analyze's default plot

Parquet readers (pyarrow datasets, pandas, Spark, Ray Data) skip names that start with "_" or
".", so the metadata sits beside the rows without being read as rows.

Durability: a file is written under a dot-prefixed temporary name of its own job
(`.<name>.<tag>.tmp`, so two jobs never touch each other's), fsynced, renamed into place, and the
folder fsynced: a part file counts once its rename is on disk, and a crash never leaves a partial
file that looks complete. Part files carry page checksums. A rerun reads every part file whole
once (OutputDir.index); one that cannot be read is set aside with a warning and its rows count as
not written. A row to be generated again (its request changed, or a retry of error rows) is first
removed from its part file, which is rewritten the same way (OutputDir.drop_rows): every id is in
the folder at most once.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import BinaryIO, Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from specee_core.early_exit.scheduler import Schedule

log = logging.getLogger(__name__)

SCHEDULE_NAME = re.compile(r"^v(\d+)\.json$")
SUMMARY = "_summary.json"
EXIT_PLOT = "_exit_layers.png"
CORRUPT_SUFFIX = ".corrupt"


def fsync_dir(path: Path) -> None:
    """Make the folder's entries (a rename, a new or removed file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def durable_write(path: Path, write: Callable[[BinaryIO], None], tag: str) -> Path:
    """Write path atomically and durably: write(f) into `.<name>.<tag>.tmp`, fsync it, rename it into
    place, fsync the folder."""
    tmp = path.with_name(f".{path.name}.{tag}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def write_parquet(table: pa.Table, f: BinaryIO) -> None:
    pq.write_table(table, f, write_page_checksum=True)


class OutputDir:
    def __init__(self, path: str | Path, tag: str | None = None):
        """tag: names this job's temporary files (default: a new one)."""
        if "://" in str(path):
            raise ValueError(f"output must be a local or mounted directory, got {path}: the driver writes it "
                             f"(sync it to object storage afterwards)")
        self.root = Path(path).resolve()
        self.tag = tag or f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.schedules = self.root / "_schedules"
        self.summary = self.root / SUMMARY
        self.set_aside_files: list[Path] = []  # unreadable part files index() found, as renamed

    def prepare(self) -> None:
        """Create the directory (refusing the layout of an earlier pipeline version)."""
        if (self.root / "parts").is_dir():
            raise ValueError(f"{self.root} was written by an earlier version of the pipeline (rows under parts/, "
                             f"metadata beside them): give this run a new --output")
        self.root.mkdir(parents=True, exist_ok=True)

    def remove_temps(self) -> None:
        """Remove temporary files other jobs left behind. Call it holding the folder's lock: their jobs
        are gone then."""
        for tmp in self.root.glob(".*.tmp"):
            if not tmp.name.endswith(f".{self.tag}.tmp"):
                log.info("removing unfinished %s", tmp.name)
                tmp.unlink(missing_ok=True)

    def part_files(self) -> list[Path]:
        return sorted(self.root.glob("part-*.parquet")) if self.root.is_dir() else []

    def write_part(self, table: pa.Table, name: str) -> Path:
        return durable_write(self.root / name, lambda f: write_parquet(table, f), self.tag)

    def read_rows(self, columns: list[str] | None = None) -> pa.Table | None:
        files = self.part_files()
        if not files:
            return None
        return pa.concat_tables([pq.read_table(f, columns=columns) for f in files], promote_options="default")

    # ---- what is written: checked, indexed, edited ------------------------------------------------
    def index(self) -> OutputIndex:
        """Every row written, read whole and checked once; an unreadable part file is set aside."""
        files, columns = [], []
        for path in self.part_files():
            try:
                table = pq.read_table(path, page_checksum_verification=True)
                if "id" not in table.column_names:
                    raise ValueError("no id column")
            except (pa.ArrowException, OSError, ValueError) as e:
                self.set_aside(path, e)
                continue
            files.append(path)
            columns.append({c: table[c].to_pylist() if c in table.column_names else [None] * table.num_rows
                            for c in ("id", "request_hash", "error")})
        return OutputIndex.of(files, columns)

    def set_aside(self, path: Path, reason: BaseException) -> Path:
        """Rename an unreadable part file to `_<name>.corrupt`: Parquet readers skip it, and its rows are
        no longer written."""
        target = path.with_name(f"_{path.name}{CORRUPT_SUFFIX}")
        if target.exists():
            target = path.with_name(f"_{path.name}.{self.tag}{CORRUPT_SUFFIX}")
        os.replace(path, target)
        fsync_dir(self.root)
        self.set_aside_files.append(target)
        log.warning("part file %s cannot be read (%s: %s): set aside as %s, its rows will be generated again",
                    path.name, type(reason).__name__, str(reason)[:200], target.name)
        return target

    def drop_rows(self, rows: dict[Path, set[int]]) -> int:
        """Remove rows (part file -> row numbers) from their files, each file rewritten atomically (removed
        when no row is left). Returns the rows removed."""
        dropped = 0
        for path, numbers in rows.items():
            table = pq.read_table(path)
            keep = np.ones(table.num_rows, dtype=bool)
            keep[sorted(numbers)] = False
            dropped += int((~keep).sum())
            if keep.any():
                kept = table.filter(pa.array(keep))
                durable_write(path, lambda f: write_parquet(kept, f), self.tag)
            else:
                path.unlink()
                fsync_dir(self.root)
            log.info("%s: removed %d rows to generate again", path.name, int((~keep).sum()))
        return dropped

    # ---- schedules ---------------------------------------------------------------------------
    def schedule_path(self, version: int) -> Path:
        return self.schedules / f"v{version}.json"

    def latest_schedule(self) -> Schedule | None:
        versions = [int(m.group(1)) for p in self.schedules.glob("v*.json") if (m := SCHEDULE_NAME.match(p.name))] \
            if self.schedules.is_dir() else []
        return Schedule.load(self.schedule_path(max(versions))) if versions else None

    def save_schedule(self, schedule: Schedule) -> Path:
        path = self.schedule_path(schedule.version)
        self.schedules.mkdir(parents=True, exist_ok=True)
        self.write_json(path, asdict(schedule))  # what Schedule.save writes, durably
        return path

    def write_json(self, path: Path, data: dict) -> None:
        text = json.dumps(data, indent=2).encode()
        durable_write(path, lambda f: f.write(text), self.tag)

    def write_summary(self, summary: dict) -> None:
        self.write_json(self.summary, summary)


class OutputIndex:
    """The rows of an output folder, one entry per id, sorted by id digest: the digest, the row's
    request hash (16 bytes; empty when the row has none), whether it is an error row, and where it
    is (part file, row number). 37 bytes per row. Rows whose id an earlier row already holds (a
    folder written before ids were kept unique) are listed in `duplicates`."""

    def __init__(self, files: list[Path], digests: np.ndarray, hashes: np.ndarray, errors: np.ndarray,
                 file_no: np.ndarray, row_no: np.ndarray, duplicates: dict[Path, set[int]] | None = None):
        self.files = files
        self.digests, self.hashes, self.errors = digests, hashes, errors  # [N] S16, S16, bool: sorted by digest
        self.file_no, self.row_no = file_no, row_no  # [N] int32: where each row is
        self.duplicates = duplicates or {}

    @classmethod
    def of(cls, files: list[Path], columns: list[dict]) -> OutputIndex:
        """files[k]'s rows are columns[k]: lists of id, request_hash (hex or None) and error."""
        digests = np.array([digest(i) for c in columns for i in c["id"]], dtype="S16")
        hashes = np.array([bytes.fromhex(h) if h else b"" for c in columns for h in c["request_hash"]], dtype="S16")
        errors = np.array([e is not None for c in columns for e in c["error"]], dtype=bool)
        file_no = np.concatenate([np.full(len(c["id"]), k, dtype=np.int32) for k, c in enumerate(columns)]) \
            if columns else np.zeros(0, dtype=np.int32)
        row_no = np.concatenate([np.arange(len(c["id"]), dtype=np.int32) for c in columns]) \
            if columns else np.zeros(0, dtype=np.int32)
        order = np.argsort(digests, kind="stable")  # equal ids keep file order: the first written is kept
        first = np.ones(len(order), dtype=bool)
        first[1:] = digests[order][1:] != digests[order][:-1]
        duplicates: dict[Path, set[int]] = {}
        for i in order[~first]:
            duplicates.setdefault(files[file_no[i]], set()).add(int(row_no[i]))
        keep = order[first]
        return cls(files, digests[keep], hashes[keep], errors[keep], file_no[keep], row_no[keep], duplicates)

    def __len__(self) -> int:
        return len(self.digests)

    def find(self, ids: list[str]) -> np.ndarray:
        """[len(ids)] int: each id's position in the index, -1 where it has no row."""
        if not len(self.digests) or not ids:
            return np.full(len(ids), -1)
        keys = np.array([digest(i) for i in ids], dtype="S16")
        at = np.minimum(np.searchsorted(self.digests, keys), len(self.digests) - 1)
        return np.where(self.digests[at] == keys, at, -1)

    def rows_at(self, positions: np.ndarray) -> dict[Path, set[int]]:
        """Part file -> row numbers of the rows at these positions."""
        out: dict[Path, set[int]] = {}
        for p in positions:
            out.setdefault(self.files[self.file_no[p]], set()).add(int(self.row_no[p]))
        return out

    def done_ids(self, without: np.ndarray | None = None) -> DoneIds:
        """The ids written, less those at positions `without`."""
        if without is None or not len(without):
            return DoneIds(self.digests)
        keep = np.ones(len(self.digests), dtype=bool)
        keep[without] = False
        return DoneIds(self.digests[keep])


class DoneIds:
    """A set of row ids held as sorted 16-byte BLAKE2b digests: 16 bytes per row (1.6 GB at 10^8
    rows, against ~10 GB for a Python set of the strings); a false match needs a 128-bit collision."""

    def __init__(self, digests: np.ndarray):
        self.digests = digests  # sorted, unique, dtype S16

    @classmethod
    def of(cls, id_columns) -> DoneIds:
        parts = [np.array([digest(i) for i in col.to_pylist()], dtype="S16") for col in id_columns]
        parts = [p for p in parts if len(p)]
        return cls(np.unique(np.concatenate(parts)) if parts else np.zeros(0, dtype="S16"))

    def __len__(self) -> int:
        return len(self.digests)

    def __contains__(self, row_id: str) -> bool:
        return bool(self.mask([row_id])[0])

    def mask(self, ids: list[str]) -> np.ndarray:
        """True where the id is in the set."""
        if not len(self.digests) or not ids:
            return np.zeros(len(ids), dtype=bool)
        keys = np.array([digest(i) for i in ids], dtype="S16")
        at = np.minimum(np.searchsorted(self.digests, keys), len(self.digests) - 1)
        return self.digests[at] == keys


def digest(row_id: str) -> bytes:
    return hashlib.blake2b(row_id.encode("utf-8"), digest_size=16).digest()
