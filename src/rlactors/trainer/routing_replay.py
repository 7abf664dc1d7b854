"""Routing replay: the trainer's MoE layers send each token to the experts the rollout engine chose.

Why: the engine and the trainer can route one token to different experts (other kernels and
precision, and in async mode weights that moved since the rollout); the importance ratio of that
token then compares two different networks. With replay, every forward pass of the trainer (old
logprobs, reference, update) uses the recorded experts, and only their weights come from the
trainer's router, by that router class's own rule (`router_rule`: e.g. Qwen3-MoE's softmax over all
experts gathered at the recorded ones, renormalised where `norm_topk_prob` says; Mixtral's always
renormalised; gpt-oss's softmax over the k experts' logits alone), so gradients still reach the
router and a token's weights are those the router's own forward gives its own top-k.

    replay = RoutingReplay(model)              # finds the routers (transformers' MoE top-k routers)
    with replay.using(routes, record=True):    # routes: [B, T, num_layers, top_k], -1 = none
        logits = model(input_ids).logits
    replay.last.used[k]                        # [B*T, top_k] experts each token went to, k-th MoE layer
    replay.last.own[k]                         # [B*T, top_k] the experts the trainer's router chose

Routes are indexed by decoder layer, as vLLM records them (a dense layer's entries are unused):
the k-th router reads `routes[:, :, replay.layer_indices[k]]`.

Rule for a token without recorded routing (its row holds -1: the response's last token, which the
engine never ran; padding; a sample from an engine that did not record): the trainer routes it
itself, and `num_unrecorded` counts it, so the share is reported, never hidden. (An episode's
observation tokens are recorded: the engine runs them as the next turn's prompt.)

Invariant: `routes=None` leaves the model's routing untouched; with routes, `used` equals the
recorded experts on every recorded token of every layer.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial

import torch

UNRECORDED = -1  # a route entry with no recorded expert
# What `routing_sums` returns: token-weighted sums, divided by the step's tokens into means.
ROUTING_METRICS = ("routing_mismatch_share", "routing_unrecorded_share", "expert_load_max", "expert_load_min")


def find_routers(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """(decoder layer index, router) of the model's top-k routers in layer order: modules under
    `layers.<i>.` with a `weight`, `top_k` and `num_experts` whose forward returns (router_logits,
    scores, indices), the contract of transformers' MoE routers (`...TopKRouter`). Only the
    classes in `ROUTER_RULES` can replay."""
    routers = []
    for name, module in model.named_modules():
        layer = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
        if (layer and isinstance(getattr(module, "weight", None), torch.Tensor) and hasattr(module, "top_k")
                and hasattr(module, "num_experts") and type(module).__name__.endswith("TopKRouter")):
            routers.append((int(layer.group(1)), module))
    return routers


# The weights [N, k] of experts [N, k] from router logits [N, E], as one router class computes them.
WeightRule = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def replayed_scores(router_logits: torch.Tensor, experts: torch.Tensor, normalise: bool) -> torch.Tensor:
    """The routing weights of `experts` [N, k] under the router's softmax over all experts (fp32),
    renormalised over the k when the model normalises its top-k: differentiable in the logits."""
    probabilities = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights = probabilities.gather(-1, experts)
    return weights / weights.sum(dim=-1, keepdim=True) if normalise else weights


def top_k_softmax_scores(router_logits: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """The routing weights of `experts` [N, k] as a softmax over their k logits alone, in the
    logits' dtype (gpt-oss: top-k of the logits, then the softmax)."""
    return torch.softmax(router_logits.gather(-1, experts), dim=-1, dtype=router_logits.dtype)


def _configured_rule(router: torch.nn.Module) -> WeightRule:
    # The router's config decides whether its top-k is renormalised.
    return partial(replayed_scores, normalise=bool(router.norm_topk_prob))


# Router class name -> its rule, read from transformers' forward of that class: a class absent here
# weighs its experts in a way replay does not know (sigmoid scores, expert groups, a scaling factor,
# another output order).
ROUTER_RULES: dict[str, Callable[[torch.nn.Module], WeightRule]] = {
    "Qwen2MoeTopKRouter": _configured_rule,
    "Qwen3MoeTopKRouter": _configured_rule,
    "OlmoeTopKRouter": _configured_rule,
    "MixtralTopKRouter": lambda router: partial(replayed_scores, normalise=True),
    "GptOssTopKRouter": lambda router: top_k_softmax_scores,
}


def router_rule(router: torch.nn.Module) -> WeightRule:
    """How `router` weighs given experts from its logits: for its own top-k, exactly the weights
    its forward returns. A class not in `ROUTER_RULES` is a ValueError naming it."""
    name = type(router).__name__
    if name not in ROUTER_RULES:
        raise ValueError(f"routing replay does not know how router class {name} weighs its experts; it knows "
                         f"{', '.join(sorted(ROUTER_RULES))}")
    return ROUTER_RULES[name](router)


@dataclass
class RoutingRecord:
    """What one forward pass routed, per MoE layer (rows are the flattened [B*T] tokens)."""

    used: list[torch.Tensor] = field(default_factory=list)  # experts each token was sent to
    own: list[torch.Tensor] = field(default_factory=list)  # the trainer router's own top-k
    recorded: list[torch.Tensor] = field(default_factory=list)  # the record read, -1 where none
    router_logits: list[torch.Tensor] = field(default_factory=list)  # [B*T, E], in the autograd graph
    num_unrecorded: int = 0  # (token, layer) pairs that routed themselves for want of a record


class RoutingReplay:
    def __init__(self, model: torch.nn.Module):
        found = find_routers(model)
        self.layer_indices = [layer for layer, _ in found]
        self.routers = [router for _, router in found]
        self.num_layers = getattr(getattr(model, "config", None), "num_hidden_layers", None) or (
            max(self.layer_indices, default=-1) + 1)
        self.routes: torch.Tensor | None = None
        self.record = False
        self.replay = True
        self.last = RoutingRecord()
        self.rules: list[WeightRule] = []  # each router's, looked up when routes are replayed
        for index, (layer, router) in enumerate(found):
            router.register_forward_hook(self._hook(index, layer))

    @contextmanager
    def using(self, routes: torch.Tensor | None, record: bool = False, replay: bool = True
              ) -> Iterator[RoutingRecord]:
        """Within the block, route by `routes` ([B, T, num_layers, top_k] expert ids, -1 where
        unrecorded; None: the model's own routing) and, with `record`, keep what was routed. With
        `replay` false the routes are only read into the record (to measure how often the
        trainer's routing differs), and the model routes itself. A router class without a known
        rule (`router_rule`) is refused here, before the forward, only when it would replay."""
        if routes is not None and (routes.dim() != 4 or routes.shape[2] != self.num_layers):
            raise ValueError(f"routing replay: routes of shape {tuple(routes.shape)}, expected "
                             f"[batch, tokens, {self.num_layers} layers, top_k]")
        if routes is not None and replay:
            self.rules = [router_rule(router) for router in self.routers]
        self.routes, self.record, self.replay, self.last = routes, record, replay, RoutingRecord()
        try:
            yield self.last
        finally:
            self.routes, self.record, self.replay = None, False, True

    def _hook(self, index: int, layer: int):
        def hook(router, inputs, output):
            if self.routes is None and not self.record:
                return None
            logits, scores, own = output
            used, chosen, recorded = own, scores, None
            if self.routes is not None:
                recorded = self.routes[:, :, layer, :].reshape(-1, self.routes.shape[-1]).to(own.device)
                if recorded.shape != own.shape:
                    raise ValueError(f"routing replay, layer {layer}: {recorded.shape[0]} recorded tokens of "
                                     f"top-{recorded.shape[1]}, the forward routes {own.shape[0]} of top-{own.shape[1]}")
                missing = (recorded < 0).any(dim=-1, keepdim=True)
                if self.replay:
                    used = torch.where(missing, own, recorded.long())
                    chosen = self.rules[index](logits, used).to(scores.dtype)
                    self.last.num_unrecorded += int(missing.sum())
            if self.record:
                self.last.used.append(used.detach())
                self.last.own.append(own.detach())
                self.last.router_logits.append(logits)
                if recorded is not None:
                    self.last.recorded.append(recorded)
            return logits, chosen, used

        return hook


def mismatch_share(used: list[torch.Tensor], own: list[torch.Tensor], valid: torch.Tensor) -> float:
    """Share of (valid token, layer) pairs whose trainer top-k, as a set, differs from the experts
    used. `valid` [N] bool marks the tokens that count (recorded, real)."""
    num_pairs, num_different = 0, 0
    for layer_used, layer_own in zip(used, own, strict=True):
        num_different += int(different_sets(layer_used, layer_own)[valid].sum())
        num_pairs += int(valid.sum())
    return num_different / num_pairs if num_pairs else 0.0


def different_sets(experts: torch.Tensor, others: torch.Tensor) -> torch.Tensor:
    """[N] bool: whether row n of two [N, k] expert-id tensors names a different set of experts
    (the order within a top-k does not matter)."""
    return (experts.long().sort(dim=-1).values != others.long().sort(dim=-1).values).any(dim=-1)


def expert_load(used: list[torch.Tensor], num_experts: int, valid: torch.Tensor) -> torch.Tensor:
    """[num_layers, num_experts]: each expert's share of the valid tokens' routed slots, per layer
    (each row sums to 1; balanced routing is 1 / num_experts everywhere)."""
    rows = []
    for layer_used in used:
        counts = torch.bincount(layer_used[valid].reshape(-1), minlength=num_experts).float()
        rows.append(counts / counts.sum().clamp(min=1))
    return torch.stack(rows) if rows else torch.zeros(0, num_experts)


def load_balancing_loss(router_logits: list[torch.Tensor], own: list[torch.Tensor], valid: torch.Tensor
                        ) -> torch.Tensor:
    """The Switch Transformer's auxiliary loss over the `valid` tokens, mean over layers:
    num_experts x sum over experts of (share of the router's own top-k slots) x (mean router
    probability); 1.0 when balanced, differentiable through the logits. It pushes the router's own
    preferences towards balance, whatever experts replay sent the tokens to."""
    losses = []
    for logits, layer_own in zip(router_logits, own, strict=True):
        num_experts = logits.shape[-1]
        slots = expert_load([layer_own], num_experts, valid)[0]
        mean_probability = torch.softmax(logits[valid].float(), dim=-1).mean(dim=0)
        losses.append(num_experts * (slots * mean_probability).sum())
    return torch.stack(losses).mean() if losses else torch.zeros(())


def routing_sums(record: RoutingRecord, positions: torch.Tensor, weights: torch.Tensor) -> dict[str, torch.Tensor]:
    """Token-weighted sums of one forward pass's routing, for the step's metrics (divided by the
    step's tokens later): over the flattened `positions` [N] (rows of the [B*T] routing) with
    `weights` [N] (1 per token that trains), the share of layers where the trainer's own top-k
    differs from the recorded one (`routing_mismatch_share`), the share with nothing recorded
    (`routing_unrecorded_share`), and the busiest and idlest expert's share of routed slots, the
    largest and smallest over layers (`expert_load_max`, `expert_load_min`)."""
    weights = weights.float()
    total = weights.sum()
    sums = {}
    if record.recorded:
        different = torch.zeros_like(weights)
        unrecorded = torch.zeros_like(weights)
        for recorded, own in zip(record.recorded, record.own, strict=True):
            recorded, own = recorded[positions], own[positions]
            missing = (recorded < 0).any(dim=-1)
            differs = different_sets(recorded, own) & ~missing
            different += differs.float() / len(record.own)
            unrecorded += missing.float() / len(record.own)
        sums["routing_mismatch_share"] = (different * weights).sum()
        sums["routing_unrecorded_share"] = (unrecorded * weights).sum()
    if record.used and total > 0:
        num_experts = record.router_logits[0].shape[-1]
        valid = torch.zeros(record.used[0].shape[0], dtype=torch.bool, device=weights.device)
        valid[positions[weights > 0]] = True
        load = expert_load(record.used, num_experts, valid)
        sums["expert_load_max"] = load.max() * total
        sums["expert_load_min"] = load.min() * total
    return sums


def micro_batch_terms(record: RoutingRecord, micro, pad_token_id: int, aux_coefficient: float, token_share: float
                      ) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """What a micro-batch's MoE forward pass adds to the actor's step (`micro` a
    `rlactors.trainer.batch.MicroBatch`): the load-balancing loss over its real tokens, times
    `aux_coefficient` and the micro-batch's `token_share` of the step's tokens so the step's terms
    add up to a token-weighted mean (None when the coefficient is 0), and its `routing_sums` over
    the positions that predict the tokens that train."""
    if not record.used:
        return None, {}
    width = micro.input_ids.shape[1]
    rows = torch.arange(micro.input_ids.shape[0], device=micro.mask.device).unsqueeze(1) * width
    sums = routing_sums(record, (rows + micro.response_positions).reshape(-1), micro.mask.reshape(-1))
    if not aux_coefficient:
        return None, sums
    real = (micro.input_ids != pad_token_id).reshape(-1)
    aux = load_balancing_loss(record.router_logits, record.own, real) * aux_coefficient * token_share
    sums["router_aux_loss"] = aux.detach()
    return aux, sums
