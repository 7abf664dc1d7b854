"""engine_core's process bookkeeping, on real child processes, and its calls into vLLM, on a stand-in
(no vLLM needed)."""

from __future__ import annotations

import asyncio
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


def start_named_child() -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", NAMED_CHILD])
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
    calls = engine_core.VllmCalls(SimpleNamespace(errored=False), "cpu", error_file="")

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
