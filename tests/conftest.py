"""Shared fixtures. Add yours here; keep each one cheap or session-scoped (the suite runs on 2 cores)."""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from collections import defaultdict
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# Marks every process this test session starts (Ray's, vLLM's, reward workers, drivers), so that
# checks for leftover processes count this session's only, whatever else runs on the machine.
TEST_SESSION_ENV = "RLACTORS_TEST_SESSION"
os.environ[TEST_SESSION_ENV] = uuid.uuid4().hex


# Test files run longest first (seconds per test: tests/durations.json, `make test-durations`;
# unrecorded tests count DEFAULT_S). Each xdist worker takes the next file when it is done, so
# the long runs start early on both and the short files even out the end, instead of one worker
# finishing the longest file alone. The Makefile keeps this order (--no-loadscope-reorder).
DURATIONS = Path(__file__).with_name("durations.json")
DEFAULT_S = 0.02  # what a test under a second takes on average


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected: the files' selected tests count
def pytest_collection_modifyitems(items):
    seconds = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
    file_s, first_index = defaultdict(float), {}
    for index, item in enumerate(items):
        path = item.nodeid.split("::", 1)[0]
        file_s[path] += seconds.get(item.nodeid, DEFAULT_S)
        first_index.setdefault(path, index)
    items.sort(key=lambda item: (-file_s[item.nodeid.split("::", 1)[0]], first_index[item.nodeid.split("::", 1)[0]]))


# Files whose tests use the session's `shared_engine` (a vLLM start, ~40 s): one xdist work unit, so
# one worker runs them back to back (in the order above) and the engine starts once for all of them;
# a worker that took them one by one between other files would start it again for each.
SHARED_ENGINE_FILES = ("tests/reward/test_judge.py", "tests/rollout/test_engine.py", "tests/rollout/test_episode.py")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """With `--dist loadfile` (the Makefile's): xdist's file scheduling, the SHARED_ENGINE_FILES as one unit."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class FilesSharingAnEngine(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return "shared_engine" if path in SHARED_ENGINE_FILES else path

    return FilesSharingAnEngine(config, log)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A `tiny` Qwen2 model folder built once per test session (seed 0)."""
    from rlactors.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny", preset="tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_moe_model_dir(tmp_path_factory):
    """A `tiny` Qwen3-MoE model folder (8 experts, 2 routed per token) built once per test session."""
    from rlactors.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny_moe", preset="tiny", seed=0,
                            architecture="qwen3_moe")


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """The transformers model holding the same weights as the module's engine, and its tokenizer
    (tests that send weights to the engine mutate both together, so each module gets its own)."""
    from rlactors.models import load_model, load_tokenizer

    return load_model(tiny_model_dir).eval(), load_tokenizer(tiny_model_dir)


# What every Ray the suite starts gets (the suite's, and a test's own through `another_ray`).
RAY_INIT_DEFAULTS = {"log_to_driver": False, "runtime_env": {"env_vars": {"TOKENIZERS_PARALLELISM": "false"}}}


def start_local_ray(**init_kwargs):
    """The suite's local Ray: 4 CPUs declared (what the pipelines' plans need), no dashboard;
    `init_kwargs` add to or replace those settings (`another_ray`)."""
    import ray

    if not ray.is_initialized():
        # address="local": a new instance even while another Ray runs on this machine (a `ray start`
        # head, e.g. the job-submission test's), which a bare ray.init() would join.
        ray.init(**{"address": "local", "num_cpus": 4, "include_dashboard": False, **RAY_INIT_DEFAULTS, **init_kwargs})
    return ray


@contextlib.contextmanager
def another_ray(nodes: list[dict] | None = None, env: dict[str, str] | None = None, **init_kwargs):
    """The body runs on a Ray of its own instead of the suite's: a simulated cluster (Ray's
    `Cluster`, yielded) whose head takes the first of `nodes` and a node each the rest, else a local
    one; `init_kwargs` go to `ray.init`, `env` is set while it runs. Afterwards, however the body
    ends, that Ray is gone and the suite's local Ray runs again (later tests of the worker need it)."""
    import ray
    from ray.cluster_utils import Cluster

    ray.shutdown()
    saved = {name: os.environ.get(name) for name in env or {}}
    os.environ.update(env or {})
    cluster = None
    try:
        if nodes:
            cluster = Cluster(initialize_head=True, head_node_args=nodes[0])
            for node in nodes[1:]:
                cluster.add_node(**node)
            ray.init(**{"address": cluster.address, **RAY_INIT_DEFAULTS, **init_kwargs})
            cluster.wait_for_nodes()
        else:
            start_local_ray(**init_kwargs)
        yield cluster
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        for name, value in saved.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value
        start_local_ray()


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray instance shared by the whole session (tests that need another cluster, e.g. a
    simulated multi-node one, shut it down and call `start_local_ray()` again when done)."""
    yield start_local_ray()


# Session fixtures that hold what other tests need (CPUs of the suite's 4-CPU Ray, a vLLM each):
# fixture name -> release. Each test releases those it does not ask for; their values start what
# they hold again when a later test asks (a release of nothing held does nothing).
_releasable: dict = {}


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    # A hook, not an autouse fixture: it runs before any of the test's fixtures are set up, so a
    # module fixture that starts actors (test_router's two engines) never waits on CPUs that a
    # session fixture of the previous file still holds. `fixturenames` is the whole closure.
    for name, release in _releasable.items():
        if name not in item.fixturenames:
            release()


@pytest.fixture(scope="session")
def warm_actors(ray_session):
    """Rollout engines and trainer groups kept from one pipeline run to the next
    (`rlactors.pipelines.warm`): pass it as `run_pipeline(config, warm=warm_actors)`, and a run whose
    engine settings and plan match the last run's takes its engines instead of starting vLLM
    (~25 s), and its trainer groups whose ranks would start alike (~5 s each). Every run still
    gets its own buffer and reward scorers, loads its model into the trainers, and sends its
    weights to the engines before they generate."""
    from rlactors.pipelines.warm import WarmActors

    warm = WarmActors()
    _releasable["warm_actors"] = warm.close
    yield warm
    warm.close()


class EngineOnDemand:
    """One RolloutEngine, started at the first `get()` after a `close()` or after the suite's Ray
    restarted (tests that need a cluster of their own restart it, and its actors end with it)."""

    def __init__(self, model_dir, config):
        self.model_dir, self.config = model_dir, config
        self.handle = self.cluster = None

    def get(self):
        import ray

        from rlactors.pipelines.warm import cluster_address
        from rlactors.rollout.engine import create_engine

        if self.handle is None or self.cluster != cluster_address():
            self.close()
            self.handle, self.cluster = create_engine(str(self.model_dir), self.config), cluster_address()
            ray.get(self.handle.ready.remote(), timeout=600)
        return self.handle

    def close(self) -> None:
        import ray

        from rlactors.pipelines.warm import cluster_address

        handle, self.handle = self.handle, None
        if handle is not None and self.cluster == cluster_address():
            ray.kill(handle)


@pytest.fixture(scope="session")
def shared_engine(ray_session, tiny_model_dir):
    """The rollout tests' engine (tests/rollout: engine, episodes), for those that do not fault it:
    partial rollouts resumed, 256 tokens of context, episodes of up to 3 turns of 8 tokens whose
    environment steps may take 2 s (a request names its environment). vLLM starts once for them."""
    from rlactors.config import EnvironmentConfig, RolloutConfig

    environment = EnvironmentConfig(max_turns=3, max_turn_tokens=8, step_timeout_s=2.0)
    engine = EngineOnDemand(tiny_model_dir, RolloutConfig(partial_rollout=True, on_abort="resume", max_model_len=256,
                                                          environment=environment))
    _releasable["shared_engine"] = engine.close
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def engine(shared_engine, reference):
    """The shared engine, holding the module's `reference` weights: sent as its next policy version
    through the trainer's weight sync, since an earlier module left its own there. The module's
    tests move the two together."""
    import ray

    handle = shared_engine.get()
    version = ray.get(handle.health.remote(), timeout=60)["policy_version"] + 1
    send_weights(handle, reference[0], version)
    return handle


class RunsCode:
    """Unpickling this calls `open(marker, "w")`: what a crafted checkpoint file could do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def reference_greedy(model, prompt_ids, num_tokens):
    """Argmax decoding with transformers, EOS included like vLLM's ignore_eos (no EOS masking)."""
    import torch

    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(num_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt_ids):]


def reference_logprobs(model, prompt_ids, response_ids, temperature):
    """log_softmax(logits / temperature) of each response token under the transformers forward."""
    import torch

    ids = torch.tensor([prompt_ids + response_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].double()
    logprobs = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    return logprobs.gather(-1, torch.tensor(response_ids)[:, None])[:, 0]


def send_weights(engine, model, policy_version, transport="shm", verify=True):
    """Send the transformers model's weights to the engine (a RolloutEngine, or a router) over
    `transport`, in buckets of half the model, through vLLM's weight-transfer API; returns the
    sync's figures and the bytes sent."""
    from rlactors.models.moe import checkpoint_layout
    from rlactors.weight_sync.choice import WeightSyncSettings
    from rlactors.weight_sync.sender import WeightSender

    # What a trainer sends: a tied lm_head is the embedding and is not sent on its own.
    tied = model.config.tie_word_embeddings
    state = [(n, t) for n, t in model.state_dict().items() if not (tied and n == "lm_head.weight")]
    total_bytes = sum(t.numel() * t.element_size() for _, t in state)
    bucket_bytes = total_bytes // 2 + 1
    if hasattr(engine, "engines"):
        return engine.update_weights(state, policy_version, transport, bucket_bytes, verify=verify), total_bytes
    settings = WeightSyncSettings(transport, bucket_bytes, None, call_timeout_s=300.0, verify=verify)
    stats = WeightSender(rank=0).send(lambda: iter(state), {0: (engine, 0)}, policy_version, settings,
                                      split=checkpoint_layout(model))
    assert stats["num_buckets"] >= 2 and not stats["failed"]
    return stats, total_bytes


def actor_gone(actor, timeout_s: float = 30.0) -> bool:
    """Whether the actor is gone within `timeout_s`: `ray.kill` is asynchronous, and an idle actor
    may still answer a call sent just after it."""
    import time

    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=timeout_s)
        except ray.exceptions.RayActorError:
            return True
        time.sleep(0.1)
    return False
