"""Variable-length micro-batches: Seq1F1B against Megatron's own schedule on the same model.

Every case builds this rank's chunks once with ``variable_seq_lengths=True``, runs
Megatron's own forward-backward function (which exchanges a shape before every message)
on micro-batches of different lengths, keeps its loss reports and every gradient, zeroes
them, runs Seq1F1B on the same micro-batches and compares (fp32, rel 1e-5). Runs inside
harness worker processes.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import schedules

import gpt
from gpt import ModelSpec

RTOL = 1e-5


def varlen_batches(spec: ModelSpec, lengths, *, documents=None, thd: bool = False,
                   micro_batch_size: int = 1, seed: int = 11) -> list[dict]:
    """One micro-batch per length: tokens, labels, a loss mask with zeros, positions; with
    ``documents`` (per micro-batch, where documents start) positions restart per document,
    and either the packed form (``thd``: cu_seqlens, max_seqlen, as Megatron-LM and
    frameworks give it) or end-of-document ids (the last vocabulary id) with the dense
    document mask Megatron's own attention needs to keep them apart."""
    gen = torch.Generator().manual_seed(seed)
    b, v = micro_batch_size, spec.vocab_size
    batches = []
    for index, s in enumerate(lengths):
        starts = documents[index] if documents else None
        tokens = torch.randint(0, v - 1 if starts is not None else v, (b, s), generator=gen)
        labels = torch.randint(0, v, (b, s), generator=gen)
        loss_mask = (torch.rand(b, s, generator=gen) > 0.25).float()
        position_ids = torch.arange(s).unsqueeze(0).expand(b, s).contiguous()
        batch = dict(tokens=tokens, labels=labels, loss_mask=loss_mask,
                     position_ids=position_ids, attention_mask=None)
        if starts is not None:
            bounds = list(starts) + [s]
            document = torch.zeros(s, dtype=torch.long)
            for number, (a, c) in enumerate(zip(bounds, bounds[1:])):
                batch["position_ids"][:, a:c] = torch.arange(c - a)
                document[a:c] = number
                if c < s and not thd:
                    batch["tokens"][:, c - 1] = v - 1
            if thd:
                batch["cu_seqlens"] = torch.tensor([bounds], dtype=torch.int32)
                batch["max_seqlen"] = torch.tensor([max(c - a for a, c in zip(bounds, bounds[1:]))])
            else:
                mask = (document.unsqueeze(0) != document.unsqueeze(1)) | torch.ones(
                    s, s, dtype=torch.bool).triu(1)
                batch["attention_mask"] = mask.expand(b, 1, s, s).contiguous()
        batches.append(batch)
    return batches


def _grads(models) -> dict:
    out = {}
    for i, model in enumerate(models):
        for name, param in model.named_parameters():
            grad = getattr(param, "main_grad", None)
            grad = param.grad if grad is None else grad
            out[(i, name)] = None if grad is None else grad.detach().clone()
    return out


def _zero(models) -> None:
    for model in models:
        model.zero_grad_buffer()
        for param in model.parameters():
            param.grad = None


def _close(actual, expected) -> tuple[bool, float]:
    scale = expected.abs().max().item()
    err = (actual - expected).abs().max().item()
    return err <= RTOL * max(scale, 1e-30), err / max(scale, 1e-30)


def run(*, spec: ModelSpec, lengths, seq1f1b: dict, pp: int = 2, vpp: int | None = None,
        tp: int = 1, sp: bool = False, cp: int = 1, ep: int = 1, documents=None,
        thd: bool = False, per_token: bool = False, forward_only: bool = False,
        config_overrides: dict | None = None, micro_batch_size: int = 1,
        megatron_seq_length: int | None = None, forward_step=gpt.forward_step,
        order: bool = False) -> dict:
    """Megatron's schedule, then Seq1F1B, on this rank's chunks; problems found here.
    ``order``: also return the order in which Seq1F1B ran this rank's (phase, micro-batch,
    segment) units (a hook on each segment's output marks its backward)."""
    import megatron_seq1f1b as s1
    from megatron_seq1f1b.segments.run import current_segment

    events = []
    if order:
        plain_step = forward_step

        def forward_step(data_iterator, model, slicer=None):
            info = current_segment()
            output, loss = plain_step(data_iterator, model, slicer=slicer)
            if info is not None and output.requires_grad:
                unit = (info.microbatch, info.index)
                events.append(("F",) + unit)
                output.register_hook(lambda grad, unit=unit: events.append(("B",) + unit))
            return output, loss

    overrides = {**dict(variable_seq_lengths=True, calculate_per_token_loss=per_token,
                        moe_token_dispatcher_type="alltoall"),  # Megatron requires it here
                 **(config_overrides or {})}  # variable_seq_lengths=False: equal lengths
    if vpp:  # Megatron's interleaved schedule on pp 2: see notes (batched p2p pairs wrongly)
        overrides.setdefault("overlap_p2p_comm", pp == 2)
        overrides.setdefault("batch_p2p_comm", pp != 2)
    longest = max(lengths)
    spec = dataclasses.replace(spec, seq_length=max(spec.seq_length, longest))
    batches = varlen_batches(spec, lengths, documents=documents, thd=thd,
                             micro_batch_size=micro_batch_size)
    m = len(lengths)

    def build(context_parallel: int):
        extra = dict(expert_model_parallel_size=ep) if ep > 1 else {}
        if context_parallel > 1:
            extra["context_parallel_size"] = context_parallel
        gpt.init_parallel(tp, pp, vpp, **extra)
        config = gpt.make_config(spec, tp=tp, pp=pp, vpp=vpp, sp=sp, **overrides, **extra)
        chunks = gpt.build_chunks(spec, config)
        s1.enable(chunks)
        return chunks, gpt.wrap_ddp(chunks, config)

    def call(fn, slicer):
        gpt.clear_moe_losses()
        iterators = [iter(batches) for _ in models]
        store = fn(forward_step_func=partial(forward_step, slicer=slicer),
                   data_iterator=iterators if len(models) > 1 else iterators[0],
                   model=models if len(models) > 1 else models[0], num_microbatches=m,
                   seq_length=megatron_seq_length or longest,
                   micro_batch_size=micro_batch_size, forward_only=forward_only)
        return store, gpt.moe_losses()

    # Megatron's own schedule runs context parallelism through Transformer Engine only: the
    # reference then runs without it (its data-parallel replicas all get these micro-batches,
    # so their mean gradient is one replica's), and the CP layout gets the same weights.
    chunks, models = build(1)
    reference, ref_moe = call(schedules.get_forward_backward_func(), None)
    expected = _grads(models)
    if cp > 1:
        weights = {(i, name): p.detach().clone() for i, chunk in enumerate(chunks)
                   for name, p in chunk.named_parameters()}
        chunks, models = build(cp)
        with torch.no_grad():
            for i, chunk in enumerate(chunks):
                for name, p in chunk.named_parameters():
                    p.copy_(weights[(i, name)])
    _zero(models)
    store, moe = call(s1.get_forward_backward_func(**seq1f1b), s1.slice_batch)
    if cp > 1 and not forward_only:  # each context-parallel rank reports its tokens' part
        for entry in store:
            torch.distributed.all_reduce(entry["lm loss"],
                                         group=parallel_state.get_context_parallel_group())
    actual = _grads(models)
    problems = []
    if not forward_only:
        for key, want in expected.items():
            got = actual[key]
            if (want is None) != (got is None):
                problems.append(f"{key}: gradient {'missing' if got is None else 'unexpected'}")
                continue
            if want is not None:
                ok, rel = _close(got, want)
                if not ok:
                    problems.append(f"{key}: max rel err {rel:.2e}")
        for name, values in ref_moe.items():
            ok, rel = _close(moe[name], values)
            if not ok:
                problems.append(f"MoE {name}: rel err {rel:.2e}")
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        if len(store) != len(reference):
            problems.append(f"{len(store)} store entries, Megatron's schedule has "
                            f"{len(reference)}")
        for index, (got, want) in enumerate(zip(store, reference)):
            for key in want:
                if got[key].shape != want[key].shape:
                    problems.append(f"micro-batch {index} report {key}: shape "
                                    f"{tuple(got[key].shape)}, Megatron's {tuple(want[key].shape)}")
                    continue
                ok, rel = _close(got[key].float(), want[key].float())
                if not ok:
                    problems.append(f"micro-batch {index} report {key}: rel err {rel:.2e}")
    return {"rank": torch.distributed.get_rank(), "problems": problems, "order": events}


# ---------------------------------------------------------------- the passes post-training runs


def logprob_loss(form: str, loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """A log-probability pass as RL trainers write it: per-token values in the report;
    ``form`` "mean": Megatron's 2-tuple (a placeholder loss), "triple": with a [sum, count]."""
    logprobs = -output_tensor.detach().float()
    if form == "mean":
        return output_tensor.float().mean(), {"logprobs": logprobs}
    loss = torch.sum(output_tensor.float() * loss_mask)
    tokens = loss_mask.sum().to(torch.int)
    pair = torch.cat([loss.detach().view(1), tokens.view(1).float()])
    return loss, tokens, {"logprobs": logprobs, "lm loss": pair}


def logprob_step(form: str, data_iterator, model, slicer=None):
    batch = next(data_iterator)
    if slicer is not None:
        batch = slicer(batch)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                   labels=batch["labels"], packed_seq_params=gpt.packed_seq_params(batch))
    return output, partial(logprob_loss, form, batch["loss_mask"])


def sequence_mean_weights(loss_mask: torch.Tensor) -> torch.Tensor:
    """GRPO-style per-sequence mean as token weights of the whole micro-batch, scaled so
    they sum to its token count: each sample's tokens share 1 / (its tokens x samples)."""
    b = loss_mask.shape[0]
    per_sample = loss_mask.sum(dim=1, keepdim=True).clamp(min=1)
    return loss_mask / per_sample / b * loss_mask.sum()


def weighted_loss(batch: dict, output_tensor: torch.Tensor):
    """The weighted token sum (sum w * loss, this part's tokens, report): split by segments
    it adds up to the micro-batch's own (docs/variable_lengths.md)."""
    loss = torch.sum(output_tensor.float() * batch["weights"])
    tokens = batch["loss_mask"].sum().to(torch.int)
    return loss, tokens, {"lm loss": torch.cat([loss.detach().view(1), tokens.view(1).float()])}


def weighted_step(data_iterator, model, slicer=None):
    batch = next(data_iterator)
    batch = dict(batch, weights=sequence_mean_weights(batch["loss_mask"]))  # the whole one
    if slicer is not None:
        batch = slicer(batch, extra_keys=("weights",))
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                   labels=batch["labels"], packed_seq_params=gpt.packed_seq_params(batch))
    return output, partial(weighted_loss, batch)


def run_step(*, step: str, form: str = "", **kwargs) -> dict:
    """:func:`run` with another forward step (``logprob`` or ``weighted``)."""
    steps = {"logprob": partial(logprob_step, form), "weighted": weighted_step}
    return run(forward_step=steps[step], **kwargs)


def run_mismatch(*, kind: str, lengths, num_splits: int = 2) -> dict:
    """Stage 1's data differs from stage 0's (``short``: one micro-batch fewer; ``length``:
    micro-batch 1 longer): every rank must raise the same line before any message."""
    import megatron_seq1f1b as s1
    from megatron_seq1f1b.base.checks import ConfigError

    spec = ModelSpec(seq_length=max(lengths) + 8)
    gpt.init_parallel(1, 2)
    config = gpt.make_config(spec, pp=2, variable_seq_lengths=True,
                             moe_token_dispatcher_type="alltoall")
    chunks = gpt.build_chunks(spec, config)
    s1.enable(chunks)
    models = gpt.wrap_ddp(chunks, config)
    mine = list(lengths)
    stage = parallel_state.get_pipeline_model_parallel_rank()
    if stage == 1 and kind == "length":
        mine[1] += 8
    batches = varlen_batches(spec, mine)
    if stage == 1 and kind == "short":
        batches = batches[:-1]
    try:
        s1.get_forward_backward_func(num_splits)(
            forward_step_func=partial(gpt.forward_step, slicer=s1.slice_batch),
            data_iterator=iter(batches), model=models[0], num_microbatches=len(lengths),
            seq_length=max(lengths), micro_batch_size=1)
    except ConfigError as exc:
        return {"rank": torch.distributed.get_rank(), "error": exc.problems}
    return {"rank": torch.distributed.get_rank(), "error": None}


def run_auto(*, lengths, spec: ModelSpec = ModelSpec(seq_length=64)) -> dict:
    """``--seq1f1b-splits auto`` with variable lengths: it plans on its first call (the same
    plan on every rank), runs exactly (against Megatron's schedule on the same micro-batches)
    and leaves the iterator where training would have left it."""
    import megatron_seq1f1b as s1
    from megatron_seq1f1b.planner.auto import auto_forward_backward_func

    gpt.init_parallel(1, 2)
    config = gpt.make_config(spec, pp=2, variable_seq_lengths=True,
                             moe_token_dispatcher_type="alltoall")
    chunks = gpt.build_chunks(spec, config)
    s1.enable(chunks)
    models = gpt.wrap_ddp(chunks, config)
    batches = varlen_batches(spec, lengths)
    m = len(lengths) // 2

    def call(fn, iterator, slicer):
        return fn(forward_step_func=partial(gpt.forward_step, slicer=slicer),
                  data_iterator=iterator, model=models[0], num_microbatches=m,
                  seq_length=max(lengths), micro_batch_size=1)

    reference = call(schedules.get_forward_backward_func(), iter(batches[:m]), None)
    expected = _grads(models)
    _zero(models)
    auto = auto_forward_backward_func(log=lambda text: None)
    iterator = iter(batches)
    store = call(auto, iterator, s1.slice_batch)
    actual = _grads(models)
    problems = [f"{key}: max rel err {_close(actual[key], want)[1]:.2e}"
                for key, want in expected.items()
                if want is not None and not _close(actual[key], want)[0]]
    left = len(list(iterator))
    if left != len(lengths) - m:
        problems.append(f"{left} micro-batches left in the iterator, expected {len(lengths) - m}")
    if parallel_state.is_pipeline_last_stage():
        for index, (got, want) in enumerate(zip(store, reference)):
            if not _close(got["lm loss"], want["lm loss"])[0]:
                problems.append(f"micro-batch {index}: report differs")
    choice = auto.choice
    return {"rank": torch.distributed.get_rank(), "problems": problems,
            "plan": (choice.name, choice.num_splits, choice.segment_tokens)}


# ---------------------------------------------------------------- the drop-in path, as called


def framework_batches(spec: ModelSpec, lengths, documents) -> list[dict]:
    """Packed micro-batches as a post-training framework holds them: ``[1, T]`` token rows,
    its own 1-D int32 ``cu_seqlens`` of the sequences packed into the micro-batch and an int
    ``max_seqlen``; no attention mask."""
    batches = []
    for batch in varlen_batches(spec, lengths, documents=documents, thd=True):
        batch = {key: value for key, value in batch.items() if key != "attention_mask"}
        batch["cu_seqlens"] = batch["cu_seqlens"].reshape(-1)
        batch["max_seqlen"] = int(batch["max_seqlen"].item())
        batches.append(batch)
    return batches


def framework_step(data_iterator, model):
    """A post-training framework's forward step: its micro-batch (cut to the segment by
    ``slice_batch``, the identity under Megatron's schedule), ``PackedSeqParams`` built from
    its own ``cu_seqlens``, a loss per token (``calculate_per_token_loss``: the sum and the
    token count; Megatron divides by the iteration's tokens)."""
    import megatron_seq1f1b as s1
    from megatron.core.packed_seq_params import PackedSeqParams

    batch = s1.slice_batch(next(data_iterator))
    cu = batch["cu_seqlens"]
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=batch["max_seqlen"], max_seqlen_kv=batch["max_seqlen"])
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                   packed_seq_params=packed)
    mask = batch["loss_mask"]

    def loss_func(output_tensor):
        loss = torch.sum(output_tensor.float().view(-1) * mask.view(-1))
        tokens = mask.sum().to(torch.int)
        return loss, tokens, {"lm loss": torch.stack([loss.detach(), tokens.float().detach()])}

    return output, loss_func


def run_framework(*, via: str, lengths, documents, seq1f1b: dict,
                  spec: ModelSpec = ModelSpec(seq_length=32, attention="flash")) -> dict:
    """Megatron's getter on the framework's micro-batches, then Seq1F1B as the framework
    reaches it: ``install(...)`` and Megatron's getter again (``via="install"``), or the
    function ``get_forward_backward_func`` returns (``via="function"``); loss reports and
    every gradient compared."""
    import megatron.core.pipeline_parallel as pipeline_parallel

    import megatron_seq1f1b as s1

    spec = dataclasses.replace(spec, seq_length=max(spec.seq_length, max(lengths)))
    gpt.init_parallel(1, 2)
    config = gpt.make_config(spec, pp=2, variable_seq_lengths=True, calculate_per_token_loss=True,
                             moe_token_dispatcher_type="alltoall")
    chunks = gpt.build_chunks(spec, config)
    s1.enable(chunks)
    (model,) = gpt.wrap_ddp(chunks, config)
    batches = framework_batches(spec, lengths, documents)

    def call(forward_backward):
        return forward_backward(forward_step_func=framework_step, data_iterator=iter(batches),
                                model=model, num_microbatches=len(batches),
                                seq_length=max(lengths), micro_batch_size=1)

    megatron = pipeline_parallel.get_forward_backward_func()  # what the framework calls
    reference = call(megatron)
    expected = _grads([model])
    _zero([model])
    problems = []
    if via == "install":
        installed = s1.install(**seq1f1b)
        try:
            got = pipeline_parallel.get_forward_backward_func()
            if got is not installed:
                problems.append(f"Megatron's getter returned {got!r} after install()")
            store = call(got)
        finally:
            s1.uninstall()
        if pipeline_parallel.get_forward_backward_func() is not megatron:
            problems.append("uninstall() left Seq1F1B's function in Megatron's getter")
    else:
        store = call(s1.get_forward_backward_func(**seq1f1b))
    for key, want in expected.items():
        got = _grads([model])[key]
        if (want is None) != (got is None):
            problems.append(f"{key}: gradient {'missing' if got is None else 'unexpected'}")
        elif want is not None:
            ok, rel = _close(got, want)
            if not ok:
                problems.append(f"{key}: max rel err {rel:.2e}")
    if parallel_state.is_pipeline_last_stage():
        if len(store) != len(reference):
            problems.append(f"{len(store)} store entries, Megatron's schedule has "
                            f"{len(reference)}")
        for index, (got, want) in enumerate(zip(store, reference)):
            ok, rel = _close(got["lm loss"], want["lm loss"])
            if not ok:
                problems.append(f"micro-batch {index} lm loss: rel err {rel:.2e}")
    return {"rank": torch.distributed.get_rank(), "problems": problems}


def budget_rounding() -> dict:
    """What a budget's cut rounds to on CUDA: the count the budget gives (2 segments of 2048
    tokens round to 64), not its cap (64 segments would not)."""
    from unittest import mock

    from megatron_seq1f1b.runtime.executor_setup import process_groups, stage_facts

    spec = ModelSpec(seq_length=2048)
    gpt.init_parallel(1, 1)
    config = gpt.make_config(spec)
    chunks = gpt.build_chunks(spec, config)
    _, groups = process_groups(config, None, None)
    out = {}
    for name, tokens in (("budget", 1024), ("cap", None)):
        with mock.patch("torch.cuda.is_available", return_value=True):
            facts = stage_facts(chunks, config, groups, num_microbatches=2, seq_length=2048,
                                micro_batch_size=1, forward_only=False, num_splits=64,
                                partition="uniform", split_lengths=None, schedule="1f1b",
                                segment_costs=None, adjust_tensor_shapes_fn=None,
                                segment_tokens=tokens)
        out[name] = facts.multiple
    return out
