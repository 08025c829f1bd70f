"""Segments driven by hand against the full sequence (run in harness workers).

Forward segments in order, backward in reverse order, each backward seeded
with the segment's share of the loss (sum over its tokens divided by the
micro-batch's token count). Logits, losses and every gradient must equal a
plain full-sequence forward/backward of the same model.
"""

from __future__ import annotations

import dataclasses
import gc

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel

import megatron_seq1f1b as s1
from megatron_seq1f1b.segments.run import SegmentRun
from gpt import (
    DataSpec, ModelSpec, TEDotProductAttention, _close, build_chunks, data_documents,
    init_parallel, layer_spec, make_batches, make_config, packed_seq_params,
)

RTOL = 1e-5


# --------------------------------------------------------------- by-hand driver


def _model(spec: ModelSpec, *, tp=1, sp=False, fake_te=False, **overrides):
    init_parallel(tp=tp)
    config = make_config(spec, tp=tp, sp=sp, **overrides)
    if not fake_te:
        (gpt,) = build_chunks(spec, config)
        return gpt
    TEDotProductAttention.backend = "flash"  # the default; tests that need "unfused" say so
    return GPTModel(
        config=config, transformer_layer_spec=layer_spec(spec, fake_te=True), vocab_size=spec.vocab_size,
        max_sequence_length=spec.seq_length, position_embedding_type=spec.position_embedding_type,
    )


def _forward(model, batch, labels=True):
    return model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                 labels=batch["labels"] if labels else None)


def _sp_reduce(model) -> dict:
    """Gradients as finalize_model_grads would leave them (SP norms summed over TP)."""
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad.detach().clone()
        if getattr(param, "sequence_parallel", False):
            torch.distributed.all_reduce(grad, group=parallel_state.get_tensor_model_parallel_group())
        grads[name] = grad
    return grads



def _gradient_problems(gpt, ref_grads: dict) -> list[str]:
    """Every parameter gradient (summed over sequence-parallel ranks) against the reference."""
    grads = _sp_reduce(gpt)
    problems = []
    for name, expected in ref_grads.items():
        ok, rel = _close(grads[name], expected, RTOL)
        if not ok:
            problems.append(f"{name}: max rel err {rel:.2e}")
    return problems

def _full_sequence(model, batches):
    model.zero_grad(set_to_none=True)
    logits = [_forward(model, b, labels=False).detach() for b in batches]
    losses = []
    for batch in batches:
        per_token = _forward(model, batch)
        mask = batch["loss_mask"]
        loss = (per_token * mask).sum() / mask.sum()
        loss.backward()
        losses.append(per_token.detach())
    return logits, losses, _sp_reduce(model)


def _unit_order(num_microbatches, k, interleave, backward=False):
    segments_ = list(reversed(range(k))) if backward else list(range(k))
    if interleave:
        return [(mb, j) for j in segments_ for mb in range(num_microbatches)]
    return [(mb, j) for mb in range(num_microbatches) for j in segments_]


def _segmented_logits(model, batches, lengths, interleave):
    """Forward-only run: logits per micro-batch; caches released after the last segment."""
    run = SegmentRun(lengths, forward_only=True)
    outputs = {}
    with torch.no_grad():
        for mb, j in _unit_order(len(batches), len(lengths), interleave):
            with run.forward(mb, j):
                outputs[mb, j] = _forward(model, s1.slice_batch(batches[mb]), labels=False)
    run.close()
    k = len(lengths)
    return [torch.cat([outputs[mb, j] for j in range(k)], dim=1) for mb in range(len(batches))]


def _segmented(model, batches, lengths, interleave_microbatches=False):
    model.zero_grad(set_to_none=True)
    run = SegmentRun(lengths)
    k = len(lengths)
    outputs = {}
    for mb, j in _unit_order(len(batches), k, interleave_microbatches):
        with run.forward(mb, j) as info:
            assert s1.current_segment() == info
            batch = s1.slice_batch(batches[mb])
            outputs[mb, j] = (_forward(model, batch), batch["loss_mask"])
    assert s1.current_segment() is None
    live_after = []
    for mb, j in _unit_order(len(batches), k, interleave_microbatches, backward=True):
        per_token, mask = outputs[mb, j]
        total = batches[mb]["loss_mask"].sum()
        with run.backward(mb, j):
            ((per_token * mask).sum() / total).backward()
        if j == 0:
            live_after.append(run.kv.live_entries(mb))
    run.close()
    losses = [torch.cat([outputs[mb, j][0].detach() for j in range(k)], dim=1)
              for mb in range(len(batches))]
    return losses, _sp_reduce(model), live_after


def compare_by_hand(
    model: ModelSpec = ModelSpec(),
    data: DataSpec = DataSpec(num_microbatches=1),
    lengths=(8, 8, 8, 8),
    tp: int = 1,
    sp: bool = False,
    fake_te: bool = False,
    interleave_microbatches: bool = False,
    overrides: dict | None = None,
) -> dict:
    """Problems found on this rank when comparing segments with the full sequence."""
    gpt = _model(model, tp=tp, sp=sp, fake_te=fake_te, **(overrides or {}))
    batches = make_batches(model, data)
    ref_logits, ref_losses, ref_grads = _full_sequence(gpt, batches)
    state_before = {k: v.clone() for k, v in gpt.state_dict().items() if v is not None}
    s1.enable(gpt)
    s1.enable(gpt)  # idempotent
    state_after = gpt.state_dict()
    problems = []
    if set(state_before) != {k for k, v in state_after.items() if v is not None}:
        problems.append("state_dict keys changed")
    for key, value in state_before.items():
        if isinstance(value, torch.Tensor) and not torch.equal(value, state_after[key]):
            problems.append(f"state_dict value changed: {key}")
    # Enabled but no active segment: full-sequence behaviour is unchanged.
    same_logits, _, same_grads = _full_sequence(gpt, batches)
    for a, b in zip(same_logits, ref_logits):
        if not torch.equal(a, b):
            problems.append("enable() changed full-sequence logits")
    for name in ref_grads:
        if not torch.equal(same_grads[name], ref_grads[name]):
            problems.append(f"enable() changed full-sequence gradient of {name}")

    TEDotProductAttention.calls.clear()
    logits = _segmented_logits(gpt, batches, lengths, interleave_microbatches)
    losses, grads, live_after = _segmented(gpt, batches, lengths, interleave_microbatches)
    for mb, (a, b) in enumerate(zip(logits, ref_logits)):
        ok, rel = _close(a, b, RTOL)
        if not ok:
            problems.append(f"micro-batch {mb}: logits max rel err {rel:.2e}")
    for mb, (a, b) in enumerate(zip(losses, ref_losses)):
        ok, rel = _close(a, b, RTOL)
        if not ok:
            problems.append(f"micro-batch {mb}: per-token losses max rel err {rel:.2e}")
    for name, expected in ref_grads.items():
        ok, rel = _close(grads[name], expected, RTOL)
        if not ok:
            problems.append(f"{name}: max rel err {rel:.2e}")
    # After each micro-batch's segment 0 backward, its caches are gone.
    if any(live_after):
        problems.append(f"caches alive after segment 0 backward: {live_after}")
    return {"problems": problems, "te_calls": list(TEDotProductAttention.calls)}


def leak_check(model: ModelSpec = ModelSpec(), lengths=(8, 8, 8, 8), iterations: int = 20) -> dict:
    """Tensors alive and resident memory after many segmented iterations."""
    gpt = _model(model)
    s1.enable(gpt)
    batches = make_batches(model, DataSpec(num_microbatches=2))

    def live_tensors():
        gc.collect()
        return sum(1 for obj in gc.get_objects() if isinstance(obj, torch.Tensor))

    def rss_kib():
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        return 0

    counts, rss = [], []
    for _ in range(iterations):
        _segmented(gpt, batches, lengths)
        counts.append(live_tensors())
        rss.append(rss_kib())
    return {"tensors": counts, "rss_kib": rss}


def error_messages() -> dict:
    """The message of each rejected configuration or misuse (run on one rank)."""
    spec = ModelSpec()
    messages = {}

    def capture(name, fn):
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - we want the message
            messages[name] = f"{type(exc).__name__}: {exc}"
        else:
            messages[name] = None

    for name, field, value in [
        ("context_parallel", "context_parallel_size", 2),
        ("sliding_window_ahead", "window_size", (8, 2)),
        ("moe_capacity", "moe_expert_capacity_factor", 1.0),
        ("mtp", "mtp_use_repeated_layer", True),
        ("offloading", "fine_grained_activation_offloading", True),
        ("cuda_graphs", "cuda_graph_impl", "local"),
        ("tp_comm_overlap", "tp_comm_overlap", True),
        ("fp8_attention", "fp8_dot_product_attention", True),
    ]:
        gpt = _model(spec)
        setattr(gpt.config, field, value)
        if field.startswith("moe_"):
            gpt.config.num_moe_experts = 4
        if field.startswith("mtp_"):
            gpt.config.mtp_num_layers = 2
        capture(name, lambda gpt=gpt: s1.enable(gpt))

    gpt = _model(spec)
    gpt.position_embedding_type = "yarn"
    capture("yarn", lambda: s1.enable(gpt))
    capture("not_gpt", lambda: s1.enable(torch.nn.Linear(2, 2)))

    gpt = _model(spec)
    s1.enable(gpt)
    batch = make_batches(spec, DataSpec(num_microbatches=1))[0]

    def forward(run, mb, j, sliced=True, mask=None):
        with run.forward(mb, j):
            b = s1.slice_batch(batch) if sliced else dict(batch)
            if mask is not None:
                b["attention_mask"] = mask
            return _forward(gpt, b)

    run = SegmentRun((16, 16))
    capture("segment_1_first", lambda: forward(run, 0, 1))
    run = SegmentRun((16, 16))
    forward(run, 0, 0)
    capture("twice", lambda: forward(run, 0, 0))
    run = SegmentRun((16, 16))
    capture("not_sliced", lambda: forward(run, 0, 0, sliced=False))
    run = SegmentRun((16, 16))
    full_mask = torch.ones(1, 1, 32, 32, dtype=torch.bool).triu(1)
    capture("unsliced_mask", lambda: forward(run, 0, 0, mask=full_mask))

    def slice_wrong_length():
        with SegmentRun((16, 16)).forward(0, 0):
            s1.slice_batch({"tokens": torch.zeros(1, 30)})

    capture("slice_bad_shape", slice_wrong_length)
    run = SegmentRun((16, 16))
    forward(run, 0, 0)
    capture("leak_at_close", run.close)
    sp_config = make_config(spec, tp=2, sp=True)
    capture("sp_divisibility", lambda: SegmentRun((17, 15), config=sp_config))
    capture("bad_lengths", lambda: SegmentRun((16, 0)))
    fp8_config = make_config(spec)
    fp8_config.fp8 = "hybrid"
    capture("fp8_lengths", lambda: SegmentRun((12, 20), config=fp8_config))

    def attention_bias():
        core = gpt.decoder.layers[0].self_attention.core_attention
        q = torch.zeros(16, 1, 2, 8)
        with SegmentRun((16, 16)).forward(0, 0):
            core(q, q, q, None, attention_bias=torch.zeros(1, 2, 16, 16))

    capture("attention_bias", attention_bias)
    return messages


# --------------------------------------------------------------- packed documents


def _documents_model(spec: ModelSpec, backend: str, *, tp=1, sp=False, **overrides):
    """The model under test with the reference's weights: Megatron's local attention, the
    flash one, or the Transformer Engine stand-in (``te-flash`` ignores a given mask,
    ``te-unfused`` ORs it in)."""
    init_parallel(tp=tp)
    config = make_config(spec, tp=tp, sp=sp, **overrides)
    if backend.startswith("te"):
        TEDotProductAttention.backend = backend.split("-")[1]
        return GPTModel(config=config, transformer_layer_spec=layer_spec(spec, fake_te=True),
                        vocab_size=spec.vocab_size, max_sequence_length=spec.seq_length,
                        position_embedding_type=spec.position_embedding_type)
    (gpt,) = build_chunks(dataclasses.replace(spec, attention=backend), config)
    return gpt


def _doc_forward(model, batch, labels=True):
    return model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                 labels=batch["labels"] if labels else None,
                 packed_seq_params=packed_seq_params(batch))


def compare_documents_by_hand(
    model: ModelSpec = ModelSpec(),
    data: DataSpec = DataSpec(num_microbatches=1),
    lengths=(8, 8, 8, 8),
    backend: str = "local",
    tp: int = 1,
    sp: bool = False,
    overrides: dict | None = None,
    documents: bool = True,
) -> dict:
    """Segments of packed documents against the full sequence with a dense document mask.

    The reference is Megatron's local attention on the full sequence with the
    documents as a dense mask; the model under test (``backend``) gets the
    batches as ``data`` says (end-of-document tokens only, a dense mask, or
    packed THD) and the documents as the schedule's plan data. Logits
    (forward-only), per-token losses and every gradient are compared.
    """
    overrides = overrides or {}
    init_parallel(tp=tp)
    # Megatron's local attention replaces a given mask by its own on windowed layers (the
    # documents would be lost): with windows the reference is the TE stand-in's unfused
    # backend, which ORs the document mask into its window.
    windowed = overrides.get("window_size") is not None
    reference_model = _model(model, tp=tp, sp=sp, fake_te=windowed, **overrides)
    TEDotProductAttention.backend = "unfused"
    ref_batches = make_batches(model, data, reference=True)
    ref_logits, ref_losses, ref_grads = _full_sequence(reference_model, ref_batches)
    gpt = _documents_model(model, backend, tp=tp, sp=sp, **overrides)
    gpt.load_state_dict(reference_model.state_dict(), strict=False)
    s1.enable(gpt)
    batches = make_batches(model, data)
    # ``documents=False``: the schedule is not told (only the batch's dense mask has them)
    documents = data_documents(data, len(batches), model.seq_length) if documents else None
    TEDotProductAttention.calls.clear()

    def run_of(forward_only=False):
        return SegmentRun(lengths, forward_only=forward_only, documents=documents)

    problems = []
    k = len(lengths)
    run = run_of(forward_only=True)
    outputs = {}
    with torch.no_grad():
        for mb, j in _unit_order(len(batches), k, False):
            with run.forward(mb, j):
                outputs[mb, j] = _doc_forward(gpt, s1.slice_batch(batches[mb]), labels=False)
    run.close()
    for mb, expected in enumerate(ref_logits):
        got = torch.cat([outputs[mb, j] for j in range(k)], dim=1)
        ok, rel = _close(got, expected, RTOL)
        if not ok:
            problems.append(f"micro-batch {mb}: logits max rel err {rel:.2e}")

    gpt.zero_grad(set_to_none=True)
    run = run_of()
    outputs = {}
    for mb, j in _unit_order(len(batches), k, False):
        with run.forward(mb, j):
            batch = s1.slice_batch(batches[mb])
            outputs[mb, j] = (_doc_forward(gpt, batch), batch["loss_mask"])
    live_after = []
    for mb, j in _unit_order(len(batches), k, False, backward=True):
        per_token, mask = outputs[mb, j]
        with run.backward(mb, j):
            ((per_token * mask).sum() / batches[mb]["loss_mask"].sum()).backward()
        if j == 0:
            live_after.append(run.kv.live_entries(mb))
    run.close()
    for mb, expected in enumerate(ref_losses):
        got = torch.cat([outputs[mb, j][0].detach() for j in range(k)], dim=1)
        ok, rel = _close(got, expected, RTOL)
        if not ok:
            problems.append(f"micro-batch {mb}: per-token losses max rel err {rel:.2e}")
    problems += _gradient_problems(gpt, ref_grads)
    if any(live_after):
        problems.append(f"caches alive after segment 0 backward: {live_after}")
    return {"problems": problems, "te_calls": list(TEDotProductAttention.calls)}


class _Created(torch.overrides.TorchFunctionMode):
    """Shapes of the tensors Python code creates (a kernel's own insides are not seen: the
    handler runs each call with the mode off; ``paused`` also hides a stand-in's insides)."""

    def __init__(self):
        super().__init__()
        self.shapes, self.paused = [], 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.paused:
            for tensor in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(tensor, torch.Tensor):
                    self.shapes.append(tuple(tensor.shape))
        return out


def mask_shapes_by_hand(model: ModelSpec, data: DataSpec, lengths, backend: str) -> dict:
    """Training segments of packed documents with every tensor created outside the attention
    kernels recorded: which of them have a [queries, keys] shape of a segment (or [s, s])."""
    created = _Created()
    stand_in = TEDotProductAttention.forward

    def opaque(self, *args, **kwargs):  # Transformer Engine's kernels are not Python
        created.paused += 1
        try:
            return stand_in(self, *args, **kwargs)
        finally:
            created.paused -= 1

    TEDotProductAttention.forward = opaque  # before enable() wraps the bound forward
    gpt = _documents_model(model, backend)
    s1.enable(gpt)
    batches = make_batches(model, data)
    documents = data_documents(data, len(batches), model.seq_length)
    run = SegmentRun(lengths, documents=documents)
    k, seq = len(lengths), model.seq_length
    outputs, sizes = {}, {(seq, seq)}
    try:
        with created:
            for mb, j in _unit_order(len(batches), k, False):
                with run.forward(mb, j) as info:
                    view = run.geometry(mb, None).views[j]
                    sizes.add((info.length, view.num_keys))
                    batch = s1.slice_batch(batches[mb])
                    outputs[mb, j] = (_doc_forward(gpt, batch) * batch["loss_mask"]).sum()
            for mb, j in _unit_order(len(batches), k, False, backward=True):
                with run.backward(mb, j):
                    outputs[mb, j].backward()
        run.close()
    finally:
        TEDotProductAttention.forward = stand_in
    found = sorted({shape for shape in created.shapes
                    if any(tuple(shape[i:i + 2]) in sizes for i in range(len(shape) - 1))})
    return {"mask_shaped": found, "sizes": sorted(sizes), "created": len(created.shapes)}


def flash_thd_full_sequence(model: ModelSpec, data: DataSpec) -> dict:
    """Megatron's own path (no segments) with packed THD batches on the flash attention:
    equal to the local attention with the dense document mask."""
    reference_model = _model(model)
    ref_logits, ref_losses, ref_grads = _full_sequence(
        reference_model, make_batches(model, data, reference=True))
    gpt = _documents_model(model, "flash")
    gpt.load_state_dict(reference_model.state_dict(), strict=False)
    gpt.zero_grad(set_to_none=True)
    problems = []
    for mb, batch in enumerate(make_batches(model, data)):
        assert batch.get("cu_seqlens") is not None and batch["attention_mask"] is None
        per_token = _doc_forward(gpt, batch)
        ((per_token * batch["loss_mask"]).sum() / batch["loss_mask"].sum()).backward()
        ok, rel = _close(per_token.detach(), ref_losses[mb], RTOL)
        if not ok:
            problems.append(f"micro-batch {mb}: per-token losses max rel err {rel:.2e}")
    problems += _gradient_problems(gpt, ref_grads)
    return {"problems": problems}
