"""``benchmarks/diagnostics/grouped_gemm_fit.py --refit``: a dry run's results file (toy shapes timed on the CPU)
rewrote the package's ``tune/grouped_costs.py`` with its figures."""

import json
import sys

import pytest

import flashoverlap.tune
from benchmarks.diagnostics import grouped_gemm_fit


@pytest.mark.parametrize("meta", [{"gpus": "cpu (dry run)", "partial": True}, {"gpus": "x", "dry_run": True}])
@pytest.mark.parametrize("costs", [None, "package"])
def test_a_dry_run_file_is_not_refitted_into_the_package(meta, costs, tmp_path, monkeypatch, capsys):
    package = tmp_path / "tune"  # the package's tune folder, here (the real one is never at risk)
    package.mkdir()
    (package / "grouped_costs.py").write_text("COSTS = {}\n")
    monkeypatch.setattr(flashoverlap.tune, "__file__", str(package / "__init__.py"))
    results = tmp_path / "dry.json"
    results.write_text(json.dumps({"meta": meta, "rows": []}))
    argv = [str(tmp_path / "out.json"), "--refit", str(results)]
    if costs:
        argv += ["--costs", str(package / ".." / "tune" / "grouped_costs.py")]
    monkeypatch.setattr(sys, "argv", ["grouped_gemm_fit", *argv])
    with pytest.raises(SystemExit) as exit_info:
        grouped_gemm_fit.main()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"--refit {results} holds a dry run's rows" in err and "--costs PATH" in err, err
    assert (package / "grouped_costs.py").read_text() == "COSTS = {}\n"
    assert not (tmp_path / "out.json").exists()


def test_a_gpu_file_is_not_taken_for_a_dry_run():
    assert not grouped_gemm_fit._dry_run({"gpus": "NVIDIA H200", "commit": "abc"})
    assert grouped_gemm_fit._dry_run({"gpus": "cpu (dry run)"}) and grouped_gemm_fit._dry_run({"dry_run": True})


@pytest.mark.parametrize("module", ["grouped_gemm_fit", "grouped_gemm_validate"])
@pytest.mark.parametrize("argv,said", [(["FOLDER", "--dry-run"], "argument out: FOLDER is a folder; name the file"),
                                       (["FOLDER/no/x.json", "--dry-run"], "is not a folder (create it first)"),
                                       (["x.json", "--dry-run", "--iters", "0"], "argument --iters: expected a "
                                                                                 "positive integer"),
                                       (["x.json", "--dry-run", "--warmup=-1"], "argument --warmup: expected an "
                                                                                "integer >= 0")])
def test_a_results_path_or_count_it_could_not_use_is_refused_before_measuring(module, argv, said, tmp_path,
                                                                              monkeypatch, capsys):
    """The results file is opened after the first sample (a folder, or a file in a missing folder: a traceback,
    seconds on the CPU, minutes on a GPU); ``--iters 0`` ended in the median of nothing."""
    import importlib

    main = importlib.import_module(f"benchmarks.diagnostics.{module}").main
    monkeypatch.chdir(tmp_path)
    argv = [arg.replace("FOLDER", str(tmp_path)) for arg in argv]
    monkeypatch.setattr(sys, "argv", [module, *argv])
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == 2 and said.replace("FOLDER", str(tmp_path)) in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize("argv,said", [(["x.json", "--refit", "missing.json"], "argument --refit: missing.json: no "
                                                                               "such file"),
                                       (["x.json", "--refit", "rows.json", "--costs", "."], "argument --costs: . is "
                                                                                             "a folder")])
def test_the_fit_refuses_a_refit_file_that_is_not_there_or_costs_it_could_not_write(argv, said, tmp_path,
                                                                                    monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rows.json").write_text(json.dumps({"meta": {"gpus": "x"}, "rows": []}))
    monkeypatch.setattr(sys, "argv", ["grouped_gemm_fit", *argv])
    with pytest.raises(SystemExit) as exit_info:
        grouped_gemm_fit.main()
    assert exit_info.value.code == 2 and said in capsys.readouterr().err
