"""``flashoverlap.testing.spawn``, which every multi-process test stands on: fresh ranks per call, the caller's
environment at the call, the ranks' output on the caller's streams while they run, a rank's failure raised in the
caller, a rank that ends without reporting or a call that never ends turned into an error in bounded time."""

import os
import sys
import time
import warnings

import pytest
import torch

from flashoverlap import testing
from flashoverlap.testing import apply_environ, rank_context, spawn

_touched = None  # a module global a rank sets: a rank of a later call must not see it (no rank is reused)


def _report(rank, world_size, name):
    global _touched
    before, _touched = _touched, rank
    print(f"rank {rank} of {world_size} says hello")
    print(f"rank {rank} warns", file=sys.stderr)
    return before, os.environ.get(name), os.environ.get("FLASHOVERLAP_TEST_GONE")


def _fail(rank, world_size):
    print(f"rank {rank} was here")
    if rank == 1:
        raise ValueError("rank one refuses")


def _vanish(rank, world_size):
    # spawn's workers pass a barrier after the group's set-up, so rank 0's set-up is over when rank 1 exits.
    if rank == 1:
        os._exit(3)


def _hang(rank, world_size):
    print(f"rank {rank} started", flush=True)
    time.sleep(600)


def _salt(rank, world_size):
    return hash("flashoverlap")


def test_ranks_see_the_callers_environment_at_the_call_and_start_fresh(monkeypatch, capfd):
    monkeypatch.setenv("FLASHOVERLAP_TEST_SET", "set after the session began")
    monkeypatch.setenv("FLASHOVERLAP_TEST_GONE", "removed before the call")
    monkeypatch.delenv("FLASHOVERLAP_TEST_GONE")
    first = spawn(_report, 2, args=("FLASHOVERLAP_TEST_SET",))
    assert first == [(None, "set after the session began", None)] * 2
    again = spawn(_report, 2, args=("FLASHOVERLAP_TEST_SET",), env={"FLASHOVERLAP_TEST_SET": "given"})
    assert again == [(None, "given", None)] * 2  # env wins; no rank of the first call is reused
    out, err = capfd.readouterr()
    assert out.count("rank 0 of 2 says hello") == 2 and out.count("rank 1 of 2 says hello") == 2
    assert err.count("rank 1 warns") == 2


def test_a_rank_takes_exactly_the_environment_it_is_handed():
    environ = {"KEPT": "1", "CHANGED": "old", "GONE": "x"}
    apply_environ({"KEPT": "1", "CHANGED": "new", "ADDED": "y"}, environ)
    assert environ == {"KEPT": "1", "CHANGED": "new", "ADDED": "y"}


@pytest.mark.skipif(sys.platform != "linux", reason="the forkserver is used on Linux only")
def test_variables_read_at_import_send_the_call_to_fresh_interpreters(monkeypatch):
    monkeypatch.setattr(testing, "_fresh_because", set())  # what this test sends is not the session's to report
    if testing._server is None:
        rank_context()  # the forkserver, started here if no test started it before
    # Its own start environment as the base: the session's may have changed since (other tests, torch itself).
    environ = dict(testing._server[1])
    server = rank_context(environ)
    assert server.get_start_method() == "forkserver"
    assert rank_context(dict(environ, FLASHOVERLAP_DEBUG_TIMEOUT="5", NCCL_P2P_DISABLE="1")) is server
    # What torch.compile's inductor leaves in the environment of a process that compiled (as tests here do).
    assert rank_context(dict(environ, TORCHINDUCTOR_CACHE_DIR="/tmp/x",
                             _TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR="1")) is server
    assert rank_context(dict(environ, OMP_NUM_THREADS="1")).get_start_method() == "spawn"
    without_path = dict(environ)
    without_path.pop("PATH")
    assert rank_context(without_path).get_start_method() == "spawn"
    assert rank_context(fresh=True).get_start_method() == "spawn"
    assert testing.fresh_because() == ["OMP_NUM_THREADS", "PATH"]



def _started_with(rank, world_size, name):
    """``name`` in the environment this rank's interpreter was started with (what torch saw at its import), not
    the one ``spawn`` applies later."""
    with open("/proc/self/environ", "rb") as f:
        started = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    value = started.get(name.encode())
    return None if value is None else value.decode()


@pytest.mark.skipif(sys.platform != "linux", reason="/proc/self/environ: Linux")
def test_a_variable_read_at_import_is_there_when_the_fresh_interpreter_starts(monkeypatch):
    """``env={"OMP_NUM_THREADS": ...}``-like variables send a call to fresh interpreters because torch reads them at
    import: they must be in the environment those interpreters start with (they were applied only after the
    import, too late), and the caller's own environment stays as it was."""
    name = "FLASHOVERLAP_IMPORT_TIME_PROBE"[len("FLASHOVERLAP_"):]  # outside READ_AT_WORK: read at import
    assert name not in os.environ
    monkeypatch.setattr(testing, "_fresh_because", set())  # what this test sends is not the session's to report
    assert spawn(_started_with, 2, args=(name,), env={name: "at start"}) == ["at start"] * 2
    assert name not in os.environ


def test_spawn_refuses_a_world_it_cannot_start():
    with pytest.raises(ValueError, match="world_size must be an int >= 1, got 0"):
        spawn(_salt, 0)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="backend='nccl' needs a CUDA GPU per rank"):
            spawn(_salt, 2, backend="nccl")


def test_spawn_on_one_gpu_refuses_more_ranks_than_the_p2p_path_serves_before_starting_any(monkeypatch):
    """docs/usage.md: up to 8 processes. Nine used to start, and every op refused them (P2P serves up to 8 ranks,
    and the NCCL path refuses a gloo group of CUDA tensors)."""
    from flashoverlap.testing import spawn_on_one_gpu

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(testing, "rank_context", lambda *a, **kw: pytest.fail("ranks were started"))
    with pytest.raises(ValueError, match=r"spawn_on_one_gpu: up to 8 ranks \(the P2P path's most\), got 9"):
        spawn_on_one_gpu(_salt, 9)


def test_spawn_refuses_more_nccl_ranks_than_gpus_before_starting_any(monkeypatch):
    """NCCL refuses two ranks on one GPU: the ranks used to start, wrap round onto the GPUs (rank % GPUs) and fail
    inside NCCL's first call (so did the GPU suite with FLASHOVERLAP_TEST_WORLD_SIZE above the GPU count)."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(testing, "rank_context", lambda *a, **kw: pytest.fail("ranks were started"))
    with pytest.raises(RuntimeError, match=r"needs a CUDA GPU per rank: 4 ranks, 2 GPUs \(torch.cuda.device_count"):
        spawn(_salt, 4, backend="nccl")

def test_fresh_ranks_salt_their_string_hashes_apart():
    first, second = spawn(_salt, 2, fresh=True)
    assert first != second  # as separate machines' processes do (equal by chance with probability 2**-64)


def test_a_failing_rank_is_raised_with_its_traceback_and_every_ranks_output(capfd):
    with pytest.raises(RuntimeError, match="rank 1 failed:(.|\n)*ValueError: rank one refuses"):
        spawn(_fail, 2)
    out, _ = capfd.readouterr()
    assert "rank 0 was here" in out and "rank 1 was here" in out


def test_a_rank_that_ends_without_reporting_is_an_error_at_once():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 ended \\(exit code 3\\) without reporting"):
        spawn(_vanish, 2, timeout=120)
    assert time.monotonic() - start < 60


def test_a_call_that_never_ends_is_an_error_after_its_timeout_with_what_the_ranks_printed(capfd):
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="did not all report within 3 s: ranks 0, 1 did not"):
        spawn(_hang, 2, timeout=3)
    assert time.monotonic() - start < 60
    out, _ = capfd.readouterr()
    assert "rank 0 started" in out and "rank 1 started" in out


def test_the_others_get_a_grace_period_once_a_rank_has_failed():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 failed"):
        spawn(_fail_while_the_other_hangs, 2, timeout=300, grace=2.0)
    assert time.monotonic() - start < 60


def _fail_while_the_other_hangs(rank, world_size):
    if rank == 1:
        raise ValueError("rank one refuses")
    time.sleep(600)


def _reads_twice():
    warnings.warn(testing.SYNC_WARNING, stacklevel=1)
    warnings.warn("something else", stacklevel=1)
    _reads_once()


def _reads_once():
    warnings.warn(testing.SYNC_WARNING, stacklevel=1)


def test_host_synchronisations_names_where_each_is_issued_and_restores_the_mode(monkeypatch):
    modes = []

    def set_mode(mode):  # as torch's: setting "warn" raises a notice that is not a synchronisation
        if mode == "warn":
            warnings.warn("Sync debug mode is a prototype feature and does not yet detect all synchronizing "
                          "operations", stacklevel=1)
        modes.append(mode)

    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", set_mode)
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 2)  # the caller's mode: "error"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    passed_on = []
    monkeypatch.setattr(warnings, "showwarning", lambda message, *args, **kwargs: passed_on.append(str(message)))
    found = testing.host_synchronisations(_reads_twice)
    assert [site.split(" <- ")[0].split(":")[0] for site in found] == ["_reads_twice", "_reads_once"]
    assert found[1].startswith("_reads_once:") and " <- _reads_twice:" in found[1]
    assert modes == ["warn", 2], "the caller's mode restored"
    # The mode's notice and fn's other warning go on to the handler in place before; the synchronisations do not.
    assert len(passed_on) == 2 and passed_on[0].startswith("Sync debug mode") and passed_on[1] == "something else"

    def fails():
        raise KeyError("boom")

    with pytest.raises(KeyError):
        testing.host_synchronisations(fails)
    assert modes[-1] == 2
    assert testing.host_synchronisations(lambda: None) == []


def _big(rank, world_size):
    return torch.full((4_000_000,), float(rank))  # 16 MB: past what the queue's shared storage carried reliably


def test_large_tensor_results_reach_the_caller():
    """A rank's tensor used to travel as shared storage that the rank, gone after reporting, could no longer serve
    (EOFError, ConnectionResetError, FileNotFoundError in the caller)."""
    for _ in range(2):
        got = spawn(_big, 2)
        assert [float(t[0]) for t in got] == [0.0, 1.0] and all(t.shape == (4_000_000,) for t in got)


def _unpicklable(rank, world_size):
    return (lambda: rank) if rank == 1 else rank


def test_a_result_that_cannot_be_sent_is_that_ranks_failure():
    with pytest.raises(RuntimeError, match=r"rank 1 failed:(.|\n)*rank 1's result \(function\) cannot be sent"):
        spawn(_unpicklable, 2)


def _fail_while_the_other_waits_in_a_collective(rank, world_size):
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("boom from rank 1")
    dist.all_reduce(torch.ones(1))  # rank 1 never comes: the collective breaks off once rank 1's process is gone


def test_the_first_failure_is_raised_not_the_peer_it_broke():
    """Rank 0's collective breaks off because rank 1 raised: rank 1's error is the one raised (it was the first
    seen; the lowest rank's used to be), rank 0's after it."""
    with pytest.raises(RuntimeError) as info:
        spawn(_fail_while_the_other_waits_in_a_collective, 2, timeout=120, grace=30.0)
    text = str(info.value)
    assert text.startswith("rank 1 failed:") and "ValueError: boom from rank 1" in text, text


def test_host_synchronisations_says_it_needs_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="host_synchronisations: needs CUDA"):
        testing.host_synchronisations(lambda: None)


def test_spawn_refuses_an_env_value_that_is_not_a_str_and_leaves_the_environment_whole():
    # {"HOME": None} raised a TypeError naming nothing, after the caller's environment had been cleared: 30
    # variables stayed gone from the calling process.
    before = dict(os.environ)
    with pytest.raises(TypeError, match="spawn: env maps names to str values.*'HOME': None"):
        testing.spawn(_salt, 2, env={"HOME": None})
    assert dict(os.environ) == before


def test_the_environment_is_restored_when_applying_it_fails():
    before = dict(os.environ)
    with pytest.raises(TypeError):
        with testing._environment({"A_NAME": 1}):
            pass
    assert dict(os.environ) == before


def test_spawn_refuses_a_bool_world_size():
    with pytest.raises(ValueError, match="spawn: world_size must be an int >= 1, got True"):
        testing.spawn(_salt, True)


def test_an_inductor_variable_read_at_import_sends_the_ranks_to_fresh_interpreters(monkeypatch):
    # The forkserver's preload imports torch._dynamo, which reads TORCHINDUCTOR_ variables then: forked ranks kept
    # the server's value (max_autotune False where the caller asked for 1). The two inductor sets itself do not.
    monkeypatch.setattr(testing, "_fresh_because", set())  # what this test sends fresh is its own
    if testing._server is None:
        testing.rank_context()  # the forkserver, started here if no test started it before
    environ = dict(testing._server[1])  # its own start environment: the session's may have changed since
    assert testing.rank_context({**environ, "TORCHINDUCTOR_MAX_AUTOTUNE": "1"}).get_start_method() == "spawn"
    for name in ("TORCHINDUCTOR_CACHE_DIR", "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"):
        assert testing.rank_context({**environ, name: "x"}).get_start_method() == "forkserver"


def _plain_unknown(rank, world_size):
    try:
        testing.plain("allreduce", torch.randn(4, 2), torch.randn(2, 3))
    except ValueError as exc:
        return str(exc)
    return "computed"


def test_plain_refuses_an_unknown_op():
    # It computed a reduce-scatter for any name but all_reduce and all_gather.
    assert testing.spawn(_plain_unknown, 2, timeout=60) == [
        "plain: op must be 'all_reduce', 'reduce_scatter' or 'all_gather', got 'allreduce'"] * 2


def _lingering(rank, world_size):
    import threading

    if rank == 1:  # a non-daemon thread keeps the process from ending after it reported
        threading.Thread(target=time.sleep, args=(1000,)).start()
    return rank


def test_spawn_keeps_its_timeout_while_the_ranks_end():
    # Once every rank had reported, each process got a fixed 60 s to end. (The rank that lingers
    # is killed at the call's deadline: the test takes its timeout, kept short.)
    start = time.monotonic()
    assert testing.spawn(_lingering, 2, timeout=8) == [0, 1]
    assert time.monotonic() - start < 40  # 68 s before: 8 s and a fixed 60 s
