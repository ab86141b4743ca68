"""The command line: ``flashoverlap demo | bench ops|block|moe | tune bandwidth|plan|validate | version`` (also
``python -m flashoverlap ...``), its options and the strict value parsers every command shares.

Values are parsed by one function each (``shape`` for ``M,N,K``, ``shapes`` for ``M,N,K;M,N,K``,
``positive_ints`` for comma-separated counts), strictly: ASCII digits only, so ``1_6`` is refused rather than read
as 16. A value that starts with ``-`` (``--shape -8,8,8``) reaches its parser and gets its message instead of
argparse's "expected one argument" (``join_values``). The benchmark harness (``benchmarks/`` of a source checkout,
not installed) parses its options with these functions too.

``bench ops`` is the installed benchmark (``flashoverlap.bench``); ``bench block``, ``bench moe`` and ``tune
validate`` (and ``bench ops`` given the harness's own options, ``--timeline``, ``--sweep``, ...) belong to the harness,
``benchmarks/`` of a source checkout: run from one (``pip install -e .`` of a clone) they run it, its options and
``--help`` its own; elsewhere they say in one line how to get it. ``bench`` and ``tune`` need CUDA GPUs and run under
``torchrun``; they say so after parsing, so their ``--help`` works on a CPU machine, and a mistyped option is
refused there too. This module is the one place
besides the settings that reads the environment (torchrun's ``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE``, and the
variables a results file records); ``bench`` and ``tune`` set theirs before any process group exists (no multicast,
``NO_MULTICAST``; ``bench ops`` runs untuned, ``FLASHOVERLAP_NO_CACHE=1``). Nothing here imports torch until a
command runs.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys

OPS = ["all_reduce", "reduce_scatter", "all_gather"]
# The demo's ops by their API names (``moe``: one MoE layer's calls, moe_layout, moe_dispatch_gemm, the activation
# and moe_gemm_combine) and the names earlier versions took, kept as aliases.
DEMO_OPS = ["gemm_all_reduce", "gemm_reduce_scatter", "all_gather_gemm", "scaled_gemm_all_reduce",
            "scaled_gemm_reduce_scatter", "all_gather_scaled_gemm", "moe"]
DEMO_ALIASES = {"all_reduce": "gemm_all_reduce", "reduce_scatter": "gemm_reduce_scatter",
                "all_gather": "all_gather_gemm", "scaled_all_reduce": "scaled_gemm_all_reduce",
                "scaled_reduce_scatter": "scaled_gemm_reduce_scatter", "scaled_all_gather": "all_gather_scaled_gemm",
                "moe_layout": "moe", "moe_dispatch_gemm": "moe", "moe_gemm_combine": "moe"}
DEMO_DESCRIPTION = ("Run one op on every GPU (on 2 CPU processes with fewer than 2 GPUs) and check it against plain "
                    "PyTorch; print the path that ran.")
# The ops ``tune plan`` tunes, by their API names (the keys) and short names (the values: the tuner's).
TUNE_OPS = {"gemm_all_reduce": "all_reduce", "gemm_reduce_scatter": "reduce_scatter", "all_gather_gemm": "all_gather"}
# What every benchmark and tuning runs with (docs/benchmarks.md), set where the user has not: multicast off.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
DTYPES = ["bfloat16", "float16"]
# Options whose value may start with "-" (a mistyped negative dimension): joined to their option before parsing.
VALUE_OPTIONS = ("--shape", "--shapes", "--world-size", "--top", "--max-mib", "--iters")
# What the harness runs instead of the commands it owns, from the root of a source checkout.
HARNESS = {"block": "torchrun --nproc-per-node 2 -m benchmarks.block",
           "moe": "torchrun --nproc-per-node 2 -m benchmarks.moe",
           "validate": "torchrun --nproc-per-node 2 -m benchmarks.model_check"}
_DIGITS = re.compile(r"[0-9]+")


# -- value parsers ----------------------------------------------------------------------------------------------
def _count(text: str) -> int | None:
    """A positive integer written in ASCII digits, else None (``int`` would accept ``1_6``, ``+8``, `` 8``)."""
    return int(text) if _DIGITS.fullmatch(text) and int(text) > 0 else None


def shape(text: str) -> tuple[int, int, int]:
    """``M,N,K``: three positive integers (the one parser of a shape, for every command)."""
    dims = tuple(_count(part) for part in text.split(","))
    if len(dims) != 3 or None in dims:
        raise argparse.ArgumentTypeError(f"expected three positive integers M,N,K (digits only), got {text!r}")
    return dims  # type: ignore[return-value]


def shapes(text: str) -> list[tuple[int, int, int]]:
    """``M,N,K;M,N,K;...``: one or more shapes."""
    return [shape(part) for part in text.split(";")]


def positive(text: str) -> int:
    """One positive integer."""
    value = _count(text)
    if value is None:
        raise argparse.ArgumentTypeError(f"expected a positive integer (digits only), got {text!r}")
    return value


def non_negative(text: str) -> int:
    """Zero or a positive integer."""
    if text == "0":
        return 0
    try:
        return positive(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0 (digits only), got {text!r}") from None


def _ints(text: str, parse, what: str) -> list[int]:
    try:
        return [parse(part) for part in text.split(",")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected comma-separated {what} (digits only), got {text!r}") from None


def positive_ints(text: str) -> list[int]:
    """``A,B,...``: positive integers."""
    return _ints(text, positive, "positive integers")


def non_negative_ints(text: str) -> list[int]:
    """``A,B,...``: integers >= 0."""
    return _ints(text, non_negative, "integers >= 0")


def names_of(known: tuple[str, ...], what: str):
    """A parser of ``A,B,...``: names of ``known`` (the ``what``), at least one: a misspelt name would select nothing
    for it, and an empty list nothing at all, and the command exit 0 having done less than asked."""
    def parse(text: str) -> list[str]:
        names = [name for name in text.split(",") if name]
        unknown = [name for name in names if name not in known]
        if unknown or not names:
            wrong = f"unknown {what} {', '.join(unknown)}" if unknown else f"expected at least one {what}"
            raise argparse.ArgumentTypeError(f"{wrong}; choose from {', '.join(known)}")
        return names
    return parse


op_names = names_of(tuple(OPS), "op")  # ``all_reduce,reduce_scatter,...``: known ops, at least one


def demo_op(text: str) -> str:
    """A demo op: its API name (``DEMO_OPS``) or an alias of one (``DEMO_ALIASES``), returned as the API name."""
    name = DEMO_ALIASES.get(text, text)
    if name not in DEMO_OPS:
        raise argparse.ArgumentTypeError(f"unknown op {text!r}; choose from {', '.join(DEMO_OPS)}")
    return name


def tune_op(text: str) -> str:
    """An op ``tune plan`` tunes, by its short name (``all_reduce``) or its API name (``gemm_all_reduce``), returned
    as the short name (the tuner's and the cache's)."""
    name = TUNE_OPS.get(text, text)
    if name not in OPS:
        raise argparse.ArgumentTypeError(f"unknown op {text!r}; choose from {', '.join(TUNE_OPS)} (or their short "
                                         f"names {', '.join(OPS)})")
    return name


def _api_name(op: str) -> str:
    """``tune plan``'s op (the tuner's short name, ``all_reduce``) by its API name (``gemm_all_reduce``)."""
    return next(name for name, short in TUNE_OPS.items() if short == op)


def op_list(text: str) -> str:
    """``op_names``, checked, kept as the comma-separated text (the tuner's form)."""
    op_names(text)
    return text


def join_values(argv: list[str], options: tuple[str, ...] = VALUE_OPTIONS) -> list[str]:
    """``--shape -8,8,8`` -> ``--shape=-8,8,8`` for each of ``options``, so that the value's parser sees it
    (argparse takes a value that starts with ``-`` for an option, and says only "expected one argument")."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        if argv[i] in options and i + 1 < len(argv) and argv[i + 1].startswith("-") and argv[i + 1] != "--" \
                and not argv[i + 1].startswith("--"):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def add_bench_ops_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``bench ops`` (the harness's ``benchmarks.ops`` adds its own to these)."""
    parser.add_argument("--ops", default=["all_reduce"], type=op_names, metavar="OPS",
                        help="comma-separated: all_reduce, reduce_scatter, all_gather (default: all_reduce)")
    parser.add_argument("--shapes", default=None, type=shapes, metavar="M,N,K;...",
                        help="shapes to run for every op (default: docs/benchmarks.md's grid of each op)")
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="input dtype (default: bfloat16)")
    parser.add_argument("--iters", type=positive, default=30, help="timed calls per figure (default 30)")


# -- the parser -------------------------------------------------------------------------------------------------
def _usage_lines(parsers: dict[str, argparse.ArgumentParser]) -> str:
    """Each subcommand's usage (every option, in brief), for its parent's ``--help``."""
    lines = [parser.format_usage().strip().replace("usage: ", "  ", 1) for parser in parsers.values()]
    first = next(iter(parsers.values())).prog
    return "every option, in brief:\n" + "\n".join(lines) + f"\n\n`{first} --help` (and so on) describes each."


def _harness_text(what: str, options: str = "...") -> str:
    command = HARNESS[what]
    return (f"part of the benchmark harness (benchmarks/ of a source checkout), which this installation does not "
            f"have: in a clone of the repository (`pip install -e .` there) this command runs it, or run "
            f"`{command} {options}` from its root (its options: `python -m {command.split()[-1]} --help`)")


def harness_root():
    """The source checkout this package runs from (``pip install -e .`` of a clone: ``src/flashoverlap`` beside
    ``benchmarks/``), or None (an installed wheel has no harness)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    return root if (root / "benchmarks" / "harness" / "run.py").is_file() else None


def parser() -> argparse.ArgumentParser:
    from flashoverlap import __version__

    top = argparse.ArgumentParser(prog="flashoverlap", description="Tensor-parallel communication hidden behind "
                                  "the GEMMs that produce or consume it.",
                                  epilog="`flashoverlap COMMAND --help` lists every option of COMMAND.")
    top.add_argument("--version", action="version", version=f"flashoverlap {__version__}")
    commands = top.add_subparsers(dest="command", required=True, metavar="{demo,bench,tune,version}")
    demo = commands.add_parser("demo", help="run one op on every GPU (or 2 CPU processes) and check it against "
                               "plain PyTorch", description=DEMO_DESCRIPTION)
    demo.add_argument("--op", default="gemm_all_reduce", type=demo_op, metavar="OP",
                      help=f"the op, by its API name: {', '.join(DEMO_OPS)} (default gemm_all_reduce); the fp8 ops "
                           "with row-wise scales and bf16 output; moe: one MoE layer's moe_layout, moe_dispatch_gemm "
                           "and moe_gemm_combine (--op moe_dispatch_gemm and moe_gemm_combine run it too). The "
                           "short names of earlier versions (all_reduce, scaled_all_gather, ...) still work")
    demo.add_argument("--shape", type=shape, default=None, metavar="M,N,K",
                      help="M rows (all-gather: gathered), N columns, this rank's K; moe: tokens per rank, hidden, "
                           "expert FFN (default 16384,8192,4096 on GPUs, 1024,1024,256 on the CPU; moe "
                           "4096,4096,14336 and 256,128,256)")
    demo.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="input dtype (default: bfloat16)")
    demo.add_argument("--world-size", type=positive, default=None,
                      help="ranks (default: every GPU, or 2 CPU processes)")
    demo.add_argument("--cpu", action="store_true", help="use CPU processes (gloo) even where GPUs are present")

    bench = commands.add_parser("bench", help="benchmark the ops against matmul + collective; under torchrun on "
                                "GPUs", formatter_class=argparse.RawDescriptionHelpFormatter,
                                description="Benchmarks, under torchrun on CUDA GPUs (docs/benchmarks.md).")
    kinds = bench.add_subparsers(dest="what", required=True, metavar="{ops,block,moe}")
    bench_parsers = {
        "ops": kinds.add_parser("ops", help="the three ops against matmul + collective at the grid shapes",
                                description="The ops against the plain PyTorch code they replace (matmul then the "
                                "collective) at docs/benchmarks.md's grid: a table, and the results rows with "
                                "--out. The full harness (decomposition and async TP baselines, both paths, plan "
                                "sweeps, the timeline) is `torchrun --nproc-per-node 2 -m benchmarks.ops` from the "
                                "root of a source checkout."),
        "block": kinds.add_parser("block", help="the tensor-parallel transformer block (the harness's: "
                                  "`flashoverlap bench block --help` lists its options)", add_help=False,
                                  description=f"The transformer block: {_harness_text('block')}."),
        "moe": kinds.add_parser("moe", help="the expert-parallel MoE layer (the harness's: `flashoverlap bench moe "
                                "--help` lists its options)", add_help=False,
                                description=f"The MoE layer: {_harness_text('moe')}."),
    }
    add_bench_ops_arguments(bench_parsers["ops"])
    bench_parsers["ops"].add_argument("--out", default=None, metavar="FILE",
                                      help="also write the results JSON ({meta, rows}) to FILE")
    bench.epilog = _usage_lines(bench_parsers)

    tune = commands.add_parser("tune", help="the tuner, under torchrun: bandwidth curves, plan search, model check",
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    steps = tune.add_subparsers(dest="tune_command", required=True, metavar="{bandwidth,plan,validate}")
    tune_parsers = {}
    for name, text in (("bandwidth", "measure each collective's time against message size"),
                       ("plan", "search one shape's plan with the model, confirm by measurement, cache the winner")):
        step = tune_parsers[name] = steps.add_parser(name, help=text, description=text)
        if name == "bandwidth":
            step.add_argument("--path", default="nccl", choices=["nccl", "p2p"],
                              help="the communicator whose curves to measure (default nccl; tune plan, by "
                                   "default, reads both where P2P applies)")
        else:
            step.add_argument("--path", default="auto", choices=["nccl", "p2p", "auto"],
                              help="the path whose calls use the plan (default auto, the ops' default: NCCL and, "
                                   "where P2P applies, P2P are searched, and path='auto' calls follow the winner's "
                                   "path; nccl, p2p: calls that name that path)")
        step.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="input dtype (default: bfloat16)")
    tune_parsers["bandwidth"].add_argument("--ops", default=",".join(OPS), type=op_list,
                                           help="comma-separated ops (default: all three)")
    tune_parsers["bandwidth"].add_argument("--max-mib", type=positive, default=512,
                                           help="largest message in MiB (default 512)")
    plan = tune_parsers["plan"]
    plan.add_argument("--op", required=True, type=tune_op, metavar="OP",
                      help=f"the op to tune: {', '.join(TUNE_OPS)}, or by its short name ({', '.join(OPS)})")
    plan.add_argument("--shape", type=shape, required=True, metavar="M,N,K",
                      help="the call's shape; for all_gather, M is the gathered rows")
    plan.add_argument("--top", type=positive, default=3, help="model's best candidates to time (default 3)")
    plan.add_argument("--exhaustive", action="store_true", help="time every candidate")
    tune_parsers["validate"] = steps.add_parser(
        "validate", help="the model's predictions and picks against measurements over the grid (the harness's: "
        "`flashoverlap tune validate --help` lists its options)", add_help=False,
        description=f"The model check: {_harness_text('validate')}.")
    tune.epilog = _usage_lines(tune_parsers)
    version = commands.add_parser("version", help="print the version")
    # The command each parser runs, so that an option it does not take is refused with its usage, not the top's.
    top.commands = {("demo", None): demo, ("version", None): version, **{("bench", name): each for name, each in
                    bench_parsers.items()}, **{("tune", name): each for name, each in tune_parsers.items()}}
    return top


# -- the commands -----------------------------------------------------------------------------------------------
def _needs_gpus(command: str) -> None:
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
        raise SystemExit(f"flashoverlap {command}: needs CUDA GPUs (one per rank, under torchrun --nproc-per-node N); "
                         "on a CPU-only machine run `flashoverlap demo` or the tests")
    if "RANK" not in os.environ:
        raise SystemExit(f"flashoverlap {command}: start it under torchrun, e.g. "
                         f"`torchrun --nproc-per-node 2 -m flashoverlap {command} ...`")
    from flashoverlap.bench import ranks_beyond_gpus

    beyond = ranks_beyond_gpus()  # rank LOCAL_RANK >= gpus: "invalid device ordinal"
    if beyond is not None:
        local, gpus = beyond
        raise SystemExit(f"flashoverlap {command}: {local} ranks on this node (torchrun --nproc-per-node {local}) "
                         f"but {gpus} CUDA GPU{'s' if gpus > 1 else ''}: one GPU per rank; use --nproc-per-node "
                         f"{gpus} or fewer")


def _under_torchrun(run, untuned: bool = False) -> int:
    """``run(device)`` on this rank's GPU (torchrun's ``LOCAL_RANK``) with the NCCL group started, taken down after;
    the environment prepared first (``_prepare_environment``)."""
    import torch
    import torch.distributed as dist

    _prepare_environment(untuned)
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=device)
    try:
        return run(device)
    finally:
        dist.barrier()
        dist.destroy_process_group()


def tune_target(dtype_name: str, device):
    """The tuner's ``Target`` on the world group: this device, the dtype, the runtime's NCCL transport setting."""
    import torch
    import torch.distributed as dist

    from flashoverlap import settings
    from flashoverlap.tune.tuner import Target

    return Target(dist.group.WORLD, device, getattr(torch, dtype_name), settings.current().nccl_p2p_disabled)


def tune_paths(path: str, target) -> list[str]:
    """The paths ``tune plan --path PATH`` searches: the one asked for, or for ``"auto"`` NCCL and, where it applies
    to this group, P2P (the ops' ``path="auto"`` rule: the runtime's answer)."""
    import torch.distributed as dist

    from flashoverlap.comm.symmetric import p2p_unavailable_reason
    from flashoverlap.runtime.policy import p2p_excluded

    if path != "auto":
        return [path]
    reason = None if target.nccl_p2p_disabled else p2p_unavailable_reason(target.group, target.device)
    excluded = p2p_excluded(reason, dist.get_world_size(target.group), target.nccl_p2p_disabled)
    return ["nccl"] if excluded else ["nccl", "p2p"]


def tune_search(op: str, shape: tuple[int, int, int], target, path: str):
    """``tune.tuner.model_search`` over the paths ``path`` covers (``tune_paths``), each with the plan an untuned
    call takes there (the runtime's answers, passed to the tuner as values)."""
    from flashoverlap.runtime import plan_for
    from flashoverlap.tune.tuner import model_search

    group, device = target.group, target.device
    hand_set = {each: plan_for(op, tuple(shape), group, device, target.dtype, each, tuned=False)
                for each in tune_paths(path, target)}
    return model_search(op, shape, target, hand_set, path)


def _tune_problem(args: argparse.Namespace, target) -> str | None:
    """Why this rank's tuning could not end in a stored result, found before measuring anything (None: it can):
    the cache off or not writable, the plan's file one the cache would not replace (rank 0 writes), a bandwidth
    curve ``tune plan`` reads missing here."""
    import torch.distributed as dist

    from flashoverlap.tune import cache
    from flashoverlap.tune.tuner import missing_curves

    plan = args.tune_command == "plan"
    # Every rank asks the same collective questions first (``tune_paths`` asks the P2P verdict, an all-gather on
    # its first use), whatever this rank's own problem: a rank that skipped it would meet its peers' all-gather
    # with the next one.
    paths = tune_paths(args.path, target) if plan else None
    if dist.get_rank(target.group) == 0:
        problem = cache.write_problem(target.key(args.op, args.path) if plan else None)
    else:
        problem = cache.NO_CACHE if cache.cache_dir() is None else None
    if problem is None and plan:
        problem = missing_curves(args.op, paths, target)
    return problem


def _tune(args: argparse.Namespace, device) -> int:
    """``tune bandwidth``: measure and store each op's curve. ``tune plan``: tune one shape and cache the winner,
    then say where and which calls take it. Either refuses in one line, before measuring, where its result could
    not be stored or a curve it needs is missing (any rank's reason: every rank stops)."""
    import torch.distributed as dist

    from flashoverlap.tune import cache
    from flashoverlap.tune.tuner import tune_bandwidth, tune_plan

    target = tune_target(args.dtype, device)
    problems: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(problems, _tune_problem(args, target))
    problem = next((each for each in problems if each is not None), None)
    if problem is not None:
        raise SystemExit(f"flashoverlap tune {args.tune_command}: {problem}")
    say = print if dist.get_rank() == 0 else (lambda line: None)
    if args.tune_command == "bandwidth":
        tune_bandwidth(args.ops.split(","), args.path, target, args.max_mib << 20, say)
        return 0
    search = tune_search(args.op, args.shape, target, args.path)
    winner, _ = tune_plan(args.op, args.shape, target, search, args.top, args.exhaustive, say)
    say(winner.describe())
    api = _api_name(args.op)
    users = "path='auto' (the default)" if args.path == "auto" else \
        f"path={args.path!r} (path='auto' calls read `tune plan --path auto`'s plans only)"
    say(f"cached in {cache.cache_file(search.key)}: {api} calls with {users} at M,N,K = "
        f"{','.join(map(str, args.shape))} in {args.dtype} over {dist.get_world_size()} ranks use it (M within a "
        "factor 2 borrow it)")
    return 0


def _run_harness(command: str, what: str, rest: list[str], unknown: list[str] | None = None) -> int:
    """``flashoverlap COMMAND WHAT REST``: a harness command, or ``bench ops`` with options it lacks (``unknown``:
    ``benchmarks.ops`` has more). This process becomes ``python -m benchmarks.<module> REST`` of this source
    checkout (an exec, not an import: the package never imports the harness; under torchrun each rank does the
    same), which parses first (a mistyped option, ``--help``), then needs GPUs. Without a checkout, one line says
    how to get one."""
    module = HARNESS[what].split()[-1] if what in HARNESS else "benchmarks.ops"
    root = harness_root()
    if root is None and unknown:
        raise SystemExit(f"flashoverlap {command} {what}: unrecognized arguments: {' '.join(unknown)} (the "
                         "harness's options, --timeline, --sweep, ..., are `torchrun --nproc-per-node 2 -m "
                         "benchmarks.ops`'s, in a source checkout; this installation has none)")
    if root is None and ("-h" in rest or "--help" in rest):
        print(f"usage: flashoverlap {command} {what} ...\n\n{_harness_text(what)}")
        return 0
    if root is None:
        raise SystemExit(f"flashoverlap {command} {what}: {_harness_text(what, ' '.join(rest) or '...')}")
    if unknown and os.environ.get("RANK", "0") == "0":
        print(f"flashoverlap {command} {what}: {' '.join(unknown)}: handed with the rest to {module}, the harness "
              "of this source checkout, which has more options", file=sys.stderr, flush=True)
    path = os.pathsep.join([str(root), *filter(None, [os.environ.get("PYTHONPATH")])])
    sys.stdout.flush()
    # What every benchmark runs with, as bench and tune set it where the user has not (multicast off).
    os.execve(sys.executable, [sys.executable, "-m", module, *rest],
              {**NO_MULTICAST, **os.environ, "PYTHONPATH": path})


def environment() -> dict[str, str]:
    """The variables that shape a run's communication and the library's choices, recorded in a results file's
    meta."""
    return {k: v for k, v in os.environ.items()
            if k.startswith(("NCCL_", "TORCH_SYMM", "NVSHMEM_", "CUDA_DEV", "FLASHOVERLAP_"))}


def _prepare_environment(untuned: bool) -> None:
    """Before any process group exists: multicast off where the user has not set it (``NO_MULTICAST``), and for
    ``untuned`` (``bench ops``: a plain call, as docs/benchmarks.md defines T) no plan cache, read afresh by the
    settings."""
    from flashoverlap import settings

    for name, value in NO_MULTICAST.items():
        os.environ.setdefault(name, value)
    if untuned:
        os.environ["FLASHOVERLAP_NO_CACHE"] = "1"
    settings.refresh()


def _check_settings(command: str) -> None:
    """The library's variables (``settings.read``: a switch other than 0 or 1, a debug timeout that is no number)
    checked before any rank or process group starts: one line naming the variable, instead of a traceback from
    every rank's first call."""
    from flashoverlap import settings

    try:
        settings.read()
    except ValueError as exc:
        raise SystemExit(f"flashoverlap {command}: {exc}") from None


def _world_size() -> int:
    """torchrun's ``WORLD_SIZE`` (1 without it)."""
    text = os.environ.get("WORLD_SIZE", "1")
    return int(text) if _DIGITS.fullmatch(text) else 1


def main(argv: list[str] | None = None) -> int:
    argv = join_values(list(sys.argv[1:] if argv is None else argv))
    top = parser()
    args, unknown = top.parse_known_args(argv)
    what = {"bench": getattr(args, "what", None), "tune": getattr(args, "tune_command", None)}.get(args.command)
    if what in HARNESS:  # the harness's command: its options (and --help) are its own
        return _run_harness(args.command, what, argv[argv.index(what, argv.index(args.command)) + 1 :])
    if unknown and what == "ops":  # the harness's options: benchmarks.ops runs, with the options given
        return _run_harness(args.command, what, argv[argv.index(what, argv.index(args.command)) + 1 :], unknown)
    if unknown:  # refused by the command's own parser: its usage, not the top's
        top.commands.get((args.command, what), top).error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command == "version":
        from flashoverlap import __version__

        print(f"flashoverlap {__version__}")
        return 0
    if args.command == "demo":
        if _world_size() > 1:  # torchrun's ranks (a scheduler's WORLD_SIZE=1 for one process is left alone)
            raise SystemExit("flashoverlap demo: it starts its own ranks; run it without torchrun (`flashoverlap "
                             "demo ...`, --world-size N for N ranks)")
        _check_settings("demo")
        from flashoverlap.demo import main as demo_main

        return demo_main(args.shape, args.dtype, args.world_size, args.cpu, args.op)
    # The command line and the library's variables first, then the GPUs: a bad --out or shape is named as such on
    # any machine (on a CPU one it was "needs CUDA GPUs", whatever else was wrong).
    _check_settings(f"{args.command} {what}")
    if args.command == "tune":
        world = _world_size()
        if what == "plan" and args.op != "all_reduce" and args.shape[0] % world:  # as bench ops checks its shapes
            raise SystemExit(f"flashoverlap tune plan: --shape {','.join(map(str, args.shape))}: "
                             f"{_api_name(args.op)} needs M divisible by the {world} ranks")
        _needs_gpus(f"{args.command} {what}")
        return _under_torchrun(lambda device: _tune(args, device))
    from flashoverlap import bench

    refused = bench.shape_problem(args.ops, args.shapes, _world_size()) or bench.out_problem(args.out)
    if refused is not None:
        raise SystemExit(f"flashoverlap bench ops: {refused}")
    _needs_gpus(f"{args.command} {what}")
    command = shlex.join(["flashoverlap", *argv])  # quoted: a shape list's ";" stays one word
    return _under_torchrun(lambda device: bench.main(args, device, command, environment()), untuned=True)


if __name__ == "__main__":
    sys.exit(main())
