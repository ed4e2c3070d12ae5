"""Model definitions and weight loading (GGUF files and Hugging Face directories)."""
