"""Zero-bubble W for Transformer Engine layers, with a stand-in for TE (not installable here).

The fake layers behave as TE >= 2.8 documents and implements delayed weight
gradients: backward queues (input, grad_output) in a per-layer FIFO and returns
no weight gradient; ``backward_dw()`` pops one entry, *sets* ``param.grad`` and
calls the hooks registered with ``register_wgrad_accumulation_and_reduce_hooks``
(the place Megatron DDP moves the gradient into ``main_grad``).
"""

from __future__ import annotations

import inspect
import queue
from types import SimpleNamespace

import pytest
import torch

from megatron_seq1f1b.runtime import te_wgrad, wgrad

LOG: list[tuple[str, str]] = []  # ("put" | "dw", layer label), in call order


# ------------------------------------------------------------------ the fake Transformer Engine

class WeightGradStore:
    """TE's per-layer queue of delayed weight GEMMs (module/_common.py)."""

    def __init__(self, delay_wgrad_compute: bool = False):
        self.context = queue.Queue() if delay_wgrad_compute else None
        self.enabled = delay_wgrad_compute

    def delay_wgrad_compute(self) -> bool:
        return self.enabled

    def put(self, tensor_list, func) -> None:
        self.context.put([tensor_list, func])

    def pop(self):
        if self.context.qsize() == 0:
            raise RuntimeError("Pop empty queue.")
        tensor_list, func = self.context.get()
        return func(*tensor_list), tensor_list


class TransformerEngineBaseModule(torch.nn.Module):
    """TE >= 2.7's base: backward_dw pops one entry and runs the registered hooks."""

    def __init__(self):
        super().__init__()
        self.wgrad_accumulation_and_reduce_hooks = []
        self.wgrad_store = None

    def register_wgrad_accumulation_and_reduce_hooks(self, hook) -> None:
        self.wgrad_accumulation_and_reduce_hooks.append(hook)

    def backward_dw(self) -> None:
        if self.wgrad_store is None or not self.wgrad_store.delay_wgrad_compute():
            return
        LOG.append(("dw", self.label))
        (wgrad_, _), _ = self.wgrad_store.pop()
        self.weight.grad = wgrad_.to(self.weight.dtype)  # TE >= 2.8 overwrites
        for hook in self.wgrad_accumulation_and_reduce_hooks:
            hook()


class _LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, store, label):
        ctx.save_for_backward(x, weight)
        ctx.store, ctx.label = store, label
        return x.matmul(weight.t())

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors

        def weight_gemm(x_, dy):
            return dy.reshape(-1, dy.shape[-1]).t().matmul(x_.reshape(-1, x_.shape[-1])), None

        if ctx.store is not None:
            LOG.append(("put", ctx.label))
            ctx.store.put([x, grad_output], weight_gemm)
            grad_weight = None
        else:
            grad_weight, _ = weight_gemm(x, grad_output)
        return grad_output.matmul(weight), grad_weight, None, None


class Linear(TransformerEngineBaseModule):
    """TE's Linear, without bias, FP8 or parallelism."""

    def __init__(self, n_in: int, n_out: int, label: str, *, delay_wgrad_compute: bool = False,
                 bias: bool = False, fuse_wgrad_accumulation: bool = False):
        super().__init__()
        self.label = label
        self.weight = torch.nn.Parameter(torch.randn(n_out, n_in, dtype=torch.float64) / n_in**0.5)
        self.use_bias = bias
        if bias:
            self.bias = torch.nn.Parameter(torch.zeros(n_out, dtype=torch.float64))
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.wgrad_store = WeightGradStore(delay_wgrad_compute)
        if delay_wgrad_compute:
            self.weight.skip_backward_post_hook = True  # DDP hooks this layer, not AccumulateGrad

    def forward(self, x):
        store = self.wgrad_store if self.wgrad_store.delay_wgrad_compute() else None
        out = _LinearFunction.apply(x, self.weight, store, self.label)
        return out + self.bias if self.use_bias else out


class TELinear(Linear):
    """Megatron's wrapper: backward_dw runs only while config.delay_wgrad_compute is on."""

    def __init__(self, n_in: int, n_out: int, label: str, config, *,
                 disable_parameter_transpose_cache: bool = True, **kwargs):
        super().__init__(n_in, n_out, label,
                         delay_wgrad_compute=config.delay_wgrad_compute, **kwargs)
        self.config = config
        self.disable_parameter_transpose_cache = disable_parameter_transpose_cache

    def backward_dw(self) -> None:
        if self.config.delay_wgrad_compute:
            super().backward_dw()


class TE26:
    """TE 2.3-2.6: layers with backward_dw but no hooks for DDP."""

    class TransformerEngineBaseModule(torch.nn.Module):
        def backward_dw(self) -> None:
            pass

    class Linear(TransformerEngineBaseModule):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(2, 2))


class TEFusedMLP(torch.nn.Module):
    """Megatron's MLP on TE's operation fuser (its fc1/fc2 weights bypass the layers' queues)."""


# ------------------------------------------------------------------ a tiny model in two chunks

def config(delay: bool = True) -> SimpleNamespace:
    return SimpleNamespace(delay_wgrad_compute=delay)


class LocalLinear(torch.nn.Module):
    """Megatron's own linear Function as wgrad.install() makes it (the local-layer path)."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4, 4, dtype=torch.float64) / 2)

    def forward(self, x):
        from megatron.core.tensor_parallel import layers

        wgrad.install()  # idempotent; inert outside wgrad.deferring()
        function = layers.LinearWithGradAccumulationAndAsyncCommunication
        megatron = function.__mro__[1]
        extra = [1] * (len(inspect.signature(megatron.forward).parameters) - 10)  # gtp_remat_size
        # input, weight, bias, fusion, allreduce_dgrad, sequence_parallel, buffer, limit, tp_group
        return function.apply(x, self.weight, None, False, False, False, None, 0, None, *extra)


class Block(torch.nn.Module):
    """fc1, fc2, extra (TE layers) and a local Megatron linear, with a residual."""

    def __init__(self, chunk: int, cfg, mode: str = "once"):
        super().__init__()
        self.mode = mode
        self.fc1 = TELinear(4, 6, f"fc1@{chunk}", cfg)
        self.fc2 = TELinear(6, 4, f"fc2@{chunk}", cfg)
        self.extra = TELinear(4, 4, f"extra@{chunk}", cfg)
        self.local = LocalLinear()

    def forward(self, x):
        h = self.fc2(torch.tanh(self.fc1(x)))
        if self.mode == "twice":
            h = self.extra(self.extra(h))
        elif self.mode == "once":
            h = self.extra(h)
        return self.local(torch.tanh(h)) + x


class Hooks:
    """Megatron DDP's part (delay_wgrad_compute=True): backward_dw's grad -> main_grad."""

    def __init__(self, chunk: torch.nn.Module):
        self.calls = 0
        for module in chunk.modules():
            for param in module.parameters(recurse=False):
                if getattr(param, "skip_backward_post_hook", False):
                    param.main_grad = torch.zeros_like(param)
                    module.register_wgrad_accumulation_and_reduce_hooks(self._hook(param))

    def _hook(self, param):
        def hook():
            self.calls += 1
            param.main_grad.add_(param.grad)
            param.grad = None

        return hook


def build(delay: bool = True, mode: str = "once", seed: int = 0) -> list[Block]:
    torch.manual_seed(seed)
    return [Block(c, config(delay), mode) for c in range(2)]


def gradients(chunks) -> dict[str, torch.Tensor]:
    """main_grad where the hooks keep one, else .grad; zeros for a weight no unit reached."""
    found = {}
    for c, chunk in enumerate(chunks):
        for name, p in chunk.named_parameters():
            grad = getattr(p, "main_grad", p.grad)
            found[f"{c}.{name}"] = torch.zeros_like(p) if grad is None else grad
    return found


UNITS = [(0, 0, 0), (0, 1, 0), (0, 0, 1), (1, 0, 0), (0, 1, 1), (1, 1, 0), (1, 0, 1), (1, 1, 1)]
# A zero-bubble-like order: W of each unit later, in B order per rank.
ORDER = ["B000", "B010", "W000", "B001", "B100", "W010", "B011", "W001", "B110", "B101", "W100",
         "W011", "B111", "W110", "W101", "W111"]


def losses(chunks, units=UNITS, seed: int = 1):
    torch.manual_seed(seed)
    inputs = {u: torch.randn(3, 4, dtype=torch.float64) for u in units}
    return {u: chunks[u[2]](inputs[u]).pow(2).sum() for u in units}


def reference(mode: str = "once") -> dict[str, torch.Tensor]:
    chunks = build(delay=False, mode=mode)
    for loss in losses(chunks).values():
        loss.backward()
    return gradients(chunks)


def run_zero_bubble(chunks, store, order=ORDER):
    """Forward every unit, then run the B/W actions of `order` through `store`; W's counts."""
    with wgrad.deferring():
        forward = losses(chunks)
    counts = []
    for action in order:
        unit = tuple(int(ch) for ch in action[1:])
        LOG.append(("action", action))
        if action[0] == "B":
            with store.input_grads_only(unit):
                forward[unit].backward()
        else:
            counts.append(store.run(unit))
    store.close()
    return counts


def assert_close(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=0, msg=name)


@pytest.fixture(autouse=True)
def _clear_log():
    LOG.clear()


# ------------------------------------------------------------------ W drives backward_dw

def test_delayed_layers_found_in_order():
    chunk = build()[0]
    assert te_wgrad.te_delayed_modules(chunk) == [chunk.fc1, chunk.fc2, chunk.extra]
    assert [type(m).__name__ for _, m in te_wgrad.te_linears(chunk)] == ["TELinear"] * 3
    eager = build(delay=False)[0]
    assert te_wgrad.te_delayed_modules(eager) == [] and len(te_wgrad.te_linears(eager)) == 3
    assert not te_wgrad.is_te_linear(chunk.local)


def test_w_calls_backward_dw_once_per_layer_in_b_order_and_matches_plain_backward():
    chunks = build()
    hooks = [Hooks(c) for c in chunks]
    counts = run_zero_bubble(chunks, wgrad.WeightGradStore(chunks))
    assert counts == [3 + 1] * len(UNITS)  # three TE layers and the local one
    assert_close(gradients(chunks), reference())
    # Each B queues fc1..extra's GEMMs (backward order); its W pops one of each (module order).
    per_action, current = {}, None
    for kind, what in LOG:
        if kind == "action":
            current = per_action[what] = []
        else:
            current.append((kind, what))
    for action, calls in per_action.items():
        c = action[-1]
        if action[0] == "B":
            assert calls == [("put", f"extra@{c}"), ("put", f"fc2@{c}"), ("put", f"fc1@{c}")]
        else:
            assert calls == [("dw", f"fc1@{c}"), ("dw", f"fc2@{c}"), ("dw", f"extra@{c}")]
    assert [h.calls for h in hooks] == [4 * 3, 4 * 3]  # 4 units x 3 layers, once each
    assert all(te_wgrad.queued(m) == 0 for c in chunks for m in te_wgrad.te_delayed_modules(c))


def test_a_store_that_does_not_know_the_layers_loses_their_gradients():
    """The comparison above can fail: W without backward_dw leaves the TE weights' grads out."""
    chunks = build()
    for chunk in chunks:
        Hooks(chunk)
    counts = run_zero_bubble(chunks, wgrad.WeightGradStore())  # the local-layer store of before
    assert counts == [1] * len(UNITS)
    got, want = gradients(chunks), reference()
    assert torch.count_nonzero(got["0.fc1.weight"]) == 0
    torch.testing.assert_close(got["0.local.weight"], want["0.local.weight"], rtol=1e-5, atol=0)
    assert te_wgrad.queued(chunks[0].fc1) == 4
    with pytest.raises(AssertionError):
        assert_close(got, want)


def test_w_out_of_b_order_is_refused():
    chunks = build()
    for chunk in chunks:
        Hooks(chunk)
    order = ["B000", "B010", "W010"]  # would pop unit (0,0,0)'s entries
    with pytest.raises(RuntimeError, match="order of its B"):
        run_zero_bubble(chunks, wgrad.WeightGradStore(chunks), order)
    assert ("dw", "fc1@0") not in LOG


def test_a_layer_the_unit_never_reached_is_not_called():
    chunks = build(mode="skip")
    for chunk in chunks:
        Hooks(chunk)
    run_zero_bubble(chunks, wgrad.WeightGradStore(chunks))
    assert ("dw", "extra@0") not in LOG and ("dw", "fc1@0") in LOG
    assert_close(gradients(chunks), reference(mode="skip"))


def test_a_layer_run_twice_in_a_unit_is_an_error_not_a_lost_gradient():
    chunks = build(mode="twice")
    for chunk in chunks:
        Hooks(chunk)
    with pytest.raises(RuntimeError, match="extra holds 4.*more than once"):
        run_zero_bubble(chunks, wgrad.WeightGradStore(chunks))


def test_backward_dw_switched_off_after_building_is_an_error():
    chunks = build()
    for chunk in chunks:
        Hooks(chunk)
    chunks[0].fc1.config.delay_wgrad_compute = False
    assert any("keep it True" in p for p in wgrad.deferral_problems(chunks))
    with pytest.raises(RuntimeError, match="computed nothing"):
        run_zero_bubble(chunks, wgrad.WeightGradStore(chunks))


# ------------------------------------------------------------------ what deferral_problems rejects

class Wrapped(torch.nn.Module):
    """Megatron DDP's shape: the model in `.module`, its options in `.ddp_config`."""

    def __init__(self, module, **ddp):
        super().__init__()
        from megatron.core.distributed import DistributedDataParallelConfig

        self.module = module
        self.ddp_config = DistributedDataParallelConfig(**ddp)


def _hooked(chunk):
    Hooks(chunk)
    return chunk


def _layer(**kwargs):
    return TELinear(4, 4, "x", config(), **kwargs)


PROBLEMS = {
    "eager": (lambda: torch.nn.Sequential(TELinear(4, 4, "x", config(delay=False))),
              ["built without delay_wgrad_compute", "config.delay_wgrad_compute = True",
               "DistributedDataParallelConfig(delay_wgrad_compute=True)", "schedule='1f1b'"]),
    "te-older-than-2.7": (lambda: torch.nn.Sequential(TE26.Linear()),
                          ["Transformer Engine >= 2.7"]),
    "no-ddp": (lambda: torch.nn.Sequential(_layer()), ["not wrapped in Megatron DDP"]),
    "ddp-without-delay": (lambda: Wrapped(torch.nn.Sequential(_layer()), delay_wgrad_compute=False),
                          ["DistributedDataParallelConfig has delay_wgrad_compute=False"]),
    "bias": (lambda: _hooked(torch.nn.Sequential(_layer(bias=True))), ["add_bias_linear=False"]),
    "fused-overlap": (lambda: Wrapped(_hooked(torch.nn.Sequential(
        _layer(fuse_wgrad_accumulation=True))), delay_wgrad_compute=True, overlap_grad_reduce=True),
        ["overlap_grad_reduce=False or gradient_accumulation_fusion=False"]),
    "first-microbatch-overwrite": (lambda: _hooked(torch.nn.Sequential(_layer(
        fuse_wgrad_accumulation=True, disable_parameter_transpose_cache=False))),
        ["disable_parameter_transpose_cache=True or gradient_accumulation_fusion=False"]),
    "op-fuser": (lambda: _hooked(torch.nn.Sequential(_layer(), TEFusedMLP())),
                 ["use_te_op_fuser"]),
}


@pytest.mark.parametrize("case", sorted(PROBLEMS))
def test_deferral_problems_name_the_option_and_the_fix(case):
    build_chunk, expected = PROBLEMS[case]
    problems = wgrad.deferral_problems([build_chunk()])
    assert len(problems) == 1, problems
    for text in expected:
        assert text in problems[0], problems[0]


def test_a_wired_model_and_a_local_model_pass():
    assert wgrad.deferral_problems([_hooked(c) for c in build()]) == []
    one_segment = _hooked(torch.nn.Sequential(_layer(fuse_wgrad_accumulation=True,
                                                     disable_parameter_transpose_cache=False)))
    assert wgrad.deferral_problems([one_segment], num_splits=1) == []
    wired = Wrapped(_hooked(torch.nn.Sequential(_layer(fuse_wgrad_accumulation=True))),
                    delay_wgrad_compute=True, overlap_grad_reduce=False)
    assert wgrad.deferral_problems([wired]) == []
    local = [torch.nn.Sequential(LocalLinear(), torch.nn.LayerNorm(4))]
    assert wgrad.deferral_problems(local) == [] and wgrad.without_w_problems(local) == []


def test_schedules_without_w_refuse_delayed_layers():
    problems = wgrad.without_w_problems(build())
    assert len(problems) == 1 and "schedule='zb-h1'" in problems[0], problems
    assert wgrad.without_w_problems(build(delay=False)) == []


# ------------------------------------------------------------------ with Megatron's own DDP

def real_ddp_case(overlap: bool) -> list[str]:
    """Per data-parallel rank: the fake TE model in Megatron DDP, zero-bubble order, sync on
    only for each chunk's last B and W (as the executor does); main_grad must equal the
    ranks' averaged plain backward."""
    import contextlib

    import torch.distributed as dist
    from gpt import init_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig

    init_parallel()
    cfg = TransformerConfig(num_layers=1, hidden_size=4, num_attention_heads=1)
    cfg.delay_wgrad_compute = True  # after the config's validation, before building the model
    torch.manual_seed(0)
    plain = [Block(c, cfg) for c in range(2)]
    ddp_config = DistributedDataParallelConfig(delay_wgrad_compute=True,
                                               overlap_grad_reduce=overlap)
    chunks = [DistributedDataParallel(cfg, ddp_config, block, disable_bucketing=(i > 0))
              for i, block in enumerate(plain)]
    problems = wgrad.deferral_problems(chunks)
    if any(len(m.wgrad_accumulation_and_reduce_hooks) != 1
           for c in chunks for m in te_wgrad.te_delayed_modules(c)):
        problems.append("Megatron DDP did not hook each delayed layer once")

    rank, world = dist.get_rank(), dist.get_world_size()
    want = {}
    for r in range(world):
        ref = build(delay=False)
        for loss in losses(ref, seed=1 + r).values():
            loss.backward()
        for name, grad in gradients(ref).items():
            want[name] = want.get(name, 0) + grad / world
    last = {(action[0], action[-1]): action for action in ORDER}
    # The first iteration teaches overlapping DDP when a bucket is complete; the third runs W
    # with a store that does not know the TE layers, which the comparison must catch.
    for iteration in range(3):
        for ddp in chunks:
            ddp.zero_grad_buffer()
        with wgrad.deferring():
            forward = losses(chunks, seed=1 + rank)
        store = wgrad.WeightGradStore(chunks if iteration < 2 else ())
        for action in ORDER:
            unit = tuple(int(ch) for ch in action[1:])
            sync = last[(action[0], action[-1])] == action
            with contextlib.nullcontext() if sync else chunks[unit[2]].no_sync():
                if action[0] == "B":
                    with store.input_grads_only(unit):
                        forward[unit].backward()
                else:
                    store.run(unit)
        store.close()
        try:
            for ddp in chunks:
                ddp.finish_grad_sync()
        except AssertionError:  # overlapping DDP notices the missing gradients itself
            if iteration < 2 or not overlap:
                raise
            continue
        got = {f"{c}.{name}": p.main_grad for c, block in enumerate(plain)
               for name, p in block.named_parameters()}
        wrong = [name for name in want
                 if not torch.allclose(got[name], want[name], rtol=1e-5, atol=0)]
        if iteration < 2:
            problems += [f"iteration {iteration}, {n}: {got[n]} != {want[n]}" for n in wrong]
        elif sorted(wrong) != [f"{c}.{n}.weight" for c in range(2) for n in ("extra", "fc1", "fc2")]:
            problems.append(f"without backward_dw calls, the gradients that differ are {wrong}")
    unwired = DistributedDataParallel(cfg, DistributedDataParallelConfig(), build()[0])
    if not any("delay_wgrad_compute=False" in p for p in wgrad.deferral_problems([unwired])):
        problems.append("DDP without delay_wgrad_compute was not rejected")
    return problems


@pytest.mark.parametrize("overlap", [False, True], ids=["ddp", "ddp-overlap"])
def test_megatron_ddp_takes_each_delayed_gradient_once(ranks, overlap):
    problems = [p for r in ranks.run(2, real_ddp_case, overlap=overlap) for p in r]
    assert not problems, "\n".join(problems)


def test_every_segmented_schedule_refuses_the_first_microbatch_overwrite():
    """Not only zero bubble: with segments, TE's is_first_microbatch GEMM (segment 0's
    backward, which runs after the later segments') would overwrite their gradients."""
    from megatron_seq1f1b.runtime.te_wgrad import first_microbatch_problems

    eager = TELinear(4, 4, "x", config(delay=False), fuse_wgrad_accumulation=True,
                     disable_parameter_transpose_cache=False)
    chunk = torch.nn.Sequential(eager)
    problems = first_microbatch_problems([chunk], num_splits=2)
    assert len(problems) == 1 and "disable_parameter_transpose_cache=True" in problems[0]
    assert first_microbatch_problems([chunk], num_splits=1) == []
    eager.disable_parameter_transpose_cache = True
    assert first_microbatch_problems([chunk], num_splits=2) == []


# ------------------------------------------------------------------ Megatron's own linear layers

@pytest.mark.parametrize("zero_out", [False, True])
def test_fused_accumulation_leaves_a_placeholder_zeroed_only_where_asked(monkeypatch, zero_out):
    """With gradient_accumulation_fusion a deferred W adds into main_grad and hands DDP's hook
    a placeholder it drops: allocated, not zero-filled, unless the weight asks
    (``zero_out_wgrad``), as Megatron's own backward (it was zero-filled every time: a memset
    of every deferred weight's size per unit)."""
    monkeypatch.setattr(wgrad, "_fused_accumulate",
                        lambda input_2d, grad_2d, main: main.add_(grad_2d.t() @ input_2d))
    delivered = []
    monkeypatch.setattr(wgrad, "deliver", lambda weight, grad: delivered.append(grad))
    zeros, real_zeros = [], torch.zeros
    monkeypatch.setattr(torch, "zeros", lambda *a, **k: zeros.append(a) or real_zeros(*a, **k))
    weight = torch.nn.Parameter(torch.ones(3, 2))
    weight.grad_added_to_main_grad, weight.zero_out_wgrad = False, zero_out
    main_grad = real_zeros(3, 2)
    ctx = SimpleNamespace(sequence_parallel=False, tp_group=None,
                          gradient_accumulation_fusion=True, main_grad=main_grad)
    inputs, grad_output = torch.randn(4, 1, 2), torch.randn(4, 1, 3)
    wgrad._linear_weight_grad(ctx, inputs, weight, grad_output)()
    expected = grad_output.reshape(4, 3).t() @ inputs.reshape(4, 2)
    assert torch.allclose(main_grad, expected) and weight.grad_added_to_main_grad
    (placeholder,) = delivered
    assert placeholder.shape == (3, 2) and len(zeros) == int(zero_out)
    if zero_out:
        assert placeholder.count_nonzero() == 0
