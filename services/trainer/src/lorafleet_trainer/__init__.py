"""lorafleet trainer: one base model, N fixed LoRA slots, trained exactly."""
