"""Feed-forward patterns: gated FFNs with their epilogues fused."""
