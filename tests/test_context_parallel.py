"""Seq1F1B with context parallelism: each segment spread over the CP group (two chunks per
rank, Megatron's load balancing within each segment), keys and values gathered over it,
against training without pipelining or CP on one rank."""

import dataclasses

import pytest

from gpt import DataSpec, ModelSpec, run_layout

ROPE = ModelSpec()
GQA = ModelSpec(num_attention_heads=4, num_query_groups=2)


def _check(results):
    problems = [f"rank {r['rank']}: {p}" for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems)
    assert any(r["entries"] for r in results), "no rank reported losses"


LAYOUTS = {
    "cp2_k2_local": dict(model=ROPE, cp=2, seq1f1b=dict(num_splits=2, partition="uniform")),
    "cp2_k3_flash_gqa": dict(model=dataclasses.replace(GQA, attention="flash"), cp=2,
                             seq1f1b=dict(num_splits=2, partition="balanced")),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_context_parallel_segments_equal_one_rank(ranks, name):
    layout = LAYOUTS[name]
    world = layout.get("pp", 1) * layout["cp"] * layout.get("tp", 1)
    _check(ranks.run(world, run_layout, case=name, data=DataSpec(num_microbatches=2),
                     **layout))
