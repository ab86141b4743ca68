"""One context per (process group, device), identity-checked: a group re-created where an old one was (same id)
gets a fresh context, never the old one's rates, verdict, plan cache or communicators; ``release`` frees what a
context holds, through every communicator's own ``release``."""

import os

import torch
import torch.distributed as dist

import flashoverlap as fo
from flashoverlap.runtime import context as context_module
from flashoverlap.runtime.context import context_of, existing_context
from flashoverlap.testing import spawn


def _ranks(rank, world_size):
    cpu = torch.device("cpu")
    world = context_of(dist.group.WORLD, cpu)
    assert context_of(dist.group.WORLD, cpu) is world  # found again
    world.rates[torch.bfloat16] = "measured for WORLD"
    world._p2p_reason = "verdict for WORLD"
    sub = dist.new_group([0, 1])
    assert existing_context(sub, cpu) is None
    fresh = context_of(sub, cpu)
    assert fresh is not world and not fresh.rates and fresh.name.endswith("(ranks [0, 1])")
    # A destroyed group's object freed and a new one allocated at the same address: the registry's entry for
    # that id still names the old group, so the new one must not inherit it.
    other = dist.new_group([0, 1])
    # Both ranks connected before either goes on: a rank that raced ahead to its exit closed the group's sockets
    # while the other was still connecting (gloo: "Connection closed by peer", a flaky failure).
    dist.barrier(group=other)
    key = (id(other), cpu.type, cpu.index)
    context_module.REGISTRY.contexts[key] = world  # what an id-keyed cache would hand out
    assert existing_context(other, cpu) is None
    renewed = context_of(other, cpu)
    assert renewed is not world and renewed.process_group is other and not renewed.rates
    assert renewed._p2p_reason is not world._p2p_reason
    fo.release(other)
    assert existing_context(other, cpu) is None
    dist.barrier()
    return True


def test_a_recreated_group_gets_fresh_context():
    assert spawn(_ranks, 2) == [True, True]


class _Holding:
    """A communicator that records its release."""

    released = 0

    def __init__(self, group):
        self.group = group

    def release(self):
        type(self).released += 1


def _release(rank, world_size):
    cpu = torch.device("cpu")
    a, b = torch.randn(8, 4), torch.randn(4, 6)
    fo.gemm_all_reduce(a, b)  # the reference communicator, a resolved call
    ctx = context_of(dist.group.WORLD, cpu)
    assert ctx.calls and ctx.communicators
    ctx.communicators[("gemm", "p2p")] = _Holding(ctx.group)
    ctx.rates[torch.float32] = "rates"
    ctx.agreed[("gpu", 2, 0)] = {"entries": 1}
    ctx._p2p_reason = "verdict"
    fo.release()  # every group
    assert _Holding.released == 1, "release did not reach the communicators"
    assert not ctx.communicators and not ctx.calls and not ctx.rates and not ctx.agreed
    assert ctx._p2p_reason is context_module._UNSET
    assert existing_context(dist.group.WORLD, cpu) is None
    again = fo.gemm_all_reduce(a, b)  # the next call starts afresh
    want = a @ b
    dist.all_reduce(want)
    torch.testing.assert_close(again, want)
    return True


def test_release_frees_every_communicator_and_forgets_the_group():
    assert spawn(_release, 2) == [True, True]


_EXIT_SCRIPT = """
import atexit, gc, sys, weakref
import torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
group = weakref.ref(dist.group.WORLD)
atexit.register(lambda: print("freed" if (gc.collect(), group())[1] is None else "held", flush=True))
import flashoverlap as fo  # its exit handler, registered after the one above, runs before it
fo.gemm_all_reduce(torch.randn(8, 16), torch.randn(16, 4))
dist.destroy_process_group()
"""


def test_a_destroyed_group_is_not_held_into_the_interpreters_teardown(tmp_path):
    # The registry holds each group a call used; held past the exit handlers, a destroyed gloo group was freed in
    # the interpreter's final teardown, where its worker threads ended the process with std::terminate (a
    # flaky failure of the README's example under torchrun).
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT, str(tmp_path / "init")], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "freed", proc.stdout


def _a_cycle_holding_a_group(rank, world_size):
    import gc
    import weakref

    group = dist.new_group([0])
    fo.all_gather_gemm(torch.randn(4, 8), torch.randn(8, 3), group=group)  # a context of ours holds it too

    class Layer:  # a layer in a reference cycle (as modules and autograd graphs often are)
        def __init__(self, group):
            self.group, self.me = group, self

    Layer(group)
    held = weakref.ref(group)
    dist.destroy_process_group(group)
    del group
    gc.disable()  # no collection but the one under test
    try:
        assert held() is not None  # the cycle and our context still hold it
        context_module.REGISTRY.forget()  # the exit handler
        return held() is None
    finally:
        gc.enable()


def test_the_exit_handler_lets_go_of_a_group_held_in_a_reference_cycle():
    """At interpreter exit (``atexit``) the registry drops its contexts and collects cycles, so that a destroyed
    gloo group held by a layer in a reference cycle is freed while the interpreter still runs: freed in its final
    teardown instead, it ended two-rank runs of the examples that train with std::terminate, now and then."""
    assert spawn(_a_cycle_holding_a_group, 1, "gloo") == [True]
