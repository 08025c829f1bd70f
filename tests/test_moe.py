"""Mixture of experts under Seq1F1B: loss, every gradient and the reported load-balancing and
z-losses equal no-pipelining training on the full sequence (fp32, rel. 1e-5)."""

import dataclasses
import os

import pytest

from gpt import DataSpec, ModelSpec, run_layout


@pytest.fixture(autouse=True, scope="module")
def _fresh_workers_afterwards(ranks):
    """Megatron-Core's MoE models are not freed after a case (a reference cycle the collector
    cannot see through), and each keeps its gloo groups' threads: thousands after this module,
    which would slow every later case. The workers are restarted after it."""
    yield
    ranks.close()


def moe(**fields) -> ModelSpec:
    base = dict(num_moe_experts=4, moe_router_topk=2, add_bias_linear=False,
                moe_aux_loss_coeff=0.1, moe_router_load_balancing_type="aux_loss",
                moe_token_dispatcher_type="alltoall")
    base.update(fields)
    return ModelSpec(extra=tuple(base.items()))


def _check(results):
    problems = [f"rank {r['rank']}: {p}" for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems)
    assert any(r["entries"] for r in results), "no rank reported losses"


CASES = {
    "no_losses": moe(moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none"),
    "aux_loss": moe(),
    "seq_aux_loss": moe(moe_router_load_balancing_type="seq_aux_loss"),
    "global_aux_loss": moe(moe_router_load_balancing_type="global_aux_loss"),
    "z_loss_sigmoid_allgather": moe(moe_z_loss_coeff=0.01, moe_router_score_function="sigmoid",
                                    moe_token_dispatcher_type="allgather"),
}


def test_per_token_loss_with_aux_and_z_loss(ranks):
    """calculate_per_token_loss: Megatron scales the router losses by the forward's tokens."""
    results = ranks.run(2, run_layout, case="moe-per-token", per_token=True,
                        model=moe(moe_z_loss_coeff=0.01),
                        data=DataSpec(num_microbatches=3), pp=2,
                        seq1f1b=dict(num_splits=3, partition="balanced"))
    _check(results)


@pytest.mark.parametrize("name", list(CASES))
def test_moe_pp2_k3_balanced(ranks, name):
    results = ranks.run(2, run_layout, case=f"moe-{name}", model=CASES[name],
                        data=DataSpec(num_microbatches=3, micro_batch_size=2), pp=2,
                        seq1f1b=dict(num_splits=3, partition="balanced"))
    _check(results)


def test_moe_forward_only(ranks):
    results = ranks.run(2, run_layout, case="moe-forward-only", model=CASES["aux_loss"],
                        data=DataSpec(num_microbatches=3), pp=2, forward_only=True,
                        seq1f1b=dict(num_splits=4, partition="balanced"))
    _check(results)


def test_mixed_dense_and_moe_layers_with_shared_experts(ranks):
    model = moe(moe_layer_freq=2, moe_shared_expert_intermediate_size=48,
                moe_router_load_balancing_type="seq_aux_loss", moe_z_loss_coeff=0.01)
    results = ranks.run(2, run_layout, case="moe-mixed-shared", model=model,
                        data=DataSpec(num_microbatches=2), pp=2,
                        seq1f1b=dict(num_splits=3, partition="uniform"))
    _check(results)


def test_interleaved_moe(ranks):
    model = dataclasses.replace(moe(moe_router_load_balancing_type="global_aux_loss"),
                                num_layers=8)
    results = ranks.run(2, run_layout, case="moe-interleaved", model=model,
                        data=DataSpec(num_microbatches=2), pp=2, vpp=2,
                        seq1f1b=dict(num_splits=3, partition="balanced"))
    _check(results)


def test_moe_tp2_sp_pp2(ranks):
    results = ranks.run(4, run_layout, case="moe-tp2-sp-pp2", model=CASES["aux_loss"],
                        data=DataSpec(num_microbatches=2), tp=2, pp=2, sp=True,
                        seq1f1b=dict(num_splits=2, partition="balanced"))
    _check(results)


FULL = os.environ.get("SEQ1F1B_FULL") == "1"
EP_LAYOUTS = [(1, "alltoall"), (1, "allgather")] + ([(2, "alltoall")] if FULL else [])


# EP2 x TP2 x PP2 is 8 processes (~40 s here): SEQ1F1B_FULL=1 only.
@pytest.mark.parametrize("tp,dispatcher", EP_LAYOUTS,
                         ids=[f"ep2-tp{tp}-{d}" for tp, d in EP_LAYOUTS])
def test_expert_parallel_pp2(ranks, tp, dispatcher):
    """EP=2 with pipelining (data-parallel replicas exchange tokens with each other's experts)."""
    results = ranks.run(4 * tp, run_layout, case=f"moe-ep2-tp{tp}-{dispatcher}",
                        model=moe(moe_token_dispatcher_type=dispatcher),
                        data=DataSpec(num_microbatches=2), tp=tp, pp=2, sp=tp > 1, ep=2,
                        seq1f1b=dict(num_splits=2, partition="balanced"))
    _check(results)


def test_three_adam_steps_with_expert_bias_equal_no_pipelining(ranks):
    """Aux-loss-free balancing: the router's expert bias is updated from token counts after
    every step; weights and biases after 3 steps equal no-pipelining training."""
    import pipeline_cases

    model = moe(moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none",
                moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid",
                moe_router_bias_update_rate=0.01)
    results = ranks.run(2, pipeline_cases.steps_match_no_pipelining, case="moe-expert-bias",
                        pp=2, k=3, model=model, data=DataSpec(num_microbatches=2))
    assert not [p for r in results for p in r], results


@pytest.mark.parametrize("schedule", ["zb-h1", "zb-h2"])
def test_zero_bubble_moe(ranks, schedule):
    """Deferred weight gradients of the experts' (and shared experts') linear layers."""
    model = moe(moe_shared_expert_intermediate_size=48, moe_z_loss_coeff=0.01)
    results = ranks.run(2, run_layout, case=f"moe-{schedule}", model=model,
                        data=DataSpec(num_microbatches=3), pp=2,
                        seq1f1b=dict(num_splits=3, partition="balanced", schedule=schedule))
    _check(results)


# Context parallelism: each CP rank's router losses hold its own tokens' scores with the counts
# of the whole segment (reduced over the TP x CP group), and the executor scales their
# backward by the CP size as Megatron's forward_step does (the gradient reduction averages
# over the CP ranks too). Without that factor every case but the loss-free one is off.
CONTEXT_PARALLEL = {
    "cp2_aux_loss_mbs2": dict(model=CASES["aux_loss"],
                              data=DataSpec(num_microbatches=2, micro_batch_size=2),
                              seq1f1b=dict(num_splits=2, partition="uniform")),
    "cp2_seq_aux_z_loss_per_token": dict(
        model=moe(moe_router_load_balancing_type="seq_aux_loss", moe_z_loss_coeff=0.01),
        data=DataSpec(num_microbatches=2, micro_batch_size=2), per_token=True,
        seq1f1b=dict(num_splits=2, partition="uniform")),
    "cp2_ep2_z_loss": dict(model=moe(moe_z_loss_coeff=0.01), ep=2,
                           data=DataSpec(num_microbatches=2),
                           seq1f1b=dict(num_splits=3, partition="balanced")),
    "pp2_cp2_global_aux_loss": dict(
        model=moe(moe_router_load_balancing_type="global_aux_loss", moe_z_loss_coeff=0.01),
        pp=2, data=DataSpec(num_microbatches=3), seq1f1b=dict(num_splits=2)),
}


@pytest.mark.parametrize("name", list(CONTEXT_PARALLEL))
def test_moe_with_context_parallelism(ranks, name):
    from megatron_seq1f1b.base import compat

    layout = CONTEXT_PARALLEL[name]
    if layout.get("per_token") and not compat.per_token_router_losses_count_context_parallel():
        pytest.skip(f"megatron-core {compat.megatron_core_version()} scales per-token router "
                    "losses by one CP rank's tokens: refused (tests/test_rejections.py)")
    results = ranks.run(2 * layout.get("pp", 1), run_layout, case=f"moe-{name}", cp=2, **layout)
    _check(results)
