"""Seq1F1B forward-backward (non-interleaved) against no-pipelining training."""

import pytest

from gpt import DataSpec, ModelSpec, run_layout
from harness import COMM_TIMEOUT_S

ROPE = ModelSpec()
LEARNED = ModelSpec(position_embedding_type="learned_absolute")


def _check(results):
    problems = [f"rank {r['rank']}: {p}" for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems)
    assert any(r["entries"] for r in results), "no rank reported losses"


GRID = [
    (pp, k, partition, mbs)
    for pp in (1, 2, 4)
    for k in (1, 2, 3, 4)
    for partition in ("uniform", "balanced")
    for mbs in (1, 2)
    if not (k == 1 and partition == "balanced")
]


@pytest.mark.parametrize("pp,k,partition,mbs", GRID)
def test_seq1f1b_equals_no_pipelining(ranks, pp, k, partition, mbs):
    results = ranks.run(
        pp, run_layout, case=f"pp{pp}-k{k}-{partition}-mbs{mbs}", model=ROPE,
        data=DataSpec(num_microbatches=3, micro_batch_size=mbs), pp=pp,
        seq1f1b=dict(num_splits=k, partition=partition),
    )
    _check(results)


import pipeline_cases as cases  # noqa: E402
from megatron_seq1f1b.schedules.schedule import build_schedule  # noqa: E402
from megatron_seq1f1b.schedules.simulate import simulate  # noqa: E402


@pytest.mark.parametrize("pp,m", [(4, 1), (4, 2), (2, 1)])
def test_fewer_microbatches_than_stages(ranks, pp, m):
    results = ranks.run(pp, run_layout, case=f"small-m-pp{pp}-m{m}", model=ROPE,
                        data=DataSpec(num_microbatches=m), pp=pp,
                        seq1f1b=dict(num_splits=3, partition="balanced"))
    _check(results)


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("model", [ROPE, LEARNED], ids=["rope", "learned"])
def test_positions_and_per_token_loss(ranks, per_token, model):
    results = ranks.run(2, run_layout, case=f"pos-{model.position_embedding_type}-{per_token}",
                        model=model, data=DataSpec(num_microbatches=3), pp=2, per_token=per_token,
                        seq1f1b=dict(num_splits=4, partition="balanced"))
    _check(results)


@pytest.mark.parametrize("forward_only", [False, True], ids=["train", "forward-only"])
@pytest.mark.parametrize("window", [5, 19], ids=["window-5-under-a-segment", "window-19-over-two"])
def test_sliding_window(ranks, window, forward_only):
    """k=4 segments of 8 tokens; a window shorter than a segment and one longer than two."""
    results = ranks.run(2, run_layout, case=f"window-{window}-{forward_only}",
                        model=ModelSpec(extra=(("window_size", (window, 0)),)),
                        data=DataSpec(num_microbatches=3), pp=2, forward_only=forward_only,
                        seq1f1b=dict(num_splits=4, partition="balanced"))
    _check(results)


@pytest.mark.parametrize("forward_only", [False, True], ids=["train", "forward-only"])
def test_multi_latent_attention(ranks, forward_only):
    """MLA with RoPE, k=4 balanced (its attention cost is that of its up-projected heads)."""
    results = ranks.run(2, run_layout, case=f"mla-{forward_only}",
                        model=ModelSpec(mla=True, normalization="RMSNorm"),
                        data=DataSpec(num_microbatches=3), pp=2, forward_only=forward_only,
                        seq1f1b=dict(num_splits=4, partition="balanced"))
    _check(results)


def test_tp2_pp2_sequence_parallel(ranks):
    results = ranks.run(4, run_layout, case="tp2-pp2-sp", model=ModelSpec(num_query_groups=2),
                        data=DataSpec(num_microbatches=3), tp=2, pp=2, sp=True,
                        seq1f1b=dict(num_splits=3, partition="balanced"))
    _check(results)


def test_dp2_pp2_ddp_overlap_grad_reduce(ranks):
    results = ranks.run(4, run_layout, case="dp2-pp2-ddp", model=ROPE,
                        data=DataSpec(num_microbatches=3), pp=2,
                        ddp=dict(overlap_grad_reduce=True),
                        seq1f1b=dict(num_splits=2, partition="balanced"))
    _check(results)


def test_tied_embeddings_and_kept_outputs(ranks):
    results = ranks.run(4, run_layout, case="tied-no-dealloc",
                        model=ModelSpec(tied_embeddings=True), data=DataSpec(num_microbatches=2),
                        pp=4, config_overrides=dict(deallocate_pipeline_outputs=False),
                        seq1f1b=dict(num_splits=3, partition="uniform"))
    _check(results)


@pytest.mark.parametrize("distributed", [False, True], ids=["ddp", "distributed-optimizer"])
def test_optimizer_step_matches_reference(ranks, distributed):
    results = ranks.run(4, cases.optimizer_step, case=f"optimizer-{distributed}", pp=2, k=2,
                        distributed=distributed, model=ROPE, data=DataSpec(num_microbatches=2))
    assert not [p for r in results for p in r], results


@pytest.mark.parametrize("pp", [1, 2, 4])
def test_one_split_is_bit_identical_to_megatron(ranks, pp):
    results = ranks.run(pp, cases.bit_identical_k1, case=f"bitwise-pp{pp}", pp=pp, model=ROPE,
                        data=DataSpec(num_microbatches=4))
    assert not [p for r in results for p in r], results


@pytest.mark.parametrize("pp,k,m", [(4, 4, 4), (4, 2, 1), (2, 3, 5)])
def test_live_activations_peak_where_simulated(ranks, pp, k, m, tmp_path):
    png = tmp_path / "measured.png"
    results = ranks.run(pp, cases.peak_and_iterator, case=f"peak-{pp}-{k}-{m}", pp=pp, k=k, m=m,
                        model=ROPE, png=str(png))
    schedule = build_schedule(pp, m, k)
    expected = simulate(schedule).peak_inflight
    for r in results:
        assert r["peak"] == expected[r["pp_rank"]], (r, expected)
        assert r["computed"] == [str(a) for a in schedule[r["pp_rank"]]]
        assert r["next_calls"] == m  # the caller's iterator advanced once per micro-batch
        # The recorded timeline of the real run, all ranks, as the simulator's pictures use it.
        assert r["gathered"] == [[str(a) for a in rank] for rank in schedule] and r["ordered"]
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_forward_only_evaluation(ranks):
    results = ranks.run(2, cases.forward_only, case="forward-only", pp=2, k=3, model=ROPE,
                        data=DataSpec(num_microbatches=3))
    for r in results:
        assert r["grad_sum"] == 0.0
        if "loss_err" in r:
            assert r["loss_err"] < 1e-4 and r["collected"] == [3] * 3


def test_bad_configurations_fail_fast_with_their_rule(ranks):
    results = ranks.run(2, cases.configuration_errors, case="config-errors", model=ROPE)
    expected = {
        "not_enabled": "call megatron_seq1f1b.enable(model)",
        "lengths_sum": "sum to 20, not the sequence length 32",
        "adjust_shapes": "adjust_tensor_shapes_fn",
        "variable_seq_lengths": "with variable_seq_lengths each micro-batch is cut by its own",
        "overlap_p2p": "overlap_p2p_comm needs model chunks",
        "sp_divisibility": "divisible by the tensor-parallel size 2",
    }
    for r in results:
        for name, fragment in expected.items():
            message, seconds = r[name]
            assert message is not None and fragment in message, (name, message)
            assert "ConfigError" in message and seconds < 2, (name, seconds)
    # Only the last stage sees the loss; its neighbour fails on the broken link, fast.
    last, first = results[1]["two_tuple_loss"], results[0]["two_tuple_loss"]
    assert "Return Megatron's triple" in last[0], last
    assert first[0] is not None and first[1] < 30, first


def test_stages_with_different_schedules_are_rejected_before_p2p(ranks):
    results = ranks.run(2, cases.schedule_disagreement, case="disagree", model=ROPE)
    for r in results:
        assert r["error"] and "ConfigError" in r["error"] and "pipeline stages [1]" in r["error"], r
        assert r["seconds"] < 5, r


def test_a_stage_refusing_for_its_own_reasons_stops_every_stage_before_p2p(ranks):
    results = ranks.run(2, cases.stage_local_refusal, case="stage-refuses", model=ROPE)
    refusing, waiting = results[1], results[0]
    assert refusing["error"] and "not prepared for segments" in refusing["error"], refusing
    assert waiting["error"] and "ConfigError" in waiting["error"], waiting
    assert "pipeline stage(s) [1] refused this call" in waiting["error"], waiting
    assert all(r["seconds"] < 5 for r in results), results


def test_lost_p2p_message_raises_naming_rank_and_action_instead_of_hanging(ranks):
    results = ranks.run(2, cases.p2p_lost_message, case="lost-message", model=ROPE, timeout_s=4)
    waiting = results[1]
    assert waiting["error"] and "PipelineCommError" in waiting["error"], results
    assert "rank 1 (pipeline stage 1)" in waiting["error"], waiting
    assert "receive act 1.1 0->1" in waiting["error"] and "before F1.1" in waiting["error"], waiting
    assert all(r["seconds"] < 30 for r in results), results


@pytest.mark.parametrize("pp,vpp,k", [(4, None, 3), (2, None, 2), (4, 2, 2)],
                         ids=["pp4", "dp2-pp2", "pp4-vpp2"])
def test_links_transport_equals_no_pipelining(ranks, pp, vpp, k):
    """NCCL's transport (a process group per link direction) run on gloo: same results, the
    links made once for every pipeline of the world (two pipelines with dp2)."""
    results = ranks.run(4, cases.with_links_transport, case=f"links-pp{pp}-vpp{vpp}",
                        model=ModelSpec(num_layers=8), data=DataSpec(num_microbatches=4),
                        pp=pp, vpp=vpp, seq1f1b=dict(num_splits=k, partition="balanced"))
    _check(results)
    expected = {4: [(0, 1), (1, 0), (1, 2), (2, 1), (2, 3), (3, 2)], 2: [(0, 1), (1, 0)]}[pp]
    if vpp:
        expected = sorted(expected + [(3, 0), (0, 3)])
    for r in results:  # each rank holds the links it is an end of
        assert r["links"] == [link for link in expected if r["pp_rank"] in link], r["links"]
        # with the pipeline group's timeout (Megatron's distributed_timeout_minutes)
        assert r["link_timeouts_s"] == [COMM_TIMEOUT_S], r["link_timeouts_s"]


def test_link_order_is_one_order_both_ends_of_every_link_agree_on():
    """Each rank posts a step's transfers with the lower links first, so two neighbours
    never each wait on their own send first (were a GPU to run them one at a time)."""
    from megatron_seq1f1b.runtime.p2p import link_order
    from megatron_seq1f1b.schedules.plan import Message

    def msg(src, dst, kind="act"):
        return Message(kind, 0, 0, 0, src, dst)

    # stage 1 of 4 exchanging both ways with both neighbours in one step
    posted = sorted([msg(1, 2), msg(1, 0, "grad"), msg(0, 1), msg(2, 1, "grad")], key=link_order)
    assert [(m.src, m.dst) for m in posted] == [(0, 1), (1, 0), (1, 2), (2, 1)]
    # both ends of a link give its messages the same key
    assert link_order(msg(2, 3)) == link_order(msg(2, 3)) < link_order(msg(3, 2))
    # the wrap-around link (last -> first) sorts with stage 0's links
    assert link_order(msg(3, 0)) < link_order(msg(1, 2))


def test_links_transport_posts_in_link_order(monkeypatch):
    """The links transport posts a step's transfers in ``link_order`` (not sends first), and
    two messages of one link direction in the step's own order (NCCL matches them so)."""
    import torch

    from megatron_seq1f1b.runtime import p2p
    from megatron_seq1f1b.schedules.plan import Message, Step

    posted = []
    monkeypatch.setattr(p2p.dist, "isend", lambda t, dst, group: posted.append(("send", group,
                                                                                 int(t))))
    monkeypatch.setattr(p2p.dist, "irecv", lambda t, src, group: posted.append(("recv", group,
                                                                                int(t))))
    links = {(a, b): f"{a}->{b}" for a, b in [(0, 1), (1, 0), (1, 2), (2, 1)]}
    peers = p2p.Peers(pp_rank=1, pp_size=3, global_rank=1, stage_to_global=[0, 1, 2],
                      group=None, sync_after_batch=False, links=links)
    sends = (Message("act", 0, 0, 0, 1, 2), Message("act", 0, 1, 0, 1, 2),
             Message("grad", 0, 0, 0, 1, 0))
    recvs = (Message("grad", 1, 0, 0, 2, 1), Message("act", 1, 0, 0, 0, 1))
    step = Step(sends=sends, recvs=recvs, actions=())
    received = {m: torch.tensor(10 + i) for i, m in enumerate(recvs)}
    p2p._post(step, peers, [torch.tensor(i) for i in range(3)], received)
    assert posted == [("recv", "0->1", 11), ("send", "1->0", 2), ("send", "1->2", 0),
                      ("send", "1->2", 1), ("recv", "2->1", 10)]


@pytest.mark.parametrize("vpp,k,schedule,forward_only", [
    (None, 2, "zb-h1", False), (None, 3, "zb-h2", False), (2, 3, "zb-h1", False),
    (2, 2, "1f1b", True), (None, 3, "1f1b", True)])
def test_links_transport_zero_bubble_and_forward_only(ranks, vpp, k, schedule, forward_only):
    """More of the links transport on gloo (pp=4): zero-bubble steps, whose sends and
    receives fall unevenly, interleaved wrap-around, evaluation."""
    results = ranks.run(4, cases.with_links_transport,
                        case=f"links-{vpp}-{k}-{schedule}-{forward_only}",
                        model=ModelSpec(num_layers=8), data=DataSpec(num_microbatches=4), pp=4,
                        vpp=vpp, forward_only=forward_only,
                        seq1f1b=dict(num_splits=k, partition="balanced", schedule=schedule))
    _check(results)


def test_segment_multiple_rounds_lengths_and_stays_exact(ranks):
    """segment_multiple=8 (what 64 is on CUDA, at this model's size): 32 tokens in 3 balanced
    segments become multiples of 8, still equal to no pipelining."""
    results = ranks.run(2, cases.with_setup_lengths, case="segment-multiple", model=ROPE,
                        data=DataSpec(num_microbatches=3), pp=2,
                        seq1f1b=dict(num_splits=3, partition="balanced", segment_multiple=8))
    _check(results)
    for r in results:
        assert sum(r["lengths"]) == 32 and all(n % 8 == 0 for n in r["lengths"]), r["lengths"]
