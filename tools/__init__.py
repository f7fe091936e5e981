"""Developer tools: benchmarks (bench*), probes and checks (probe_serve_memory, gpu_check, weights_agreement), and
what builds the bundled model and prompt files (train_tokenizer, train_base, make_instructions, make_prompts). The
commands users run are in jobs/."""
