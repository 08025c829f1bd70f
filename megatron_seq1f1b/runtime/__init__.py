"""What runs a plan on a model: the executor, its messages and the model's hooks.

:mod:`~megatron_seq1f1b.runtime.executor` walks this rank's action list with Megatron-Core's
forward-backward signature; :mod:`~.executor_setup` builds, checks and caches what a call
needs (:mod:`~.executor_checks`: what is wrong with a call, before any communication);
:mod:`~.p2p` sends each segment's activations with shapes known in advance;
:mod:`~.model_hooks` prepares a model for segments (:func:`megatron_seq1f1b.enable`);
:mod:`~.wgrad` and :mod:`~.te_wgrad` defer weight gradients for zero-bubble schedules;
:mod:`~.recurrent_hooks` starts each segment of a recurrent layer (Mamba-2, gated delta
net) from the previous one's state; :mod:`~.hybrid_spec` is a HybridModel stack without
Transformer Engine; :mod:`~.trace` times a real run's actions; :mod:`~.cpu` lets
Megatron-Core run on CPU (:mod:`~.cpu_recurrent` puts the reference kernels of
:mod:`~.recurrent_reference`, :mod:`~.reference_conv`, :mod:`~.reference_mamba` and
:mod:`~.reference_gdn` where Megatron looks for the CUDA ones); :mod:`~.getter` finds where
Megatron's getter is held (:func:`megatron_seq1f1b.install`).

May import: :mod:`megatron_seq1f1b.base`, :mod:`~megatron_seq1f1b.schedules`,
:mod:`~megatron_seq1f1b.segments`, :mod:`~megatron_seq1f1b.attention`, torch, Megatron-Core.
"""
