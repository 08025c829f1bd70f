"""Variable-length (THD) attention over documents: the kernels.

A segment with documents is many small causal attentions: per sample, one
per document piece (:class:`~megatron_seq1f1b.segments.documents.Piece`), queries
``[q0, q1)`` over keys ``[k0, q1)``, aligned bottom-right. Transformer
Engine and PyTorch's flash kernel take such a batch as *THD*: queries and
keys of all pieces packed along one token dimension, cut by cumulative
lengths (``cu_seqlens_q``, ``cu_seqlens_kv``). No ``[queries, keys]`` mask
exists anywhere (a windowed layer's per-piece window mask on the fallback aside).

:class:`~megatron_seq1f1b.segments.packed.Packed` is one segment's packing, made
once per segment and window from the plan: the cuts as host integers and as
device tensors. :func:`attention` is the kernel:

* CUDA, fp16 / bf16, no dropout, one head size: PyTorch's ``varlen_attn``
  (``torch.nn.attention.varlen``, torch >= 2.10), one call per layer and
  segment, called as its signature allows (:class:`_Kernel`, read once per
  function): causal as ``window_size=(-1, 0)`` (a window ``w`` as ``(w, 0)``),
  or ``is_causal=True`` where it has no ``window_size`` (torch 2.10; windowed
  layers then take the fallback); ``enable_gqa`` where it exists, else K/V
  repeated per query head; ``scale`` where it exists, else the query scaled
  so the kernel's ``1/sqrt(d)`` gives it. Its flash kernel aligns causal
  masks and windows bottom-right per sequence. Before first use on a device,
  dtype and kind of call (window, GQA), a self-check against the per-piece
  path (forward and gradients, a sequence with more keys than queries
  included) decides whether it is used: a kernel that aligned top-left, or
  attended to all keys, would be silently wrong.
* Elsewhere, and where that check fails, one SDPA call per piece
  (:func:`_per_piece`). Which kernel serves what, and why, is logged once.

On the kernel path nothing waits for the device: the cuts and maxima come
from the plan (host integers, device tensors made once per segment); no
``.tolist()``, ``.item()``, ``int(tensor)`` or ``bool(tensor)`` per layer.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from megatron_seq1f1b.attention.prefix import bottom_right_causal

log = logging.getLogger(__name__)


class MaskType(NamedTuple):
    """A Transformer Engine mask type Megatron's ``AttnMaskType`` lacks (TE reads ``.name``)."""

    name: str


#: THD needs a padding mask type; the document crossing into a segment from earlier ones has
#: more keys than queries, aligned bottom-right.
PADDING_CAUSAL_BOTTOM_RIGHT = MaskType("padding_causal_bottom_right")

#: Where PyTorch's variable-length flash kernel runs (tests widen these to drive it on CPU).
KERNEL_DEVICES = ("cuda",)
KERNEL_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class _Kernel:
    """How this PyTorch's ``varlen_attn`` is asked for causal attention aligned bottom-right.

    Read from its signature, not the version string (torch 2.10 takes
    ``is_causal`` and no scale; 2.11 ``window_size`` and ``scale``; 2.12 on
    also ``enable_gqa``; backports and nightlies differ).
    """

    function: Callable[..., torch.Tensor]
    windows: bool  # takes window_size: causal is (-1, 0), a window w is (w, 0); else is_causal
    gqa: bool  # takes enable_gqa; else K/V are repeated per query head
    scale: bool  # takes scale; else the query is scaled (the kernel's default is 1/sqrt(d))

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int, *,
                 scale: float, window: int | None) -> torch.Tensor:
        heads, groups = query.shape[1], key.shape[1]
        extra: dict = {}
        if self.windows:  # a tuple: the function compares it with (-1, 0) to mean causal
            extra["window_size"] = (-1 if window is None else window, 0)
        else:
            extra["is_causal"] = True
        if groups != heads and self.gqa:
            extra["enable_gqa"] = True
        elif groups != heads:
            key = key.repeat_interleave(heads // groups, dim=1)
            value = value.repeat_interleave(heads // groups, dim=1)
        if self.scale:
            extra["scale"] = scale
        elif not math.isclose(scale, 1.0 / math.sqrt(query.shape[-1]), rel_tol=1e-12):
            query = query * (scale * math.sqrt(query.shape[-1]))
        return self.function(query, key, value, cu_q, cu_k, max_q, max_k, **extra)

    def describe(self) -> str:
        """How it is called (for the log)."""
        causal = "window_size=(-1, 0) / (w, 0)" if self.windows else "is_causal=True"
        gqa = "enable_gqa" if self.gqa else "K/V repeated per query head"
        scale = "scale" if self.scale else "query pre-scaled"
        return f"PyTorch varlen_attn ({causal}; {gqa}; {scale})"


@functools.lru_cache(maxsize=None)
def _adapter(function: Callable) -> tuple[_Kernel | None, str]:
    """``function`` (a ``varlen_attn``) as a causal bottom-right call, or None and why not."""
    signature = inspect.signature(function)
    params = signature.parameters
    if "window_size" not in params and "is_causal" not in params:
        return None, (f"varlen_attn{signature} takes neither window_size nor is_causal: it "
                      "cannot be asked for causal attention")
    kernel = _Kernel(function, "window_size" in params, "enable_gqa" in params, "scale" in params)
    return kernel, kernel.describe()


def _varlen_attn() -> Callable | None:
    """PyTorch's ``varlen_attn``, or None (torch < 2.10)."""
    try:
        from torch.nn.attention import varlen
    except ImportError:
        return None
    return getattr(varlen, "varlen_attn", None)


#: The kernel chosen per (device, dtype, windowed, grouped, dropout, MLA widths): a dict look-up
#: per layer after the first.
_CHOSEN: dict[tuple, _Kernel | None] = {}


def _choose(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, window: int | None,
            dropout: float) -> _Kernel | None:
    """The varlen kernel for this call, or None for the per-piece path; logged once per kind."""
    where = (query.device, query.dtype, window is not None, key.shape[1] != query.shape[1],
             dropout > 0.0, value.shape[-1] != query.shape[-1])
    if where not in _CHOSEN:
        kernel, why = _pick(*where)
        _CHOSEN[where] = kernel
        on_cuda_fallback = kernel is None and query.device.type in KERNEL_DEVICES \
            and query.dtype in KERNEL_DTYPES and dropout == 0.0
        log.log(logging.WARNING if on_cuda_fallback else logging.INFO,
                "THD attention on %s %s (window: %s, GQA: %s): %s", query.device,
                str(query.dtype).removeprefix("torch."), window is not None, where[3],
                why if kernel is not None else f"one SDPA call per document piece; {why}")
    return _CHOSEN[where]


def _pick(device: torch.device, dtype: torch.dtype, windowed: bool, grouped: bool,
          dropout: bool, mla: bool) -> tuple[_Kernel | None, str]:
    """The kernel for this kind of call and what it is, or None and why the per-piece path."""
    if device.type not in KERNEL_DEVICES:
        return None, f"PyTorch's variable-length flash kernel runs on {KERNEL_DEVICES} only"
    if dtype not in KERNEL_DTYPES:
        return None, "PyTorch's variable-length flash kernel takes fp16 / bf16 only"
    if dropout:
        return None, "varlen_attn has no dropout"
    if mla:
        return None, "varlen_attn needs one head size for queries, keys and values"
    function = _varlen_attn()
    if function is None:
        return None, "torch.nn.attention.varlen.varlen_attn does not exist (torch < 2.10)"
    kernel, why = _adapter(function)
    if kernel is None:
        return None, why
    if windowed and not kernel.windows:
        return None, f"varlen_attn{inspect.signature(function)} has no window_size"
    problem = _disagreement(kernel, device, dtype, windowed, grouped)
    if problem:
        return None, f"{kernel.describe()} failed its self-check: {problem}"
    return kernel, why


def _disagreement(kernel: _Kernel, device, dtype, windowed: bool, grouped: bool) -> str:
    """What is wrong with ``kernel`` on ``device`` (``""``: nothing), output and gradients
    against the per-piece path on CPU in fp64: two sequences, the first with more keys than
    queries (bottom-right), a scale other than the default. Once per kind of call, so its
    host syncs are once too."""
    generator = torch.Generator(device="cpu").manual_seed(0)
    heads, groups = 4, (2 if grouped else 4)
    cu_q, cu_k, window, scale = (0, 24, 40), (0, 40, 56), (7 if windowed else None), 0.1
    exact = [torch.randn(n, h, 64, generator=generator, dtype=torch.float64)
             for n, h in ((40, heads), (56, groups), (56, groups), (40, heads))]
    with torch.inference_mode(False), torch.enable_grad():
        try:
            inputs = [t.to(device, dtype).requires_grad_() for t in exact[:3]]
            fast = kernel(*inputs, torch.tensor(cu_q, dtype=torch.int32, device=device),
                          torch.tensor(cu_k, dtype=torch.int32, device=device), 24, 40,
                          scale=scale, window=window)
            fast_grads = torch.autograd.grad(fast, inputs, exact[3].to(device, dtype))
        except Exception as error:  # noqa: BLE001 - a kernel that does not run here is not used
            return f"{type(error).__name__}: {str(error).splitlines()[0]}"
        # the reference sees the inputs as the kernel did (rounded to its dtype)
        wide = [t.detach().to("cpu", torch.float64).requires_grad_() for t in inputs]
        slow = _per_piece(*wide, cu_q, cu_k, scale=scale, window=window, dropout=0.0)
        slow_grads = torch.autograd.grad(slow, wide, exact[3].to(dtype).double())
    for name, got, want in zip(("output", "query gradient", "key gradient", "value gradient"),
                               (fast, *fast_grads), (slow, *slow_grads)):
        error = (got.detach().to("cpu", torch.float64) - want).abs().max().item()
        if error > 3e-2 * max(1.0, want.abs().max().item()):
            return f"{name} differs by {error:.3g} (aligned top-left, or not causal?)"
    return ""


def window_mask(sq: int, sk: int, window: int, device) -> torch.Tensor:
    """Boolean ``[sq, sk]`` mask (True = attend): causal, bottom-right, ``window`` keys back."""
    rows = torch.arange(sq, device=device).unsqueeze(1) + (sk - sq)
    keys = torch.arange(sk, device=device)
    return (keys <= rows) & (keys >= rows - window)


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              cu_q: tuple[int, ...] | None, cu_k: tuple[int, ...] | None, max_q: int,
              max_k: int, *, scale: float, window: int | None = None, dropout: float = 0.0,
              cu_q_tensor: torch.Tensor | None = None,
              cu_k_tensor: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention per sequence of a THD batch, aligned bottom-right; ``[T, h, dv]`` out.

    ``query`` ``[Tq, heads, d]``, ``key`` / ``value`` ``[Tk, groups, d]`` (GQA
    when groups < heads). Sequence ``i`` is queries ``cu_q[i]:cu_q[i+1]`` over
    keys ``cu_k[i]:cu_k[i+1]``. The cuts come as host integers (``cu_q``,
    ``cu_k``: a segment's plan; None where unknown) and as device tensors
    (``cu_*_tensor``); the kernel needs the tensors, the per-piece path the
    integers; each is derived from the other only where missing (from the
    tensors: a host sync, which only Megatron's own schedules' THD batches take).
    """
    kernel = _choose(query, key, value, window, dropout)
    if kernel is not None:
        if cu_q_tensor is None:
            cu_q_tensor = torch.tensor(cu_q, dtype=torch.int32, device=query.device)
        if cu_k_tensor is None:
            cu_k_tensor = torch.tensor(cu_k, dtype=torch.int32, device=query.device)
        return kernel(query, key, value, cu_q_tensor, cu_k_tensor, max_q, max_k, scale=scale,
                      window=window)
    if cu_q is None:
        cu_q = tuple(cu_q_tensor.tolist())
    if cu_k is None:
        cu_k = tuple(cu_k_tensor.tolist())
    return _per_piece(query, key, value, cu_q, cu_k, scale=scale, window=window, dropout=dropout)


def _per_piece(query, key, value, cu_q, cu_k, *, scale: float, window: int | None,
               dropout: float) -> torch.Tensor:
    """One SDPA call per sequence, no mask tensor unless a window needs one.

    Grouped queries go per group: ``[groups, heads / groups, s, d]`` queries
    over keys expanded without a copy, so SDPA and the CPU prefix kernels see
    as many key heads as query heads. (SDPA's ``enable_gqa`` would leave the
    CPU kernels to CausalBias, which builds the ``[sq, sk]`` mask for a piece
    with more keys than queries; ``repeat_interleave`` copies K/V per head.)
    """
    heads, groups = query.shape[1], key.shape[1]
    # split, not one slice per piece: a slice's backward zero-fills a gradient of all tokens
    q_lengths = [b - a for a, b in zip(cu_q, cu_q[1:])]
    k_lengths = [b - a for a, b in zip(cu_k, cu_k[1:])]
    outputs = []
    for q, k, v in zip(query[cu_q[0]:cu_q[-1]].split(q_lengths),
                       key[cu_k[0]:cu_k[-1]].split(k_lengths),
                       value[cu_k[0]:cu_k[-1]].split(k_lengths)):
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [h or g, s, d]
        (sq, d), (sk, dv) = q.shape[1:], v.shape[1:]
        per = heads // groups
        q = q.reshape(groups, per, sq, d)  # a view: splits the head dimension
        k = k.unsqueeze(1).expand(groups, per, sk, k.shape[-1])
        v = v.unsqueeze(1).expand(groups, per, sk, dv)
        if window is not None:
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=window_mask(sq, sk, window, q.device), dropout_p=dropout,
                scale=scale)
        else:
            out = bottom_right_causal(q, k, v, scale=scale, dropout=dropout)
        outputs.append(out.reshape(heads, sq, dv).transpose(0, 1))
    return torch.cat(outputs) if len(outputs) > 1 else outputs[0]
