"""The model: config, RoPE, KV cache, the layer-by-layer Llama forward, loading (HF checkpoints, GGUF
conversion) and weight formats (low-bit blocks, the per-machine choice of format)."""
