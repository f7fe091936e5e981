"""Checkpoint formats and the loader's error cases."""
from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from specee_core import SpecEEEngine, load_model
from tests.conftest import make_hf_model


def logits_of(model, ids):
    return model.logits(model.forward(ids, torch.arange(ids.shape[1])[None], model.new_cache(1, ids.shape[1])))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = tmp_path_factory.mktemp("ref")
    make_hf_model(path, layers=2, hidden=64, heads=4, kv_heads=2, tied=False, seed=3)
    return path


@pytest.mark.parametrize("fmt", ["sharded", "bin"])
def test_checkpoint_formats_load_the_same_weights(tmp_path, reference, fmt):
    if fmt == "sharded":
        make_hf_model(tmp_path, layers=2, hidden=64, heads=4, kv_heads=2, tied=False, seed=3, max_shard_size="300KB")
        assert (tmp_path / "model.safetensors.index.json").is_file()
    else:
        make_hf_model(tmp_path, layers=2, hidden=64, heads=4, kv_heads=2, tied=False, seed=3, safe=False)
        assert (tmp_path / "pytorch_model.bin").is_file()
    ids = torch.tensor([[0, 5, 9, 200, 31]])
    torch.testing.assert_close(logits_of(load_model(tmp_path), ids), logits_of(load_model(reference), ids))


def test_missing_directory_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="model directory not found: .*nope"):
        SpecEEEngine.from_pretrained(tmp_path / "nope", dtype="float32")


def test_missing_config_and_weights_are_named(tmp_path, reference):
    with pytest.raises(FileNotFoundError, match="config not found: .*config.json"):
        load_model(tmp_path)
    shutil.copy(reference / "config.json", tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match="no weights found"):
        load_model(tmp_path)


def test_missing_shard_is_named(tmp_path):
    make_hf_model(tmp_path, layers=2, hidden=64, heads=4, kv_heads=2, max_shard_size="300KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        load_model(tmp_path)


@pytest.mark.parametrize("entry", ["../../etc/passwd", "/etc/passwd", "shards/../../x.safetensors", "", 7])
def test_a_shard_outside_the_model_folder_is_refused(tmp_path, entry):
    model = tmp_path / "model"
    make_hf_model(model, layers=2, hidden=64, heads=4, kv_heads=2, max_shard_size="300KB")
    index = model / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"]["model.norm.weight"] = entry
    index.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=f"{index}: entry {re.escape(repr(entry))} is not a file inside {model}"):
        load_model(model)
    index.write_text(json.dumps({"weight_map": ["model-00001-of-00002.safetensors"]}))
    with pytest.raises(ValueError, match="not a valid weight index .*weight_map is a list"):
        load_model(model)


def test_shards_linked_from_outside_as_in_a_hub_snapshot_load(tmp_path, reference):
    snapshot, blobs = tmp_path / "snapshots" / "abc", tmp_path / "blobs"
    make_hf_model(snapshot, layers=2, hidden=64, heads=4, kv_heads=2, tied=False, seed=3, max_shard_size="300KB")
    blobs.mkdir()
    for shard in snapshot.glob("model-*.safetensors"):  # the Hugging Face cache's layout: links into ../../blobs
        shard.rename(blobs / shard.name)
        shard.symlink_to(f"../../blobs/{shard.name}")
    ids = torch.tensor([[0, 5, 9, 200, 31]])
    torch.testing.assert_close(logits_of(load_model(snapshot), ids), logits_of(load_model(reference), ids))


def test_an_unsupported_architecture_is_rejected(tmp_path, reference):
    shutil.copytree(reference, tmp_path, dirs_exist_ok=True)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"config.json.*not an architecture this engine runs \(supported: "
                                         r"LlamaForCausalLM \(llama\), MistralForCausalLM"):
        load_model(tmp_path)


def test_shape_mismatch_names_file_and_tensor(tmp_path, reference):
    shutil.copytree(reference, tmp_path, dirs_exist_ok=True)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.weight"] = torch.zeros(64, 7)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"model.safetensors: tensor 'model.layers.1.mlp.down_proj.weight' has shape \(64, 7\)"):
        load_model(tmp_path)


def test_unknown_dtype_is_rejected(reference):
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        load_model(reference, dtype="int8")


def test_corrupt_weights_are_named(tmp_path, reference):
    shutil.copytree(reference, tmp_path, dirs_exist_ok=True)
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="model.safetensors: cannot read weights"):
        load_model(tmp_path)


def test_bad_prompts_raise_clear_errors(reference):
    from specee_core import PromptError

    engine = SpecEEEngine.from_pretrained(reference, dtype="float32")
    with pytest.raises(PromptError, match="prompt 1: prompt is empty"):
        engine.generate(["ok", ""], max_new_tokens=2, mode="dense")
    with pytest.raises(PromptError, match="must be a string"):
        engine.generate([3], max_new_tokens=2, mode="dense")
    with pytest.raises(PromptError, match="context holds 256"):
        engine.generate(["x " * 400], max_new_tokens=2, mode="dense")
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.generate(["ok"], max_new_tokens=0, mode="dense")
    with pytest.raises(ValueError, match="mode must be one of"):
        engine.generate(["ok"], mode="fast")


def test_sampling_is_seeded_and_stops(reference):
    engine = SpecEEEngine.from_pretrained(reference, dtype="float32")
    kw = dict(max_new_tokens=8, temperature=0.8, top_p=0.9, top_k=50)
    a = engine.generate(["def f():", "class A:"], seed=7, **kw, mode="dense")
    b = engine.generate(["def f():", "class A:"], seed=7, **kw, mode="dense")
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    greedy = engine.generate(["def f():"], max_new_tokens=8, mode="dense")[0]
    stop = greedy.text[2:4] if len(greedy.text) >= 4 else None
    if stop:
        cut = engine.generate(["def f():"], max_new_tokens=8, stop=[stop], mode="dense")[0]
        assert cut.finish_reason == "stop" and cut.text == greedy.text[: greedy.text.find(stop)]
    at_start = engine.generate(["def f():"], max_new_tokens=8, stop=[greedy.text[:2]], mode="dense")[0]
    assert at_start.text == "" and at_start.finish_reason == "stop"
    streamed = []
    res = engine.generate(["def f():", "x"], max_new_tokens=5, on_token=lambda i, t: streamed.append((i, t)), mode="dense")
    assert sorted(streamed) == sorted((i, t) for i, r in enumerate(res) for t in r.token_ids)
    for r in res:
        assert r.finish_reason in ("stop", "length") and r.metrics["ttft_s"] > 0


def test_the_tokenizer_is_the_one_autotokenizer_loads(tmp_path, reference):
    """A fast tokenizer loads through its own class: the same class, vocabulary, encoding and chat template
    as AutoTokenizer's (the GGUF import's TokenizersBackend and PreTrainedTokenizerFast); a broken config is named."""
    from transformers import AutoTokenizer

    from specee_core.model.loader import load_tokenizer
    from tests.test_smollm2 import MODEL

    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def f(x):\n  return x"}]
    for path in [reference] + ([MODEL] if (MODEL / "tokenizer.json").is_file() else []):
        ours, auto = load_tokenizer(path), AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        assert type(ours) is type(auto) and ours.get_vocab() == auto.get_vocab()
        assert ours("héllo wörld  x\n\ty").input_ids == auto("héllo wörld  x\n\ty").input_ids
        assert (ours.eos_token_id, ours.bos_token_id, ours.chat_template) == \
            (auto.eos_token_id, auto.bos_token_id, auto.chat_template)
        if auto.chat_template is not None:
            assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
                auto.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    other = tmp_path / "other"
    shutil.copytree(reference, other)
    config = json.loads((other / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "PreTrainedTokenizerFast"}))
    assert load_tokenizer(other).get_vocab() == load_tokenizer(reference).get_vocab()
    (other / "tokenizer_config.json").write_text("{broken")
    with pytest.raises(ValueError, match="tokenizer_config.json: not valid JSON"):
        load_tokenizer(other)
