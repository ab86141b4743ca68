"""The command line: ``flashoverlap demo | bench ops | bench block | tune ... | version`` (also ``python -m
flashoverlap ...``), and every option of it, including those of ``python -m flashoverlap.bench`` and ``python -m
flashoverlap.bench.block``, which take their parsers from here so that ``--help`` lists the same options
everywhere and on any machine.

Values are parsed by one function each (``shape`` for ``M,N,K``, ``shapes`` for ``M,N,K;M,N,K``,
``positive_ints`` for comma-separated counts), strictly: ASCII digits only, so ``1_6`` is refused rather than read
as 16. A value that starts with ``-`` (``--shape -8,8,8``) reaches its parser and gets its message instead of
argparse's "expected one argument". ``bench`` and ``tune`` need CUDA GPUs and run under ``torchrun``; they say so
after parsing, so their ``--help`` works on a CPU machine. Nothing here imports torch until a command runs.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

OPS = ["all_reduce", "reduce_scatter", "all_gather"]
DTYPES = ["bfloat16", "float16"]
# Options whose value may start with "-" (a mistyped negative dimension): joined to their option before parsing.
_VALUE_OPTIONS = ("--shape", "--shapes", "--tokens", "--world-size", "--top", "--max-mib", "--iters", "--steps",
                  "--decode-tokens", "--sweep-iters", "--sweep-groups", "--sweep-ctas")
_DIGITS = re.compile(r"[0-9]+")


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
    return 0 if text == "0" else positive(text)


def positive_ints(text: str) -> list[int]:
    """``A,B,...``: positive integers."""
    try:
        return [positive(part) for part in text.split(",")]
    except argparse.ArgumentTypeError:
        message = f"expected comma-separated positive integers (digits only), got {text!r}"
        raise argparse.ArgumentTypeError(message) from None


def non_negative_ints(text: str) -> list[int]:
    """``A,B,...``: integers >= 0."""
    try:
        return [non_negative(part) for part in text.split(",")]
    except argparse.ArgumentTypeError:
        message = f"expected comma-separated integers >= 0 (digits only), got {text!r}"
        raise argparse.ArgumentTypeError(message) from None


def op_names(text: str) -> list[str]:
    """``all_reduce,reduce_scatter,...``: known ops (empty: none)."""
    names = [name for name in text.split(",") if name]
    unknown = [name for name in names if name not in OPS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown op(s) {unknown}; choose from {', '.join(OPS)}")
    return names


def op_list(text: str) -> str:
    """``op_names``, checked, kept as the comma-separated text (the tuner's form)."""
    if not op_names(text):
        raise argparse.ArgumentTypeError("expected at least one op")
    return text


def join_values(argv: list[str]) -> list[str]:
    """``--shape -8,8,8`` -> ``--shape=-8,8,8``, so that the value's parser sees it (argparse takes a value that
    starts with ``-`` for an option, and says only "expected one argument")."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        if argv[i] in _VALUE_OPTIONS and i + 1 < len(argv) and argv[i + 1].startswith("-") and argv[i + 1] != "--" \
                and not argv[i + 1].startswith("--"):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


# -- the benchmarks' options (also used by python -m flashoverlap.bench and python -m flashoverlap.bench.block) --
def add_bench_ops_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of the ops benchmark (docs/benchmarks.md's grid)."""
    parser.add_argument("--ops", default=["all_reduce"], type=op_names, metavar="OPS",
                        help="comma-separated: all_reduce, reduce_scatter, all_gather (default: all_reduce; empty: "
                             "no grid, e.g. with --movers alone)")
    parser.add_argument("--shapes", default=None, type=shapes, metavar="M,N,K;...",
                        help="shapes to run for every op (default: docs/benchmarks.md's grid of each op)")
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="input dtype (default: bfloat16)")
    parser.add_argument("--iters", type=positive, default=30, help="timed calls per figure (default 30)")
    parser.add_argument("--sweep", action="store_true", help="also time a family of plans per shape")
    parser.add_argument("--sweep-groups", type=positive_ints, default=[4, 8], metavar="G,G",
                        help="--sweep: group counts (default 4,8)")
    parser.add_argument("--sweep-profiles", type=lambda s: s.split(","), metavar="P,P",
                        default=["even", "small-first", "small-last"],
                        help="--sweep: group-size profiles (default even,small-first,small-last)")
    parser.add_argument("--sweep-programs", type=lambda s: s.split(","), default=["tiles", "16"], metavar="P,P",
                        help="--sweep: 'tiles' (one tile per program) and/or SMs left free (0 = persistent on every "
                             "SM) (default tiles,16)")
    parser.add_argument("--sweep-ctas", type=non_negative_ints, default=[0, 4, 8, 32], metavar="C,C",
                        help="--sweep: NCCL CTA counts, 0 = NCCL's default (default 0,4,8,32)")
    parser.add_argument("--sweep-iters", type=positive, default=10, help="--sweep: timed calls per plan (default 10)")
    parser.add_argument("--gemm-sweep", action="store_true", help="time our GEMM alone over tile configurations")
    parser.add_argument("--interference", action="store_true", help="measure GEMM/NCCL mutual slowdown")
    parser.add_argument("--movers", action="store_true",
                        help="measure how copy engines and SM copies over NVLink and a GEMM slow each other")
    parser.add_argument("--timeline", default=None, metavar="PNG",
                        help="also draw one gemm_all_reduce call of the first all-reduce shape on two lanes")
    parser.add_argument("--out", default=None, help="results JSON (default benchmarks/results/<gpus>-<setting>.json)")


def add_bench_block_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of the transformer-block benchmark."""
    parser.add_argument("--tokens", type=positive_ints, default=[8192, 16384], metavar="T,T",
                        help="token counts (batch x sequence), comma-separated (default 8192,16384)")
    parser.add_argument("--steps", type=positive, default=20, help="timed steps per figure, median (default 20)")
    parser.add_argument("--decode-tokens", type=positive, default=16, help="tokens of the decode step (default 16)")
    parser.add_argument("--no-compile", action="store_true",
                        help="skip the compiled blocks (ours, plain PyTorch TP, no communication)")
    parser.add_argument("--no-async-tp", action="store_true", help="skip torch's async TP (compiled)")
    parser.add_argument("--out", default=None,
                        help="results JSON (default benchmarks/results/<gpus>-<setting>-block.json)")


def _needs_gpus(command: str) -> None:
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
        raise SystemExit(f"flashoverlap {command}: needs CUDA GPUs (two or more, under torchrun --nproc-per-node N); "
                         "on a CPU-only machine run `flashoverlap demo` or the tests")
    if "RANK" not in os.environ:
        raise SystemExit(f"flashoverlap {command}: start it under torchrun, e.g. "
                         f"`torchrun --nproc-per-node 2 -m flashoverlap {command} ...`")


def _usage_lines(parsers: dict[str, argparse.ArgumentParser]) -> str:
    """Each subcommand's usage (every option, in brief), for its parent's ``--help``."""
    lines = [parser.format_usage().strip().replace("usage: ", "  ", 1) for parser in parsers.values()]
    first = next(iter(parsers.values())).prog
    return "every option, in brief:\n" + "\n".join(lines) + f"\n\n`{first} --help` (and so on) describes each."


def parser() -> argparse.ArgumentParser:
    from flashoverlap import __version__

    top = argparse.ArgumentParser(prog="flashoverlap", description="Tensor-parallel communication hidden behind "
                                  "the GEMMs that produce or consume it.",
                                  epilog="`flashoverlap COMMAND --help` lists every option of COMMAND.")
    top.add_argument("--version", action="version", version=f"flashoverlap {__version__}")
    commands = top.add_subparsers(dest="command", required=True, metavar="{demo,bench,tune,version}")
    demo = commands.add_parser("demo", help="run one op on 2 ranks and check it against plain PyTorch")
    demo.add_argument("--op", default="all_reduce", choices=OPS, help="the op (default: all_reduce)")
    demo.add_argument("--shape", type=shape, default=None, metavar="M,N,K",
                      help="M rows (all_gather: gathered), N columns, this rank's K (default 16384,8192,4096 on "
                           "GPUs, 4096,4096,1024 on the CPU)")
    demo.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="input dtype (default: bfloat16)")
    demo.add_argument("--world-size", type=positive, default=None,
                      help="ranks (default: every GPU, or 2 CPU processes)")
    demo.add_argument("--cpu", action="store_true", help="use CPU processes (gloo) even where GPUs are present")

    bench = commands.add_parser("bench", help="benchmark the ops (or the transformer block) against baselines; "
                                "under torchrun on GPUs", formatter_class=argparse.RawDescriptionHelpFormatter,
                                description="Benchmarks, under torchrun on CUDA GPUs; results JSON under "
                                "benchmarks/results/ (docs/benchmarks.md).")
    kinds = bench.add_subparsers(dest="what", required=True, metavar="{ops,block}")
    bench_parsers = {
        "ops": kinds.add_parser("ops", help="the benchmark grid of the three ops against their baselines",
                                description="The ops against matmul + collective, decomposition and async TP "
                                "(also `python -m flashoverlap.bench`)."),
        "block": kinds.add_parser("block", help="the tensor-parallel transformer block, eager and compiled",
                                  description="A Llama-style block at tensor parallelism: ours against plain "
                                  "PyTorch TP, async TP and no communication, eager and compiled (also `python -m "
                                  "flashoverlap.bench.block`)."),
    }
    add_bench_ops_arguments(bench_parsers["ops"])
    add_bench_block_arguments(bench_parsers["block"])
    bench.epilog = _usage_lines(bench_parsers)

    tune = commands.add_parser("tune", help="the tuner, under torchrun: bandwidth curves, plan search, model check",
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    steps = tune.add_subparsers(dest="tune_command", required=True, metavar="{bandwidth,plan,validate}")
    tune_parsers = {}
    for name, text in (("bandwidth", "measure each collective's time against message size"),
                       ("plan", "search one shape's plan with the model, confirm by measurement, cache the winner"),
                       ("validate", "the model's predictions and picks against measurements over the grid")):
        step = tune_parsers[name] = steps.add_parser(name, help=text, description=text)
        paths = ["nccl", "p2p"] if name == "bandwidth" else ["nccl", "p2p", "auto"]
        step.add_argument("--path", default="nccl", choices=paths,
                          help="the communicator (default nccl; auto: both where P2P applies, and the winner's plan "
                               "names its path, which path='auto' calls then follow)")
        step.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="input dtype (default: bfloat16)")
        if name in ("bandwidth", "validate"):
            step.add_argument("--ops", default=",".join(OPS), type=op_list,
                              help="comma-separated ops (default: all three)")
        if name == "bandwidth":
            step.add_argument("--max-mib", type=positive, default=512, help="largest message in MiB (default 512)")
        if name == "plan":
            step.add_argument("--op", required=True, choices=OPS, help="the op to tune")
            step.add_argument("--shape", type=shape, required=True, metavar="M,N,K",
                              help="the call's shape; for all_gather, M is the gathered rows")
            step.add_argument("--top", type=positive, default=3, help="model's best candidates to time (default 3)")
            step.add_argument("--exhaustive", action="store_true", help="time every candidate")
        if name == "validate":
            step.add_argument("--out", default=None, help="results JSON (default benchmarks/results/...-model.json)")
    tune.epilog = _usage_lines(tune_parsers)
    commands.add_parser("version", help="print the version")
    return top


def main(argv: list[str] | None = None) -> int:
    argv = join_values(list(sys.argv[1:] if argv is None else argv))
    args = parser().parse_args(argv)
    if args.command == "version":
        from flashoverlap import __version__

        print(f"flashoverlap {__version__}")
        return 0
    if args.command == "demo":
        from flashoverlap.demo import main as demo_main

        return demo_main(args.shape, args.dtype, args.world_size, args.cpu, args.op)
    _needs_gpus(f"{args.command} {args.what if args.command == 'bench' else args.tune_command}")
    if args.command == "tune":
        from flashoverlap.bench.tuner import main as tune_main

        return tune_main(args)
    # The benchmarks parse their own options (the same definitions, above): pass on what follows ``bench WHAT``.
    rest = argv[argv.index(args.what, argv.index("bench")) + 1 :]
    if args.what == "block":
        from flashoverlap.bench.block import main as block_main

        return block_main(rest)
    from flashoverlap.bench.__main__ import main as bench_main

    return bench_main(rest)


if __name__ == "__main__":
    sys.exit(main())
