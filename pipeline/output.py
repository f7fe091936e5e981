"""The output directory of a batch job. `pd.read_parquet(<output>)` returns exactly its rows:

    <output>/part-<run>-<seq>.parquet   rows (OUTPUT_SCHEMA), one file per flush
    <output>/_schedules/v<N>.json       predictor schedules, one per version
    <output>/_summary.json              the last run's summary
    <output>/_exit_layers.png           jobs.analyze's default plot

Parquet readers (pyarrow datasets, pandas, Spark, Ray Data) skip names that start with "_" or
".", so the metadata sits beside the rows without being read as rows. A part file is written
under a dot-prefixed temporary name and renamed when complete: a crash never leaves a partial
file that looks complete, and a rerun treats exactly the rows of complete files as done.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from specee_core.early_exit.scheduler import Schedule

log = logging.getLogger(__name__)

SCHEDULE_NAME = re.compile(r"^v(\d+)\.json$")
SUMMARY = "_summary.json"
EXIT_PLOT = "_exit_layers.png"


class OutputDir:
    def __init__(self, path: str | Path):
        if "://" in str(path):
            raise ValueError(f"output must be a local or mounted directory, got {path}: the driver writes it "
                             f"(sync it to object storage afterwards)")
        self.root = Path(path).resolve()
        self.schedules = self.root / "_schedules"
        self.summary = self.root / SUMMARY

    def prepare(self) -> None:
        """Create the directory and remove temporary files a crashed run left behind."""
        if (self.root / "parts").is_dir():
            raise ValueError(f"{self.root} was written by an earlier version of the pipeline (rows under parts/, "
                             f"metadata beside them): give this run a new --output")
        self.root.mkdir(parents=True, exist_ok=True)
        for tmp in self.root.glob(".part-*.tmp"):
            log.info("removing unfinished part %s", tmp.name)
            tmp.unlink()

    def part_files(self) -> list[Path]:
        return sorted(self.root.glob("part-*.parquet")) if self.root.is_dir() else []

    def done_ids(self) -> DoneIds:
        """Ids of every row already written (error rows included: they would fail again)."""
        return DoneIds.of(pq.read_table(f, columns=["id"])["id"] for f in self.part_files())

    def write_part(self, table: pa.Table, name: str) -> Path:
        final = self.root / name
        tmp = self.root / f".{name}.tmp"
        pq.write_table(table, tmp)
        os.replace(tmp, final)  # atomic: the file appears complete or not at all
        return final

    def read_rows(self, columns: list[str] | None = None) -> pa.Table | None:
        files = self.part_files()
        if not files:
            return None
        return pa.concat_tables([pq.read_table(f, columns=columns) for f in files], promote_options="default")

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
        schedule.save(path)
        return path

    def write_summary(self, summary: dict) -> None:
        tmp = self.root / f".{SUMMARY}.tmp"
        tmp.write_text(json.dumps(summary, indent=2))
        os.replace(tmp, self.summary)


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
