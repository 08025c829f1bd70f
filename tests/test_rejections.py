"""Every configuration Seq1F1B rejects, walked from the table in docs/rejections.md.

Why: that table is what a user reads when a run refuses to start, so it must
be complete and true. Each row has a case id, and TRIGGERS below provoke each
case. The tests check that the ids match both ways (no untested row, no
undocumented rejection), that every trigger is rejected with a message that
holds the row's fragment and names its flag, and that the library's
rejections come within 2 s and before any point-to-point message: they run on
two gloo ranks with torch.distributed's send/receive functions counted.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import itertools
import re
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch
import torch.distributed as dist

import megatron_seq1f1b as s1
from megatron_seq1f1b import megatron_lm
from megatron_seq1f1b.trainer import arguments

DOC = Path(__file__).resolve().parents[1] / "docs" / "rejections.md"
HEADER = "| Case | Flag | Checked by | The message says | Fix |"


@dataclasses.dataclass(frozen=True)
class Row:
    case: str
    flag: str
    checked_by: str
    fragment: str


def _code(cell: str) -> str:
    """The text of the cell's first `code` span."""
    found = re.match(r"`([^`]+)`", cell)
    assert found, f"{DOC.name}: expected `code` in {cell!r}"
    return found.group(1)


def read_table(path: Path = DOC) -> dict[str, Row]:
    lines = path.read_text().splitlines()
    body = itertools.takewhile(lambda line: line.startswith("|"), lines[lines.index(HEADER) + 2:])
    rows: dict[str, Row] = {}
    for line in body:
        case, flag, checked_by, fragment, _fix = (c.strip() for c in line.strip("|").split("|"))
        row = Row(_code(case), _code(flag), _code(checked_by), _code(fragment))
        assert row.case not in rows, f"{DOC.name}: case {row.case} twice"
        rows[row.case] = row
    return rows


ROWS = read_table()


@contextlib.contextmanager
def _changed(obj: Any, **values: Any) -> Iterator[None]:
    """Set attributes for the duration (a config option, a submodule, even __class__)."""
    missing = object()
    saved = {name: getattr(obj, name, missing) for name in values}
    for name, value in values.items():
        setattr(obj, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is missing:
                delattr(obj, name)
            else:
                setattr(obj, name, value)


# ------------------------------------------------------------------ triggers run in this process

LocalTrigger = Callable[[], object]


API: dict[str, LocalTrigger] = {
    "api-num-splits": lambda: s1.get_forward_backward_func(-1),
    "api-partition": lambda: s1.get_forward_backward_func(2, "random"),
    "api-partition-measured": lambda: s1.get_forward_backward_func(2, "measured"),
    "api-schedule": lambda: s1.get_forward_backward_func(2, schedule="zb-h3"),
    "api-split-lengths-count": lambda: s1.get_forward_backward_func(2, split_lengths=[1, 2, 3]),
    "api-segment-multiple": lambda: s1.get_forward_backward_func(2, segment_multiple=0),
    "api-segment-tokens": lambda: s1.get_forward_backward_func(2, segment_tokens=0),
    "api-segment-tokens-one-split": lambda: s1.get_forward_backward_func(1, segment_tokens=8),
    "api-backward-by-documents-without-documents": lambda: s1.get_forward_backward_func(
        2, backward_by_documents=True),
}

# Megatron-LM's arguments as its validate_args leaves them: GPT, TP 2 with sequence parallelism.
LM_VALID = dict(
    seq1f1b=True, seq1f1b_splits=4, seq1f1b_partition="balanced", seq1f1b_schedule="1f1b",
    seq_length=4096, tensor_model_parallel_size=2, sequence_parallel=True,
    virtual_pipeline_model_parallel_size=None, position_embedding_type="rope",
    transformer_impl="local",
)


#: Packed batches, documents the schedule reads (what backward_by_documents needs)
_LM_PACKED = dict(sft=True, micro_batch_size=1, apply_rope_fusion=False)


def _lm(**flags: Any) -> LocalTrigger:
    """What the patched validate_args runs: raise_if(args_problems(args))."""
    return lambda: megatron_lm.validate_args(argparse.Namespace(**{**LM_VALID, **flags}))


MEGATRON_LM: dict[str, LocalTrigger] = {
    "lm-splits-not-positive": _lm(seq1f1b_splits=-1),
    "lm-memory-budget-without-auto": _lm(seq1f1b_memory_budget=2.0),
    "lm-memory-budget-microbatches-positive": _lm(seq1f1b_splits="auto",
                                                  seq1f1b_memory_budget_microbatches=0.0),
    "lm-partition-unknown": _lm(seq1f1b_partition="random"),
    "lm-partition-measured": _lm(seq1f1b_partition="measured"),
    "lm-schedule-unknown": _lm(seq1f1b_schedule="zb-h3"),
    "lm-zb-h2-interleaved": _lm(seq1f1b_schedule="zb-h2", virtual_pipeline_model_parallel_size=2),
    "lm-zero-bubble-transformer-engine": _lm(seq1f1b_schedule="zb-h1",
                                             transformer_impl="transformer_engine"),
    "lm-context-parallel-transformer-engine": _lm(context_parallel_size=2,
                                                  transformer_impl="transformer_engine"),
    "lm-context-parallel-comm-type": _lm(context_parallel_size=2, cp_comm_type=["a2a"]),
    "lm-context-parallel-packed": _lm(context_parallel_size=2, sft=True, micro_batch_size=1),
    "lm-context-parallel-mla": _lm(context_parallel_size=2, multi_latent_attention=True),
    "lm-hybrid-context-parallel": _lm(hybrid_context_parallel=True),
    "lm-rl-sequence-packing": _lm(rl_use_sequence_packing=True),
    "lm-packed-micro-batch-size": _lm(sft=True, micro_batch_size=2),
    "lm-packed-rope-fusion": _lm(dataloader_inter_document_masking=True, apply_rope_fusion=True),
    "lm-packed-mla-yarn": _lm(sft=True, multi_latent_attention=True),
    "lm-partition-documents-without-documents": _lm(seq1f1b_partition="documents"),
    "lm-reset-attention-mask-transformer-engine": _lm(reset_attention_mask=True,
                                                      transformer_impl="transformer_engine"),
    "lm-decoder-seq-length": _lm(decoder_seq_length=2048),
    "lm-legacy-models": _lm(use_legacy_models=True),
    "lm-moe-capacity-factor": _lm(num_experts=8, moe_expert_capacity_factor=1.0),
    "lm-moe-rank-capacity": _lm(num_experts=8, moe_expert_rank_capacity_factor=1.5),
    "lm-moe-recompute": _lm(num_experts=8, moe_aux_loss_coeff=1e-2, recompute_granularity="full"),
    "lm-overlap-moe-comm": _lm(overlap_moe_expert_parallel_comm=True),
    "lm-mtp-context-parallel": _lm(mtp_num_layers=1, context_parallel_size=2),
    "lm-mtp-repeated-layer": _lm(mtp_num_layers=2, mtp_use_repeated_layer=True),
    "lm-mla-yarn-rope-fusion": _lm(multi_latent_attention=True, apply_rope_fusion=True),
    "lm-mla-down-proj-fusion": _lm(multi_latent_attention=True, mla_down_proj_fusion=True),
    "lm-experimental-attention": _lm(experimental_attention_variant="gated_delta_net"),
    "lm-window-size": _lm(window_size=(128, 4)),
    "lm-position-embedding": _lm(position_embedding_type="yarn"),
    "lm-cuda-graph-impl": _lm(cuda_graph_impl="local"),
    "lm-enable-cuda-graph": _lm(enable_cuda_graph=True),
    "lm-external-cuda-graph": _lm(external_cuda_graph=True),
    "lm-activation-offloading": _lm(fine_grained_activation_offloading=True),
    "lm-overlap-p2p-without-vpp": _lm(overlap_p2p_comm=True),
    "lm-tp-comm-overlap": _lm(tp_comm_overlap=True),
    "lm-fp8-dot-product-attention": _lm(fp8_dot_product_attention=True),
    "lm-fp8-multi-head-attention": _lm(fp8_multi_head_attention=True),
    "lm-flash-dataloader-mask": _lm(attention_backend="flash",
                                    create_attention_mask_in_dataloader=True),
    "lm-logits-load-dir": _lm(logits_load_dir="/cache/logits"),
    "lm-logits-save-dir": _lm(logits_save_dir="/cache/logits"),
    "lm-modelopt": _lm(modelopt_enabled=True),
    "lm-kd-teacher": _lm(export_kd_teacher_load="/ckpt/teacher"),
    "lm-splits-exceed-sequence": _lm(seq_length=3, sequence_parallel=False),
    "lm-segments-sequence-parallel": _lm(seq_length=4097),
    "lm-segments-fp8": _lm(fp8="hybrid", seq_length=4100),
    "lm-segments-context-parallel": _lm(context_parallel_size=2, seq_length=4098),
    "lm-segment-multiple": _lm(seq1f1b_segment_multiple=0),
    "lm-segments-segment-multiple": _lm(seq1f1b_segment_multiple=3000),
    "lm-segment-tokens-without-seq1f1b": _lm(seq1f1b=False, seq1f1b_segment_tokens=512),
    "lm-backward-by-documents-without-seq1f1b": _lm(seq1f1b=False,
                                                    seq1f1b_backward_by_documents=True),
    "lm-backward-by-documents-per-token": _lm(seq1f1b_backward_by_documents=True,
                                              calculate_per_token_loss=False, **_LM_PACKED),
    "lm-backward-by-documents-auto": _lm(seq1f1b_backward_by_documents=True,
                                         calculate_per_token_loss=True, seq1f1b_splits="auto",
                                         **_LM_PACKED),
    "lm-backward-by-documents-without-documents": _lm(seq1f1b_backward_by_documents=True,
                                                      calculate_per_token_loss=True),
    "lm-segment-tokens-positive": _lm(seq1f1b_segment_tokens=0),
    "lm-segment-tokens-one-split": _lm(seq1f1b_splits=1, seq1f1b_segment_tokens=512),
    "lm-segment-tokens-auto": _lm(seq1f1b_splits="auto", seq1f1b_segment_tokens=512),
    "lm-segment-tokens-sequence-parallel": _lm(seq1f1b_segment_tokens=512, seq_length=4097),
    "lm-split-lengths-without-seq1f1b": _lm(seq1f1b=False, seq1f1b_split_lengths=(2048, 2048)),
    "lm-split-lengths-auto": _lm(seq1f1b_splits="auto", seq1f1b_split_lengths=(2048, 2048)),
    "lm-split-lengths-count": _lm(seq1f1b_split_lengths=(2048, 2048)),  # --seq1f1b-splits 4
    "lm-split-lengths-segment-tokens": _lm(seq1f1b_splits=None, seq1f1b_segment_tokens=512,
                                           seq1f1b_split_lengths=(2048, 2048)),
    "lm-split-lengths-documents": _lm(seq1f1b_splits=None, seq1f1b_partition="documents",
                                      seq1f1b_split_lengths=(2048, 2048), **_LM_PACKED),
    "lm-split-lengths-variable": _lm(seq1f1b_splits=None, variable_seq_lengths=True,
                                     seq1f1b_split_lengths=(2048, 2048)),
    "lm-split-lengths-sum": _lm(seq1f1b_splits=None, seq1f1b_split_lengths=(2048, 1024)),
    "lm-split-lengths-multiple": _lm(seq1f1b_splits=None, seq1f1b_split_lengths=(2047, 2049)),
}

TRAINER_VALID = ["--mock-data", "--tokenizer-type", "ByteTokenizer"]


def _three_documents_default_split():
    """The trainer on an indexed data set of three documents, with the default --split."""
    import tempfile

    from megatron_seq1f1b.trainer.data import write_indexed

    with tempfile.TemporaryDirectory() as folder:
        prefix = write_indexed(["one", "two", "three"], Path(folder) / "three")
        return arguments.parse(["--data-path", str(prefix), "--tokenizer-type", "ByteTokenizer"])


def _trainer(*argv: str, world_size: int = 1) -> LocalTrigger:
    return lambda: arguments.parse([*TRAINER_VALID, *argv], world_size)


def _without_psutil(trigger: LocalTrigger) -> LocalTrigger:
    """The trigger on a machine where psutil is not installed."""
    def run():
        from unittest import mock

        real = importlib.util.find_spec
        with mock.patch.object(importlib.util, "find_spec",
                               lambda name, *a: None if name == "psutil" else real(name, *a)):
            return trigger()
    return run


_CP2 = ("--context-parallel-size", "2", "--seq1f1b")
# Mamba-2 and gated delta net layers, sized to pass (Megatron-LM's GDN sizes; Mamba: 2 x hidden
# 128 / 64 = 4 heads in 2 groups); --swiglu last.
_RECURRENT = ("--hybrid-layer-pattern", "MG*-", "--mamba-num-groups", "2", "--swiglu")

#: Tensor parallelism 2 with a vocabulary it divides (the byte tokenizer's 257 does not)
_TP2 = ("--tensor-model-parallel-size", "2", "--vocab-size", "258")

TRAINER: dict[str, LocalTrigger] = {
    "trainer-world-size": _trainer(*_TP2, world_size=3),
    "trainer-backward-by-documents-per-token": _trainer("--seq1f1b",
                                                        "--seq1f1b-backward-by-documents",
                                                        "--reset-attention-mask"),
    "trainer-backward-by-documents-without-documents": _trainer(
        "--seq1f1b", "--seq1f1b-backward-by-documents", "--calculate-per-token-loss"),
    "trainer-layers-per-stage": _trainer("--pipeline-model-parallel-size", "3", world_size=3),
    "trainer-vpp-needs-pipeline": _trainer("--num-layers-per-virtual-pipeline-stage", "1"),
    "trainer-hybrid-symbols": _trainer("--hybrid-layer-pattern", "*D-"),
    "trainer-recurrent-context-parallel": _trainer(*_CP2, *_RECURRENT, world_size=2),
    "trainer-gdn-activation": _trainer(*_RECURRENT[:-1]),  # without --swiglu
    "trainer-mamba-heads": _trainer("--hybrid-layer-pattern", "M-"),  # Megatron's sizes, h 128
    "trainer-gdn-heads": _trainer(*_RECURRENT, "--linear-num-key-heads", "3"),
    "trainer-hybrid-mla": _trainer("--hybrid-layer-pattern", "+-+-"),
    "trainer-hybrid-stages": _trainer("--hybrid-layer-pattern", "*-|*-|*-",
                                      "--pipeline-model-parallel-size", "2", world_size=2),
    "trainer-vpp-divides": _trainer("--pipeline-model-parallel-size", "2",
                                    "--num-layers-per-virtual-pipeline-stage", "3", world_size=2),
    "trainer-bf16-fp16": _trainer("--bf16", "--fp16"),
    "trainer-global-batch": _trainer("--global-batch-size", "3", world_size=2),
    "trainer-data-source": _trainer("--data-path", "corpus"),
    "trainer-vocab-size": _trainer("--tokenizer-type", "NullTokenizer"),
    "trainer-max-positions": _trainer("--max-position-embeddings", "128"),
    "trainer-recompute-method": _trainer("--recompute-granularity", "full"),
    "trainer-save-interval": _trainer("--save-interval", "5"),
    "trainer-exit-interval": _trainer("--exit-interval", "0"),
    "trainer-distributed-checkpoint-psutil": _without_psutil(
        _trainer("--use-distributed-optimizer", "--save", "checkpoints")),
    "trainer-splits-negative": _trainer("--seq1f1b", "--seq1f1b-splits", "-1"),
    "trainer-segment-multiple-without-seq1f1b": _trainer("--seq1f1b-segment-multiple", "64"),
    "trainer-segment-multiple-positive": _trainer("--seq1f1b", "--seq1f1b-segment-multiple",
                                                  "0"),
    "trainer-splits-exceed-sequence": _trainer("--seq-length", "2", "--seq1f1b",
                                               "--seq1f1b-splits", "4"),
    "trainer-segments-sequence-parallel": _trainer(*_TP2,
                                                   "--sequence-parallel", "--seq-length", "255",
                                                   "--seq1f1b", world_size=2),
    "trainer-zb-h2-interleaved": _trainer("--pipeline-model-parallel-size", "2",
                                          "--num-layers-per-virtual-pipeline-stage", "1",
                                          "--seq1f1b", "--seq1f1b-schedule", "zb-h2",
                                          world_size=2),
    "trainer-splits-not-a-number": _trainer("--seq1f1b-splits", "x"),
    "trainer-partition-unknown": _trainer("--seq1f1b-partition", "random"),
    "trainer-memory-budget-without-auto": _trainer("--seq1f1b", "--seq1f1b-memory-budget", "1.5"),
    "trainer-memory-budget-positive": _trainer("--seq1f1b", "--seq1f1b-splits", "auto",
                                               "--seq1f1b-memory-budget", "0"),
    "trainer-min-segment-length": _trainer("--seq1f1b", "--seq1f1b-splits", "auto",
                                           "--seq1f1b-min-segment-length", "0"),
    "trainer-schedule-unknown": _trainer("--seq1f1b-schedule", "zb-h3"),
    "trainer-position-embedding": _trainer("--position-embedding-type", "yarn"),
    "trainer-partition-documents-without-documents": _trainer("--seq1f1b", "--seq1f1b-partition",
                                                              "documents"),
    "trainer-documents-mla": _trainer("--dataloader-inter-document-masking",
                                      "--multi-latent-attention"),
    "trainer-unknown-flag": _trainer("--hybrid-context-parallel"),
    "trainer-context-parallel-without-seq1f1b": _trainer("--context-parallel-size", "2",
                                                         world_size=2),
    "trainer-segments-context-parallel": _trainer(*_CP2, "--seq1f1b-splits", "2",
                                                  "--seq-length", "66", world_size=2),
    "trainer-attention-heads": _trainer("--hidden-size", "66"),
    "trainer-query-groups": _trainer("--num-query-groups", "3"),
    "trainer-vocab-tensor-parallel": _trainer("--tensor-model-parallel-size", "2",
                                              world_size=2),
    "trainer-router-topk": _trainer("--num-experts", "3", "--moe-router-topk", "5",
                                    "--disable-bias-linear"),
    "trainer-moe-bias-linear": _trainer("--num-experts", "2"),
    "trainer-window-look-ahead": _trainer("--seq1f1b", "--window-size", "(16, 4)"),
    "trainer-plan-without-seq1f1b": _trainer("--seq1f1b-splits", "8"),
    "trainer-split-without-documents": _three_documents_default_split,
    "trainer-segment-tokens-without-seq1f1b": _trainer("--seq1f1b-segment-tokens", "64"),
    "trainer-segment-tokens-positive": _trainer("--seq1f1b", "--seq1f1b-segment-tokens", "0"),
    "trainer-segment-tokens-one-split": _trainer("--seq1f1b", "--seq1f1b-splits", "1",
                                                 "--seq1f1b-segment-tokens", "64"),
    "trainer-segment-tokens-auto": _trainer("--seq1f1b", "--seq1f1b-splits", "auto",
                                            "--seq1f1b-segment-tokens", "64"),
    "trainer-segment-tokens-sequence-parallel": _trainer(
        *_TP2, "--sequence-parallel", "--seq-length", "255",
        "--seq1f1b", "--seq1f1b-segment-tokens", "64", world_size=2),
    "trainer-split-lengths-value": _trainer("--seq1f1b", "--seq1f1b-split-lengths", "128,x"),
    "trainer-split-lengths-without-seq1f1b": _trainer("--seq1f1b-split-lengths", "128,128"),
    "trainer-split-lengths-count": _trainer("--seq1f1b", "--seq1f1b-splits", "3",
                                            "--seq1f1b-split-lengths", "128,128"),
    "trainer-split-lengths-sum": _trainer("--seq1f1b", "--seq1f1b-split-lengths", "100,100"),
    "trainer-split-lengths-variable": _trainer("--seq1f1b", "--seq1f1b-split-lengths", "128,128",
                                               "--variable-seq-lengths"),
    "trainer-variable-mode-unknown": _trainer("--variable-seq-lengths", "uniform"),
    "trainer-variable-documents-micro-batch-size": _trainer("--variable-seq-lengths",
                                                            "--micro-batch-size", "2"),
    "trainer-variable-allgather": _trainer("--variable-seq-lengths", "lognormal",
                                           "--num-experts", "2", "--disable-bias-linear"),
    "trainer-variable-auto-budget-microbatches": _trainer(
        "--variable-seq-lengths", "--seq1f1b", "--seq1f1b-splits", "auto",
        "--seq1f1b-memory-budget-microbatches", "2"),
    "trainer-variable-min-exceeds-sequence": _trainer("--variable-seq-lengths", "lognormal",
                                                      "--variable-seq-lengths-min", "300"),
    "trainer-variable-shape-without-lognormal": _trainer("--variable-seq-lengths-sigma", "0.5"),
    "trainer-variable-sequence-parallel": _trainer(
        *_TP2, "--sequence-parallel", "--seq-length", "255",
        "--variable-seq-lengths", "lognormal", world_size=2),
}

# ------------------------------------------------------------------ triggers run on two gloo ranks


@dataclasses.dataclass
class Layout:
    """One rank's part of a built model (DDP-wrapped chunks) and its micro-batches."""

    config: Any
    models: list
    batches: list

    def gpt(self) -> torch.nn.Module:
        from gpt import unwrap

        return unwrap(self.models[0])

    def run(self, forward_backward: Callable, models: list | None = None, **overrides: Any):
        from gpt import ModelSpec, forward_step
        from megatron_seq1f1b.runtime.executor import clear_setups

        clear_setups()  # triggers change the shared model in place; setups are per configuration

        models = models or self.models
        many = len(models) > 1
        call = dict(
            forward_step_func=partial(forward_step, slicer=s1.slice_batch),
            data_iterator=[iter(self.batches) for _ in models] if many else iter(self.batches),
            model=models if many else models[0], num_microbatches=len(self.batches),
            seq_length=ModelSpec().seq_length, micro_batch_size=1,
        )
        return forward_backward(**{**call, **overrides})


RankTrigger = Callable[[Layout], object]


def _call(num_splits: int = 1, *, config: dict | None = None, schedule: str = "1f1b",
          split_lengths: list[int] | None = None, **call: Any) -> RankTrigger:
    """A forward-backward call, with config options changed for its duration."""
    def trigger(at: Layout) -> None:
        with _changed(at.config, **(config or {})):
            at.run(s1.get_forward_backward_func(num_splits, schedule=schedule,
                                                split_lengths=split_lengths), **call)
    return trigger


def _variable_call(**kwargs: Any) -> RankTrigger:
    """A forward-backward call of variable-length micro-batches with ``kwargs`` for
    get_forward_backward_func."""
    def trigger(at: Layout) -> None:
        with _changed(at.config, variable_seq_lengths=True):
            at.run(_unchecked_getter(2, **kwargs))
    return trigger


def _documents_apart(**config: Any) -> RankTrigger:
    """backward_by_documents=True (end-of-document documents) with config options changed."""
    def trigger(at: Layout) -> None:
        with _changed(at.config, **config):
            at.run(_unchecked_getter(2, documents=0, backward_by_documents=True))
    return trigger


def _unchecked_getter(num_splits: int, **kwargs: Any):
    """Seq1F1B's function with arguments the getter's own checks would refuse first (the
    executor's checks are the ones under test)."""
    from megatron_seq1f1b.runtime.executor import forward_backward

    return partial(forward_backward, num_splits=num_splits, **kwargs)


def _per_token_moe_before_0_19(at: Layout) -> None:
    """Per-token router losses under CP, on a megatron-core that scales them by one CP rank's
    tokens (before 0.19; the detector says so here whatever is installed)."""
    from megatron_seq1f1b.base import compat

    with _changed(compat, per_token_router_losses_count_context_parallel=lambda: False):
        _call(config=dict(num_moe_experts=4, moe_aux_loss_coeff=1e-2,
                          calculate_per_token_loss=True, context_parallel_size=2))(at)


def _enable(**config: Any) -> RankTrigger:
    def trigger(at: Layout) -> None:
        with _changed(at.config, **config):
            s1.enable(at.models)
    return trigger


def _not_enabled(at: Layout) -> None:
    from megatron_seq1f1b.runtime.model_hooks import _ENABLED

    with _changed(at.gpt(), **{_ENABLED: False}):
        at.run(s1.get_forward_backward_func(2))


def _yarn(at: Layout) -> None:
    with _changed(at.gpt(), position_embedding_type="yarn"):
        s1.enable(at.models)


def _recurrent_mixer(name: str, **config: Any) -> RankTrigger:
    """A layer holding a recurrent mixer (a stand-in named as Megatron's class, with a copy of
    the model's config, options changed)."""
    def trigger(at: Layout) -> None:
        layer = at.gpt().decoder.layers[0]
        mixer = type(name, (torch.nn.Module,), {})()
        mixer.config = dataclasses.replace(at.config, **config)
        layer.add_module("mixer", mixer)
        try:
            s1.enable(at.models)
        finally:
            del layer.mixer
    return trigger


def _cross_attention(at: Layout) -> None:
    from megatron.core.transformer.attention import CrossAttention

    with _changed(at.gpt().decoder.layers[0].self_attention, __class__=CrossAttention):
        s1.enable(at.models)


def _unknown_core_attention(at: Layout) -> None:
    with _changed(at.gpt().decoder.layers[0].self_attention, core_attention=torch.nn.Identity()):
        s1.enable(at.models)


def _install_multi_module(at: Layout) -> None:
    """Megatron's getter after install(); on a rank because Megatron is imported there."""
    from megatron.core.pipeline_parallel import schedules

    class MultiModuleProcessGroupCollection:  # Megatron's cross-grid collection, by name
        pass

    s1.install(2)
    try:
        schedules.get_forward_backward_func(
            schedule_pg_collection=MultiModuleProcessGroupCollection())
    finally:
        s1.uninstall()


def _per_stage(first: dict, others: dict) -> RankTrigger:
    """Stage 0 calls get_forward_backward_func(**first), the other stages (**others)."""
    def trigger(at: Layout) -> None:
        from megatron.core import parallel_state

        options = first if parallel_state.get_pipeline_model_parallel_rank() == 0 else others
        at.run(s1.get_forward_backward_func(**options))
    return trigger


def _flash_on_stage_1(at: Layout) -> None:
    """A balanced k=2 call with stage 1's layers on the flash core attention, stage 0's on
    Megatron's local one (put back afterwards)."""
    from megatron.core import parallel_state
    from megatron_seq1f1b.attention.flash import use_flash_attention

    with contextlib.ExitStack() as restore:
        for layer in at.gpt().decoder.layers:
            attention = layer.self_attention
            restore.enter_context(_changed(attention, core_attention=attention.core_attention))
        if parallel_state.get_pipeline_model_parallel_rank() == 1:
            use_flash_attention(at.models)
        at.run(s1.get_forward_backward_func(2, "balanced"))


def _te(make: Callable[[Any], torch.nn.Module], *, hooked: bool = True, schedule: str = "zb-h1",
        ddp: dict | None = None) -> RankTrigger:
    """A k=2 call with a stand-in Transformer Engine layer (tests/test_wgrad_te.py) in the model.

    `make(te)` builds it from that module; `hooked`: Megatron DDP's delayed-gradient hooks
    registered on it; `ddp`: DistributedDataParallelConfig options changed for the call.
    """
    def trigger(at: Layout) -> None:
        import test_wgrad_te as te

        layer = make(te)
        if hooked:
            te.Hooks(layer)
        with _changed(at.gpt(), seq1f1b_fake_te=layer), \
                _changed(at.models[0].ddp_config, **(ddp or {})):
            at.run(s1.get_forward_backward_func(2, schedule=schedule))
    return trigger


def _delay_switched_off(te) -> torch.nn.Module:
    layer = te.TELinear(4, 4, "fc", te.config())
    layer.config.delay_wgrad_compute = False
    return layer


def _queue_without_qsize(te) -> torch.nn.Module:
    layer = te.TELinear(4, 4, "fc", te.config())
    layer.wgrad_store.context = []
    return layer


# Layouts on 2 ranks (_layout's arguments) and, per layout, its cases; one harness case each.
LAYOUTS: dict[str, dict] = {
    "pp2": dict(pp=2, enable=True),
    "pp2-vpp2": dict(pp=2, vpp=2, enable=True),
    "tp2-sp": dict(pp=1, tp=2, sp=True, enable=True),  # pipeline size 1: the chunks rule
}
ON_RANKS: dict[str, dict[str, RankTrigger]] = {
    "pp2": {
        "install-multi-module": _install_multi_module,
        "enable-not-gpt": lambda at: s1.enable(torch.nn.Linear(2, 2)),
        "enable-context-parallel": _enable(context_parallel_size=2),
        "enable-hybrid-context-parallel": _enable(hybrid_context_parallel=True),
        "enable-recurrent-context-parallel": _recurrent_mixer("MambaMixer",
                                                              context_parallel_size=2),
        "enable-recurrent-deterministic": _recurrent_mixer("GatedDeltaNet",
                                                           deterministic_mode=True),
        "enable-mla-yarn-rope-fusion": _enable(multi_latent_attention=True, rope_type="yarn",
                                               apply_rope_fusion=True),
        "enable-mla-down-proj-fusion": _enable(multi_latent_attention=True,
                                               mla_down_proj_fusion=True),
        "enable-window-size": _enable(window_size=(8, 2)),
        "enable-moe-capacity-factor": _enable(num_moe_experts=4, moe_expert_capacity_factor=1.0),
        "enable-moe-rank-capacity": _enable(num_moe_experts=4,
                                            moe_expert_rank_capacity_factor=1.5),
        "enable-moe-recompute": _enable(num_moe_experts=4, moe_aux_loss_coeff=1e-2,
                                        recompute_granularity="selective",
                                        recompute_modules=["moe"]),
        "enable-mtp-standalone": _enable(mtp_num_layers=1, mtp_standalone=True),
        "enable-activation-offloading": _enable(fine_grained_activation_offloading=True),
        "enable-cuda-graph-impl": _enable(cuda_graph_impl="local"),
        "enable-enable-cuda-graph": _enable(enable_cuda_graph=True),
        "enable-tp-comm-overlap": _enable(tp_comm_overlap=True),
        "enable-fp8-dot-product-attention": _enable(fp8_dot_product_attention=True),
        "enable-fp8-multi-head-attention": _enable(fp8_multi_head_attention=True),
        "enable-position-embedding": _yarn,
        "enable-cross-attention": _cross_attention,
        "enable-core-attention": _unknown_core_attention,
        "executor-not-enabled": _not_enabled,
        "executor-num-microbatches": _call(num_microbatches=0),
        "executor-variable-split-lengths": _call(2, config=dict(variable_seq_lengths=True),
                                                 split_lengths=[16, 16]),
        "executor-variable-segment-costs": _variable_call(segment_costs=[(1, 1, 1)] * 2,
                                                          schedule="zb-h1"),
        "executor-variable-measured": _variable_call(partition="measured",
                                                     split_lengths=None),
        "executor-backward-by-documents-per-token": _documents_apart(),
        "executor-backward-by-documents-moe-aux-loss": _documents_apart(
            calculate_per_token_loss=True, num_moe_experts=4, moe_aux_loss_coeff=0.01),
        "executor-backward-by-documents-mtp": _documents_apart(calculate_per_token_loss=True,
                                                               mtp_num_layers=1),
        "executor-backward-by-documents-recurrent": _documents_apart(
            calculate_per_token_loss=True, experimental_attention_variant="gated_delta_net"),
        "executor-backward-by-documents-context-parallel": _documents_apart(
            calculate_per_token_loss=True, context_parallel_size=2),
        "executor-overlap-p2p-without-chunks": _call(config=dict(overlap_p2p_comm=True,
                                                                 batch_p2p_comm=False)),
        "executor-adjust-tensor-shapes": _call(adjust_tensor_shapes_fn=lambda r, s: (r, s)),
        "executor-pipeline-dtype": _call(config=dict(pipeline_dtype=None)),
        "executor-overlap-moe-comm": _call(config=dict(overlap_moe_expert_parallel_comm=True)),
        "executor-moe-capacity-factor": _call(config=dict(num_moe_experts=4,
                                                          moe_expert_capacity_factor=1.0)),
        "executor-moe-per-token-context-parallel": _per_token_moe_before_0_19,
        "executor-mtp-repeated-layer": _call(config=dict(mtp_num_layers=2,
                                                         mtp_use_repeated_layer=True)),
        "executor-activation-offloading": _call(
            config=dict(fine_grained_activation_offloading=True)),
        "executor-p2p-communicator": _call(p2p_communicator=object()),
        "executor-too-many-splits": _call(40),
        "executor-split-lengths-positive": _call(2, split_lengths=[0, 32]),
        "executor-split-lengths-sum": _call(2, split_lengths=[10, 10]),
        "executor-split-lengths-fp8": _call(2, split_lengths=[12, 20], config=dict(fp8="hybrid")),
        "executor-context-parallel-lengths": _call(config=dict(context_parallel_size=2),
                                                   seq_length=31),
        "stages-differ-num-splits": _per_stage(dict(num_splits=2), dict(num_splits=4)),
        "stages-differ-split-lengths": _per_stage(dict(num_splits=2, split_lengths=[16, 16]),
                                                  dict(num_splits=2, split_lengths=[20, 12])),
        "stages-differ-schedule": _per_stage(dict(num_splits=2),
                                             dict(num_splits=2, schedule="zb-h1")),
        "stages-differ-attention": _flash_on_stage_1,
        "te-too-old": _te(lambda te: te.TE26.Linear(), hooked=False),
        "te-not-delayed": _te(lambda te: te.TELinear(4, 4, "fc", te.config(delay=False))),
        "te-delay-switched-off": _te(_delay_switched_off),
        "te-no-queue": _te(_queue_without_qsize),
        "te-ddp-not-delayed": _te(lambda te: te.TELinear(4, 4, "fc", te.config()), hooked=False),
        "te-fused-overlap-grad-reduce": _te(
            lambda te: te.TELinear(4, 4, "fc", te.config(), fuse_wgrad_accumulation=True),
            ddp=dict(overlap_grad_reduce=True)),
        "te-bias": _te(lambda te: te.TELinear(4, 4, "fc", te.config(), bias=True)),
        "te-op-fuser": _te(lambda te: torch.nn.Sequential(
            te.TELinear(4, 4, "fc", te.config()), te.TEFusedMLP())),
        "te-first-microbatch-overwrite": _te(
            lambda te: te.TELinear(4, 4, "fc", te.config(delay=False),
                                   fuse_wgrad_accumulation=True,
                                   disable_parameter_transpose_cache=False),
            schedule="1f1b"),
        "te-delayed-without-w": _te(lambda te: te.TELinear(4, 4, "fc", te.config()),
                                    schedule="1f1b"),
    },
    "pp2-vpp2": {
        "executor-data-iterators": lambda at: at.run(s1.get_forward_backward_func(1),
                                                     data_iterator=[iter(at.batches)]),
        "executor-overlap-and-batch-p2p": _call(config=dict(overlap_p2p_comm=True,
                                                            batch_p2p_comm=True)),
        "executor-zb-h2-interleaved": _call(2, schedule="zb-h2"),
        "executor-backward-by-documents-chunks": _documents_apart(calculate_per_token_loss=True),
    },
    "tp2-sp": {
        "executor-chunks-need-pipeline": lambda at: at.run(s1.get_forward_backward_func(1),
                                                           models=at.models * 2),
        "executor-seq-length-multiple": _call(2, seq_length=31),
        "executor-split-lengths-sequence-parallel": _call(2, split_lengths=[17, 15]),
    },
}

LOCAL: dict[str, LocalTrigger] = {**API, **MEGATRON_LM, **TRAINER}
TRIGGERS = {**LOCAL, **{case: t for cases in ON_RANKS.values() for case, t in cases.items()}}
# Which "Checked by" each group of triggers may document.
ENTRY_POINTS = [
    (API, {"get_forward_backward_func"}),
    (MEGATRON_LM, {"Megatron-LM validate_args"}),
    (TRAINER, {"scripts/pretrain_gpt.py"}),
    (dict(itertools.chain.from_iterable(c.items() for c in ON_RANKS.values())),
     {"install", "enable(model)", "forward-backward call"}),
]
RAISES = {"enable-not-gpt": "TypeError"}  # everything else in the library: ConfigError

P2P_FUNCTIONS = ("send", "recv", "isend", "irecv", "batch_isend_irecv")


@contextlib.contextmanager
def counting_p2p() -> Iterator[list[str]]:
    """Record every point-to-point call (and P2POp made) through torch.distributed."""
    calls: list[str] = []
    saved = {name: getattr(dist, name) for name in (*P2P_FUNCTIONS, "P2POp")}
    real: dict[Callable, Callable] = {}

    def counted(name: str, fn: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)
        real[wrapper] = fn
        return wrapper

    for name in P2P_FUNCTIONS:
        setattr(dist, name, counted(name, saved[name]))
    # P2POp accepts only the real isend/irecv.
    dist.P2POp = counted("P2POp", lambda op, *a, **k: saved["P2POp"](real.get(op, op), *a, **k))
    try:
        yield calls
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def rejections_on_ranks(layout: str) -> dict[str, tuple[str | None, float, int]]:
    """Harness case: every trigger of `layout` on this rank -> (error, seconds, p2p calls)."""
    from gpt import DataSpec, ModelSpec
    from pipeline_cases import _layout

    _, config, models, batches = _layout(ModelSpec(), DataSpec(num_microbatches=2),
                                         **LAYOUTS[layout])
    at = Layout(config, models, batches)
    found = {}
    with counting_p2p() as calls:
        for case, trigger in ON_RANKS[layout].items():
            posted, start, error = len(calls), time.monotonic(), None
            try:
                trigger(at)
            except Exception as exc:  # noqa: BLE001 - the rejection under test
                error = f"{type(exc).__name__}: {exc}"
            found[case] = (error, time.monotonic() - start, len(calls) - posted)
    return found


# ------------------------------------------------------------------ tests


@pytest.fixture(scope="module")
def on_ranks(ranks) -> dict[str, list[tuple[str | None, float, int]]]:
    """Every rank's outcome of every case that needs a model: case -> one entry per rank."""
    found: dict[str, list] = {}
    for layout in ON_RANKS:
        for result in ranks.run(2, rejections_on_ranks, case=f"rejections-{layout}", layout=layout):
            for case, outcome in result.items():
                found.setdefault(case, []).append(outcome)
    return found


def test_every_row_has_a_trigger_and_every_trigger_a_row():
    assert len(TRIGGERS) == sum(len(group) for group, _ in ENTRY_POINTS), "a case id twice"
    assert sorted(set(ROWS) - set(TRIGGERS)) == [], "rows without a trigger"
    assert sorted(set(TRIGGERS) - set(ROWS)) == [], f"triggers missing from {DOC.name}"
    for group, allowed in ENTRY_POINTS:
        wrong = {c: ROWS[c].checked_by for c in group if ROWS[c].checked_by not in allowed}
        assert not wrong, f"'Checked by' should be one of {sorted(allowed)}: {wrong}"


def test_valid_baselines_are_accepted():
    """A row passes only because of its one change."""
    assert megatron_lm.args_problems(argparse.Namespace(**LM_VALID)) == []
    for world_size in (1, 2, 3):
        arguments.parse(TRAINER_VALID, world_size)
    arguments.parse([*TRAINER_VALID, *_CP2], 2)  # context parallelism under Seq1F1B
    if importlib.util.find_spec("megatron.core.models.hybrid") is not None:  # HybridModel: 0.18+
        arguments.parse([*TRAINER_VALID, *_RECURRENT], 1)  # Mamba-2 and gated delta nets
        arguments.parse([*TRAINER_VALID, *_RECURRENT, "--seq1f1b"], 1)


# Once rejected, now accepted: documents the schedule reads (packed batches, end-of-document
# tokens on the flash attention) and a dense document mask on the local attention.
LM_DOCUMENTS_ACCEPTED = [
    dict(sft=True, micro_batch_size=1, apply_rope_fusion=False),
    dict(sft=True, micro_batch_size=1, transformer_impl="transformer_engine",
         seq1f1b_partition="documents"),
    dict(dataloader_inter_document_masking=True, micro_batch_size=1),
    dict(reset_attention_mask=True, attention_backend="flash",
         create_attention_mask_in_dataloader=False, seq1f1b_partition="documents"),
    dict(reset_attention_mask=True),
]


@pytest.mark.parametrize("flags", LM_DOCUMENTS_ACCEPTED)
def test_megatron_lm_documents_are_accepted(flags):
    assert megatron_lm.args_problems(argparse.Namespace(**{**LM_VALID, **flags})) == []


def _rejection(case: str, capsys: pytest.CaptureFixture) -> str | None:
    try:
        LOCAL[case]()
    except SystemExit as exc:  # the trainer; argparse prints its error and exits 2
        return f"SystemExit: {exc.code if isinstance(exc.code, str) else capsys.readouterr().err}"
    except Exception as exc:  # noqa: BLE001 - the rejection under test
        return f"{type(exc).__name__}: {exc}"
    return None


@pytest.mark.parametrize("case", list(ROWS))
def test_rejected_with_the_documented_message(case: str, request, capsys):
    row = ROWS[case]
    if case in LOCAL:
        errors = [_rejection(case, capsys)]
    else:
        outcomes = request.getfixturevalue("on_ranks")[case]
        errors = [error for error, _, _ in outcomes]
        for rank, (error, seconds, posted) in enumerate(outcomes):
            assert posted == 0, f"rank {rank}: {posted} point-to-point calls before: {error}"
            assert seconds < 2, f"rank {rank}: rejected after {seconds:.1f} s"
    expected = "SystemExit" if case in TRAINER else RAISES.get(case, "ConfigError")
    for error in errors:
        assert error is not None, f"{case}: nothing was rejected"
        assert error.startswith(expected + ":"), error
        assert row.fragment in error, f"{case}: {row.fragment!r} not in:\n{error}"
        assert row.flag in error, f"{case}: flag {row.flag!r} not in:\n{error}"
