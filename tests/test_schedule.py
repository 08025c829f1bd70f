"""Schedules as data: construction, Megatron equivalence, exhaustive validation."""

import pytest

from megatron_seq1f1b.schedules.plan import ACTIVATION, GRADIENT, Message, Step, plan_steps
from megatron_seq1f1b.schedules.replay import DeadlockError, ScheduleError, replay
from megatron_seq1f1b.schedules.schedule import (
    B, F, Action, build_schedule, format_schedule, parse_schedule,
)
from megatron_seq1f1b.schedules.validate import check_link_order, validate

import megatron_order


def test_action_text_round_trip():
    for action in (F(3, 1), B(0, 2, 1), F(12, 0, 3)):
        assert Action.parse(str(action)) == action
    assert str(F(3, 1)) == "F3.1" and str(B(0, 2, 1)) == "B0.2c1"


def test_schedule_text_round_trip():
    schedule = build_schedule(3, 2, 2)
    text = format_schedule(schedule)
    assert text.splitlines()[0].startswith("rank 0: F0.0 F0.1 F1.0")
    assert parse_schedule(text) == schedule


def test_known_schedule_p2_m2_k2():
    assert format_schedule(build_schedule(2, 2, 2)) == (
        "rank 0: F0.0 F0.1 F1.0 B0.1 F1.1 B0.0 B1.1 B1.0\n"
        "rank 1: F0.0 F0.1 B0.1 F1.0 B0.0 F1.1 B1.1 B1.0"
    )


def _megatron_orders(p, m):
    return megatron_order.record_1f1b(p, m)


@pytest.mark.parametrize("p,m", [(1, 3), (2, 1), (2, 4), (4, 2), (4, 8), (3, 5)])
def test_one_split_is_exactly_megatrons_1f1b(ranks, p, m):
    (orders,) = ranks.run(1, _megatron_orders, case=f"megatron-1f1b-p{p}-m{m}", p=p, m=m)
    ours = [[f"{a.kind}{a.microbatch}" for a in rank] for rank in build_schedule(p, m, 1)]
    assert ours == orders


def test_exhaustive_validation_p1_to_8_m1_to_16_k1_to_8():
    for p in range(1, 9):
        for m in range(1, 17):
            for k in range(1, 9):
                validate(build_schedule(p, m, k))


@pytest.mark.parametrize("p,m,k", [(1, 1, 1), (4, 3, 2), (8, 16, 8)])
def test_forward_only_schedules_validate(p, m, k):
    schedule = build_schedule(p, m, k, forward_only=True)
    assert all(a.is_forward for rank in schedule for a in rank)
    validate(schedule, forward_only=True)


def _swap(actions, i, j):
    actions = list(actions)
    actions[i], actions[j] = actions[j], actions[i]
    return actions


def test_validator_rejects_forward_segments_out_of_order():
    schedule = build_schedule(2, 2, 2)
    schedule[0] = _swap(schedule[0], 0, 1)
    with pytest.raises(ScheduleError, match=r"rank 0, action 0 \(F0.1\).*before segment 0"):
        validate(schedule)


def test_validator_rejects_backward_segments_in_forward_order():
    schedule = build_schedule(1, 1, 2)
    assert format_schedule(schedule) == "rank 0: F0.0 F0.1 B0.1 B0.0"
    schedule[0] = [F(0, 0), F(0, 1), B(0, 0), B(0, 1)]
    with pytest.raises(ScheduleError, match=r"reverse order; expected segment 1"):
        validate(schedule)


def test_validator_rejects_missing_and_duplicate_units():
    schedule = build_schedule(2, 2, 1)
    schedule[1] = schedule[1][:-1]
    with pytest.raises(ScheduleError, match="rank 1: backwards missing"):
        validate(schedule)
    schedule = build_schedule(2, 2, 1)
    schedule[0] = schedule[0] + [F(1)]
    with pytest.raises(ScheduleError, match="forwarded twice"):
        validate(schedule)


def test_validator_reports_deadlock_with_ranks_and_messages():
    # The first stage wants micro-batch 0's gradient before sending micro-batch 1,
    # the last stage wants micro-batch 1 before it computes that gradient.
    schedule = [[F(0), B(0), F(1), B(1)], [F(0), F(1), B(0), B(1)]]
    with pytest.raises(DeadlockError) as info:
        validate(schedule)
    text = str(info.value)
    assert "rank 0 before B0.0 waits for rank 1 to send grad 0.0 1->0" in text
    assert "rank 1 before F1.0 waits for rank 0 to send act 1.0 0->1" in text


def test_rendezvous_replay_reports_send_send_deadlock():
    # Both ranks send before they receive, in separate steps: with NCCL-like
    # rendezvous neither send can complete.
    a = Message(ACTIVATION, 0, 0, 0, src=0, dst=1)
    g = Message(GRADIENT, 0, 0, 0, src=1, dst=0)
    steps = [[Step((a,), (), ()), Step((), (g,), ())], [Step((g,), (), ()), Step((), (a,), ())]]
    with pytest.raises(DeadlockError) as info:
        replay(steps)
    text = str(info.value)
    assert "rank 0 at step 0 (final sends) waits for rank 1 to receive act 0.0 0->1" in text
    assert "(rank 1 is at step 0, final sends)" in text


def test_link_order_check_catches_reordered_receives():
    steps = plan_steps(build_schedule(2, 2, 1, forward_only=True))
    # Receiver swaps the order of its two receives: replay by name would succeed,
    # a real transport would put micro-batch 1's data into micro-batch 0.
    r1 = steps[1]
    steps[1] = [r1[1].__class__(r1[0].sends, r1[1].recvs, r1[0].actions),
                r1[0].__class__(r1[1].sends, r1[0].recvs, r1[1].actions)] + r1[2:]
    with pytest.raises(ScheduleError, match="sent as .* but received as"):
        check_link_order(steps)


@pytest.mark.parametrize("bad", [(0, 2, 2), (2, 0, 1), (2, 2, -1), (2, 2, 2, 0)])
def test_build_rejects_bad_sizes(bad):
    with pytest.raises(ValueError, match="positive integer"):
        build_schedule(*bad)


@pytest.mark.parametrize("p,m,k,v,name", [(4, 6, 3, 1, "zb-h2"), (3, 6, 2, 2, "1f1b"),
                                          (2, 4, 2, 2, "zb-h1"), (1, 2, 3, 1, "1f1b")])
def test_every_step_receives_and_sends_what_its_actions_need_and_make(p, m, k, v, name):
    """The plan derives its messages inline (its hot spot); they must be the ones
    input_message and output_message name, each sent in the step after its producer's and
    received no later than its consumer's."""
    from megatron_seq1f1b.schedules.plan import Topology, input_message, output_message

    schedule = build_schedule(p, m, k, v, schedule=name)
    topo = Topology(p, v)
    steps = plan_steps(schedule, v)
    for rank, rank_steps in enumerate(steps):
        received, previous_outputs = set(), ()
        for step in rank_steps:
            assert step.sends == previous_outputs
            received.update(step.recvs)
            assert {input_message(a, rank, topo) for a in step.actions} - {None} <= received
            previous_outputs = tuple(o for o in (output_message(a, rank, topo)
                                                 for a in step.actions) if o)
        assert [a for step in rank_steps for a in step.actions] == schedule[rank]
        assert received == {msg for a in schedule[rank]
                            for msg in [input_message(a, rank, topo)] if msg}
