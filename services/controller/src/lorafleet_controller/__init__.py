"""lorafleet controller service."""
