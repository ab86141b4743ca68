"""The command line's parsing, on a CPU machine: every command's ``--help`` lists every option of the commands under
it (``bench --help`` those of ``bench ops``, ``bench block`` and ``bench moe``) and prints instead of refusing for
want of GPUs; one strict parser for shapes and counts (``bench/args.py``), used by ``flashoverlap`` and by ``python
-m flashoverlap.bench[.block|.moe]`` alike (``1_6`` is not 16, ``-8,8,8`` gets the shape's message, not argparse's
"expected one argument")."""

import argparse
import subprocess
import sys

import pytest

from flashoverlap import cli
from flashoverlap.bench import args


def _sub(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(actions[0].choices) if actions else {}


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {opt for action in parser._actions for opt in action.option_strings if opt.startswith("--")} - {"--help"}


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
    for argv in (("bench", "ops", "--help"), ("bench", "block", "--help"), ("bench", "moe", "--help"),
                 ("tune", "plan", "--help")):
        code, out, err = _main(capsys, *argv)
        assert code == 0 and out.startswith(f"usage: flashoverlap {argv[0]} {argv[1]}"), (argv, err)
    # And as a user types it, in a fresh process.
    proc = subprocess.run([sys.executable, "-m", "flashoverlap", "bench", "ops", "--help"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "--sweep-ctas" in proc.stdout and "needs CUDA" not in proc.stderr


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
    assert args.shape("8,16,32") == (8, 16, 32)
    assert args.shapes("1,2,3;4,5,6") == [(1, 2, 3), (4, 5, 6)]
    assert args.positive_ints("8192,16384") == [8192, 16384]
    assert args.non_negative_ints("0,4") == [0, 4]
    for bad in ("1_6", "-1", "0", "+2", "2.0", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            args.positive(bad)
    with pytest.raises(argparse.ArgumentTypeError, match="positive integers"):
        args.positive_ints("8,1_6")
    with pytest.raises(argparse.ArgumentTypeError, match="unknown op"):
        args.op_names("all_reduce,all_to_all")
    assert args.op_names("") == []
    assert args.join_values(["demo", "--shape", "-8,8,8", "--cpu"]) == ["demo", "--shape=-8,8,8", "--cpu"]
    assert args.join_values(["--shape", "--cpu"]) == ["--shape", "--cpu"]  # an option is left an option


@pytest.mark.parametrize("argv,message", [
    (("bench", "block", "--tokens", "8192,1_6"), "comma-separated positive integers"),
    (("bench", "block", "--steps", "-3"), "positive integer"),
    (("bench", "ops", "--iters", "0"), "positive integer"),
    (("bench", "ops", "--sweep-ctas", "4,-1"), "integers >= 0"),
    (("tune", "validate", "--ops", "all_reduce,gather"), "unknown op"),
    (("demo", "--world-size", "1_0"), "positive integer"),
    (("bench", "moe", "--tokens", "4096,8192"), "positive integer"),
    (("bench", "moe", "--warmup", "-1"), "integer >= 0"),
    (("bench", "moe", "--iters", "0"), "positive integer"),
    (("bench", "moe", "--paths", "ring"), "invalid choice: 'ring'"),
    (("bench", "moe", "--configs", "mixtral-8x7b"), "invalid choice"),
])
def test_bad_counts_are_refused_naming_the_option(capsys, argv, message):
    code, _, err = _main(capsys, *argv)
    assert code == 2 and message in err and f"argument {argv[-2]}" in err, err


@pytest.mark.parametrize("module,argv", [("flashoverlap.bench.__main__", ["--shapes", "1_6,8,8"]),
                                         ("flashoverlap.bench.block", ["--tokens", "-8"]),
                                         ("flashoverlap.bench.moe", ["--tokens", "4096", "-8"])])
def test_the_benchmark_modules_parse_with_the_same_functions(capsys, module, argv):
    import importlib

    with pytest.raises(SystemExit) as stop:
        importlib.import_module(module).main(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "digits only" in err and f"usage: python -m {module.replace('.__main__', '')}" \
        in err, err


@pytest.mark.parametrize("what,argv", [("block", ["--tokens", "64", "--steps", "5"]),
                                       ("moe", ["--tokens", "64", "128", "--paths", "nccl", "p2p"])])
def test_the_benchmarks_are_handed_the_options_after_their_name(monkeypatch, what, argv):
    import importlib

    import torch

    module = importlib.import_module(f"flashoverlap.bench.{what}")
    seen = {}
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)

    def bench_main(argv):
        seen["argv"] = argv
        return 0

    monkeypatch.setattr(module, "main", bench_main)
    assert cli.main(["bench", what, *argv]) == 0
    assert seen["argv"] == argv


def test_the_moe_options_name_what_the_benchmark_has():
    from flashoverlap.bench import moe
    from flashoverlap.runtime.policy import EXPERT_PATHS

    assert args.MOE_CONFIGS == list(moe.CONFIGS)
    assert (args.MOE_ROUTINGS, args.MOE_MODES, args.MOE_PASSES) == (list(moe.ROUTINGS), list(moe.MODES),
                                                                    list(moe.PASSES))
    assert args.MOE_PATHS == list(EXPERT_PATHS)
    parser = argparse.ArgumentParser()
    args.add_bench_moe_arguments(parser)
    parsed = parser.parse_args(["--tokens", "64", "128", "--paths", "auto", "nccl", "--warmup", "0"])
    assert (parsed.tokens, parsed.paths, parsed.warmup, parsed.configs) == ([64, 128], ["auto", "nccl"], 0,
                                                                            args.MOE_CONFIGS)
