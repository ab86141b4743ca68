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
