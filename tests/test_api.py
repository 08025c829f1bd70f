"""Public API surface: signature, install/uninstall, argument errors, lazy imports."""

import inspect
import subprocess
import sys

import pytest

import megatron_seq1f1b as s1


def test_signature_matches_megatron_core():
    from megatron.core.pipeline_parallel import schedules

    ours = inspect.signature(s1.get_forward_backward_func(2))
    for name in ("forward_backward_pipelining_without_interleaving",
                 "forward_backward_pipelining_with_interleaving",
                 "forward_backward_no_pipelining"):
        theirs = inspect.signature(getattr(schedules, name))
        assert list(ours.parameters) == list(theirs.parameters), name
        for param in theirs.parameters.values():
            assert ours.parameters[param.name].kind == param.kind
            assert ours.parameters[param.name].default == param.default


def test_install_and_uninstall():
    from megatron.core import pipeline_parallel
    from megatron.core.pipeline_parallel import schedules

    original = schedules.get_forward_backward_func
    ours = s1.install(3, "balanced")
    try:
        assert pipeline_parallel.get_forward_backward_func() is ours
        assert schedules.get_forward_backward_func() is ours
        assert schedules.get_forward_backward_func(pp_size=4, vp_size=None) is ours
        # Megatron-LM core_v0.19's train() and evaluate() pass schedule_pg_collection.
        assert schedules.get_forward_backward_func(schedule_pg_collection=None) is ours
        getter_keywords = set(inspect.signature(schedules.get_forward_backward_func).parameters)
        assert getter_keywords == set(s1.api.GETTER_KEYWORDS)
        assert set(inspect.signature(original).parameters) <= getter_keywords

        class MultiModuleProcessGroupCollection:  # Megatron's cross-grid collection, by name
            pass

        with pytest.raises(s1.ConfigError, match="multi-module"):
            schedules.get_forward_backward_func(
                schedule_pg_collection=MultiModuleProcessGroupCollection())
        assert ours.num_splits == 3 and ours.partition == "balanced"
        again = s1.install(2)  # re-installing replaces, uninstall still restores Megatron's
        assert pipeline_parallel.get_forward_backward_func() is again
    finally:
        s1.uninstall()
    assert schedules.get_forward_backward_func is original
    assert pipeline_parallel.get_forward_backward_func is original


@pytest.mark.parametrize("args,kwargs,match", [
    ((0,), {}, "positive integer"),
    ((2, "random"), {}, "unknown partition"),
    ((2,), {"split_lengths": [1, 2, 3]}, "3 entries"),
])
def test_bad_arguments(args, kwargs, match):
    with pytest.raises(s1.ConfigError, match=match):
        s1.get_forward_backward_func(*args, **kwargs)


def test_schedule_tools_do_not_import_megatron():
    code = ("import sys, megatron_seq1f1b as s1; s1.simulate.simulate(s1.schedule.build_schedule(2,2,2));"
            "print('megatron.core' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_slice_batch_is_identity_outside_segments():
    import torch

    batch = {"tokens": torch.zeros(2, 8), "attention_mask": None, "other": 3}
    assert s1.current_segment() is None
    assert s1.slice_batch(batch) is batch
