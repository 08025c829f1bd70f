"""Stage rehearsal cases (run in harness workers): a real gloo pipeline, then each rank
rehearses its own stage alone, on models built by build_stage_chunks."""

from __future__ import annotations

from functools import partial

from megatron.core import parallel_state

import megatron_seq1f1b as s1
from gpt import DataSpec, ModelSpec, build_chunks, clear_moe_losses, forward_step, \
    init_parallel, layer_spec, make_batches, make_config, unwrap
from megatron_seq1f1b.planner.peak_memory import SavedActivations
from megatron_seq1f1b.runtime.trace import TimelineRecorder


def _parameters(chunks) -> list:
    return [p for chunk in chunks for p in unwrap(chunk).parameters()]


def pipeline_then_rehearsal(pp: int, k: int, schedule: str, model: ModelSpec, data: DataSpec,
                            vpp: int | None = None, partition: str = "uniform") -> dict:
    """This rank's actions and saved-activation peak in a real pp-stage pipeline, and the
    same for its stage rehearsed alone (Megatron's parallel state with pipeline size 1),
    told the pipeline's attention as the rehearsal's command line tells it."""
    from megatron_seq1f1b.runtime.model_hooks import AttentionKind

    from megatron_seq1f1b.planner.rehearse import build_stage_chunks, rehearse_stage

    batches = make_batches(model, data)
    step = partial(forward_step, slicer=s1.slice_batch)
    many = bool(vpp)

    def iterators():
        return [iter(batches) for _ in range(vpp)] if many else iter(batches)

    # the real pipeline
    clear_moe_losses()
    init_parallel(1, pp, vpp)
    config = make_config(model, pp=pp, vpp=vpp)
    chunks = build_chunks(model, config)
    s1.enable(chunks)
    stage = parallel_state.get_pipeline_model_parallel_rank()
    recorder = TimelineRecorder()
    meter = SavedActivations(exclude=_parameters(chunks))
    with meter:
        s1.get_forward_backward_func(k, partition, schedule=schedule, recorder=recorder)(
            forward_step_func=step, data_iterator=iterators(),
            model=chunks if many else chunks[0], num_microbatches=data.num_microbatches,
            seq_length=model.seq_length, micro_batch_size=data.micro_batch_size)
    real = {"actions": [str(iv.action) for iv in recorder.last.compute],
            "lengths": list(recorder.last.lengths[0]),
            "saved_peak": meter.peak_bytes,
            "parameter_bytes": sum(p.numel() * p.element_size() for p in _parameters(chunks))}
    del chunks

    # the same stage alone
    clear_moe_losses()
    init_parallel()
    whole = make_config(model, pp=pp, vpp=vpp)
    alone = build_stage_chunks(whole, pp, stage, vocab_size=model.vocab_size,
                               max_sequence_length=model.seq_length,
                               num_model_chunks=vpp or 1,
                               layer_spec=None if model.hybrid else layer_spec(model),
                               tied_embeddings=model.tied_embeddings,
                               position_embedding_type=model.position_embedding_type,
                               **_hybrid(model))
    s1.enable(alone)
    rehearsal = rehearse_stage(
        alone if many else alone[0], step, iterators(), num_stages=pp, stage=stage,
        num_microbatches=data.num_microbatches, seq_length=model.seq_length,
        micro_batch_size=data.micro_batch_size, num_splits=k, partition=partition,
        schedule=schedule, count_saved=True, attention=AttentionKind.of_backend(model.attention))
    return {"stage": stage, "real": real, "rehearsal": rehearsal.to_dict(),
            "layers": [len(unwrap(c).decoder.layers) for c in alone],
            "pre_post": [(unwrap(c).pre_process, unwrap(c).post_process) for c in alone],
            "mtp": [bool(getattr(unwrap(c), "mtp_process", False)) for c in alone]}


def _hybrid(model: ModelSpec) -> dict:
    """build_stage_chunks' HybridModel arguments: the pattern and the spec tests/gpt.py uses."""
    if not model.hybrid:
        return {}
    from megatron_seq1f1b.runtime.hybrid_spec import local_hybrid_stack_spec

    return {"hybrid_layer_pattern": model.hybrid, "hybrid_stack_spec": local_hybrid_stack_spec(
        attention=model.attention, num_experts=dict(model.extra).get("num_moe_experts"))}


def cli(argv: list[str]) -> dict:
    """``python -m megatron_seq1f1b.rehearse`` in this (one-rank) worker; its JSON."""
    import json
    import tempfile
    from pathlib import Path

    from megatron_seq1f1b.planner import rehearse

    with tempfile.TemporaryDirectory() as folder:
        out, calibration = Path(folder) / "stage.json", Path(folder) / "calibration.json"
        argv = [str(calibration) if a == "CALIBRATION" else a for a in argv]
        assert rehearse.main(argv + ["--json", str(out)]) == 0
        result = json.loads(out.read_text())
        if calibration.exists():
            result["calibration"] = json.loads(calibration.read_text())
        return result


def rehearsal_refusals(model: ModelSpec, stage: int, attention) -> str:
    """The error of rehearsing ``stage`` (of two, balanced cut) told ``attention``, or ''."""
    from megatron_seq1f1b.planner.rehearse import build_stage_chunks, rehearse_stage

    init_parallel()
    alone = build_stage_chunks(make_config(model, pp=2), 2, stage, vocab_size=model.vocab_size,
                               max_sequence_length=model.seq_length, **_hybrid(model))
    s1.enable(alone)
    try:
        rehearse_stage(alone[0], partial(forward_step, slicer=s1.slice_batch),
                       iter(make_batches(model, DataSpec(num_microbatches=2))), num_stages=2,
                       stage=stage, num_microbatches=2, seq_length=model.seq_length,
                       micro_batch_size=1, num_splits=4, partition="balanced",
                       attention=attention)
    except ValueError as exc:
        return str(exc)
    return ""
