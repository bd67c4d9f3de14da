"""lorafleet rollout service."""
