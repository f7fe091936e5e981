"""The model: config (the architectures as settings of one decoder), RoPE, KV cache, the layer-by-layer forward,
loading (HF checkpoints, GGUF conversion) and weight formats (low-bit blocks, the per-machine choice of format)."""
