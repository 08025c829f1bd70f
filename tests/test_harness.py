"""The harness against Megatron-Core's own schedules, and proof that it can fail."""

import pytest
import torch

from gpt import DataSpec, ModelSpec, run_layout
from harness import CaseFailed

MODEL = ModelSpec()
MODEL8 = ModelSpec(num_layers=8)
DATA = DataSpec(num_microbatches=4)

LAYOUTS = {
    "pp2": dict(world=2, pp=2),
    "pp4": dict(world=4, pp=4),
    "pp4_vpp2": dict(world=4, pp=4, vpp=2, model=MODEL8),
    "pp2_vpp2": dict(
        world=2,
        pp=2,
        vpp=2,
        # Megatron's async p2p sends may still be reading an output when it is
        # pseudo-freed; with gloo that race is real, so keep outputs allocated.
        config_overrides=dict(
            overlap_p2p_comm=True, batch_p2p_comm=False, deallocate_pipeline_outputs=False
        ),
    ),
    "tp2_pp2_sp": dict(world=4, tp=2, pp=2, sp=True),
    "dp2_pp2_ddp": dict(world=4, pp=2, ddp=dict(overlap_grad_reduce=True)),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_megatron_schedules_match_reference(ranks, name):
    layout = dict(LAYOUTS[name])
    world = layout.pop("world")
    layout.setdefault("model", MODEL)
    results = ranks.run(world, run_layout, case=name, data=DATA, **layout)
    problems = [f"rank {r['rank']}: {p}" for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems)
    assert any(r["entries"] for r in results), "no rank reported losses"


def _perturb_one_gradient(models, store):
    """A deliberately wrong schedule result: one gradient element off by 1e-3 relative."""
    for model in models:
        for param in model.parameters():
            grad = param.main_grad
            grad.view(-1)[0] += 1e-3 * grad.abs().max()
            return


def _drop_last_report(models, store):
    if store:
        store[-1]["lm loss"] = store[-1]["lm loss"] * 1.001


def test_comparison_catches_a_wrong_gradient(ranks):
    results = ranks.run(
        2, run_layout, case="tampered-grad", model=MODEL, data=DATA, pp=2, tamper=_perturb_one_gradient
    )
    assert all(r["problems"] for r in results), results


def test_comparison_catches_a_wrong_loss(ranks):
    results = ranks.run(
        2, run_layout, case="tampered-loss", model=MODEL, data=DATA, pp=2, tamper=_drop_last_report
    )
    last = [r for r in results if r["entries"]]
    assert last and all(any("loss" in p for p in r["problems"]) for r in last), results


def _raise_on_rank_one():
    if torch.distributed.get_rank() == 1:
        raise ValueError("boom on purpose")
    torch.distributed.barrier()


def test_failure_names_rank_and_does_not_hang(ranks):
    with pytest.raises(CaseFailed, match=r"(?s)rank\(s\) \[(0, )?1\].*boom on purpose"):
        ranks.run(2, _raise_on_rank_one, case="raises", timeout=60)
