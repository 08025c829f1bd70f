"""Seq1F1B with context parallelism: each segment spread over the CP group (two chunks per
rank, Megatron's load balancing within each segment), keys and values gathered over it,
against training without pipelining or CP on one rank."""

import dataclasses

import pytest

from gpt import DataSpec, ModelSpec, run_layout

ROPE = ModelSpec()
LEARNED = ModelSpec(position_embedding_type="learned_absolute")
GQA = ModelSpec(num_attention_heads=4, num_query_groups=2)
FLASH = dataclasses.replace(ROPE, attention="flash")  # CPU: the chunks in one call (spans)
FLASH_GQA = dataclasses.replace(GQA, attention="flash")  # CPU: one call per chunk
# multi-latent attention: the flash attention takes its key and value widths (CPU: per chunk)
MLA = ModelSpec(mla=True, normalization="RMSNorm", attention="flash")
MLA_YARN = dataclasses.replace(MLA, extra=(("rope_type", "yarn"),))
EOD = ROPE.vocab_size - 1
DOCUMENTS = (((0, 5, 20),), ((0, 3, 11, 12, 27),))


def _check(results):
    problems = [f"rank {r['rank']}: {p}" for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems)
    assert any(r["entries"] for r in results), "no rank reported losses"


LAYOUTS = {
    # CP 2 alone (2 ranks)
    "cp2_k1_local": dict(model=ROPE, seq1f1b=dict(num_splits=1)),
    "cp2_k2_learned_local": dict(model=LEARNED, seq1f1b=dict(num_splits=2, partition="uniform")),
    "cp2_k3_flash_gqa_balanced": dict(model=FLASH_GQA,
                                      seq1f1b=dict(num_splits=3, partition="balanced")),
    "cp2_k2_documents_flash": dict(model=FLASH_GQA, data=DataSpec(num_microbatches=2,
                                                                  documents=DOCUMENTS),
                                   seq1f1b=dict(num_splits=2, partition="uniform",
                                                documents=EOD)),
    # k=4 of 8 tokens: the documents starting at 5 and 12 each span three segments
    "cp2_k4_documents_spanning_local": dict(
        model=ROPE, data=DataSpec(num_microbatches=2, documents=DOCUMENTS),
        seq1f1b=dict(num_splits=4, partition="uniform", documents=EOD)),
    "cp2_k4_documents_spanning_flash": dict(
        model=FLASH, data=DataSpec(num_microbatches=2, documents=DOCUMENTS),
        seq1f1b=dict(num_splits=4, partition="uniform", documents=EOD)),
    "cp2_k3_mla_yarn_mbs2": dict(model=MLA_YARN, data=DataSpec(num_microbatches=2,
                                                               micro_batch_size=2),
                                 seq1f1b=dict(num_splits=3, partition="uniform")),
    "cp2_k2_local_mask_mbs2": dict(model=ROPE, data=DataSpec(num_microbatches=2,
                                                             micro_batch_size=2,
                                                             explicit_mask=True),
                                   seq1f1b=dict(num_splits=2, partition="uniform")),
    "cp2_k2_window_local": dict(model=dataclasses.replace(GQA, extra=(("window_size", (6, 0)),)),
                                seq1f1b=dict(num_splits=2, partition="uniform")),
    # pipeline 2 x CP 2, tensor 2 x CP 2 (4 ranks)
    "pp2_cp2_k3_flash": dict(model=FLASH, pp=2,
                             seq1f1b=dict(num_splits=3, partition="balanced")),
    "pp2_cp2_k1_learned_local": dict(model=LEARNED, pp=2, seq1f1b=dict(num_splits=1)),
    "pp2_cp2_k2_flash_gqa_uniform": dict(model=FLASH_GQA, pp=2,
                                         seq1f1b=dict(num_splits=2, partition="uniform")),
    "pp2_cp2_k3_mla_balanced": dict(model=MLA, pp=2,
                                    seq1f1b=dict(num_splits=3, partition="balanced")),
    "pp2_cp2_k2_zero_bubble_local": dict(model=ROPE, pp=2,
                                         seq1f1b=dict(num_splits=2, schedule="zb-h1")),
    "pp2_vpp2_cp2_k2_local": dict(model=ROPE, pp=2, vpp=2,
                                  config_overrides=dict(overlap_p2p_comm=True,
                                                        batch_p2p_comm=False),
                                  seq1f1b=dict(num_splits=2)),
    "tp2_cp2_k2_sp_flash": dict(model=FLASH_GQA, tp=2, sp=True, seq1f1b=dict(num_splits=2)),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_context_parallel_segments_equal_one_rank(ranks, name):
    layout = dict(LAYOUTS[name])
    data = layout.pop("data", DataSpec(num_microbatches=2))
    world = layout.get("pp", 1) * 2 * layout.get("tp", 1)
    _check(ranks.run(world, run_layout, case=name, data=data, cp=2, **layout))


def test_a_given_mask_with_flash_attention_is_refused_as_without_context_parallelism(ranks):
    """CP without documents cuts a given mask to each chunk and hands it to the attention, which
    uses or refuses it as without CP (the flash attention refuses it). Before, the mask went to
    a packed path built for one sample: with two per micro-batch, gradients 100 % off."""
    from harness import CaseFailed

    data = DataSpec(num_microbatches=2, micro_batch_size=2, explicit_mask=True)
    with pytest.raises(CaseFailed, match="does not support an explicit attention_mask"):
        ranks.run(2, run_layout, case="cp-flash-mask", data=data, cp=2, model=FLASH,
                  seq1f1b=dict(num_splits=2, partition="uniform"))


def test_a_failing_context_parallel_peer_stops_the_other_in_time_naming_it(ranks):
    import pipeline_cases as cases

    timeout_s = 4
    results = ranks.run(2, cases.context_parallel_fault, case="cp-fault", failing_rank=1,
                        model=ROPE, timeout_s=timeout_s)
    failed, waiting = results[1], results[0]
    assert failed["error"].startswith("ActionError") and "injected failure" in failed["error"]
    assert waiting["error"].startswith("ContextParallelCommError"), waiting
    assert "rank 0: the context-parallel" in waiting["error"] and "ranks [1]" in waiting["error"]
    assert waiting["seconds"] < 6 * timeout_s, waiting


def test_exchanged_bytes_are_what_the_planner_counts(ranks):
    """The bytes a CP rank sends (counted at every all-gather and reduce-scatter) equal the
    planner's count for the layout: pipeline 2 x CP 2, k=2, m=2."""
    from megatron_seq1f1b.attention.context_parallel import exchanged_bytes

    model = ROPE
    results = ranks.run(4, run_layout, case="cp-bytes", model=model, pp=2, cp=2,
                        data=DataSpec(num_microbatches=2), count_cp_bytes=True,
                        seq1f1b=dict(num_splits=2))
    _check(results)
    kv = 2 * model.hidden_size * 4  # keys and values of one token of one layer, fp32
    expected = 2 * exchanged_bytes([16, 16], model.num_layers // 2, kv, 2)  # 2 micro-batches
    assert all(r["cp_bytes"] == expected for r in results), [r["cp_bytes"] for r in results]
    # ... and the tensors torch.distributed's collectives were given moved as many
    assert all(r["cp_bytes_moved"] == expected for r in results), \
        [r["cp_bytes_moved"] for r in results]


def test_auto_plans_with_context_parallelism_and_trains_exactly(ranks):
    import pipeline_cases as cases

    results = ranks.run(2, cases.auto_plan, case="auto-cp", pp=1, cp=2, model=ROPE,
                        data=DataSpec(num_microbatches=2))
    problems = [p for r in results for p in r.get("problems", [r.get("error")])]
    assert not problems, "\n".join(map(str, problems))
    plans = [r["plan"] for r in results]
    assert plans[0] == plans[1] and all(n % 4 == 0 for n in plans[0][2]), plans
