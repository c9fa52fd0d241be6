"""Model loading: HF safetensors folders and GGUF files, and the default model's location."""
