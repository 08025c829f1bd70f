"""Segment-aware core attention and rotary embeddings (installed by ``enable``).

Inside a segmented step, core attention gets this segment's queries against
the keys/values it may see (see :mod:`megatron_seq1f1b.segments.kv_cache`): without
documents those of segments ``0..j`` of the same micro-batch, with the causal
mask aligned to the bottom right (query ``i``, position ``start + i``, sees
keys ``0 .. start + i``); with packed documents only the keys of each query's
own document (:mod:`megatron_seq1f1b.segments.documents`); with context parallelism
this rank's two chunks of the segment as queries, over the segment's keys
gathered from the CP group (:mod:`megatron_seq1f1b.attention.context_parallel`).
Outside a segmented step (or with a single segment and neither documents nor
CP) the original forward runs untouched.

Backends:

* Megatron's local ``DotProductAttention``: it asserts equal query/key
  lengths when no mask is given, so we pass an explicit boolean mask
  ``[1 or b, 1, queries, keys]`` (True = masked), ORed with the user's own mask
  sliced by :func:`~megatron_seq1f1b.segments.run.slice_batch`. Its softmax is
  switched to the masked (non-causal) kernel for the call, because the fused
  causal kernel ignores masks and needs as many keys as queries, and its own
  window mask is kept from replacing ours.
* Transformer Engine's ``TEDotProductAttention`` and our SDPA flash attention
  (``bottom_right_causal``): ``causal_bottom_right`` over the K/V prefix (TE's
  plain ``causal`` is aligned top-left when lengths differ), a given mask
  along as unsegmented; with documents the segment packed as THD
  (:mod:`megatron_seq1f1b.attention.varlen`, ``padding_causal_bottom_right``); with CP
  and no documents one call per chunk (a given mask cut to each chunk's rows and keys).

Sliding windows (``window_size=(w, 0)``, per layer as Megatron decides with
``window_attn_skip_freq``): query ``i`` sees keys ``start + i - w .. start + i``,
so a segment gets only rows ``[max(0, start - w), end)``; both backends align
their window bottom-right, which is then exactly the full sequence's window.
"""

from __future__ import annotations

import contextlib

import torch

from megatron_seq1f1b.attention.context_parallel import GatherKV
from megatron_seq1f1b.attention.varlen import PADDING_CAUSAL_BOTTOM_RIGHT
from megatron_seq1f1b.segments import run as segments
from megatron_seq1f1b.segments.documents import ALONE, HEAD
from megatron_seq1f1b.segments.kv_cache import GradientSink, KVAppend

_ORIGINAL = "_seq1f1b_original_forward"


def _segmented() -> "segments._Active | None":
    """The active segment, if attention must treat it as one: several segments, documents, or
    context parallelism."""
    current = segments.active()
    if current is None or not current.run.segmented:
        return None
    return current


def layer_window(core_attention) -> int | None:
    """Left window of this layer in keys (``None``: the whole prefix).

    Megatron's local attention keeps the layer's window on its softmax;
    Transformer Engine keeps its own ``window_size`` (``-1`` = unbounded).
    """
    softmax = getattr(core_attention, "scale_mask_softmax", None)
    window = getattr(softmax if softmax is not None else core_attention, "window_size", None)
    if window is None or window[0] is None or window[0] < 0:
        return None
    if window[1] not in (0, -1):
        raise ValueError(
            f"Seq1F1B: sliding window {tuple(window)} looks ahead {window[1]} tokens; causal "
            "segments cannot see later segments' keys; use window_size=(w, 0)"
        )
    return int(window[0])


def segment_kv(layer, key, value, current, window: int | None = None):
    """This segment's keys/values for attention, what the segment sees and what this rank's
    queries of it see (:class:`SegmentView` s; the same without context parallelism).

    A segment of a chain (:mod:`megatron_seq1f1b.segments.documents`) gets views of
    the chain's buffer, rows ``[key_start, end)``, its own rows added; a
    segment alone its own, untouched. With context parallelism the segment's
    keys and values are first gathered over the CP group
    (:class:`~megatron_seq1f1b.attention.context_parallel.GatherKV`).
    """
    info, run = current.info, current.run
    if run.cp_size > 1:
        if key.shape[0] * run.cp_size != info.length:
            raise RuntimeError(
                f"Seq1F1B: attention received {key.shape[0]} keys for this context-parallel "
                f"rank's part of segment {info.index} ({info.length} tokens over "
                f"{run.cp_size} ranks); cut batches with megatron_seq1f1b.slice_batch")
        key, value = GatherKV.apply(key, value, run.cp_group, run.cp_meter)
    if key.shape[0] != info.length:
        raise RuntimeError(
            f"Seq1F1B: attention received {key.shape[0]} keys for segment {info.index} of "
            f"{info.length} tokens; batches must be cut with megatron_seq1f1b.slice_batch "
            "and pipeline inputs must have the segment's shape"
        )
    geometry = run.geometry(info.microbatch, window)
    view, mine = geometry.views[info.index], geometry.queries[info.index]
    role, number = geometry.roles[info.index]
    if role == ALONE:
        return key, value, view, mine
    chain = geometry.chains[number]
    entry = run.kv.get(info.microbatch, info.chunk, layer, chain.head)
    if current.phase == segments.FORWARD:
        if entry is None:
            if role != HEAD:
                raise RuntimeError(f"Seq1F1B: {_where(info)} forwarded before segment "
                                   f"{chain.head}")
            entry = run.kv.create(
                info.microbatch, info.chunk, layer, key, value, head=chain.head, base=chain.base,
                end=chain.end, starts=geometry.starts, lengths=geometry.lengths,
                windowed=window is not None)
        if info.index in entry.forwarded:
            raise RuntimeError(
                f"Seq1F1B: {_where(info)} forwarded twice; a repeated forward would overwrite "
                "the key/value cache (recomputation must run inside the segment's backward)"
            )
        if len(entry.forwarded) != info.index - chain.head:  # head..index-1, each once (checked)
            missing = sorted(set(range(chain.head, info.index)) - entry.forwarded)
            raise RuntimeError(f"Seq1F1B: {_where(info)} forwarded before segments {missing}")
        entry.forwarded.add(info.index)
        write = True
    else:
        # Recomputation inside the segment's backward: the cache already holds
        # this segment's rows; reuse them, write nothing, count nothing.
        if entry is None or info.index not in entry.forwarded:
            raise RuntimeError(f"Seq1F1B: {_where(info)} recomputed without a cached forward")
        write = False
    keys, values = KVAppend.apply(key, value, run.kv, entry, info, write, view.key_start)
    keys.seq1f1b_grad_sink = GradientSink(entry, info, view.key_start)
    return keys, values, view, mine


def _where(info) -> str:
    return f"micro-batch {info.microbatch}, segment {info.index}, chunk {info.chunk}"


@contextlib.contextmanager
def _masked_softmax(core_attention):
    """Megatron's softmax with our mask as given: its fused causal kernel ignores masks and
    needs as many keys as queries, and on windowed layers it builds its own window mask in
    place of the given one (which would drop documents); ours holds the window already."""
    from megatron.core.transformer.enums import AttnMaskType

    softmax = core_attention.scale_mask_softmax
    saved = softmax.attn_mask_type, getattr(softmax, "window_size", None)
    softmax.attn_mask_type = AttnMaskType.padding
    if saved[1] is not None:
        softmax.window_size = None
    try:
        yield
    finally:
        softmax.attn_mask_type = saved[0]
        if saved[1] is not None:
            softmax.window_size = saved[1]


def _given_mask(attention_mask, info, view, mine):
    """The user's mask (sliced by ``slice_batch`` to ``[..., queries, end]``) over the keys
    seen (``view``'s, from its ``key_start``) by this rank's queries (``mine``)."""
    if tuple(attention_mask.shape[-2:]) != (mine.num_queries, info.end):
        raise ValueError(
            f"Seq1F1B: attention_mask of shape {tuple(attention_mask.shape)} for segment "
            f"{info.index} (tokens {info.start}..{info.end}); expected [..., "
            f"{mine.num_queries}, {info.end}]: cut the batch with megatron_seq1f1b.slice_batch"
        )
    return attention_mask[..., view.key_start:]


def _local_mask(attention_mask, current, view, mine, device):
    """What the local attention masks: the segment's own causal/document/window mask, and the
    user's mask on top (Megatron's windowed softmax also builds its own window mask)."""
    info = current.info
    own = current.run.local_mask(info, mine, device, view.key_start)
    if attention_mask is None:
        return own
    given = _given_mask(attention_mask, info, view, mine)
    if mine.pieces is None and mine.window is None:
        return given
    return given | own


def _is_thd(packed_seq_params) -> bool:
    if packed_seq_params is None:
        return False
    if getattr(packed_seq_params, "qkv_format", None) != "thd":
        raise ValueError(
            f"Seq1F1B: packed_seq_params with qkv_format={packed_seq_params.qkv_format!r}; "
            "segments take packed documents as THD (qkv_format='thd') batches"
        )
    return True


def _thd_checks(current, packed_seq_params, query) -> None:
    """THD inputs in a segment: documents known to the run, one sample, the segment's tokens."""
    run, info = current.run, current.info
    if run.documents is None:
        raise ValueError(
            "Seq1F1B: a packed (THD) batch in a segment, but the schedule was not given its "
            "documents; pass documents='cu_seqlens' to get_forward_backward_func (Megatron-LM "
            "and scripts/pretrain_gpt.py do it for --dataloader-inter-document-masking / --sft)")
    if run.documents_of(info.microbatch).micro_batch_size != 1:
        raise ValueError("Seq1F1B: packed (THD) batches hold one sample per micro-batch")
    if query.shape[0] != info.length:
        raise RuntimeError(
            f"Seq1F1B: {query.shape[0]} packed tokens for segment {info.index} of "
            f"{info.length} tokens; cut the batch with megatron_seq1f1b.slice_batch")


def _reject_bias(attention_bias) -> None:
    """An attention bias is shaped for the whole sequence; a segment cannot cut it (yet)."""
    if attention_bias is not None:
        raise ValueError(
            "Seq1F1B does not support an attention_bias (it is shaped for the whole "
            "sequence, not a segment); run without it"
        )


def local_attention_forward(core_attention, original):
    """Forward for Megatron's ``DotProductAttention``."""
    from megatron.core.transformer.enums import AttnMaskType

    def forward(query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        current = _segmented()
        if current is None:
            return original(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                            attention_bias=attention_bias, packed_seq_params=packed_seq_params)
        _reject_bias(attention_bias)
        if _is_thd(packed_seq_params):  # THD: one sample; attend as [L, 1, ...]
            _thd_checks(current, packed_seq_params, query)
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        window = layer_window(core_attention)
        keys, values, view, mine = segment_kv(core_attention, key, value, current, window)
        mask = _local_mask(attention_mask, current, view, mine, query.device)
        with _masked_softmax(core_attention):
            return original(query, keys, values, mask, attn_mask_type=AttnMaskType.padding,
                            attention_bias=None, packed_seq_params=None)

    return forward


def te_attention_forward(core_attention, original):
    """Forward for Transformer Engine's ``TEDotProductAttention`` (and look-alikes: the flash
    attention on SDPA takes the same calls).

    A segment without documents (or whose documents change nothing) attends over
    its K/V prefix with ``causal_bottom_right``; a given mask goes along, over the
    keys it sees, as unsegmented (TE's unfused backend ORs it into the causal
    mask, its flash and fused backends ignore it). With documents the segment is
    packed as THD (:mod:`megatron_seq1f1b.attention.varlen`): ``cu_seqlens`` per document
    piece and ``padding_causal_bottom_right``, which THD requires; no mask.
    """
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    causal = (AttnMaskType.causal, AttnMaskType.causal_bottom_right, AttnMaskType.padding_causal,
              "causal")

    def forward(query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **kwargs):
        current = _segmented()
        if current is None:
            return original(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                            attention_bias=attention_bias, packed_seq_params=packed_seq_params,
                            **kwargs)
        _reject_bias(attention_bias)
        mask_type = attn_mask_type if attn_mask_type is not None else core_attention.attn_mask_type
        if mask_type not in causal:
            raise ValueError(
                f"Seq1F1B needs causal self-attention; this layer uses {mask_type}"
            )
        if _is_thd(packed_seq_params):
            _thd_checks(current, packed_seq_params, query)
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        keys, values, view, mine = segment_kv(core_attention, key, value, current,
                                              layer_window(core_attention))
        info = current.info
        if mine.pieces is None:
            mask = (None if attention_mask is None
                    else _given_mask(attention_mask, info, view, mine))
            return original(query, keys, values, mask,
                            attn_mask_type=AttnMaskType.causal_bottom_right,
                            attention_bias=None, packed_seq_params=None, **kwargs)
        if current.run.documents_of(info.microbatch) is None:
            # Context parallelism without documents: this rank's chunks are causal spans over
            # views of the keys (no packed copy of them): in one call where the attention
            # takes spans, else one bottom-right call per chunk, a given mask cut to each
            # (it goes along as without CP: the attention uses or refuses it)
            spans, row = [], 0
            for piece in mine.pieces[0]:
                spans.append((row, piece.queries, piece.k0 - view.key_start,
                              piece.q1 - view.key_start))
                row += piece.queries
            given = (None if attention_mask is None
                     else _given_mask(attention_mask, info, view, mine))
            attend_spans = getattr(core_attention, "attend_spans", None)
            out = (None if attend_spans is None or given is not None
                   else attend_spans(query, keys, values, spans))
            if out is not None:
                return out
            return torch.cat([original(
                query[row:row + rows], keys[low:high], values[low:high],
                None if given is None else given[..., row:row + rows, low:high],
                attn_mask_type=AttnMaskType.causal_bottom_right, attention_bias=None,
                packed_seq_params=None, **kwargs) for row, rows, low, high in spans])
        packed = current.run.packed(info, mine, query.device, view.key_start)
        q, k, v = packed.pack(query, keys, values)
        params = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=packed.cu_q_tensor, cu_seqlens_kv=packed.cu_k_tensor,
            max_seqlen_q=packed.max_q, max_seqlen_kv=packed.max_k)
        params.seq1f1b_host = (packed.cu_q, packed.cu_k)
        out = original(q, k, v, None, attn_mask_type=PADDING_CAUSAL_BOTTOM_RIGHT,
                       attention_bias=None, packed_seq_params=params, **kwargs)
        return packed.unpack(out)

    return forward


def rotary_forward(rotary, original):
    """RotaryEmbedding.forward with the segment's position offset.

    Packed (THD) batches restart positions at every document, and Megatron
    applies a table as long as the packed tokens row by row: the segment gets
    one row per token, at its position within its document (the part of a
    document that crossed from earlier segments continues where it was).
    """

    def forward(max_seq_len, offset=0, packed_seq=False, cp_group=None):
        current = _segmented()
        if current is None:
            return original(max_seq_len, offset, packed_seq, cp_group)
        info = current.info
        if packed_seq:
            run = current.run
            if run.documents is None:
                raise ValueError(
                    "Seq1F1B: rotary embeddings of a packed (THD) batch in a segment, but the "
                    "schedule was not given its documents; pass documents='cu_seqlens'")
            _, longest = run.document_rows(info)
            table = original(longest, 0, packed_seq, cp_group)
            if not isinstance(table, torch.Tensor):
                raise ValueError("Seq1F1B: packed (THD) documents with this rotary embedding "
                                 f"({type(rotary).__name__}, e.g. YaRN) are not supported")
            return table.index_select(0, run.document_positions(info, table.device))
        if max_seq_len != info.length:
            raise RuntimeError(
                f"Seq1F1B: rotary embedding asked for {max_seq_len} positions in segment "
                f"{info.index} of {info.length} tokens; cut each segment's batch with "
                "megatron_seq1f1b.slice_batch"
            )
        run = current.run
        if run.cp_size == 1:
            return original(max_seq_len, offset + info.start, packed_seq, cp_group)
        # Context parallelism: the segment's table (packed_seq: not Megatron's whole-sequence
        # CP slicing), then this rank's chunks of the segment. YaRN returns (table, mscale).
        table = original(max_seq_len, offset + info.start, True, cp_group)
        full = table[0] if isinstance(table, tuple) else table
        rows = torch.cat([torch.arange(a - info.start, b - info.start, device=full.device)
                          for a, b in run.rank_ranges(info)])
        mine = full.index_select(0, rows)
        return (mine, *table[1:]) if isinstance(table, tuple) else mine

    return forward


def install_forward(module, make_forward) -> bool:
    """Replace `module.forward` (instance attribute, state_dict untouched); idempotent."""
    if hasattr(module, _ORIGINAL):
        return False
    original = module.forward
    setattr(module, _ORIGINAL, original)
    module.forward = make_forward(module, original)
    return True


def is_te_attention(module) -> bool:
    """TE's attention, or a core attention that declares TE's contract (``bottom_right_causal``:
    takes ``attn_mask_type=causal_bottom_right`` and a K/V prefix)."""
    return getattr(type(module), "bottom_right_causal", False) or any(
        cls.__name__ == "TEDotProductAttention" for cls in type(module).__mro__)
