"""The lorafleet operator CLI."""
