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


def emit_json(obj: dict, path: str | Path | None = None) -> dict:
    """Print obj as indented JSON and, given a path, write the same text there; returns obj."""
    import json

    text = json.dumps(obj, indent=2)
    print(text)
    if path:
        Path(path).write_text(text + "\n")
    return obj
