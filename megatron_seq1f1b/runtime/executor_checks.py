"""What is wrong with a forward-backward call, found before any communication.

The configuration rules every floor shares (segment lengths, model options, MoE) live in
:mod:`megatron_seq1f1b.base.checks`; this module adds what only the executor's call can tell:
the iterators against the chunks, Megatron's p2p flags, the first micro-batch of deferred
Transformer Engine weight gradients, and whether the model was prepared for segments.
"""

from __future__ import annotations

from megatron_seq1f1b.base.checks import (
    model_config_problems, moe_problems, segment_length_problems,
)
from megatron_seq1f1b.runtime.te_wgrad import first_microbatch_problems
from megatron_seq1f1b.segments import mtp


def executor_problems(chunks, iterators, config, num_microbatches, num_splits, lengths,
                      seq_length, pp_size, adjust_tensor_shapes_fn, model_enabled) -> list[str]:
    """Everything wrong with a forward-backward call, found before any communication
    (``lengths`` None: variable-length micro-batches, whose cuts are checked per iteration)."""
    problems = []
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        problems.append(f"num_microbatches must be a positive integer, got {num_microbatches!r}")
    if len(iterators) != len(chunks):
        problems.append(f"{len(chunks)} model chunks but {len(iterators)} data iterators; pass "
                        "data_iterator as a list with one iterator per chunk")
    if len(chunks) > 1 and pp_size < 2:
        problems.append("model chunks (virtual pipeline) need pipeline_model_parallel_size >= 2")
    if getattr(config, "overlap_p2p_comm", False) and len(chunks) == 1:
        problems.append("overlap_p2p_comm needs model chunks (as in Megatron); set it to False")
    if getattr(config, "overlap_p2p_comm", False) and getattr(config, "batch_p2p_comm", False):
        problems.append("overlap_p2p_comm and batch_p2p_comm cannot both be set (as in Megatron)")
    if adjust_tensor_shapes_fn is not None:
        problems.append("adjust_tensor_shapes_fn is not supported: segment shapes are fixed")
    if pp_size > 1 and getattr(config, "pipeline_dtype", None) is None:
        problems.append("config.pipeline_dtype must be set for pipeline parallelism")
    if getattr(config, "overlap_moe_expert_parallel_comm", False):
        problems.append("overlap_moe_expert_parallel_comm (combined 1F1B) is not supported")
    problems += mtp.problems(config, None)
    if getattr(config, "num_moe_experts", None):
        problems += moe_problems(config)
    if getattr(config, "fine_grained_activation_offloading", False):
        problems.append("fine-grained activation offloading (fine_grained_activation_offloading) "
                        "is not supported; disable it")
    if num_splits > 1:
        problems += model_config_problems(config)
        problems += first_microbatch_problems(chunks, num_splits)
        if not model_enabled:
            problems.append(
                "the model is not prepared for segments: call megatron_seq1f1b.enable(model) "
                "after building it"
            )
    if lengths is not None:  # None: variable-length micro-batches, cut every iteration
        problems += segment_length_problems(lengths, seq_length, config)
    return sorted(set(problems), key=problems.index)
