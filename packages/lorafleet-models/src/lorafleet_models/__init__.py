"""Local models without a hub: the tiny seeded model + tokenizer, and the SmolLM2 import."""
