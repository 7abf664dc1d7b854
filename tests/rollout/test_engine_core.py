"""engine_core's process bookkeeping, on real child processes (no vLLM needed)."""

from __future__ import annotations

import subprocess
import sys
import time

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
