"""The command line on the CPU: ``flashoverlap demo`` (every op, both dtypes, the MoE dispatch and combine) says the
path it ran (the reference path on a CPU, and no GPU plan) and checks against plain PyTorch; ``version``; clear
errors for bad values and for commands that need GPUs.

Most run in this process (``cli.main``, ``demo.main``: the ranks fork from the test session's rank server); one demo
runs as a user types it, ``python -m flashoverlap demo``, in a fresh process."""

import subprocess
import sys

import pytest
import torch

from flashoverlap import cli, demo


def _main(capsys, *argv) -> tuple[object, str, str]:
    """``flashoverlap ARGV`` in this process: (exit code or SystemExit's message, stdout, stderr)."""
    try:
        code = cli.main(list(argv))
    except SystemExit as stop:
        code = stop.code
    out, err = capsys.readouterr()
    return code, out, err


def _no_gpu_plan(out: str) -> None:
    for word in ("tiles", "CTAs", "programs", "group   0", "Triton GEMM"):
        assert word not in out.replace("no Triton or NCCL plan", ""), f"a GPU plan printed on the CPU: {out}"


def test_demo_as_typed_says_it_ran_the_reference_path_and_checks():
    proc = subprocess.run([sys.executable, "-m", "flashoverlap", "demo", "--cpu", "--shape", "700,300,96"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    out = proc.stdout
    assert "flashoverlap demo: gemm_all_reduce of [700, 96] @ [96, 300] bfloat16 on 2 CPU processes (gloo)" in out
    assert "\npath: reference (CPU, gloo): " in out
    _no_gpu_plan(out)
    assert "verdict: OK: result vs matmul + all_reduce" in out


@pytest.mark.parametrize("op,name,dtype", [("gemm_reduce_scatter", "gemm_reduce_scatter", "float16"),
                                           ("all_gather_gemm", "all_gather_gemm", "bfloat16"),
                                           ("scaled_gemm_all_reduce", "scaled_gemm_all_reduce", "bfloat16"),
                                           ("scaled_reduce_scatter", "scaled_gemm_reduce_scatter", "float16"),
                                           ("all_gather_scaled_gemm", "all_gather_scaled_gemm", "bfloat16")])
def test_demo_runs_every_op_on_cpu(capsys, op, name, dtype):
    assert demo.main((640, 300, 96), dtype, None, True, op) == 0
    out = capsys.readouterr().out
    assert f"{name} of [640, 96] @ [96, 300] {dtype}" in out and "verdict: OK" in out
    assert "path: reference (CPU, gloo)" in out
    _no_gpu_plan(out)


def test_demo_moe_runs_dispatch_and_combine_on_two_ranks_against_plain_pytorch(capsys):
    assert demo.main(None, "bfloat16", None, True, "moe") == 0
    out = capsys.readouterr().out
    assert "moe_layout + moe_dispatch_gemm + moe_gemm_combine, 256 tokens per rank, hidden 128, expert FFN 256, " \
           "8 experts, top-2, bfloat16, on 2 CPU processes (gloo)" in out
    assert "path: reference (CPU, gloo)" in out and "verdict: OK: result vs plain PyTorch" in out
    _no_gpu_plan(out)


def test_demo_refuses_a_shape_the_op_cannot_split():
    with pytest.raises(SystemExit, match="gemm_reduce_scatter needs M divisible"):
        demo.main((641, 8, 8), "bfloat16", None, True, "reduce_scatter")


def test_demo_help_describes_the_command_and_offers_every_op_by_its_api_name(capsys):
    code, out, _ = _main(capsys, "demo", "--help")
    help_text = " ".join(out.split())
    assert code == 0 and cli.DEMO_DESCRIPTION in help_text
    for name in cli.DEMO_OPS:
        assert f"{name}," in help_text or f"{name} " in help_text, name


def test_the_demo_offers_every_public_op_under_its_api_name_and_keeps_the_old_names():
    import flashoverlap as fo

    ops = [name for name in fo.__all__ if callable(getattr(fo, name)) and not isinstance(getattr(fo, name), type)
           and name not in ("default_plan", "release")]
    assert len(ops) >= 9, ops
    for name in ops:  # the MoE ops run together, as one layer
        assert cli.demo_op(name) == (name if name in demo.OPS else "moe"), name
    assert set(cli.DEMO_OPS) == set(demo.OPS)
    for old, name in {"all_reduce": "gemm_all_reduce", "scaled_all_gather": "all_gather_scaled_gemm",
                      "moe": "moe"}.items():
        assert cli.demo_op(old) == name
    code = None
    try:
        cli.main(["demo", "--op", "scaled_all_to_all"])
    except SystemExit as stop:
        code = stop.code
    assert code == 2


def test_cli_rejects_unknown_commands(capsys):
    code, _, err = _main(capsys, "frobnicate")
    assert code == 2 and "invalid choice" in err


@pytest.mark.parametrize("argv,message", [
    (("demo", "--shape", "0,8,8"), "three positive integers"),
    (("demo", "--shape", "8,-5,8"), "three positive integers"),
    (("demo", "--shape", "8,8"), "three positive integers"),
    (("demo", "--world-size", "0"), "positive integer"),
    (("demo", "--dtype", "float32"), "invalid choice"),
    (("bench", "--ops", "all_reduce"), "choose from 'ops', 'block'"),
])
def test_bad_values_are_rejected_with_the_option_named(capsys, argv, message):
    code, _, err = _main(capsys, *argv)
    assert code == 2 and message in err and "Traceback" not in err


@pytest.mark.parametrize("argv", [("bench", "ops", "--ops", "all_reduce"),
                                  ("tune", "plan", "--op", "all_reduce", "--shape", "8,8,8")])
def test_gpu_commands_say_they_need_gpus(capsys, monkeypatch, argv):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on a CPU machine, wherever this runs
    code, _, _ = _main(capsys, *argv)
    assert isinstance(code, str) and "needs CUDA GPUs" in code  # SystemExit's message: printed, exit status 1


def test_version(capsys):
    from flashoverlap import __version__

    code, out, _ = _main(capsys, "version")
    assert code == 0 and out.strip() == f"flashoverlap {__version__}"
    code, out, _ = _main(capsys, "--version")
    assert code == 0 and out.strip() == f"flashoverlap {__version__}"
    code, out, _ = _main(capsys, "--help")
    assert code == 0 and "{demo,bench,tune,version}" in out


def test_the_demo_reads_the_path_from_the_librarys_debug_log():
    """On GPUs the demo says which path ``path="auto"`` took as the library logs it: the message the runtime writes
    (checked to be the one in its source) is parsed, and nothing is claimed where none comes."""
    import inspect
    import logging

    from flashoverlap.runtime import plans

    message = "flashoverlap: path='auto' uses %s for %s on %s: %s"
    assert f'_LOG.debug("{message}"' in inspect.getsource(plans)
    log = logging.getLogger("flashoverlap")
    level = log.level
    result, path = demo._chosen_path(lambda: log.debug(message, "p2p", "all_reduce", "group 0", "one node") or 7)
    assert (result, path) == (7, "p2p (path='auto': one node)")
    assert log.level == level and not any(isinstance(h, demo._PathLog) for h in log.handlers)
    assert demo._chosen_path(lambda: 8) == (8, "auto (the library did not report its choice)")
