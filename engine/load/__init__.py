"""Opening checkpoints (safetensors, GGUF), loading them into a model, tokenizers, the demo and synthetic models."""
