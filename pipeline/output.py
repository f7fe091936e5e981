"""The output directory of a batch job.

    <output>/parts/part-<run>-w<wave>-<seq>.parquet   rows (OUTPUT_SCHEMA), one file per flush
    <output>/schedules/v<N>.json                       predictor schedules, one per version
    <output>/summary.json                              the last run's summary

A part file is written under a dot-prefixed temporary name and renamed when complete: readers
(pyarrow, pandas, Ray Data) skip dot files, so a crash never leaves a partial file that looks
complete, and a rerun treats exactly the rows of complete files as done.
"""
from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from specee_core.scheduler import Schedule

log = logging.getLogger(__name__)

SCHEDULE_NAME = re.compile(r"^v(\d+)\.json$")


class OutputDir:
    def __init__(self, path: str | Path):
        if "://" in str(path):
            raise ValueError(f"output must be a local or mounted directory, got {path}: the driver writes it "
                             f"(sync it to object storage afterwards)")
        self.root = Path(path).resolve()
        self.parts = self.root / "parts"
        self.schedules = self.root / "schedules"

    def prepare(self) -> None:
        """Create the directories and remove temporary files a crashed run left behind."""
        self.parts.mkdir(parents=True, exist_ok=True)
        for tmp in self.parts.glob(".*.tmp"):
            log.info("removing unfinished part %s", tmp.name)
            tmp.unlink()

    def part_files(self) -> list[Path]:
        return sorted(self.parts.glob("part-*.parquet")) if self.parts.is_dir() else []

    def done_ids(self) -> frozenset[str]:
        """Ids of every row already written (error rows included: they would fail again)."""
        ids: set[str] = set()
        for f in self.part_files():
            ids.update(pq.read_table(f, columns=["id"])["id"].to_pylist())
        return frozenset(ids)

    def write_part(self, table: pa.Table, name: str) -> Path:
        final = self.parts / name
        tmp = self.parts / f".{name}.tmp"
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
        tmp = self.root / ".summary.json.tmp"
        tmp.write_text(json.dumps(summary, indent=2))
        os.replace(tmp, self.root / "summary.json")
