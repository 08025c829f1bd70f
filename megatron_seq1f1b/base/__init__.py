"""The ground floor: what every other floor may use, importing nothing of the package.

* :mod:`~megatron_seq1f1b.base.checks`: :class:`ConfigError` and the named configuration
  rules (segment multiples and lengths, model options, context parallelism, MoE), collected
  and reported at once before anything runs;
* :mod:`~megatron_seq1f1b.base.compat`: the small adapters over Megatron-Core's API changes
  from 0.16.1 to 0.19.x (nothing else in the package asks for a version);
* :mod:`~megatron_seq1f1b.base.flags`: numbers on every command line, checked where they are
  read and refused in one line.

May import: torch, Megatron-Core (lazily), the standard library; nothing of ``megatron_seq1f1b``.
"""
