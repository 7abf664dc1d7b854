"""Building a run (pure parts): the trainer settings the run's ranks get."""

from rlactors.config import load_config
from rlactors.pipelines import build


def test_trainer_settings_give_a_one_rank_colocated_cpu_trainer_every_core():
    def settings(device_kind, *overrides):
        return build.trainer_settings(load_config(None, ["pipeline.mode=colocated", *overrides]), device_kind)

    assert settings("cpu").cpu_cores == "all"
    assert settings("gpu").cpu_cores is None
    assert settings("cpu", "pipeline.mode=async").cpu_cores is None
    assert settings("cpu", "trainer.num_workers=2").cpu_cores is None  # ranks would contend for the same cores
    assert settings("cpu", "trainer.cpu_cores=[1]").cpu_cores == [1]  # what the user pinned stays
