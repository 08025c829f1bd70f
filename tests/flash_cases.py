"""Flash core attention against Megatron's local one (run in harness workers).

The layouts run with ``ModelSpec(attention="flash")``; tests/gpt.py builds
their reference with Megatron's ``DotProductAttention`` on the full sequence.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses

import torch
from torch.overrides import TorchFunctionMode

from gpt import ModelSpec, build_chunks, init_parallel, make_config, run_layout
from megatron_seq1f1b import megatron_lm
from megatron_seq1f1b.attention.flash import FlashDotProductAttention
from megatron_seq1f1b.runtime.model_hooks import dense_attention


def _cores(chunks) -> list[str]:
    return [type(layer.self_attention.core_attention).__name__
            for chunk in chunks for layer in chunk.decoder.layers]


def megatron_lm_swap(model: ModelSpec, **layout) -> dict:
    """Megatron-LM's ``--attention-backend flash --transformer-impl local`` (no --seq1f1b):
    prepare_model swaps the built local attention; equal results, equal state_dict keys."""
    swapped = {}

    def prepare(chunks):
        keys = [sorted(chunk.state_dict()) for chunk in chunks]
        swapped["dense_before"] = dense_attention(chunks)
        args = argparse.Namespace(attention_backend="flash", transformer_impl="local",
                                  create_attention_mask_in_dataloader=False)
        megatron_lm.prepare_model(chunks, args)
        swapped.update(before_keys=keys, after_keys=[sorted(c.state_dict()) for c in chunks],
                       cores=_cores(chunks), dense_after=dense_attention(chunks))
        return chunks

    result = run_layout(model=model, prepare=prepare, **layout)
    init_parallel()
    (spec_built,) = build_chunks(dataclasses.replace(model, attention="flash"),
                                 make_config(model))
    return dict(result, **swapped, spec_keys=sorted(spec_built.state_dict()),
                spec_cores=_cores([spec_built]))


class _Recorder(TorchFunctionMode):
    """Inside one flash forward: SDPA's mask arguments, and the shape of every tensor the
    module itself creates (SDPA's internals excluded: the handler runs SDPA outside the mode)."""

    def __init__(self):
        super().__init__()
        self.sdpa, self.shapes = [], []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.nn.functional.scaled_dot_product_attention:
            mask = kwargs.get("attn_mask")
            self.sdpa.append((type(mask).__name__ if mask is not None else None,
                              kwargs.get("is_causal", False)))
        elif isinstance(out, torch.Tensor):
            self.shapes.append(tuple(out.shape))
        return out


@contextlib.contextmanager
def _recording():
    calls = []
    original = FlashDotProductAttention.forward

    def forward(self, query, key, value, *args, **kwargs):
        recorder = _Recorder()
        with recorder:
            out = original(self, query, key, value, *args, **kwargs)
        sq, sk = query.shape[0], key.shape[0]
        calls.append(dict(window=self.window_size[0] >= 0, sq=sq, sk=sk, sdpa=recorder.sdpa,
                          dense=[s for s in recorder.shapes if s[-2:] == (sq, sk)]))
        return out

    FlashDotProductAttention.forward = forward
    try:
        yield calls
    finally:
        FlashDotProductAttention.forward = original


def recorded_layout(**layout) -> dict:
    """run_layout with every flash forward recorded (see :class:`_Recorder`)."""
    with _recording() as calls:
        result = run_layout(**layout)
    return dict(result, calls=calls)
