"""What the environment says about a call (``runtime/settings.py``), read once per call: the debug deadline and
the replay verdict."""

import pytest

from flashoverlap.runtime import settings


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


def test_nccl_p2p_disabled():
    assert settings.read({"NCCL_P2P_DISABLE": "1"}).nccl_p2p_disabled
    assert not settings.read({"NCCL_P2P_DISABLE": "0"}).nccl_p2p_disabled
