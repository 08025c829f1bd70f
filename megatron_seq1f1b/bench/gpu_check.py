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
import dataclasses
import datetime
import gc
import importlib.metadata
import json
import math
import os
import platform
import re
import socket
import subprocess
import sys
import time
import traceback
from functools import partial
from pathlib import Path
from typing import Callable, Iterable, NamedTuple

import torch

from megatron_seq1f1b.base.flags import ArgumentParser, non_negative_int, positive_float, positive_int

FP32_RTOL = 1e-5
BF16_LOSS_RTOL = 1e-2
BF16_MIN_COSINE = 0.999
# Transformer Engine runs fp32 GEMMs in TF32 (10-bit mantissa; no switch), so two GEMM
# shapes differ by ~1e-3: its "fp32" is judged like bf16, with tighter limits.
TF32_LOSS_RTOL = 1e-3
TF32_MIN_COSINE = 0.9999
MAX_MEMORY_RATIO = 1.5
BACKENDS = ("local", "flash", "te")
DTYPES = ("fp32", "bf16")
FAULTS = ("none", "grad", "shift-mask")  # injected errors: the tests prove they are caught
SUMMARY_FILE = "gpu_check.json"
DEFAULT_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "pretrain_gpt.py"


# ---------------------------------------------------------------- results


@dataclasses.dataclass
class Check:
    """One row of the summary: what was checked, the verdict, and the numbers behind it."""

    name: str
    status: str  # "pass" | "fail" | "skip"
    summary: str  # one line: the deciding numbers, or why it failed / was skipped
    numbers: dict = dataclasses.field(default_factory=dict)
    seconds: float = 0.0


class Verdict(NamedTuple):
    status: str
    summary: str
    numbers: dict


def format_table(checks: Iterable[Check]) -> str:
    """A short fixed-width table, one line per check."""
    rows = [("check", "status", "seconds", "details")]
    rows += [(c.name, c.status.upper(), f"{c.seconds:.1f}", c.summary) for c in checks]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = [f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]}" for r in rows]
    lines.insert(1, "-" * max(len(line) for line in lines))
    return "\n".join(lines)


def counts(checks: Iterable[Check]) -> dict[str, int]:
    result = {"pass": 0, "fail": 0, "skip": 0}
    for check in checks:
        result[check.status] += 1
    return result


def write_summary(out_dir: Path, environment: dict, settings: dict, checks: list[Check],
                  seconds: float) -> Path:
    """gpu_check.json: environment, settings, every check; ``passed`` iff none failed."""
    tally = counts(checks)
    report = {
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "passed": tally["fail"] == 0,
        "counts": tally,
        "seconds": round(seconds, 1),
        "environment": environment,
        "settings": settings,
        "checks": [dataclasses.asdict(c) for c in checks],
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / SUMMARY_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=1, default=_jsonable) + "\n")
    tmp.replace(path)
    return path


def _jsonable(value):
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


# ---------------------------------------------------------------- comparisons


def max_relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|, per tensor, as the test suite compares.

    Relative to the tensor's largest entry, so entries near zero do not turn
    rounding into huge element-wise ratios.
    """
    if actual.shape != expected.shape:
        raise ValueError(f"shapes differ: {tuple(actual.shape)} vs {tuple(expected.shape)}")
    if actual.numel() == 0:
        return 0.0
    expected = expected.detach().double()
    scale = expected.abs().max().item()
    error = (actual.detach().double() - expected).abs().max().item()
    return error / max(scale, 1e-30)


def cosine_similarity(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine of two tensors as flat vectors; two zero tensors agree (1.0)."""
    a, b = a.detach().double().flatten(), b.detach().double().flatten()
    norm_a, norm_b = a.norm().item(), b.norm().item()
    if norm_a == 0.0 and norm_b == 0.0:
        return 1.0
    if norm_a == 0.0 or norm_b == 0.0:
        return 0.0
    return (a @ b).item() / (norm_a * norm_b)


def overall_cosine(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> float:
    """Cosine of all gradients concatenated into one vector (names as in `expected`)."""
    dot = norm_e = norm_a = 0.0
    for name, e in expected.items():
        e, a = e.detach().double().flatten(), actual[name].detach().double().flatten()
        dot += (e @ a).item()
        norm_e += (e @ e).item()
        norm_a += (a @ a).item()
    if norm_e == 0.0 and norm_a == 0.0:
        return 1.0
    if norm_e == 0.0 or norm_a == 0.0:
        return 0.0
    return dot / math.sqrt(norm_e * norm_a)


def _relative(actual: float, expected: float) -> float:
    if not (math.isfinite(actual) and math.isfinite(expected)):
        return math.inf
    return abs(actual - expected) / max(abs(expected), 1e-30)


def _gradient_problems(expected: dict, actual: dict) -> list[str]:
    """Parameters that lack a gradient on one side (both runs must produce the same set)."""
    problems = [f"{n}: no Seq1F1B gradient" for n in expected if actual.get(n) is None]
    problems += [f"{n}: no full-sequence gradient" for n in actual if expected.get(n) is None
                 and actual.get(n) is not None]
    return problems


def judge_exact(loss_full: float, loss_seq: float, grads_full: dict, grads_seq: dict,
                rtol: float = FP32_RTOL) -> Verdict:
    """fp32: the loss and every parameter gradient within `rtol` (relative, per tensor)."""
    problems = _gradient_problems(grads_full, grads_seq)
    loss_rel = _relative(loss_seq, loss_full)
    if not loss_rel <= rtol:
        problems.insert(0, f"loss {loss_seq:.8g} vs {loss_full:.8g} (rel {loss_rel:.1e})")
    errors = {n: max_relative_error(grads_seq[n], g) for n, g in grads_full.items()
              if g is not None and grads_seq.get(n) is not None}
    over = sorted((n for n, e in errors.items() if not e <= rtol), key=lambda n: -errors[n])
    worst = max(errors, key=errors.get) if errors else None
    numbers = {
        "criterion": f"loss and every gradient: max|diff| / max|full| <= {rtol:g}",
        "loss_full": loss_full, "loss_seq1f1b": loss_seq, "loss_rel_err": loss_rel,
        "params_compared": len(errors), "grad_max_rel_err": errors.get(worst, 0.0),
        "worst_param": worst, "params_over": over[:10], "params_over_count": len(over),
    }
    detail = (f"loss rel {loss_rel:.1e}; worst gradient rel {errors.get(worst, 0.0):.1e} "
              f"({worst}) of {len(errors)}; limit {rtol:g}")
    if over:
        problems.append(f"{len(over)} of {len(errors)} gradients over rel {rtol:g}, worst "
                        f"{errors[over[0]]:.1e} ({over[0]})")
    if problems:
        return Verdict("fail", "; ".join(problems), numbers)
    return Verdict("pass", detail, numbers)


def judge_cosine(loss_full: float, loss_seq: float, grads_full: dict, grads_seq: dict,
                 loss_rtol: float = BF16_LOSS_RTOL,
                 min_cosine: float = BF16_MIN_COSINE) -> Verdict:
    """bf16: loss within `loss_rtol`; overall gradient cosine >= `min_cosine` (judged);
    the smallest per-parameter cosine is reported."""
    problems = _gradient_problems(grads_full, grads_seq)
    loss_rel = _relative(loss_seq, loss_full)
    if not loss_rel <= loss_rtol:
        problems.insert(0, f"loss {loss_seq:.6g} vs {loss_full:.6g} (rel {loss_rel:.1e} > "
                           f"{loss_rtol:g})")
    names = [n for n, g in grads_full.items() if g is not None and grads_seq.get(n) is not None]
    per_param = {n: cosine_similarity(grads_seq[n], grads_full[n]) for n in names}
    errors = {n: max_relative_error(grads_seq[n], grads_full[n]) for n in names}
    overall = overall_cosine({n: grads_full[n] for n in names}, grads_seq) if names else 0.0
    lowest = min(per_param, key=per_param.get) if per_param else None
    below = sorted((n for n in names if not per_param[n] >= min_cosine), key=per_param.get)
    numbers = {
        "criterion": (f"loss rel <= {loss_rtol:g}; overall cosine (all gradients as one vector) "
                      f">= {min_cosine:g}; per-parameter minimum reported, not judged"),
        "loss_full": loss_full, "loss_seq1f1b": loss_seq, "loss_rel_err": loss_rel,
        "params_compared": len(names), "cosine_overall": overall,
        "cosine_min_param": per_param.get(lowest), "cosine_min_param_name": lowest,
        "params_below_min_cosine": below[:10], "params_below_min_cosine_count": len(below),
        "grad_max_rel_err": max(errors.values(), default=0.0),
        "worst_param": max(errors, key=errors.get) if errors else None,
    }
    if not overall >= min_cosine:
        problems.append(f"overall gradient cosine {overall:.6f} < {min_cosine:g}")
    if problems:
        return Verdict("fail", "; ".join(problems), numbers)
    low = "" if lowest is None else f", lowest parameter {per_param[lowest]:.5f} ({lowest})"
    return Verdict("pass", f"loss rel {loss_rel:.1e}; overall gradient cosine {overall:.6f}{low}",
                   numbers)


def judge_for(backend: str, dtype: str) -> Callable[..., Verdict]:
    """fp32 with Megatron's local layers: exact; bf16, and TE's TF32 "fp32": cosine."""
    if dtype == "bf16":
        return judge_cosine
    if backend == "te":
        return partial(judge_cosine, loss_rtol=TF32_LOSS_RTOL, min_cosine=TF32_MIN_COSINE)
    return judge_exact


def judge_memory(full_bytes: int, seq_bytes: int, max_ratio: float = MAX_MEMORY_RATIO) -> Verdict:
    """Seq1F1B's peak (above the run's start) at most `max_ratio` x the full sequence's."""
    mib = 2.0**20
    numbers = {"criterion": f"Seq1F1B peak <= {max_ratio:g} x full-sequence peak",
               "peak_full_mib": full_bytes / mib, "peak_seq1f1b_mib": seq_bytes / mib}
    if full_bytes <= 0:
        return Verdict("fail", "no allocation measured in the full-sequence run", numbers)
    ratio = seq_bytes / full_bytes
    numbers["ratio"] = ratio
    detail = (f"peak above start: full {full_bytes / mib:.1f} MiB, Seq1F1B "
              f"{seq_bytes / mib:.1f} MiB ({ratio:.2f}x; limit {max_ratio:g}x)")
    return Verdict("pass" if ratio <= max_ratio else "fail", detail, numbers)


def judge_trainer(log: dict | None, iterations: int, baseline: dict | None = None,
                  first_loss_rtol: float = BF16_LOSS_RTOL) -> Verdict:
    """A trainer run (its --log-json content): all iterations, finite falling losses; with a
    baseline run of the same weights and data, the same first loss."""
    if log is None:
        return Verdict("fail", "no --log-json written (see the run's log)", {})
    summary = log.get("summary", {})
    losses = list(summary.get("losses", []))
    numbers = {
        "iterations": len(losses), "losses": losses,
        "tokens_per_s": summary.get("tokens_per_s"),
        "mean_ms_per_iter": summary.get("mean_ms_per_iter"),
        "peak_gib_per_stage": summary.get("peak_gib_per_stage"),
    }
    problems = []
    if len(losses) != iterations:
        problems.append(f"{len(losses)} iterations logged, expected {iterations}")
    if not all(isinstance(x, (int, float)) and math.isfinite(x) for x in losses):
        problems.append("non-finite loss")
    elif losses and not losses[-1] < losses[0]:
        problems.append(f"loss did not fall ({losses[0]:.4f} -> {losses[-1]:.4f})")
    base_losses = list((baseline or {}).get("summary", {}).get("losses", []))
    if losses and base_losses:
        first_rel = _relative(losses[0], base_losses[0])
        pairs = list(zip(losses, base_losses))
        numbers.update(
            first_loss_rel_diff=first_rel,
            max_loss_rel_diff=max(_relative(a, b) for a, b in pairs),
            tokens_per_s_ratio=(summary.get("tokens_per_s") or 0.0)
            / max(baseline["summary"].get("tokens_per_s") or 0.0, 1e-9),
        )
        if not first_rel <= first_loss_rtol:
            problems.append(f"first loss {losses[0]:.6g} vs Megatron's {base_losses[0]:.6g} "
                            f"(rel {first_rel:.1e} > {first_loss_rtol:g})")
    if problems:
        return Verdict("fail", "; ".join(problems), numbers)
    detail = (f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; "
              f"{numbers['tokens_per_s'] or 0:.0f} tokens/s")
    if "tokens_per_s_ratio" in numbers:
        detail += (f" ({numbers['tokens_per_s_ratio']:.2f}x Megatron); loss curves within rel "
                   f"{numbers['max_loss_rel_diff']:.1e}")
    return Verdict("pass", detail, numbers)


# ---------------------------------------------------------------- environment


def cuda_problem() -> str | None:
    """Why this process cannot run the check on a GPU, in one line; None if it can."""
    if torch.version.cuda is None:
        return (f"torch {torch.__version__} is not a CUDA build: install PyTorch with CUDA "
                "and run this on a machine with an NVIDIA GPU")
    if not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        hint = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        return (f"CUDA is not available to torch {torch.__version__} (CUDA {torch.version.cuda})"
                f"{hint}: run this on a machine with an NVIDIA GPU and its driver")
    return None


def _version(distribution: str, *others: str) -> str | None:
    for name in (distribution, *others):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def environment(device: torch.device | None) -> dict:
    """Versions and the device (None: there is none); imports nothing beyond torch."""
    import megatron_seq1f1b

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "megatron_core": _version("megatron-core", "megatron_core"),
        "transformer_engine": _version("transformer-engine", "transformer_engine",
                                       "transformer-engine-torch"),
        "triton": _version("triton", "pytorch-triton"),
        "megatron_seq1f1b": megatron_seq1f1b.__version__,
        "megatron_seq1f1b_path": str(Path(megatron_seq1f1b.__file__).parent),
        "torch_matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "NVIDIA_TF32_OVERRIDE": os.environ.get("NVIDIA_TF32_OVERRIDE"),
        "TORCHDYNAMO_DISABLE": os.environ.get("TORCHDYNAMO_DISABLE"),  # scripts/gpu_check.sh
        "stale_wheel_replaced_by_checkout": os.environ.get("SEQ1F1B_STALE_WHEEL") == "1",
    }
    if device is not None and device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(
            device=props.name,
            capability=f"{props.major}.{props.minor}",
            device_memory_gib=round(props.total_memory / 2**30, 1),
            devices_visible=torch.cuda.device_count(),
            cudnn=torch.backends.cudnn.version(),
            nccl=_nccl_version(),
        )
    elif device is not None:
        env["device"] = "cpu (the tests' private path, not a GPU check)"
    else:
        env["device"] = None
    return env


def _nccl_version() -> str | None:
    try:
        version = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError):
        return None
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def transformer_engine_problem(timeout_s: float = 180.0) -> str | None:
    """Why Transformer Engine cannot be used here (None if it imports).

    Probed in a child process first: a TE build that does not match the
    driver or torch can crash the interpreter on import.
    """
    try:
        import importlib.util

        if importlib.util.find_spec("transformer_engine") is None:
            return "transformer_engine is not installed"
    except (ImportError, ValueError) as exc:
        return f"transformer_engine cannot be found: {exc}"
    try:
        probe = subprocess.run([sys.executable, "-c", "import transformer_engine.pytorch"],
                               capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"importing transformer_engine.pytorch took over {timeout_s:.0f} s"
    if probe.returncode != 0:
        lines = [line for line in probe.stderr.strip().splitlines() if line.strip()]
        return ("importing transformer_engine.pytorch failed: "
                + (lines[-1] if lines else f"exit status {probe.returncode}"))
    return None


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
