"""The admission gate and `run_request` (pure asyncio): what enters vLLM while weights change, and
which version each request is stamped with; against a stand-in for vLLM's `AsyncLLM` that keeps
the order in which requests and pauses reach its engine core, and the weights each request ran on."""

from __future__ import annotations

import asyncio

import pytest

from rlactors.rollout.admission import AdmissionGate, run_request


class Output:
    def __init__(self, request_id, version):
        self.request_id, self.ran_on, self.finished = request_id, version, True


class Queue:
    def __init__(self, request_id):
        self.request_id, self.items, self.ready, self.closed = request_id, [], asyncio.Event(), False

    def put(self, item):
        self.items.append(item)
        self.ready.set()

    def get_nowait(self):
        return self.items.pop(0) if self.items else None

    async def get(self):
        await self.ready.wait()
        self.ready.clear()
        item = self.items.pop(0)
        if isinstance(item, Exception):
            raise item
        return item

    def close(self):
        self.closed = True


class EngineCore:
    """vLLM's contract, as far as the gate relies on it: requests and pauses are taken in the order
    they were sent; a request runs on the weights loaded when the engine core takes it up, unless
    the scheduler is paused, in which case it runs after the resume. `add_request` takes `hand_over_s`
    before the request is sent (vLLM's input processing)."""

    def __init__(self, hand_over_s=0.0, run_s=0.01):
        self.weights, self.paused, self.hand_over_s, self.run_s = 0, False, hand_over_s, run_s
        self.queued: list[tuple[str, Queue]] = []
        self.log: list[str] = []
        self.errored = False
        self.aborted: list[str] = []
        self.queues: dict[str, Queue] = {}

    async def add_request(self, request_id, prompt, params, lora_request=None):
        await asyncio.sleep(self.hand_over_s)
        queue = self.queues[request_id] = Queue(request_id)
        self.log.append(f"add {request_id}")
        if self.paused:
            self.queued.append((request_id, queue))
        else:
            self._run(request_id, queue)
        return queue

    def _run(self, request_id, queue):
        weights = self.weights
        asyncio.get_running_loop().call_later(self.run_s, queue.put, Output(request_id, weights))

    async def pause(self):  # mode "wait": requests already taken finish on the old weights
        self.log.append("pause")
        self.paused = True
        await asyncio.sleep(self.run_s * 2)

    def load(self, weights):
        self.weights = weights

    def resume(self):
        self.paused = False
        for request_id, queue in self.queued:
            self._run(request_id, queue)
        self.queued = []

    async def abort(self, request_id, internal=False):
        self.aborted.append(request_id)


async def update(gate, core, engine_state, version):
    """What RolloutEngine.start_/finish_weight_update do around the gate."""
    await gate.close(5.0)
    await core.pause()
    core.load(version)
    engine_state["version"] = version
    core.resume()
    gate.open()


@pytest.mark.parametrize("hand_over_s", [0.0, 0.005])
def test_every_request_is_stamped_with_the_weights_it_ran_on_across_updates(hand_over_s):
    async def scenario():
        gate, core, state = AdmissionGate(), EngineCore(hand_over_s=hand_over_s), {"version": 0}
        results = []

        async def client(i):
            for j in range(20):
                output, version = await run_request(core, gate, lambda: (state["version"], None), lambda: True,
                                                    [1], None, f"r{i}.{j}")
                results.append((output.ran_on, version))

        async def trainer():
            for version in range(1, 6):
                await asyncio.sleep(0.013)
                await update(gate, core, state, version)

        await asyncio.gather(*(client(i) for i in range(8)), trainer())
        return results

    results = asyncio.run(scenario())
    assert len(results) == 160
    assert all(ran_on == stamped for ran_on, stamped in results), [r for r in results if r[0] != r[1]][:5]
    assert len({ran_on for ran_on, _ in results}) > 2  # the updates landed amid the requests


def test_the_same_race_without_the_gate_stamps_wrong_versions():
    """The stand-in can tell: read the version without holding the gate, and requests handed over
    during an update run on the new weights under the old label."""

    async def scenario():
        core, state = EngineCore(hand_over_s=0.005), {"version": 0}
        wrong = 0

        async def client(i):
            nonlocal wrong
            for j in range(20):
                version = state["version"]
                queue = await core.add_request(f"r{i}.{j}", [1], None)
                output = await queue.get()
                wrong += output.ran_on != version

        async def trainer():
            for version in range(1, 6):
                await asyncio.sleep(0.013)
                await core.pause()
                core.load(version)
                state["version"] = version
                core.resume()

        await asyncio.gather(*(client(i) for i in range(8)), trainer())
        return wrong

    assert asyncio.run(scenario()) > 0


def test_close_waits_for_requests_being_handed_over_and_nothing_enters_until_open():
    async def scenario():
        gate, core = AdmissionGate(), EngineCore(hand_over_s=0.05)
        first = asyncio.create_task(run_request(core, gate, lambda: (0, None), lambda: True, [1], None, "first"))
        await asyncio.sleep(0.01)  # `first` is inside the gate, not yet in the engine core
        await gate.close(5.0)
        assert core.log == ["add first"]  # close returned only once it was handed over
        late = asyncio.create_task(run_request(core, gate, lambda: (1, None), lambda: True, [1], None, "late"))
        await asyncio.sleep(0.1)
        assert core.log == ["add first"] and not late.done()
        gate.open()
        await asyncio.gather(first, late)
        return core.log

    assert asyncio.run(scenario()) == ["add first", "add late"]


def test_a_request_aborted_while_it_waits_at_the_gate_never_enters():
    async def scenario():
        gate, core = AdmissionGate(), EngineCore()
        wanted = {"yes": True}
        await gate.close(1.0)
        task = asyncio.create_task(run_request(core, gate, lambda: (0, None), lambda: wanted["yes"], [1], None, "r"))
        await asyncio.sleep(0.01)
        wanted["yes"] = False
        gate.open()
        return await task, core.log

    assert asyncio.run(scenario()) == ((None, None), [])


def test_a_close_that_times_out_names_what_it_waited_for_and_reopens():
    async def scenario():
        gate, core = AdmissionGate(), EngineCore(hand_over_s=1.0)
        task = asyncio.create_task(run_request(core, gate, lambda: (0, None), lambda: True, [1], None, "slow"))
        await asyncio.sleep(0.01)
        with pytest.raises(TimeoutError, match=r"1 request\(s\) still entering vLLM after 0.05 s"):
            await gate.close(0.05)
        assert gate.is_open
        await task

    asyncio.run(scenario())


def test_a_failed_or_cancelled_request_is_aborted_in_vllm_and_its_queue_closed():
    async def scenario():
        gate, core = AdmissionGate(), EngineCore(run_s=10.0)
        cancelled = asyncio.create_task(run_request(core, gate, lambda: (0, None), lambda: True, [1], None, "cancelled"))
        failing = asyncio.create_task(run_request(core, gate, lambda: (0, None), lambda: True, [1], None, "failing"))
        await asyncio.sleep(0.01)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        core.queues["failing"].put(RuntimeError("vLLM failed the request"))  # what vLLM's output handler does
        with pytest.raises(RuntimeError, match="vLLM failed the request"):
            await failing
        assert core.aborted == ["cancelled", "failing"]
        assert all(queue.closed for queue in core.queues.values())

    asyncio.run(scenario())
