"""How long a pipeline receive waits on gloo when posted late or a step ahead (two ranks).

Why: a step's receive posted only when it is needed waits for the sender's gloo thread,
which shares a core with the sender's compute; posted ahead (what
:class:`~megatron_seq1f1b.runtime.p2p.EarlyReceives` does on gloo) it completes during the
receiver's own compute. Rank 0 computes, sends one segment's activation, computes on;
rank 1 computes a little longer, then waits for it, having posted its receive either after
its compute (``late``, as Megatron's schedules and a plain step do) or before (``early``)::

    torchrun --nproc-per-node 2 -m megatron_seq1f1b.bench.p2p_latency --trials 20

Prints, per way of posting, the median and the longest wait in milliseconds (rank 1).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from megatron_seq1f1b.base.flags import non_negative_float, positive_int

WAYS = ("late", "early")


def _compute(matrix: torch.Tensor, ms: float) -> None:
    """Keep this rank's core busy for ``ms`` milliseconds."""
    start = time.perf_counter()
    while (time.perf_counter() - start) * 1e3 < ms:
        matrix @ matrix


def trial(way: str, message: torch.Tensor, matrix: torch.Tensor, compute_ms: float) -> float:
    """One send from rank 0 to rank 1; rank 1's wait in ms (0.0 on rank 0)."""
    dist.barrier()
    if dist.get_rank() == 0:
        _compute(matrix, compute_ms)
        work = dist.isend(message, 1)
        _compute(matrix, compute_ms)  # the sender is busy when the receiver asks
        work.wait()
        return 0.0
    buffer = torch.empty_like(message)
    work = dist.irecv(buffer, 0) if way == "early" else None
    _compute(matrix, compute_ms * 1.25)
    start = time.perf_counter()
    if work is None:
        work = dist.irecv(buffer, 0)
    work.wait()
    return (time.perf_counter() - start) * 1e3


def main(argv: list[str] | None = None) -> dict[str, tuple[float, float]]:
    """Run the trials under torchrun (two ranks); {way: (median, longest)} waits in ms
    (rank 1's; zeros on rank 0)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=positive_int, default=20,
                        help="sends per way (default 20)")
    parser.add_argument("--compute-ms", type=non_negative_float, default=20.0,
                        help="the sender's compute before and after its send (default 20)")
    parser.add_argument("--tokens", type=positive_int, default=256,
                        help="the message: [tokens, 1, hidden] fp32 (default 256)")
    parser.add_argument("--hidden", type=positive_int, default=256, help="(default 256)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        if dist.get_world_size() != 2:
            raise SystemExit("p2p_latency: run with torchrun --nproc-per-node 2")
        message = torch.randn(args.tokens, 1, args.hidden)
        matrix = torch.randn(256, 256)
        waits = {way: [trial(way, message, matrix, args.compute_ms) for _ in range(args.trials)]
                 for way in WAYS}
    finally:
        dist.destroy_process_group()
    return {way: (statistics.median(w), max(w)) for way, w in waits.items()}


if __name__ == "__main__":
    import os

    result = main()
    if os.environ.get("RANK") == "1":
        for way, (median, longest) in result.items():
            print(f"receive posted {way:5s}: wait median {median:.3f} ms, longest "
                  f"{longest:.3f} ms")
