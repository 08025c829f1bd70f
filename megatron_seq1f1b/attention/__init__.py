"""Core attention over a segment and its carried-over prefix, one path per backend.

Megatron's core-attention modules, each taught to attend from a segment's queries to the
keys and values of its prefix (bottom-right causal, documents apart):
:mod:`~megatron_seq1f1b.attention.segmented` wraps Megatron's unfused and Transformer Engine
attention and RoPE; :mod:`~.flash` is the flash (PyTorch SDPA) core attention;
:mod:`~.prefix` holds the mask-free prefix kernels it uses on CPU; :mod:`~.varlen` the THD
(variable-length) kernels for packed documents; :mod:`~.context_parallel` the K/V all-gather
of a segment over its context-parallel group.

May import: :mod:`megatron_seq1f1b.base`, :mod:`~megatron_seq1f1b.schedules`,
:mod:`~megatron_seq1f1b.segments`, torch, Megatron-Core.
"""
