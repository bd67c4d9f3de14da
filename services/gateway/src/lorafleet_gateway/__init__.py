"""lorafleet gateway service."""
