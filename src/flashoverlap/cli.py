"""The command line: ``flashoverlap demo | bench ops|block|moe | tune ... | version`` (also ``python -m
flashoverlap ...``).

The options and their strict value parsers are ``bench/args.py``'s, shared with ``python -m flashoverlap.bench``,
``.bench.block`` and ``.bench.moe``, so that ``--help`` lists the same options everywhere and on any machine; this
module imports the benchmarks only to run them, and they never import it. ``bench`` and ``tune`` need CUDA GPUs
and run under ``torchrun``; they say so after parsing, so their ``--help`` works on a CPU machine. Nothing here
imports torch until a command runs.
"""

from __future__ import annotations

import argparse
import os
import sys

from flashoverlap.bench.args import (
    DTYPES,
    OPS,
    add_bench_block_arguments,
    add_bench_moe_arguments,
    add_bench_ops_arguments,
    join_values,
    op_list,
    positive,
    shape,
)


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
    kinds = bench.add_subparsers(dest="what", required=True, metavar="{ops,block,moe}")
    bench_parsers = {
        "ops": kinds.add_parser("ops", help="the benchmark grid of the three ops against their baselines",
                                description="The ops against matmul + collective, decomposition and async TP "
                                "(also `python -m flashoverlap.bench`)."),
        "block": kinds.add_parser("block", help="the tensor-parallel transformer block, eager and compiled",
                                  description="A Llama-style block at tensor parallelism: ours against plain "
                                  "PyTorch TP, async TP and no communication, eager and compiled (also `python -m "
                                  "flashoverlap.bench.block`)."),
        "moe": kinds.add_parser("moe", help="the expert-parallel MoE layer against the plain layer",
                                description="One expert-parallel SwiGLU MoE layer: ours against NCCL all-to-all + "
                                "torch._grouped_mm and against no communication, per config, routing, mode and path "
                                "(also `python -m flashoverlap.bench.moe`)."),
    }
    add_bench_ops_arguments(bench_parsers["ops"])
    add_bench_block_arguments(bench_parsers["block"])
    add_bench_moe_arguments(bench_parsers["moe"])
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
    if args.what == "moe":
        from flashoverlap.bench.moe import main as moe_main

        return moe_main(rest)
    from flashoverlap.bench.__main__ import main as bench_main

    return bench_main(rest)


if __name__ == "__main__":
    sys.exit(main())
