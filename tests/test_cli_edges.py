"""The command line's edges, on a CPU machine (one gloo rank, stand-ins for what needs GPUs): ``tune`` refuses in
one line before measuring where its result could not be stored or a curve it reads is missing; ``tune plan``
defaults to the ops' ``path="auto"`` and says which file and calls it tuned for; ``bench ops`` runs untuned,
without multicast, records the library's variables and checks its shapes against the ranks up front; ``demo``
refuses torchrun and names the default shape it refuses."""

import argparse

import pytest
import torch
import torch.distributed as dist

from flashoverlap import cli, settings
from flashoverlap.tune import tuner
from flashoverlap.tune.model import Curve

GPU = "NVIDIA H100 80GB HBM3"
CPU = torch.device("cpu")


@pytest.fixture
def one_rank(tmp_path, monkeypatch):
    """One gloo rank, a fresh plan cache, and every measurement a failure (nothing may be measured here)."""
    monkeypatch.setenv("FLASHOVERLAP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("FLASHOVERLAP_NO_CACHE", raising=False)
    monkeypatch.delenv("NCCL_P2P_DISABLE", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: GPU)
    for name in ("measure_curve", "measure_slowdowns", "measure_machine", "tune_bandwidth", "tune_plan"):
        monkeypatch.setattr(tuner, name, lambda *a, name=name, **kw: pytest.fail(f"{name} ran"))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def _args(*argv: str) -> argparse.Namespace:
    return cli.parser().parse_args(["tune", *argv])


BANDWIDTH = ("bandwidth",)
PLAN = ("plan", "--op", "all_reduce", "--shape", "8192,8192,8192")


@pytest.mark.parametrize("argv", [BANDWIDTH, PLAN])
def test_tune_refuses_with_the_cache_off_before_measuring(one_rank, monkeypatch, argv):
    monkeypatch.setenv("FLASHOVERLAP_NO_CACHE", "1")
    with pytest.raises(SystemExit) as stop:
        cli._tune(_args(*argv), CPU)
    assert stop.value.code == f"flashoverlap tune {argv[0]}: tune needs the cache: unset FLASHOVERLAP_NO_CACHE"


@pytest.mark.parametrize("argv", [BANDWIDTH, PLAN])
def test_tune_refuses_a_cache_directory_it_cannot_write_before_measuring(one_rank, tmp_path, monkeypatch, argv):
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("FLASHOVERLAP_CACHE_DIR", str(tmp_path / "a-file"))
    with pytest.raises(SystemExit, match=f"flashoverlap tune {argv[0]}: the plan cache directory .* cannot be "
                                         "written"):
        cli._tune(_args(*argv), CPU)


def test_tune_plan_refuses_a_missing_curve_before_measuring_naming_its_command(one_rank, monkeypatch):
    monkeypatch.setattr(cli, "tune_paths", lambda path, target: ["nccl", "p2p"])  # one NVLink node: P2P applies
    target = cli.tune_target("bfloat16", CPU)
    tuner.store_curve(target.key("all_reduce", "nccl"), Curve((65536, 131072), (0.01, 0.02)))  # `tune bandwidth`
    with pytest.raises(SystemExit) as stop:
        cli._tune(_args(*PLAN), CPU)
    assert stop.value.code.startswith("flashoverlap tune plan: no bandwidth curve of all_reduce on path p2p") and \
        "`torchrun --nproc-per-node 1 -m flashoverlap tune bandwidth --path p2p --dtype bfloat16 --ops all_reduce`" \
        in stop.value.code and "--path nccl" not in stop.value.code, stop.value.code


def test_tune_plan_tunes_for_the_ops_default_path_and_says_where_and_for_which_calls(one_rank, monkeypatch, capsys):
    import flashoverlap as fo

    args = _args("plan", "--op", "gemm_reduce_scatter", "--shape", "8192,8192,8192")
    assert (args.path, args.op) == ("auto", "reduce_scatter")  # the ops' default path; API names as the demo's
    monkeypatch.setattr(cli, "tune_paths", lambda path, target: ["nccl"])
    target = cli.tune_target("bfloat16", CPU)
    tuner.store_curve(target.key("reduce_scatter", "nccl"), Curve((65536, 131072), (0.01, 0.02)))
    searched = {}

    def search(op, shape, target, path):
        searched.update(op=op, path=path)
        return tuner.Search(target.key(op, path), [], {}, {})

    winner = fo.default_plan("reduce_scatter", 8192, 8192, 8192, 1, num_sms=132)
    monkeypatch.setattr(cli, "tune_search", search)
    monkeypatch.setattr(tuner, "tune_plan", lambda *a, **kw: (winner, []))
    assert cli._tune(args, CPU) == 0
    out = capsys.readouterr().out
    file = tuner.cache.cache_file(target.key("reduce_scatter", "auto"))
    assert searched == {"op": "reduce_scatter", "path": "auto"}
    assert f"cached in {file}: gemm_reduce_scatter calls with path='auto' (the default)" in out, out


def test_tune_plan_refuses_unknown_ops_naming_both_spellings(capsys):
    with pytest.raises(SystemExit):
        cli.main(["tune", "plan", "--op", "gemm_all_to_all", "--shape", "8,8,8"])
    err = capsys.readouterr().err
    assert "unknown op 'gemm_all_to_all'" in err and "gemm_all_reduce, " in err and "short names all_reduce, " in err


@pytest.fixture
def torchrun_rank(monkeypatch):
    """This process as torchrun's rank 0 of ``WORLD_SIZE`` on a machine with GPUs, no process group started for
    real, and the variables ``bench``/``tune`` set restored after."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    for name in ("init_process_group", "barrier", "destroy_process_group"):
        monkeypatch.setattr(dist, name, lambda *a, **kw: None)
    for name in (*cli.NO_MULTICAST, "FLASHOVERLAP_NO_CACHE", "WORLD_SIZE"):
        monkeypatch.setenv(name, "")  # recorded, so that what the command sets is undone after
        monkeypatch.delenv(name)


def test_bench_ops_runs_untuned_without_multicast_and_records_the_librarys_variables(torchrun_rank, monkeypatch,
                                                                                      tmp_path):
    from flashoverlap import bench

    monkeypatch.setenv("FLASHOVERLAP_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")  # the user's own setting stays
    assert settings.current().cache_dir == tmp_path  # read before: read again when bench ops changes it
    seen = {}

    def bench_main(args, device, command, environment):
        seen.update(environment=environment, cache_dir=settings.current().cache_dir)
        return 0

    monkeypatch.setattr(bench, "main", bench_main)
    assert cli.main(["bench", "ops", "--shapes", "64,64,64"]) == 0
    assert seen["cache_dir"] is None  # a plain call: no tuned plan is looked up
    env = seen["environment"]
    assert env["FLASHOVERLAP_NO_CACHE"] == "1" and env["FLASHOVERLAP_CACHE_DIR"] == str(tmp_path)
    assert env["NCCL_NVLS_ENABLE"] == "1" and env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1" and \
        env["NVSHMEM_DISABLE_NVLS"] == "1"


def test_tune_runs_without_multicast_and_with_the_cache(torchrun_rank, monkeypatch):
    seen = {}
    monkeypatch.setattr(cli, "_tune", lambda args, device: seen.update(env=cli.environment()) or 0)
    assert cli.main(["tune", "bandwidth"]) == 0
    assert {name: seen["env"].get(name) for name in cli.NO_MULTICAST} == cli.NO_MULTICAST
    assert "FLASHOVERLAP_NO_CACHE" not in seen["env"]


@pytest.mark.parametrize("argv,message", [
    (["--ops", "reduce_scatter", "--shapes", "1000,64,64"], "--shapes 1000,64,64: gemm_reduce_scatter needs M "
                                                            "divisible by the 3 ranks"),
    (["--ops", "all_gather"], "the grid's shape 4096,8192,8192: all_gather_gemm needs M divisible by the 3 ranks"),
])
def test_bench_ops_checks_its_shapes_against_the_ranks_before_starting(torchrun_rank, monkeypatch, argv, message):
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setattr(cli, "_under_torchrun", lambda *a, **kw: pytest.fail("started"))
    with pytest.raises(SystemExit) as stop:
        cli.main(["bench", "ops", *argv])
    assert stop.value.code.startswith(f"flashoverlap bench ops: {message}"), stop.value.code


@pytest.mark.parametrize("rank", ["0", "1"])
def test_demo_refuses_to_run_under_torchrun(monkeypatch, rank):
    from flashoverlap import demo

    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(demo, "main", lambda *a, **kw: pytest.fail("the demo ran once per rank"))
    with pytest.raises(SystemExit) as stop:
        cli.main(["demo"])
    assert stop.value.code.startswith("flashoverlap demo: it starts its own ranks; run it without torchrun")


def test_demo_runs_where_a_scheduler_says_one_process(monkeypatch):
    from flashoverlap import demo

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")  # some schedulers export these for a single process
    monkeypatch.setattr(demo, "main", lambda *a, **kw: 0)
    assert cli.main(["demo"]) == 0


def test_demo_names_the_default_shape_it_cannot_split():
    from flashoverlap import demo

    with pytest.raises(SystemExit) as stop:
        demo.main(None, "bfloat16", 3, True, "gemm_reduce_scatter")
    assert stop.value.code == ("flashoverlap demo: the default shape 1024,1024,256: gemm_reduce_scatter needs M "
                               "divisible by the 3 ranks; pass --shape")


def test_tune_plan_asks_the_paths_on_every_rank_whatever_its_own_problem(one_rank, tmp_path, monkeypatch):
    # tune_paths asks the P2P verdict, a collective on its first use: a rank with a problem of its own (here the
    # cache directory cannot be written) that skipped it met its peers' verdict all-gather with the next one.
    asked = []
    monkeypatch.setattr(cli, "tune_paths", lambda path, target: asked.append(path) or ["nccl"])
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("FLASHOVERLAP_CACHE_DIR", str(tmp_path / "a-file"))
    with pytest.raises(SystemExit, match="cannot be written"):
        cli._tune(_args(*PLAN), CPU)
    assert asked == ["auto"]


@pytest.mark.parametrize("variable,value,said", [
    ("FLASHOVERLAP_REPLAY", "yes", "FLASHOVERLAP_REPLAY must be 0 or 1, got 'yes'"),
    ("FLASHOVERLAP_DEBUG_TIMEOUT", "abc", "FLASHOVERLAP_DEBUG_TIMEOUT must be a number of seconds, got 'abc'"),
])
def test_demo_refuses_a_bad_library_variable_in_one_line_before_starting_ranks(monkeypatch, variable, value, said):
    """It used to start its ranks, each of which raised at its first call: two tracebacks, the message last."""
    from flashoverlap import demo

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv(variable, value)
    monkeypatch.setattr(demo, "spawn", lambda *a, **kw: pytest.fail("the ranks started"))
    with pytest.raises(SystemExit) as stop:
        cli.main(["demo"])
    assert stop.value.code == f"flashoverlap demo: {said}"


@pytest.mark.parametrize("argv", [["bench", "ops"], ["tune", "bandwidth"]])
def test_bench_and_tune_refuse_a_bad_library_variable_in_one_line_before_starting(torchrun_rank, monkeypatch, argv):
    monkeypatch.setenv("FLASHOVERLAP_NO_CACHE", "true")
    monkeypatch.setattr(cli, "_under_torchrun", lambda *a, **kw: pytest.fail("started"))
    with pytest.raises(SystemExit) as stop:
        cli.main(argv)
    assert stop.value.code == f"flashoverlap {' '.join(argv)}: FLASHOVERLAP_NO_CACHE must be 0 or 1, got 'true'"


@pytest.mark.parametrize("argv", [["bench", "ops"], ["tune", "plan", "--op", "all_reduce", "--shape", "64,64,64"]])
def test_bench_and_tune_refuse_more_ranks_on_a_node_than_gpus(torchrun_rank, monkeypatch, argv):
    """``torchrun --nproc-per-node 4`` on two GPUs: ranks 2 and 3 failed in torch.cuda.set_device ("invalid device
    ordinal"), the others waited in the rendezvous, although the message of the GPU check says one GPU per rank."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setattr(cli, "_under_torchrun", lambda *a, **kw: pytest.fail("started"))
    with pytest.raises(SystemExit) as stop:
        cli.main(argv)
    command = " ".join(argv[:2])
    assert stop.value.code == (f"flashoverlap {command}: 4 ranks on this node (torchrun --nproc-per-node 4) but 2 "
                               "CUDA GPUs: one GPU per rank; use --nproc-per-node 2 or fewer")


@pytest.mark.parametrize("where,said", [("", "is a directory; name the results file"),
                                        ("a-file/rows.json", "a-file is a file, not a folder")])
def test_bench_ops_refuses_an_out_it_could_not_write_before_starting(torchrun_rank, monkeypatch, tmp_path, where,
                                                                     said):
    """Rank 0 writes --out after the whole run: a path it cannot write used to fail there, the figures lost."""
    (tmp_path / "a-file").write_text("")
    monkeypatch.setattr(cli, "_under_torchrun", lambda *a, **kw: pytest.fail("started"))
    out = str(tmp_path / where) if where else str(tmp_path)
    with pytest.raises(SystemExit) as stop:
        cli.main(["bench", "ops", "--shapes", "64,64,64", "--out", out])
    assert stop.value.code.startswith(f"flashoverlap bench ops: --out {out}: ") and said in stop.value.code


def test_bench_ops_takes_an_out_in_folders_it_will_create(torchrun_rank, monkeypatch, tmp_path):
    from flashoverlap import bench

    monkeypatch.setattr(cli, "_under_torchrun", lambda *a, **kw: 0)
    assert bench.out_problem(str(tmp_path / "new" / "deeper" / "rows.json")) is None
    assert cli.main(["bench", "ops", "--shapes", "64,64,64", "--out", str(tmp_path / "new" / "rows.json")]) == 0


@pytest.mark.parametrize("op,api", [("reduce_scatter", "gemm_reduce_scatter"), ("all_gather_gemm", "all_gather_gemm")])
def test_tune_plan_checks_its_shape_against_the_ranks_before_starting(torchrun_rank, monkeypatch, op, api):
    """It started the NCCL group and raised from deep inside the plan search (Plan.m must be divisible), a
    traceback on every rank, where bench ops refuses its shapes in one line first."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(cli, "_under_torchrun", lambda *a, **kw: pytest.fail("started"))
    with pytest.raises(SystemExit) as stop:
        cli.main(["tune", "plan", "--op", op, "--shape", "1001,64,64"])
    assert stop.value.code == f"flashoverlap tune plan: --shape 1001,64,64: {api} needs M divisible by the 2 ranks"
    monkeypatch.setattr(cli, "_under_torchrun", lambda *a, **kw: 0)
    assert cli.main(["tune", "plan", "--op", "all_reduce", "--shape", "1001,64,64"]) == 0  # M is not split


@pytest.mark.parametrize("argv,env,said", [
    (["bench", "ops", "--shapes", "64,64,64", "--out", "{tmp}"], {}, "flashoverlap bench ops: --out {tmp}: "),
    (["tune", "plan", "--op", "all_reduce", "--shape", "64,64,64"], {"FLASHOVERLAP_REPLAY": "yes"},
     "flashoverlap tune plan: FLASHOVERLAP_REPLAY"),
    (["bench", "ops", "--shapes", "64,64,64"], {"FLASHOVERLAP_NO_CACHE": "true"},
     "flashoverlap bench ops: FLASHOVERLAP_NO_CACHE"),
])
def test_bench_and_tune_name_a_bad_option_or_variable_before_looking_for_the_gpus(monkeypatch, tmp_path, argv, env,
                                                                                   said):
    """On a machine without GPUs a bad --out or library variable was answered "needs CUDA GPUs" (the commands audit's
    note): the command line and the variables are checked first, on any machine."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as stop:
        cli.main([arg.format(tmp=tmp_path) for arg in argv])
    assert stop.value.code.startswith(said.format(tmp=tmp_path)), stop.value.code
    assert "needs CUDA" not in stop.value.code
