"""Reading checkpoints: GGUF files, Hugging Face directories, and the catalog of pullable models."""
