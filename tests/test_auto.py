"""--seq1f1b-splits auto as Megatron-LM runs it: the forward-backward function that measures
the model on its first call, plans, and then trains exactly (the measured micro-batch is
replayed, so every rank reads the same data as with the chosen flags given by hand)."""

import re

import pytest

import pipeline_cases as cases
from gpt import DataSpec, ModelSpec

ROPE = ModelSpec(position_embedding_type="rope")


def _one_plan(results: list[dict]) -> list:
    plans = [r["plan"] for r in results]
    assert all(p == plans[0] for p in plans), plans  # every rank runs the same plan
    return plans[0]


@pytest.mark.parametrize("vpp", [None, 2], ids=["plain", "interleaved"])
def test_auto_plans_on_the_first_call_and_equals_no_pipelining(ranks, vpp):
    results = ranks.run(2, cases.auto_plan, case=f"auto-vpp{vpp}", pp=2, vpp=vpp,
                        model=ModelSpec(position_embedding_type="rope", num_layers=4),
                        data=DataSpec(num_microbatches=4))
    problems = [p for r in results for p in r.get("problems", [r.get("error")])]
    assert not problems, "\n".join(map(str, problems))
    k, partition, lengths, schedule = _one_plan(results)
    assert sum(lengths) == ROPE.seq_length and len(lengths) == k
    logged = [r["logged"] for r in results if r["rank"] == 0][0]
    assert len(logged) == 1 and " wins: " in logged[0] and " MiB" in logged[0], logged
    assert all(r["bytes_per_token"] > 0 for r in results)  # measured activation bytes
    assert all("W timed apart" in r["source"] and "messages timed" in r["source"]
               for r in results), results[0]["source"]
    # Megatron's local attention computes every score of len x end: that shape, not the
    # better fit, is the fits' quadratic term
    assert all("score rectangle (local attention)" in r["source"] for r in results)


def test_auto_budget_nothing_fits_is_one_clear_error_on_every_rank(ranks):
    results = ranks.run(2, cases.auto_plan, case="auto-budget", pp=2, model=ROPE,
                        data=DataSpec(num_microbatches=2), memory_budget_gib=1e-9)
    errors = [r.get("error") for r in results]
    assert all(e and "no plan fits the activation-memory budget of 0.00 MiB" in e
               and re.search(r"the smallest reachable is [\d.]+ micro-batches \([\d.]+ MiB\), "
                             r"by k=", e)
               for e in errors), errors
    assert len(set(errors)) == 1, errors
