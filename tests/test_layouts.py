"""Megatron-Core's ``pipeline_model_parallel_layout``: stages without attention layers.

Why: an embedding-only or loss-only stage has no attention of its own, yet it must cut every
micro-batch exactly as the stages that have attention (their p2p shapes meet it): the stages
agree on what the cut is computed from, the attention kind included (docs/design.md).
"""

import dataclasses

import pytest
from megatron.core.transformer.transformer_config import TransformerConfig

import pipeline_cases as cases
from gpt import DataSpec, ModelSpec, make_config
from megatron_seq1f1b.schedules.partition import split_sequence

pytestmark = pytest.mark.skipif(
    "pipeline_model_parallel_layout" not in {f.name for f in dataclasses.fields(TransformerConfig)},
    reason="this megatron-core has no pipeline_model_parallel_layout")

# At 64 tokens this model's balanced cuts are the same for dense and causal attention; at 256
# they differ, so a stage cutting by its own (missing) attention would be caught.
MODEL = ModelSpec(num_layers=4, hidden_size=64, seq_length=256)

# (pp, layout, attention layers per stage): "E" embedding, "t" a transformer layer, "L" loss.
LAYOUTS = [
    (2, "E|t*4L", [0, 4]),
    (3, "E|t*4|L", [0, 4, 0]),
    (3, "Et|t*3|L", [1, 3, 0]),
]


def _balanced(k: int, dense: bool) -> list[int]:
    return split_sequence(MODEL.seq_length, k, "balanced", config=make_config(MODEL),
                          vocab_size=MODEL.vocab_size, dense_attention=dense)


def _check(results: list[dict], layers: list[int]) -> None:
    assert [r["layers"] for r in results] == layers
    problems = [f"stage {i}: {p}" for i, r in enumerate(results) for p in r["problems"]]
    assert not problems, "\n".join(problems)
    assert all(r["params"] for r in results) and results[-1]["reported"]


@pytest.mark.parametrize("k", [2, 3])
def test_this_model_cuts_by_the_attention_kind(k):
    assert _balanced(k, dense=True) != _balanced(k, dense=False)


@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("pp,layout,layers", LAYOUTS, ids=[lay for _, lay, _ in LAYOUTS])
def test_stage_without_attention_equals_megatron(ranks, pp, layout, layers, k):
    """Seq1F1B k balanced segments on the layout: loss and every gradient equal Megatron's own
    schedule on it; every stage cut as the stages with (local, dense) attention do."""
    results = ranks.run(pp, cases.layout_against_megatron, case=f"layout-{layout}-k{k}", pp=pp,
                        layout=layout, k=k, model=MODEL, data=DataSpec(num_microbatches=3))
    _check(results, layers)
    assert [r["lengths"] for r in results] == [_balanced(k, dense=True)] * pp
    # --seq1f1b-splits auto plans with the pipeline's attention, not a stage's own
    assert [r["own_dense"] for r in results] == [n > 0 for n in layers]
    assert all(r["pipeline_dense"] for r in results)


def test_stages_without_attention_beside_flash_attention(ranks):
    """The same with the flash core attention: the stages cut by its (causal) costs."""
    results = ranks.run(3, cases.layout_against_megatron, case="layout-flash", pp=3,
                        layout="E|t*4|L", k=3, model=dataclasses.replace(MODEL, attention="flash"),
                        data=DataSpec(num_microbatches=3))
    _check(results, [0, 4, 0])
    assert [r["lengths"] for r in results] == [_balanced(3, dense=False)] * 3
