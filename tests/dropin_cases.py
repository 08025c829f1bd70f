"""Megatron-Core's own forward-backward contract, with Seq1F1B installed at one segment.

The cases follow the forward-backward tests of Megatron-LM's
``tests/unit_tests/pipeline_parallel/test_schedules.py`` (core_v0.19.0) on CPU ranks: mock
models (a ``torch.nn.Linear`` with ``set_input_tensor``, not a GPTModel), ``seq_length=None``
without pipelining, loss functions that return two values, ``forward_only``, explicit process
groups. Each case runs the same calls through Megatron's own getter and through
``megatron_seq1f1b.install(1)``'s, and returns both results for the test to compare.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.model_parallel_config import ModelParallelConfig

from gpt import init_parallel

HIDDEN, SEQ, MBS = 8, 16, 2


def _getter():
    from megatron.core import pipeline_parallel

    return pipeline_parallel.get_forward_backward_func()


def _both(call) -> dict:
    """``call(forward_backward_func)`` with Megatron's function, then with install(1)'s."""
    import megatron_seq1f1b as s1

    torch.manual_seed(0)
    megatron = call(_getter())
    s1.install(1)
    try:
        ours = _getter()
        assert getattr(ours, "num_splits", None) == 1, "install(1) did not replace the getter"
        torch.manual_seed(0)
        seq1f1b = call(ours)
    finally:
        s1.uninstall()
    return {"megatron": megatron, "seq1f1b": seq1f1b}


def _mock_model(config: ModelParallelConfig, seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 1)
    model.model_type = "unit-test"
    model.set_input_tensor = lambda tensor: None
    model.config = config
    return model


def _rank() -> int:
    return torch.distributed.get_rank()


def no_pipelining() -> dict:
    """Megatron's first case: tp 2, pp 1, ``seq_length=None``, a (value, dict) loss; then a
    training step whose gradients must match."""
    from megatron.core.transformer import TransformerConfig

    init_parallel(tp=2, pp=1)
    # Megatron-Core 0.16's own schedule reads TransformerConfig fields when it trains.
    model = _mock_model(TransformerConfig(num_layers=1, hidden_size=4, num_attention_heads=1,
                                          pipeline_model_parallel_size=1))

    def step(data_iterator, model):
        next(data_iterator)

        def loss(output):
            return output.sum(), {"loss_reduced": _rank()}

        return model(torch.ones(1, 4)), loss

    def forward_only(func):
        return func(forward_step_func=step, data_iterator=iter(range(100)), model=[model],
                    num_microbatches=4, seq_length=None, micro_batch_size=None,
                    forward_only=True)

    def train(func):
        model.zero_grad(set_to_none=True)
        reports = func(forward_step_func=step, data_iterator=iter(range(100)), model=[model],
                       num_microbatches=3, seq_length=None, micro_batch_size=None)
        return reports, [p.grad.clone() for p in model.parameters()]

    out = {"forward_only": _both(forward_only), "train": _both(train)}

    import megatron_seq1f1b as s1

    try:  # segments on a model that cannot have them: refused, as before
        s1.get_forward_backward_func(2)(
            forward_step_func=step, data_iterator=iter(range(100)), model=[model],
            num_microbatches=1, seq_length=SEQ, micro_batch_size=MBS)
        out["segments"] = None
    except TypeError as exc:
        out["segments"] = str(exc)
    return out


def _pipeline_step(data_iterator, model):
    """Megatron's pipelined mock: activations made up on every stage, the rank as the loss."""

    def loss(output):
        return _rank(), {"loss_reduced": _rank()}

    return torch.rand(SEQ, MBS, HIDDEN), loss


def pipelining(explicit_groups: bool = False) -> dict:
    """pp 2 without interleaving, forward only; optionally with Megatron's explicit process
    groups (``pg_collection`` and ``p2p_communicator``)."""
    init_parallel(pp=2)
    config = ModelParallelConfig(pipeline_model_parallel_size=2, pipeline_dtype=torch.float)
    config.hidden_size = HIDDEN
    model = _mock_model(config)
    kwargs = {}
    if explicit_groups:
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
        from megatron.core.process_groups_config import ProcessGroupCollection

        groups = ProcessGroupCollection.use_mpu_process_groups()
        kwargs = {"pg_collection": groups,
                  "p2p_communicator": P2PCommunicator(groups.pp, config)}

    def call(func):
        return func(forward_step_func=_pipeline_step, data_iterator=None, model=[model],
                    num_microbatches=4, seq_length=SEQ, micro_batch_size=MBS,
                    forward_only=True, **kwargs)

    return _both(call)


def interleaving() -> dict:
    """pp 4 x vpp 2, forward only: Megatron's case, including its refusal of a micro-batch
    count the pipeline does not divide."""
    from megatron.core.enums import ModelType

    init_parallel(pp=4, vpp=2)
    config = ModelParallelConfig(pipeline_model_parallel_size=4, pipeline_dtype=torch.float,
                                 virtual_pipeline_model_parallel_size=2)
    config.hidden_size = HIDDEN
    model = _mock_model(config)
    model.model_type = ModelType.encoder_or_decoder

    def call(func):
        return func(forward_step_func=_pipeline_step, data_iterator=[iter(range(100))] * 2,
                    model=[model, model], num_microbatches=8, seq_length=SEQ,
                    micro_batch_size=MBS, decoder_seq_length=SEQ, forward_only=True)

    def refused(func):
        try:
            func(forward_step_func=_pipeline_step, data_iterator=[iter(range(100))] * 2,
                 model=[model, model], num_microbatches=7, seq_length=SEQ,
                 micro_batch_size=MBS, forward_only=True)
        except RuntimeError as exc:
            return type(exc).__name__
        return None

    return {"results": _both(call), "refused": _both(refused),
            "stages": parallel_state.get_pipeline_model_parallel_world_size()}
