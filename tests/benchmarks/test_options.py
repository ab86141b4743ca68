"""The harness's command lines (``python -m benchmarks.ops|block|moe|model_check``) parse with the command line's
strict value parsers (``flashoverlap.cli``): ``1_6`` is not 16, ``-8`` gets the count's message, each bad value's
message names its option; and the harness imports from the root of a checkout, as CI runs the suite."""

import argparse
import importlib
import json
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _exit(capsys, module: str, argv: list[str]) -> tuple[int, str]:
    with pytest.raises(SystemExit) as stop:
        importlib.import_module(module).main(argv)
    return stop.value.code, capsys.readouterr().err


def _script_exit(capsys, monkeypatch, script: str, argv: list[str]) -> tuple[int, str]:
    """``python benchmarks/SCRIPT ARGV``'s exit code and stderr, run in this process (a child costs a torch import,
    ~2.5 s): the script's ``main`` with its ``sys.argv``; the folders it puts on ``sys.path`` taken off after."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    main = runpy.run_path(str(ROOT / "benchmarks" / script))["main"]
    monkeypatch.setattr(sys, "argv", [f"benchmarks/{script}", *argv])
    with pytest.raises(SystemExit) as stop:
        main()
    return stop.value.code, capsys.readouterr().err


@pytest.mark.parametrize("module,argv", [("benchmarks.ops", ["--shapes", "1_6,8,8"]),
                                         ("benchmarks.block", ["--tokens", "-8"]),
                                         ("benchmarks.moe", ["--tokens", "4096", "-8"])])
def test_the_benchmark_modules_parse_with_the_same_functions(capsys, module, argv):
    code, err = _exit(capsys, module, argv)
    assert code == 2 and "digits only" in err and f"usage: python -m {module}" in err, err


@pytest.mark.parametrize("module,argv,message", [
    ("benchmarks.block", ["--tokens", "8192,1_6"], "comma-separated positive integers"),
    ("benchmarks.block", ["--steps", "-3"], "positive integer"),
    ("benchmarks.ops", ["--iters", "0"], "positive integer"),
    ("benchmarks.ops", ["--sweep-ctas", "4,-1"], "integers >= 0"),
    ("benchmarks.model_check", ["--ops", "all_reduce,gather"], "unknown op"),
    ("benchmarks.moe", ["--tokens", "4096,8192"], "positive integer"),
    ("benchmarks.moe", ["--warmup", "-1"], "integer >= 0"),
    ("benchmarks.moe", ["--iters", "0"], "positive integer"),
    ("benchmarks.moe", ["--paths", "ring"], "invalid choice: 'ring'"),
    ("benchmarks.moe", ["--configs", "mixtral-8x7b"], "invalid choice"),
])
def test_bad_counts_are_refused_naming_the_option(capsys, module, argv, message):
    code, err = _exit(capsys, module, argv)
    assert code == 2 and message in err and f"argument {argv[-2]}" in err, err


def test_the_moe_options_name_what_the_benchmark_has():
    from benchmarks import moe
    from flashoverlap.runtime.policy import EXPERT_PATHS

    assert list(moe.PATHS) == list(EXPERT_PATHS)
    parser = argparse.ArgumentParser()
    moe.add_arguments(parser)
    parsed = parser.parse_args(["--tokens", "64", "128", "--paths", "auto", "nccl", "--warmup", "0"])
    assert (parsed.tokens, parsed.paths, parsed.warmup, parsed.configs) == ([64, 128], ["auto", "nccl"], 0,
                                                                            list(moe.CONFIGS))


def test_the_harness_runs_from_the_root_of_a_checkout():
    # As a user (and CI) runs it: a fresh interpreter in the repository's root, the package installed (here: on
    # the path the suite runs with).
    proc = subprocess.run([sys.executable, "-m", "benchmarks.ops", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "--sweep-ctas" in proc.stdout and "--shapes" in proc.stdout, proc.stderr


def test_host_bound_cases_keep_the_ops_asked_for():
    from benchmarks import host_bound

    everything = host_bound.cases(False, "grid")
    kept = host_bound.cases(False, "grid", ("reduce_scatter", "all_gather"))
    assert {op for _, op, *_ in everything} == set(host_bound.OPS)
    assert kept == [case for case in everything if case[1] != "all_reduce"] and kept


@pytest.mark.parametrize("module", ["benchmarks.diagnostics.fp8_grouped", "benchmarks.diagnostics.fp8_grouped_tiles"])
def test_a_misspelt_config_name_is_a_usage_error_before_the_gpu_is_asked_for(capsys, monkeypatch, module):
    """``--only`` with a name that is not a config ran nothing and exited 0; now the usage error names it and lists
    the configs."""
    monkeypatch.setattr(sys, "argv", [module, "--only", "mixtral-8x22b-up,mixtral-8x22-up"])
    with pytest.raises(SystemExit) as stop:
        importlib.import_module(module).main()
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "unknown config mixtral-8x22-up;" in err and "gpt-oss-120b-up" in err, err


@pytest.mark.parametrize("script,argv,said", [
    ("host_python.py", ["--parts", "runtme"], "argument --parts: unknown runtme"),
    ("host_python.py", ["--dtypes", "fp8"], "argument --dtypes: unknown fp8"),
    ("host_python.py", ["--parts", ","], "argument --parts: none named"),
    ("moe_host_python.py", ["--repeat", "0"], "argument --repeat: a whole number of 1 or more"),
    ("nccl_host_python.py", ["--repeat", "0"], "argument --repeat: a whole number of 1 or more"),
    ("fp8_moe_host_python.py", ["--calls", "0"], "argument --calls: a whole number of 1 or more")])
def test_a_cpu_measurement_that_would_measure_nothing_is_a_usage_error(capsys, monkeypatch, tmp_path, script, argv,
                                                                       said):
    """These measured nothing for a misspelt name or a zero count, exited 0, and replaced the label's rows in the
    results file by fewer or none."""
    out = tmp_path / "rows.json"
    code, err = _script_exit(capsys, monkeypatch, script, ["--label", "x", "--out", str(out), *argv])
    assert code == 2 and said in err, err
    assert not out.exists()


@pytest.mark.parametrize("script", ["host_python.py", "moe_host_python.py", "nccl_host_python.py",
                                    "fp8_moe_host_python.py"])
@pytest.mark.parametrize("where,said", [("folder", "is a folder; name the results file"),
                                        ("missing/rows.json", "is not a folder (create it first)"),
                                        ("not-json", "is no results file of benchmarks/"),
                                        ("other", "is no results file of benchmarks/")])
def test_a_cpu_measurement_refuses_an_out_it_could_not_merge_into_before_measuring(capsys, monkeypatch, tmp_path,
                                                                                   script, where, said):
    """``--out`` naming a folder, a file in a folder that does not exist, a file that is no JSON or another script's
    results file (``moe_host_python.py --out cpu-host-python.json``: its rows have no ``label``) ended in a traceback
    once every row was measured (a minute or more), the run's rows lost."""
    target = tmp_path / where
    if where == "folder":
        target.mkdir()
    elif where == "not-json":
        target.write_text("rows\n")
    elif where == "other":
        other = "host_python.py" if script != "host_python.py" else "moe_host_python.py"
        target.write_text(json.dumps({"meta": {"command": f"python benchmarks/{other} --label LABEL --out FILE"},
                                      "rows": []}))
    before = target.read_bytes() if target.is_file() else None
    code, err = _script_exit(capsys, monkeypatch, script, ["--label", "x", "--out", str(target)])
    assert code == 2 and "argument --out:" in err and said in err, err
    assert (target.read_bytes() if target.is_file() else None) == before


def test_a_cpu_measurement_takes_its_own_results_files():
    """The committed results files each script merges into (its documented ``--out``) are still taken."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import cpu_runs
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    for script, files in (("host_python.py", ["cpu-host-python.json", "cpu-host-python-w8.json"]),
                          ("moe_host_python.py", ["cpu-moe-host-python.json"]),
                          ("nccl_host_python.py", ["cpu-nccl-host-python.json", "cpu-nccl-host-views.json"]),
                          ("fp8_moe_host_python.py", ["cpu-fp8-moe-host-python.json"])):
        for name in files:
            path = str(ROOT / "benchmarks" / "results" / name)
            assert cpu_runs.results_out(script)(path) == path


def test_a_misspelt_routing_or_path_is_a_usage_error(capsys, monkeypatch):
    """``moe_gemm --routings zpf`` ran zipf routing under the label "zpf" (anything but "balanced" was zipf);
    ``fp8_moe_host --path ncl`` recorded an error row per case and exited 0, over the committed results file."""
    code, err = _exit(capsys, "benchmarks.moe_gemm", ["--routings", "balanced,zpf"])
    assert code == 2 and "unknown routing zpf; choose from balanced, zipf" in err, err
    code, err = _exit(capsys, "benchmarks.moe_gemm", ["--projs", "upp"])
    assert code == 2 and "unknown projection upp; choose from up, down" in err, err
    monkeypatch.setattr(sys, "argv", ["fp8_moe_host", "--path", "ncl"])
    with pytest.raises(SystemExit) as stop:
        importlib.import_module("benchmarks.diagnostics.fp8_moe_host").main()
    assert stop.value.code == 2 and "invalid choice: 'ncl'" in capsys.readouterr().err


def test_one_fault_scenario_with_no_faults_is_a_usage_error(capsys, monkeypatch, tmp_path):
    """``reliability.py --fault OP:PATH:KIND --skip-faults`` ran no random calls (``--fault``) and no fault
    (``--skip-faults``), then wrote a file holding only ``meta``. Refused before the GPU is looked for."""
    out = tmp_path / "r.json"
    code, err = _script_exit(capsys, monkeypatch, "reliability.py",
                             ["--fault", "all_reduce:p2p:skip", "--skip-faults", "--out", str(out)])
    assert code == 2 and "--fault runs one fault scenario and --skip-faults runs none" in err, err
    assert not out.exists()


@pytest.mark.parametrize("calls", ["0", "-3"])
def test_reliability_refuses_a_run_of_no_calls(capsys, monkeypatch, tmp_path, calls):
    """``--calls 0`` was accepted: with ``--skip-faults`` the run checked nothing and exited 0."""
    out = tmp_path / "r.json"
    code, err = _script_exit(capsys, monkeypatch, "reliability.py",
                             ["--calls", calls, "--skip-faults", "--out", str(out)])
    assert code == 2 and "--calls takes a positive count" in err, err
    assert not out.exists()


def test_the_agreement_fuzzer_runs_the_world_size_it_is_given(monkeypatch, capsys):
    """``tools/fuzz_agreement.py --world 3`` without ``--replay`` ran W = 2's trials too (the option was ignored)."""
    fuzz = runpy.run_path(str(Path(__file__).resolve().parents[2] / "tools" / "fuzz_agreement.py"))
    worlds = []
    main_globals = fuzz["main"].__globals__
    monkeypatch.setitem(main_globals, "run",
                        lambda trials, world, timeout: worlds.append(world) or [[] for _ in trials])
    monkeypatch.setitem(main_globals, "verdict", lambda trial, records: ("clean", ""))
    for argv, want in ((["--trials", "4", "--world", "3"], {3}), (["--trials", "4"], {2, 3})):
        worlds.clear()
        monkeypatch.setattr(sys, "argv", ["fuzz_agreement.py", *argv])
        with pytest.raises(SystemExit) as stop:
            fuzz["main"]()
        assert stop.value.code == 0 and set(worlds) == want, (argv, worlds)
    capsys.readouterr()


@pytest.mark.parametrize("argv,said", [(["--quik"], "unrecognized arguments: --quik"),
                                       (["--shape=llama"], "unrecognized arguments: --shape=llama"),
                                       (["--shapes=lama"], "invalid choice: 'lama'"),
                                       (["--dtypes=bfloat16,fp8"], "unknown dtype fp8"),
                                       (["--ops=all_reduce,gather"], "unknown op gather")])
def test_host_bound_refuses_a_misspelt_option_or_value_before_the_gpu_is_asked_for(capsys, argv, said):
    """Its options were read by hand: a misspelt key (``--shape=``, ``--quik``) was ignored and every case ran."""
    from benchmarks import host_bound

    with pytest.raises(SystemExit) as stop:
        host_bound.parse_args(["out.json", *argv])
    assert stop.value.code == 2 and said in capsys.readouterr().err


def test_host_bound_takes_its_documented_forms():
    from benchmarks import host_bound

    args = host_bound.parse_args(["o.json", "--shapes=llama", "--dtypes=bfloat16", "--quick"])
    assert (args.out, args.shapes, list(args.dtypes), args.quick, tuple(args.ops)) == \
        ("o.json", "llama", ["bfloat16"], True, host_bound.OPS)
    args = host_bound.parse_args(["--shapes", "grid", "--ops", "all_gather", "o.json"])
    assert (args.out, args.shapes, args.ops) == ("o.json", "grid", ["all_gather"])


@pytest.fixture
def gpu_rank(monkeypatch):
    """This process as torchrun's rank 0 on a node with two GPUs; the group is never started (a failure if it is)."""
    import torch
    import torch.distributed as dist

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: pytest.fail("a GPU was set"))
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **kw: pytest.fail("the group started"))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")


@pytest.mark.parametrize("module", ["benchmarks.ops", "benchmarks.block", "benchmarks.moe", "benchmarks.model_check"])
def test_the_harness_refuses_more_ranks_on_a_node_than_gpus_before_starting(gpu_rank, monkeypatch, module):
    """The harness's start (flashoverlap bench block|moe, tune validate): ranks past the last GPU used to fail in
    torch.cuda.set_device, the others waiting in the NCCL rendezvous."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(SystemExit) as stop:
        importlib.import_module(module).main([])
    assert stop.value.code == (f"python -m {module}: 4 ranks on this node but 2 CUDA GPUs: one per rank; use "
                               "torchrun --nproc-per-node 2 or fewer")


@pytest.mark.parametrize("module", ["benchmarks.ops", "benchmarks.block", "benchmarks.moe", "benchmarks.model_check"])
def test_the_harness_refuses_an_out_it_could_not_write_before_starting(gpu_rank, monkeypatch, capsys, tmp_path,
                                                                       module):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    code, err = _exit(capsys, module, ["--out", str(tmp_path)])
    assert code == 2 and f"--out {tmp_path}: is a directory" in err, err


@pytest.mark.parametrize("module", ["benchmarks.ops", "benchmarks.block", "benchmarks.moe", "benchmarks.model_check"])
def test_the_harness_names_a_bad_out_on_a_machine_without_gpus(monkeypatch, capsys, tmp_path, module):
    """On a machine without GPUs a bad --out was answered "needs CUDA GPUs": the command line comes first."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, err = _exit(capsys, module, ["--out", str(tmp_path)])
    assert code == 2 and f"--out {tmp_path}: is a directory" in err and "needs CUDA" not in err, err


@pytest.mark.parametrize("where,said", [("folder", "is a folder; name the results file"),
                                        ("missing/install.json", "is not a writable folder or file")])
def test_the_cpu_install_measurement_refuses_an_out_it_could_not_write_before_installing(capsys, monkeypatch,
                                                                                         tmp_path, where, said):
    """``benchmarks/cpu_install.py --out FOLDER`` failed in the write after its virtual environments were made and
    measured (minutes), the figures lost."""
    (tmp_path / "folder").mkdir()
    code, err = _script_exit(capsys, monkeypatch, "cpu_install.py", ["--out", str(tmp_path / where)])
    assert code == 2 and "argument --out:" in err and said in err, err
