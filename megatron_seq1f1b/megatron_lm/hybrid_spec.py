"""Stack specs for Megatron-LM's ``pretrain_hybrid.py --spec MODULE NAME``.

Megatron-LM's hybrid builders take a ``--spec`` as a module and the name of a ``ModuleSpec``
in it (``megatron.core.transformer.spec_utils.import_module``), not a function to call. Here
are the project's local stack specs (:func:`~megatron_seq1f1b.runtime.hybrid_spec.
local_hybrid_stack_spec`: Megatron's own modules, no Transformer Engine) under such names:

* ``--spec megatron_seq1f1b.megatron_lm.hybrid_spec local``: Megatron's local core attention
  (with ``--seq1f1b --context-parallel-size`` > 1 the patched builder makes it Seq1F1B's CP
  form);
* ``--spec megatron_seq1f1b.megatron_lm.hybrid_spec flash``: the flash core attention
  (PyTorch SDPA; multi-latent attention layers ``+`` need it or Transformer Engine's).

MoE layers (``E``) take their expert count from the model's config.
"""

from megatron_seq1f1b.runtime.hybrid_spec import local_hybrid_stack_spec

local = local_hybrid_stack_spec(attention="local", num_experts=1)
flash = local_hybrid_stack_spec(attention="flash", num_experts=1)
