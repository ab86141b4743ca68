import contextlib
import os
import tempfile
from pathlib import Path

import pytest
import torch

try:
    import fcntl
except ImportError:  # not on Windows: GPU tests there are not serialised
    fcntl = None

# What the environment said before any test module was imported (see tests/test_environment.py).
INITIAL_TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET")


def pytest_configure(config):
    """The multi-process tests' ranks fork from one server that has imported torch (``testing.rank_context``): start
    it now, with the environment the session began with. Started by a test that had changed a variable read at
    import, it would send every later call to fresh interpreters (correct, but slow). Under pytest-xdist (the README's
    ``-n 2``) each worker starts its own, and the controller, which runs no test, none."""
    if config.pluginmanager.hasplugin("xdist") and config.getoption("numprocesses", None) \
            and not hasattr(config, "workerinput"):
        return
    from flashoverlap.testing import rank_context

    rank_context()


# The tests that use GPUs (``tests/gpu``, and those marked ``gpu`` elsewhere) take this lock in turn: under the
# README's two pytest-xdist workers (or beside another pytest session) two of them never share the GPUs, and the
# ones that time their calls time them alone. A lock, not an xdist group: ``--dist loadgroup`` groups nothing with
# pytest 9.2 and pytest-xdist 3.8 (pytest-xdist issue 1386), and a group lets only one worker hold the tests.
# One file per user: another user's would refuse this one's open.
GPU_LOCK = Path(tempfile.gettempdir()) / f"flashoverlap-gpu-tests-{getattr(os, 'getuid', lambda: 0)()}.lock"


def uses_gpu(item) -> bool:
    return "/tests/gpu/" in item.path.as_posix() or item.get_closest_marker("gpu") is not None


@contextlib.contextmanager
def one_gpu_test_at_a_time(path: Path = GPU_LOCK):
    """An exclusive ``flock`` on ``path`` while the block runs (released by the kernel if the process dies)."""
    if fcntl is None:
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@pytest.fixture(autouse=True)
def _gpu_tests_one_at_a_time(request):
    """A GPU test's body and its function-scoped fixtures run holding ``GPU_LOCK`` (an autouse fixture is set up
    first). A test skipped by its marks (no GPU) never takes it."""
    if not uses_gpu(request.node):
        yield
        return
    with one_gpu_test_at_a_time():
        yield


def pytest_terminal_summary(terminalreporter):
    from flashoverlap.testing import fresh_because

    if fresh_because():
        terminalreporter.write_line(f"testing.spawn started fresh interpreters (not the forkserver's forks) because "
                                    f"these variables had changed: {', '.join(fresh_because())}")


def _globals() -> dict:
    """The process-wide torch entry points and switches that CPU tests stand in for (fake CUDA streams, a recording
    allocator) or flip: each must be the same after every test as before it."""
    matmul = torch.backends.cuda.matmul
    return {
        "torch.empty": torch.empty,
        "torch.zeros": torch.zeros,
        "torch.cuda.current_stream": torch.cuda.current_stream,
        "torch.cuda.is_current_stream_capturing": torch.cuda.is_current_stream_capturing,
        "torch.cuda.is_available": torch.cuda.is_available,
        "torch.cuda.Stream": torch.cuda.Stream,
        "torch.cuda.Event": torch.cuda.Event,
        "torch.Tensor.record_stream": torch.Tensor.record_stream,
        "torch.mm": torch.mm,
        "allow_bf16_reduced_precision_reduction": matmul.allow_bf16_reduced_precision_reduction,
        "allow_fp16_reduced_precision_reduction": matmul.allow_fp16_reduced_precision_reduction,
    }


@pytest.fixture(autouse=True)
def _no_leaked_stand_ins():
    """Fail the test that leaves a stand-in or a flipped switch behind, instead of the unrelated tests after it."""
    before = _globals()
    yield
    changed = [name for name, value in _globals().items() if value is not before[name]
               and value != before[name]]
    assert not changed, f"this test left {changed} changed for the tests after it"


@pytest.fixture(autouse=True)
def _settings_read_afresh():
    """``flashoverlap.settings`` reads the environment once and keeps it: every test starts and ends with it unread,
    so that a variable a test sets (and monkeypatch restores) neither reaches the next test nor is missed."""
    from flashoverlap import settings

    settings.refresh()
    yield
    settings.refresh()
