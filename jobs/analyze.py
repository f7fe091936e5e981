"""Statistics of a batch generation output directory (jobs.generate), per run and per schedule
version, and a PNG of the exit-layer histogram.

    python -m jobs.analyze out/gen                 # tables on stdout, JSON at the end
    python -m jobs.analyze out/gen --png hist.png  # default: <output>/_exit_layers.png

avg_layers is per generated token (rows weighted by their tokens). tokens_per_s has the meaning
it has in the progress bar and _summary.json: generated tokens over the seconds from the group's
first engine batch start to its last batch end (for a run: the job's throughput; schedule versions
overlap in time across actors, so theirs is the rate while that version was in use).
latency_s and ttft_s are the rows' own (from their engine batch's start).
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from pipeline.output import EXIT_PLOT
from specee_core.early_exit.calibration import upper_bound


@dataclass
class AnalyzeConfig:
    output: Path
    png: Path | None = None  # None: <output>/exit_layers.png

    def __post_init__(self) -> None:
        self.output = Path(self.output)
        if not self.output.is_dir():
            raise FileNotFoundError(f"output directory not found: {self.output}")
        if not any(self.output.glob("part-*.parquet")):
            raise FileNotFoundError(f"{self.output} is not a batch output directory (no part-*.parquet in it)")
        self.png = Path(self.png) if self.png else self.output / EXIT_PLOT


def load_rows(output: Path) -> pd.DataFrame:
    return pd.read_parquet(output)


def group_stats(df: pd.DataFrame, by: str) -> pd.DataFrame:
    """rows, errors, tokens, avg layers (per token), tokens/s, and median row latency and time to
    first token for each value of column `by`."""
    ok = df[df["error"].isna()]
    g_all = df.groupby(by, dropna=False)
    g_ok = ok.groupby(by, dropna=False)
    tokens = g_ok["completion_tokens"].sum()
    layer_tokens = (ok["avg_layers"] * ok["completion_tokens"]).groupby(ok[by], dropna=False).sum()
    span = (df["batch_started_at"] + df["batch_s"]).groupby(df[by], dropna=False).max() - g_all["batch_started_at"].min()
    out = pd.DataFrame({
        "rows": g_all.size(),
        "errors": g_all["error"].count(),
        "tokens": tokens,
        "avg_layers": layer_tokens / tokens.replace(0, np.nan),
        "tokens_per_s": tokens / span.replace(0, np.nan),
        "latency_s_p50": g_ok["latency_s"].median(),
        "ttft_s_p50": g_ok["ttft_s"].median(),
    })
    out[["tokens"]] = out[["tokens"]].fillna(0).astype(int)
    return out


def audit_stats(df: pd.DataFrame, confidence: float = 0.95) -> list[dict]:
    """Per schedule version: the live audit's exits run on to full depth, the disagreements among
    them, the rate and its upper confidence bound (rows without audit columns count nothing)."""
    if "audit_exits" not in df:
        return []
    ok = df[df["error"].isna() & df["audit_exits"].notna()]
    out = []
    for version, g in ok.groupby(ok["schedule_version"].astype("Int64"), dropna=False):
        n = int(sum(int(np.sum(a)) for a in g["audit_exits"]))
        k = int(sum(int(np.sum(a)) for a in g["audit_disagree"]))
        out.append({"schedule_version": None if pd.isna(version) else int(version), "audit_exits": n,
                    "audit_disagree": k, "disagreement": k / n if n else None,
                    "upper_bound": upper_bound(k, n, 1 - confidence) if n else None})
    return out


def exit_histogram(df: pd.DataFrame) -> dict[str, np.ndarray]:
    """Fraction of generated tokens per exit layer (index 0 = 1 layer run), per schedule version."""
    ok = df[df["error"].isna() & df["exit_layers"].notna()]
    num_layers = int(df["num_layers"].max())
    hists = {}
    key = ok["schedule_version"].map(lambda v: "dense" if pd.isna(v) else f"v{int(v)}")
    for name, rows in ok.groupby(key):
        layers = np.concatenate([np.asarray(x, dtype=np.int64) for x in rows["exit_layers"]] or [np.zeros(0, int)])
        counts = np.bincount(layers, minlength=num_layers + 1)[1:]
        hists[name] = counts / max(counts.sum(), 1)
    return hists


def save_histogram_png(hists: dict[str, np.ndarray], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / max(len(hists), 1)
    for k, (name, frac) in enumerate(sorted(hists.items())):
        x = np.arange(1, len(frac) + 1) + (k - (len(hists) - 1) / 2) * width
        ax.bar(x, frac, width=width, label=name)
    ax.set_xlabel("exit layer (decoder layers run)")
    ax.set_ylabel("fraction of generated tokens")
    ax.set_title("Exit-layer histogram per schedule version")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def records(table: pd.DataFrame) -> list[dict]:
    """JSON-ready rows: NaN and <NA> become None, numpy scalars Python numbers."""
    rows = table.reset_index().astype(object).to_dict(orient="records")
    return [{k: None if pd.isna(v) else v.item() if hasattr(v, "item") else v for k, v in r.items()} for r in rows]


def analyze(cfg: AnalyzeConfig) -> dict:
    df = load_rows(cfg.output)
    per_run = group_stats(df, "run_id")
    per_version = group_stats(df.assign(schedule_version=df["schedule_version"].astype("Int64")), "schedule_version")
    save_histogram_png(exit_histogram(df), cfg.png)
    ok = df[df["error"].isna()]
    tokens = int(ok["completion_tokens"].sum())
    avg_layers = float((ok["avg_layers"] * ok["completion_tokens"]).sum() / tokens) if tokens else None
    return {
        "rows": len(df),
        "errors": int(df["error"].notna().sum()),
        "tokens": tokens,
        "avg_layers": avg_layers,
        "num_layers": int(df["num_layers"].max()),
        # decoder layers only (draft head and predictors not counted): an upper bound
        "est_speedup_upper_bound": int(df["num_layers"].max()) / avg_layers if avg_layers else None,
        "error_kinds": df["error"].dropna().str.split(":").str[0].value_counts().to_dict(),
        "per_run": records(per_run),
        "per_schedule_version": records(per_version),
        "audit_per_schedule_version": audit_stats(df),
        "png": str(cfg.png),
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("output", help="output directory of jobs.generate")
    p.add_argument("--png", default=None, help=f"histogram image (default: <output>/{EXIT_PLOT})")
    args = p.parse_args(argv)
    result = analyze(AnalyzeConfig(output=args.output, png=args.png))
    with pd.option_context("display.width", 120, "display.float_format", "{:.3f}".format):
        for name in ("per_run", "per_schedule_version", "audit_per_schedule_version"):
            if not result[name]:
                continue
            print(f"\n{name}:\n{pd.DataFrame(result[name]).to_string(index=False)}")
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
