"""``benchmarks/readme_tables.py``'s command line: ``--help`` exited 1, a misspelt document was a
FileNotFoundError traceback, and a file without render markers was "checked" and exited 0 having checked nothing."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def readme_tables():
    spec = importlib.util.spec_from_file_location("readme_tables_cli", ROOT / "benchmarks" / "readme_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_help_prints_the_usage_and_exits_0(flag, readme_tables, capsys):
    assert readme_tables.main([flag]) == 0
    assert "--write|--check [DOC ...]" in capsys.readouterr().out


@pytest.mark.parametrize("argv,said", [
    (["--check", "docs/nonexist.md"], "--check docs/nonexist.md: no such file"),
    (["--write", "docs"], "--write docs: no such file"),
    (["--check", "src/flashoverlap/__init__.py"], "src/flashoverlap/__init__.py: holds no rendered piece"),
    (["--write", "README.md", "pyproject.toml"], "pyproject.toml: holds no rendered piece"),  # before any write
    ([], "usage:"), (["--chek"], "usage:")])
def test_a_document_that_is_missing_or_renders_nothing_is_a_usage_error(argv, said, readme_tables, capsys,
                                                                        monkeypatch):
    monkeypatch.setattr(readme_tables, "process", lambda **kw: pytest.fail(f"processed {kw}"))
    assert readme_tables.main(argv) == 2
    assert said in capsys.readouterr().err


def test_a_host_bound_table_of_two_runs_at_one_commit_names_each_run_and_divides_by_its_own_matmul(readme_tables,
                                                                                                  tmp_path):
    # Rows of two runs of one commit: each row over its own run's matmul (keyed by commit alone, the second run's
    # matmul replaced the first's), the runs named in a column and in the source line.
    def row(run, path, host):
        return {"shape": "o", "op": "reduce_scatter", "M": 8, "N": 8, "K": 8, "dtype": "bfloat16", "path": path,
                "mode": "eager", "host_us": host, "gpu_us": 100.0, "wall_us": 100.0, "commit": "abc", "run": run}

    sources = [{"run": run, "commit": "abc", "command": "python -m benchmarks.host_bound OUT", "date": date}
               for run, date in (("1", "2026-12-06T14:00:02Z"), ("2", "2026-12-06T14:10:48Z"))]
    results = tmp_path / "host-bound.json"
    results.write_text(json.dumps({
        "meta": {"gpus": "1x GPU", "commit": "abc", "command": "c", "date": "2026-12-06", "sources": sources},
        "rows": [row("1", "mm", 10.0), row("1", "nccl", 100.0), row("2", "mm", 20.0), row("2", "nccl", 100.0)]}))
    table = readme_tables.host_bound(str(results))
    assert "| dtype | run | path |" in table
    assert "| 1 | nccl | eager | 100 | 100 | 100 | 1.00 | 10.0x |" in table
    assert "| 2 | nccl | eager | 100 | 100 | 100 | 1.00 | 5.0x |" in table
    assert "each row naming its run): run 1 (2026-12-06T14:00), commit `abc`" in table


def test_an_fp8_moe_host_table_of_several_runs_names_each_rows_run(readme_tables, tmp_path):
    def row(dtype, host, ratio, run=None):
        named = {} if run is None else {"run": run, "commit": "abc"}
        return {"config": "mixtral", "mode": "exact", "dtype": dtype, "host_us": host, "t_gpu_ms": 2.0,
                "ratio_to_bf16": ratio, **named}

    sources = [{"run": run, "commit": "abc", "command": "python -m benchmarks.diagnostics.fp8_moe_host", "date": date}
               for run, date in (("1", "2026-12-07T04:35:33Z"), ("2", "2026-12-07T04:42:16Z"))]
    results = tmp_path / "fp8-moe-host.json"
    results.write_text(json.dumps({
        "meta": {"gpus": "GPU", "commit": "abc", "command": "c", "date": "2026-12-07", "sources": sources},
        "rows": [row("bf16", 800.0, 1.0, "1"), row("fp8-block", 960.0, 1.2, "1"), row("bf16", 700.0, 1.0, "2"),
                 row("fp8-block", 770.0, 1.1, "2")]}))
    table = readme_tables.fp8_moe_host(str(results))
    assert "| config | mode | run | dtype | host (µs) |" in table
    assert "| mixtral | exact | 1 | fp8-block | 960 | 2.00 | 1.20x |" in table
    assert "| mixtral | exact | 2 | fp8-block | 770 | 2.00 | 1.10x |" in table
    assert "each row naming its run): run 1 (2026-12-07T04:35), commit `abc`" in table
    # one run: no run column
    results.write_text(json.dumps({"meta": {"gpus": "GPU", "commit": "abc", "command": "c"},
                                   "rows": [row("bf16", 800.0, 1.0)]}))
    assert "| mixtral | exact | bf16 | 800 | 2.00 | 1.00x |" in readme_tables.fp8_moe_host(str(results))


def test_a_soak_table_of_rows_from_several_commits_names_each_rows_commit(readme_tables, tmp_path):
    def row(world, commit):
        return {"W": world, "commit": commit, "calls": 10000, "wrong": 0, "errors": 0, "hangs": 0,
                "memory_mib": [100.0, 100.0], "flat": True, "ms_per_call": 3.0, "replays": 10, "stopped": None}

    meta = {"gpus": "1x GPU", "commit": "bbb", "command": "c", "date": "2026-12-06"}
    results = tmp_path / "soak.json"
    results.write_text(json.dumps({"meta": meta, "rows": [row(2, "aaa"), row(8, "bbb")]}))
    assert "| 2 | aaa | 10000 | 0 |" in readme_tables.soak(str(results))
    results.write_text(json.dumps({"meta": meta, "rows": [row(2, "bbb"), row(8, "bbb")]}))
    assert "| W | calls |" in readme_tables.soak(str(results))  # one commit: the source line names it
    # runs that read their checks every 8 and every 32 bursts: a column says which
    results.write_text(json.dumps({"meta": meta, "rows": [{**row(8, "bbb"), "read_every": 8, "run": "1"},
                                                          {**row(8, "bbb"), "read_every": 32, "run": "2"}]}))
    table = readme_tables.soak(str(results))
    assert "| W | run | read every (bursts) | calls |" in table and "| 8 | 2 | 32 | 10000 | 0 |" in table
    # one row recording a read_every and the others none: no column (one value is no comparison)
    results.write_text(json.dumps({"meta": meta, "rows": [row(2, "bbb"), {**row(8, "bbb"), "read_every": 8}]}))
    assert "| W | calls |" in readme_tables.soak(str(results))


def test_an_fp8_grouped_row_names_the_kernel_it_ran_where_the_file_records_it(readme_tables, tmp_path):
    def row(kernel):
        found = {"config": "c", "set": "fit", "routing": "balanced", "scaling": "block", "experts": 4, "rows": 8,
                 "K": 256, "N": 128, "t_ours_ms": 1.0, "t_scaled_grouped_mm_ms": None, "t_loop_ms": 2.0,
                 "t_bf16_grouped_mm_ms": 1.5, "chosen": "ours"}
        return found if kernel is None else {**found, "kernel": kernel}

    results = tmp_path / "fp8-grouped.json"
    meta = {"gpus": "NVIDIA H100", "commit": "abc", "command": "c", "date": "2026-12-06"}
    results.write_text(json.dumps({"meta": meta, "rows": [row("gluon"), row("triton"), row(None)]}))
    lines = readme_tables.fp8_grouped(str(results)).splitlines()
    assert [line.split("|")[6].strip() for line in lines[2:5]] == ["1.000 (Gluon)", "1.000 (Triton)", "1.000"]


def test_a_check_that_finds_everything_rendered_says_so(readme_tables, capsys):
    """``--check`` exited 0 with no output where everything agreed: now a one-line verdict (a stale piece: exit 1)."""
    assert readme_tables.main(["--check", "docs/testing.md"]) == 0
    assert "every rendered piece of docs/testing.md matches its results file" in capsys.readouterr().out
