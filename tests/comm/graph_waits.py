"""What both P2P executors' graph-wait tests share (``tests/comm/test_p2p_executor.py``,
``test_expert_p2p_executor.py``): the wait kernel recorded where a capture launches it, the trace a captured call
must leave when each flag wait (a wait and a reset, as stream memory operations) is that kernel instead, and the
kernel's load on a plan's first call (deadlock rule 3)."""

import contextlib

import torch


def record_wait_kernels(monkeypatch, recorder, flags: torch.Tensor) -> None:
    """``kernels.counters.wait_reset`` appends ``(stream, "wait kernel", index, value)`` to ``recorder.trace``, the
    stream being the one ``torch.cuda.stream`` made current (the kernel is launched on the current stream); it must
    be given ``flags``, this rank's own."""
    from flashoverlap.kernels import counters

    current = [0]

    @contextlib.contextmanager
    def on(stream):
        before, current[0] = current[0], stream.cuda_stream
        yield
        current[0] = before

    def wait_kernel(given, index, value):
        assert given is flags
        recorder.trace.append((current[0], "wait kernel", index, value))

    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(counters, "wait_reset", wait_kernel)


def as_kernel_waits(trace: list, flags_at: int, slots: int) -> list:
    """``trace`` with each (wait for 1, reset to 0) pair of stream memory operations on a flag of this rank's (from
    address ``flags_at``, ``slots`` int32 flags) replaced by one wait kernel launch on the same stream for its slot."""
    out, i = [], 0
    while i < len(trace):
        step = trace[i]
        if step[1:2] == ("wait",):
            assert trace[i + 1] == (step[0], "write", step[2], 0)
            slot, rest = divmod(step[2] - flags_at, 4)  # a wait reads this rank's flags
            assert rest == 0 and 0 <= slot < slots
            out.append((step[0], "wait kernel", slot, 1))
            i += 2
        else:
            out.append(step)
            i += 1
    return out


def first_load(monkeypatch, load_kernels) -> tuple:
    """Run ``load_kernels()`` (a plan's first-call kernel loading) until it loads the wait kernel, first: returns
    the arguments ``kernels.counters.load`` was given, and fails if anything else ran into a GPU before it."""
    from flashoverlap.kernels import counters

    class Loaded(Exception):
        pass

    def load(device):
        raise Loaded(device)

    monkeypatch.setattr(counters, "load", load)
    try:
        load_kernels()
    except Loaded as loaded:
        return loaded.args
    raise AssertionError("the plan's first call never loaded the wait kernel")
