"""Configurations Seq1F1B cannot run correctly, rejected before anything runs.

Each rule says what is wrong and how to fix it. Everything is collected and
reported at once, so a user fixes a configuration in one round.
"""

from __future__ import annotations


# Position embeddings whose per-segment form is implemented (RoPE offsets, sliced ids).
SUPPORTED_POSITIONS = ("rope", "learned_absolute", "none")


class ConfigError(ValueError):
    """A configuration that Seq1F1B would run incorrectly (or not at all)."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"Seq1F1B cannot run this configuration:\n{lines}")


def raise_if(problems: list[str]) -> None:
    if problems:
        raise ConfigError(problems)


# Transformer Engine's FP8 GEMMs need the token dimension divisible by 8.
FP8_TOKEN_MULTIPLE = 8


def segment_multiple(config) -> int:
    """What every segment length must divide by for this model configuration.

    The tensor-parallel size with sequence parallelism (each rank holds
    length / tp tokens), times 8 with FP8 (each rank's tokens feed FP8 GEMMs);
    with context parallelism ``cp`` a segment is cut into ``2 * cp`` chunks and
    each CP rank's ``length / cp`` tokens must divide as above.
    """
    import math

    get = lambda name, default=None: getattr(config, name, default)  # noqa: E731
    tp = (get("tensor_model_parallel_size", 1) or 1) if get("sequence_parallel") else 1
    own = tp * (FP8_TOKEN_MULTIPLE if get("fp8") else 1)
    cp = get("context_parallel_size", 1) or 1
    return own if cp == 1 else math.lcm(2 * cp, cp * own)


#: On CUDA, segment lengths are multiples of this by default: tensor-core GEMM tiles and
#: attention kernels run full blocks (e.g. balanced lengths like 4499 and 3693 do not).
CUDA_SEGMENT_MULTIPLE = 64


def rounding_multiple(config, seq_length: int, num_splits: int = 1,
                      requested: int | None = None, on_cuda: bool | None = None) -> int:
    """What segment lengths are rounded to: ``requested`` or, by default, 64 on CUDA; always
    also a multiple of :func:`segment_multiple` (the layout's own constraint).

    A requested multiple is strict (a sequence it cannot cut is an error later). The
    default falls back to the layout's own multiple where ``seq_length`` does not divide
    into ``num_splits`` segments of whole 64-token blocks (or on CPU, where it buys nothing).
    """
    return rounding_multiple_of(segment_multiple(config), seq_length, num_splits, requested,
                                on_cuda)


def rounding_multiple_of(own: int, seq_length: int, num_splits: int = 1,
                         requested: int | None = None, on_cuda: bool | None = None) -> int:
    """:func:`rounding_multiple` from the layout's own multiple (no config: the executor
    rounds every variable-length micro-batch with it)."""
    import math

    if requested is not None:
        return math.lcm(int(requested), own)
    if on_cuda is None:
        import torch

        on_cuda = torch.cuda.is_available()
    if not on_cuda:
        return own
    preferred = math.lcm(CUDA_SEGMENT_MULTIPLE, own)
    if seq_length % preferred or seq_length // preferred < num_splits:
        return own
    return preferred


def segment_multiple_problems(requested) -> list[str]:
    """A requested segment multiple (``--seq1f1b-segment-multiple``) must be a positive integer."""
    if requested is None:
        return []
    if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
        return [f"segment_multiple (--seq1f1b-segment-multiple) must be a positive integer, "
                f"got {requested!r}"]
    return []


def attention_shape_problems(hidden_size: int, num_attention_heads: int,
                             num_query_groups: int | None = None, tensor_parallel_size: int = 1,
                             ffn_hidden_size: int | None = None) -> list[str]:
    """Model sizes Megatron-LM's ``validate_args`` refuses (or its layers assert on, later and
    with a traceback): heads that divide the hidden size, query groups that divide the heads,
    and a tensor-parallel size that divides heads, groups and the MLP. Messages name the
    command-line flags (the planner, the rehearsal and the trainer share them)."""
    problems = []
    if hidden_size % num_attention_heads:
        problems.append(f"--hidden-size {hidden_size} must divide by --num-attention-heads "
                        f"{num_attention_heads} (as in Megatron-LM)")
    if num_query_groups and num_attention_heads % num_query_groups:
        problems.append(f"--num-query-groups {num_query_groups} must divide "
                        f"--num-attention-heads {num_attention_heads}")
    for flag, value in (("--num-attention-heads", num_attention_heads),
                        ("--num-query-groups", num_query_groups),
                        ("--ffn-hidden-size", ffn_hidden_size)):
        if value and value % tensor_parallel_size:
            problems.append(f"{flag} {value} must be a multiple of --tensor-model-parallel-size "
                            f"{tensor_parallel_size}: every TP rank computes as many of them")
    return problems


def local_expert_bias_problems(num_experts: int | None, disable_bias_linear: bool) -> list[str]:
    """Megatron-Core's local experts (``SequentialMLP``, what the command lines build without
    Transformer Engine) with linear biases fail in their first forward, under any schedule:
    they add the bias in place to a view autograd made (``mlp.py``, 0.16.1 to 0.19), a
    ``RuntimeError`` deep in a traceback. The command lines (the trainer, the rehearsal) say
    so before building anything."""
    if num_experts and not disable_bias_linear:
        return ["--num-experts without --disable-bias-linear: Megatron-Core's local experts "
                "(SequentialMLP) add their bias in place to a view of their output, which "
                "autograd refuses in the first forward (RuntimeError in "
                "megatron/core/transformer/mlp.py, under any schedule); add --disable-bias-linear "
                "(MoE models train without linear biases)"]
    return []


def model_config_problems(config) -> list[str]:
    """TransformerConfig options that segment-wise attention does not support (yet)."""
    get = lambda name, default=None: getattr(config, name, default)  # noqa: E731
    problems = []
    if (get("context_parallel_size", 1) or 1) > 1:
        problems += context_parallel_problems(config)
    if get("hybrid_context_parallel"):
        problems.append("hybrid_context_parallel is not supported (it chooses data x context "
                        "parallelism per sequence); disable it")
    if get("multi_latent_attention") and get("rope_type") == "yarn" and get("apply_rope_fusion"):
        problems.append(
            "multi-latent attention with YaRN and apply_rope_fusion reads RoPE cos/sin cached "
            "from position 0, not the segment's offset; set apply_rope_fusion=False "
            "(--no-rope-fusion)"
        )
    if get("multi_latent_attention") and get("mla_down_proj_fusion"):
        problems.append(
            "mla_down_proj_fusion builds FusedMLASelfAttention, whose fused RoPE has no position "
            "offset; disable mla_down_proj_fusion"
        )
    window = get("window_size")
    if window is not None and (len(window) != 2 or window[0] is None or window[0] < 0
                               or window[1] != 0):
        problems.append(
            f"sliding-window attention (window_size={tuple(window)}) must look back w >= 0 "
            "keys and not ahead (later segments' keys do not exist yet); use window_size=(w, 0) "
            "or None"
        )
    if get("num_moe_experts"):
        problems += moe_problems(config)
    if get("fine_grained_activation_offloading"):
        problems.append(
            "fine-grained activation offloading (fine_grained_activation_offloading) frees "
            "attention inputs that the segment K/V cache shares; disable it"
        )
    if get("cuda_graph_impl", "none") not in (None, "none"):
        problems.append(
            f"CUDA graphs (cuda_graph_impl={get('cuda_graph_impl')!r}) capture fixed shapes; "
            "segments differ in length; disable them"
        )
    if get("enable_cuda_graph"):
        problems.append("CUDA graphs (enable_cuda_graph) capture fixed shapes; disable them")
    if get("tp_comm_overlap"):
        problems.append(
            "tensor-parallel communication overlap (tp_comm_overlap) uses Transformer Engine "
            "userbuffers sized for the whole sequence; segments are shorter; disable it"
        )
    for name in ("fp8_dot_product_attention", "fp8_multi_head_attention"):
        if get(name):
            problems.append(
                f"FP8 attention ({name}) is untested with bottom-right causal masks over a "
                "K/V prefix; keep attention in bf16/fp16 (FP8 linear layers are fine)"
            )
    return problems


def context_parallel_problems(config) -> list[str]:
    """Context parallelism inside segments: the keys and values of a segment are all-gathered
    over the CP group (:mod:`megatron_seq1f1b.attention.context_parallel`); what that does not cover."""
    get = lambda name, default=None: getattr(config, name, default)  # noqa: E731
    problems = []
    kinds = get("cp_comm_type")
    kinds = kinds if isinstance(kinds, (list, tuple)) else [kinds]
    odd = sorted({str(k) for k in kinds if k not in (None, "p2p", "all_gather")})
    if odd:
        problems.append(
            f"cp_comm_type {odd}: Seq1F1B's segments exchange keys and values over the "
            "context-parallel group by all-gather; use cp_comm_type='all_gather' (or 'p2p', "
            "which segments run as all-gather too)")
    return problems


def moe_problems(config) -> list[str]:
    """MoE options whose result depends on how many tokens share one forward."""
    get = lambda name, default=None: getattr(config, name, default)  # noqa: E731
    problems = []
    if get("moe_expert_capacity_factor") is not None:
        problems.append(
            f"token dropping (moe_expert_capacity_factor={get('moe_expert_capacity_factor')}) "
            "fills each expert's capacity per forward, so a segment would drop other tokens "
            "than the full sequence; use dropless MoE (moe_expert_capacity_factor=None)"
        )
    if get("moe_expert_rank_capacity_factor") is not None or get("moe_paged_stash"):
        problems.append(
            "per-rank expert capacity (moe_expert_rank_capacity_factor, moe_paged_stash) caps "
            "tokens per forward, so segments would overflow differently than the full "
            "sequence; disable it"
        )
    losses = bool(get("moe_z_loss_coeff")) or any(
        float(c) > 0 for c in (get("moe_aux_loss_coeff", 0) if isinstance(
            get("moe_aux_loss_coeff", 0), (list, tuple)) else [get("moe_aux_loss_coeff", 0) or 0]))
    modules = get("recompute_modules") or []
    if losses and (get("recompute_granularity") == "full" or (
            get("recompute_granularity") == "selective" and "moe" in modules)):
        problems.append(
            "recomputing MoE layers (recompute_granularity='full', or recompute_modules with "
            "'moe') computes the router's losses inside the backward, after later segments' "
            "counts are needed; recompute other modules, or set moe_aux_loss_coeff=0 and "
            "moe_z_loss_coeff=None"
        )
    cp = get("context_parallel_size", 1) or 1
    if losses and cp > 1 and get("calculate_per_token_loss"):
        from megatron_seq1f1b.base import compat

        if not compat.per_token_router_losses_count_context_parallel():
            problems.append(
                f"megatron-core {compat.megatron_core_version()} scales per-token router "
                "losses (calculate_per_token_loss with moe_aux_loss_coeff or "
                "moe_z_loss_coeff) by one context-parallel rank's tokens, so under "
                f"context_parallel_size={cp} their gradients would be 1/{cp} of the full "
                "sequence's (megatron-core 0.19 scales them exactly); use megatron-core "
                "0.19, or calculate_per_token_loss=False"
            )
    return problems


def segment_length_problems(lengths, seq_length: int | None = None, config=None) -> list[str]:
    """Segment lengths that do not fit the sequence or the tensor-parallel layout."""
    lengths = list(lengths)
    problems = []
    if not lengths or any(int(n) < 1 for n in lengths):
        problems.append(f"segment lengths (split_lengths) must be positive integers, got {lengths}")
        return problems
    if seq_length is not None and sum(lengths) != seq_length:
        problems.append(
            f"segment lengths (split_lengths) {lengths} sum to {sum(lengths)}, not the sequence "
            f"length {seq_length}"
        )
    if config is None:
        return problems
    multiple = segment_multiple(config)
    bad = [n for n in lengths if n % multiple]
    if bad:
        cp = getattr(config, "context_parallel_size", 1) or 1
        if cp > 1:
            rule = (f"with context parallelism {cp} a segment is cut into {2 * cp} equal chunks "
                    f"(and each rank's part divided as its layout needs): every segment length "
                    f"must be divisible by {multiple}")
        elif getattr(config, "fp8", None):
            rule = (f"with FP8 every segment's tokens per rank must be divisible by "
                    f"{FP8_TOKEN_MULTIPLE} (Transformer Engine's FP8 GEMMs)")
        else:
            rule = ("with sequence parallelism every segment length must be divisible by the "
                    f"tensor-parallel size {multiple}")
        problems.append(f"{rule}; {bad} are not (pass split_lengths from "
                        f"split_sequence(..., multiple_of={multiple}))")
    return problems
