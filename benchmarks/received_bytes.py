"""Counting the bytes the driver process receives from Ray: the measure behind
`benchmarks/driver_bytes.py` and the test that rollout data never passes through the driver
(tests/pipelines/test_pipelines.py).

    with DriverBytes() as received:
        ...                                  # a run, in this process
        step = received.flush()              # {"bytes": ..., "inline_bytes": ..., "read_bytes": ...}
    received.rollout_types_read              # Counter of Group/Sample/TrainBatch/Tensor values ray.get gave
    received.bytes_by_source                 # Counter: inline bytes by call, read bytes by value type

Bytes reach a Ray process two ways, and both are counted:
- inline: a call's result under `max_direct_call_object_size` comes inside the reply to the call
  and stays in the caller's memory store, read or not. Every object ref this process's remote calls
  and streams make is kept until `flush()`, which adds the size of those that came inline;
- read: `ray.get` of an object in the object store copies it into the process; its size is looked up
  when it is read (an inline one is not counted twice).
Not counted: what the driver sends, and objects that only reach the driver's node's object store.
Patches `ray.get`, actor method and remote function calls and `ObjectRefGenerator.__next__` while
active; a measurement tool, not for production runs.
"""

from __future__ import annotations

import dataclasses
import pickle
import threading
from collections import Counter

import ray
import ray.actor
import ray.remote_function

ROLLOUT_TYPES = ("Group", "Sample", "TrainBatch", "Tensor")  # rollout data by value; none should reach the driver


def object_size(ref: ray.ObjectRef) -> int | None:
    """Serialized size of an object, asked of its owner (nothing is fetched)."""
    location = ray.experimental.get_object_locations([ref]).get(ref)
    return location["object_size"] if location else None


def rollout_types_in(value, depth: int = 4) -> Counter:
    """Names of rollout-data types in `value`, looking into lists, tuples, dicts and dataclasses."""
    found: Counter = Counter()
    name = type(value).__name__
    if name in ROLLOUT_TYPES:
        found[name] += 1
        return found
    if depth == 0:
        return found
    if isinstance(value, list | tuple | set):
        items = value
    elif isinstance(value, dict):
        items = list(value.values())
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = list(vars(value).values())
    else:
        return found
    for item in items:
        found += rollout_types_in(item, depth - 1)
    return found


class DriverBytes:
    def __init__(self):
        self._lock = threading.Lock()
        self._made: list[tuple[ray.ObjectRef, str]] = []  # (ref, call) kept alive until flush, for their sizes
        self._reads: list[tuple[bytes, int, str]] = []  # (object id, size, value type) since the last flush
        self._inline_ids: set[bytes] = set()
        self.rollout_types_read: Counter = Counter()
        self.largest_read: tuple[int, str] = (0, "")  # (bytes, type name)
        self.total: Counter = Counter()
        self.bytes_by_source: Counter = Counter()
        self._originals: dict = {}

    # ---------------------------------------------------------------- recording

    def _made_refs(self, result, call: str) -> None:
        refs = [result] if isinstance(result, ray.ObjectRef) else (
            [r for r in result if isinstance(r, ray.ObjectRef)] if isinstance(result, list) else [])
        with self._lock:
            self._made += [(ref, call) for ref in refs]

    def _read(self, refs, values) -> None:
        single = isinstance(refs, ray.ObjectRef)
        refs, values = ([refs], [values]) if single else (list(refs), list(values))
        locations = ray.experimental.get_local_object_locations(refs)
        for ref, value in zip(refs, values, strict=True):
            size = (locations.get(ref) or {}).get("object_size")
            if size is None:  # no local record of it: measure the value itself
                size = len(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
            with self._lock:
                self._reads.append((ref.binary(), size, type(value).__name__))
                self.rollout_types_read += rollout_types_in(value)
                self.largest_read = max(self.largest_read, (size, type(value).__name__))

    def __enter__(self) -> DriverBytes:
        get = ray.get
        actor_remote = ray.actor.ActorMethod._remote
        function_remote = ray.remote_function.RemoteFunction._remote
        generator_next = ray.ObjectRefGenerator.__next__
        self._originals = {"get": get, "actor": actor_remote, "function": function_remote, "next": generator_next}

        def counted_get(refs, *args, **kwargs):
            values = get(refs, *args, **kwargs)
            self._read(refs, values)
            return values

        def counted_actor_remote(method, *args, **kwargs):
            result = actor_remote(method, *args, **kwargs)
            self._made_refs(result, f"inline {method._method_name}")
            return result

        def counted_function_remote(function, *args, **kwargs):
            result = function_remote(function, *args, **kwargs)
            self._made_refs(result, f"inline {function._function_name}")
            return result

        def counted_next(generator):
            ref = generator_next(generator)
            self._made_refs(ref, "inline streamed item")
            return ref

        ray.get = counted_get
        ray.actor.ActorMethod._remote = counted_actor_remote
        ray.remote_function.RemoteFunction._remote = counted_function_remote
        ray.ObjectRefGenerator.__next__ = counted_next
        return self

    def __exit__(self, *exc) -> None:
        ray.get = self._originals["get"]
        ray.actor.ActorMethod._remote = self._originals["actor"]
        ray.remote_function.RemoteFunction._remote = self._originals["function"]
        ray.ObjectRefGenerator.__next__ = self._originals["next"]
        if ray.is_initialized():
            self.flush()

    # ---------------------------------------------------------------- totals

    def flush(self) -> dict[str, int]:
        """Bytes received since the last flush: `inline_bytes` (results that came inside replies),
        `read_bytes` (objects `ray.get` copied in) and their sum `bytes`. Results not finished yet
        are kept for the next flush."""
        with self._lock:
            made, self._made = self._made, []
            reads, self._reads = self._reads, []
        counts: Counter = Counter()
        locations = ray.experimental.get_local_object_locations([ref for ref, _ in made]) if made else {}
        unfinished = []
        for ref, call in made:
            location = locations.get(ref)
            if location is None or location.get("object_size") is None:
                unfinished.append((ref, call))
            elif not location["node_ids"] and ref.binary() not in self._inline_ids:
                # In no node's object store, so in this process's memory store: it came inline.
                self._inline_ids.add(ref.binary())
                counts["inline_bytes"] += location["object_size"]
                counts["num_inline"] += 1
                self.bytes_by_source[call] += location["object_size"]
        for object_id, size, type_name in reads:
            if object_id not in self._inline_ids:
                counts["read_bytes"] += size
                counts["num_read"] += 1
                self.bytes_by_source[f"read {type_name}"] += size
        with self._lock:
            self._made = unfinished + self._made
        counts["bytes"] = counts["inline_bytes"] + counts["read_bytes"]
        self.total += counts
        return {name: counts[name] for name in ("bytes", "inline_bytes", "read_bytes", "num_inline", "num_read")}
