"""Mixture-of-experts under segments: load-balancing losses equal to the full sequence's.

Routing is per token, so segments route exactly like the full sequence; the
auxiliary losses are not. Megatron's switch loss of a micro-batch is

    aux = c * sum_e P_e * f_e,   c = E * coeff / (topk * T^2)

with ``P_e`` the summed router scores and ``f_e`` the token count of expert
``e`` over the micro-batch (``T`` tokens). Computed per segment it would use
the segment's counts and token total. Two facts make it exact here:

* The gradient with respect to a token's scores is ``c * f`` (counts carry no
  gradient), and on every stage all forward segments of a micro-batch run
  before its first backward: so the full ``f`` is known when any gradient is
  computed. Each segment attaches a *late-bound* loss (:class:`_LateBound`)
  whose backward reads the completed counts.
* The reported value is bilinear: summing ``f(<=j) . p_j + f_j . P(<j)`` over
  segments gives every pair ``(a, b)`` of segments once, i.e. the full
  ``P . f``. Each segment reports its share as it runs.

``seq_aux_loss`` is the same per sequence (columns ``b * E``), divided by the
batch size. ``global_aux_loss`` uses the running average of counts over the
micro-batches of the iteration, ``(G0 + F_0 + ... + F_i) / (n0 + i + 1)``;
the router's own running sum grows by each segment's counts (so by ``F_i``
per micro-batch) and its step count is put back to one per micro-batch. The
z-loss is a mean over tokens: a segment's share is its token fraction.
Per-token-loss scaling (``valid_token_count``) is that of the full
micro-batch. Expert-bias updates count tokens, which add up across segments.

Megatron's own code computes, attaches and logs every loss; this module only
hands it the segment-exact value (per-instance wrappers installed by
``enable``, doing nothing outside a segmented forward).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from megatron_seq1f1b.segments import run as segments
from megatron_seq1f1b.segments.loss import auxiliary_loss_scale

_KINDS = {"_apply_aux_loss": "aux_loss", "_apply_seq_aux_loss": "seq_aux_loss",
          "_apply_global_aux_loss": "global_aux_loss"}
_STASH = "_seq1f1b_balance_stash"
_INSTALLED = "_seq1f1b_moe_installed"


@dataclass
class Ledger:
    """One router's counts and scores for one micro-batch and loss kind, segment by segment."""

    num_splits: int
    counts: torch.Tensor | None = None  # f(<=j), reduced like Megatron's
    scores: torch.Tensor | None = None  # P(<=j), this rank's tokens, no gradient
    forwarded: set = field(default_factory=set)

    def add(self, index: int, counts: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """Record segment `index`; returns its share of ``P . f`` (the bilinear pairs)."""
        if index in self.forwarded:
            raise RuntimeError(f"Seq1F1B: router saw segment {index} twice in one forward pass")
        counts, scores = counts.detach().float(), scores.detach().float()
        if self.counts is None:
            self.counts, self.scores = torch.zeros_like(counts), torch.zeros_like(scores)
        share = (self.counts + counts) @ scores + counts @ self.scores
        self.counts, self.scores = self.counts + counts, self.scores + scores
        self.forwarded.add(index)
        return share

    def complete_counts(self) -> torch.Tensor:
        if len(self.forwarded) != self.num_splits:
            raise RuntimeError(
                "Seq1F1B: a load-balancing loss is being differentiated before all "
                f"{self.num_splits} forward segments of its micro-batch ran on this stage "
                f"(seen: {sorted(self.forwarded)}); the schedule breaks the rule every "
                "Seq1F1B schedule keeps"
            )
        return self.counts


class _LateBound(torch.autograd.Function):
    """A loss whose value is given and whose gradient ``scale * weights()`` is read at backward."""

    @staticmethod
    def forward(ctx, scores, value, scale, weights):
        ctx.shape, ctx.dtype, ctx.scale, ctx.weights = scores.shape, scores.dtype, scale, weights
        return value.detach().clone()

    @staticmethod
    def backward(ctx, grad):
        per_column = ctx.weights() * ctx.scale * grad
        return per_column.to(ctx.dtype).expand(ctx.shape), None, None, None


def _segment():
    current = segments.active()
    if current is None or current.info.num_splits == 1 or current.phase != segments.FORWARD:
        return None
    return current


def _ledgers(run) -> dict:
    store = getattr(run, "moe_ledgers", None)
    if store is None:
        store = run.moe_ledgers = {}
    return store


def _apply_wrapper(router, name, original):
    kind = _KINDS[name]

    def apply(probs, scores_for_aux_loss, routing_map, *args, **kwargs):
        current = _segment()
        if current is None or router.get_aux_loss_coeff(kind) == 0:
            return original(probs, scores_for_aux_loss, routing_map, *args, **kwargs)
        if kwargs.get("with_padding_mask"):
            raise ValueError("Seq1F1B: MoE load-balancing losses with a padding mask are not "
                             "supported; train on unpadded sequences")
        stash = {"kind": kind, "scores": scores_for_aux_loss, "routing_map": routing_map,
                 "current": current}
        if kind == "seq_aux_loss":
            seq_length = args[0] if args else kwargs["seq_length"]
            bsz = args[1] if len(args) > 1 else kwargs["bsz"]
            stash.update(seq_length=seq_length, bsz=bsz)
        if kind == "global_aux_loss":  # the running sum before the iteration's first call,
            # kept on the device (reading the step count back would wait for it every layer)
            start = _ledgers(current.run).setdefault(_global_start(current.info, router), {})
            if not start:
                start["sum"] = router.global_tokens_per_expert.detach().float().clone()
                start["steps"] = router.ga_steps.detach().clone()
        setattr(router, _STASH, stash)
        try:
            probs = original(probs, scores_for_aux_loss, routing_map, *args, **kwargs)
        finally:
            setattr(router, _STASH, None)
        if kind == "global_aux_loss" and current.info.index > 0:
            router.ga_steps -= 1  # one step per micro-batch, as without segments
        return probs

    return apply


def _attach_wrapper(router, original):
    from megatron.core.transformer.moe import router as router_module

    def attach(activation, aux_loss_coeff, aux_loss, aux_loss_name, reduce_group, *args,
               **kwargs):
        stash = getattr(router, _STASH, None)
        if stash is None:
            return original(activation, aux_loss_coeff, aux_loss, aux_loss_name, reduce_group,
                            *args, **kwargs)
        info, run = stash["current"].info, stash["current"].run
        scores, routing_map, kind = stash["scores"], stash["routing_map"], stash["kind"]
        topk_for_counts, divide = router.topk, 1
        if kind == "seq_aux_loss":
            scores = scores.reshape(stash["seq_length"], -1)
            routing_map = routing_map.reshape(stash["seq_length"], -1)
            topk_for_counts, divide = router.topk * stash["bsz"], stash["bsz"]
        counts, _, total = router_module.get_tokens_per_expert_and_token_count(
            routing_map=routing_map, reduce_group=reduce_group, topk=topk_for_counts)
        seq_length = sum(info.lengths)
        total_full = int(total) * seq_length // info.length
        scale = (router.config.num_moe_experts * aux_loss_coeff
                 / (router.topk * total_full * total_full) / divide)
        key = (info.microbatch, info.chunk, id(router), kind)
        ledger = _ledgers(run).setdefault(key, Ledger(info.num_splits))
        share = ledger.add(info.index, counts, scores.sum(dim=0))
        if kind == "global_aux_loss":
            value, weights = _global_share(run, router, info, ledger, stash, share, scores)
        else:
            value, weights = share, ledger.complete_counts
        late = _LateBound.apply(scores, (value * scale).to(aux_loss.dtype), scale, weights)
        if "valid_token_count" in kwargs and kwargs["valid_token_count"] is not None:
            kwargs["valid_token_count"] = kwargs["valid_token_count"] * seq_length // info.length
        return original(activation, aux_loss_coeff, late, aux_loss_name, reduce_group, *args,
                        **kwargs)

    return attach


def _global_start(info, router) -> tuple:
    """The ledger key of a router's running sum and step count before the iteration."""
    return ("global-start", info.chunk, id(router))


def _global_share(run, router, info, ledger, stash, share, scores):
    """Value share and late weights of the global loss: counts averaged over micro-batches."""
    start = _ledgers(run)[_global_start(info, router)]  # taken before the first micro-batch
    mine = [key for key in _ledgers(run) if key[1:] == (info.chunk, id(router), "global_aux_loss")]
    earlier = [_ledgers(run)[key] for key in mine if key[0] < info.microbatch]
    if len(earlier) != info.microbatch:
        raise RuntimeError("Seq1F1B: global_aux_loss needs micro-batches forwarded in order")
    before = start["sum"] + sum((e.complete_counts() for e in earlier),
                                torch.zeros_like(start["sum"]))
    steps = start["steps"] + info.microbatch + 1
    # P . (before + F) / steps: F's part is the segment's bilinear share
    value = (before @ scores.sum(dim=0).detach().float() + share) / steps

    def weights():
        return (before + ledger.complete_counts()) / steps

    return value, weights


def _z_loss_wrapper(router, original):
    """The z-loss is a mean over the forward's tokens: a segment's share is its token fraction.

    Without per-token loss both the value and the gradient scale by the fraction
    (``z_loss_func`` is scaled for the call). With per-token loss Megatron
    multiplies the z-loss by the forward's token count, which makes the gradient
    per token and already exact: only the logged mean is scaled.
    """
    from megatron.core.transformer.moe import router as router_module

    def apply_z_loss(logits, *args, **kwargs):
        current = _segment()
        if current is None or router.config.moe_z_loss_coeff is None:
            return original(logits, *args, **kwargs)
        fraction = current.info.length / sum(current.info.lengths)
        with _scaled_z_loss(router_module, fraction, router.config.calculate_per_token_loss):
            return original(logits, *args, **kwargs)

    return apply_z_loss


@contextlib.contextmanager
def _scaled_z_loss(router_module, fraction: float, per_token: bool):
    """For one call of ``apply_z_loss``: scale the loss, or (per-token loss) its log entry."""
    if not per_token:
        name, unscaled = "z_loss_func", router_module.z_loss_func

        def replacement(*a, **k):
            return unscaled(*a, **k) * fraction
    elif hasattr(router_module, "get_moe_metrics_tracker"):  # megatron-core 0.19
        name, unscaled = "get_moe_metrics_tracker", router_module.get_moe_metrics_tracker

        class _Scaled:
            def record(self, metric, value, *a, **k):
                return unscaled().record(metric, value * fraction, *a, **k)

        def replacement():
            return _Scaled()
    else:
        name, unscaled = "save_to_aux_losses_tracker", router_module.save_to_aux_losses_tracker

        def replacement(metric, value, *a, **k):
            return unscaled(metric, value * fraction, *a, **k)

    setattr(router_module, name, replacement)
    try:
        yield
    finally:
        setattr(router_module, name, unscaled)


def install(router) -> bool:
    """Wrap one router's loss methods (instance attributes; idempotent)."""
    if getattr(router, _INSTALLED, False):
        return False
    for name in _KINDS:
        if hasattr(router, name):
            setattr(router, name, _apply_wrapper(router, name, getattr(router, name)))
    router.attach_and_log_load_balancing_loss = _attach_wrapper(
        router, router.attach_and_log_load_balancing_loss)
    router.apply_z_loss = _z_loss_wrapper(router, router.apply_z_loss)
    setattr(router, _STASH, None)
    setattr(router, _INSTALLED, True)
    return True


def routers(model) -> list:
    """Megatron's top-k routers in a model chunk."""
    return [m for m in model.modules()
            if any(c.__name__ == "TopKRouter" for c in type(m).__mro__)]


def set_aux_loss_scale(config, num_microbatches: int) -> None:
    """What Megatron's forward_step does for MoE: the aux losses' backward scale.

    The executor calls the user's forward step itself, so it sets this too:
    the loss scale (``moe_grad_scale_func`` where it exists, else
    ``grad_scale_func``) times the context-parallel size over the number of
    micro-batches, or unscaled with per-token loss. (Under CP each rank's loss
    holds its own tokens' scores and the data-parallel reduction averages over
    the CP ranks too: the CP factor undoes that average, as for the LM loss.)
    """
    if not getattr(config, "num_moe_experts", None):
        return
    from megatron.core.transformer.moe.router import MoEAuxLossAutoScaler

    scale = auxiliary_loss_scale(config, "moe_grad_scale_func", num_microbatches,
                                 context_parallel=True)
    MoEAuxLossAutoScaler.set_loss_scale(scale)
