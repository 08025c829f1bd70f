"""Hugging Face models under Seq1F1B through NVIDIA Megatron-Bridge (``megatron-seq1f1b[bridge]``).

Megatron-Bridge converts Hugging Face checkpoints to Megatron-Core models and back, and runs its own
training loop (``pretrain`` / ``finetune``). Seq1F1B joins that loop in two places::

    from megatron_seq1f1b import bridge as s1b
    pretrain(cfg, s1b.forward_step, callbacks=[s1b.Seq1F1B(num_splits=4, partition="balanced")])

* :class:`~.callback.Seq1F1B` (``callback.py``): a Bridge callback that prepares the built model
  (:func:`megatron_seq1f1b.enable`) and points Bridge's training and evaluation modules at
  Seq1F1B's forward-backward function, after the model exists and before the loop asks for it
  (in-batch packing runs as variable-length micro-batches, ``segment_tokens`` a token budget);
  configurations Seq1F1B cannot run through Bridge yet are refused by name there;
* :func:`~.step.forward_step` (``step.py``): Bridge's GPT forward step, one
  segment of each micro-batch at a time (Bridge's packed-batch keys included), FLOPs counted
  once per micro-batch; :func:`~.step.packed_documents` reads a packed micro-batch's
  documents for the schedule;
* :func:`~.loading.load_bridge` (``loading.py``): imports Megatron-Bridge where Transformer
  Engine is absent (a CPU machine), for conversion and tests.

May import: every floor below it (:mod:`megatron_seq1f1b.api`, :mod:`~megatron_seq1f1b.planner`
and down) and Megatron-Bridge; importing this package imports neither Bridge nor Megatron-Core,
its names load on first use.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "Seq1F1B": "megatron_seq1f1b.bridge.callback",
    "bridge_problems": "megatron_seq1f1b.bridge.callback",
    "variable_lengths": "megatron_seq1f1b.bridge.callback",
    "forward_step": "megatron_seq1f1b.bridge.step",
    "packed_documents": "megatron_seq1f1b.bridge.step",
    "segment_packed_metadata": "megatron_seq1f1b.bridge.step",
    "load_bridge": "megatron_seq1f1b.bridge.loading",
    "bridge_missing_reason": "megatron_seq1f1b.bridge.loading",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value
