"""Model loading: local Hugging Face directories, the built-in tiny model, LoRA."""
