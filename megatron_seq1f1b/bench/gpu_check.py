"""A prepared check for one NVIDIA GPU: the paths the CPU test suite cannot reach.

The suite proves Seq1F1B equal to full-sequence training on CPU (gloo,
fp32). NCCL, CUDA memory, bf16 and Transformer Engine attention exist only
on a GPU; this module runs them in a few minutes and writes one JSON summary::

    python -m megatron_seq1f1b.bench.gpu_check --out out/gpu_check

(``scripts/gpu_check.sh`` installs the wheels offline, then runs this.) In order:

1. Seq1F1B (pipeline size 1, ``--splits`` segments, one NCCL rank) against
   Megatron's no-pipelining schedule on the full sequence, same weights and
   batches, for each attention backend (Megatron's local attention; our SDPA
   flash attention, :mod:`megatron_seq1f1b.attention.flash`, whose fp32 runs on
   SDPA's efficient or math kernel and bf16 on its flash kernel, which a
   profiler check confirms for the segments; Transformer Engine's when it
   imports) and dtype. fp32: the loss and every
   parameter gradient within relative 1e-5. bf16: the loss within 1e-2
   relative and the cosine similarity of all gradients taken as one vector
   >= 0.999 (the smallest per-parameter cosine is reported, not judged:
   bf16 rounding alone moves small gradients). Transformer Engine computes
   fp32 GEMMs in TF32, so its fp32 run is judged the bf16 way with tighter
   limits (loss 1e-3, cosine 0.9999).
2. CUDA peak memory of both runs (:class:`megatron_seq1f1b.planner.peak_memory.PeakMemory`):
   with one pipeline stage both hold one micro-batch, Seq1F1B adds the carried
   K/V, so more than 1.5x the full sequence means caches outlive their use.
3. The trainer (``scripts/pretrain_gpt.py`` under torchrun, NCCL, bf16) for
   20 iterations with Megatron's schedule and with Seq1F1B: clean exit,
   finite falling losses, the same first loss (same weights and data), tokens/s.

Exit status: 0 when no check failed, 1 when one did, 2 when the run cannot
start (no CUDA, bad arguments). The JSON is rewritten after every check, so
a crash leaves the results so far.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import socket
import subprocess
import sys
import time
import traceback
from functools import partial
from pathlib import Path
from typing import Callable, NamedTuple

import torch

from megatron_seq1f1b.base.flags import ArgumentParser, non_negative_int, positive_float, positive_int
from megatron_seq1f1b.bench.gpu_environment import (
    cuda_problem, environment, transformer_engine_problem,
)
from megatron_seq1f1b.bench.gpu_verdicts import (
    Check, Verdict, counts, format_table, judge_for, judge_memory, judge_trainer,
    write_summary,
)

BACKENDS = ("local", "flash", "te")
DTYPES = ("fp32", "bf16")
FAULTS = ("none", "grad", "shift-mask")  # injected errors: the tests prove they are caught
DEFAULT_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "pretrain_gpt.py"


# ---------------------------------------------------------------- the Seq1F1B comparison


def model_flags(opts: argparse.Namespace) -> list[str]:
    """The model and batch, as trainer flags (shared by the comparison and the trainer runs)."""
    return [
        "--num-layers", str(opts.num_layers), "--hidden-size", str(opts.hidden_size),
        "--num-attention-heads", str(opts.num_attention_heads),
        "--seq-length", str(opts.seq_length), "--position-embedding-type", "rope",
        "--micro-batch-size", "1", "--global-batch-size", str(opts.microbatches),
        "--mock-data", "--vocab-size", str(opts.vocab_size), "--seed", str(opts.seed),
    ]


def seq1f1b_flags(opts: argparse.Namespace) -> list[str]:
    """Seq1F1B's plan, as trainer flags (the trainer refuses them without --seq1f1b)."""
    return ["--seq1f1b", "--seq1f1b-splits", str(opts.splits),
            "--seq1f1b-partition", opts.partition]


def _trainer_args(opts: argparse.Namespace, dtype: str) -> argparse.Namespace:
    from megatron_seq1f1b.trainer import arguments

    argv = model_flags(opts) + seq1f1b_flags(opts) + (["--bf16"] if dtype == "bf16" else [])
    return arguments.parse(argv, world_size=1)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_single_rank(opts: argparse.Namespace) -> torch.device:
    """One rank: NCCL on the GPU (gloo on the CPU test path) and Megatron's parallel state,
    through the trainer's own set-up."""
    from megatron_seq1f1b.trainer import data, setup

    data.quiet_logs()
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("WORLD_SIZE", "1"),
                       ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    if os.environ["WORLD_SIZE"] != "1":
        raise RuntimeError("the comparison runs on one rank: start it without torchrun")
    return setup.init_distributed(_trainer_args(opts, "fp32"))


def shutdown_single_rank() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _provider(backend: str) -> Callable:
    """A model provider (trainer signature) with Megatron's local or Transformer Engine spec."""

    def provider(args, config, pre_process=True, post_process=True, vp_stage=None):
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt import gpt_layer_specs

        if backend == "te":
            spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
        else:
            spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization=args.normalization)
        if backend == "flash":
            from megatron_seq1f1b.attention.flash import flash_layer_spec

            spec = flash_layer_spec(spec)
        return GPTModel(
            config=config, transformer_layer_spec=spec, vocab_size=args.vocab_size,
            max_sequence_length=args.max_position_embeddings, pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
            position_embedding_type=args.position_embedding_type, vp_stage=vp_stage,
        )

    return provider


def make_batches(opts: argparse.Namespace, device: torch.device) -> list[dict]:
    """Fixed random micro-batches; a quarter of the loss mask is zero, so segments (and
    micro-batches) hold different token counts and the loss normalization is exercised."""
    gen = torch.Generator().manual_seed(opts.seed)
    s, v = opts.seq_length, opts.vocab_size
    batches = []
    for _ in range(opts.microbatches):
        batch = {
            "tokens": torch.randint(0, v, (1, s), generator=gen),
            "labels": torch.randint(0, v, (1, s), generator=gen),
            "loss_mask": (torch.rand(1, s, generator=gen) > 0.25).float(),
            "position_ids": torch.arange(s).unsqueeze(0),
        }
        batches.append({k: t.to(device) for k, t in batch.items()} | {"attention_mask": None})
    return batches


def _loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Megatron-LM's GPT loss triple: (sum, token count, [sum, tokens] report)."""
    mask = loss_mask.reshape(-1).float()
    loss = torch.sum(output_tensor.float().reshape(-1) * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    report = torch.cat([loss.clone().detach().view(1), num_tokens.view(1).float()])
    return loss, num_tokens, {"lm loss": report}


def _forward_step(data_iterator, model, fault: str = "none"):
    import megatron_seq1f1b as s1

    batch = s1.slice_batch(next(data_iterator))
    mask = batch["loss_mask"]
    if fault == "shift-mask" and s1.current_segment() is not None:
        mask = mask.roll(1, dims=1)  # a slicing bug: each segment's mask off by one token
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                   labels=batch["labels"])
    return output, partial(_loss_func, mask)


class RunResult(NamedTuple):
    loss: float
    grads: dict
    peak_bytes: int
    seconds: float


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_schedule(forward_backward: Callable, model: list, batches: list[dict], opts,
                 memory, fault: str = "none") -> RunResult:
    """One forward-backward over `batches`: loss, every gradient (DDP's main_grad), peak
    memory above the start, seconds."""
    for chunk in model:
        chunk.zero_grad_buffer()
    device = batches[0]["tokens"].device
    memory.reset()
    start = time.perf_counter()
    store = forward_backward(
        forward_step_func=partial(_forward_step, fault=fault), data_iterator=iter(batches),
        model=model[0], num_microbatches=len(batches), seq_length=opts.seq_length,
        micro_batch_size=1, decoder_seq_length=None, forward_only=False,
    )
    _synchronize(device)
    seconds = time.perf_counter() - start
    peak = memory.peak_above_baseline()
    total = torch.stack([entry["lm loss"].double() for entry in store]).sum(dim=0)
    grads = {}
    for name, param in model[0].named_parameters():
        grad = getattr(param, "main_grad", None)
        grad = param.grad if grad is None else grad
        while name.startswith("module."):  # DDP (and Float16Module) wrappers
            name = name[len("module."):]
        grads[name] = None if grad is None else grad.detach().float().clone()
    return RunResult((total[0] / total[1]).item(), grads, peak, seconds)


def compare_backend(opts: argparse.Namespace, backend: str, dtype: str, device: torch.device,
                    fault: str = "none") -> list[Check]:
    """Seq1F1B vs the full sequence on one model: the equivalence and the memory checks."""
    import megatron_seq1f1b as s1
    from megatron.core.pipeline_parallel import schedules

    from megatron_seq1f1b.planner.peak_memory import PeakMemory
    from megatron_seq1f1b.trainer import setup

    start = time.monotonic()
    args = _trainer_args(opts, dtype)
    config = setup.transformer_config(args)
    model = setup.build_model(args, config, _provider(backend))  # s1.enable()d, DDP-wrapped
    batches = make_batches(opts, device)
    ours = s1.get_forward_backward_func(opts.splits, opts.partition)
    full_sequence = schedules.forward_backward_no_pipelining
    memory = PeakMemory(device)

    full = run_schedule(full_sequence, model, batches, opts, memory)
    seq = run_schedule(ours, model, batches, opts, memory, fault=fault)
    if fault == "grad":  # one gradient off by 1e-4 relative: the fp32 check must see it
        name = next((n for n in seq.grads if "linear_qkv.weight" in n), next(iter(seq.grads)))
        seq.grads[name].mul_(1 + 1e-4)
    compared = time.monotonic()
    # Memory and time from a second run of each, after first-use allocations (cuBLAS
    # workspaces, NCCL buffers) are out of the way.
    full_again = run_schedule(full_sequence, model, batches, opts, memory)
    seq_again = run_schedule(ours, model, batches, opts, memory, fault=fault)

    equal = judge_for(backend, dtype)(full.loss, seq.loss, full.grads, seq.grads)
    if backend == "te" and dtype == "fp32":
        equal.numbers["note"] = "Transformer Engine computes fp32 GEMMs in TF32"
        equal = equal._replace(summary=f"TF32 GEMMs: {equal.summary}")
    shared = {"backend": backend, "dtype": dtype, "splits": opts.splits,
              "partition": opts.partition, "microbatches": len(batches),
              "ms_full": full_again.seconds * 1e3, "ms_seq1f1b": seq_again.seconds * 1e3}
    if fault != "none":
        shared["injected_fault"] = fault
    mem = judge_memory(full_again.peak_bytes, seq_again.peak_bytes)
    if device.type != "cuda":  # the tests' CPU path: resident-set pages of a tiny model
        mem = Verdict("skip", f"not judged on CPU (resident-set noise): {mem.summary}",
                      mem.numbers)
    suffix = "" if fault == "none" else f" [fault {fault}]"
    extra = []
    if backend == "flash" and fault == "none":
        kernels = flash_kernels(ours, model, batches, opts)
        verdict = judge_flash_kernels(kernels, dtype, device.type == "cuda")
        extra.append(Check(f"flash kernels: {dtype}", verdict.status, verdict.summary,
                           {**shared, **verdict.numbers}))
    return extra + [
        Check(f"seq1f1b = full: {backend} {dtype}{suffix}", equal.status, equal.summary,
              {**shared, **equal.numbers}, compared - start),
        Check(f"peak memory: {backend} {dtype}{suffix}", mem.status, mem.summary,
              {**shared, **mem.numbers}, time.monotonic() - compared),
    ]


def flash_kernels(forward_backward: Callable, model: list, batches: list[dict], opts) -> dict:
    """CUDA kernels (name: count) of one Seq1F1B forward-backward, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA] if torch.cuda.is_available() else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        run_schedule(forward_backward, model, batches, opts, _NoMemory())
    names: dict[str, int] = {}
    for event in prof.events():
        if getattr(event, "device_type", None) is not None and "cuda" in str(
                event.device_type).lower():
            names[event.name] = names.get(event.name, 0) + 1
    return names


class _NoMemory:
    def reset(self) -> None:
        pass

    def peak_above_baseline(self) -> int:
        return 0


def judge_flash_kernels(kernels: dict, dtype: str, on_gpu: bool) -> Verdict:
    """bf16: PyTorch's flash kernel served the attention (segments over their prefix
    included); fp32 has no flash kernel: the efficient one (or the math path) is expected."""
    flash = {n: c for n, c in kernels.items() if "flash" in n.lower()}
    efficient = {n: c for n, c in kernels.items() if "fmha" in n.lower() or "efficient" in n.lower()}
    numbers = {"flash_kernels": flash, "efficient_kernels": efficient,
               "kernel_names": len(kernels)}
    if not on_gpu:
        return Verdict("skip", "kernels are only named on a GPU", numbers)
    if dtype == "bf16":
        if not flash:
            return Verdict("fail", "no flash attention kernel ran (SDPA fell back to another "
                                   "kernel)", numbers)
        return Verdict("pass", f"flash kernels: {sum(flash.values())} launches "
                               f"({', '.join(sorted(flash))[:120]})", numbers)
    served = "efficient" if efficient else "math (no fused attention kernel)"
    return Verdict("pass", f"fp32 served by SDPA's {served} path", numbers)


# ---------------------------------------------------------------- the trainer


def trainer_command(opts: argparse.Namespace, script: Path, log_json: Path, seq1f1b: bool,
                    port: int) -> list[str]:
    """torchrun, one process, NCCL, bf16, mock data: Megatron's schedule or Seq1F1B."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
        "--master-port", str(port), str(script), *model_flags(opts), "--bf16",
        "--train-iters", str(opts.train_iters), "--lr", "1e-3", "--lr-decay-style", "constant",
        "--log-interval", "5", "--log-json", str(log_json),
        *(seq1f1b_flags(opts) if seq1f1b else []),
    ]


def run_trainer(opts: argparse.Namespace, script: Path, out_dir: Path, seq1f1b: bool,
                timeout_s: float) -> tuple[dict | None, Path, str | None]:
    """(its --log-json content or None, the log file, why it failed or None)."""
    tag = "seq1f1b" if seq1f1b else "megatron"
    log_json, log_file = out_dir / f"trainer_{tag}.json", out_dir / f"trainer_{tag}.log"
    log_json.unlink(missing_ok=True)
    command = trainer_command(opts, script, log_json, seq1f1b, _free_port())
    env = dict(os.environ, SEQ1F1B_TIMEOUT_MINUTES="3")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)  # torchrun sets its own
    problem = None
    with open(log_file, "w") as log:
        log.write(" ".join(command) + "\n\n")
        log.flush()
        try:
            done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                  timeout=timeout_s)
            if done.returncode != 0:
                problem = f"exit status {done.returncode}: {_last_error(log_file)}"
        except subprocess.TimeoutExpired:
            problem = f"did not finish in {timeout_s:.0f} s"
    record = json.loads(log_json.read_text()) if log_json.exists() else None
    return record, log_file, problem


def _last_error(log_file: Path) -> str:
    """The trainer's own exception line (torchrun's ChildFailedError report comes after it)."""
    lines = [line.strip() for line in log_file.read_text(errors="replace").splitlines()]
    errors = [line for line in lines if re.match(r"[\w.]*(Error|Exception|Exit)\b.*:", line)
              and "ChildFailedError" not in line]
    return (errors or [line for line in lines if line] or ["(empty log)"])[-1][:300]


def check_trainer(opts: argparse.Namespace, script: Path, out_dir: Path,
                  timeout_s: float) -> list[Check]:
    """Megatron's schedule, then Seq1F1B (judged against it): 20 bf16 iterations each."""
    checks = []
    baseline = None
    for seq1f1b in (False, True):
        name = f"trainer: {'seq1f1b' if seq1f1b else 'megatron'} bf16, {opts.train_iters} iters"
        start = time.monotonic()
        record, log_file, problem = run_trainer(opts, script, out_dir, seq1f1b, timeout_s)
        verdict = judge_trainer(record, opts.train_iters, baseline if seq1f1b else None)
        status, summary = verdict.status, verdict.summary
        if problem is not None:
            status, summary = "fail", f"{problem} (log: {log_file})"
        numbers = {**verdict.numbers, "log": str(log_file)}
        checks.append(Check(name, status, summary, numbers, time.monotonic() - start))
        if not seq1f1b:
            baseline = record
    return checks


# ---------------------------------------------------------------- the run


def _comma_list(choices: tuple[str, ...]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        items = [item.strip() for item in text.split(",") if item.strip()]
        unknown = [item for item in items if item not in choices]
        if unknown or not items:
            raise argparse.ArgumentTypeError(
                f"{text!r}: give a comma-separated list of {', '.join(choices)}")
        return items

    return parse


def build_parser() -> ArgumentParser:
    p = ArgumentParser(
        prog="python -m megatron_seq1f1b.bench.gpu_check",
        description="Check Seq1F1B on one NVIDIA GPU (NCCL, bf16, CUDA memory, Transformer "
                    "Engine) and write gpu_check.json.",
        allow_abbrev=False,
    )
    p.add_argument("--out", required=True, help="folder for gpu_check.json and the trainer logs")
    p.add_argument("--pretrain-script", type=Path, default=DEFAULT_SCRIPT,
                   help="scripts/pretrain_gpt.py of a checkout (default: next to this package)")
    p.add_argument("--backends", type=_comma_list(BACKENDS), default=list(BACKENDS),
                   help="attention backends to compare (te is skipped if it does not import)")
    p.add_argument("--dtypes", type=_comma_list(DTYPES), default=list(DTYPES))
    p.add_argument("--no-trainer", action="store_true", help="skip the torchrun trainer runs")
    p.add_argument("--num-layers", type=positive_int, default=4)
    p.add_argument("--hidden-size", type=positive_int, default=256)
    p.add_argument("--num-attention-heads", type=positive_int, default=4)
    p.add_argument("--seq-length", type=positive_int, default=1024)
    p.add_argument("--vocab-size", type=positive_int, default=1024)
    p.add_argument("--microbatches", type=positive_int, default=2)
    p.add_argument("--splits", type=positive_int, default=4,
                   help="Seq1F1B segments per micro-batch (k)")
    p.add_argument("--partition", choices=["uniform", "balanced"], default="balanced")
    p.add_argument("--train-iters", type=positive_int, default=20)
    p.add_argument("--seed", type=non_negative_int, default=1234)
    p.add_argument("--time-budget-s", type=positive_float, default=420.0,
                   help="checks not started by then are skipped (default 420: with the "
                        "offline install the script stays under 8 minutes)")
    # Private, for tests/test_gpu_check.py only: the same comparison on CPU (gloo), and
    # injected errors that the comparison must catch.
    p.add_argument("--_device", choices=["cuda", "cpu"], default="cuda", help=argparse.SUPPRESS)
    p.add_argument("--_faults", type=_comma_list(FAULTS), default=["none"], help=argparse.SUPPRESS)
    return p


def _settings(opts: argparse.Namespace) -> dict:
    keys = ("backends", "dtypes", "num_layers", "hidden_size", "num_attention_heads",
            "seq_length", "vocab_size", "microbatches", "splits", "partition", "train_iters",
            "seed", "time_budget_s")
    settings = {key: getattr(opts, key) for key in keys}
    settings.update(pipeline_model_parallel_size=1, world_size=1,
                    trainer=not opts.no_trainer, pretrain_script=str(opts.pretrain_script))
    if opts._device != "cuda" or opts._faults != ["none"]:
        settings.update(private_device=opts._device, private_faults=opts._faults)
    return settings


def _one_line(exc: BaseException) -> str:
    """`Type: first line of the message` (full tracebacks go into the JSON)."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


class _Runner:
    """Runs checks in order under a time budget; records, prints and saves each result."""

    def __init__(self, opts: argparse.Namespace, environment_: dict):
        self.opts, self.environment = opts, environment_
        self.out_dir = Path(opts.out)
        self.checks: list[Check] = []
        self.start = time.monotonic()

    def remaining_s(self) -> float:
        return self.opts.time_budget_s - (time.monotonic() - self.start)

    def add(self, *checks: Check) -> None:
        for check in checks:
            self.checks.append(check)
            print(f"[gpu_check] {check.status.upper():4s} {check.name} ({check.seconds:.1f} s): "
                  f"{check.summary}", flush=True)
        self.save()

    def save(self) -> Path:
        return write_summary(self.out_dir, self.environment, _settings(self.opts), self.checks,
                             time.monotonic() - self.start)

    def run(self, names: list[str], work: Callable[[], list[Check]]) -> None:
        """`work` yields checks called `names`; an exception fails them all, with its reason."""
        if self.remaining_s() <= 0:
            self.add(*(Check(n, "skip", f"time budget of {self.opts.time_budget_s:.0f} s spent")
                       for n in names))
            return
        start = time.monotonic()
        try:
            checks = work()
        except Exception as exc:  # noqa: BLE001 - one broken check must not hide the others
            reason = _one_line(exc)
            trace = traceback.format_exc()
            checks = [Check(n, "fail", reason, {"traceback": trace}) for n in names]
        seconds = (time.monotonic() - start) / max(len(checks), 1)
        for check in checks:
            check.seconds = check.seconds or seconds
        self.add(*checks)


def run_comparisons(opts: argparse.Namespace, runner: _Runner, device: torch.device) -> None:
    """Seq1F1B vs the full sequence per backend and dtype (and the tests' injected faults)."""
    te_problem = None
    if "te" in opts.backends:
        te_problem = transformer_engine_problem()
    for backend in opts.backends:
        for dtype in opts.dtypes:
            for fault in opts._faults:
                suffix = "" if fault == "none" else f" [fault {fault}]"
                names = [f"seq1f1b = full: {backend} {dtype}{suffix}",
                         f"peak memory: {backend} {dtype}{suffix}"]
                if backend == "flash" and fault == "none":
                    names.insert(0, f"flash kernels: {dtype}")
                if backend == "te" and te_problem:
                    runner.add(*(Check(n, "skip", te_problem) for n in names))
                    continue
                runner.run(names, partial(compare_backend, opts, backend, dtype, device, fault))


def run_trainer_checks(opts: argparse.Namespace, runner: _Runner, on_gpu: bool) -> None:
    """The trainer under torchrun (after this process has let go of its models and NCCL)."""
    names = [f"trainer: {tag} bf16, {opts.train_iters} iters" for tag in ("megatron", "seq1f1b")]
    if opts.no_trainer:
        runner.add(*(Check(n, "skip", "not asked for (--no-trainer)") for n in names))
    elif not on_gpu:
        runner.add(*(Check(n, "skip", "bf16 training needs a GPU") for n in names))
    elif not opts.pretrain_script.is_file():
        runner.add(*(Check(n, "skip", f"no trainer script at {opts.pretrain_script} "
                                      "(--pretrain-script)") for n in names))
    else:
        timeout = max(min(240.0, runner.remaining_s() / 2), 30.0)
        runner.run(names, partial(check_trainer, opts, opts.pretrain_script, runner.out_dir,
                                  timeout))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    opts = parser.parse_args(argv)
    if opts.splits > opts.seq_length:
        parser.error(f"--splits {opts.splits}: --seq-length {opts.seq_length} has too few tokens "
                     "for that many segments")
    if opts.hidden_size % opts.num_attention_heads:
        parser.error(f"--hidden-size {opts.hidden_size} must divide by --num-attention-heads "
                     f"{opts.num_attention_heads}")
    out_dir = Path(opts.out)
    if opts._device == "cuda":
        problem = cuda_problem()
        if problem is not None:
            print(f"gpu_check: FAIL: {problem}", file=sys.stderr)
            write_summary(out_dir, environment(None), _settings(opts),
                          [Check("cuda", "fail", problem)], 0.0)
            return 2
    elif torch.cuda.is_available():
        print("gpu_check: --_device cpu is the tests' CPU path: hide the GPUs "
              "(CUDA_VISIBLE_DEVICES=)", file=sys.stderr)
        return 2

    # fp32 means fp32 for torch's own GEMMs (the default; set in case a site changed it).
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    runner = _Runner(opts, environment(torch.device("cuda", 0) if opts._device == "cuda"
                                       else torch.device("cpu")))
    runner.save()
    try:
        device = init_single_rank(opts)
    except Exception as exc:  # noqa: BLE001 - reported as a check, with its reason
        runner.add(Check("process group (NCCL, world size 1)", "fail", _one_line(exc),
                         {"traceback": traceback.format_exc()}))
        device = None
    if device is not None:
        runner.add(Check("process group (NCCL, world size 1)" if device.type == "cuda"
                         else "process group (gloo, world size 1)", "pass",
                         f"{torch.distributed.get_backend()} on {device}"))
        try:
            run_comparisons(opts, runner, device)
        finally:
            shutdown_single_rank()
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the trainer processes share this GPU
    run_trainer_checks(opts, runner, on_gpu=opts._device == "cuda")
    path = runner.save()
    tally = counts(runner.checks)
    print()
    print(format_table(runner.checks))
    print(f"\n{tally['pass']} passed, {tally['fail']} failed, {tally['skip']} skipped in "
          f"{time.monotonic() - runner.start:.0f} s on {runner.environment.get('device')}; "
          f"summary: {path}")
    return 1 if tally["fail"] else 0


if __name__ == "__main__":
    sys.exit(main())
