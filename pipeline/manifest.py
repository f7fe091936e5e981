"""What an output folder's rows were generated with: `_specee_manifest.json`.

The batch job (job_manifest) records the model (its path, and a SHA-256 of each weight
file and of its config and tokenizer files: the path alone says nothing once the files change), the mode, the job-level
sampling and engine settings, and the input files. A job resuming into a folder compares its own
manifest with the folder's: any difference in what is compared is an error naming the differences,
unless the job is told to write anyway (overwrite_config), and then its manifest replaces the old
one, which is kept under "earlier". Paths are recorded but not compared: under `ray job submit` the
working directory, and with it the default model and input paths, is new on every submission; the
weights' hashes and the input file names (relative to their common folder, as default ids are) are.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

from pipeline.prompts import FORMATS, id_root, infer_format, strip_scheme
from pipeline.stage import StageConfig

log = logging.getLogger(__name__)

MANIFEST = "_specee_manifest.json"
FORMAT = 1
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")  # the draft head's, predictors' too
MODEL_TEXT_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")  # the chat template is in the last
NOT_COMPARED = ("format", "model_path", "input_paths", "written_by", "earlier")


def job_manifest(st: StageConfig, inputs: list[str], *, input_format: str | None, prompt_column: str,
                 id_column: str, run_id: str) -> dict:
    """What a batch job's rows are generated with: the manifest it writes into its output folder."""
    paths = [p if "://" in p else str(Path(p).resolve()) for p in inputs]
    return {
        "format": FORMAT,
        "model_path": str(Path(st.model).resolve()),
        "model_files": model_files_sha256(st.model),
        "mode": st.mode,
        "sampling": {"max_new_tokens": st.max_new_tokens, "temperature": st.temperature, "top_p": st.top_p,
                     "top_k": st.top_k, "stop": list(st.stop), "seed": st.seed},
        "engine": {"chat": st.chat, "dtype": st.dtype, "weights": st.weights, "spec": dict(st.spec),
                   "engine_options": dict(st.engine_options)},
        "input_paths": paths,
        "input_files": input_files(paths, input_format),
        "prompt_column": prompt_column,
        "id_column": id_column,
        "written_by": {"run_id": run_id, "at": time.strftime("%Y-%m-%d %H:%M:%S")},
    }


def input_files(paths: list[str], input_format: str | None) -> list[str]:
    """The input files by the names default ids use (relative to the inputs' common folder); remote
    paths as given."""
    root = id_root(paths)
    exts = {"." + e for e in FORMATS[input_format or infer_format(paths)]}
    names = []
    for p in paths:
        local = Path(strip_scheme(p))
        if "://" in p:
            names.append(p)
        elif local.is_dir():
            names += [f.relative_to(root).as_posix() for f in sorted(local.rglob("*")) if f.is_file() and
                      f.suffix.lower() in exts and not f.name.startswith((".", "_"))]
        else:
            names.append(local.relative_to(root).as_posix() if root else local.name)
    return sorted(names)


def model_files_sha256(model: str | Path, cache: Path | None = None) -> dict[str, str]:
    """SHA-256 of each weight file under the model folder (draft head and predictors included) and of
    its config and tokenizer files, by path relative to the folder (hidden folders skipped). Hashing reads the content (~1 s per GB); the
    digests are cached by path, size and mtime ($SPECEE_CACHE or ~/.cache/specee)."""
    root = Path(model).resolve()
    files = sorted(p for p in root.rglob("*") if p.is_file() and not any(part.startswith(".") for part in
                                                                          p.relative_to(root).parts)
                   and (p.suffix in WEIGHT_SUFFIXES or p.relative_to(root).as_posix() in MODEL_TEXT_FILES))
    cache_path = cache or Path(os.environ.get("SPECEE_CACHE") or Path.home() / ".cache" / "specee") / "file_sha256.json"
    try:
        cached = json.loads(cache_path.read_text())
    except (OSError, ValueError):
        cached = {}
    out, changed = {}, False
    for p in files:
        st = p.stat()
        key = str(p)
        entry = cached.get(key)
        if not (isinstance(entry, dict) and entry.get("size") == st.st_size and entry.get("mtime_ns") == st.st_mtime_ns):
            with open(p, "rb") as f:
                entry = {"size": st.st_size, "mtime_ns": st.st_mtime_ns,
                         "sha256": hashlib.file_digest(f, "sha256").hexdigest()}
            cached[key], changed = entry, True
        out[p.relative_to(root).as_posix()] = entry["sha256"]
    if changed:
        try:
            cache_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache_path.with_name(f".{cache_path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(cached))
            os.replace(tmp, cache_path)
        except OSError as e:  # a read-only home: hash again next time
            log.warning("cannot cache weight hashes in %s: %s", cache_path, e)
    return out


def read_manifest(folder: Path) -> dict | None:
    path = folder / MANIFEST
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path} is not valid JSON ({e}): restore it, or delete it and pass a new --output") from None


def differences(old: dict, new: dict) -> list[tuple[str, object, object]]:
    """(setting, value in old, value in new) for each compared setting that differs."""
    a, b = flatten(old), flatten(new)
    return [(k, a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def flatten(manifest: dict) -> dict[str, object]:
    """The compared settings by name: nested sections flattened to their keys (a model file as
    `model file <name>`)."""
    out = {}
    for k, v in manifest.items():
        if k in NOT_COMPARED:
            continue
        if k == "model_files":
            out.update({f"model file {name}": digest for name, digest in v.items()})
        elif isinstance(v, dict) and k in ("sampling", "engine"):
            out.update(v)
        else:
            out[k] = v
    return out


def mismatch_message(folder: Path, diffs: list[tuple[str, object, object]]) -> str:
    def show(name: str, v) -> str:
        if v is None and name.startswith("model file"):
            return "absent"
        if isinstance(v, str) and name.startswith("model file"):
            return f"sha256:{v[:12]}"
        return json.dumps(v)

    there = ", ".join(f"{k}={show(k, a)}" for k, a, _ in diffs)
    here = ", ".join(f"{k}={show(k, b)}" for k, _, b in diffs)
    return (f"output folder {folder} was written with {there}; this job has {here}; pass --overwrite-config "
            f"(BatchConfig.overwrite_config) to write into it anyway")


def check_manifest(folder: Path, new: dict, has_rows: bool, overwrite: bool) -> dict:
    """The manifest to write for this job into folder: ValueError naming the differences when the folder's
    rows were written with other settings (and not overwrite). A folder without rows takes the new one."""
    old = read_manifest(folder)
    if old is None:
        if has_rows:
            raise ValueError(f"{folder} has part files but no {MANIFEST}: it was written by an earlier version of "
                             f"the pipeline (or the manifest was deleted); give this run a new --output")
        return {**new, "earlier": []}
    diffs = differences(old, new)
    if not diffs or not has_rows:
        return {**new, "earlier": old.get("earlier", [])}
    if not overwrite:
        raise ValueError(mismatch_message(folder, diffs))
    log.warning("%s: overwrite_config: writing into it with %s", folder,
                ", ".join(f"{k}={v!r} (was {a!r})" for k, a, v in diffs))
    return {**new, "earlier": [*old.get("earlier", []), {k: v for k, v in old.items() if k != "earlier"}]}
