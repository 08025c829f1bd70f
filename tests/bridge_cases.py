"""Hugging Face models converted by Megatron-Bridge, under Seq1F1B (run in harness workers).

The oracle: a tiny random Hugging Face model (every weight random, norms included, so a weight
the conversion missed shows), saved locally and converted by ``AutoBridge``. Its logits equal
Megatron's; then Seq1F1B's loss, every gradient, Bridge's ``train_step`` losses and the weights
exported back to Hugging Face after optimizer steps equal Megatron's own schedule on the same
converted model, both driven through Bridge's own code (its ``get_batch``, loss, ``train_step``
and the getter its ``train`` / ``eval`` modules hold).
"""

from __future__ import annotations

import dataclasses
import tempfile
import types
from functools import partial

import torch

import bridge_env
from gpt import RTOL, init_parallel

SEED = 1234
VOCAB, SEQ, HIDDEN = 96, 32, 64


@dataclasses.dataclass(frozen=True)
class Case:
    family: str = "llama"          # "llama" (GQA, RoPE) or "qwen3" (GQA, RoPE, q/k norms)
    pp: int = 1
    num_splits: int = 4
    partition: str = "balanced"    # or "documents" (packed batches, Bridge's keys)
    packed_form: str = ""          # "legacy" (cu_seqlens, -1 padding, argmin) or "current"
    num_microbatches: int = 4
    # in-batch packing: micro-batches of these lengths (variable_seq_lengths), two documents
    # each, Seq1F1B with this token budget per segment
    lengths: tuple = ()
    segment_tokens: int | None = None


def _families():
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    return {"llama": (LlamaConfig, LlamaForCausalLM, {}),
            "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 16})}


def hf_model(family: str):
    """A tiny random HF causal LM (GQA: 4 heads, 2 key/value groups; 2 layers), and where it is
    saved. Every parameter is random, norms and all, so a missed mapping changes the logits."""
    config_class, model_class, extra = _families()[family]
    config = config_class(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=2 * SEQ, tie_word_embeddings=False,
                          rope_theta=10000.0, **extra)
    generator = torch.Generator().manual_seed(SEED)
    model = model_class(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.5 * torch.rand(param.shape, generator=generator))
            else:
                param.copy_(0.05 * torch.randn(param.shape, generator=generator))
    path = tempfile.mkdtemp(prefix=f"seq1f1b-hf-{family}-")
    model.save_pretrained(path)
    return model, path


def converted(path: str, pp: int, attention: str = "local", wrap_with_ddp: bool = True,
              variable: bool = False):
    """AutoBridge's provider for the saved model, made buildable on CPU (fp32, the local layer
    spec or the project's flash one, no fusions); returns (bridge, model chunks)."""
    from megatron.bridge import AutoBridge
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_seq1f1b.attention.flash import flash_layer_spec

    bridge = AutoBridge.from_hf_pretrained(path, dtype=torch.float32)
    provider = bridge.to_megatron_provider(load_weights=True)
    spec = get_gpt_layer_local_spec(normalization=provider.normalization,
                                    qk_layernorm=bool(getattr(provider, "qk_layernorm", False)))
    provider.apply_overrides_and_finalize(dtype=torch.float32, overrides=dict(
        transformer_layer_spec=flash_layer_spec(spec) if attention == "flash" else spec,
        pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32, seq_length=SEQ,
        masked_softmax_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        cross_entropy_loss_fusion=False, attention_dropout=0.0, hidden_dropout=0.0,
        deallocate_pipeline_outputs=True,
        # in-batch packing: Megatron's flag, as Bridge sets it with pipeline parallelism
        **(dict(variable_seq_lengths=True, moe_token_dispatcher_type="alltoall")
           if variable and pp > 1 else {})))
    if variable:
        provider._enable_in_batch_packing = True  # what Bridge's ConfigContainer sets
    ddp = DistributedDataParallelConfig() if wrap_with_ddp else None
    model = provider.provide_distributed_model(ddp_config=ddp, wrap_with_ddp=wrap_with_ddp,
                                               use_cpu_initialization=True)
    return bridge, model


# ---------------------------------------------------------------- Bridge's state and batches


def bridge_state(num_microbatches: int):
    """What Bridge's forward step and train_step read of its GlobalState, as plain objects:
    configuration (defaults of Bridge's fields), timers (none logged), no straggler detection."""
    from megatron.core.timers import Timers
    from megatron.core.utils import StragglerDetector

    cfg = types.SimpleNamespace(
        model=types.SimpleNamespace(seq_length=SEQ, virtual_pipeline_model_parallel_size=None,
                                    qk_clip=False),
        dataset=types.SimpleNamespace(skip_getting_attention_mask_from_dataset=True,
                                      dataloader_type="single"),
        rerun_state_machine=types.SimpleNamespace(check_for_nan_in_loss=True,
                                                  check_for_spiky_loss=False),
        train=types.SimpleNamespace(micro_batch_size=1, empty_unused_memory_level=0,
                                    check_optimizer_step_success=True,
                                    skip_sync_grad_norm_across_mp=False),
        optimizer=types.SimpleNamespace(barrier_with_L1_time=False, log_num_zeros_in_grad=False,
                                        reuse_grad_buf_for_mxfp8_param_ag=False),
        ddp=types.SimpleNamespace(overlap_param_gather=False),
        dist=types.SimpleNamespace(use_decentralized_pg=False),
        data_parallel_size=1)
    return types.SimpleNamespace(cfg=cfg, timers=Timers(0, "minmax"),
                                 straggler_timer=StragglerDetector())


DOCUMENTS = ((0, 5, 20), (0, 3, 11, 12, 27), (0, 8, 16, 24), (0, 30))


def bridge_batches(case: Case, iteration: int = 0) -> list[dict]:
    """Micro-batches as Bridge's data loaders give them (host tensors, one sample each); packed
    ones with Bridge's metadata in the case's form, position ids restarting per document."""
    generator = torch.Generator().manual_seed(SEED + 101 * iteration)
    batches = []
    for index in range(case.num_microbatches):
        n = case.lengths[index] if case.lengths else SEQ
        tokens = torch.randint(0, VOCAB, (1, n), generator=generator)
        batch = dict(tokens=tokens, labels=torch.randint(0, VOCAB, (1, n), generator=generator),
                     loss_mask=(torch.rand(1, n, generator=generator) > 0.25).float(),
                     position_ids=torch.arange(n).unsqueeze(0), attention_mask=None)
        if case.partition == "documents":
            starts = (0, n // 3) if case.lengths else DOCUMENTS[index % len(DOCUMENTS)]
            cu = list(starts) + [n]
            positions = torch.cat([torch.arange(b - a) for a, b in zip(cu, cu[1:])])
            batch["position_ids"] = positions.unsqueeze(0)
            longest = max(b - a for a, b in zip(cu, cu[1:]))
            if case.packed_form == "legacy":
                batch["cu_seqlens"] = torch.tensor([cu + [-1, -1]], dtype=torch.int32)
                batch["cu_seqlens_argmin"] = torch.tensor(len(cu))
                batch["max_seqlen"] = torch.tensor(longest)
            else:
                batch["cu_seqlens_q"] = batch["cu_seqlens_kv"] = torch.tensor(cu, dtype=torch.int32)
                batch["max_seqlen_q"] = batch["max_seqlen_kv"] = torch.tensor(longest)
        batches.append(batch)
    return batches


# ---------------------------------------------------------------- cases


def _setup(pp: int):
    bridge_env.load_loop()
    init_parallel(pp=pp)


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()


def logits_equal_hf(family: str) -> dict:
    """HF's logits and loss against the converted Megatron model's, one rank."""
    _setup(1)
    hf, path = hf_model(family)
    _, (model,) = converted(path, pp=1, wrap_with_ddp=False)
    generator = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=generator)
    labels = torch.randint(0, VOCAB, (2, SEQ), generator=generator)
    with torch.no_grad():
        expected = hf(tokens).logits
        actual = model(tokens, torch.arange(SEQ).expand(2, SEQ), None)
        losses = model(tokens, torch.arange(SEQ).expand(2, SEQ), None, labels=labels)
    hf_losses = torch.nn.functional.cross_entropy(expected.reshape(-1, VOCAB), labels.reshape(-1),
                                                  reduction="none").view(2, SEQ)
    names = [name for name, _ in model.named_parameters()]
    return dict(logits=_relative(actual, expected), loss=_relative(losses, hf_losses),
                names=names)


def _megatron_run(case, path, batches, state, loop):
    """Megatron's own schedule (its getter) with Bridge's own forward step."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    attention = "flash" if case.partition == "documents" else "local"
    bridge, model = converted(path, case.pp, attention, variable=bool(case.lengths))
    return bridge, model, get_forward_backward_func(), partial(loop.gpt_step.forward_step, state)


def _seq1f1b_run(case, path, batches, state, loop, callback):
    """Seq1F1B through the callback, fired by Bridge's callback manager as ``setup()`` fires it,
    and the function Bridge's training module's getter now answers."""
    from megatron_seq1f1b import bridge as s1b

    attention = "flash" if case.partition == "documents" else "local"
    bridge, model = converted(path, case.pp, attention, variable=bool(case.lengths))
    manager = loop.callbacks.CallbackManager()
    manager.add([callback])
    manager.fire("on_data_init_start", loop.callbacks.CallbackContext(
        state=state, model=model, user_state=manager.user_state))
    function = loop.train.get_forward_backward_func(pp_size=case.pp, vp_size=None)
    return bridge, model, function, partial(s1b.forward_step, state)


def _callback(case):
    from megatron_seq1f1b import bridge as s1b

    documents = "packed" if case.partition == "documents" else None
    return s1b.Seq1F1B(case.num_splits, case.partition, documents=documents,
                       segment_tokens=case.segment_tokens)


def _grads(model) -> dict:
    from gpt import unwrap

    return {name: param.main_grad.detach().clone()
            for chunk in model for name, param in unwrap(chunk).named_parameters()}


def gradients_equal_megatron(spec: Case) -> dict:
    """One forward-backward: loss reports and every gradient, Seq1F1B vs Megatron's schedule."""
    case = spec
    loop = bridge_env.load_loop()
    _setup(case.pp)
    _, path = hf_model(case.family)
    outcomes, flops = [], []
    callback = _callback(case)
    try:
        for runner in (_megatron_run, partial(_seq1f1b_run, callback=callback)):
            state = bridge_state(case.num_microbatches)
            batches = bridge_batches(case)
            _, model, function, step = runner(case, path, batches, state, loop)
            store = function(forward_step_func=step, data_iterator=iter(batches), model=model,
                             num_microbatches=case.num_microbatches,
                             seq_length=max(case.lengths or (SEQ,)), micro_batch_size=1)
            reports = torch.stack([entry["lm loss"] for entry in store]) if store else None
            outcomes.append((reports, _grads(model)))
            flops.append(tuple(getattr(state, key, None)
                               for key in ("_flops_seqlen_sum", "_flops_seqlen_sq_sum")))
    finally:
        callback.uninstall()
    (ref_reports, ref_grads), (reports, grads) = outcomes
    problems = []
    if ref_reports is not None:
        if reports is None:
            problems.append("no loss reports under Seq1F1B")
        else:
            per_mb = reports.view(case.num_microbatches, -1, 2).sum(dim=1)
            if _relative(per_mb, ref_reports) > RTOL:
                problems.append(f"loss reports: rel {_relative(per_mb, ref_reports):.2e}")
    for name, expected in ref_grads.items():
        rel = _relative(grads[name], expected)
        if not rel <= RTOL:
            problems.append(f"{name}: rel {rel:.2e}")
    if not any(g.abs().max() > 0 for g in ref_grads.values()):
        problems.append("the reference has no gradient")
    flops = [tuple(None if value is None else float(value) for value in pair) for pair in flops]
    if case.partition == "documents":  # the documents matter: without them, other gradients
        state = bridge_state(case.num_microbatches)
        whole = [{key: value for key, value in batch.items()
                  if not key.startswith(("cu_seqlens", "max_seqlen"))}
                 for batch in bridge_batches(case)]
        _, model, function, step = _megatron_run(case, path, whole, state, loop)
        function(forward_step_func=step, data_iterator=iter(whole), model=model,
                 num_microbatches=case.num_microbatches,
                 seq_length=max(case.lengths or (SEQ,)), micro_batch_size=1)
        if all(_relative(g, ref_grads[n]) <= 1e-3 for n, g in _grads(model).items()):
            problems.append("the packed documents changed no gradient: the test cannot tell")
    if flops[0] != flops[1]:
        problems.append(f"FLOPs tokens counted {flops[1]}, Bridge's own step {flops[0]}")
    worst = max(_relative(grads[name], expected) for name, expected in ref_grads.items())
    return dict(problems=problems, entries=0 if reports is None else len(reports),
                worst_gradient=worst, flops=flops)


def _optimizer(model):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    # adam_eps=1: updates nearly linear in the gradient, so fp32 rounding differences between
    # schedules are not blown up to +-lr where a gradient element is ~0 (tests/pipeline_cases.py)
    config = OptimizerConfig(optimizer="adam", lr=0.1, weight_decay=0.0, clip_grad=0.0,
                             adam_eps=1.0, bf16=False, fp16=False)
    return get_megatron_optimizer(config, model, use_gloo_process_groups=False)


def _as_bridge_setup_leaves_it(model, optimizer) -> None:
    """The model config's hooks that Bridge's ``setup()`` installs (``_update_model_config_funcs``)
    and the schedules call: gradient finalization, no_sync, the loss scale."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.utils import get_model_config

    config = get_model_config(model[0])
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = model[0].no_sync
    config.grad_scale_func = optimizer.scale_loss


def train_steps_and_export(spec: Case, iterations: int = 2) -> dict:
    """Bridge's own ``train_step`` for a few iterations with the function its ``train`` module's
    getter answers: Seq1F1B (callback fired) vs Megatron's schedule (no callback). Losses,
    weights exported back to HF after the optimizer steps, and one forward-only evaluation
    through the getter Bridge's ``eval`` module holds."""
    from megatron.core.num_microbatches_calculator import (
        destroy_num_microbatches_calculator, init_num_microbatches_calculator,
    )
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.utils import get_model_config

    from megatron_seq1f1b import bridge as s1b

    case = spec
    loop = bridge_env.load_loop()
    _setup(case.pp)
    original, path = hf_model(case.family)
    callback = _callback(case)
    attention = "flash" if case.partition == "documents" else "local"
    outcomes = []
    try:
        for seq1f1b in (False, True):
            destroy_num_microbatches_calculator()
            init_num_microbatches_calculator(torch.distributed.get_rank(), None,
                                             case.num_microbatches, 1, 1)
            state = bridge_state(case.num_microbatches)
            bridge, model = converted(path, case.pp, attention)
            step = loop.gpt_step.forward_step
            if seq1f1b:
                manager = loop.callbacks.CallbackManager()
                manager.add([callback])
                manager.fire("on_data_init_start", loop.callbacks.CallbackContext(
                    state=state, model=model, user_state=manager.user_state))
                step = s1b.forward_step
            function = loop.train.get_forward_backward_func(pp_size=case.pp, vp_size=None)
            optimizer = _optimizer(model)
            _as_bridge_setup_leaves_it(model, optimizer)
            groups = ProcessGroupCollection.use_mpu_process_groups()
            p2p = P2PCommunicator(pp_group=groups.pp, config=get_model_config(model[0]))
            scheduler = types.SimpleNamespace(step=lambda increment: None)  # constant learning rate
            losses = []
            for iteration in range(iterations):
                batches = bridge_batches(case, iteration)
                result = loop.train.train_step(partial(step, state), iter(batches), model,
                                               optimizer, scheduler, state, groups, function, p2p)
                losses.append(result[0].get("lm loss"))
            evaluate = loop.eval.get_forward_backward_func(pp_size=case.pp, vp_size=None)
            batches = bridge_batches(case, iterations)
            store = evaluate(forward_step_func=partial(step, state), data_iterator=iter(batches),
                             model=model, num_microbatches=case.num_microbatches,
                             seq_length=SEQ, micro_batch_size=1, forward_only=True)
            evaluated = (torch.stack([e["lm loss"] for e in store]).sum(dim=0) if store else None)
            exported = {name: tensor.detach().clone()
                        for name, tensor in bridge.export_hf_weights(model, cpu=True)}
            outcomes.append(dict(losses=losses, exported=exported, evaluated=evaluated,
                                 function=function, evaluate=evaluate))
    finally:
        callback.uninstall()
        destroy_num_microbatches_calculator()
    reference, ours = outcomes
    problems = []
    if ours["function"] is not callback.function or ours["evaluate"] is not callback.function:
        problems.append("Bridge's train/eval getters did not answer Seq1F1B's function")
    if reference["function"] is callback.function:
        problems.append("the reference ran Seq1F1B's function")
    for index, (expected, actual) in enumerate(zip(reference["losses"], ours["losses"])):
        if (expected is None) != (actual is None) or (
                expected is not None and _relative(actual.view(1), expected.view(1)) > RTOL):
            problems.append(f"iteration {index}: loss {actual} != Megatron's schedule {expected}")
    if reference["evaluated"] is not None and _relative(
            ours["evaluated"], reference["evaluated"]) > RTOL:
        problems.append(f"evaluation {ours['evaluated']} != {reference['evaluated']}")
    if set(reference["exported"]) != set(ours["exported"]):
        problems.append("exported names differ")
    hf_state = original.state_dict()
    moved = 0.0
    for name, expected in reference["exported"].items():
        rel = _relative(ours["exported"][name], expected)
        if not rel <= RTOL:
            problems.append(f"exported {name}: rel {rel:.2e}")
        if name in hf_state:
            moved = max(moved, (expected - hf_state[name]).abs().max().item())
    if moved < 1e-4:
        problems.append(f"the optimizer steps moved no exported weight (max change {moved:.1e})")
    losses = [None if loss is None else float(loss) for loss in ours["losses"]]
    return dict(problems=problems, losses=losses, exported=len(ours["exported"]), moved=moved)


def refusals() -> list[str]:
    """What the callback refuses, by name, before it touches the model or Bridge's modules;
    Bridge's packed keys read as documents. Returns the problems found (empty: as documented)."""
    from megatron.core.transformer import TransformerConfig

    from megatron_seq1f1b import bridge as s1b
    from megatron_seq1f1b.base.checks import ConfigError

    loop = bridge_env.load_loop()
    problems = []

    def refused(make, *words) -> None:
        try:
            make()
        except ConfigError as error:
            missing = [word for word in words if word not in str(error)]
            if missing:
                problems.append(f"refusal without {missing}: {error}")
            return
        problems.append(f"not refused: {words}")

    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, pipeline_dtype=torch.float32)
    in_batch = TransformerConfig(**base)
    in_batch._enable_in_batch_packing = True  # what Bridge's ConfigContainer sets
    cfg = bridge_state(1).cfg
    holders = [module.get_forward_backward_func for module in (loop.train, loop.eval)]
    overlap = TransformerConfig(**base)
    overlap.overlap_moe_expert_parallel_comm = True
    model = [types.SimpleNamespace(config=overlap)]
    callback = s1b.Seq1F1B(4, "uniform")
    context = loop.callbacks.CallbackContext(state=types.SimpleNamespace(cfg=cfg), model=model)
    refused(lambda: callback.on_data_init_start(context), "overlap_moe_expert_parallel_comm")
    if [m.get_forward_backward_func for m in (loop.train, loop.eval)] != holders:
        problems.append("a refused callback replaced Bridge's getters")
    if not s1b.variable_lengths(in_batch):
        problems.append("in-batch packing not read as variable-length micro-batches")
    refused(lambda: s1b.Seq1F1B(0), "num_splits")
    refused(lambda: s1b.Seq1F1B(4, "documents"), "documents")
    refused(lambda: s1b.Seq1F1B(4, segment_tokens=0), "segment_tokens")
    refused(lambda: s1b.Seq1F1B(1, segment_tokens=16), "num_splits=1")
    refused(lambda: s1b.Seq1F1B(4, backward_by_documents=True), "backward_by_documents")
    if not s1b.Seq1F1B(4, documents="packed", backward_by_documents=True).function \
            .backward_by_documents:
        problems.append("backward_by_documents not passed to the forward-backward function")
    full_graphs = types.SimpleNamespace(**vars(cfg))
    full_graphs.model = types.SimpleNamespace(cuda_graph_impl="full_iteration")
    if not any("full_iteration" in p for p in s1b.bridge_problems(full_graphs, in_batch)):
        problems.append("full-iteration CUDA graphs not refused")

    legacy = dict(cu_seqlens=torch.tensor([[0, 5, 20, 32, -1, -1]]),
                  cu_seqlens_argmin=torch.tensor(4))
    current = dict(cu_seqlens_q=torch.tensor([0, 5, 20, 32]))
    short = dict(cu_seqlens=torch.tensor([[0, 5, 20, -1]]))  # padding after the last document
    for batch, starts in ((legacy, (0, 5, 20)), (current, (0, 5, 20)), (short, (0, 5, 20))):
        found = s1b.packed_documents(batch, 32).starts
        if found != (starts,):
            problems.append(f"packed_documents({batch}) = {found}, expected {(starts,)}")
    padded = dict(cu_seqlens_q=torch.tensor([0, 5, 20, 30]),
                  cu_seqlens_q_padded=torch.tensor([0, 8, 24, 32]))
    refused(lambda: s1b.packed_documents(padded, 32), "padded")
    return problems
