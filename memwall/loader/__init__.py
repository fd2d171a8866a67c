"""Model loading: GGUF files and Hugging Face directories."""
