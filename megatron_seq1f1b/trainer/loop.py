"""The training loop: iterations, evaluation, Megatron-style logs, checkpoints."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from megatron_seq1f1b.base import compat
from megatron_seq1f1b.megatron_lm.arguments import AUTO
from megatron_seq1f1b.planner.peak_memory import PeakMemory
from megatron_seq1f1b.trainer import arguments, auto_plan, checkpoint, data, lengths, setup


def _forward_backward_func(args, recorder=None) -> Callable:
    if args.seq1f1b:
        import megatron_seq1f1b as s1

        return s1.get_forward_backward_func(
            args.seq1f1b_splits, args.seq1f1b_partition, schedule=args.seq1f1b_schedule,
            split_lengths=getattr(args, "seq1f1b_split_lengths", None), recorder=recorder,
            segment_costs=getattr(args, "seq1f1b_segment_costs", None),
            segment_multiple=args.seq1f1b_segment_multiple,
            documents=data.seq1f1b_documents(args, data.make_tokenizer(args).eod),
            segment_tokens=args.seq1f1b_segment_tokens,
            backward_by_documents=args.seq1f1b_backward_by_documents)
    from megatron.core.pipeline_parallel import get_forward_backward_func

    return get_forward_backward_func()


@contextlib.contextmanager
def _timed(args, model, recorder) -> Iterator[Callable]:
    """The forward-backward function of an iteration whose actions `recorder` times."""
    from megatron_seq1f1b.runtime.trace import megatron_step_timer

    if args.seq1f1b:
        yield _forward_backward_func(args, recorder)
        return
    recorder.begin(dist.get_rank())
    with megatron_step_timer(recorder, model):
        yield _forward_backward_func(args)


def _write_timeline(args, recorder, title: str, picture: bool = True) -> dict:
    """Gather the recorded iteration over the pipeline; its stats. With `picture`, the last
    rank also writes it (Chrome trace, PNG)."""
    from megatron.core import parallel_state

    from megatron_seq1f1b.runtime.trace import timeline_stats
    from megatron_seq1f1b.schedules import draw

    timeline = recorder.gather(-1, group=parallel_state.get_pipeline_model_parallel_group())
    stats = timeline_stats(timeline)
    cuts = recorder.last.lengths  # per micro-batch, as the executor cut it (Seq1F1B)
    stats["segment_lengths"] = [list(cut) for cut in cuts] if cuts else None
    if picture and dist.get_rank() == dist.get_world_size() - 1:
        os.makedirs(args.timeline_dir, exist_ok=True)
        png = os.path.join(args.timeline_dir, "timeline.png")
        trace = os.path.join(args.timeline_dir, "timeline.json")
        draw.write_chrome_trace(timeline, trace, time_unit_us=1e6)
        try:
            # Megatron's schedules are timed by wrapping their steps: no p2p waits recorded.
            note = "" if args.seq1f1b else " (p2p waits not recorded)"
            draw.draw_png(timeline, png, title=f"{title}: bubble {stats['bubble_fraction']:.1%}"
                          f"{note}", time_label="seconds (measured)", show_waits=True)
        except ImportError as exc:  # matplotlib is optional
            _print(f"> no timeline picture: {exc}")
            png = None
        stats.update(png=png, trace=trace)
    return stats


def _moe_losses(args) -> dict:
    """Each MoE loss of the iteration: mean over MoE layers of its per-micro-batch value
    (stages hold different layers: summed over the pipeline first). Resets the tracker."""
    from megatron.core import parallel_state

    mine = {name: values.cpu() for name, values in compat.moe_losses(reset=True).items()}
    stages = [None] * parallel_state.get_pipeline_model_parallel_world_size()
    dist.all_gather_object(stages, mine, group=parallel_state.get_pipeline_model_parallel_group())
    losses = {}
    for name in sorted({name for stage in stages for name in stage}):
        values = sum(stage[name] for stage in stages if name in stage)
        layers = max(int((values != 0).sum()), 1)
        losses[name] = values.sum().item() / layers / args.num_microbatches
    return losses


def _mtp_losses(args) -> dict:
    """Each MTP depth's loss of the iteration (Megatron-LM's "mtp_<d> loss": its per-micro-
    batch values' mean), from the last stage, which holds the MTP block. Resets the tracker."""
    from megatron.core import parallel_state
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    tracker = MTPLossLoggingHelper.tracker
    values = tracker.get("loss_values", tracker.get("values"))
    mine = None if values is None else (values.detach().cpu() / args.num_microbatches).tolist()
    tracker.clear()
    stages = [None] * parallel_state.get_pipeline_model_parallel_world_size()
    dist.all_gather_object(stages, mine, group=parallel_state.get_pipeline_model_parallel_group())
    found = next((stage for stage in reversed(stages) if stage is not None), None) or []
    return {f"mtp_{depth} loss": value for depth, value in enumerate(found, start=1)}


def _reduce_losses(store: list, device, read: int = 0) -> tuple[float, float, int]:
    """(loss, loss tokens, tokens read) over the global batch: sum reports, all-reduce over
    data x context parallel ranks (as Megatron-LM: each context-parallel rank reports its
    tokens' part); ``read``: the tokens of the micro-batches this rank read (each
    context-parallel rank of a replica reads the same ones)."""
    from megatron.core import parallel_state

    total = torch.zeros(3, dtype=torch.float64, device=device)
    for entry in store:
        total[:2] += entry["lm loss"].to(device=device, dtype=torch.float64)
    total[2] = read / parallel_state.get_context_parallel_world_size()
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        dist.all_reduce(total, group=parallel_state.get_data_parallel_group(
            with_context_parallel=True))
    # Everyone learns the loss (the last stage has it).
    last = parallel_state.get_pipeline_model_parallel_last_rank()
    dist.broadcast(total, src=last, group=parallel_state.get_pipeline_model_parallel_group())
    return (total[0] / total[1].clamp(min=1)).item(), total[1].item(), round(total[2].item())


def _stage_peaks(memory: PeakMemory, device) -> list[float]:
    """Peak GiB above the window's start, per pipeline stage (max over the stage's ranks)."""
    from megatron.core import parallel_state

    stage = parallel_state.get_pipeline_model_parallel_rank()
    mine = torch.tensor([stage, memory.peak_above_baseline() / 2**30], dtype=torch.float64,
                        device=device)
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    peaks = [0.0] * parallel_state.get_pipeline_model_parallel_world_size()
    for value in everyone:
        peaks[int(value[0])] = max(peaks[int(value[0])], value[1].item())
    return peaks


def _weights_digests(model: list) -> list[str]:
    """SHA-256 of every rank's parameters (bytes, in name order), by global rank.

    Equal digests mean bit-identical weights (resume tests compare them).
    """
    digest = hashlib.sha256()
    for i, chunk in enumerate(model):
        for name, param in sorted(chunk.named_parameters()):
            digest.update(f"{i}.{name}".encode())
            digest.update(param.detach().float().cpu().contiguous().numpy().tobytes())
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, digest.hexdigest())
    return everyone


def _schedule_name(args) -> str:
    """The schedule as the logs and the summary name it."""
    if not args.seq1f1b:
        return ("Megatron-Core interleaved 1F1B" if args.virtual_pipeline_model_parallel_size
                else "Megatron-Core 1F1B" if args.pipeline_model_parallel_size > 1
                else "Megatron-Core (no pipelining)")
    if args.seq1f1b_segment_tokens is not None:
        budget = args.seq1f1b_segment_tokens  # the most a micro-batch of the sequence gets
        most = args.seq1f1b_splits
        if isinstance(most, int):
            most = min(most, -(-args.schedule_seq_length // budget))
        return (f"Seq1F1B segments of <= {budget} tokens (k <= {most}, "
                f"{args.seq1f1b_partition}, {args.seq1f1b_schedule})")
    if "--seq1f1b-split-lengths" in getattr(args, "given_flags", ()):
        cut = "lengths " + ",".join(map(str, args.seq1f1b_split_lengths))
    else:
        cut = args.seq1f1b_partition
    return f"Seq1F1B k={args.seq1f1b_splits} ({cut}, {args.seq1f1b_schedule})"


def _documents_note(args) -> str:
    """How this run keeps documents apart (the start-up line)."""
    if args.documents is None:
        return ""
    where = ("the dataset's cu_seqlens" if args.documents == "dataset"
             else "end-of-document tokens")
    if args.packed_documents:
        how = "packed THD batches" + (
            f" ({args.micro_batch_size} samples flattened into {args.schedule_seq_length} "
            "tokens)" if args.micro_batch_size > 1 else "")
    elif data.dense_document_mask(args):
        how = "a dense document mask"
    else:
        how = "Seq1F1B's documents"
    return f"; documents from {where} as {how}"


def _print(message: str) -> None:
    if dist.get_rank() == dist.get_world_size() - 1:
        print(message, flush=True)


def pretrain(forward_step_func: Callable, model_provider: Callable, argv=None) -> dict:
    """Parse flags, set up, train, evaluate, save; returns the summary (all ranks).

    Process groups are destroyed before returning: gloo groups left to the
    interpreter's exit can abort a successful run ("terminate called without an
    active exception", seen about once in 20 runs on CPU).
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    data.quiet_logs()  # first: the --data-path checks import Megatron-Core's datasets
    args = arguments.parse(argv, world_size)
    device = setup.init_distributed(args)
    summary = _train(args, forward_step_func, model_provider, device, world_size)
    setup.shutdown()  # not after a failure: a peer may be gone, and the error should surface
    return summary


def _train(args, forward_step_func: Callable, model_provider: Callable, device,
           world_size: int) -> dict:
    config = setup.transformer_config(args)
    model = setup.build_model(args, config, model_provider)
    optimizer, scheduler = setup.build_optimizer(args, model)
    iteration = checkpoint.load(args, model, optimizer, scheduler) if args.load else 0

    tokenizer = data.make_tokenizer(args)
    eval_runs = (args.train_iters // args.eval_interval + 1) if args.eval_interval else 1
    train_ds, valid_ds = data.build_datasets(
        args, tokenizer,
        train_samples=args.train_iters * args.global_batch_size,
        eval_samples=eval_runs * args.eval_iters * args.global_batch_size,
    )
    if args.seq1f1b and args.seq1f1b_splits == AUTO:
        choice = auto_plan.choose(args, model, forward_step_func, train_ds)
        _print(f"> Seq1F1B plan (--seq1f1b-splits auto; costs: {choice.source}):\n"
               f"{choice.table()}")
    train_iter, counted = data.data_iterators(args, train_ds, model,
                                              iteration * args.num_microbatches)
    forward_backward = _forward_backward_func(args)
    memory = PeakMemory(device)
    schedule = _schedule_name(args)
    variable = args.variable_seq_lengths is not None
    _print(f"> training with {schedule} schedule: world {world_size}, tp "
           f"{args.tensor_model_parallel_size}, pp {args.pipeline_model_parallel_size}, vpp "
           f"{args.virtual_pipeline_model_parallel_size}, cp {args.context_parallel_size}, dp "
           f"{args.data_parallel_size}, "
           f"{args.num_microbatches} micro-batches of {args.micro_batch_size} x "
           f"{'up to ' if variable else ''}{args.seq_length} tokens"
           f"{'; ' + lengths.describe(args) if variable else ''}{_documents_note(args)}")
    for warning in [*args.startup_warnings, memory.warning]:
        if warning:
            _print(f"> warning: {warning}")

    # With --timeline-dir every iteration after the first (warm-up) is timed per action, so
    # that a summary's bubble and busy time are medians, not one iteration's; the last one
    # is also drawn.
    records, times, read, timeline, timelines = [], [], [], None, []
    while iteration < args.train_iters:
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        memory.reset()
        recorder = None
        if args.timeline_dir and (iteration >= 1 or args.train_iters == 1):
            from megatron_seq1f1b.runtime.trace import TimelineRecorder

            recorder = TimelineRecorder()
        start = time.perf_counter()
        with (_timed(args, model, recorder) if recorder else contextlib.nullcontext(
                forward_backward)) as run:
            store = run(
                forward_step_func=forward_step_func, data_iterator=train_iter, model=model,
                num_microbatches=args.num_microbatches, seq_length=args.schedule_seq_length,
                micro_batch_size=args.schedule_micro_batch_size, decoder_seq_length=None,
                forward_only=False,
            )
        success, grad_norm, _ = optimizer.step()
        if success:
            scheduler.step(increment=1)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        iteration += 1
        loss, _, tokens = _reduce_losses(store, device, counted.take())
        peaks = _stage_peaks(memory, device)
        times.append(elapsed)
        read.append(tokens)
        record = {
            "iteration": iteration, "lm_loss": loss, "lr": optimizer.param_groups[0]["lr"],
            "grad_norm": grad_norm, "tokens": tokens,
            "ms_per_iter": elapsed * 1e3, "tokens_per_s": tokens / elapsed,
            "peak_gib_per_stage": peaks,
        }
        if args.num_experts:
            record["moe_losses"] = _moe_losses(args)
        if args.mtp_num_layers:
            record["mtp_losses"] = _mtp_losses(args)
        records.append(record)
        if recorder is not None:  # after the iteration's time was taken
            timeline = _write_timeline(args, recorder, schedule,
                                       picture=iteration == args.train_iters)
            timelines.append({key: timeline[key] for key in
                              ("makespan_s", "busy_s", "bubble_fraction")})
        if iteration % args.log_interval == 0 or iteration == args.train_iters:
            _print(
                f" iteration {iteration:6d}/{args.train_iters:6d} | lm loss: {loss:.6E} | "
                f"learning rate: {record['lr']:.3E} | grad norm: {grad_norm or 0:.3f} | "
                f"elapsed time per iteration (ms): {elapsed * 1e3:.1f} | tokens/s: "
                f"{tokens / elapsed:.0f} | peak mem per stage (GiB): "
                + " ".join(f"{p:.3f}" for p in peaks)
                + "".join(f" | {name}: {value:.6E}"
                          for name, value in record.get("moe_losses", {}).items())
                + "".join(f" | {name}: {value:.6E}"
                          for name, value in record.get("mtp_losses", {}).items())
            )
        if args.eval_interval and iteration % args.eval_interval == 0:
            evaluate(args, forward_step_func, forward_backward, model, valid_ds, device, iteration)
        if args.save and args.save_interval and iteration % args.save_interval == 0:
            checkpoint.save(args, iteration, model, optimizer, scheduler)
        if args.exit_interval and iteration % args.exit_interval == 0:
            _print(f"> exiting after iteration {iteration} (--exit-interval {args.exit_interval})")
            break
    if args.save:
        checkpoint.save(args, iteration, model, optimizer, scheduler)
    steady = times[1:] or times
    steady_tokens = read[1:] or read
    summary = {
        "schedule": schedule,
        "attention_backend": arguments.core_attention(args),
        "iterations": len(records),
        "final_lm_loss": records[-1]["lm_loss"] if records else None,
        "mean_ms_per_iter": 1e3 * sum(steady) / max(len(steady), 1),
        "tokens_per_s": sum(steady_tokens) / max(sum(steady), 1e-9),
        # Like the times, peaks skip the first iteration (it allocates optimizer state).
        "peak_gib_per_stage": [max(r["peak_gib_per_stage"][s] for r in records[1:] or records)
                               for s in range(len(records[0]["peak_gib_per_stage"]))]
        if records else [],
        "losses": [r["lm_loss"] for r in records],
    }
    if timeline is not None:
        summary["timeline"] = timeline  # the last iteration's, drawn
        summary["timelines"] = timelines  # every timed iteration's, for medians
    summary["weights_sha256"] = _weights_digests(model)
    shown = {k: v for k, v in summary.items() if k not in ("losses", "weights_sha256")}
    if timeline is not None:  # one cut per micro-batch: in the JSON log, not on the line
        shown["timeline"] = {k: v for k, v in timeline.items() if k != "segment_lengths"}
    _print(f"> summary: {json.dumps(shown)}")
    if args.log_json and dist.get_rank() == dist.get_world_size() - 1:
        with open(args.log_json, "w") as out:
            json.dump({"summary": summary, "iterations": records}, out, indent=1)
    return summary


def evaluate(args, forward_step_func, forward_backward, model, dataset, device, iteration) -> float:
    """Validation loss over --eval-iters global batches (forward only)."""
    for chunk in model:
        chunk.eval()
    consumed = (iteration // args.eval_interval - 1) * args.eval_iters * args.num_microbatches
    iterator, _ = data.data_iterators(args, dataset, model, max(consumed, 0), split="valid")
    total_loss = total_tokens = 0.0
    with torch.no_grad():
        for _ in range(args.eval_iters):
            store = forward_backward(
                forward_step_func=forward_step_func, data_iterator=iterator, model=model,
                num_microbatches=args.num_microbatches, seq_length=args.schedule_seq_length,
                micro_batch_size=args.schedule_micro_batch_size, decoder_seq_length=None,
                forward_only=True,
            )
            loss, tokens, _ = _reduce_losses(store, device)
            total_loss += loss * tokens
            total_tokens += tokens
    for chunk in model:
        chunk.train()
    value = total_loss / max(total_tokens, 1)
    _print(f" validation loss at iteration {iteration} | lm loss value: {value:.6E}")
    return value
