"""Print the plan mode="auto" runs with for a model on this machine: the dtype and weight format and why
(with --weights auto, also the format auto would pick at each batch size), the measured
cost of a verify forward per batch size and draft length, one draft-head level's cost, and per
batch size what a step does for rows it knows nothing about yet (dense, or chains of some depth, and
the expected gain). Measures what the cache ($SPECEE_CACHE/plans) lacks; --fresh measures again.

    python -m jobs.plan                                   # SmolLM2, dtype auto, batch sizes 1,8,16
    python -m jobs.plan --dtype float32 --batch-sizes 1,4 --threads 1
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from jobs.cli import emit_json, parse_config
from specee_core import SpecEEEngine
from specee_core.model.config import resolve_dtype
from specee_core.machine import machine_facts
from specee_core.spec.costs import CostTable


@dataclass
class PlanConfig:
    model: Path = Path("models/smollm2-135m-instruct")
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    weights: str = "auto"  # auto | fp32 | bf16 | q8 | q4 (auto: chosen at the largest batch size)
    device: str = "cpu"
    batch_sizes: str = "1,8,16"
    depth: int = 4  # the deepest chain the plan may choose
    threads: int = 0  # torch threads (0: torch's default); costs are cached per thread count
    fresh: bool = False  # measure again even when the cache has the table
    out: Path | None = None

    def __post_init__(self) -> None:
        if self.dtype != "auto":
            resolve_dtype(self.dtype)
        try:
            self.sizes = [int(b) for b in self.batch_sizes.split(",") if b]
        except ValueError:
            raise ValueError(f"batch_sizes must be comma-separated integers, got {self.batch_sizes!r}") from None
        if not self.sizes or min(self.sizes) < 1:
            raise ValueError(f"batch_sizes must be integers >= 1, got {self.batch_sizes!r}")


def run(cfg: PlanConfig) -> dict:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    engine = SpecEEEngine.from_pretrained(cfg.model, device=cfg.device, dtype=cfg.dtype, weights=cfg.weights,
                                          max_batch_size=max(cfg.sizes))
    spec = {"depth": cfg.depth}
    plan = engine.spec_plan(spec)
    if cfg.fresh:
        plan.costs = CostTable(key=plan.costs.key)
    engine.prepare_plan(cfg.sizes, spec)
    out = {"model": str(cfg.model), **machine_facts(engine.device), **engine.weights_info()}
    if cfg.weights == "auto" and cfg.dtype == "auto":  # what auto would load at each batch size
        from specee_core.model.loader import find_model_dir
        from specee_core.machine import choose_dtype
        from specee_core.model.weight_plan import choose_weights

        dev, model_dir = torch.device(cfg.device), find_model_dir(cfg.model)
        out["weights_by_batch"] = {str(b): choose_weights(model_dir, engine.config, dev, choose_dtype(dev)[0], b).reason
                                   for b in cfg.sizes}
    return {**out, **plan.to_json(cfg.sizes)}


def main(argv: list[str] | None = None) -> dict:
    cfg = parse_config(PlanConfig, __doc__, argv)
    return emit_json(run(cfg), cfg.out)


if __name__ == "__main__":
    main()
