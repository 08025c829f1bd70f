"""Multi-token prediction under Seq1F1B: Megatron's MTP depths read the next tokens of later
segments as data; loss, every gradient (the MTP layers', the shared embedding's) equal
no-pipelining training on the full sequence (fp32, rel. 1e-5)."""

import importlib.util
import os

import pytest

from gpt import DataSpec, ModelSpec, run_layout

HYBRID = importlib.util.find_spec("megatron.core.models.hybrid") is not None


def _check(results):
    problems = [f"rank {r['rank']}: {p}" for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems)
    assert any(r["entries"] for r in results), "no rank reported losses"


def mtp(depth: int, **fields) -> ModelSpec:
    return ModelSpec(extra=(("mtp_num_layers", depth), ("mtp_loss_scaling_factor", 0.3)),
                     **fields)


FULL = os.environ.get("SEQ1F1B_FULL") == "1"  # CI runs the cases the issue names
CASES = [
    # (depth, pipeline stages, k, per-token loss, micro-batch size)
    (1, 1, 3, False, 2),
    (1, 2, 3, True, 2),
    (2, 2, 3, True, 2),
    (1, 4, 3, True, 2),
    (2, 4, 3, True, 2),
] + ([(1, 1, 1, False, 1), (2, 2, 3, False, 2), (2, 4, 4, False, 1)] if FULL else [])


@pytest.mark.parametrize("form", ["eod", "thd"])
def test_gpt_mtp_with_documents(ranks, form):
    """End-of-document ids (Megatron's MTP rolls across them, as without segments) and packed
    THD batches (Megatron rolls per document: nothing crosses a document's end), k=3."""
    documents = (((0, 5, 20),), ((0, 3, 11, 12, 27),), ((0, 8, 16, 24),))
    thd = form == "thd"
    model = mtp(2, attention="flash" if thd else "local")
    results = ranks.run(2, run_layout, case=f"mtp-documents-{form}", model=model,
                        data=DataSpec(num_microbatches=3, documents=documents, thd=thd,
                                      model_loss_mask=thd), pp=2,
                        seq1f1b=dict(num_splits=3, partition="documents",
                                     documents="cu_seqlens" if thd else model.vocab_size - 1))
    _check(results)


@pytest.mark.parametrize("depth,pp,k,per_token,mbs", CASES,
                         ids=[f"d{c[0]}-pp{c[1]}-k{c[2]}-{'per-token' if c[3] else 'mean'}-mbs{c[4]}"
                              for c in CASES])
def test_gpt_mtp_equals_no_pipelining(ranks, depth, pp, k, per_token, mbs):
    results = ranks.run(pp, run_layout, case=f"mtp-d{depth}-pp{pp}-k{k}-{per_token}-{mbs}",
                        model=mtp(depth),
                        data=DataSpec(num_microbatches=4, micro_batch_size=mbs,
                                      model_loss_mask=per_token),
                        pp=pp, per_token=per_token,
                        seq1f1b=dict(num_splits=k, partition="balanced"))
    _check(results)


HYBRID_CASES = [
    # (pattern, pipeline stages, k, per-token loss)
    ("*-*E/*-", 1, 3, False),
    ("*-*E|*-*-/*-", 2, 3, True),
    ("*-*E|*-*-/*-/*-", 2, 3, True),
    ("*E|-*|*-|*-/*-", 4, 3, True),
] + ([("*E|-*|*-|*-/*-/*-", 4, 3, True)] if FULL else [])


@pytest.mark.skipif(not HYBRID, reason="HybridModel is in megatron-core 0.18 and later")
@pytest.mark.parametrize("pattern,pp,k,per_token", HYBRID_CASES,
                         ids=[f"{c[0]}-pp{c[1]}-k{c[2]}" for c in HYBRID_CASES])
def test_hybrid_mtp_equals_no_pipelining(ranks, pattern, pp, k, per_token):
    """HybridModel's MTP depths ('/' parts of the pattern), micro-batch size 2."""
    moe = (("num_moe_experts", 4), ("moe_router_topk", 2), ("add_bias_linear", False),
           ("moe_token_dispatcher_type", "alltoall"))
    model = ModelSpec(hybrid=pattern, extra=moe + (("mtp_loss_scaling_factor", 0.3),))
    results = ranks.run(pp, run_layout, case=f"mtp-hybrid-{pattern}-{k}", model=model,
                        data=DataSpec(num_microbatches=4, micro_batch_size=2,
                                      model_loss_mask=True), pp=pp,
                        per_token=per_token, seq1f1b=dict(num_splits=k, partition="balanced"))
    _check(results)
