"""``python -m megatron_seq1f1b.megatron_lm``: the ``--seq1f1b`` flags' help and checks."""

from megatron_seq1f1b.megatron_lm.hooks import main

raise SystemExit(main())
