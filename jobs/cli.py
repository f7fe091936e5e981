"""argparse from a config dataclass: every field becomes --field-name with its default."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import typing
from pathlib import Path


def _arg_type(hint, default):
    if hint in (Path, "Path", "Path | None") or isinstance(default, Path):
        return Path
    if default is None:  # an optional field: the type it holds when set (float | None -> float)
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        return inner[0] if len(inner) == 1 and inner[0] in (int, float, str, Path) else str
    return type(default)


def parse_config(cls, doc: str | None, argv: list[str] | None = None, **overrides):
    """Parse argv into an instance of dataclass `cls` (overrides: defaults to change)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        default = overrides.get(f.name, f.default)
        if default is dataclasses.MISSING:
            default = None
        typ = _arg_type(hints.get(f.name), default)
        if typ is bool:
            p.add_argument("--" + f.name.replace("_", "-"), action=argparse.BooleanOptionalAction, default=default)
        else:
            p.add_argument("--" + f.name.replace("_", "-"), type=typ, default=default)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    return cls(**vars(args))


# the engine options the batch job's command line sets, under its flag names (the rest it sets itself)
ENGINE_FLAGS = {"max_batch_size": "--batch-size", "context_len": "--context-len", "prefill_chunk": "--prefill-chunk",
                "kv_block_size": "--kv-block-size", "kv_cache_gb": "--kv-cache-gb", "prefix_cache": "--prefix-cache"}


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """A flag per ENGINE_FLAGS option, its default and help from specee_core.options.EngineOptions."""
    from specee_core.options import EngineOptions, default, help_text

    hints = typing.get_type_hints(EngineOptions)
    for name, flag in ENGINE_FLAGS.items():
        typ = _arg_type(hints[name], default(name))
        kind = ({"action": argparse.BooleanOptionalAction} if typ is bool
                else {"type": typ, "metavar": name.split("_")[-1].upper()})
        p.add_argument(flag, dest=name, default=default(name), help=help_text(name), **kind)


def engine_options(args: argparse.Namespace) -> dict:
    """The ENGINE_FLAGS options parsed by add_engine_arguments, by their EngineOptions names."""
    return {name: getattr(args, name) for name in ENGINE_FLAGS}


def git_commit() -> str:
    """The checkout's commit (short), "unknown" outside a git checkout: what a result JSON names."""
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).resolve().parents[1],
                              capture_output=True, text=True, check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def emit_json(obj: dict, path: str | Path | None = None) -> dict:
    """Print obj as indented JSON and, given a path, write the same text there; returns obj."""
    import json

    text = json.dumps(obj, indent=2)
    print(text)
    if path:
        Path(path).write_text(text + "\n")
    return obj
