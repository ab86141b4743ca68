"""The command line: ``flashoverlap demo | bench | tune | version`` (also ``python -m flashoverlap ...``).

Shapes are ``--shape M,N,K`` everywhere (``bench``: ``--shapes M,N,K;M,N,K``), checked here; ``bench`` and
``tune`` need CUDA GPUs and run under ``torchrun``, and say so instead of failing deep inside.
"""

from __future__ import annotations

import argparse
import os
import sys

OPS = ["all_reduce", "reduce_scatter", "all_gather"]
DTYPES = ["bfloat16", "float16"]


def shape(text: str) -> tuple[int, int, int]:
    """``M,N,K``: three positive integers."""
    try:
        dims = tuple(int(x) for x in text.split(","))
    except ValueError:
        dims = ()
    if len(dims) != 3 or min(dims) < 1:
        raise argparse.ArgumentTypeError(f"expected three positive integers M,N,K, got {text!r}")
    return dims


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _needs_gpus(command: str) -> None:
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
        raise SystemExit(f"flashoverlap {command}: needs CUDA GPUs (two or more, under torchrun --nproc-per-node N); "
                         "on a CPU-only machine run `flashoverlap demo` or the tests")
    if "RANK" not in os.environ:
        raise SystemExit(f"flashoverlap {command}: start it under torchrun, e.g. "
                         f"`torchrun --nproc-per-node 2 -m flashoverlap {command} ...`")


def parser() -> argparse.ArgumentParser:
    from flashoverlap import __version__

    top = argparse.ArgumentParser(prog="flashoverlap", description="Tensor-parallel communication hidden behind "
                                  "the GEMMs that produce or consume it.")
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
                                "under torchrun on GPUs")
    bench.add_argument("what", choices=["ops", "block"],
                       help="ops: the benchmark grid of the three ops; block: the tensor-parallel block")
    bench.add_argument("args", nargs=argparse.REMAINDER,
                       help="options of `python -m flashoverlap.bench` (ops) or `python -m flashoverlap.bench.block`")

    tune = commands.add_parser("tune", help="the tuner, under torchrun: bandwidth curves, plan search, model check")
    steps = tune.add_subparsers(dest="tune_command", required=True, metavar="{bandwidth,plan,validate}")
    for name, text in (("bandwidth", "measure each collective's time against message size"),
                       ("plan", "search one shape's plan with the model, confirm by measurement, cache the winner"),
                       ("validate", "the model's predictions and picks against measurements over the grid")):
        step = steps.add_parser(name, help=text)
        paths = ["nccl", "p2p"] if name == "bandwidth" else ["nccl", "p2p", "auto"]
        step.add_argument("--path", default="nccl", choices=paths,
                          help="the communicator (auto: both where P2P applies; the winner's plan names its path)")
        step.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="input dtype (default: bfloat16)")
        if name in ("bandwidth", "validate"):
            step.add_argument("--ops", default=",".join(OPS), help="comma-separated ops (default: all three)")
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
    commands.add_parser("version", help="print the version")
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command == "version":
        from flashoverlap import __version__

        print(f"flashoverlap {__version__}")
        return 0
    if args.command == "demo":
        from flashoverlap.demo import main as demo_main

        return demo_main(args.shape, args.dtype, args.world_size, args.cpu, args.op)
    _needs_gpus(f"{args.command}{' ' + args.what if args.command == 'bench' else ''}")
    if args.command == "tune":
        from flashoverlap.bench.tuner import main as tune_main

        return tune_main(args)
    rest = [a for a in args.args if a != "--"]
    if args.what == "block":
        from flashoverlap.bench.block import main as block_main

        return block_main(rest)
    from flashoverlap.bench.__main__ import main as bench_main

    return bench_main(rest)


if __name__ == "__main__":
    sys.exit(main())
