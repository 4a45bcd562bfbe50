"""cy-llm's own engine: Llama-family models in plain PyTorch, a paged KV cache, continuous batching."""
