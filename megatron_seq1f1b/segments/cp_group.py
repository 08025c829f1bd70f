"""The context-parallel group as segments meet it: collectives that name their peers on failure.

A segment's context-parallel ranks meet in attention (the K/V all-gather) and in the loss (a
micro-batch's token count). Both run their collectives through :func:`collective`, so that a
failed or vanished peer becomes one error naming this rank and the peers it waited for. A stage
rehearsed alone has a :class:`StandInGroup` instead of a process group: its collectives do
nothing, and the callers make up results of the real shapes.
"""

from __future__ import annotations


class StandInGroup:
    """A group of a stage rehearsed alone (:mod:`megatron_seq1f1b.planner.rehearse`): it has a size and
    a rank, and nothing to talk to. Collectives over it make up their results with the
    shapes the real ones have (a gather repeats this rank's part; a reduction keeps it)."""

    stand_in = True

    def __init__(self, size: int, rank: int, attention=None):
        self._size, self._rank = size, rank
        self.attention = attention  # a pipeline group's: the kind its stages' cut reads

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def is_stand_in(group) -> bool:
    return getattr(group, "stand_in", False)


class ContextParallelCommError(RuntimeError):
    """A context-parallel collective of a segment failed or timed out: a peer failed or is gone."""


def collective(what: str, group, call) -> None:
    """Run a CP collective; a failure (a dead or failed peer, the group's timeout) becomes an
    error naming this rank and the peers it waited for. Over a stand-in group: nothing."""
    import torch.distributed as dist

    if is_stand_in(group):
        return
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - re-raised with who and what
        me = dist.get_rank()
        peers = [r for r in dist.get_process_group_ranks(group) if r != me]
        raise ContextParallelCommError(
            f"Seq1F1B: rank {me}: the context-parallel {what} with ranks {peers} failed or "
            f"timed out (a peer failed or is gone): {type(exc).__name__}: {exc}") from exc
