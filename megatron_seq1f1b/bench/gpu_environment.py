"""What the GPU check runs on: CUDA present and usable, the versions installed (torch,
CUDA, NCCL, Megatron-Core, Transformer Engine), and whether Transformer Engine imports."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch


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
