"""A small Megatron-Core trainer for GPT (used by scripts/pretrain_gpt.py and the benchmarks).

Structured after Megatron-LM's training loop, without a Megatron-LM checkout:
flags with Megatron-LM's names (:mod:`.arguments`), datasets
(:mod:`.data`), model/optimizer setup (:mod:`.setup`), checkpoints
(:mod:`.checkpoint`) and the loop itself (:mod:`.loop`).
"""
