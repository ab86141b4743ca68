"""README.md and docs/: every figure is rendered from a committed results file (a fresh rendering must equal the
text), every rendered table names the commit it was measured at and says where the code it measures has changed
since, no number is typed by hand outside rendered pieces and code, every link resolves, nothing refers to files
outside the repository, every command is invoked one way, and the README is a front page: what it is, a short code
example and a timeline picture on its first screen, the measured headline, install and the demo in its first 55
lines, the known limits near the top, at most 14,000 bytes."""

import importlib.util
import json
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _renderer():
    spec = importlib.util.spec_from_file_location("readme_tables", ROOT / "benchmarks" / "readme_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_rendered_piece_matches_its_results_file():
    stale = _renderer().process(write=False)
    assert not stale, f"re-render with `python benchmarks/readme_tables.py --write`: {stale}"


def _prose(text: str) -> str:
    """The text with rendered pieces, code blocks, inline code and link targets removed."""
    text = re.sub(r"<!-- render: .*?<!-- end render -->", "", text, flags=re.S)
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    text = re.sub(r"`[^`]*`", "", text)
    return re.sub(r"\]\([^)]*\)", "]", text)


# A measured figure: a decimal, a percentage, a speedup, a time. Version requirements (">= 3.10") are not figures.
FIGURE = re.compile(r"(?<![>=\w.])(\d+\.\d+|\d+(\.\d+)?\s?(%|x\b|ms\b|us\b|µs\b|GB/s|TFLOP))")


def test_no_figure_is_typed_by_hand():
    typed = {doc.name: FIGURE.findall(_prose(doc.read_text())) for doc in DOCS}
    typed = {name: [m[0] for m in found] for name, found in typed.items() if found}
    assert not typed, f"figures outside rendered pieces (render them from a results file): {typed}"


def test_links_resolve_and_nothing_points_outside_the_repository():
    for doc in DOCS:
        text = doc.read_text()
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
            if "://" not in target:
                assert (doc.parent / target).exists(), f"{doc.name}: broken link {target}"
        assert not re.search(r"\b(DESIGN|BENCHMARK|STYLE)\.md|\.\./shared", text), doc.name
        assert not re.search(r"\bissue \d+", text, re.I), doc.name


def test_readme_is_a_front_page():
    text = (ROOT / "README.md").read_text()
    assert len(text.encode()) <= 14_000
    lines = text.splitlines()
    # The first screen: what it is, a short code example and a timeline picture, before anything else.
    screen = "\n".join(lines[:20])
    assert screen.startswith("# flashoverlap\n")
    code = re.search(r"```python\n(.*?)```", screen, re.S)
    assert code and len(code.group(1).splitlines()) <= 6, "no short code example on the first screen"
    picture = re.search(r"!\[[^\]]+\]\((docs/images/timeline-[^)]+\.png)\)", screen)
    assert picture and (ROOT / picture.group(1)).is_file(), "no timeline picture on the first screen"
    first = "\n".join(lines[:55])
    assert "<!-- render: headline " in first and "<!-- end render -->" in first  # the measured headline, whole
    for what in ("## Install", "pip install", "## Try it", "flashoverlap demo"):
        assert what in first, what
    headings = [line for line in text.splitlines() if line.startswith("## ")]
    for heading in ("## Known limits", "## Use", "## Tests", "## Documentation"):
        assert heading in headings, heading
    assert headings.index("## Known limits") <= 3  # before the example and everything after it
    # Every other results table lives in docs/benchmarks.md; the README's test command is .ci/run's, no figure of it.
    specs = re.findall(r"<!-- render: (\S+)", text)
    assert specs == ["headline"], specs
    ci = (Path(__file__).parents[1] / ".ci" / "run").read_text()
    command = "pytest -n 2"
    assert f"\n{command}\n" in text and f"python -m {command} 2>&1" in ci  # what CI runs is what the README says
    assert not re.search(r"\d+ (passed|skipped)|\d+ min \d+ s", text)


def _shell_text(doc: Path) -> str:
    """A document without its rendered pieces (their sources quote the command that made each file, as it was)."""
    text = re.sub(r"<!-- render: .*?<!-- end render -->", "", doc.read_text(), flags=re.S)
    return re.sub(r"\s+", " ", text)


def test_every_command_is_invoked_one_way():
    """``flashoverlap demo|version`` as typed; ``bench`` and ``tune`` under ``torchrun ... -m flashoverlap``; never
    ``python -m flashoverlap.bench`` or ``python -m flashoverlap``."""
    mine = ["README.md", "docs/usage.md", "docs/migration.md", "docs/benchmarks.md", "docs/testing.md"]
    for name in mine:
        text = _shell_text(ROOT / name)
        assert "-m flashoverlap.bench" not in text and "python -m flashoverlap " not in text, name
        bare = len(re.findall(r"flashoverlap (?:bench|tune)\b", text))
        launched = len(re.findall(r"torchrun --nproc-per-node \S+ -m flashoverlap (?:bench|tune)\b", text))
        assert bare == launched, f"{name}: `flashoverlap bench|tune` without `torchrun --nproc-per-node N -m`"


BLOCK_ROW = {"mode": "train", "tokens": 64, "t_torch_eager_ms": 10.0, "t_nocomm_eager_ms": 8.0,
             "t_ours_eager_ms": 9.0, "t_torch_compiled_ms": 8.0, "t_nocomm_compiled_ms": 6.0, "t_async_tp_ms": 7.0,
             "t_ours_compiled_ms": 7.5}
META = {"gpus": "synthetic", "setting": "test", "torch": "-", "commit": "0" * 40, "command": "none"}


def _block_file(tmp_path, rows) -> str:
    path = tmp_path / "block.json"
    path.write_text(json.dumps({"meta": META, "rows": rows}))
    return str(path)


def test_the_block_table_compares_eager_with_eager_and_compiled_with_compiled(tmp_path):
    # Synthetic figures, chosen so that compiled ours against the eager baselines would read +1.25, not +0.25.
    decode = {**dict.fromkeys(BLOCK_ROW), "mode": "decode", "tokens": 4, "t_torch_eager_ms": 1.0,
              "t_nocomm_eager_ms": 0.5, "t_ours_eager_ms": 0.75}
    table = _renderer().block_table(_block_file(tmp_path, [BLOCK_ROW, decode]))
    lines = [line for line in table.splitlines() if line.startswith("| ")]
    assert "PyTorch TP (ms)" in lines[0] and "**ours** (ms)" in lines[0]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    assert [c[:3] for c in cells] == [["train", "64", "eager"], ["train", "64", "compiled"], ["decode", "4", "eager"]]
    eager, compiled, decode_line = cells
    assert eager[3:] == ["10.000", "8.000", "-", "**9.000**", "+0.50", "-"]
    assert compiled[3:] == ["8.000", "6.000", "7.000", "**7.500**", "+0.25", "+0.50"]
    assert decode_line[-2:] == ["+0.50", "-"]
    for term in ("`PyTorch TP`", "`no communication`", "`async TP`", "`E_block`", "eager against eager"):
        assert term in table, term


def test_a_block_file_from_before_the_split_baselines_is_refused(tmp_path):
    old = {"mode": "train", "tokens": 64, "t_torch_ms": 10.0, "t_nocomm_ms": 8.0, "t_async_tp_ms": 7.0,
           "t_ours_eager_ms": 9.0, "t_ours_compiled_ms": 7.5}
    with pytest.raises(ValueError, match="measure it again"):
        _renderer().block_table(_block_file(tmp_path, [old]))


@pytest.mark.parametrize("renderer,path,terms", [
    ("ops_table", "benchmarks/results/h200x2-nvlink.json",
     ["`T_seq`", "`best decomp.`", "`async TP`", "**ours** (`T`)", "`speedup`", "`E`", "`E async TP`", "`host µs`"]),
    ("paths_table", "benchmarks/results/h200x2-nvlink.json",
     ["`T_gemm`", "`T_comm`", "`T_seq`", "`T`", "`E`", "`host µs`"]),
])
def test_every_table_gives_units_and_defines_its_columns_under_it(renderer, path, terms):
    table = getattr(_renderer(), renderer)(path)
    header = table.splitlines()[0]
    assert header.count("(ms") >= 3 and "µs" in header
    legend = next(line for line in table.splitlines() if line.startswith("<sub>") and "Source" not in line)
    missing = [term for term in terms if term not in legend]
    assert not missing, f"{renderer}: not defined under the table: {missing}"


def _table(text: str) -> list[list[str]]:
    """The cells of a rendered table's body rows."""
    rows = [line for line in text.splitlines() if line.startswith("| ")][2:]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]


def _results(tmp_path, name, meta, rows) -> str:
    path = tmp_path / name
    path.write_text(json.dumps({"meta": meta, "rows": rows}))
    return str(path)


def test_one_gpu_host_time_gives_ratios_to_torch_mm_and_differences_to_the_direct_call(tmp_path):
    rows = [{"op": "all_reduce", "path": "p2p", "mode": "eager", "M": 8, "N": 16, "K": 32, "host_us": 300.0,
             "torch_mm_us": 100.0, "direct_us": None, "extra": 1},  # keys the renderer does not know are left
            {"op": "all_reduce", "path": "nccl", "mode": "sequential", "M": 8, "N": 16, "K": 32, "host_us": 150.0,
             "torch_mm_us": 50.0, "direct_us": 120.0}]
    meta = {"gpus": "synthetic", "torch": "-", "commit": "0" * 40, "command": "none", "date": "2000-01-01"}
    table = _renderer().host_one_gpu(_results(tmp_path, "host.json", meta, rows))
    assert [row[4:] for row in _table(table)] == [["300", "100", "-", "3.0x", "-"], ["150", "50", "120", "-", "+30"]]
    assert "(µs)" in table.splitlines()[0]
    for term in ("two processes sharing one GPU", "`torch.mm` alone", "`direct`", "Source", "none"):
        assert term in table, term


def test_one_gpu_host_time_shows_the_paired_figures_where_the_file_has_them(tmp_path):
    rows = [{"op": "all_reduce", "path": "p2p", "mode": "eager", "M": 8, "N": 16, "K": 32, "host_us": 300.0,
             "torch_mm_us": 100.0, "direct_us": None, "paired_ratio": 2.46},
            {"op": "all_reduce", "path": "nccl", "mode": "sequential", "M": 8, "N": 16, "K": 32, "host_us": 150.0,
             "torch_mm_us": 50.0, "direct_us": 120.0, "paired_extra_us": 21.4}]
    meta = {"gpus": "synthetic", "torch": "-", "commit": "0" * 40, "command": "none", "date": "2000-01-01"}
    table = _renderer().host_one_gpu(_results(tmp_path, "host.json", meta, rows))
    assert [row[7:] for row in _table(table)] == [["3.0x", "-", "2.5x"], ["-", "+30", "+21"]]
    assert "paired" in table.splitlines()[0] and "same round" in table


def test_the_grouped_gemm_table_compares_the_chosen_path_with_grouped_mm(tmp_path):
    row = {"config": "toy", "routing": "zipf", "proj": "up", "path": "triton", "experts": 4, "rows": 64,
           "t_ms": 2.0, "t_grouped_mm_ms": 2.5, "t_loop_ms": 3.0, "t_triton_ms": 1.5, "tile": {"block_m": 64}}
    meta = {"gpu": "synthetic", "world_size_sliced": 2, "torch": "-", "commit": "0" * 40, "command": "none"}
    rows = [row, {**row, "t_loop_ms": None, "t_triton_ms": None}]
    table = _renderer().moe_gemm(_results(tmp_path, "gemm.json", meta, rows))
    assert _table(table) == [["toy", "zipf", "up", "4", "64", "**2.000** (triton)", "2.500", "3.000", "1.25x", "1.500"],
                             ["toy", "zipf", "up", "4", "64", "**2.000** (triton)", "2.500", "-", "1.25x", "-"]]
    assert "at W = 2" in table and "above 1: ours is faster" in table


def test_the_tile_sweep_table_names_the_fastest_tile_and_how_many_share_an_sm(tmp_path):
    tiles = {"current": {"tile": [128, 128, 8, 3, 8, 0, 1], "t_ms": 2.0, "ok": True},
             "64x128-s4-w4-2sm": {"tile": [64, 128, 8, 4, 4, 0, 2], "t_ms": 1.0, "ok": True},
             "128x128-s3-tiles": {"tile": [128, 128, 8, 3, 8, None, 1], "t_ms": 1.5, "ok": True}}
    rows = [{"config": "toy", "scaling": "block", "experts": 4, "rows": 64, "K": 256, "N": 128,
             "t_bf16_grouped_mm_ms": 1.5, "tiles": tiles, "best": "64x128-s4-w4-2sm", "t_best_ms": 1.0,
             "bf16_over_best": 1.5, "bf16_over_current": 0.75},
            {"config": "toy", "scaling": "row", "skipped": "K"}]
    meta = {"gpus": "synthetic", "torch": "-", "commit": "0" * 40, "command": "none", "date": "2000-01-01",
            "facts": {"block": {"64x128-s4-w4-2sm": {"programs_per_sm_fit": 2}}}}
    table = _table(_renderer().fp8_tiles(_results(tmp_path, "tiles.json", meta, rows)))
    assert table[0][3:] == ["1.500", "128x128-s3: 2.000", "64x128-s4-w4-2sm", "1.000", "2 (fit 2)", "1.50x", "0.75x"]
    assert table[1][3].startswith("not run: K")


def test_the_python_cost_table_puts_before_beside_after(tmp_path):
    rows = [{"op": "all_reduce", "part": "runtime", "mode": "before", "us_per_call": 10.0},
            {"op": "all_reduce", "part": "p2p-executor", "mode": "before", "us_per_call": 40.0,
             "driver_and_stream_calls": 63},
            {"op": "all_reduce", "part": "runtime", "mode": "after", "us_per_call": 5.0},
            {"op": "all_reduce", "part": "p2p-executor", "mode": "after", "us_per_call": 30.0,
             "driver_and_stream_calls": 20}]
    meta = {"shape": [8, 16, 32], "world_size_p2p": 2, "runs": {
        "before": {"commit": "aaaa", "command": "PYTHONPATH=old python benchmarks/host_python.py --label before"},
        "after": {"commit": "bbbb", "command": "python benchmarks/host_python.py --label after"}}}
    renderer = _renderer()
    table = renderer.cpu_host_python(_results(tmp_path, "cpu.json", meta, rows))
    assert "before (µs per call) | after (µs per call) | after / before" in table.splitlines()[0]
    assert _table(table) == [["gemm_all_reduce", "runtime", "10.0", "5.0", "0.50x", "- / -"],
                             ["gemm_all_reduce", "p2p-executor", "40.0", "30.0", "0.75x", "63 / 20"]]
    assert "commit `aaaa`" in table and "commit `bbbb`" in table and "8x16x32" in table
    alone = renderer.cpu_host_python(_results(tmp_path, "one.json", meta, rows[:2]))  # one label: no ratio
    assert "/ before" not in alone and _table(alone)[0] == ["gemm_all_reduce", "runtime", "10.0", "-"]


def test_moe_layer_files_are_rendered_where_there_are_some(tmp_path):
    renderer = _renderer()
    assert renderer.moe_layer(str(tmp_path / "*-moe.json")).startswith("Not measured yet")
    base = {"config": "toy", "W": 2, "tokens": 64, "routing": "zipf", "pass": "forward", "t_plain_ms": 10.0,
            "t_nocomm_ms": 6.0, "host_plain_us": 100.0}
    rows = [{**base, "mode": "exact", "path": "nccl", "t_ms": 9.0, "E": 0.25, "host_us": 300.0},
            {**base, "mode": "bounded", "path": "p2p", "t_ms": 7.0, "E": 0.75, "host_us": 200.0},
            {"config": "toy", "W": 2, "tokens": 64, "routing": "zipf", "path": "p2p", "pass": "forward",
             "notes": "skipped: no NVLink"}]
    meta = {"gpus": "synthetic", "setting": "test", "torch": "-", "commit": "0" * 40, "command": "none"}
    _results(tmp_path, "x2-test-moe.json", meta, rows)
    text = renderer.moe_layer(str(tmp_path / "*-moe.json"))
    assert _table(text) == [["toy", "64", "zipf", "forward", "10.000", "6.000", "**7.000** (bounded, p2p)", "+0.75",
                             "100 / 200"]]


def _git(repo: Path, *argv: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *argv], capture_output=True, text=True, check=True).stdout.strip()


def test_changed_since_asks_git_about_the_paths_measured(tmp_path):
    repo = tmp_path / "repo"
    (repo / "lib").mkdir(parents=True)
    (repo / "other").mkdir()
    _git(repo, "init", "-q")
    for path, text in (("lib/a.py", "1"), ("other/b.py", "1")):
        (repo / path).write_text(text)
    _git(repo, "add", ".")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "measured")
    measured = _git(repo, "rev-parse", "HEAD")
    (repo / "lib" / "a.py").write_text("2")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "changed")
    changed_since = _renderer().changed_since
    assert changed_since(measured, ("lib",), repo) is True
    assert changed_since(measured, ("other",), repo) is False
    assert changed_since(measured[:10] + "-dirty", ("other",), repo) is False  # the commit a dirty tree was based on
    assert changed_since(_git(repo, "rev-parse", "HEAD"), ("lib",), repo) is False
    assert changed_since("0" * 40, ("lib",), repo) is None  # not in this repository (a shallow clone)
    assert changed_since(measured, ("lib",), tmp_path) is None  # no repository


def test_every_rendered_table_says_its_commit_and_whether_the_code_changed_since(monkeypatch):
    renderer = _renderer()
    specs = {m for doc in DOCS for m in re.findall(r"<!-- render: ([^>]*?) -->", doc.read_text())}
    tables = 0
    for changed in (True, False):
        monkeypatch.setattr(renderer, "changed_since", lambda commit, paths, repo=None, changed=changed: changed)
        for spec in specs:
            text = renderer.render(spec)
            if "| --- " not in text:
                continue  # a range in a sentence, or no file yet
            tables += changed
            assert "commit `" in text, spec
            noted = re.search(r"changed since\*\*|code changed since \|", text) is not None  # not the legends
            assert noted == changed, (spec, changed)
    assert tables >= 10
    monkeypatch.setattr(renderer, "changed_since", lambda commit, paths, repo=None: True)
    table = renderer.render("ops benchmarks/results/h200x2-nvlink.json")
    assert ("commit `0198a8bbc0`; **the code it measures has changed since** (`git diff 0198a8bbc0 HEAD -- "
            "src/flashoverlap`)") in table
    assert "tools/mutate.py`" in renderer.render("mutations benchmarks/results/mutations.json")
    assert "-- pyproject.toml`" in renderer.render("cpu-install benchmarks/results/cpu-install.json")


def test_a_note_git_cannot_confirm_is_accepted_with_or_without_it(monkeypatch):
    renderer = _renderer()
    monkeypatch.setattr(renderer, "changed_since", lambda commit, paths, repo=None: None)
    fresh = renderer.render("ops benchmarks/results/h200x2-nvlink.json")
    assert renderer.UNSURE in fresh
    with_note = fresh.replace(renderer.UNSURE, "")
    without = re.sub(f"{renderer.UNSURE}.*?{renderer.UNSURE}", "", fresh)
    assert "changed since" in with_note and "changed since" not in without
    assert renderer.agrees(with_note, fresh) and renderer.agrees(without, fresh)
    assert not renderer.agrees(without.replace("1.16x", "1.17x"), fresh)
    assert renderer.agrees(without, without) and not renderer.agrees(with_note, without)


def test_the_headline_gives_each_ops_worst_and_best_speedup_and_the_commit(tmp_path, monkeypatch):
    renderer = _renderer()
    monkeypatch.setattr(renderer, "changed_since", lambda commit, paths, repo=None: commit.startswith("a"))
    base = {"op": "all_reduce", "path": "nccl", "K": 8, "baselines": {}}
    rows = [{**base, "M": 8, "N": 16, "t_seq_ms": 2.0, "auto": {"t_ms": 1.0, "E": 1.0, "path": "p2p", "host_us": 1}},
            {**base, "M": 8, "N": 16, "path": "p2p", "t_seq_ms": 2.0, "t_ms": 0.1},  # the same shape: left out
            {**base, "M": 32, "N": 16, "t_seq_ms": 3.0, "auto": {"t_ms": 2.5, "E": 0.5, "path": "p2p", "host_us": 1}},
            {**base, "op": "all_gather", "M": 8, "N": 16, "t_seq_ms": 1.0, "t_ms": 1.25, "E": -0.5},  # old format
            ]
    meta = {"gpus": "2x synthetic", "setting": "fast", "torch": "-", "command": "bench"}
    one = _results(tmp_path, "one.json", {**meta, "commit": "a" * 40}, rows)
    two = _results(tmp_path, "two.json", {**meta, "setting": "slow", "commit": "b" * 40}, rows[:1])
    table = renderer.headline(one, two)
    assert _table(table) == [
        ["gemm_all_reduce", "2x synthetic, fast", "2", "1.20x (32, 16, 8)", "2.00x (8, 16, 8)",
         "`aaaaaaaaaa`, code changed since"],
        ["gemm_all_reduce", "2x synthetic, slow", "1", "2.00x (8, 16, 8)", "2.00x (8, 16, 8)", "`bbbbbbbbbb`"],
        ["all_gather_gemm", "2x synthetic, fast", "1", "0.80x (8, 16, 8)", "0.80x (8, 16, 8)",
         "`aaaaaaaaaa`, code changed since"]]
    for term in ("`T_seq / T`", "`path=\"auto\"`", "`nvlink`", "`pcie-like`", "Code changed since", "Sources"):
        assert term in table, term


def test_the_gpu_tests_take_one_lock_in_turn(tmp_path):
    """Under the README's two workers the tests that use GPUs (tests/gpu, and those marked ``gpu`` elsewhere) run one
    at a time: each holds ``conftest.GPU_LOCK`` (here a lock file of the test's own) while it runs, and another
    process cannot take it meanwhile; no other test takes it."""
    import subprocess
    import sys
    import types

    from tests import conftest

    def item(nodeid: str, gpu: bool = False):
        return types.SimpleNamespace(nodeid=nodeid, path=Path(__file__).parents[1] / nodeid.split("::")[0],
                                     get_closest_marker=lambda name: object() if gpu and name == "gpu" else None)

    items = [item("tests/gpu/test_gpu_all_reduce.py::test_x"), item("tests/test_plan.py::test_y"),
             item("tests/kernels/test_gpu_like.py::test_w"), item("tests/kernels/test_grouped_gemm.py::t", gpu=True)]
    assert [conftest.uses_gpu(it) for it in items] == [True, False, False, True]
    lock = tmp_path / "gpu.lock"
    probe = ("import fcntl, sys\nwith open(sys.argv[1], 'a') as f:\n    try:\n"
             "        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)\n    except BlockingIOError:\n"
             "        sys.exit(3)\n")

    def other_process_takes_it() -> bool:
        code = subprocess.run([sys.executable, "-c", probe, str(lock)], timeout=60).returncode
        assert code in (0, 3), code
        return code == 0

    with conftest.one_gpu_test_at_a_time(lock):
        assert not other_process_takes_it()
    assert other_process_takes_it()
