"""engine_core's process bookkeeping, on real child processes, and its calls into vLLM, on a stand-in
(no vLLM needed)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import psutil
import pytest

from rlactors.rollout import engine_core
from rlactors.rollout.engine_core import vllm_processes

# A child that names itself as vLLM's processes do (the kernel's `comm`, what psutil's name() reads).
NAMED_CHILD = "open('/proc/self/comm', 'w').write('VLLM::Fake'); import time; time.sleep(60)"
BUSY_CHILD = "open('/proc/self/comm', 'w').write('VLLM::Fake'); import time; end = time.monotonic() + 60\nwhile time.monotonic() < end: pass"


def start_named_child(busy: bool = False) -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", BUSY_CHILD if busy else NAMED_CHILD])
    deadline = time.monotonic() + 30
    while psutil.Process(child.pid).name() != "VLLM::Fake":
        if time.monotonic() > deadline:
            child.kill()
            pytest.fail("the child never renamed itself")
        time.sleep(0.05)
    return child


def test_vllm_processes_reuses_its_listing_while_every_process_runs_and_lists_again_after_one_ends(monkeypatch):
    monkeypatch.setattr(engine_core, "_FOUND", {})
    listings = []
    children = psutil.Process.children
    monkeypatch.setattr(psutil.Process, "children", lambda self, **kw: listings.append(self.pid) or children(self, **kw))
    first = start_named_child()
    try:
        found = vllm_processes()
        assert [p.pid for p in found] == [first.pid]
        num_listings = len(listings)
        assert [p.pid for p in vllm_processes()] == [first.pid]
        assert len(listings) == num_listings  # the cached listing, every process in it still running
        first.kill()
        first.wait()
        second = start_named_child()
        try:
            assert [p.pid for p in vllm_processes()] == [second.pid]  # listed afresh: one had ended
            assert len(listings) > num_listings
        finally:
            second.kill()
            second.wait()
    finally:
        first.kill()
        first.wait()


def test_vllm_calls_stop_vllm_only_once_no_call_awaits_an_answer_and_continue_it_at_the_next(monkeypatch):
    events = []
    monkeypatch.setattr(engine_core, "Suspension", lambda: SimpleNamespace(suspend=lambda: events.append("stop"),
                                                                          resume=lambda: events.append("continue")))
    calls = engine_core.VllmCalls(SimpleNamespace(errored=False), "cpu", error_file="", hang_timeout_s=lambda: 60.0)

    async def scenario():
        answer = asyncio.get_running_loop().create_future()
        waiting = asyncio.create_task(calls("weight_checksums", answer))
        await asyncio.sleep(0)
        calls.suspend_when_idle()  # as a sleep does, with that call still awaiting its answer
        assert events == ["continue"]
        answer.set_result("checksums")
        assert await waiting == "checksums"
        assert events == ["continue", "stop"]  # once its answer came
        assert await calls("wake_up", asyncio.sleep(0, "awake")) == "awake"

    asyncio.run(scenario())
    assert events == ["continue", "stop", "continue"]  # the next call took the stop back for good


def test_suspension_returns_once_every_process_is_stopped_and_resume_continues_them(monkeypatch, caplog):
    monkeypatch.setattr(engine_core, "_FOUND", {})
    # A busy vLLM stand-in that seldom gets its core (a busy neighbour, and the idle scheduling class):
    # SIGSTOP takes effect only when it next runs, as on a loaded machine.
    neighbour = subprocess.Popen([sys.executable, "-c", BUSY_CHILD.split("; ", 1)[1]])  # not named vLLM
    child = start_named_child(busy=True)
    try:
        core = min(os.sched_getaffinity(0))
        for pid in (neighbour.pid, child.pid):
            os.sched_setaffinity(pid, {core})
        os.sched_setscheduler(child.pid, os.SCHED_IDLE, os.sched_param(0))
        suspension = engine_core.Suspension()
        suspension.suspend()
        assert psutil.Process(child.pid).status() == psutil.STATUS_STOPPED
        suspension.resume()
        assert psutil.Process(child.pid).status() != psutil.STATUS_STOPPED
        # One that never reports stopped: the wait ends at its bound and names the process.
        monkeypatch.setattr(engine_core, "STOP_TIMEOUT_S", 0.05)
        monkeypatch.setattr(engine_core, "stopped", lambda process: False)
        suspension.suspend()
        assert f"[{child.pid}] were sent SIGSTOP" in caplog.text
        suspension.resume()
    finally:
        for process in (child, neighbour):
            process.kill()
            process.wait()


def test_a_core_that_stops_answering_fails_the_calls_waiting_on_it_and_one_that_answers_again_does_not(monkeypatch):
    """The heartbeat over a stand-in core whose answers can be held back: a slow call into a core
    that answers its heartbeat completes; once the core answers nothing for the limit, a waiting
    call raises EngineDeadError saying it is hung, and so does `hung_error` (what health() reports);
    a core stopped on purpose (asleep on CPU) is never asked, so never counts as silent."""
    monkeypatch.setattr(engine_core, "HEARTBEAT_INTERVAL_S", 0.01)
    monkeypatch.setattr(engine_core, "DEATH_POLL_S", 0.01)

    async def scenario():
        answering = asyncio.Event()
        answering.set()

        async def is_sleeping():
            await answering.wait()
            return False

        calls = engine_core.VllmCalls(SimpleNamespace(errored=False, is_sleeping=is_sleeping), "cuda", "", lambda: 0.3)
        assert await calls("slow", asyncio.sleep(0.6, "done")) == "done"  # twice the limit, the core answering
        assert calls.hung_error("health") is None

        answering.clear()  # the core stops answering (a stopped process, a hung collective)
        started = time.monotonic()
        with pytest.raises(engine_core.engine_dead_error_class()) as raised:
            await calls("start_weight_update", asyncio.get_running_loop().create_future())
        assert 0.3 <= time.monotonic() - started < 5.0
        assert "start_weight_update" in str(raised.value) and "hung: it answered nothing for" in str(raised.value)
        assert "rollout.health_timeout_s=0.3" in str(raised.value)
        assert "hung" in str(calls.hung_error("health"))

        answering.set()  # it answers again: no longer silent
        await asyncio.sleep(0.05)
        assert calls.core_silent_s() < 0.05 and calls.hung_error("health") is None

        calls._suspension.processes = ["stopped on purpose"]  # as `suspend_when_idle` leaves it
        answering.clear()
        await asyncio.sleep(0.5)
        assert calls.core_silent_s() == 0.0 and calls.hung_error("health") is None
        calls._suspension.processes = []
        answering.set()

    asyncio.run(scenario())
