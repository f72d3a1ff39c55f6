"""The OpenAI-compatible HTTP front door (docs/ARCHITECTURE.md)."""
