"""Routing replay on the tiny Qwen3-MoE, without Ray: the trainer's forward uses exactly the
recorded experts on every token of every layer, weighs them by its own router (so the router still
learns), routes unrecorded tokens itself and counts them; and a moved router disagrees with the
recorded routing on a measurable share, which replay removes."""

import pytest
import torch

from rlactors.models import load_model
from rlactors.trainer.routing_replay import UNRECORDED, RoutingReplay, expert_load, mismatch_share


@pytest.fixture
def model(tiny_moe_model_dir):
    return load_model(tiny_moe_model_dir)


def _ids(seed=0, shape=(3, 12)):
    return torch.randint(4, 200, shape, generator=torch.Generator().manual_seed(seed))


def _routes(record) -> torch.Tensor:
    """[B, T, layers, top_k] of a recorded pass over input ids of shape (3, 12)."""
    return torch.stack(record.used, dim=1).reshape(3, 12, len(record.used), -1)


def _record_then_move_the_routers(model, replay, ids, seed):
    """The routing of `ids` as recorded now (the engine's, under the old weights), then a push to
    every router (the trainer's weights moved): the record and its routes."""
    with torch.no_grad(), replay.using(None, record=True) as record:
        model(ids)
    with torch.no_grad():
        for router in replay.routers:
            router.weight.add_(0.5 * torch.randn(router.weight.shape, generator=torch.Generator().manual_seed(seed)))
    return record, _routes(record)


def test_replaying_the_models_own_routing_changes_nothing(model):
    replay = RoutingReplay(model)
    assert (replay.num_layers, replay.layer_indices) == (2, [0, 1])
    ids = _ids()
    with torch.no_grad():
        plain = model(ids).logits
        with replay.using(None, record=True) as record:
            recorded = model(ids).logits
        with replay.using(_routes(record), record=True) as replayed_record:
            replayed = model(ids).logits
    assert torch.equal(plain, recorded)
    torch.testing.assert_close(replayed, plain, rtol=0, atol=1e-6)
    assert replayed_record.num_unrecorded == 0
    assert mismatch_share(replayed_record.used, replayed_record.own, torch.ones(36, dtype=torch.bool)) == 0.0


def test_a_moved_router_disagrees_and_replay_uses_the_recorded_experts_exactly(model):
    """The engine's routing (recorded under the old weights) against a trainer whose routers moved:
    without replay a measurable share of (token, layer) pairs goes elsewhere; with replay every
    token goes exactly where the record says, per layer, and the router still gets a gradient."""
    replay, ids = RoutingReplay(model), _ids(1)
    record, routes = _record_then_move_the_routers(model, replay, ids, seed=2)
    every = torch.ones(36, dtype=torch.bool)
    with torch.no_grad(), replay.using(None, record=True) as moved:
        model(ids)
    assert mismatch_share(record.used, moved.used, every) > 0.2  # measured ~0.5 with this push
    with replay.using(routes, record=True) as replayed:
        logits = model(ids).logits
    for layer in range(replay.num_layers):
        assert torch.equal(replayed.used[layer], routes[:, :, layer].reshape(36, -1)), layer
    assert mismatch_share(replayed.used, replayed.own, every) == mismatch_share(record.used, moved.used, every)
    logits.logsumexp(-1).sum().backward()
    for router in replay.routers:
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_unrecorded_tokens_route_themselves_and_are_counted(model):
    replay = RoutingReplay(model)
    ids = _ids(3)
    with torch.no_grad(), replay.using(None, record=True) as record:
        model(ids)
    routes = _routes(record).clone()
    pushed = (routes + 1) % 8  # every recorded expert moved by one: differs from the router's own
    pushed[0, 5:] = UNRECORDED  # e.g. the observation tokens of an episode
    with torch.no_grad(), replay.using(pushed, record=True) as replayed:
        model(ids)
    assert replayed.num_unrecorded == 7 * replay.num_layers
    for layer in range(replay.num_layers):
        used, own = replayed.used[layer].reshape(3, 12, -1), replayed.own[layer].reshape(3, 12, -1)
        assert torch.equal(used[0, 5:], own[0, 5:])  # the router's own choice, in this pass
        assert torch.equal(used[0, :5], pushed[0, :5, layer]) and torch.equal(used[1:], pushed[1:, :, layer])


def test_routes_of_the_wrong_shape_are_refused_naming_it(model):
    replay = RoutingReplay(model)
    with pytest.raises(ValueError, match=r"\[batch, tokens, 2 layers, top_k\]"):
        with replay.using(torch.zeros(3, 12, 5, 2, dtype=torch.long)):
            pass
    with pytest.raises(ValueError, match="36 recorded tokens"), torch.no_grad():
        with replay.using(torch.zeros(3, 12, 2, 2, dtype=torch.long)):
            model(_ids(shape=(3, 10)))


def test_expert_load_is_each_experts_share_of_the_routed_slots():
    used = [torch.tensor([[0, 1], [0, 2], [3, 0]])]
    load = expert_load(used, 4, torch.tensor([True, True, False]))
    torch.testing.assert_close(load, torch.tensor([[0.5, 0.25, 0.25, 0.0]]))


def test_the_step_sums_count_mismatches_and_the_loss_matches_transformers(model):
    """Replay off, a moved router: the trainer routes itself and `routing_sums` reports the share
    of (token, layer) pairs where it left the record; the load-balancing loss is transformers'
    (`load_balancing_loss_func`) divided by top_k, so balanced routing gives 1.0."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from rlactors.trainer.routing_replay import load_balancing_loss, routing_sums

    replay, ids = RoutingReplay(model), _ids(4)
    _, routes = _record_then_move_the_routers(model, replay, ids, seed=5)
    with torch.no_grad(), replay.using(routes, record=True, replay=False) as compared:
        model(ids)
    assert compared.num_unrecorded == 0 and all(torch.equal(u, o) for u, o in zip(compared.used, compared.own, strict=True))
    positions, weights = torch.arange(36), torch.ones(36)
    weights[30:] = 0  # tokens that do not train count nowhere
    sums = routing_sums(compared, positions, weights)
    expected = sum(mismatch_share([r[:30]], [o[:30]], torch.ones(30, dtype=torch.bool))
                   for r, o in zip(compared.recorded, compared.own, strict=True)) / 2 * 30
    assert sums["routing_mismatch_share"].item() == pytest.approx(expected) and expected > 0
    assert sums["routing_unrecorded_share"].item() == 0
    load = expert_load(compared.used, 8, weights.bool())
    assert sums["expert_load_max"].item() == pytest.approx(load.max().item() * 30)
    every = torch.ones(36, dtype=torch.bool)
    ours = load_balancing_loss(compared.router_logits, compared.own, every)
    for layer in range(2):
        theirs = load_balancing_loss_func((compared.router_logits[layer],), 8, 2)
        alone = load_balancing_loss([compared.router_logits[layer]], [compared.own[layer]], every)
        assert alone.item() == pytest.approx(theirs.item() / 2, rel=1e-5)
    assert 1.0 <= ours.item() < 8.0


def test_replay_held_through_backward_gives_checkpointed_gradients_their_routing(tiny_moe_model_dir):
    """Gradient checkpointing runs each layer's forward again in the backward pass: replay must
    still be on there (the trainer holds it through `backward()`), or the recomputed layers route
    by the moved router and the gradients belong to another network (here torch's checkpoint
    check refuses the recomputation)."""
    def gradients(checkpointing: bool, hold_through_backward: bool) -> torch.Tensor:
        model = load_model(tiny_moe_model_dir).train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        replay = RoutingReplay(model)
        _, routes = _record_then_move_the_routers(model, replay, _ids(6), seed=7)
        with replay.using(routes):
            loss = model(_ids(6)).logits.logsumexp(-1).sum()
            if hold_through_backward:
                loss.backward()
        if not hold_through_backward:
            loss.backward()
        return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])

    plain = gradients(checkpointing=False, hold_through_backward=True)
    torch.testing.assert_close(gradients(checkpointing=True, hold_through_backward=True), plain)
    try:  # released before backward: torch notices the recomputation differs, or the gradients do
        released = gradients(checkpointing=True, hold_through_backward=False)
    except torch.utils.checkpoint.CheckpointError:
        released = None
    assert released is None or not torch.allclose(released, plain)


# One tiny random model per router class in `ROUTER_RULES` (Qwen3-MoE both ways of its top-k).
TINY_MOE_CONFIGS = {
    "qwen3_moe normalised": ("Qwen3MoeConfig", dict(num_experts=8, norm_topk_prob=True, moe_intermediate_size=16)),
    "qwen3_moe unnormalised": ("Qwen3MoeConfig", dict(num_experts=8, norm_topk_prob=False, moe_intermediate_size=16)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=8, norm_topk_prob=False, moe_intermediate_size=16,
                                         shared_expert_intermediate_size=16)),
    "olmoe": ("OlmoeConfig", dict(num_experts=8, norm_topk_prob=False)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=8)),
    "gpt_oss": ("GptOssConfig", dict(num_local_experts=8)),
}


def tiny_moe(name: str, dtype: torch.dtype) -> torch.nn.Module:
    import transformers

    config_class, experts = TINY_MOE_CONFIGS[name]
    config = getattr(transformers, config_class)(
        vocab_size=256, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, num_experts_per_tok=2, max_position_embeddings=64,
        initializer_range=0.08, **experts)  # wide: routers whose logits differ clearly between experts
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).to(dtype).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(TINY_MOE_CONFIGS))
def test_replaying_its_own_top_k_gives_each_router_its_own_weights_exactly(name, dtype):
    """Each known router class, replayed on the experts it chose itself: the weights its forward
    hands the experts, and so the model's logits, are bit for bit those of its own forward (a
    Mixtral or gpt-oss router replayed as an unnormalised softmax over all experts is another
    network)."""
    model, ids = tiny_moe(name, dtype), _ids()
    replay = RoutingReplay(model)
    assert replay.layer_indices == [0, 1]
    weights = []
    for router in replay.routers:  # after replay's hook: what the experts are handed
        router.register_forward_hook(lambda module, inputs, output: weights.append(output[1]))
    with torch.no_grad():
        with replay.using(None, record=True) as record:
            own = model(ids).logits
        own_weights, weights[:] = list(weights), []
        with replay.using(_routes(record)) as replayed_record:
            replayed = model(ids).logits
    assert replayed_record.num_unrecorded == 0
    for layer, (theirs, ours) in enumerate(zip(own_weights, weights, strict=True)):
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs), (name, layer, (ours - theirs).abs().max())
    assert torch.equal(replayed, own)


def test_a_router_class_without_a_known_rule_is_refused_naming_it(model, monkeypatch):
    """Replaying through a router whose weighing is not known would train another network than
    the engine's; recording and comparing need no rule."""
    import rlactors.trainer.routing_replay as routing_replay

    replay, ids = RoutingReplay(model), _ids()
    with torch.no_grad(), replay.using(None, record=True) as record:
        model(ids)
    monkeypatch.delitem(routing_replay.ROUTER_RULES, "Qwen3MoeTopKRouter")
    with torch.no_grad(), replay.using(_routes(record), record=True, replay=False):
        model(ids)
    with pytest.raises(ValueError, match=r"router class Qwen3MoeTopKRouter .* it knows GptOssTopKRouter, "
                                         r"MixtralTopKRouter"):
        with replay.using(_routes(record)):
            pass
