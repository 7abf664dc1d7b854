"""The pure parts of an adapter-only sync (`rlactors.weight_sync.adapters`): where the folders go,
the verification of what each engine loaded, and the clean-up of older versions."""

from pathlib import Path

from rlactors.weight_sync.adapters import adapter_dir, check_digests, remove_older_versions
from rlactors.weight_sync.client import EngineSyncClient


def test_one_node_writes_under_dev_shm_and_several_into_the_run_folder(tmp_path):
    one = adapter_dir(tmp_path, {0})
    assert one.startswith("/dev/shm/rlactors-adapters-") and one != adapter_dir(tmp_path / "other", {0})
    assert adapter_dir(tmp_path, {0, 1}) == str(tmp_path / "adapters")


def test_an_engine_that_loaded_another_file_fails_the_sync_naming_why():
    client = EngineSyncClient({0: None, 1: None, 2: None}, "adapter", 1.0)
    client.failed[2], client.live = "load_adapter: no answer", [0, 1]
    check_digests(client, {0: {"adapter_sha256": "a"}, 1: {"adapter_sha256": "b"}}, sent="a")
    assert client.live == [0]
    assert client.failed == {1: "verify: the adapter file the engine loaded differs from the one written",
                             2: "load_adapter: no answer"}


def test_older_versions_go_and_the_current_one_and_other_files_stay(tmp_path):
    for name in ("policy_version_1", "policy_version_2", "policy_version_3", "notes"):
        (tmp_path / name).mkdir()
    remove_older_versions(tmp_path, 3)
    assert sorted(p.name for p in Path(tmp_path).iterdir()) == ["notes", "policy_version_3"]
