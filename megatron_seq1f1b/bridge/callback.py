"""The Megatron-Bridge callback that runs Bridge's loop with Seq1F1B's schedule.

Bridge's ``train`` and ``eval`` modules import Megatron-Core's ``get_forward_backward_func`` by
name when they are imported, and ``train()`` calls it once, before its loop (``evaluate()`` on
every evaluation). No configuration field chooses the schedule, so the callback replaces that
name in both modules, at ``on_data_init_start``: Bridge fires it after the model, optimizer and
checkpoint exist and before ``train()`` asks for the function. The model is prepared for
segments (:func:`megatron_seq1f1b.enable`) at the same moment, and in-batch packing (micro-batches
of their own lengths) is run as Megatron's ``variable_seq_lengths``. What Seq1F1B cannot run
through Bridge yet is refused there, by name, before any step (:func:`bridge_problems`).
"""

from __future__ import annotations

import importlib
import sys
from typing import Callable, Sequence

from megatron_seq1f1b.api import get_forward_backward_func
from megatron_seq1f1b.base.checks import raise_if
from megatron_seq1f1b.bridge.loading import load_bridge

load_bridge()
from megatron.bridge.training.callbacks import Callback  # noqa: E402 - after load_bridge

#: Bridge's modules that hold Megatron-Core's getter under its own name
BRIDGE_GETTER_HOLDERS = ("megatron.bridge.training.train", "megatron.bridge.training.eval")


def variable_lengths(model_config) -> bool:
    """Whether Bridge gives micro-batches of their own lengths: in-batch packing (with pipeline
    parallelism Bridge sets ``variable_seq_lengths`` for it; without, Megatron's schedule needs
    nothing, but Seq1F1B cuts every micro-batch by its own length only where the flag says so)."""
    return bool(getattr(model_config, "variable_seq_lengths", False)
                or getattr(model_config, "_enable_in_batch_packing", False))


def bridge_problems(cfg, model_config) -> list[str]:
    """What keeps Seq1F1B from running Bridge's loop with this configuration (empty: nothing).

    ``cfg``: Bridge's ``ConfigContainer`` (or anything with its fields); ``model_config``: the
    built model's ``TransformerConfig``.
    """
    problems = []
    model_cfg = getattr(cfg, "model", None)
    if getattr(model_cfg, "cuda_graph_impl", "none") == "full_iteration" or (
            getattr(model_config, "cuda_graph_impl", "none") == "full_iteration"):
        problems.append("full-iteration CUDA graphs (cuda_graph_impl='full_iteration') capture one "
                        "forward-backward function's launches; Seq1F1B's schedule is not captured: "
                        "use cuda_graph_impl='none' or 'transformer_engine'")
    if getattr(model_cfg, "moe_expert_rank_capacity_factor", None) is not None:
        problems.append("moe_expert_rank_capacity_factor wraps the schedule in Bridge's "
                        "PagedStashRunner, which reruns iterations Seq1F1B has not been tested "
                        "under: leave it unset")
    dist_train = getattr(model_cfg, "dist_train", None)
    if getattr(dist_train, "use_dist_train", False):
        problems.append("dist_train.use_dist_train makes Bridge call Megatron's 1F1B function "
                        "directly, past the getter Seq1F1B replaces")
    if (getattr(model_config, "context_parallel_size", 1) or 1) > 1:
        problems.append("context parallelism through Bridge's forward step: Bridge's get_batch "
                        "cuts the sequence for CP before Seq1F1B cuts segments; use "
                        "context_parallel_size=1 with Seq1F1B under Bridge")
    if getattr(model_config, "overlap_moe_expert_parallel_comm", False):
        problems.append("overlap_moe_expert_parallel_comm builds Megatron's combined 1F1B "
                        "schedule plans; Seq1F1B runs its own schedule: turn it off")
    train_cfg = getattr(cfg, "train", None)
    if getattr(train_cfg, "num_epochs", None) is not None:
        problems.append("train.num_epochs: Bridge does not fire on_data_init_start, where this "
                        "callback joins its loop, with num_epochs; set train_iters instead")
    return problems


class Seq1F1B(Callback):
    """Run Megatron-Bridge's ``pretrain()`` / ``finetune()`` with Seq1F1B.

    ``num_splits``, ``partition``, ``schedule``, ``split_lengths``, ``segment_multiple``,
    ``documents``: as :func:`megatron_seq1f1b.get_forward_backward_func`; ``documents="packed"``
    reads the documents of Bridge's packed batches (:func:`~.step.packed_documents`).
    ``segment_tokens``: a token budget per segment (``num_splits`` is then the most segments a
    micro-batch gets), for Bridge's in-batch packing, whose micro-batches have their own
    lengths (:func:`variable_lengths`; docs/variable_lengths.md). ``backward_by_documents``:
    a micro-batch's runs of documents go backward apart (with ``documents``; per-token loss).
    Use with :func:`megatron_seq1f1b.bridge.step`, which cuts each micro-batch into its
    segment. The arguments are checked here, before Bridge starts.
    """

    def __init__(self, num_splits: int, partition: str = "uniform", *, schedule: str = "1f1b",
                 split_lengths: Sequence[int] | None = None, segment_multiple: int | None = None,
                 documents=None, segment_tokens: int | None = None,
                 backward_by_documents: bool = False):
        kwargs = dict(split_lengths=split_lengths, schedule=schedule,
                      segment_multiple=segment_multiple)
        if documents == "packed":
            from megatron_seq1f1b.bridge.step import packed_documents

            documents = packed_documents
        kwargs["documents"] = documents
        if segment_tokens is not None:
            kwargs["segment_tokens"] = segment_tokens
        if backward_by_documents:
            kwargs["backward_by_documents"] = True
        self.function = get_forward_backward_func(num_splits, partition, **kwargs)
        self._replaced: dict[str, Callable] = {}

    def getter(self, pp_size=None, vp_size=None, schedule_pg_collection=None) -> Callable:
        """Megatron-Core's getter's signature, answering Seq1F1B's function."""
        return self.function

    def on_data_init_start(self, context) -> None:
        from megatron.core.utils import get_model_config

        from megatron_seq1f1b.runtime.model_hooks import enable

        model = list(context.model)
        config = get_model_config(model[0])
        raise_if(bridge_problems(context.state.cfg, config))
        if variable_lengths(config):  # in-batch packing: each micro-batch cut by its length
            config.variable_seq_lengths = True
        enable(model)
        self.install()

    def install(self) -> None:
        """Point Bridge's training and evaluation modules at Seq1F1B's function."""
        for name in BRIDGE_GETTER_HOLDERS:
            module = sys.modules.get(name) or importlib.import_module(name)
            current = module.get_forward_backward_func
            if current is not self.getter:
                self._replaced.setdefault(name, current)
                module.get_forward_backward_func = self.getter

    def uninstall(self) -> None:
        """Give Bridge's modules back the getter they had."""
        for name, original in list(self._replaced.items()):
            sys.modules[name].get_forward_backward_func = original
            del self._replaced[name]

    def on_train_start(self, context) -> None:
        train = sys.modules.get(BRIDGE_GETTER_HOLDERS[0])
        if train is not None and train.get_forward_backward_func is not self.getter:
            raise RuntimeError(
                "Seq1F1B: Bridge's training module no longer holds Seq1F1B's getter (something "
                "replaced it after on_data_init_start); its loop would run another schedule")
