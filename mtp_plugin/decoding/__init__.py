"""The decoding engine: draft, verify, roll back, and schedule each pass (single stream and batch)."""
