"""Executor cases beyond the reference grid (run in harness workers)."""

from __future__ import annotations

import time
from functools import partial

import torch
from megatron.core import parallel_state
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import schedules

import megatron_seq1f1b as s1
from gpt import (
    DataSpec,
    ModelSpec,
    build_chunks,
    copy_weights,
    forward_step,
    init_parallel,
    make_batches,
    make_config,
    reference,
    tp_slice,
    global_name,
    unwrap,
    wrap_ddp,
)


def _layout(model, data, pp, tp=1, sp=False, enable=False, ddp=None, per_token=False,
            timeout_s=None, vpp=None, **cfg):
    world = torch.distributed.get_world_size()
    dp = world // (tp * pp)
    batches = make_batches(model, data, count=data.num_microbatches * dp)
    ref = reference(model, (data, dp), batches, per_token)
    init_parallel(tp, pp, vpp, timeout_s=timeout_s)
    config = make_config(model, tp=tp, pp=pp, vpp=vpp, sp=sp, calculate_per_token_loss=per_token,
                         **cfg)
    chunks = build_chunks(model, config)
    copy_weights(chunks, ref, model)
    if enable:
        s1.enable(chunks)
    models = wrap_ddp(chunks, config, **(ddp or {}))
    m = data.num_microbatches
    rank = parallel_state.get_data_parallel_rank()
    return ref, config, models, batches[rank * m : (rank + 1) * m]


def _run(fwd_bwd, models, batches, model, data, slicer=None, **kw):
    many = len(models) > 1
    return fwd_bwd(
        forward_step_func=partial(forward_step, slicer=slicer),
        data_iterator=[iter(batches) for _ in models] if many else iter(batches),
        model=models if many else models[0],
        num_microbatches=len(batches),
        seq_length=model.seq_length,
        micro_batch_size=data.micro_batch_size,
        **kw,
    )


def bit_identical_k1(pp: int, model: ModelSpec, data: DataSpec, vpp=None) -> list[str]:
    """Megatron's own schedule and ours with num_splits=1: exactly equal results."""
    outcomes = []
    for make in (schedules.get_forward_backward_func, lambda: s1.get_forward_backward_func(1)):
        _, _, models, batches = _layout(model, data, pp, vpp=vpp)
        store = _run(make(), models, batches, model, data)
        grads = {f"{i}.{n}": p.main_grad.clone() for i, m in enumerate(models)
                 for n, p in unwrap(m).named_parameters()}
        outcomes.append((grads, [e["lm loss"] for e in store]))
    (grads_a, store_a), (grads_b, store_b) = outcomes
    problems = [n for n in grads_a if not torch.equal(grads_a[n], grads_b[n])]
    if len(store_a) != len(store_b) or any(not torch.equal(a, b) for a, b in zip(store_a, store_b)):
        problems.append("loss reports differ")
    return problems


def optimizer_step(pp: int, k: int, distributed: bool, model: ModelSpec, data: DataSpec,
                   schedule: str = "1f1b") -> list[str]:
    """One Adam step after Seq1F1B equals one step on the reference gradients.

    eps = 1 makes the first Adam step ``lr * g / (|g| + 1)``: nearly linear in
    the gradient, so wrong gradients show up in the parameters.
    """
    lr, eps = 0.1, 1.0
    ddp = dict(use_distributed_optimizer=distributed, overlap_grad_reduce=True)
    ref, config, models, batches = _layout(model, data, pp, enable=True, ddp=ddp)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=lr, weight_decay=0.0, clip_grad=0.0, adam_eps=eps,
                        use_distributed_optimizer=distributed, bf16=False, fp16=False),
        models, use_gloo_process_groups=False,
    )
    optimizer.zero_grad()
    _run(s1.get_forward_backward_func(k, "balanced", schedule=schedule), models, batches, model,
         data, slicer=s1.slice_batch)
    success, _, _ = optimizer.step()
    problems = [] if success else ["optimizer step reported failure"]
    gpt = unwrap(models[0])
    for name, param in gpt.named_parameters():
        full = global_name(gpt, name, model)
        grad = ref["grads"][full]
        expected = tp_slice(param, ref["state"][full] - lr * grad / (grad.abs() + eps))
        err = (param.detach() - expected).abs().max().item()
        moved = (tp_slice(param, ref["state"][full]) - expected).abs().max().item()
        if err > 1e-5 * max(moved, 1e-12):
            problems.append(f"{name}: parameter after step off by {err:.2e} (step {moved:.2e})")
    return problems


def peak_and_iterator(pp: int, k: int, m: int, model: ModelSpec, png: str | None = None) -> dict:
    """Live units during a real run, how often the caller's iterator advanced, its timeline."""
    from megatron_seq1f1b.runtime.trace import TimelineRecorder

    data = DataSpec(num_microbatches=m)
    _, _, models, batches = _layout(model, data, pp, enable=True)
    calls = []

    def counting():
        for batch in batches:
            calls.append(1)
            yield batch

    recorder = TimelineRecorder()
    source = counting()
    fwd_bwd = s1.get_forward_backward_func(k, recorder=recorder)
    fwd_bwd(
        forward_step_func=partial(forward_step, slicer=s1.slice_batch), data_iterator=source,
        model=models[0], num_microbatches=m, seq_length=model.seq_length, micro_batch_size=1,
    )
    record = recorder.last
    timeline = recorder.gather(group=parallel_state.get_pipeline_model_parallel_group())
    if png and torch.distributed.get_rank() == 0:
        from megatron_seq1f1b.schedules import draw

        draw.draw_png(timeline, png, title="measured")
    return {
        "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
        "peak": record.peak_live_units,
        "next_calls": len(calls),
        "computed": [str(iv.action) for iv in record.compute],
        "gathered": [[str(iv.action) for iv in rank] for rank in timeline.compute],
        "ordered": all(a.end <= b.start + 1e-9 for rank in timeline.compute
                       for a, b in zip(rank, rank[1:])),
    }


def forward_only(pp: int, k: int, model: ModelSpec, data: DataSpec) -> dict:
    """Evaluation: loss reports equal the reference, one store entry per micro-batch (as
    Megatron's); non-loss data per micro-batch, the tuple of its segments' values."""
    ref, _, models, batches = _layout(model, data, pp, enable=True)
    fwd_bwd = s1.get_forward_backward_func(k)
    store = _run(fwd_bwd, models, batches, model, data, slicer=s1.slice_batch, forward_only=True)
    collected = fwd_bwd(
        forward_step_func=_non_loss_step, data_iterator=iter(batches), model=models[0],
        num_microbatches=len(batches), seq_length=model.seq_length,
        micro_batch_size=data.micro_batch_size, forward_only=True, collect_non_loss_data=True,
    )
    grads = [p.main_grad.abs().sum().item() for p in models[0].parameters()]
    result = {"pp_rank": parallel_state.get_pipeline_model_parallel_rank(), "grad_sum": sum(grads)}
    if parallel_state.is_pipeline_last_stage():
        reports = torch.stack([e["lm loss"] for e in store])
        result["loss_err"] = (reports - ref["reports"]).abs().max().item()
        result["collected"] = [len(entry["logits_shape"]) for entry in collected]
    return result


def _non_loss_step(data_iterator, model):
    batch = s1.slice_batch(next(data_iterator))
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"])

    def collect(out, non_loss_data=False):
        assert non_loss_data
        return {"logits_shape": tuple(out.shape)}

    return output, collect


def configuration_errors(model: ModelSpec) -> dict:
    """Messages of configurations rejected before any communication."""
    data = DataSpec(num_microbatches=2)
    out = {}

    def attempt(name, fb, models, batches, **kw):
        start = time.monotonic()
        try:
            _run(fb, models, batches, model, data, slicer=s1.slice_batch, **kw)
        except Exception as exc:  # noqa: BLE001
            out[name] = (f"{type(exc).__name__}: {exc}", time.monotonic() - start)
        else:
            out[name] = (None, time.monotonic() - start)

    _, config, models, batches = _layout(model, data, 2)
    attempt("not_enabled", s1.get_forward_backward_func(2), models, batches)
    attempt("lengths_sum", s1.get_forward_backward_func(2, split_lengths=[10, 10]), models, batches)
    # One segment on a model enable() did not prepare is Megatron's own schedule (the drop-in
    # contract, tests/test_dropin.py): the executor's rules below apply to prepared ones.
    s1.enable(models)
    attempt("adjust_shapes", s1.get_forward_backward_func(1), models, batches,
            adjust_tensor_shapes_fn=lambda r, s: (r, s))
    config.variable_seq_lengths = True  # one cut for micro-batches of their own lengths
    attempt("variable_seq_lengths", s1.get_forward_backward_func(2, split_lengths=[16, 16]),
            models, batches)
    config.variable_seq_lengths = False
    config.overlap_p2p_comm, config.batch_p2p_comm = True, False
    attempt("overlap_p2p", s1.get_forward_backward_func(1), models, batches)
    config.overlap_p2p_comm, config.batch_p2p_comm = False, True

    _, config, models, batches = _layout(model, data, 1, tp=2, sp=True, enable=True)
    attempt("sp_divisibility", s1.get_forward_backward_func(2, split_lengths=[17, 15]), models,
            batches)

    _, config, models, batches = _layout(model, data, 2, enable=True)

    def two_tuple_step(data_iterator, m):
        output, loss_func = forward_step(data_iterator, m, slicer=s1.slice_batch)
        return output, lambda out: loss_func(out)[::2]

    start = time.monotonic()
    try:
        s1.get_forward_backward_func(2)(
            forward_step_func=two_tuple_step, data_iterator=iter(batches), model=models[0],
            num_microbatches=2, seq_length=model.seq_length, micro_batch_size=1,
        )
        out["two_tuple_loss"] = (None, time.monotonic() - start)
    except Exception as exc:  # noqa: BLE001
        out["two_tuple_loss"] = (f"{type(exc).__name__}: {exc}", time.monotonic() - start)
    return out


def schedule_disagreement(model: ModelSpec) -> dict:
    """Stages with different segment lengths fail before any p2p message."""
    data = DataSpec(num_microbatches=2)
    _, _, models, batches = _layout(model, data, 2, enable=True)
    lengths = [16, 16] if torch.distributed.get_rank() == 0 else [20, 12]
    start = time.monotonic()
    try:
        _run(s1.get_forward_backward_func(2, split_lengths=lengths), models, batches, model, data,
             slicer=s1.slice_batch)
    except Exception as exc:  # noqa: BLE001
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


def p2p_lost_message(model: ModelSpec, timeout_s: float) -> dict:
    """Stage 0 never sends one activation: both stages fail within the timeout."""
    from megatron_seq1f1b.runtime import executor, executor_setup  # noqa: F401
    from megatron_seq1f1b.schedules.plan import Step

    data = DataSpec(num_microbatches=2)
    _, _, models, batches = _layout(model, data, 2, enable=True, timeout_s=timeout_s)
    original = executor_setup.rank_steps

    def lossy(*args):
        steps = list(original(*args))
        if torch.distributed.get_rank() == 0:
            # Drop the last activation sent (micro-batch 1, segment 1): dropping an
            # earlier one would shift every later message on the link instead.
            steps = [Step(tuple(m for m in st.sends if (m.microbatch, m.segment) != (1, 1)),
                          st.recvs, st.actions) for st in steps]
        return tuple(steps)

    executor_setup.rank_steps = lossy
    executor_setup.step_plan.cache_clear()  # made with the lossless steps in earlier cases
    start = time.monotonic()
    try:
        _run(s1.get_forward_backward_func(2), models, batches, model, data, slicer=s1.slice_batch)
    except Exception as exc:  # noqa: BLE001
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - start}
    finally:
        executor_setup.rank_steps = original
        executor_setup.step_plan.cache_clear()
    return {"error": None, "seconds": time.monotonic() - start}


def zero_bubble_defers(pp: int, k: int, drop_weight_grads: bool, model: ModelSpec,
                       data: DataSpec) -> dict:
    """How many weight GEMMs each W ran; with `drop_weight_grads`, W does nothing (must fail)."""
    from megatron_seq1f1b.runtime import wgrad
    from gpt import run_layout

    original = wgrad.WeightGradStore.run
    counts = []

    def run(self, unit):
        if drop_weight_grads:
            self._pending.pop(unit)
            counts.append(0)
            return 0
        counts.append(original(self, unit))
        return counts[-1]

    wgrad.WeightGradStore.run = run
    try:
        result = run_layout(model=model, data=data, pp=pp,
                            seq1f1b=dict(num_splits=k, partition="uniform", schedule="zb-h1"))
    finally:
        wgrad.WeightGradStore.run = original
    return dict(result, weight_gemms=counts)


def zero_bubble_with_costs(pp: int, k: int, costs, model: ModelSpec, data: DataSpec) -> dict:
    """A zero-bubble run given the planner's per-segment costs: the results, and the costs
    that placed the steps this rank ran."""
    from megatron_seq1f1b.runtime import executor, executor_setup  # noqa: F401
    from gpt import run_layout

    original, used = executor_setup.rank_steps, []

    def recording(*args):
        used.append(args[-1])  # costs
        return original(*args)

    executor_setup.rank_steps = recording
    try:
        result = run_layout(model=model, data=data, pp=pp,
                            seq1f1b=dict(num_splits=k, partition="uniform", schedule="zb-h1",
                                         segment_costs=costs))
    finally:
        executor_setup.rank_steps = original
    return dict(result, costs_used=used)


def auto_plan(pp: int, model: ModelSpec, data: DataSpec, vpp: int | None = None,
              cp: int = 1, time_every_candidate: bool = False, **budget) -> dict:
    """The auto forward-backward function (what Megatron-LM's --seq1f1b-splits auto installs):
    planned on its first call, then exact; or the error a budget nothing fits gives.
    ``time_every_candidate``: the search times (and logs) every candidate, as the planner's
    ``--top 0`` does, instead of leaving those its bounds rule out untimed."""
    from megatron_seq1f1b.base.checks import ConfigError
    from megatron_seq1f1b.planner import search
    from megatron_seq1f1b.planner.auto import auto_forward_backward_func
    from gpt import run_layout

    logged = []
    func = auto_forward_backward_func(min_segment_length=4, log=logged.append, **budget)
    choose = search.choose_plan
    if time_every_candidate:  # the ranks' processes serve later cases: put it back after
        search.choose_plan = lambda *args, **kwargs: choose(*args, exhaustive=True, **kwargs)
    try:
        result = run_layout(model=model, data=data, pp=pp, vpp=vpp, forward_backward=func,
                            prepare=s1.enable, slicer=s1.slice_batch, cp=cp)
    except ConfigError as exc:
        return {"error": str(exc)}
    finally:
        search.choose_plan = choose
    plan = func.choice.plan
    return dict(result, plan=[plan.num_splits, plan.partition, list(plan.lengths),
                              plan.schedule], logged=logged,
                bytes_per_token=func.choice.plan.memory_bytes, source=func.choice.source)


def fault_in_user_code(stage: int, action: str, where: str, model: ModelSpec,
                       timeout_s: float) -> dict:
    """pp=4: the user's code raises on one stage in one action; every rank's error, timed.

    `where`: "forward" (forward_step_func), "loss" (loss_func, last stage) or "backward" (a
    hook the forward step registered, run by that unit's backward).
    """
    from megatron_seq1f1b.schedules.schedule import Action

    data = DataSpec(num_microbatches=4)
    _, _, models, batches = _layout(model, data, 4, enable=True, timeout_s=timeout_s)
    target = Action.parse(action)
    mine = parallel_state.get_pipeline_model_parallel_rank() == stage

    def boom(*_):
        raise ValueError(f"injected failure in {where}")

    def failing_step(data_iterator, chunk):
        info = s1.current_segment()
        hit = mine and (info.microbatch, info.index) == (target.microbatch, target.segment)
        if hit and where == "forward":
            boom()
        output, loss_func = forward_step(data_iterator, chunk, slicer=s1.slice_batch)
        if hit and where == "backward":
            output.register_hook(boom)
        if hit and where == "loss":
            return output, boom
        return output, loss_func

    fwd_bwd = s1.get_forward_backward_func(2, "uniform")
    start = time.monotonic()
    try:
        fwd_bwd(forward_step_func=failing_step, data_iterator=iter(batches), model=models[0],
                num_microbatches=len(batches), seq_length=model.seq_length,
                micro_batch_size=data.micro_batch_size)
    except Exception as exc:  # noqa: BLE001
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - start,
                "rank": torch.distributed.get_rank()}
    # A rank that no longer needed the failed one finishes its schedule; its next collective
    # over the pipeline (gradient norm, the next iteration's agreement check) cannot.
    try:
        torch.distributed.all_reduce(torch.zeros(1),
                                     group=parallel_state.get_pipeline_model_parallel_group())
    except Exception as exc:  # noqa: BLE001
        return {"error": f"next collective: {type(exc).__name__}: {exc}", "finished": True,
                "seconds": time.monotonic() - start, "rank": torch.distributed.get_rank()}
    return {"error": None, "seconds": time.monotonic() - start,
            "rank": torch.distributed.get_rank()}


def context_parallel_fault(failing_rank: int, model: ModelSpec, timeout_s: float) -> dict:
    """CP 2 (one stage): one rank's forward step raises in segment 1 of micro-batch 0; what
    each rank raises, and how long it took."""
    from gpt import wrap_ddp

    data = DataSpec(num_microbatches=2)
    batches = make_batches(model, data)
    init_parallel(1, 1, None, timeout_s=timeout_s, context_parallel_size=2)
    config = make_config(model, context_parallel_size=2)
    chunks = build_chunks(model, config)
    s1.enable(chunks)
    models = wrap_ddp(chunks, config)
    me = torch.distributed.get_rank()

    def failing_step(data_iterator, chunk):
        info = s1.current_segment()
        if me == failing_rank and (info.microbatch, info.index) == (0, 1):
            raise ValueError("injected failure")
        return forward_step(data_iterator, chunk, slicer=s1.slice_batch)

    start = time.monotonic()
    try:
        s1.get_forward_backward_func(2)(
            forward_step_func=failing_step, data_iterator=iter(batches), model=models[0],
            num_microbatches=len(batches), seq_length=model.seq_length, micro_batch_size=1)
    except Exception as exc:  # noqa: BLE001
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - start,
                "rank": me}
    return {"error": None, "seconds": time.monotonic() - start, "rank": me}


def forgotten_slice_batch(pp: int, model: ModelSpec, data: DataSpec, timeout_s: float) -> dict:
    """A forward step without s1.slice_batch (the whole micro-batch to every segment, k=2):
    what each rank raises, and how long it took."""
    _, _, models, batches = _layout(model, data, pp, enable=True, timeout_s=timeout_s)
    documents = "cu_seqlens" if data.thd else None
    start = time.monotonic()
    try:
        _run(s1.get_forward_backward_func(2, documents=documents), models, batches, model, data)
    except Exception as exc:  # noqa: BLE001
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - start,
                "rank": torch.distributed.get_rank()}
    return {"error": None, "seconds": time.monotonic() - start,
            "rank": torch.distributed.get_rank()}


def _train(models, batches, model, data, fwd_bwd, steps: int, slicer=None) -> None:
    # adam_eps=1: updates nearly linear in the gradient (as in optimizer_step), so rounding
    # differences are not blown up to +-lr where a gradient element is ~0.
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=0.1, weight_decay=0.0, clip_grad=0.0, adam_eps=1.0,
                        bf16=False, fp16=False),
        models, use_gloo_process_groups=False,
    )
    for _ in range(steps):
        for m in models:
            m.zero_grad_buffer()
        optimizer.zero_grad()
        _run(fwd_bwd, models, batches, model, data, slicer=slicer)
        success, _, _ = optimizer.step()
        assert success


def _trained_state(models, model: ModelSpec) -> dict:
    """Parameters and router expert biases by their names in the pp=1 model."""
    state = {}
    for chunk in models:
        gpt = unwrap(chunk)
        for name, param in gpt.named_parameters():
            state[global_name(gpt, name, model)] = param.detach().clone()
        for name, buffer in gpt.named_buffers():
            if name.endswith("expert_bias"):
                state[global_name(gpt, name, model)] = buffer.detach().clone()
    return state


def steps_match_no_pipelining(pp: int, k: int, model: ModelSpec, data: DataSpec,
                              steps: int = 3) -> list[str]:
    """``steps`` Adam steps with Seq1F1B equal ``steps`` with no pipelining: every weight and
    every router expert bias (aux-loss-free balancing updates it from the token counts)."""
    world = torch.distributed.get_world_size()
    batches = make_batches(model, data)
    initial = reference(model, (data, world),
                        make_batches(model, data, count=data.num_microbatches * world), False)
    # Reference: pp=1; every data-parallel replica trains on the same micro-batches.
    init_parallel()
    config = make_config(model)
    chunks = build_chunks(model, config)
    copy_weights(chunks, initial, model)
    models = wrap_ddp(chunks, config)
    _train(models, batches, model, data, schedules.forward_backward_no_pipelining, steps)
    expected = _trained_state(models, model)
    # Seq1F1B on pp stages from the same initial weights.
    init_parallel(1, pp)
    config = make_config(model, pp=pp)
    chunks = build_chunks(model, config)
    copy_weights(chunks, initial, model)
    s1.enable(chunks)
    models = wrap_ddp(chunks, config)
    _train(models, batches, model, data, s1.get_forward_backward_func(k, "balanced"), steps,
           slicer=s1.slice_batch)
    problems = []
    actual = _trained_state(models, model)
    biases = [name for name in actual if name.endswith("expert_bias")]
    if not biases:
        problems.append("no router expert bias on this rank")
    if any(expected[name].abs().max().item() == 0 for name in biases):
        problems.append("the reference never updated an expert bias: the test proves nothing")
    for name, value in actual.items():
        start = initial["state"].get(name)
        moved = (expected[name] - start).abs().max().item() if start is not None else 1.0
        err = (value - expected[name]).abs().max().item()
        if err > 1e-5 * max(moved, expected[name].abs().max().item() * 1e-3, 1e-12):
            problems.append(f"{name}: after {steps} steps off by {err:.2e} (moved {moved:.2e})")
    return problems


def with_links_transport(**layout) -> dict:
    """``run_layout`` with the links transport NCCL gets (a process group per link direction,
    operations posted one by one) forced on gloo; its groups are destroyed afterwards."""
    import os

    from gpt import run_layout
    from megatron_seq1f1b.runtime import p2p

    os.environ[p2p.TRANSPORT_ENV] = p2p.LINKS
    try:
        result = run_layout(**layout)
        links = next(iter(p2p._LINK_GROUPS.values()), {})
        result["links"] = sorted(links)
        result["link_timeouts_s"] = sorted({p2p.group_timeout(g).total_seconds()
                                            for g in links.values()})
        return result
    finally:
        del os.environ[p2p.TRANSPORT_ENV]
        p2p.destroy_link_groups()


def with_setup_lengths(**layout) -> dict:
    """``run_layout``, plus the segment lengths the executor's setup used."""
    from gpt import run_layout
    from megatron_seq1f1b.runtime import executor, executor_setup  # noqa: F401

    executor.clear_setups()
    result = run_layout(**layout)
    result["lengths"] = list(next(reversed(executor_setup._SETUPS.values())).lengths)
    return result


def layout_against_megatron(pp: int, layout: str, k: int, model: ModelSpec,
                            data: DataSpec) -> dict:
    """A ``pipeline_model_parallel_layout`` run by Megatron's own schedule and by Seq1F1B (``k``
    balanced segments) from the same weights: this rank's differences between the two (loss
    reports per micro-batch, every gradient), its attention layers, and the lengths it cut."""
    from megatron_seq1f1b.runtime import executor_setup
    from gpt import RTOL, _close

    outcomes = []
    for seq1f1b in (False, True):
        _, _, models, batches = _layout(model, data, pp, enable=seq1f1b,
                                        pipeline_model_parallel_layout=layout)
        fwd_bwd = (s1.get_forward_backward_func(k, "balanced") if seq1f1b
                   else schedules.get_forward_backward_func())
        store = _run(fwd_bwd, models, batches, model, data,
                     slicer=s1.slice_batch if seq1f1b else None)
        reports = (torch.stack([e["lm loss"] for e in store]).view(len(batches), -1, 2).sum(1)
                   if store else None)
        grads = {n: p.main_grad.clone() for n, p in unwrap(models[0]).named_parameters()}
        outcomes.append((reports, grads))
    (reports_a, grads_a), (reports_b, grads_b) = outcomes
    problems = [f"{name}: max rel err {rel:.2e}" for name in grads_a
                for ok, rel in [_close(grads_b[name], grads_a[name], RTOL)] if not ok]
    if (reports_a is None) != (reports_b is None):
        problems.append("only one schedule reported losses")
    elif reports_a is not None:
        ok, rel = _close(reports_b, reports_a, RTOL)
        problems += [] if ok else [f"loss reports: max rel err {rel:.2e}"]
    from megatron_seq1f1b.planner.measure import pipeline_dense_attention
    from megatron_seq1f1b.runtime.model_hooks import dense_attention

    gpt = unwrap(models[0])
    return {"problems": problems, "layers": len(gpt.decoder.layers), "params": len(grads_a),
            "reported": reports_a is not None, "own_dense": dense_attention(models),
            "pipeline_dense": pipeline_dense_attention(models),
            "lengths": list(next(reversed(executor_setup._SETUPS.values())).lengths)}


def stage_local_refusal(model: ModelSpec) -> dict:
    """Stage 1's model is not prepared for segments (enable() only on stage 0): every stage
    fails before any p2p message, stage 0 naming stage 1 (it used to go on and wait)."""
    data = DataSpec(num_microbatches=2)
    _, _, models, batches = _layout(model, data, 2, timeout_s=20)
    if torch.distributed.get_rank() == 0:
        s1.enable(models)
    start = time.monotonic()
    try:
        _run(s1.get_forward_backward_func(2), models, batches, model, data,
             slicer=s1.slice_batch)
    except Exception as exc:  # noqa: BLE001
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}
