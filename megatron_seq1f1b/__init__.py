"""Seq1F1B for Megatron-Core."""
