"""A schedule is data: partitions, per-rank action lists and everything that reads them.

Pure functions, no processes: the partitions of a micro-batch into segments
(:mod:`~megatron_seq1f1b.schedules.partition`), the actions (:mod:`~.actions`) and schedules
that order them (1F1B/Seq1F1B in :mod:`~.schedule`, :mod:`~.interleaved`, :mod:`~.zero_bubble`),
the point-to-point messages they imply (:mod:`~.plan`), and the tools that replay all ranks
together without running a model: validation (:mod:`~.validate`), simulation
(:mod:`~.simulate`, also ``python -m megatron_seq1f1b.simulate``), the shared replay
(:mod:`~.replay`) and the pictures (:mod:`~.draw`). The executor, the planner and the
benchmarks consume these same lists.

May import: :mod:`megatron_seq1f1b.base`; never ``torch.distributed`` or Megatron-Core.
"""
