"""What the environment says about a call (``settings.py``), read once per call: the debug deadline and
the replay verdict."""

import pytest

from flashoverlap import settings


def test_debug_timeout_parsing():
    assert settings.read({}).timeout is None
    assert settings.read({"FLASHOVERLAP_DEBUG_TIMEOUT": "2.5"}).timeout == 2.5
    assert settings.read({"FLASHOVERLAP_DEBUG_TIMEOUT": "0"}).timeout is None
    with pytest.raises(ValueError, match="FLASHOVERLAP_DEBUG_TIMEOUT must be a number of seconds"):
        settings.read({"FLASHOVERLAP_DEBUG_TIMEOUT": "soon"})


@pytest.mark.parametrize("env,allowed", [({}, True), ({"FLASHOVERLAP_REPLAY": "0"}, False),
                                         ({"CUDA_DEVICE_MAX_CONNECTIONS": "1"}, False),
                                         ({"CUDA_DEVICE_MAX_CONNECTIONS": "8"}, True),
                                         ({"FLASHOVERLAP_DEBUG_TIMEOUT": "3"}, False)])
def test_replay_is_off_where_it_must_be(env, allowed):
    assert settings.read(env).replay is allowed


def test_one_hardware_queue():
    assert settings.read({"CUDA_DEVICE_MAX_CONNECTIONS": "1"}).single_queue
    assert not settings.read({"CUDA_DEVICE_MAX_CONNECTIONS": "8"}).single_queue
    assert not settings.read({}).single_queue


def test_nccl_p2p_disabled():
    assert settings.read({"NCCL_P2P_DISABLE": "1"}).nccl_p2p_disabled
    assert not settings.read({"NCCL_P2P_DISABLE": "0"}).nccl_p2p_disabled


def test_the_agreement_check_follows_torch_distributed_debug_detail_too():
    assert settings.read({}).agreement is None
    assert settings.read({"TORCH_DISTRIBUTED_DEBUG": "INFO"}).agreement is None
    assert settings.read({"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}).agreement == settings.AGREEMENT_TIMEOUT
    assert settings.read({"TORCH_DISTRIBUTED_DEBUG": "DETAIL", "FLASHOVERLAP_DEBUG_TIMEOUT": "7"}).agreement == 7
    assert settings.read({"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}).timeout is None  # waits stay unbounded, replay on
    assert settings.read({"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}).replay


def test_the_plan_cache_directory(tmp_path):
    from pathlib import Path

    assert settings.read({}).cache_dir == Path.home() / ".cache" / "flashoverlap"
    assert settings.read({"FLASHOVERLAP_CACHE_DIR": str(tmp_path)}).cache_dir == tmp_path
    assert settings.read({"FLASHOVERLAP_CACHE_DIR": str(tmp_path), "FLASHOVERLAP_NO_CACHE": "1"}).cache_dir is None


@pytest.mark.parametrize("name", ["FLASHOVERLAP_REPLAY", "FLASHOVERLAP_NO_CACHE"])
@pytest.mark.parametrize("value", ["true", "yes", "false", "off", " 1", "2"])
def test_a_switch_takes_0_or_1_and_names_itself_otherwise(name, value):
    # "true" left the cache on and "false" left replay on, the opposite of what was meant, without a word.
    with pytest.raises(ValueError, match=f"{name} must be 0 or 1, got {value!r}"):
        settings.read({name: value})


def test_switches_read_0_1_and_unset():
    assert settings.read({"FLASHOVERLAP_REPLAY": "1"}).replay
    assert settings.read({"FLASHOVERLAP_REPLAY": ""}).replay
    assert settings.read({"FLASHOVERLAP_NO_CACHE": "0"}).cache_dir is not None
    assert settings.read({"FLASHOVERLAP_NO_CACHE": ""}).cache_dir is not None


@pytest.mark.parametrize("value", ["nan", "NaN", "-nan"])
def test_a_nan_debug_timeout_is_refused_not_read_as_off(value):
    with pytest.raises(ValueError, match="FLASHOVERLAP_DEBUG_TIMEOUT must be a number of seconds"):
        settings.read({"FLASHOVERLAP_DEBUG_TIMEOUT": value})


def test_the_cache_directory_expands_a_home_tilde():
    # "~/x" (quoted, so no shell expanded it) was a directory named "~" under the working directory.
    from pathlib import Path

    assert settings.read({"FLASHOVERLAP_CACHE_DIR": "~/plans"}).cache_dir == Path.home() / "plans"
