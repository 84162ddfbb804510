"""Checkpoint sources (registry names, GGUF files, Hugging Face directories) and the Orbax store."""
