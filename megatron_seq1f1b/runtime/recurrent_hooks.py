"""Megatron's recurrent mixers under Seq1F1B: each segment starts from the previous one's state.

Megatron-Core's ``MambaMixer`` (Mamba-2, pattern symbol ``M``) and ``GatedDeltaNet`` (``G``)
call their kernels from the start of the sequence: no initial state in, no final state out.
Inside a Seq1F1B segment the kernels they call are given the previous segment's final states
and hand theirs on (:mod:`~megatron_seq1f1b.segments.state_carry`); the layers themselves are
not changed, and outside segments the kernels are called exactly as Megatron calls them.

* **Gated delta net**: its causal convolution (fla's ``causal_conv1d``, a module global)
  takes and returns the window of the last ``W`` inputs; its delta rule (the layer's
  ``gated_delta_rule``, fla's ``chunk_gated_delta_rule``) the ``[b, heads, d_k, d_v]`` state.
* **Mamba-2**: Megatron trains through mamba_ssm's fused ``mamba_split_conv1d_scan_combined``,
  which has no convolution state. Inside a segment the same computation is made of the two
  kernels that have one, as Megatron's non-fused path does: ``causal_conv1d_fn`` (window of
  ``W - 1`` inputs) and ``mamba_chunk_scan_combined`` (``[b, heads, head_dim, d_state]``).

The module globals are wrapped once per module and find their layer through
:data:`_LAYER`, set around each prepared mixer's forward (recomputation included).
"""

from __future__ import annotations

import contextvars
import functools
import math
import sys
from typing import Any, Callable

import torch

from megatron_seq1f1b.segments import active as segments
from megatron_seq1f1b.segments import state_carry

#: The recurrent mixer whose forward is running (the wrapped kernels' owner).
_LAYER: contextvars.ContextVar = contextvars.ContextVar("seq1f1b_recurrent_layer", default=None)

#: Megatron-Core's recurrent mixers by class name: what a segment boundary carries.
RECURRENT = {"MambaMixer": "Mamba-2, hybrid pattern symbol M: convolution window and SSM state",
             "GatedDeltaNet": "gated delta net, hybrid pattern symbol G: convolution window and "
                              "delta-rule state"}


def problems(module: Any, name: str) -> list[str]:
    """Why ``module`` (a recurrent mixer) cannot carry its state under Seq1F1B here."""
    config = module.config
    found = []
    kind = type(module).__name__
    if (getattr(config, "context_parallel_size", 1) or 1) > 1:
        found.append(f"{name}: {kind} with context parallelism (Megatron's is a head "
                     "all-to-all; a segment's state would have to follow it): set "
                     "context_parallel_size=1")
    if kind == "GatedDeltaNet" and getattr(config, "deterministic_mode", False):
        found.append(f"{name}: GatedDeltaNet in deterministic_mode runs F.conv1d, which takes "
                     "no initial window: set deterministic_mode=False")
    if kind == "GatedDeltaNet" and not hasattr(sys.modules[type(module).__module__],
                                                "causal_conv1d"):
        found.append(f"{name}: this Megatron-Core version's GatedDeltaNet (before 0.18: "
                     "causal-conv1d's convolution) is not hooked for Seq1F1B's state carry; "
                     "use Megatron-Core 0.18 or later")
    if kind == "MambaMixer" and not getattr(module, "use_mem_eff_path", True):
        found.append(f"{name}: MambaMixer with use_mamba_mem_eff_path=False (the prefill path) "
                     "is not hooked: use the default training path")
    return found


def _run_as_current(layer: Any, forward: Callable, *args, **kwargs):
    token = _LAYER.set(layer)
    try:
        return forward(*args, **kwargs)
    finally:
        _LAYER.reset(token)


def _current() -> Any:
    """The running mixer, inside a segment (else None: the kernels run as Megatron calls them)."""
    layer = _LAYER.get()
    return layer if layer is not None and segments.active() is not None else None


def _first_of(state: torch.Tensor | None, count: int) -> torch.Tensor | None:
    """A packed batch's initial states, one per sequence piece: the carried state for the
    first piece (the document crossing the cut; zeroed where one starts at it), zeros for
    the others (their documents start inside the segment)."""
    if state is None or count == 1:
        return state
    return torch.cat([state, state.new_zeros((count - 1, *state.shape[1:]))])


# -- gated delta net -------------------------------------------------------------------------
# Packed batches (cu_seqlens: one state per document piece) restart at document starts, as
# Megatron's layer does; unpacked ones run on across documents, as Megatron's layer does.

def _gdn_conv(original: Callable) -> Callable:
    @functools.wraps(original)
    def causal_conv1d(x, weight=None, bias=None, *args, initial_state=None,
                      output_final_state=False, cu_seqlens=None, **kwargs):
        layer = _current()
        if layer is None:
            return original(x, weight, bias, *args, initial_state=initial_state,
                            output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                            **kwargs)
        packed = cu_seqlens is not None
        window = state_carry.initial(layer, "conv", window_axis=2, restart_documents=packed)
        if packed:
            window = _first_of(window, cu_seqlens.numel() - 1)
        y, final = original(x, weight, bias, *args, initial_state=window,
                            output_final_state=True, cu_seqlens=cu_seqlens, **kwargs)
        return state_carry.handed_on(layer, "conv", y, final[-1:] if packed else final), None

    causal_conv1d.seq1f1b_carry = True
    return causal_conv1d


def _gdn_rule(layer: Any, original: Callable) -> Callable:
    @functools.wraps(original)
    def gated_delta_rule(q, k, v, *args, initial_state=None, output_final_state=False,
                         cu_seqlens=None, **kwargs):
        if _current() is not layer:
            return original(q, k, v, *args, initial_state=initial_state,
                            output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                            **kwargs)
        packed = cu_seqlens is not None
        state = state_carry.initial(layer, "recurrent", restart_documents=packed)
        if packed:
            state = _first_of(state, cu_seqlens.numel() - 1)
        out, final = original(q, k, v, *args, initial_state=state, output_final_state=True,
                              cu_seqlens=cu_seqlens, **kwargs)
        return state_carry.handed_on(layer, "recurrent", out,
                                     final[-1:] if packed else final), None

    gated_delta_rule.seq1f1b_carry = True
    return gated_delta_rule


# -- Mamba-2 ----------------------------------------------------------------------------------

def _conv_with_window(conv: Callable, xBC: torch.Tensor, carried: torch.Tensor | None,
                      weight: torch.Tensor, bias: torch.Tensor | None,
                      seq_idx: torch.Tensor | None, activation: str):
    """causal-conv1d's ``causal_conv1d_fn`` over ``xBC`` [b, l, d] preceded by the carried
    window [b, d, W-1]: (the outputs [b, l, d], the window handed on [b, d, W-1]).

    The window enters as tokens of the first sequence piece (its ``seq_idx``), not as the
    kernel's ``initial_states``: causal-conv1d takes no initial states with ``seq_idx``.
    Inputs are laid out channel-last, as the kernel wants for ``seq_idx``."""
    b, length, _ = xBC.shape
    taps = weight.shape[-1] - 1
    if carried is None:
        carried = xBC.new_zeros(b, xBC.shape[-1], taps)
    inputs = torch.cat([carried.transpose(1, 2).to(xBC.dtype), xBC], dim=1)  # [b, W-1+l, d]
    if seq_idx is not None:
        seq_idx = torch.cat([seq_idx[:, :1].expand(b, taps), seq_idx], dim=1).contiguous()
    out = conv(inputs.transpose(1, 2), weight, bias, seq_idx=seq_idx, activation=activation)
    return out[..., taps:].transpose(1, 2), inputs[:, -taps:].transpose(1, 2)


def _mamba_split_conv1d_scan(module: Any, original: Callable) -> Callable:
    """mamba_ssm's fused kernel outside segments; inside, its two-kernel equivalent with both
    states carried (the kernels looked up in Megatron's ``module`` at call time)."""

    @functools.wraps(original)
    def mamba_split_conv1d_scan_combined(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D,
                                         chunk_size, initial_states=None, seq_idx=None,
                                         dt_limit=(0.0, math.inf), return_final_states=False,
                                         activation="silu", rmsnorm_weight=None,
                                         rmsnorm_eps=1e-6, outproj_weight=None,
                                         outproj_bias=None, headdim=None, ngroups=1,
                                         norm_before_gate=True, **kwargs):
        layer = _current()
        if layer is None:
            return original(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size,
                            initial_states=initial_states, seq_idx=seq_idx, dt_limit=dt_limit,
                            return_final_states=return_final_states, activation=activation,
                            rmsnorm_weight=rmsnorm_weight, rmsnorm_eps=rmsnorm_eps,
                            outproj_weight=outproj_weight, outproj_bias=outproj_bias,
                            headdim=headdim, ngroups=ngroups, norm_before_gate=norm_before_gate,
                            **kwargs)
        if rmsnorm_weight is not None or outproj_weight is not None or initial_states is not None:
            raise NotImplementedError("Seq1F1B's Mamba-2 carry: the fused kernel's own norm, "
                                      "output projection and initial states are not used by "
                                      "Megatron's training path, nor supported here")
        nheads = D.shape[0]
        headdim = D.shape[1] if D.dim() == 2 else headdim
        dim = nheads * headdim
        dstate = (conv1d_weight.shape[0] - dim) // ngroups // 2
        d_nonssm = (zxbcdt.shape[-1] - 2 * dim - 2 * ngroups * dstate - nheads) // 2
        zx0, z, xBC, dt = torch.split(
            zxbcdt, [2 * d_nonssm, dim, dim + 2 * ngroups * dstate, nheads], dim=-1)
        b, length = zxbcdt.shape[:2]
        # Packed batches (seq_idx) restart at document starts, as Megatron's layer does;
        # unpacked ones run on across documents, as Megatron's layer does.
        packed = seq_idx is not None
        carried = state_carry.initial(layer, "conv", window_axis=2, restart_documents=packed)
        xBC, window = _conv_with_window(module.causal_conv1d_fn, xBC, carried, conv1d_weight,
                                        conv1d_bias, seq_idx, activation)
        x, B, C = torch.split(xBC, [dim, ngroups * dstate, ngroups * dstate], dim=-1)
        y, state = module.mamba_chunk_scan_combined(
            x.reshape(b, length, nheads, headdim), dt, A, B.reshape(b, length, ngroups, dstate),
            C.reshape(b, length, ngroups, dstate), chunk_size, D=D,
            z=z.reshape(b, length, nheads, headdim), dt_bias=dt_bias, dt_softplus=True,
            initial_states=state_carry.initial(layer, "ssm", restart_documents=packed),
            seq_idx=seq_idx, dt_limit=dt_limit, return_final_states=True, **kwargs)
        y = y.reshape(b, length, dim)
        if d_nonssm:
            first, second = zx0.chunk(2, dim=-1)
            y = torch.cat([torch.nn.functional.silu(first) * second, y], dim=-1)
        y = state_carry.handed_on(layer, "conv", y, window)
        return state_carry.handed_on(layer, "ssm", y, state)

    mamba_split_conv1d_scan_combined.seq1f1b_carry = True
    return mamba_split_conv1d_scan_combined


def _wrap_global(module: Any, name: str, wrap: Callable) -> None:
    kernel = getattr(module, name, None)
    if kernel is None:
        raise RuntimeError(f"Seq1F1B: {module.__name__}.{name} is missing (its package is not "
                           "installed; on CPU call megatron_seq1f1b.runtime.cpu.enable() first)")
    if not getattr(kernel, "seq1f1b_carry", False):
        setattr(module, name, wrap(kernel))


def prepare(mixer: Any) -> None:
    """Make ``mixer`` (a ``MambaMixer`` or ``GatedDeltaNet``) carry its state across Seq1F1B's
    segments (idempotent)."""
    if getattr(mixer, "seq1f1b_carry", False):
        return
    module = sys.modules[type(mixer).__module__]
    if type(mixer).__name__ == "GatedDeltaNet":
        _wrap_global(module, "causal_conv1d", _gdn_conv)
        mixer.gated_delta_rule = _gdn_rule(mixer, mixer.gated_delta_rule)
    else:
        _wrap_global(module, "mamba_split_conv1d_scan_combined",
                     functools.partial(_mamba_split_conv1d_scan, module))
    mixer.forward = functools.partial(_run_as_current, mixer, mixer.forward)
    mixer.seq1f1b_carry = True


__all__ = ["RECURRENT", "prepare", "problems"]
