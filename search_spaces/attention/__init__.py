"""Attention-family patterns: fused attention kernels (flash, decode, paged, cross) and RoPE."""
