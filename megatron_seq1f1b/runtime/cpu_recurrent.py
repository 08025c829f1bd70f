"""Megatron-Core's recurrent mixers (Mamba-2, gated delta net) on CPU: the reference kernels
put where Megatron looks for mamba_ssm's, causal-conv1d's and fla's.

Megatron-Core imports those CUDA/Triton packages inside ``try`` blocks and keeps ``None`` (or a
``MagicMock`` base class) when they are missing; its layers then refuse to build. Part of
:func:`megatron_seq1f1b.runtime.cpu.enable`: where the packages are missing, the module
globals Megatron's training forward calls become :mod:`~megatron_seq1f1b.runtime.
recurrent_reference`'s kernels (the same semantics, plain torch), so Megatron's own schedules
and Seq1F1B run these layers with identical kernels. Mamba also needs ``einops`` (a
dependency of the test extras); without it ``MambaMixer`` keeps Megatron's own error.
"""

from __future__ import annotations

import importlib
import importlib.util

from megatron_seq1f1b.runtime import recurrent_reference as reference

#: The mamba_ssm / causal-conv1d names Megatron-Core's ``mamba_mixer`` imports.
_MAMBA = {"causal_conv1d_fn": reference.causal_conv1d_fn,
          "mamba_chunk_scan_combined": reference.mamba_chunk_scan_combined,
          "mamba_split_conv1d_scan_combined": reference.mamba_split_conv1d_scan_combined,
          "RMSNormGated": reference.RMSNormGated}
#: The fla names of the gated delta net's modules (0.19: ``gated_delta_net.common`` and
#: ``.gdn``; 0.16-0.18: ``gated_delta_net``, whose 0.16-0.17 calls causal-conv1d's
#: ``causal_conv1d_fn``, 0.18 fla's ``causal_conv1d``).
_GDN = {"causal_conv1d": reference.causal_conv1d, "l2norm": reference.l2norm,
        "chunk_gated_delta_rule": reference.chunk_gated_delta_rule,
        "causal_conv1d_fn": reference.causal_conv1d_fn}
_GDN_MODULES = ("megatron.core.ssm.gated_delta_net.common", "megatron.core.ssm.gated_delta_net.gdn",
                "megatron.core.ssm.gated_delta_net")


def _module(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


class _ExtendedRMSNorm(reference.RMSNormGated):
    """Megatron's ``ExtendedRMSNorm``: the gated norm with its weight sharded along axis 0 in
    distributed checkpoints."""

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True),
                                                   prefix, {"weight": 0}, sharded_offsets)


def _packing_supported(for_inference_not_training: bool = True) -> tuple[bool, None]:
    """The reference kernels take packed sequences (``seq_idx``, ``cu_seqlens``)."""
    return True, None


def _install_mamba() -> None:
    if importlib.util.find_spec("mamba_ssm") is not None:
        return
    mixer = _module("megatron.core.ssm.mamba_mixer")
    if mixer is None or getattr(mixer, "HAVE_MAMBA_SSM", True):
        return
    for name, kernel in _MAMBA.items():
        setattr(mixer, name, kernel)
    # Megatron subclasses the gated norm at import time (a MagicMock base without mamba_ssm):
    # such a subclass, of the reference norm
    if hasattr(mixer, "ExtendedRMSNorm"):
        mixer.ExtendedRMSNorm = _ExtendedRMSNorm
    mixer.HAVE_MAMBA_SSM = True
    mixer.MAMBA_HAS_STATE_DTYPE = True  # the reference scans take state_dtype
    if hasattr(mixer, "_check_mamba_sequence_packing_support"):  # reads the packages' versions
        mixer._check_mamba_sequence_packing_support = _packing_supported


def _install_gdn() -> None:
    if importlib.util.find_spec("fla") is not None:
        return
    for name in _GDN_MODULES:
        module = _module(name)
        if module is None or not hasattr(module, "chunk_gated_delta_rule"):
            continue
        for attribute, kernel in _GDN.items():
            if hasattr(module, attribute):
                setattr(module, attribute, kernel)
        if hasattr(module, "HAVE_FLA"):
            module.HAVE_FLA = True


def install() -> None:
    """Put the reference kernels into Megatron-Core's recurrent mixer modules where their
    packages are missing (idempotent)."""
    _install_mamba()
    _install_gdn()


__all__ = ["install"]
