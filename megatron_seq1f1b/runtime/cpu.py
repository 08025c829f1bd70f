"""Run Megatron-Core (0.16.1 to 0.19.x) on CPU with gloo (development, tests, the demo).

Megatron-Core assumes CUDA in a handful of places. :func:`enable` patches
exactly those, in this process only, and only when called:

1. ``torch.cuda.current_device()`` returns the CPU device, so receive buffers
   of the p2p layer, the global memory buffer used by ``DotProductAttention``,
   rotary embeddings, sequence-parallel gathers and DDP grad buffers are
   allocated on the CPU.
2. The CUDA RNG functions used by Megatron's RNG tracker (``add``, ``fork``,
   ``model_parallel_cuda_manual_seed``, activation checkpointing) are routed
   to the CPU default generator, so dropout and recomputation replay the same
   random numbers as on a GPU.
3. Hard-coded ``device="cuda"`` tensor factories inside ``megatron.core``
   (token counters in the schedules, the default causal mask, gradient
   clipping, loss scalers) create CPU tensors instead.
4. ``torch.cuda.synchronize()`` becomes a no-op (batched p2p sync, shape
   handshake).
5. ``Tensor.cuda()`` on a CPU tensor returns the tensor (tied embeddings with
   pipeline parallelism, optimizer state loading).
6. The torch LayerNorm/RMSNorm of the local layer spec accepts sequence
   parallelism: its parameters are tagged ``sequence_parallel=True`` (what
   apex's fused norm does) so ``finalize_model_grads`` all-reduces their
   gradients over the tensor-parallel group.
7. ``Tensor.type()`` (without arguments) of a CPU tensor names the CUDA type
   (``torch.cuda.FloatTensor``): Megatron's optimizers (mixed precision and
   the distributed optimizer) sort parameters by these names.
8. CUDA streams and events (``torch.cuda.current_stream``, ``Stream``,
   ``stream``, ``Event``) are torch's CPU stand-ins (``torch.cpu.*``), whose
   waits are no-ops: Megatron-Core 0.19's DDP waits on the current stream
   before every gradient reduction; MoE's all-to-all dispatcher copies token
   counts on a side stream and waits on the event it records.
9. Megatron-Core 0.16's multi-latent attention believes Transformer Engine is
   installed when its extension module imports (it does, with mock classes)
   and calls ``isinstance`` on a mock; it is told TE is absent, as it is.
   Its MoE router GEMM refers to ``te_general_gemm``, which is never defined
   without TE; it is defined as ``None`` (the torch path).
10. MoE's all-to-all dispatcher passes its split sizes as numpy arrays, which
    this torch's ``all_to_all_single`` binding does not take: they are turned
    into lists of ints. With tensor parallelism it gathers and scatters token
    blocks of different lengths, which NCCL does and gloo does not: those
    ``all_gather`` / ``reduce_scatter`` calls are padded to the longest block.

11. RoPE on packed (THD) batches without context parallelism: where a GPU runs
    Transformer Engine's fused THD kernel, Megatron-Core 0.19's unfused path
    applies it one document at a time into slices of the output (on CPU its
    backward makes a whole-sequence gradient per document). The stand-in gathers
    every token's row of the table (its position within its document) and
    applies it once: the same products, so the same numbers, at the cost of one
    call (a fair baseline for packed-document benchmarks; tests compare both).

12. Mamba-2 and the gated delta net: where mamba_ssm, causal-conv1d and fla are missing, the
    kernels Megatron's layers call are the project's torch references
    (:mod:`~megatron_seq1f1b.runtime.cpu_recurrent`).

Calling it twice is harmless. It must not be used in a process that also uses
a GPU.
"""

from __future__ import annotations

import copy
import functools
import importlib
import inspect
import types

import torch

from megatron_seq1f1b.runtime import cpu_recurrent

_ENABLED = False

# Modules of megatron.core whose `torch` global is replaced by a proxy that
# turns device="cuda" into the CPU. Only these contain cuda literals on paths
# we run (schedules, masks, optimizer, clipping, loss scaling, DDP buffers).
_CUDA_LITERAL_MODULES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.transformer.utils",
    "megatron.core.fusions.fused_softmax",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.tensor_parallel.data",
    "megatron.core.utils",
    "megatron.core.pipeline_parallel.utils",
    "megatron.core.rerun_state_machine",
    "megatron.core.dist_checkpointing.exchange_utils",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.models.common.embeddings.rope_utils",  # CP slicing (pinned index tensor)
)

_FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange", "rand", "randn", "as_tensor")


def _cpu_device(*_args, **_kwargs) -> torch.device:
    return torch.device("cpu")


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int)


def _on_cpu(factory):
    @functools.wraps(factory)
    def wrapper(*args, **kwargs):
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = "cpu"
        kwargs.pop("pin_memory", None)  # needs an accelerator
        return factory(*args, **kwargs)

    return wrapper


class _CpuTorch(types.ModuleType):
    """Looks like `torch`, but its tensor factories never allocate on CUDA."""

    def __init__(self):
        super().__init__("torch")
        for name in _FACTORIES:
            setattr(self, name, _on_cpu(getattr(torch, name)))

    def __getattr__(self, name):
        return getattr(torch, name)


def _cpu_rng_state(*_args, **_kwargs) -> torch.Tensor:
    return torch.default_generator.get_state()


def _set_cpu_rng_state(new_state, *_args, **_kwargs) -> None:
    torch.default_generator.set_state(new_state)


def _seed_cpu(seed, *_args, **_kwargs) -> None:
    # Not torch.manual_seed: that would call the (patched) cuda seeding again.
    torch.default_generator.manual_seed(int(seed))


def _tensor_cuda(self, *args, **kwargs):
    return self


_ORIGINAL_TYPE = torch.Tensor.type


def _tensor_type(self, dtype=None, non_blocking=False, **kwargs):
    if dtype is None and not kwargs:
        name = _ORIGINAL_TYPE(self)
        if self.device.type == "cpu" and name.startswith("torch.") and "cuda" not in name:
            return "torch.cuda." + name[len("torch."):]
        return name
    return _ORIGINAL_TYPE(self, dtype, non_blocking, **kwargs)


def _patch_torch_norm() -> None:
    from megatron.core.transformer import torch_norm

    original_new = torch_norm.WrappedTorchNorm.__new__
    if getattr(original_new, "_seq1f1b_cpu", False):
        return

    def __new__(cls, config, hidden_size, *args, **kwargs):
        if not config.sequence_parallel:
            return original_new(cls, config, hidden_size, *args, **kwargs)
        plain = copy.copy(config)
        plain.sequence_parallel = False
        norm = original_new(cls, plain, hidden_size, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    __new__._seq1f1b_cpu = True
    torch_norm.WrappedTorchNorm.__new__ = staticmethod(__new__)


def _patch_rng() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = _cpu_rng_state
    mrandom._set_cuda_rng_state = _set_cpu_rng_state


def _patch_cuda_literals() -> None:
    proxy = _CpuTorch()
    for name in _CUDA_LITERAL_MODULES:
        module = importlib.import_module(name)
        if getattr(module, "torch", None) is torch:
            module.torch = proxy
    # fused_softmax imported the mask builders by name before we patched.
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils as tutils

    fused_softmax.get_default_causal_mask = tutils.get_default_causal_mask
    fused_softmax.get_sliding_window_causal_mask = tutils.get_sliding_window_causal_mask


class _CpuStream(torch.cpu.Stream):
    """torch's CPU stream, whose ``record_event`` returns an event (the MoE dispatchers wait on it)."""

    def record_event(self, event=None):
        return event if event is not None else torch.cpu.Event()


def _patch_all_to_all_splits() -> None:
    original = torch.distributed.all_to_all_single

    @functools.wraps(original)
    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None,
                          *args, **kwargs):
        as_ints = lambda sizes: None if sizes is None else [int(n) for n in sizes]  # noqa: E731
        return original(output, input, as_ints(output_split_sizes), as_ints(input_split_sizes),
                        *args, **kwargs)

    torch.distributed.all_to_all_single = all_to_all_single

    gather = torch.distributed.all_gather

    @functools.wraps(gather)
    def all_gather(tensor_list, tensor, group=None, async_op=False):
        shapes = {tuple(t.shape) for t in tensor_list} | {tuple(tensor.shape)}
        if len(shapes) == 1 or async_op:
            return gather(tensor_list, tensor, group=group, async_op=async_op)
        longest = max(t.shape[0] for t in tensor_list)
        padded = [t.new_zeros((longest,) + tuple(t.shape[1:])) for t in tensor_list]
        mine = tensor.new_zeros((longest,) + tuple(tensor.shape[1:]))
        mine[: tensor.shape[0]] = tensor
        gather(padded, mine, group=group)
        for out, block in zip(tensor_list, padded):
            out.copy_(block[: out.shape[0]])
        return None

    torch.distributed.all_gather = all_gather

    scatter = torch.distributed.reduce_scatter

    @functools.wraps(scatter)
    def reduce_scatter(output, input_list, op=torch.distributed.ReduceOp.SUM, group=None,
                       async_op=False):
        shapes = {tuple(t.shape) for t in input_list}
        if len(shapes) == 1 or async_op:
            return scatter(output, input_list, op=op, group=group, async_op=async_op)
        rank = torch.distributed.get_rank(group)
        for index, block in enumerate(input_list):  # a reduce per block, to its owner
            summed = block.contiguous().clone()
            torch.distributed.all_reduce(summed, op=op, group=group)
            if index == rank:
                output.copy_(summed)
        return None

    torch.distributed.reduce_scatter = reduce_scatter


def _patch_missing_te() -> None:
    import importlib.util

    if importlib.util.find_spec("transformer_engine") is not None:
        return
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    if not isinstance(getattr(multi_latent_attention, "TELinear", None), (type, type(None))):
        multi_latent_attention.HAVE_TE = False


def _patch_thd_rope() -> None:
    from megatron.core.models.common.embeddings import rope_utils

    original = rope_utils._apply_rotary_pos_emb_thd
    if getattr(original, "seq1f1b_cpu", False):
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def per_token(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        given = dict(bound.arguments)
        t, cu_seqlens, freqs, group = (given.pop(n) for n in ("t", "cu_seqlens", "freqs",
                                                               "cp_group"))
        total = int(cu_seqlens[-1])
        if group is None or group.size() != 1 or freqs.size(0) == total:
            return original(*args, **kwargs)  # CP's halves, or a table of every token: as is
        starts = cu_seqlens[:-1].to(torch.long)
        positions = torch.arange(total, device=t.device) - torch.repeat_interleave(
            starts, cu_seqlens[1:].to(torch.long) - starts)
        # the remaining arguments are the per-sequence function's, in every version
        return rope_utils._apply_rotary_pos_emb_bshd(t.unsqueeze(1), freqs[positions],
                                                     **given).squeeze(1)

    per_token.seq1f1b_cpu = True
    rope_utils._apply_rotary_pos_emb_thd = per_token


def enable() -> None:
    """Patch Megatron-Core (and torch.cuda shims) so it runs on CPU with gloo."""
    global _ENABLED
    if _ENABLED:
        return
    if torch.cuda.is_available():
        raise RuntimeError(
            "megatron_seq1f1b.runtime.cpu.enable() is for machines without a GPU; this process sees "
            f"{torch.cuda.device_count()} CUDA device(s). Run on the GPU with NCCL instead."
        )
    torch.cuda.current_device = _cpu_device
    torch.cuda.get_rng_state = _cpu_rng_state
    torch.cuda.set_rng_state = _set_cpu_rng_state
    torch.cuda.manual_seed = _seed_cpu
    torch.cuda.manual_seed_all = _seed_cpu
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_stream = lambda *args, **kwargs: torch.cpu.current_stream()
    torch.cuda.Stream = _CpuStream
    torch.cuda.stream = torch.cpu.stream
    torch.cuda.Event = torch.cpu.Event
    torch.Tensor.cuda = _tensor_cuda
    torch.Tensor.type = _tensor_type
    _patch_rng()
    _patch_cuda_literals()
    _patch_torch_norm()
    _patch_missing_te()
    _patch_all_to_all_splits()
    _patch_thd_rope()
    cpu_recurrent.install()
    _ENABLED = True


def is_enabled() -> bool:
    """True once :func:`enable` ran in this process."""
    return _ENABLED


__all__ = ["enable", "is_enabled"]
