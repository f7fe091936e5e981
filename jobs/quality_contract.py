"""SpecEE's quality contract on held-out instructions: for each tolerance (and raw threshold), the
audited disagreement with the full model, how far greedy generation follows dense, the layers run,
and the speed against dense measured in the same run.

    python -m jobs.quality_contract --max-disagreement 0.01,0.02,0.05 --thresholds 0.9 \\
        --out docs/contract_smollm2.json --plot docs/contract_smollm2.png

Every point decodes the held-out prompts greedily with every step audited (EarlyExitOptions.
audit_fraction = 1: exited rows still run every layer, which changes no token, and each exit is
compared with the full model's argmax on the same prefix). So the audited disagreement is exact over
these prompts, reported with its exact (Clopper-Pearson) upper bound at --confidence. Each point's tokens are then
compared with dense's (first divergence, identical share). The point "exits off" (threshold 2: the
predictors run at their layers, none fires) measures the predictors' and draft head's overhead.
The quality runs take every step as a SpecEE step (gate "off"): what the exits themselves cost.

Speed: batch --speed-batch rows, the points without audit and dense interleaved over --rounds
rounds (the order rotating), tokens generated / seconds of the generate calls; each point once with
every step a SpecEE step (gate "off") and once with the engine's default, the measured pay-off gate
(EarlyExitOptions.gate: dense steps where SpecEE's do not beat them), unless --gates says otherwise.
JSON with the commit and the machine (CPU capability).
"""
from __future__ import annotations

import json
import logging
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from jobs.cli import git_commit
from jobs.cli import parse_config
from jobs.make_distill_data import read_prompts, render_prompt
from specee_core import SpecEEEngine
from specee_core.early_exit.calibration import upper_bound
from specee_core.machine import machine_facts
from specee_eval import metrics

log = logging.getLogger(__name__)

EXITS_OFF = 2.0  # a threshold no sigmoid passes: the predictors run, nothing exits


@dataclass
class ContractConfig:
    model: Path = Path("models/smollm2-135m-instruct")
    prompts: Path = Path("prompts/instructions_heldout.jsonl")  # never used for training or calibration
    num_prompts: int = 64
    max_new_tokens: int = 64
    max_disagreement: str = "0.01,0.02,0.05"  # calibrated points
    thresholds: str = "0.9"  # raw (uncalibrated) points
    confidence: float = 0.95
    dtype: str = "auto"
    weights: str = "auto"
    batch_size: int = 16  # rows per generate call for the quality runs
    speed_batch: int = 1  # rows per generate call for the timed runs
    speed_prompts: int = 8
    gates: str = "off,auto"  # the speed runs' EarlyExitOptions.gate values (the quality runs: "off")
    rounds: int = 3
    threads: int = 0
    out: Path | None = None
    plot: Path | None = None

    def __post_init__(self) -> None:
        self.model, self.prompts = Path(self.model), Path(self.prompts)
        self.out = None if self.out in (None, "") else Path(self.out)
        self.plot = None if self.plot in (None, "") else Path(self.plot)

    def points(self) -> list[dict]:
        eps = [float(e) for e in self.max_disagreement.split(",") if e]
        ths = [float(t) for t in self.thresholds.split(",") if t]
        pts = [{"name": f"eps {e:g}", "max_disagreement": e} for e in eps]
        pts += [{"name": f"threshold {t:g}", "threshold": t} for t in ths]
        return pts + [{"name": "exits off", "threshold": EXITS_OFF}]


def point_engine(engine: SpecEEEngine, point: dict, audit: bool, confidence: float, gate: str = "off") -> SpecEEEngine:
    opts = {"audit_fraction": 1.0 if audit else 0.0, "gate": gate}
    if "max_disagreement" in point:
        opts.update(max_disagreement=point["max_disagreement"], confidence=confidence)
    else:
        opts.update(threshold=point["threshold"], max_disagreement=None)
    return engine.with_options(**opts)


def quality(engine: SpecEEEngine, point: dict, prompts: list[str], dense: list[list[int]],
            cfg: ContractConfig) -> dict:
    """One point over every prompt, every step audited."""
    L = engine.config.num_hidden_layers
    eng = point_engine(engine, point, audit=True, confidence=cfg.confidence)
    res = []
    for i in range(0, len(prompts), cfg.batch_size):
        res += eng.generate(prompts[i : i + cfg.batch_size], max_new_tokens=cfg.max_new_tokens, mode="specee",
                            ignore_eos=True)
    exits = [sum(c) for c in zip(*(r.stats["audit_exits"] for r in res))]
    disagree = [sum(c) for c in zip(*(r.stats["audit_disagree"] for r in res))]
    n, k = sum(exits), sum(disagree)
    tokens = sum(len(r.token_ids) for r in res)
    layers = [l for r in res for l in r.exit_layers[1:]]  # the prefill's token always runs every layer
    agree = metrics.agreement(dense, [r.token_ids for r in res])
    return {**point, "tokens": tokens, "exited_tokens": n, "exit_share": n / max(tokens, 1),
            "audit_disagree": k, "disagreement": k / n if n else 0.0,
            "disagreement_upper_bound": upper_bound(k, n, 1 - cfg.confidence) if n else None,
            "disagreement_per_token": k / max(tokens, 1),
            "layer_fraction": sum(layers) / max(len(layers), 1) / L,
            "layers_closed_by_calibration": sorted(set(eng.early_exit.predictors.layers) - set(eng.early_exit.thresholds)),
            "thresholds": {str(l): t for l, t in sorted(eng.early_exit.thresholds.items())},
            "per_layer": {str(i + 1): {"exits": e, "disagree": d} for i, (e, d) in enumerate(zip(exits, disagree)) if e},
            "first_divergence_median": agree["first_divergence_median"],
            "first_divergence_mean": agree["first_divergence_mean"], "identical": agree["identical"],
            "token_agreement": agree["token_agreement"],
            "predictor_calls_per_token": sum(r.stats["predictor_calls"] for r in res) / max(tokens, 1)}


def speed(engine: SpecEEEngine, points: list[dict], prompts: list[str], cfg: ContractConfig) -> dict:
    """Tokens/s of dense and every point (no audit) under every gate of cfg.gates, interleaved rounds at
    cfg.speed_batch rows. Keys: the point's name (gate "off"), "<name> + gate" (gate "auto")."""
    runs = {"dense": (engine, "dense")}
    for gate in [g for g in cfg.gates.split(",") if g]:
        runs.update({speed_name(p["name"], gate): (point_engine(engine, p, False, cfg.confidence, gate), "specee")
                     for p in points})
    names = list(runs)
    for eng, mode in runs.values():  # warm-up
        eng.generate(prompts[:1], max_new_tokens=4, mode=mode, ignore_eos=True)
    secs, toks = {n: 0.0 for n in names}, {n: 0 for n in names}
    per_round = {n: [] for n in names}
    for r in range(cfg.rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            eng, mode = runs[name]
            t, n = time.perf_counter(), 0
            for i in range(0, len(prompts), cfg.speed_batch):
                out = eng.generate(prompts[i : i + cfg.speed_batch], max_new_tokens=cfg.max_new_tokens, mode=mode,
                                   ignore_eos=True)
                n += sum(len(o.token_ids) for o in out)
            dt = time.perf_counter() - t
            secs[name] += dt
            toks[name] += n
            per_round[name].append(n / dt)
        log.info("speed round %d: %s", r + 1, {n: round(v[-1], 1) for n, v in per_round.items()})
    out = {}
    for name in names:
        tps = toks[name] / secs[name]
        out[name] = {"tokens_per_s": tps, "vs_dense": tps / (toks["dense"] / secs["dense"]),
                     "vs_dense_median_of_rounds": statistics.median(a / b for a, b in zip(per_round[name],
                                                                                         per_round["dense"])),
                     "rounds": per_round[name]}
    return out


def speed_name(point: str, gate: str) -> str:
    return point if gate == "off" else f"{point} + gate" if gate == "auto" else f"{point} + gate {gate}"


def plot(result: dict, path: Path) -> None:
    """Left: audited disagreement (with its upper bound) per point against the tolerance; right: speed
    against dense and layers run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [p for p in result["points"] if p["name"] != "exits off"]
    names = [p["name"] for p in pts]
    x = range(len(pts))
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    dis = [p["disagreement"] for p in pts]
    ub = [(p["disagreement_upper_bound"] or 0) - p["disagreement"] for p in pts]
    a.bar(x, dis, color="tab:orange", yerr=[[0] * len(pts), ub], capsize=4, label="audited disagreement (exits)")
    for i, p in enumerate(pts):
        if "max_disagreement" in p:
            a.hlines(p["max_disagreement"], i - 0.4, i + 0.4, color="k", lw=1.5,
                     label="tolerance" if i == 0 else None)
    a.set_xticks(list(x), names, rotation=20, fontsize=8)
    a.set_ylabel("share of exited tokens the full model would not emit")
    a.legend(fontsize=8)
    sp = result["speed"]
    for gate, style in (("off", "o-"), ("auto", "o:")):
        if speed_name(names[0], gate) in sp:
            b.plot(list(x), [sp[speed_name(n, gate)]["vs_dense_median_of_rounds"] for n in names], style,
                   label=f"tokens/s vs dense, {'every step SpecEE' if gate == 'off' else 'with the pay-off gate'}")
    b.plot(list(x), [p["layer_fraction"] for p in pts], "s--", label="layers run (share)")
    b.plot(list(x), [p["first_divergence_median"] / result["config"]["max_new_tokens"] for p in pts], "^:",
           label="median first divergence / tokens")
    b.axhline(1.0, color="grey", lw=0.6)
    b.set_xticks(list(x), names, rotation=20, fontsize=8)
    b.legend(fontsize=8)
    m = result["machine"]
    fig.suptitle(f"{Path(result['config']['model']).name}, {result['dtype']} / {result['weights']}, "
                 f"{m.get('cpu_capability', m['device'])}, {result['prompts']} held-out prompts x "
                 f"{result['config']['max_new_tokens']} tokens (commit {result['git_commit']})", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(cfg: ContractConfig) -> dict:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    commit = git_commit()
    engine = SpecEEEngine.from_pretrained(cfg.model, dtype=cfg.dtype, weights=cfg.weights,
                                          max_batch_size=max(cfg.batch_size, cfg.speed_batch))
    if engine.early_exit is None:
        raise ValueError(f"{cfg.model} has no predictors: nothing to check")
    rows = read_prompts(cfg.prompts, cfg.num_prompts)
    prompts = [render_prompt(engine, r["prompt"]) for r in rows]
    dense = []
    for i in range(0, len(prompts), cfg.batch_size):
        dense += [r.token_ids for r in engine.generate(prompts[i : i + cfg.batch_size],
                                                       max_new_tokens=cfg.max_new_tokens, mode="dense",
                                                       ignore_eos=True)]
    points = cfg.points()
    result = {"git_commit": commit, "machine": machine_facts(engine.device), "config": {k: str(v) for k, v in
                                                                                        vars(cfg).items()},
              "dtype": str(engine.model.dtype).removeprefix("torch."), **engine.weights_info(),
              "prompts": len(prompts), "calibration": None if engine.early_exit.calibration is None else
              {"prompts": engine.early_exit.calibration.prompts, "tokens": engine.early_exit.calibration.tokens},
              "points": []}
    result["config"]["max_new_tokens"] = cfg.max_new_tokens
    for p in points:
        q = quality(engine, p, prompts, dense, cfg)
        log.info("%s: disagreement %.4f (bound %s) of %d exits, layers %.3f, first divergence median %s",
                 p["name"], q["disagreement"], q["disagreement_upper_bound"], q["exited_tokens"], q["layer_fraction"],
                 q["first_divergence_median"])
        result["points"].append(q)
    result["speed"] = speed(engine, points, prompts[: cfg.speed_prompts], cfg)
    text = json.dumps(result, indent=1)
    if cfg.out:
        cfg.out.parent.mkdir(parents=True, exist_ok=True)
        cfg.out.write_text(text)
    if cfg.plot:
        plot(result, cfg.plot)
    print(markdown(result), flush=True)
    return result


def markdown(result: dict) -> str:
    gates = [g for g in result["config"].get("gates", "off").split(",") if g]
    speed = result["speed"]
    head = " | ".join(f"tokens/s{'' if g == 'off' else ' ' + speed_name('', g).strip()} (vs dense)" for g in gates)
    lines = ["| point | audited disagreement (bound) | exits | layers run | first divergence (median of "
             f"{result['config']['max_new_tokens']}) | identical | {head} |", "|---|---|---|---|---|---|" + "---|" * len(gates)]
    for p in result["points"]:
        b = p["disagreement_upper_bound"]
        cells = " | ".join(f"{speed[n]['tokens_per_s']:.1f} ({speed[n]['vs_dense_median_of_rounds']:.2f}x)"
                           for n in (speed_name(p["name"], g) for g in gates))
        lines.append(f"| {p['name']} | {p['disagreement']:.4f} ({'-' if b is None else f'{b:.4f}'}) | "
                     f"{p['exit_share']:.2f} | {p['layer_fraction']:.3f} | {p['first_divergence_median']:g} | "
                     f"{p['identical']:.2f} | {cells} |")
    lines.append(f"| dense | 0 | 0 | 1.000 | all | 1.00 | {speed['dense']['tokens_per_s']:.1f} |" + " |" * (len(gates) - 1))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    return run(parse_config(ContractConfig, __doc__, argv))


if __name__ == "__main__":
    main()
