"""Every shipped example runs for 2 steps with tiny-model overrides; the notebook is executed."""

import subprocess
from pathlib import Path

import pytest

from rlactors.config import load_config
from rlactors.pipelines import run_pipeline

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.vllm

# What turns a GPU-sized example into a 2-step CPU run on the tiny model; algorithm settings stay.
# (`gpu_memory_utilization` is only the share of memory vLLM checks is free on CPU: one value for all
# lets the examples whose other engine settings agree share their engines, `warm_actors`.)
TINY = [
    "model.preset=tiny", "model.dtype=auto", "data.train_files=[]", "data.val_files=[]", "data.num_train_rows=64",
    "data.num_val_rows=4", "data.max_prompt_tokens=256", "rollout.num_engines=1", "rollout.tensor_parallel_size=1",
    "rollout.enforce_eager=true", "rollout.max_model_len=320", "rollout.gpu_memory_utilization=0.5", "rollout.sampling.max_response_tokens=8",
    "rollout.sampling.num_samples_per_prompt=2", "rollout.validation_sampling.max_response_tokens=8",
    "rollout.sampling.seed=0", "reward.num_workers=1", "reward.overlong.buffer_tokens=4", "trainer.num_workers=1",
    "trainer.max_tokens_per_micro_batch=4096", "pipeline.num_steps=2", "pipeline.batch_size_prompts=2",
    "pipeline.val_every_steps=0", "pipeline.checkpoint_every_steps=0", "pipeline.resume=never",
]
PER_EXAMPLE = {
    "quickstart_cpu.yaml": [],
    "gsm8k_grpo_qwen3_8b.yaml": ["data.task=gsm8k"],
    "math_dapo_qwen2.5_math_7b_async.yaml": [
        "data.task=math", "buffer.dynamic_sampling_metric=score",
        f"reward.custom_function={HERE.parent / 'parity_reward.py'}:compute_score",
    ],
    "ppo_critic.yaml": [],
    "gsm8k_gspo_qwen3_8b.yaml": ["data.task=gsm8k"],
    "math_cispo_qwen2.5_math_7b.yaml": ["data.task=math"],
    "math_grpo_qwen3_30b_a3b_async.yaml": ["data.task=math"],
    "gsm8k_grpo_qwen3_8b_lora.yaml": ["data.task=gsm8k"],
    # ({model} is the tiny model's folder: the run checks find a model where each example names one.)
    "chat_grpo_qwen3_8b_reward_model.yaml": ["data.task=gsm8k", "reward.models=[{{name: helpfulness, path: {model}}}]"],
    "chat_grpo_qwen3_8b_judge.yaml": ["data.task=gsm8k", "reward.models=[{{name: judge, kind: judge, path: {model}}}]"],
}


# Run for 2 steps in the slow tier: DAPO async with dynamic sampling, PPO with a critic (make test:
# every example's checks below; async runs and a critic's loss in tests/pipelines and tests/trainer).
# In the extended tier (not CI): GRPO colocated with a KL loss on a reference trainer, the main
# example; CI runs a KL loss on a reference trainer in tests/pipelines/test_algorithm_options.py
# (sapo+remax). GSPO's and CISPO's examples differ from it only in their algorithm section (a policy
# loss, its clip range and aggregation, no KL): the names reach their functions
# (tests/trainer/test_policy_objective.py), options train together through the real stack
# (tests/pipelines/test_algorithm_options.py), and each example's own section gives a finite loss with
# a gradient below; a run of each would add nothing but two minutes.
EXTENDED = {"gsm8k_grpo_qwen3_8b.yaml"}
# The MoE example's run settings are DAPO-async's without its sampling options; an MoE model runs
# through both modes in tests/pipelines/test_moe_runs.py, and the example plans in tests/placement.
# The LoRA example's run settings are the main example's with adapters: LoRA runs through both modes
# in tests/pipelines/test_lora_runs.py, and the example plans in tests/placement.
# The reward-model and judge examples' run settings are the main example's with a reward model beside
# the rule: a classifier and a judge score a run in tests/pipelines/test_reward_model_runs.py, and the
# examples plan in tests/placement.
CHECKED_WITHOUT_A_RUN = {"gsm8k_gspo_qwen3_8b.yaml", "math_cispo_qwen2.5_math_7b.yaml",
                         "math_grpo_qwen3_30b_a3b_async.yaml", "gsm8k_grpo_qwen3_8b_lora.yaml",
                         "chat_grpo_qwen3_8b_reward_model.yaml", "chat_grpo_qwen3_8b_judge.yaml"}
# Run end to end on the tiny model by other tests, with tiny overrides of their own: not a third time here.
RUN_ELSEWHERE = {"quickstart_cpu.yaml": "tests/cluster/test_job_submit.py runs it as a submitted job (make test), "
                                        "tests/runtime/test_logs.py through `python -m rlactors run` with its own Ray"}


def test_every_example_config_is_covered():
    assert {p.name for p in EXAMPLES.glob("*.yaml")} == set(PER_EXAMPLE)
    assert set(RUN_ELSEWHERE) <= set(PER_EXAMPLE)
    assert not set(RUN_ELSEWHERE) & CHECKED_WITHOUT_A_RUN


@pytest.mark.parametrize("name", sorted(PER_EXAMPLE))
def test_every_example_loads_passes_the_run_checks_and_its_algorithm_trains(tmp_path, tiny_model_dir, name):
    """Without Ray: the example with the tiny overrides passes the run's own checks, and its
    algorithm section, as the trainer applies it, gives a finite policy loss with a gradient."""
    import torch

    from rlactors.pipelines import preflight
    from rlactors.trainer.policy_objective import policy_loss

    config = load_config(EXAMPLES / name, TINY + [o.format(model=tiny_model_dir) for o in PER_EXAMPLE[name]] + [
        f"model.path={tiny_model_dir}", f"pipeline.output_dir={tmp_path}"])
    preflight.check_config(config, tmp_path)
    preflight.check_model(config, tiny_model_dir)
    generator = torch.Generator().manual_seed(0)
    old = -torch.rand(4, 6, generator=generator, dtype=torch.float64) - 0.5
    logp = (old + 0.05 * torch.randn(4, 6, generator=generator, dtype=torch.float64)).requires_grad_(True)
    advantages = torch.randn(4, 6, generator=generator, dtype=torch.float64)
    mask = torch.ones(4, 6, dtype=torch.float64)
    mask[1, 3:] = 0
    counts = dict(global_num_tokens=int(mask.sum()), global_num_sequences=4, norm_tokens=6)
    loss, sums = policy_loss(config.algorithm, logp, old, old, advantages, mask, None, counts)
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(value).all() for value in sums.values())
    assert logp.grad.abs().sum() > 0 and not logp.grad[mask == 0].any()  # padding never learns


@pytest.mark.parametrize("name", [pytest.param(name, marks=[pytest.mark.extended if name in EXTENDED else pytest.mark.slow])
                                  for name in sorted(set(PER_EXAMPLE) - set(RUN_ELSEWHERE) - CHECKED_WITHOUT_A_RUN)])
def test_example_runs_two_steps(warm_actors, tmp_path, tiny_model_dir, name):
    config = load_config(EXAMPLES / name, TINY + [o.format(model=tiny_model_dir) for o in PER_EXAMPLE[name]] + [
        f"model.path={tiny_model_dir}", f"pipeline.output_dir={tmp_path}"])
    history = run_pipeline(config, warm=warm_actors)
    assert [h["step"] for h in history] == [0, 1, 2]
    assert all(name in history[-1] for name in ("reward/mean", "actor/pg_loss", "timing_s/step"))
    if config.algorithm.advantage == "gae":
        assert "critic/vf_loss" in history[-1]
    assert history[-1]["staleness/max"] <= config.buffer.max_staleness
    assert (tmp_path / "hf" / "step_2" / "model.safetensors.index.json").is_file()  # the final model, always


def test_submit_script_is_valid_bash():
    subprocess.run(["bash", "-n", str(EXAMPLES / "submit_ray_job.sh")], check=True)


NOTEBOOK_CHECKS = """
import json, math
Path(os.environ["RLACTORS_NOTEBOOK_OUTPUT"], "checks.json").write_text(json.dumps({
    "samples": samples, "num_trained_once": num_trained_once, "final": final,
    "history": [{k: v for k, v in m.items() if k in PLOTTED} for m in history],
    "other_history": [{k: v for k, v in m.items() if k in PLOTTED} for m in other_history],
    "lines": [[list(map(float, line.get_ydata())) for line in axis.lines] for axis in axes],
    "versions": [run.policy_version, other.policy_version], "plotted": PLOTTED,
}))
"""


@pytest.mark.extended  # a kernel of its own; the calls it makes are those of tests/pipelines' runs (warm_actors)
def test_notebook_executes_and_shows_real_values(ray_session, tmp_path, monkeypatch):
    import json
    import math

    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("RAY_ADDRESS", ray_session.get_runtime_context().gcs_address)  # the kernel joins this Ray
    monkeypatch.setenv("RLACTORS_NOTEBOOK_OUTPUT", str(tmp_path))
    monkeypatch.setenv("RLACTORS_NOTEBOOK_STEPS", "2")
    notebook = nbformat.read(EXAMPLES / "notebook.ipynb", as_version=4)
    notebook.cells.append(nbformat.v4.new_code_cell(NOTEBOOK_CHECKS))
    NotebookClient(notebook, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    checks = json.loads((tmp_path / "checks.json").read_text())  # a file: Ray's log lines land in cell outputs

    # The group looked at: every response token with its logprob and the policy version that made it.
    assert len(checks["samples"]) == 4
    for sample in checks["samples"]:
        assert len(sample["tokens"]) == len(sample["logprobs"]) == len(sample["versions"]) > 0
        assert all(logprob <= 0 for logprob in sample["logprobs"]) and set(sample["versions"]) == {0}
        assert 0.0 <= sample["reward"] <= 1.0
    # Two steps of each run, real numbers, and the plots hold them: one line per run on each axis.
    for history in (checks["history"], checks["other_history"]):
        assert len(history) == 2
        assert all(isinstance(m["reward/mean"], float) and 0.0 <= m["reward/mean"] <= 1.0 for m in history)
        assert all(math.isfinite(m[name]) for m in history for name in checks["plotted"])
    assert "reward/mean" in checks["plotted"]
    for axis, name in zip(checks["lines"], checks["plotted"], strict=True):
        assert axis == [[m[name] for m in checks["history"]], [m[name] for m in checks["other_history"]]]
    assert checks["versions"] == [2, 2]  # each step's weights reached the engines
    assert [key for key in checks["final"] if key.endswith("/acc")] and checks["num_trained_once"] == 8
    assert any((tmp_path / "lr_1e-3" / "logs").glob("vllm-*.log"))  # the engines' full log, off the notebook
