"""The training jobs' mechanics on tiny random models: self-distillation data, draft training on it."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from jobs.make_distill_data import DistillConfig, distill, is_heldout_id, manifest_path, read_jsonl
from jobs.train_draft import DraftTrainConfig, train
from specee_core.model.config import ModelConfig
from specee_core.draft.head import DraftHead


def write_prompts(path, n: int) -> None:
    path.write_text("".join(json.dumps({"id": f"mod{i}.py:{i}", "prompt": f"def f{i}(x):"}) + "\n" for i in range(n)))


def test_distill_appends_and_resumes(tiny_model_dir, tmp_path):
    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "distill" / "d.jsonl"
    write_prompts(prompts, 3)
    run = lambda limit: distill(DistillConfig(model=tiny_model_dir, prompts=prompts, out=out, limit=limit,  # noqa: E731
                                              max_new_tokens=5, batch_size=2, dtype="float32"))
    assert run(2)["written"] == 2
    rows = read_jsonl(out)
    assert [r["id"] for r in rows] == ["mod0.py:0", "mod1.py:1"]
    assert all(r["prompt_ids"] and 1 <= len(r["answer_ids"]) <= 5 for r in rows)
    assert run(3)["written"] == 1  # only the new prompt
    full = out.read_text()
    assert run(3)["written"] == 0  # a rerun adds nothing
    assert out.read_text() == full
    assert json.loads(manifest_path(out).read_text())["rows"] == 3

    # a writer killed mid-line: the partial line is dropped and its prompt decoded again
    lines = full.splitlines(keepends=True)
    out.write_text("".join(lines[:2]) + lines[2][:10])
    assert run(3)["written"] == 1
    assert [r["id"] for r in read_jsonl(out)] == ["mod0.py:0", "mod1.py:1", "mod2.py:2"]


def test_distill_rows_are_the_engines_greedy_answers(tiny_model_dir, tmp_path):
    from specee_core import SpecEEEngine

    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "d.jsonl"
    write_prompts(prompts, 2)
    distill(DistillConfig(model=tiny_model_dir, prompts=prompts, out=out, max_new_tokens=6, batch_size=2, dtype="float32"))
    engine = SpecEEEngine.from_pretrained(tiny_model_dir, dtype="float32")
    for r in read_jsonl(out):
        want = engine.generate([f"def f{r['id'].split(':')[1]}(x):"], max_new_tokens=6, mode="dense")[0]
        assert r["answer_ids"] == want.token_ids


@pytest.fixture()
def distill_file(tmp_path):
    """Synthetic distill rows (random token ids) with a few held out by id hash at fraction 0.2."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(24):
        p, a = int(torch.randint(3, 12, (1,), generator=g)), int(torch.randint(4, 20, (1,), generator=g))
        rows.append({"id": f"m.py:{i}", "prompt_ids": torch.randint(2, 8192, (p,), generator=g).tolist(),
                     "answer_ids": torch.randint(2, 300, (a,), generator=g).tolist()})
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path, rows


def test_train_draft_on_distill_data(tiny_model_dir, tmp_path, distill_file):
    path, rows = distill_file
    held = [r for r in rows if is_heldout_id(r["id"], 0.2)]
    assert 0 < len(held) < len(rows)
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    cfg = DraftTrainConfig(model=model, data=path, heldout_fraction=0.2, ckpt_dir=tmp_path / "ckpt", seq_len=64,
                           batch_size=4, epochs=1, draft_vocab=256, ckpt_every_s=0.0, threads=1)
    report = train(cfg)
    # evaluation counts exactly the held-out answer positions (pair i predicts token i + 2)
    assert report["positions"] == sum(len(r["answer_ids"]) for r in held)
    assert report["train"]["train_rows"] == len(rows) - len(held)
    assert 0 <= report["subset_top1"] <= report["subset_top4"] <= 1
    head = DraftHead.load(model / "draft", ModelConfig.from_file(model / "config.json"))
    assert head.vocab_subset is not None and len(head.vocab_subset) == 256
    # the subset is the most frequent answer tokens: every answer token here is < 300
    assert int(head.vocab_subset.max()) < 300
    saved = json.loads((model / "draft" / "config.json").read_text())["specee"]["heldout"]
    assert saved["heldout_top1"] == report["heldout_top1"]
    assert (tmp_path / "ckpt" / "last.pt").is_file() and (tmp_path / "ckpt" / "features.pt").is_file()

    # a rerun with the same settings resumes from the finished checkpoint and trains no further step
    again = train(cfg)
    assert again["train"]["steps"] == report["train"]["steps"]
    assert again["heldout_top1"] == report["heldout_top1"]


def test_cached_decode_data_belongs_to_the_draft_it_was_collected_with(tmp_path):
    """jobs.train_predictors reuses its decode data only for the same draft head: a retrained draft
    proposes other candidates, and predictors trained on the old draft's would not match it."""
    from jobs.train_predictors import PredictorTrainConfig, decode_data_key

    cfg = PredictorTrainConfig(model=tmp_path)
    no_draft = decode_data_key(cfg)
    weights = tmp_path / "draft" / "model.safetensors"
    weights.parent.mkdir()
    weights.write_bytes(b"draft one")
    first = decode_data_key(cfg)
    assert first != no_draft and decode_data_key(cfg) == first
    weights.write_bytes(b"draft two")
    assert decode_data_key(cfg) != first
    assert decode_data_key(PredictorTrainConfig(model=tmp_path, num_prompts=7)) != decode_data_key(cfg)


def test_calibration_job_certifies_under_the_lookup_veto(tmp_path):
    """jobs.train_predictors --calibrate-only records prompt lookup's followers while it decodes, and the
    calibration it writes gives every exit the veto stops (the exit's token contradicts lookup's after a
    match of >= 2 tokens) probability 0 and names the rule; --lookup-veto 0 leaves them in."""
    from jobs.train_predictors import PredictorTrainConfig, train
    from specee_core.early_exit.calibration import CALIBRATION_FILE, Calibration
    from specee_core.early_exit.predictors import PredictorBank, exit_choice
    from specee_core.draft.lookup import lookup_tokens
    from tests.conftest import BUNDLED

    model = tmp_path / "model"
    shutil.copytree(BUNDLED, model)
    common = dict(model=model, prompts=BUNDLED.parents[1] / "prompts" / "instructions_train.jsonl", num_prompts=2, calib_prompts=6,
                  max_new_tokens=24, ckpt_dir=tmp_path / "ckpt", calibrate_only=True, speculator="lookup")
    train(PredictorTrainConfig(**common, lookup_veto=0))
    plain = Calibration.load(model / CALIBRATION_FILE)
    report = train(PredictorTrainConfig(**common, lookup_veto=2))["calibration"]
    vetoed = Calibration.load(model / CALIBRATION_FILE)
    assert plain.lookup_veto is None and vetoed.lookup_veto == 2 and report["lookup_veto"]["min_ngram"] == 2
    data = torch.load(tmp_path / "ckpt" / "exit_data_calib.pt", weights_only=True)
    bank = PredictorBank.load(model / "predictors.safetensors")
    looked_up = lookup_tokens(data["lookup"], 2)
    choice = exit_choice(data["z"], data["cand"], bank.exit_token)  # [S, L-1]
    stop = torch.stack([(looked_up >= 0) & (choice[:, l - 1] != looked_up) for l in vetoed.layers], 1)
    assert stop.any() and (~stop).any()  # the repeats of instructions give lookup matches of both kinds
    assert torch.equal(vetoed.p_exit[stop], torch.zeros(int(stop.sum())))
    assert torch.equal(vetoed.p_exit[~stop], plain.p_exit[~stop]) and (plain.p_exit[stop] > 0).any()
