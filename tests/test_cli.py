"""The command line's parsing, on a CPU machine: every command's ``--help`` lists every option of the commands under
it (``bench --help`` those of ``bench ops``) and prints instead of refusing for want of GPUs; one strict parser for
shapes and counts (``cli.py``'s, which the harness's ``python -m benchmarks.ops|block|moe`` use too:
tests/benchmarks/test_options.py) (``1_6`` is not 16, ``-8,8,8`` gets the shape's message, not argparse's "expected
one argument"); the harness's commands (``bench block``, ``bench moe``, ``tune validate``, and ``bench ops`` given the
harness's options) run the harness of the source checkout they are installed from, and elsewhere say in one line
how to get it; ``python -m flashoverlap.bench`` is ``bench ops``, never a silent exit."""

import argparse
import os
import subprocess
import sys

import pytest

from flashoverlap import cli


def _sub(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(actions[0].choices) if actions else {}


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {opt for action in parser._actions for opt in action.option_strings if opt.startswith("--")} - {"--help"}


class _Exec:
    """A stand-in for ``os.execve``: records what this process would have become (``python -m MODULE ARGS``) and,
    with ``run``, runs that module here (as the exec would) instead of replacing the test's process."""

    def __init__(self, monkeypatch, run: bool = False) -> None:
        self.argv: list[str] | None = None
        self.env: dict | None = None
        self.monkeypatch, self.run = monkeypatch, run
        monkeypatch.setattr(cli.os, "execve", self)

    def __call__(self, path, argv, env):
        self.argv, self.env = list(argv[1:]), env
        if not self.run:
            raise SystemExit(0)
        import runpy

        assert argv[1] == "-m"
        self.monkeypatch.setattr(sys, "argv", [argv[2], *argv[3:]])
        runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
        raise SystemExit(0)


@pytest.fixture(autouse=True)
def _no_exec(monkeypatch):
    """No test here may replace the test process: a harness command's exec runs its module here instead."""
    _Exec(monkeypatch, run=True)


def _main(capsys, *argv) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as stop:
        cli.main(list(argv))
    out, err = capsys.readouterr()
    return stop.value.code, out, err


@pytest.mark.parametrize("command", ["demo", "bench", "tune"])
def test_every_commands_help_lists_every_option_beneath_it(capsys, command):
    parser = _sub(cli.parser())[command]
    beneath = _sub(parser)
    want = _options(parser).union(*(_options(p) for p in beneath.values()))
    assert want, command
    code, out, _ = _main(capsys, command, "--help")
    assert code == 0
    missing = sorted(opt for opt in want if opt not in out)
    assert not missing, f"`flashoverlap {command} --help` does not list {missing}"
    for name, sub in beneath.items():  # and each subcommand's own --help describes each of its options
        code, out, _ = _main(capsys, command, name, "--help")
        assert code == 0 and all(opt in out for opt in _options(sub)), (command, name)


def test_help_of_gpu_commands_prints_on_a_cpu_machine(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on a CPU machine, wherever this runs
    for argv in (("bench", "ops", "--help"), ("tune", "plan", "--help")):
        code, out, err = _main(capsys, *argv)
        assert code == 0 and out.startswith(f"usage: flashoverlap {argv[0]} {argv[1]}"), (argv, err)
    for argv, module in ((("bench", "block", "--help"), "block"), (("bench", "moe", "--help"), "moe"),
                         (("tune", "validate", "--help"), "model_check")):  # the harness's own help
        code, out, err = _main(capsys, *argv)
        assert code == 0 and out.startswith(f"usage: python -m benchmarks.{module}") and "--out" in out, (argv, err)
    # And as a user types it, in a fresh process.
    proc = subprocess.run([sys.executable, "-m", "flashoverlap", "bench", "ops", "--help"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "--shapes" in proc.stdout and "needs CUDA" not in proc.stderr
    assert "benchmarks.ops" in proc.stdout  # where the full harness is


@pytest.mark.parametrize("text", ["-8,8,8", "1_6,8,8", "+8,8,8", " 8,8,8", "8,8", "8,8,8,", "0,8,8", "8,8,8.0",
                                  "\uff18,8,8", "", "8,,8"])
def test_a_bad_shape_is_refused_with_the_shapes_message(capsys, text):
    for argv in (("demo", "--shape", text), ("tune", "plan", "--op", "all_reduce", "--shape", text),
                 ("bench", "ops", "--shapes", f"8,8,8;{text}")):
        code, _, err = _main(capsys, *argv)
        assert code == 2, argv
        assert "expected three positive integers M,N,K (digits only)" in err, (argv, err)
        assert "expected one argument" not in err


def test_shapes_and_counts_parse_strictly():
    assert cli.shape("8,16,32") == (8, 16, 32)
    assert cli.shapes("1,2,3;4,5,6") == [(1, 2, 3), (4, 5, 6)]
    assert cli.positive_ints("8192,16384") == [8192, 16384]
    assert cli.non_negative_ints("0,4") == [0, 4]
    for bad in ("1_6", "-1", "0", "+2", "2.0", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            cli.positive(bad)
    with pytest.raises(argparse.ArgumentTypeError, match="positive integers"):
        cli.positive_ints("8,1_6")
    with pytest.raises(argparse.ArgumentTypeError, match="unknown op"):
        cli.op_names("all_reduce,all_to_all")
    for nothing in ("", ","):  # none would run nothing and exit 0 (`flashoverlap bench ops --ops ""`)
        with pytest.raises(argparse.ArgumentTypeError, match="at least one op"):
            cli.op_names(nothing)
    assert cli.join_values(["demo", "--shape", "-8,8,8", "--cpu"]) == ["demo", "--shape=-8,8,8", "--cpu"]
    assert cli.join_values(["--shape", "--cpu"]) == ["--shape", "--cpu"]  # an option is left an option


@pytest.mark.parametrize("argv,message", [
    (("bench", "ops", "--iters", "0"), "positive integer"),
    (("bench", "ops", "--ops", "all_reduce,gather"), "unknown op"),
    (("tune", "bandwidth", "--ops", "all_reduce,gather"), "unknown op"),
    (("tune", "bandwidth", "--max-mib", "-3"), "positive integer"),
    (("demo", "--world-size", "1_0"), "positive integer"),
])
def test_bad_counts_are_refused_naming_the_option(capsys, argv, message):
    code, _, err = _main(capsys, *argv)
    assert code == 2 and message in err and f"argument {argv[-2]}" in err, err


@pytest.mark.parametrize("argv,usage", [(("tune", "bandwidth", "--bogus"), "flashoverlap tune bandwidth"),
                                        (("tune", "plan", "--op", "all_reduce", "--shape", "8,8,8", "--bogus"),
                                         "flashoverlap tune plan"),
                                        (("demo", "--bogus"), "flashoverlap demo"),
                                        (("demo", "extra"), "flashoverlap demo"),
                                        (("version", "--bogus"), "flashoverlap version")])
def test_an_unknown_option_is_refused_with_its_commands_usage(capsys, argv, usage):
    """``tune bandwidth --bogus`` printed the top-level usage (``flashoverlap [-h] [--version] {demo,...}``), which
    lists none of the options that command takes."""
    code, out, err = _main(capsys, *argv)
    assert code == 2 and err.startswith(f"usage: {usage} [-h]"), err
    assert f"{usage}: error: unrecognized arguments: {argv[-1]}" in err, err


def test_a_harness_option_of_bench_ops_runs_the_harness_or_says_where_it_is(capsys, monkeypatch):
    become = _Exec(monkeypatch)
    code, _, err = _main(capsys, "bench", "ops", "--ops", "all_reduce", "--timeline", "t.png")
    assert code == 0 and become.argv == ["-m", "benchmarks.ops", "--ops", "all_reduce", "--timeline", "t.png"]
    assert str(cli.harness_root()) in become.env["PYTHONPATH"].split(":")
    assert "--timeline t.png: handed with the rest to benchmarks.ops" in err
    monkeypatch.setattr(cli, "harness_root", lambda: None)  # an installed wheel: no harness
    code, _, err = _main(capsys, "bench", "ops", "--sweep", "--sweep-ctas", "4")
    assert isinstance(code, str) and "\n" not in code, code
    assert "unrecognized arguments: --sweep --sweep-ctas 4" in code and "-m benchmarks.ops" in code, code


def test_python_m_flashoverlap_bench_is_bench_ops(monkeypatch, capsys):
    """What the results files record (``python -m flashoverlap.bench --ops ...``) runs ``bench ops``: on a CPU it
    says in one line that it needs GPUs, never exits 0 having done nothing."""
    import runpy
    import warnings

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["flashoverlap.bench", "--ops", "all_reduce"])
    execs = []

    def become(path, argv):  # os.execv: run `python -m flashoverlap ARGS` here instead
        execs.append(argv[1:])
        monkeypatch.setattr(sys, "argv", argv[2:])
        runpy.run_module(argv[2], run_name="__main__", alter_sys=True)

    monkeypatch.setattr(os, "execv", become)
    with warnings.catch_warnings(), pytest.raises(SystemExit) as stop:
        warnings.simplefilter("ignore", RuntimeWarning)  # runpy: the module is imported already
        runpy.run_module("flashoverlap.bench", run_name="__main__", alter_sys=True)
    assert execs == [["-m", "flashoverlap", "bench", "ops", "--ops", "all_reduce"]]
    assert "flashoverlap bench ops: needs CUDA GPUs" in str(stop.value.code)


HARNESS_CASES = [
    (("bench", "block", "--tokens", "64", "--steps", "5"), "block", "-m benchmarks.block --tokens 64 --steps 5"),
    (("bench", "moe", "--tokens", "64", "128", "--paths", "nccl"), "moe",
     "-m benchmarks.moe --tokens 64 128 --paths nccl"),
    (("tune", "validate", "--path", "p2p"), "model_check", "-m benchmarks.model_check --path p2p"),
    (("bench", "block"), "block", "-m benchmarks.block ..."),
]


@pytest.mark.parametrize("argv,module,command", HARNESS_CASES)
def test_the_harness_commands_run_the_harness_of_a_source_checkout(monkeypatch, argv, module, command):
    become = _Exec(monkeypatch)
    with pytest.raises(SystemExit):
        cli.main(list(argv))
    assert become.argv == ["-m", f"benchmarks.{module}", *argv[2:]]


@pytest.mark.parametrize("argv,module,command", HARNESS_CASES)
def test_without_a_source_checkout_the_harness_commands_say_how_to_get_one(monkeypatch, argv, module, command):
    import torch

    monkeypatch.setenv("RANK", "0")  # as under torchrun, on GPUs: the answer is the same
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(cli, "harness_root", lambda: None)
    with pytest.raises(SystemExit) as stop:
        cli.main(list(argv))
    message = str(stop.value.code)
    assert "\n" not in message and "this installation does not have" in message, message
    assert f"torchrun --nproc-per-node 2 {command}`" in message, message


def test_the_harness_is_found_beside_the_package_in_a_source_checkout():
    root = cli.harness_root()
    assert root is not None and (root / "src" / "flashoverlap" / "cli.py").is_file()
    for module in cli.HARNESS.values():
        assert (root / (module.split()[-1].replace(".", "/") + ".py")).is_file(), module


def test_tune_bandwidth_offers_only_the_paths_it_takes(capsys):
    code, out, _ = _main(capsys, "tune", "bandwidth", "--help")
    assert code == 0 and "auto" not in out, out
    code, _, err = _main(capsys, "tune", "bandwidth", "--path", "auto")
    assert code == 2 and "invalid choice: 'auto'" in err


def test_bench_ops_is_handed_its_options_under_torchrun(monkeypatch):
    import torch

    from flashoverlap import bench

    seen = {}
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("NCCL_P2P_DISABLE", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(cli, "_under_torchrun", lambda run, untuned=False: run("cuda:0"))

    def bench_main(args, device, command, environment):
        seen.update(args=args, device=device, command=command, environment=environment)
        return 0

    monkeypatch.setattr(bench, "main", bench_main)
    assert cli.main(["bench", "ops", "--shapes", "64,32,16", "--iters", "3", "--out", "x.json"]) == 0
    options = seen["args"]
    assert (options.shapes, options.iters, options.out, options.ops) == ([(64, 32, 16)], 3, "x.json", ["all_reduce"])
    assert seen["command"] == "flashoverlap bench ops --shapes 64,32,16 --iters 3 --out x.json"
    assert seen["environment"]["NCCL_P2P_DISABLE"] == "1"
