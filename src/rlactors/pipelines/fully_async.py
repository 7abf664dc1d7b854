"""Fully-async driver: the rollout side generates continuously into the replay buffer while the
trainer consumes batches as soon as they are ready, on separate devices.

The rollout side streams (`Producer`): it keeps `pipeline.num_groups_in_flight` groups generating
(by default enough to fill every engine's `max_num_seqs`), scores and puts each group in the buffer
as it finishes, and sends new prompts once a quarter of that number has finished, so the engines
stay full while the longest responses of a batch run (a long tail costs colocated mode a nearly
empty engine; here only its own slots). `rollout/occupancy` in each step's metrics says how full the engines were.

Staleness is bounded twice. The producer generates until the buffer has kept `capacity_groups`
(= (1 + staleness_threshold) x batch_size_prompts x trigger_parameter_sync_step) groups since the
last published policy version, as veRL's rollouter does (dropped groups, which no batch trains, do
not count); and the buffer never hands out a group older than `max_staleness` versions (stale ones
are evicted and their prompts re-issued, or dropped).

Weights are published every `trigger_parameter_sync_step` updates; with `rollout.partial_rollout`
the engines interrupt in-flight responses at the sync and continue them with the new weights.
With max_staleness=0, staleness_threshold=0 and trigger 1 this trains exactly like colocated.
The trainer acks a batch after publishing the weights it trained: the room the ack frees in the
buffer is then generated under those weights, never under the old ones just before the sync
(whose groups would be a version staler than the rest, and with max_staleness 1 evicted).

Nothing waits forever: the trainer's wait for a batch ends once no group has reached the buffer
for `pipeline.batch_timeout_s` (`next_batch`), with what the producer, the buffer and each
rollout replica were doing; the router finds a hung engine on its own (`rlactors.rollout.watchdog`).

Where each pool's time goes is in every step's metrics: the trainer's phases and its wait for a
batch (`timing_s/gen`), and the rollout side's `timing_s/rollout_generating|paused|idle|blocked`
(`Producer.time_metrics`; `benchmarks/async_vs_colocated.py` turns them into shares).

Checkpoints are taken by the trainer loop while the producer keeps generating: the producer feeds
prompts under `PromptDataset.lock` (cursor advance and `add_prompts` as one step), and the
checkpoint snapshots the buffer and the cursor under the same lock, so they always agree (see
`rlactors.pipelines.checkpointing`).
"""

from __future__ import annotations

import threading
import time

import ray

from rlactors.buffer.records import DROP_KINDS, capacity_groups
from rlactors.config import Config
from rlactors.pipelines.build import Run, build_run
from rlactors.pipelines.common import (
    begin,
    end_step,
    feed_prompts,
    finish,
    prepare_batch,
    rollout_occupancy,
    scoring_bound_s,
    sync_weights,
    update,
)
from rlactors.pipelines.warm import WarmActors
from rlactors.runtime.state_clock import StateClock

# The longest the producer waits on the engines or its puts before it looks at `stopping` and tops up.
WAIT_S = 0.2
# After the buffer refused a reservation (backpressure), the producer asks again when the trainer
# sampled or acked a batch, or a put was dropped (what frees room), and at least this often.
RETRY_S = 1.0


class Producer(threading.Thread):
    """Driver-side rollout loop that streams: it keeps `target` groups generating on the engines,
    scores and puts each group as it finishes, and tops them up once `top_up_step` have finished
    (reserve -> generate -> score -> put, no batch barrier), so a long response holds its own slot
    only, never the engines. Errors are kept in `error` for the trainer loop to raise.

    The staleness bound: a window per published policy version, in which the groups reserved may
    fill at most `quota` groups the buffer keeps (`in_window` reserved and still in flight count as
    if kept, so the quota is never passed). Only kept groups count: a group the buffer drops (zero
    variance under dynamic sampling, a rollout error, too stale) takes no room in a batch, and
    counting it would leave the producer waiting for a publish that waits for the batch those
    groups did not fill. A publish opens the next window; groups of older windows still in flight
    finish (partial rollouts carry them across the update) and count against none. The buffer's own
    bounds still hold: its backpressure (at most its capacity of groups not yet trained) and dynamic
    sampling's `max_generation_rounds`.

    Where the rollout side's time goes, for the step metrics (`time_metrics`): this thread is
    `blocked` while it has room on the engines but the staleness bound (the quota, the buffer's
    backpressure) lets it reserve nothing, else `working`; beside it, the engines' own clocks
    (generating, paused for a weight update, idle, and their occupancy: `RolloutRouter.clocks`). It
    feeds the buffer before every reservation, so the engines never wait for lack of prompts.

    It shares the driver's core with the trainer loop, so it never polls: it waits on the engines,
    else on its puts (`WAIT_S`), and a reservation the buffer refused is asked again only once
    something may have freed room (the trainer loop's `on_buffer_freed`, a publish, a dropped put)
    or after `RETRY_S`."""

    def __init__(self, run: Run):
        super().__init__(name="rollout-producer", daemon=True)
        pipeline = run.config.pipeline
        self.run_state = run
        self.quota = capacity_groups(pipeline.batch_size_prompts, pipeline.trigger_parameter_sync_step,
                                     run.config.buffer.staleness_threshold)
        self.target = pipeline.num_groups_in_flight or pipeline.batch_size_prompts  # `start` fills the engines
        self.top_up_step = 1
        self.published = threading.Condition()
        self.published_version = run.policy_version
        # Backpressure: what may have freed room in the buffer, counted (a publish, a sample or an ack
        # of the trainer loop, a dropped put), and the count and time when the buffer last refused.
        self.num_frees = 0
        self.refused: tuple[int, float] | None = None
        self.stopping = threading.Event()
        self.error: BaseException | None = None
        self.clock = StateClock(("working", "blocked"), "working")
        self._reported: dict[str, float] = {}  # what `time_metrics` last reported (the trainer thread's)
        self._reported_clocks: dict = {}
        # What this thread is doing, for `describe` (written here, read by the trainer thread).
        self.version = run.policy_version  # the published version whose window is open
        self.num_kept = 0  # groups of this window the buffer kept
        self.in_window: set[str] = set()  # group_ids of this window reserved and not yet put back
        self.num_in_flight = 0  # groups reserved and not yet put back, of every window

    def start(self) -> None:
        router, config = self.run_state.router, self.run_state.config
        if config.pipeline.num_groups_in_flight is None:
            self.target = groups_to_fill(router.capacity(), config.rollout.sampling.num_samples_per_prompt,
                                         config.rollout.num_engines, config.pipeline.batch_size_prompts)
        self.top_up_step = max(1, self.target // 4)
        self.time_metrics()  # the baseline: each step reports the time since the one before
        super().start()

    def on_published(self, policy_version: int) -> None:
        """Called by the trainer loop once the engines hold `policy_version`."""
        with self.published:
            self.published_version = policy_version
            self.num_frees += 1
            self.published.notify_all()

    def on_buffer_freed(self) -> None:
        """Called by the trainer loop after it sampled (evictions) or acked a batch: the buffer may
        have room again for a reservation it refused."""
        with self.published:
            self.num_frees += 1
            self.published.notify_all()

    def run(self) -> None:
        run = self.run_state
        stream = run.router.stream()
        puts: dict = {}  # ref of a put -> (group_id, its deadline)
        bound_s = scoring_bound_s(run.config, 1, run.config.rollout.sampling.num_samples_per_prompt)
        try:
            while not self.stopping.is_set():
                self._top_up(stream)
                # Wait a moment on what is in flight: the engines, else the puts (never spin: this
                # thread shares the driver's core with the trainer loop).
                generating = stream.num_in_flight
                for summary, group_ref in stream.next_done(timeout_s=WAIT_S if generating else 0.0):
                    put = run.buffer.put_refs([run.reward.score(group_ref)])[0]
                    puts[put] = (summary.group_id, time.monotonic() + bound_s)
                self._count_puts(puts, bound_s, wait_s=0.0 if generating else WAIT_S)
        except BaseException as error:  # noqa: BLE001 - surfaced by the trainer loop
            self.error = error
        finally:
            stream.close()  # what is still generating is not wanted: the run ended or failed

    def _top_up(self, stream) -> None:
        """Reserve and send as many groups as the engines have room for and the window allows; wait
        a moment (on a publish, or in the buffer) when nothing can be sent and nothing is in flight."""
        run = self.run_state
        with self.published:
            if self.published_version != self.version:  # a publish opened the next window
                self.version, self.num_kept, self.in_window = self.published_version, 0, set()
            # The engines' room counts groups generating; the window's, groups not yet put back.
            engine_room = self.target - stream.num_in_flight
            window_room = self.quota - self.num_kept - len(self.in_window)
            room = min(engine_room, window_room)
            if room <= 0 and engine_room > 0:
                self.clock.switch("blocked")
                if not self.num_in_flight:
                    self.published.wait(timeout=0.5)
                return
            # Refused by the buffer and nothing freed room since: not asked again (each ask is two
            # or three buffer calls on the driver's core, which the trainer loop shares).
            backpressure = self.num_in_flight and self.refused is not None and self.refused[0] == self.num_frees \
                and time.monotonic() < self.refused[1] + RETRY_S
            num_frees = self.num_frees
        # Top up in steps of `top_up_step` groups (what is left of the window, if less): each top-up
        # costs a reservation and an engine call on the driver's core; the queued groups keep the
        # engines' slots full meanwhile.
        if room <= 0 or (stream.num_in_flight and room < min(self.top_up_step, window_room)):
            self.clock.switch("working")
            return
        if backpressure:
            self.clock.switch("blocked")
            return
        pending = run.buffer.num_pending()
        if pending < room:
            feed_prompts(run, room - pending)  # cursor and buffer move together (its lock)
        # Nothing in flight: wait in the buffer for room (backpressure); else ask and go on reading.
        requests = run.buffer.reserve(room, "producer", timeout_s=0.0 if self.num_in_flight else 0.5)
        if not requests:  # None under backpressure (the buffer is full): look at `stopping` and try again
            self.refused = (num_frees, time.monotonic())
            self.clock.switch("blocked")
            return
        self.clock.switch("working")
        stream.add(requests)
        self.in_window |= {r.group_id for r in requests}
        self.num_in_flight += len(requests)

    def _count_puts(self, puts: dict, bound_s: float, wait_s: float) -> None:
        """Take the puts that landed (waiting up to `wait_s` for the first): count those the buffer
        kept against their window's quota."""
        if not puts:
            return
        if wait_s:
            ray.wait(list(puts), num_returns=1, timeout=wait_s)
        landed, _ = ray.wait(list(puts), num_returns=len(puts), timeout=0)
        for put in landed:
            group_id, _ = puts.pop(put)
            outcome = ray.get(put)  # raises what scoring or the put failed with
            self.num_in_flight -= 1
            if not outcome["kept"]:  # a dropped group frees its room in the buffer
                with self.published:
                    self.num_frees += 1
            if group_id in self.in_window:
                self.in_window.discard(group_id)
                self.num_kept += outcome["kept"]
        now = time.monotonic()
        late = [group_id for group_id, deadline in puts.values() if now > deadline]
        if late:
            raise TimeoutError(f"group(s) {late[:5]} not scored and put in the replay buffer within {bound_s:g} s "
                               "(reward.timeout_s per sample, and the buffer's own bound)")

    def describe(self) -> str:
        """What this thread is doing, in words (for an error that says why no batch came)."""
        if not self.is_alive():
            return "the producer thread has ended" + (f" with {self.error!r}" if self.error else "")
        if self.num_in_flight:
            doing = f"generating {self.num_in_flight} group(s)"
        elif self.num_kept >= self.quota:
            doing = "waiting for a publish (its quota is used)"
        else:
            doing = "reserving prompts (the buffer holds it back while its capacity is taken)"
        return (f"{doing}; {self.num_kept} of its quota of {self.quota} kept group(s) used since policy_version "
                f"{self.version} was published")

    def time_metrics(self) -> dict[str, float]:
        """Since the last call (the trainer loop calls it once a step): seconds the engines spent
        generating, paused and idle (their mean, read now) and this thread blocked, as
        `timing_s/rollout_<state>`, and the engines' occupancy (`rollout/occupancy`)."""
        clocks = self.run_state.router.clocks()
        now = {f"rollout_{state}": seconds for state, seconds in clocks.get("time_s", {}).items()}
        now["rollout_blocked"] = self.clock.seconds()["blocked"]
        # max(0, ...): a replica Ray restarted starts its clock again
        metrics = {f"timing_s/{name}": max(seconds - self._reported.get(name, 0.0), 0.0) for name, seconds in now.items()}
        metrics |= rollout_occupancy(self._reported_clocks, clocks)
        self._reported, self._reported_clocks = now, clocks
        return metrics


def groups_to_fill(capacity: int, num_samples: int, num_engines: int, batch_size: int) -> int:
    """Groups to keep in flight by default: enough samples to fill the engines' `capacity` (their
    max_num_seqs together, each engine's share rounded up), and at least a batch. No more: each
    group beyond the slots waits in vLLM's queue, and at every weight sync it is stopped and resumed
    with the rest (the uniform 16-token benchmark, trainer-bound: 2.7 s a step with 16 groups in
    flight, 3.1 s with 17, 3.3-3.5 s with 32). Long-tailed responses want about twice
    (`pipeline.num_groups_in_flight`): a group is topped up only once its longest sample ends, so
    its other slots stand empty meanwhile."""
    per_engine = -(-capacity // num_engines)
    return max(num_engines * -(-per_engine // num_samples), batch_size)


def batch_timeout_s(config: Config) -> float:
    """`pipeline.batch_timeout_s`, or by default the longest a healthy rollout side can go without a
    group reaching the buffer: a hung engine found by the router's watchdog, restarted, and a
    group scored with every sample running into the reward's time limit."""
    if config.pipeline.batch_timeout_s is not None:
        return config.pipeline.batch_timeout_s
    rollout = config.rollout
    return (rollout.stall_timeout_s + rollout.health_timeout_s + rollout.start_timeout_s
            + rollout.sampling.num_samples_per_prompt * config.reward.timeout_s)


def next_batch(run: Run, producer: Producer, timeout_s: float | None = None):
    """Wait for a full batch, watching the producer's health. The wait is bounded by progress:
    it raises once no group has reached the buffer (kept or dropped) for `timeout_s` (default
    `batch_timeout_s(run.config)`), saying what the producer and the buffer were doing."""
    timeout_s = batch_timeout_s(run.config) if timeout_s is None else timeout_s
    num_put, since = None, time.monotonic()
    while True:
        if producer.error is not None:
            raise RuntimeError("the rollout producer failed") from producer.error
        sampled = run.buffer.sample(run.config.pipeline.batch_size_prompts, run.policy_version, timeout_s=1.0)
        if sampled is not None:
            return sampled
        metrics = run.buffer.metrics()
        if metrics["num_put"] != num_put:
            num_put, since = metrics["num_put"], time.monotonic()
        elif time.monotonic() - since >= timeout_s:
            raise TimeoutError(no_batch_message(run, producer, metrics, timeout_s))


def no_batch_message(run: Run, producer: Producer, buffer: dict[str, float], timeout_s: float) -> str:
    """Why the trainer got no batch: the producer's state, the buffer's counts since the last batch,
    and each rollout replica's."""
    batch_size = run.config.pipeline.batch_size_prompts
    dropped = ", ".join(f"{kind} {int(buffer[f'num_dropped_since_batch_{kind}'])}" for kind in DROP_KINDS)
    replicas = "; ".join(f"replica {h['replica']} {h['state']}" + (f" ({h['last_error']})" if h.get("last_error") else "")
                         for h in run.router.health())
    return (f"no batch of {batch_size} group(s) for policy_version {run.policy_version}: no group reached the replay "
            f"buffer for {timeout_s:g} s (pipeline.batch_timeout_s). Producer: {producer.describe()}. Buffer since "
            f"the last batch: {int(buffer['num_put_since_batch'])} group(s) put, {int(buffer['num_queued'])} queued "
            f"(kept), dropped: {dropped}; {int(buffer['num_reserved_open'])} reserved (in flight), "
            f"{int(buffer['num_pending'])} pending, {int(buffer['num_groups_ahead'])} of its capacity of "
            f"{int(buffer['capacity_groups'])} not yet trained. Rollout: {replicas}.")


def run_fully_async(config: Config, model_path: str | None = None,
                    warm: WarmActors | None = None) -> list[dict]:
    """Train `config.pipeline.num_steps` steps; returns the per-step metrics (also in metrics.jsonl)."""
    run = build_run(config, model_path, warm)
    history = []
    producer = Producer(run)
    try:
        logger = begin(run, history)
        producer.on_published(run.policy_version)
        producer.start()
        while run.step < config.pipeline.num_steps:
            start = time.perf_counter()
            sampled = next_batch(run, producer)
            producer.on_buffer_freed()  # the sample evicted what was too stale
            waited = time.perf_counter()
            batch, metrics = prepare_batch(run, sampled)
            metrics |= update(run, batch)
            updated = time.perf_counter()
            if (run.step + 1) % config.pipeline.trigger_parameter_sync_step == 0:
                metrics |= sync_weights(run)
                producer.on_published(run.policy_version)
            # Acked after the publish: the ack frees the batch's room in the buffer, and what the
            # producer starts in it must start under the new weights. Started before the sync, a
            # group's first tokens would carry the old version: one version staler than the rest
            # of the next batch, which with max_staleness 1 gets it evicted and generated again.
            run.buffer.ack(sampled.batch_id)
            producer.on_buffer_freed()
            timings = {"step": time.perf_counter() - start, "gen": waited - start, "update": updated - waited}
            metrics |= producer.time_metrics()
            history.append(end_step(run, logger, sampled, metrics, timings))
        producer.stopping.set()
        finish(run, logger)
    finally:
        producer.stopping.set()
        if producer.is_alive():
            # A finished run lets the producer end its round; a run that stopped on an error does
            # not wait for it (it may be what hangs): the shutdown ends its calls.
            producer.join(timeout=120 if run.finished else 5)
        run.shutdown()
    return history
