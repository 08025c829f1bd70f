"""Record the compute order of Megatron-Core's own schedules, without a real pipeline.

A fake pipeline group and a fake p2p communicator let Megatron's schedule
function run every pipeline rank's loop in one process; forward_step_func and
gradient hooks record which micro-batch is forwarded or backwarded when.
Needs torch.distributed initialized (Megatron reads ranks only then), so it
runs in a one-rank harness worker.
"""

from __future__ import annotations

import torch
from megatron.core.enums import ModelType
from megatron.core.pipeline_parallel import schedules
from megatron.core.transformer import TransformerConfig


class FakeGroup:
    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self):
        return self._rank

    def size(self):
        return self._size


class FakeP2P:
    """Answers every receive with a fresh tensor; sends go nowhere."""

    def __init__(self, rank: int, size: int, config):
        self.pp_group = FakeGroup(rank, size)
        self.config = config
        self.virtual_pipeline_model_parallel_size = config.virtual_pipeline_model_parallel_size

    # Read by Megatron-Core 0.19's schedules (properties of its P2PCommunicator).
    total_stages = property(lambda self: self.pp_group.size())
    current_stage = property(lambda self: self.pp_group.rank())
    is_pp_first_stage = property(lambda self: self.pp_group.rank() == 0)
    is_pp_last_stage = property(lambda self: self.pp_group.rank() == self.pp_group.size() - 1)

    @staticmethod
    def _like(shapes, make):
        # Megatron's communicator answers a list of shapes with a list of tensors.
        return [make() for _ in shapes] if isinstance(shapes, list) else make()

    def recv_forward(self, shapes, is_first_stage):
        act = lambda: None if is_first_stage else torch.zeros(1, requires_grad=True)
        return self._like(shapes, act)

    def recv_backward(self, shapes, is_last_stage):
        return self._like(shapes, lambda: None if is_last_stage else torch.ones(1))

    def send_forward(self, *args, **kwargs):
        pass

    def send_backward(self, *args, **kwargs):
        pass

    def send_forward_recv_backward(self, out, shapes, is_last_stage):
        return self.recv_backward(shapes, is_last_stage)

    def send_backward_recv_forward(self, grad, shapes, is_first_stage):
        return self.recv_forward(shapes, is_first_stage)


def fake_groups(rank: int, num_stages: int):
    """Megatron's ProcessGroupCollection (0.19 checks the type) holding fake groups."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    group = FakeGroup(0, 1)
    pgs = ProcessGroupCollection()
    pgs.tp, pgs.cp, pgs.dp_cp, pgs.embd, pgs.pos_embd = group, group, group, None, None
    pgs.pp = FakeGroup(rank, num_stages)
    return pgs


class Probe(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model_type = ModelType.encoder_or_decoder

    def set_input_tensor(self, tensor):
        pass


def record_1f1b(num_stages: int, num_microbatches: int) -> list[list[str]]:
    """Megatron's non-interleaved 1F1B order for every rank, as 'F3' / 'B3' strings."""
    orders = []
    for rank in range(num_stages):
        config = TransformerConfig(
            num_layers=1, hidden_size=8, num_attention_heads=1,
            pipeline_model_parallel_size=num_stages, pipeline_dtype=torch.float32,
            deallocate_pipeline_outputs=False,
        )
        order: list[str] = []

        def forward_step(data_iterator, model, order=order):
            mb = next(data_iterator)
            leaf = torch.ones(1, requires_grad=True)
            leaf.register_hook(lambda grad, mb=mb: order.append(f"B{mb}"))
            order.append(f"F{mb}")
            out = leaf * 2
            return out, lambda output: (output.sum(), {"loss": output.detach()})

        pgs = fake_groups(rank, num_stages)
        schedules.forward_backward_pipelining_without_interleaving(
            forward_step_func=forward_step,
            data_iterator=iter(range(num_microbatches)),
            model=Probe(config),
            num_microbatches=num_microbatches,
            seq_length=1,
            micro_batch_size=1,
            p2p_communicator=FakeP2P(rank, num_stages, config),
            pg_collection=pgs,
        )
        orders.append(order)
    return orders


class FakeInterleavedP2P(FakeP2P):
    """The extra calls Megatron's interleaved schedule makes (batched, no overlap)."""

    @staticmethod
    def _act(recv):
        return torch.zeros(1, requires_grad=True) if recv else None

    def send_forward_recv_forward(self, output_tensor, recv_prev, tensor_shape,
                                  overlap_p2p_comm=False):
        return self._act(recv_prev)

    def send_backward_recv_backward(self, input_tensor_grad, recv_next, tensor_shape,
                                    overlap_p2p_comm=False):
        return torch.ones(1) if recv_next else None

    def send_forward_backward_recv_forward_backward(self, output_tensor, input_tensor_grad,
                                                    recv_prev, recv_next, tensor_shape):
        return self._act(recv_prev), (torch.ones(1) if recv_next else None)


def record_interleaved(num_stages: int, num_microbatches: int, num_chunks: int) -> list[list[str]]:
    """Megatron's interleaved 1F1B order per rank, as 'F3c1' / 'B0c0' strings."""
    orders = []
    for rank in range(num_stages):
        config = TransformerConfig(
            num_layers=num_stages * num_chunks, hidden_size=8, num_attention_heads=1,
            pipeline_model_parallel_size=num_stages,
            virtual_pipeline_model_parallel_size=num_chunks, pipeline_dtype=torch.float32,
            deallocate_pipeline_outputs=False,
        )
        order: list[str] = []

        def forward_step(data_iterator, model, order=order):
            mb, chunk = next(data_iterator)
            leaf = torch.ones(1, requires_grad=True)
            leaf.register_hook(lambda grad, tag=f"B{mb}c{chunk}": order.append(tag))
            order.append(f"F{mb}c{chunk}")
            return leaf * 2, lambda output: (output.sum(), {"loss": output.detach()})

        pgs = fake_groups(rank, num_stages)
        schedules.forward_backward_pipelining_with_interleaving(
            forward_step_func=forward_step,
            data_iterator=[iter([(mb, c) for mb in range(num_microbatches)])
                           for c in range(num_chunks)],
            model=[Probe(config) for _ in range(num_chunks)],
            num_microbatches=num_microbatches,
            seq_length=1,
            micro_batch_size=1,
            p2p_communicator=FakeInterleavedP2P(rank, num_stages, config),
            pg_collection=pgs,
        )
        orders.append(order)
    return orders
