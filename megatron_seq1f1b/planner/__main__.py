"""``python -m megatron_seq1f1b.planner``: plan k, partition and schedule offline."""

from megatron_seq1f1b.planner.cli import main

raise SystemExit(main())
