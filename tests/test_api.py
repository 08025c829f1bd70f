"""Public API surface: signature, install/uninstall, argument errors, lazy imports."""

import inspect
import subprocess
import sys
import types

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
    signature = inspect.signature(original)
    ours = s1.install(3, "balanced")
    try:
        assert pipeline_parallel.get_forward_backward_func() is ours
        assert schedules.get_forward_backward_func() is ours
        assert schedules.get_forward_backward_func(pp_size=4, vp_size=None) is ours
        # Megatron-LM core_v0.19's train() and evaluate() pass schedule_pg_collection.
        assert schedules.get_forward_backward_func(schedule_pg_collection=None) is ours
        getter_keywords = set(inspect.signature(schedules.get_forward_backward_func).parameters)
        assert getter_keywords == set(s1.api.GETTER_KEYWORDS)
        assert set(signature.parameters) <= getter_keywords
        assert inspect.signature(original) == signature  # the guarded original still reads so

        class MultiModuleProcessGroupCollection:  # Megatron's cross-grid collection, by name
            pass

        with pytest.raises(s1.ConfigError, match="multi-module"):
            schedules.get_forward_backward_func(
                schedule_pg_collection=MultiModuleProcessGroupCollection())
        assert ours.num_splits == 3 and ours.partition == "balanced"
        again = s1.install(2)  # re-installing replaces, uninstall still restores Megatron's
        assert pipeline_parallel.get_forward_backward_func() is again
        assert schedules.get_forward_backward_func() is again
    finally:
        s1.uninstall()
    assert schedules.get_forward_backward_func is original
    assert pipeline_parallel.get_forward_backward_func is original
    s1.uninstall()  # a second uninstall does nothing


def _holder(name: str, monkeypatch) -> types.ModuleType:
    """A loaded module called ``name`` that did ``from megatron.core.pipeline_parallel import
    get_forward_backward_func``, as Megatron-LM's training and Megatron-Bridge's train do."""
    module = types.ModuleType(name)
    exec("from megatron.core.pipeline_parallel import get_forward_backward_func", vars(module))
    monkeypatch.setitem(sys.modules, name, module)
    return module


@pytest.mark.parametrize("name", ["megatron.training.training", "megatron.bridge.training.train",
                                  "megatron.bridge.training.eval", "users_training_loop"])
def test_install_reaches_modules_that_imported_the_getter_before(name, monkeypatch):
    from megatron.core.pipeline_parallel import schedules

    original = schedules.get_forward_backward_func
    module = _holder(name, monkeypatch)
    assert module.get_forward_backward_func is original
    ours = s1.install(2)
    try:
        assert module.get_forward_backward_func() is ours
    finally:
        s1.uninstall()
    assert module.get_forward_backward_func is original


def test_install_reaches_the_main_script(monkeypatch):
    """``from megatron.core.pipeline_parallel import get_forward_backward_func`` at the top of
    the script run (``__main__``), install() later: the script's name calls Seq1F1B."""
    from megatron.core.pipeline_parallel import schedules

    main = sys.modules["__main__"]
    monkeypatch.setattr(main, "get_forward_backward_func", schedules.get_forward_backward_func,
                        raising=False)
    ours = s1.install(2)
    try:
        assert main.get_forward_backward_func() is ours
    finally:
        s1.uninstall()
    assert main.get_forward_backward_func is schedules.get_forward_backward_func


def test_modules_imported_after_install_get_it_and_lose_it_on_uninstall(monkeypatch):
    from megatron.core.pipeline_parallel import schedules

    ours = s1.install(2)
    try:
        module = _holder("megatron.bridge.training.train", monkeypatch)
        assert module.get_forward_backward_func() is ours
        again = s1.install(3)  # re-installing reaches it too
        assert module.get_forward_backward_func() is again
    finally:
        s1.uninstall()
    assert module.get_forward_backward_func is schedules.get_forward_backward_func


def test_module_attribute_access_sees_the_installed_getter():
    import megatron.core.pipeline_parallel as pipeline_parallel
    import megatron.core.pipeline_parallel.schedules as schedules

    ours = s1.install(2)
    try:
        assert pipeline_parallel.get_forward_backward_func() is ours
        assert schedules.get_forward_backward_func() is ours
    finally:
        s1.uninstall()


def test_a_reference_taken_before_install_fails_loudly_until_uninstall():
    """A local variable install() cannot rebind: calling it raises one line naming install(),
    where it would have run Megatron's schedule; after uninstall() it is Megatron's again."""
    from megatron.core.pipeline_parallel import schedules

    held = schedules.get_forward_backward_func
    megatron = held(pp_size=1, vp_size=None)
    s1.install(2)
    try:
        with pytest.raises(RuntimeError, match=r"install\(\)") as failure:
            held(pp_size=1, vp_size=None)
        assert "\n" not in str(failure.value) and "uninstall()" in str(failure.value)
        with pytest.raises(RuntimeError, match=r"install\(\)"):
            held()
    finally:
        s1.uninstall()
    assert held(pp_size=1, vp_size=None) is megatron is schedules.forward_backward_no_pipelining


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
