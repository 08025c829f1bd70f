"""Megatron-Core's HybridModel (0.18+) under Seq1F1B: attention (*), MLP (-) and MoE (E) layers
of a hybrid pattern, pipeline stages where the pattern's "|" puts them; loss and every gradient
equal no-pipelining training of the same pattern on the full sequence (fp32, rel. 1e-5)."""

import importlib.util
import os

import pytest

from gpt import DataSpec, ModelSpec, run_layout

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron.core.models.hybrid") is None,
    reason="HybridModel is in megatron-core 0.18 and later")

MOE = (("num_moe_experts", 4), ("moe_router_topk", 2), ("add_bias_linear", False),
       ("moe_aux_loss_coeff", 0.1), ("moe_router_load_balancing_type", "aux_loss"),
       ("moe_token_dispatcher_type", "alltoall"))


@pytest.fixture(autouse=True, scope="module")
def _fresh_workers_afterwards(ranks):
    """MoE models keep their gloo groups' threads (see test_moe): fresh workers afterwards."""
    yield
    ranks.close()


def _check(results):
    problems = [f"rank {r['rank']}: {p}" for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems)
    assert any(r["entries"] for r in results), "no rank reported losses"


def hybrid(pattern: str, **fields) -> ModelSpec:
    extra = MOE if "E" in pattern else ()
    return ModelSpec(hybrid=pattern, extra=extra, **fields)


FULL = os.environ.get("SEQ1F1B_FULL") == "1"  # CI runs one case per k and layout
CASES = [
    # (pattern, pipeline stages, virtual stages, k, partition, schedule)
    ("*-*E", 1, None, 3, "balanced", "1f1b"),
    ("*-*E|*-*-", 2, None, 1, "uniform", "1f1b"),
    ("*-*E|*-*-", 2, None, 2, "uniform", "1f1b"),
    ("*-*E|*-*-", 2, None, 4, "balanced", "zb-h1"),
    ("*E|-|*-*|*", 4, None, 3, "balanced", "1f1b"),  # uneven stages; one without attention
    ("*-|*E|*-|*-", 2, 2, 2, "balanced", "1f1b"),  # a virtual pipeline layout
] + ([("*-*E|*-*-", 2, None, 3, "balanced", "1f1b")] if FULL else [])


@pytest.mark.parametrize("pattern,pp,vpp,k,partition,schedule", CASES,
                         ids=[f"{c[0]}-pp{c[1]}-vpp{c[2]}-k{c[3]}-{c[5]}" for c in CASES])
def test_hybrid_pattern_equals_no_pipelining(ranks, pattern, pp, vpp, k, partition, schedule):
    seq1f1b = dict(num_splits=k, partition=partition)
    if schedule != "1f1b":
        seq1f1b["schedule"] = schedule
    results = ranks.run(max(pp, 1), run_layout, case=f"hybrid-{pattern}-{pp}-{vpp}-{k}-{schedule}",
                        model=hybrid(pattern), data=DataSpec(num_microbatches=4), pp=pp,
                        vpp=vpp, seq1f1b=seq1f1b)
    _check(results)


def test_hybrid_tensor_parallel_flash_per_token(ranks):
    """TP 2 + sequence parallelism, flash attention, per-token loss, two stages of TP 2."""
    results = ranks.run(4, run_layout, case="hybrid-tp2-sp-flash",
                        model=hybrid("*-*E|*-*-", attention="flash"),
                        data=DataSpec(num_microbatches=3), pp=2, tp=2, sp=True, per_token=True,
                        seq1f1b=dict(num_splits=3, partition="balanced"))
    _check(results)


def test_hybrid_grouped_query_attention(ranks):
    """GQA (2 key/value groups for 4 heads) in a hybrid pattern, local attention, k=3."""
    results = ranks.run(2, run_layout, case="hybrid-gqa",
                        model=hybrid("*-*E|*-*-", num_query_groups=2),
                        data=DataSpec(num_microbatches=2), pp=2,
                        seq1f1b=dict(num_splits=3, partition="balanced"))
    _check(results)


@pytest.mark.parametrize("attention", ["local", "flash"])
def test_hybrid_multi_latent_attention(ranks, attention):
    """MLA layers ("+", Megatron's MLASelfAttention with its own RoPE) in a hybrid pattern,
    k=3, balanced; local: Transformer Engine's core attention stand-in (MLA's values are
    narrower than its queries)."""
    results = ranks.run(2, run_layout, case=f"hybrid-mla-{attention}",
                        model=hybrid("+-+E|+-+-", mla=True, normalization="RMSNorm",
                                     attention=attention),
                        data=DataSpec(num_microbatches=2), pp=2,
                        seq1f1b=dict(num_splits=3, partition="balanced"))
    _check(results)


@pytest.mark.parametrize("attention", ["flash", "local"])
def test_hybrid_context_parallel(ranks, attention):
    """Context parallelism 2 x pipeline 2 (hybrid layers take the CP path as GPT's; local:
    the stack spec made CP-buildable by context_parallel_layer_spec), k=3 balanced."""
    results = ranks.run(4, run_layout, case=f"hybrid-pp2-cp2-{attention}",
                        model=hybrid("*-*E|*-*-", attention=attention),
                        data=DataSpec(num_microbatches=2), pp=2, cp=2,
                        seq1f1b=dict(num_splits=3, partition="balanced"))
    _check(results)


def test_hybrid_expert_parallel_data_parallel(ranks):
    """Expert parallelism 2 over two data-parallel replicas of a two-stage pattern (4 ranks)."""
    results = ranks.run(4, run_layout, case="hybrid-pp2-dp2-ep2",
                        model=hybrid("*E*-|*-*E"), data=DataSpec(num_microbatches=2), pp=2,
                        ep=2, seq1f1b=dict(num_splits=2, partition="balanced"))
    _check(results)


# documents crossing no, one and several cuts (tests/test_documents.py's layouts)
DOCUMENTS = (((0, 5, 20),), ((0, 3, 11, 12, 27),), ((0, 8, 16, 24),))


@pytest.mark.parametrize("form", ["eod-local", "thd-flash"])
def test_hybrid_packed_documents(ranks, form):
    """End-of-document ids on Megatron's local attention, packed THD batches on flash."""
    thd = form == "thd-flash"
    model = hybrid("*-*E|*-*-", attention="flash" if thd else "local")
    results = ranks.run(2, run_layout, case=f"hybrid-documents-{form}", model=model,
                        data=DataSpec(num_microbatches=3, documents=DOCUMENTS, thd=thd), pp=2,
                        seq1f1b=dict(num_splits=3, partition="documents",
                                     documents="cu_seqlens" if thd else model.vocab_size - 1))
    _check(results)


def _cuts(pattern):
    """The executor's balanced cut of a one-stage HybridModel, and the pattern's own."""
    from gpt import build_chunks, init_parallel, make_config
    from megatron_seq1f1b.runtime.executor_setup import resolve_lengths
    from megatron_seq1f1b.schedules.partition import split_sequence

    spec = ModelSpec(hybrid=pattern, seq_length=64)
    init_parallel()
    config = make_config(spec)
    (model,) = build_chunks(spec, config)
    got = resolve_lengths(4, "balanced", None, 64, [model], config, spec.vocab_size)
    return got, split_sequence(64, 4, "balanced", config=config, vocab_size=spec.vocab_size,
                               dense_attention=True, pattern=pattern)


def test_balanced_cut_counts_the_pattern_layers(ranks):
    """The executor cuts a hybrid model by its pattern's layers: MLP-only layers make the cut
    closer to uniform than the same number of full GPT layers would."""
    (heavy_mlp,) = ranks.run(1, _cuts, case="cuts-mlp", pattern="*----")
    (attention,) = ranks.run(1, _cuts, case="cuts-attention", pattern="*-*-*")
    assert heavy_mlp[0] == heavy_mlp[1] and attention[0] == attention[1]
    assert heavy_mlp[0][0] - heavy_mlp[0][-1] < attention[0][0] - attention[0][-1]


def test_stack_spec_attention_layers_swapped_for_context_parallel_and_flash():
    """context_parallel_layer_spec and flash_layer_spec take a HybridStack spec: its attention
    (*) and MLA (+, where the version has it) layers' core attentions, nothing else, and
    the spec given is left as it was."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_seq1f1b.attention.context_parallel import (
        HYBRID_ATTENTION_LAYERS, context_parallel_layer_spec,
    )
    from megatron_seq1f1b.attention.flash import FlashDotProductAttention, flash_layer_spec
    from megatron_seq1f1b.runtime.hybrid_spec import local_hybrid_stack_spec

    def cores(stack):
        return {name: getattr(stack.submodules, name).submodules.self_attention.submodules
                .core_attention for name in HYBRID_ATTENTION_LAYERS
                if hasattr(stack.submodules, name)}

    stack = local_hybrid_stack_spec()
    assert set(cores(stack).values()) == {DotProductAttention}
    parallel = cores(context_parallel_layer_spec(stack))
    assert {c.__name__ for c in parallel.values()} == {"ContextParallelDotProductAttention"}
    assert set(cores(flash_layer_spec(stack)).values()) == {FlashDotProductAttention}
    assert set(cores(stack).values()) == {DotProductAttention}  # a copy was changed
    mlp = context_parallel_layer_spec(stack).submodules.mlp_layer
    assert mlp.submodules.mlp.module is stack.submodules.mlp_layer.submodules.mlp.module
