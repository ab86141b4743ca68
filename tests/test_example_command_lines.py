"""The examples' command lines on a machine that cannot run them: ``examples/shared_gpu.py --help`` (and a
misspelt option) answered "needs a CUDA GPU", and ``examples/hf_tp_plan.py`` started without torchrun printed
torchao's library-load failures (imported through transformers and flashoverlap.nn) before its one-line refusal."""

import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


@pytest.mark.parametrize("argv,code,said", [(["--help"], 0, "usage: shared_gpu.py"),
                                            (["--wrld", "4"], 2, "unrecognized arguments: --wrld"),
                                            (["--world", "9"], 2, "argument --world: invalid choice: 9"),
                                            ([], "needs a CUDA GPU", "")])
def test_shared_gpu_reads_its_command_line_before_looking_for_the_gpu(argv, code, said, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["examples/shared_gpu.py", *argv])
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(str(EXAMPLES / "shared_gpu.py"), run_name="__main__")
    out, err = capsys.readouterr()
    if isinstance(code, str):
        assert code in stop.value.code
    else:
        assert stop.value.code == code and said in out + err and "needs a CUDA GPU" not in out + err, (out, err)


def test_hf_tp_plan_without_torchrun_says_so_in_one_line_and_nothing_else():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    proc = subprocess.run([sys.executable, "examples/hf_tp_plan.py"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 1
    assert proc.stdout == "" and proc.stderr == \
        "start it under torchrun: torchrun --nproc-per-node 2 examples/hf_tp_plan.py\n", proc.stderr


@pytest.mark.parametrize("argv,said", [(["--steps", "0"], "argument --steps: expected an integer >= 1"),
                                       (["--tokens=-8"], "argument --tokens: expected an integer >= 1"),
                                       (["--layers", "1_0"], "argument --layers: expected an integer >= 1"),
                                       (["--warmup=-1"], "argument --warmup: expected an integer >= 0")])
def test_hf_llama_tp_refuses_counts_it_cannot_time_before_looking_for_the_gpus(argv, said, monkeypatch, capsys):
    """``--steps 0`` (or a negative size) passed ``type=int``: on GPUs every variant was built and its timing
    failed, each printed as skipped, and the script exited 0 having timed nothing."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["examples/hf_llama_tp.py", *argv])
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(str(EXAMPLES / "hf_llama_tp.py"), run_name="__main__")
    assert stop.value.code == 2 and said in capsys.readouterr().err


def test_hf_llama_tp_refuses_more_ranks_on_a_node_than_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(sys, "argv", ["examples/hf_llama_tp.py"])
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(str(EXAMPLES / "hf_llama_tp.py"), run_name="__main__")
    assert stop.value.code == ("examples/hf_llama_tp.py: 2 ranks on this node but 1 CUDA GPU: one per rank; use "
                               "torchrun --nproc-per-node 1 or fewer")


def test_hf_llama_tp_refuses_an_out_it_could_not_write_before_looking_for_the_gpus(monkeypatch, tmp_path, capsys):
    """Rank 0 writes --out after every variant has been timed: a directory given there failed only then."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["examples/hf_llama_tp.py", "--out", str(tmp_path)])
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(str(EXAMPLES / "hf_llama_tp.py"), run_name="__main__")
    assert stop.value.code == 2 and f"--out {tmp_path}: is a directory" in capsys.readouterr().err


def _rows(**ms):
    return [{"mode": mode, "tokens": 8, "variant": variant, "ms": value, "tokens_per_s": None}
            for variant, value in ms.items() for mode in ("prefill", "train")]


@pytest.mark.parametrize("ms,code,said", [
    ({"ours_eager": 1.0, "torch_eager": 2.0}, 0, None),
    ({"ours_eager": 1.0, "async_tp": None}, 0, "no figure for async_tp (the reasons above)\n"),
    ({"ours_eager": None, "torch_eager": 2.0}, 1, "no figure for ours_eager (the reasons above); failing, since "
                                                  "ours_eager is this library's\n"),
    ({"torch_styles_our_pass": None, "async_tp": None, "torch_eager": 2.0}, 1,
     "no figure for torch_styles_our_pass, async_tp"),
    ({"ours_eager": None, "torch_styles_our_pass": None, "torch_eager": 2.0}, 1,
     "failing, since ours_eager, torch_styles_our_pass are this library's\n"),
    ({"torch_eager": None, "async_tp": None}, 1, "failing, since no variant ran"),
])
def test_hf_llama_tp_fails_where_the_librarys_variants_or_all_of_them_timed_nothing(ms, code, said, capsys):
    """It printed "skipped (...)" for every variant and exited 0 (the eighteenth session's note)."""
    example = runpy.run_path(str(EXAMPLES / "hf_llama_tp.py"))
    assert example["exit_status"](_rows(**ms)) == code
    err = capsys.readouterr().err
    assert (err == "") if said is None else (said in err), err


@pytest.mark.parametrize("name", ["ops", "layers", "styles", "moe", "fp8_moe", "compile_pass", "hf_tp_plan"])
def test_the_examples_that_take_no_options_refuse_one(name, monkeypatch):
    """``torchrun ... examples/ops.py --world 4`` ran the example at the launcher's size and exited 0 (the audit's
    note): an example that takes no arguments says so, before anything starts."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(sys, "argv", [f"examples/{name}.py", "--world", "4"])
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(str(EXAMPLES / f"{name}.py"), run_name="__main__")
    assert stop.value.code == f"{EXAMPLES / name}.py takes no arguments, got: --world 4"  # runpy's argv[0]: the path
