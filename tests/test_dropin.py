"""The drop-in contract: with one segment, the installed function is Megatron's schedule.

Where nothing is cut (``install(1)``) every call Megatron-Core's own forward-backward
function accepts is accepted, with its results: models that are not GPTModels, no
``seq_length`` without pipelining, two-value losses, ``forward_only``, explicit process
groups (cases in ``dropin_cases.py``, after Megatron-LM's own schedule tests). Segments on
such a model are still refused with the message ``enable()`` gives.
"""

from __future__ import annotations

import pytest
import torch

import dropin_cases


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def test_no_pipelining_mock_model_without_seq_length(ranks):
    for rank, out in enumerate(ranks.run(2, dropin_cases.no_pipelining)):
        forward_only, train = out["forward_only"], out["train"]
        assert forward_only["megatron"] == [{"loss_reduced": rank}] * 4
        assert _same(forward_only["seq1f1b"], forward_only["megatron"])
        assert _same(train["seq1f1b"], train["megatron"])
        assert any(g.abs().sum() > 0 for g in train["megatron"][1])
        assert "megatron_seq1f1b.enable() supports Megatron-Core GPTModel" in out["segments"]


@pytest.mark.parametrize("explicit_groups", [False, True], ids=["default", "pg_collection"])
def test_pipelining_mock_model(ranks, explicit_groups):
    results = ranks.run(2, dropin_cases.pipelining, explicit_groups=explicit_groups)
    assert results[1]["megatron"] == [{"loss_reduced": 1}] * 4  # the last stage's losses
    for out in results:
        assert _same(out["seq1f1b"], out["megatron"])


def test_interleaving_mock_model(ranks):
    results = ranks.run(4, dropin_cases.interleaving)
    assert results[3]["results"]["megatron"] == [{"loss_reduced": 3}] * 8
    for out in results:
        assert out["stages"] == 4
        assert _same(out["results"]["seq1f1b"], out["results"]["megatron"])
        assert out["refused"] == {"megatron": "RuntimeError", "seq1f1b": "RuntimeError"}
