"""lorafleet trainer service."""
