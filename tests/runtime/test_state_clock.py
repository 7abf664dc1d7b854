import pytest

from rlactors.runtime.state_clock import StateClock


class FakeTime:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_each_state_gets_the_time_spent_in_it_and_the_total_is_the_elapsed_time():
    time = FakeTime()
    clock = StateClock(("generating", "paused", "idle"), "idle", now=time)
    time.now += 1.0
    clock.switch("generating")
    time.now += 2.5
    clock.switch("generating")  # no change: the running interval goes on
    time.now += 0.5
    clock.switch("paused")
    time.now += 0.25
    assert clock.seconds() == {"generating": 3.0, "paused": 0.25, "idle": 1.0}  # the running state counted up to now
    time.now += 0.75
    clock.switch("idle")
    assert clock.seconds() == {"generating": 3.0, "paused": 1.0, "idle": 1.0}
    assert sum(clock.seconds().values()) == time.now - 100.0


def test_reset_starts_over_and_an_unknown_state_is_refused():
    time = FakeTime()
    clock = StateClock(("working", "blocked"), "working", now=time)
    time.now += 5.0
    clock.reset("blocked")
    time.now += 1.0
    assert clock.seconds() == {"working": 0.0, "blocked": 1.0}
    with pytest.raises(ValueError, match="'asleep' is not one of"):
        clock.switch("asleep")
    with pytest.raises(ValueError, match="'asleep' is not one of"):
        StateClock(("working", "blocked"), "asleep")


def test_a_level_clock_sums_level_times_seconds_and_its_mean_over_a_span_is_the_mean_level():
    from rlactors.runtime.state_clock import LevelClock

    time = FakeTime()
    running = LevelClock(now=time)
    time.now += 2.0  # level 0 until set
    running.set(4)
    time.now += 1.0
    before = running.total()
    running.set(1)
    time.now += 3.0
    assert running.total() == 4 * 1.0 + 1 * 3.0
    assert (running.total() - before) / 3.0 == 1.0  # the mean level over the last 3 s
