"""Speculative-decoding patterns: verifying draft tokens in one target-model pass."""
