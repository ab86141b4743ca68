"""One state per (process group, device), identity-checked: a group re-created where an old one was (same id)
gets a fresh state, never the old one's rates, verdict, plan cache or communicators."""

import torch
import torch.distributed as dist

from flashoverlap.comm import state as state_module
from flashoverlap.comm.state import existing_state, state_of
from flashoverlap.testing import spawn


def _ranks(rank, world_size):
    cpu = torch.device("cpu")
    world = state_of(dist.group.WORLD, cpu)
    assert state_of(dist.group.WORLD, cpu) is world  # found again
    world.rates[torch.bfloat16] = "measured for WORLD"
    world._p2p_reason = "verdict for WORLD"
    sub = dist.new_group([0, 1])
    assert existing_state(sub, cpu) is None
    fresh = state_of(sub, cpu)
    assert fresh is not world and not fresh.rates and fresh.name.endswith("(ranks [0, 1])")
    # A destroyed group's object freed and a new one allocated at the same address: the registry's entry for
    # that id still names the old group, so the new one must not inherit it.
    other = dist.new_group([0, 1])
    key = (id(other), cpu.type, cpu.index)
    state_module._STATES[key] = world  # what an id-keyed cache would hand out
    assert existing_state(other, cpu) is None
    renewed = state_of(other, cpu)
    assert renewed is not world and renewed.group is other and not renewed.rates
    assert renewed._p2p_reason is not world._p2p_reason
    state_module.forget(other)
    assert existing_state(other, cpu) is None
    return True


def test_a_recreated_group_gets_fresh_state():
    assert spawn(_ranks, 2) == [True, True]
