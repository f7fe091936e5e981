"""The commands users run: batch generation (generate), its statistics (analyze), HumanEval (evaluate), importing a
GGUF (import_gguf), the plan mode auto runs with (plan), and SpecEE's training for a model of one's own
(make_distill_data, train_draft, train_predictors, profile_schedule, quality_contract, model_card). argparse ->
dataclass -> library call. Benchmarks and developer tools are in tools/."""
