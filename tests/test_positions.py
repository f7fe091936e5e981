"""Decode positions: at every decode step the engine's logits equal transformers' forward over the
whole sequence at that position. A one-position shift (the first new token fed at len(prompt) + 1,
the bug these tests were written for) must fail them, and each test checks that it would."""
from __future__ import annotations

import pytest
import torch

from specee_core import SpecEEEngine
from tests.conftest import make_hf_model

# long enough prompts that the distance between a new token and the prompt's tokens matters
PROMPT = ("import os\nimport sys\nfrom collections import OrderedDict\n\n\nclass Cache(object):\n"
          "    def __init__(self, size):\n        self.size = size\n        self.data = OrderedDict()\n\n"
          "    def get(self, key):\n        ")

CONFIGS = {
    "gqa-llama3-rope": dict(heads=6, kv_heads=2, hidden=96, tied=True, max_pos=512,
                            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "gqa-linear-rope": dict(heads=4, kv_heads=2, hidden=64, tied=False, max_pos=512,
                            rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "mha-default-rope": dict(heads=4, kv_heads=4, hidden=64, tied=True, max_pos=512),
}


def record_step_logits(engine: SpecEEEngine) -> list[torch.Tensor]:
    """Wrap the engine model's logits() so every call's output is kept: the prefill's last
    position first, then one [B, V] per decode step."""
    seen: list[torch.Tensor] = []
    inner = engine.model.logits

    def logits(h):
        out = inner(h)
        seen.append(out.detach().clone())
        return out

    engine.model.logits = logits
    return seen


def hf_logits(hf, ids: list[int], shift_from: int | None = None) -> torch.Tensor:
    """transformers' logits [T, V] over the whole sequence; shift_from: positions of tokens from
    that index on are one ahead (what the bug did), for checking that a test can see it."""
    pos = torch.arange(len(ids))
    if shift_from is not None:
        pos[shift_from:] += 1
    with torch.no_grad():
        return hf(input_ids=torch.tensor([ids]), position_ids=pos[None]).logits[0].float()


def assert_steps_match(hf, prompt_ids: list[int], new_ids: list[int], steps: list[torch.Tensor], atol: float,
                       check_shift: bool = True):
    """Each step's logits equal transformers' full-sequence forward within atol; check_shift: and a forward with
    the generated tokens' positions one ahead parts from them by far (the comparison can see that bug)."""
    seq = prompt_ids + new_ids
    ref = hf_logits(hf, seq)
    n0 = len(prompt_ids)
    # step j's logits predict new token j: they come from the position of token n0 - 1 + j
    ours = torch.stack(steps[: len(new_ids)])
    torch.testing.assert_close(ours, ref[n0 - 1 : n0 - 1 + len(new_ids)], atol=atol, rtol=0)
    if not check_shift:
        return
    # the same comparison against a one-position shift of the fed tokens fails by far
    shifted = hf_logits(hf, seq, shift_from=n0)
    gap = (ours[1:] - shifted[n0 : n0 - 1 + len(new_ids)]).abs().max().item()
    assert gap > 100 * atol, f"a one-position shift changes the logits by only {gap}: this config cannot see it"


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    cfg = dict(CONFIGS[request.param])
    hf = make_hf_model(path, layers=3, qk_scale=6.0, **cfg)
    return hf, SpecEEEngine.from_pretrained(path, dtype="float32")


def test_every_decode_step_equals_full_sequence_forward(pair):
    hf, engine = pair
    steps = record_step_logits(engine)
    prompt_ids = engine.encode_prompt(PROMPT)
    assert len(prompt_ids) > 40
    out = engine.generate([PROMPT], max_new_tokens=24, ignore_eos=True, mode="dense")[0]
    assert len(out.token_ids) == 24
    assert out.token_ids == [int(s[0].argmax()) for s in steps[:24]]
    assert_steps_match(hf, prompt_ids, out.token_ids, [s[0] for s in steps], atol=1e-4)


def test_ragged_batch_steps_equal_full_sequence_forward(pair):
    """Rows of different prompt lengths decode side by side: each row's logits at each step equal
    the full forward of its own sequence."""
    hf, engine = pair
    prompts = [PROMPT, PROMPT[:57], PROMPT[:120] + "return"]
    steps = record_step_logits(engine)
    outs = engine.generate(prompts, max_new_tokens=12, ignore_eos=True, mode="dense")
    for b, (p, out) in enumerate(zip(prompts, outs)):
        assert_steps_match(hf, engine.encode_prompt(p), out.token_ids, [s[b] for s in steps], atol=1e-4)
