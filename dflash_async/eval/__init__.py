"""Acceptance length by real speculative decoding, and regeneration of training answers."""
