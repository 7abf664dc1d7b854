"""A run's teardown on real actors: a part that hangs or raises is killed and named, every other
part is still stopped, and an error already on its way stays the one raised."""

import time

import pytest
import ray
from conftest import actor_gone

from rlactors.pipelines.teardown import Part, stop_all


@ray.remote(num_cpus=0)
class Stoppable:
    def hang(self):
        time.sleep(600)

    def fail(self):
        raise ValueError("cannot stop")

    def stop(self):
        return "stopped"


def _parts():
    hung, failing, fine = Stoppable.remote(), Stoppable.remote(), Stoppable.remote()
    ray.get([a.__ray_ready__.remote() for a in (hung, failing, fine)])
    parts = [Part("hung part", lambda: ray.get(hung.hang.remote()), [hung]),
             Part("failing part", lambda: ray.get(failing.fail.remote()), [failing]),
             Part("fine part", lambda: ray.get(fine.stop.remote()), [fine])]
    return parts, (hung, failing, fine)


def test_every_part_is_stopped_and_the_failures_named_after(ray_session):
    parts, actors = _parts()
    with pytest.raises(RuntimeError, match=r"hung part: TimeoutError: did not stop within 2 s; "
                                           r"failing part: ValueError: cannot stop"):
        stop_all(parts, timeout_s=2)
    assert all(actor_gone(actor) for actor in actors)


def test_an_error_on_its_way_stays_the_one_raised_with_a_note(ray_session):
    parts, actors = _parts()
    with pytest.raises(KeyError, match="the run's own error") as failure:
        try:
            raise KeyError("the run's own error")
        finally:
            stop_all(parts, timeout_s=2)
    assert any("hung part" in note and "failing part" in note for note in failure.value.__notes__)
    assert all(actor_gone(actor) for actor in actors)
