"""`WarmActors` on real actors and placement groups, with engines that only answer the calls it
makes (a run on kept vLLM engines, trained exactly like one that started them, is in
tests/pipelines/test_pipelines.py): what is taken, kept, refused and stopped."""

import pytest
import ray
from conftest import actor_gone

from rlactors.config import TrainerConfig
from rlactors.pipelines.warm import WarmActors, trainer_key
from rlactors.placement.cluster import Placement
from rlactors.rollout.router import RolloutRouter

pytestmark = pytest.mark.timeout(300)


@ray.remote(num_cpus=0)
class Engine:
    """What `keep` asks of an engine: stop generating, leave the trainer's weight transfer, sleep."""

    def __init__(self):
        self.calls = []

    def abort(self, group_ids):
        self.calls.append(f"abort {group_ids}")

    def shutdown_weight_transfer(self):
        self.calls.append("shutdown_weight_transfer")

    def sleep(self):
        self.calls.append("sleep")

    def calls_made(self):
        return self.calls


def _placement() -> Placement:
    """A one-bundle placement group of 1 CPU, as a run's plan would reserve it."""
    group = ray.util.placement_group([{"CPU": 1}])
    ray.get(group.ready(), timeout=60)
    return Placement(plan=None, groups={("rollout", 0): (group, [0])})


def _kept_run(warm: WarmActors, key: tuple) -> tuple[RolloutRouter, Placement]:
    engines = [Engine.remote() for _ in range(2)]
    router, placement = RolloutRouter(engines), _placement()
    assert warm.keep(key, placement, router)
    return router, placement


def _removed(group) -> bool:
    return ray.util.placement_group_table(group)["state"] == "REMOVED"


def test_kept_engines_sleep_without_a_trainer_and_are_taken_by_the_same_key_only(ray_session):
    warm = WarmActors()
    router, placement = _kept_run(warm, ("model", "settings", "plan"))
    at_rest = ["abort None", "shutdown_weight_transfer", "sleep"]
    assert [ray.get(e.calls_made.remote(), timeout=30) for e in router.engines] == [at_rest] * 2
    kept = warm.take(("model", "settings", "plan"))
    assert kept.engines == router.engines and kept.placement is placement and warm.num_taken == 1
    assert warm.kept is None  # the run owns them now
    (group, _), = placement.groups.values()
    warm.keep(("model", "settings", "plan"), placement, router)
    assert warm.take(("model", "other settings", "plan")) is None  # stopped, for the run to start its own
    assert all(actor_gone(engine) for engine in router.engines) and _removed(group)
    assert warm.num_taken == 1 and warm.kept is None


def test_a_run_that_lost_a_replica_keeps_nothing_and_one_that_failed_otherwise_keeps_its_engines(ray_session):
    warm = WarmActors()
    router = RolloutRouter([Engine.remote()])
    router.replicas.mark_dead({0: "killed"})  # as a failed start or a spent restart leaves it
    assert not warm.keep(("key",), _placement(), router) and warm.kept is None
    assert ray.get(router.engines[0].calls_made.remote(), timeout=30) == []
    router = RolloutRouter([Engine.remote()])
    try:
        raise RuntimeError("the reward function failed")
    except RuntimeError:
        assert warm.keep(("key",), _placement(), router)  # in the run's teardown, its error on the way
    assert warm.kept.engines == router.engines
    assert ray.get(router.engines[0].calls_made.remote(), timeout=30) == ["abort None", "shutdown_weight_transfer",
                                                                          "sleep"]
    warm.close()


def test_keeping_stops_what_was_kept_before_and_close_stops_the_rest(ray_session):
    warm = WarmActors()
    old_router, old_placement = _kept_run(warm, ("a",))
    (old_group, _), = old_placement.groups.values()
    new_router, new_placement = _kept_run(warm, ("b",))  # one set at a time
    assert all(actor_gone(engine) for engine in old_router.engines) and _removed(old_group)
    (new_group, _), = new_placement.groups.values()
    warm.close()
    assert all(actor_gone(engine) for engine in new_router.engines) and _removed(new_group)
    warm.close()  # nothing kept: nothing to do


def test_engines_kept_on_a_cluster_that_is_gone_are_dropped_untouched(ray_session):
    warm = WarmActors()
    router, placement = _kept_run(warm, ("key",))
    warm.kept.cluster = "a cluster since shut down"
    assert warm.take(("key",)) is None and warm.kept is None
    assert not any(actor_gone(engine, timeout_s=2) for engine in router.engines)  # not this cluster's to stop
    for engine in router.engines:
        ray.kill(engine)
    placement.release()



class _Group:
    """What `take_trainers` and the teardown ask of a trainer group: its role, rank actors, shutdown."""

    def __init__(self, role):
        self.role, self.workers, self.shut_down = role, [Engine.remote()], False

    def shutdown(self):
        self.shut_down = True


def test_a_run_takes_the_kept_trainer_groups_whose_ranks_would_start_alike_and_the_rest_are_stopped(ray_session):
    trainer = TrainerConfig()
    assert trainer_key("actor", trainer) == trainer_key("actor", trainer.model_copy(update={"max_tokens_per_micro_batch": 7}))
    for other in ({"num_workers": 2}, {"cpu_cores": "all"}, {"num_cpus_per_worker": 2.0}, {"collective_timeout_s": 5}):
        assert trainer_key("actor", trainer) != trainer_key("actor", trainer.model_copy(update=other)), other
    warm = WarmActors()
    actor, critic = _Group("actor"), _Group("critic")
    router = RolloutRouter([Engine.remote()])
    assert warm.keep(("key",), _placement(), router, {trainer_key("actor", trainer): actor,
                                                       trainer_key("critic", trainer): critic})
    kept = warm.take(("key",))
    taken = warm.take_trainers(kept, [trainer_key("actor", trainer), trainer_key("reference", trainer)])
    assert taken == {trainer_key("actor", trainer): actor} and warm.num_trainers_taken == 1
    assert critic.shut_down and actor_gone(critic.workers[0])  # its bundles are the run's now
    assert not actor.shut_down and not actor_gone(actor.workers[0], timeout_s=2)
    warm.keep(("key",), kept.placement, router, taken)
    warm.close()
    assert actor.shut_down and all(actor_gone(a) for a in [*actor.workers, *router.engines])
