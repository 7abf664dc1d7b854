"""When a rollout engine lets a request into vLLM, so that it knows exactly which weights produce
the request's tokens (pure asyncio; the engine is its one user).

    async with gate.admit():                      # waits while the gate is closed
        version = engine.policy_version           # the weights every token of this request will come from
        queue = await llm.add_request(...)        # handed to vLLM's engine core inside the gate
    await gate.close(timeout_s)                   # before pausing vLLM for a weight update or sleep
    gate.open()                                   # once the new weights are loaded and the engine awake

Invariant: between `close()` returning and the next `open()`, no request enters vLLM, and every
request admitted before has been handed to vLLM's engine core. vLLM's engine core takes requests
and calls (pause, sleep) in the order they were sent, so a pause sent after `close()` comes after
every admitted request: each one runs to its end (`wait`) or is aborted (`abort`) under the weights
it was admitted with (what "wait" leaves queued or preempted, the engine aborts after it). A request waiting at a closed gate enters after the update, under the new
weights. So one vLLM request never spans two weight versions, and the version read inside
`admit()` is that of every token it returns, whatever the vLLM version (older ones do not label
tokens themselves).
"""

from __future__ import annotations

import asyncio
import contextlib


class AdmissionGate:
    def __init__(self):
        self._open = asyncio.Event()
        self._open.set()
        self._num_entering = 0
        self._none_entering = asyncio.Event()
        self._none_entering.set()

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    @contextlib.asynccontextmanager
    async def admit(self):
        """Wait until the gate is open, then hold it open for `close()` until the body ends (the
        body hands one request to vLLM)."""
        while not self._open.is_set():  # opened and closed again before this waiter ran: wait again
            await self._open.wait()
        self._num_entering += 1
        self._none_entering.clear()
        try:
            yield
        finally:
            self._num_entering -= 1
            if not self._num_entering:
                self._none_entering.set()

    async def close(self, timeout_s: float) -> None:
        """Admit nothing more, and return once every admitted request has entered vLLM. After
        `timeout_s`, opens again and raises TimeoutError naming what it waited for."""
        self._open.clear()
        try:
            await asyncio.wait_for(self._none_entering.wait(), timeout_s)
        except TimeoutError:
            self._open.set()  # the caller changes nothing after a failed close: admissions resume
            raise TimeoutError(f"{self._num_entering} request(s) still entering vLLM after {timeout_s:g} s: the "
                               "weights cannot change under them") from None

    def open(self) -> None:
        self._open.set()


async def run_request(llm, gate: AdmissionGate, weights, wanted, prompt, params, request_id: str):
    """Run one request on vLLM's `AsyncLLM` `llm`, admitted through `gate`; returns its final
    `RequestOutput` (params ask for FINAL_ONLY) and the policy version of every token in it.
    `weights()`, read at admission, gives that version and the LoRA adapter the request names (None:
    the base weights alone); (None, None) if `wanted()` is false once admitted (it
    was aborted while it waited at the gate). This is `AsyncLLM.generate` with the hand-over made
    visible: `add_request` returns once the request is on its way to the engine core, which
    `generate` does inside its generator, out of the gate's sight."""
    async with gate.admit():
        if not wanted():
            return None, None
        version, adapter = weights()
        queue = await llm.add_request(request_id, prompt, params, lora_request=adapter)
    try:
        while True:
            output = queue.get_nowait() or await queue.get()  # raises what vLLM failed the request with
            if output.finished:
                return output, version
    except BaseException:  # cancelled (the caller went away) or failed: vLLM must not go on with it
        if not llm.errored:
            await llm.abort(queue.request_id, internal=True)
        raise
    finally:
        queue.close()
