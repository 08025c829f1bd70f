"""Pure-PyTorch reference kernels for Megatron-Core's recurrent mixers (Mamba-2, gated delta net).

Megatron-Core's ``MambaMixer`` and ``GatedDeltaNet`` call CUDA/Triton kernels from ``mamba_ssm``,
``causal_conv1d`` and ``fla`` (flash-linear-attention). This module re-implements, in plain torch
(autograd gives the backward), the documented semantics of exactly the kernels Megatron's *training*
forward calls, so that on CPU Megatron's own schedules and Seq1F1B run these layers with identical
kernels, and so that Seq1F1B can carry a layer's state from one segment to the next through the
kernels' initial/final-state arguments. Written from the kernels' documented interfaces and
semantics; no code is taken from those repositories. Each kernel is tested against a naive per-token
recurrence (``tests/test_recurrent_reference.py``: forward and gradients, fp64, 1e-10).

Precision follows the kernels: arithmetic in fp32 (fp64 when an input is fp64), outputs in the input
dtype; the kernels' finer rounding (inter-chunk states stored in ``state_dtype``, bf16 tiles) is not
imitated.

Kernels and the Megatron-Core call sites they stand in for (``megatron/core/ssm/...``;
0.19.2, and 0.16.1 where it differs):

``mamba_split_conv1d_scan_combined`` (mamba_ssm.ops.triton.ssd_combined)
    ``mamba_mixer.py`` import :70 (0.16.1 :61); ``MambaMixer._ssm_training`` :755 (0.16.1 :659), the
    training path (``use_mamba_mem_eff_path``, the default). Megatron passes ``seq_idx`` for packed
    sequences, ``rmsnorm_weight=None`` (gating inside the kernel, its own ``self.norm(y)`` after,
    :779 / 0.16.1 :682) and ``state_dtype`` when the kernel's signature has it (this one has).
``causal_conv1d_fn`` (causal_conv1d)
    ``mamba_mixer.py`` import :62 (0.16.1 :53); ``MambaMixer._ssm_prefill`` :917 (0.16.1 :805), the
    non-memory-efficient path (``use_mamba_mem_eff_path=False``; training there asserts no packed
    sequences). 0.16.1's ``GatedDeltaNet`` also calls it (``gated_delta_net.py`` import :50, call
    :330; ``nn.Conv1d`` when it is missing or in deterministic mode).
``mamba_chunk_scan_combined`` (mamba_ssm.ops.triton.ssd_combined)
    ``mamba_mixer.py`` import :70 (0.16.1 :61); ``MambaMixer._ssm_prefill`` :1063 (0.16.1 :850).
``RMSNormGated`` / ``RMSNorm`` / ``rmsnorm_fn`` (mamba_ssm.ops.triton.layernorm_gated)
    ``mamba_mixer.py`` imports ``RMSNorm as RMSNormGated`` :69 (0.16.1 :60) and subclasses it at
    import time (``ExtendedRMSNorm`` :111, built :417; 0.16.1 :83, :355); called as ``self.norm(y)``
    :779 and ``self.norm(y, z)`` :1093 (0.16.1 :682, :896).
``causal_conv1d`` (fla.modules.convolution; not the package ``causal_conv1d``)
    ``gated_delta_net/common.py`` import :44; ``GatedDeltaNet.forward`` (``gated_delta_net/gdn.py``)
    :214 when not ``config.deterministic_mode`` (there: ``F.conv1d`` :201).
``l2norm`` (fla.modules.l2norm)
    ``gated_delta_net/common.py`` import :45, ``_prepare_input_for_gated_delta_rule`` :411, and
    ``torch_chunk_gated_delta_rule`` :828 (with a ``dim=`` keyword fla's ``l2norm`` lacks; accepted
    here). 0.16.1: ``gated_delta_net.py`` import :40, calls :349, :350, :593.
``chunk_gated_delta_rule`` (fla.ops.gated_delta_rule)
    ``gated_delta_net/common.py`` import :46; chosen in ``gdn.py`` :62 when not deterministic and
    called :242 (0.16.1: import :41, call :382). Megatron-Core ships
    ``torch_chunk_gated_delta_rule`` (``common.py`` :801; 0.16.1 ``gated_delta_net.py`` :572), used
    in deterministic mode (``gdn.py`` :60, 0.16.1 :371): it runs on CPU once ``l2norm`` resolves,
    takes ``initial_state`` / ``output_final_state`` but no ``cu_seqlens`` (deterministic mode
    refuses packed sequences), works in fp32 whatever the input dtype, and its convolution
    (``F.conv1d``) takes no initial state. The carryable GDN path is therefore the non-deterministic
    one, which this module completes.

Not provided (inference only): ``causal_conv1d_update``, ``causal_conv1d_varlen_states``,
``selective_state_update``, Megatron's own Triton ``ssm/ops`` (dynamic-batching prefill/decode).

Running Megatron's layers on CPU with them (checked by hand on 0.19.2 and 0.16.1, not installed by
this module): Mamba -- put modules ``mamba_ssm.ops.triton.layernorm_gated`` (``RMSNorm``) and
``mamba_ssm.ops.triton.ssd_combined`` (both scans), ``causal_conv1d`` (``causal_conv1d_fn``; 0.16.1
also imports ``causal_conv1d_update``) and ``causal_conv1d.causal_conv1d_varlen`` into
``sys.modules`` before ``megatron.core.ssm.mamba_mixer`` is imported (``ExtendedRMSNorm`` subclasses
the norm at import time); ``einops`` must be importable; packed sequences also need
``mamba_mixer._check_mamba_sequence_packing_support`` to accept (it reads package versions); 0.16.1
without Triton also needs Megatron's Triton ``tensor_ops`` module (imported from
``megatron.core.inference.contexts.attention_context.triton``) stubbed. GDN -- set ``HAVE_FLA``,
``l2norm``, ``causal_conv1d`` and ``chunk_gated_delta_rule`` in ``gated_delta_net.common`` and the
last two in ``gated_delta_net.gdn`` (0.16.1: ``HAVE_FLA``, ``l2norm``, ``chunk_gated_delta_rule``,
``causal_conv1d_fn`` in ``gated_delta_net``); deterministic mode then runs Megatron's own torch path
with this ``l2norm``.

Carrying state across a cut (what Seq1F1B does): run segment ``j`` with ``return_final_states`` /
``output_final_state``, feed those as segment ``j+1``'s initial states; in the backward, the
gradient the second call returns for its initial states is the gradient of the first call's final
states. With packed documents, ``seq_idx`` semantics need care: the chunked scan gives its
``initial_states`` to the tokens whose ``seq_idx`` is 0 *before any change* (a virtual token with
``seq_idx`` 0 precedes position 0), so a segment's local ``seq_idx`` must be the global one minus
the ``seq_idx`` of the last token before the cut (then a document starting exactly at the cut gets
id 1 and starts from zero, as it should).
"""


from megatron_seq1f1b.runtime.reference_conv import causal_conv1d, causal_conv1d_fn
from megatron_seq1f1b.runtime.reference_gdn import chunk_gated_delta_rule, l2norm
from megatron_seq1f1b.runtime.reference_mamba import (
    RMSNorm, RMSNormGated, mamba_chunk_scan_combined, mamba_split_conv1d_scan_combined,
    rmsnorm_fn,
)

__all__ = [
    "mamba_chunk_scan_combined",
    "mamba_split_conv1d_scan_combined",
    "causal_conv1d_fn",
    "causal_conv1d",
    "rmsnorm_fn",
    "RMSNormGated",
    "RMSNorm",
    "l2norm",
    "chunk_gated_delta_rule",
]
