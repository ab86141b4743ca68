"""The command line: ``python -m flashoverlap <command>`` (also installed as ``flashoverlap``)."""

from __future__ import annotations

import argparse
import sys


def _shape(text: str) -> tuple[int, int, int]:
    dims = tuple(int(x) for x in text.split(","))
    if len(dims) != 3 or min(dims) < 1:
        raise argparse.ArgumentTypeError(f"expected three positive integers M,N,K, got {text!r}")
    return dims


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashoverlap", description="flashoverlap command line")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="run one overlapped op and check it against PyTorch")
    demo.add_argument("--m", type=int, default=None, help="rows of a (default 16384 on GPUs, 4096 on the CPU)")
    demo.add_argument("--n", type=int, default=None, help="columns of b (default 8192 / 4096)")
    demo.add_argument("--k", type=int, default=None, help="this rank's K (default 4096 / 1024)")
    demo.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    demo.add_argument("--world-size", type=int, default=None, help="ranks (default: all GPUs, or 2 on the CPU)")
    demo.add_argument("--cpu", action="store_true", help="use CPU processes even when GPUs are present")
    demo.add_argument("--op", default="all_reduce", choices=["all_reduce", "reduce_scatter", "all_gather"],
                      help="which overlapped op (default: GEMM+AllReduce)")
    tune = commands.add_parser("tune", help="the tuner, under torchrun: bandwidth curves, plan search, model check")
    steps = tune.add_subparsers(dest="tune_command", required=True)
    for name, text in (("bandwidth", "measure each collective's time against message size"),
                       ("plan", "search one shape's plan with the model, confirm by measurement, cache the winner"),
                       ("validate", "the model's predictions and picks against measurements over the grid")):
        step = steps.add_parser(name, help=text)
        paths = ["nccl", "p2p"] if name == "bandwidth" else ["nccl", "p2p", "auto"]
        step.add_argument("--path", default="nccl", choices=paths,
                          help="auto: search both paths where P2P applies; the winner's plan names its path")
        step.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
        if name in ("bandwidth", "validate"):
            step.add_argument("--ops", default="all_reduce,reduce_scatter,all_gather")
        if name == "bandwidth":
            step.add_argument("--max-mib", type=int, default=512, help="largest message (MiB)")
        if name == "plan":
            step.add_argument("--op", required=True, choices=["all_reduce", "reduce_scatter", "all_gather"])
            # One option, not --m/--n/--k: torchrun reads "--m" as an abbreviation of its own options.
            step.add_argument("--shape", type=_shape, required=True, metavar="M,N,K",
                              help="the call's shape; for all_gather, M is the gathered rows")
            step.add_argument("--top", type=int, default=3, help="model's best candidates to time")
            step.add_argument("--exhaustive", action="store_true", help="time every candidate")
        if name == "validate":
            step.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.command == "tune":
        from flashoverlap.tune.tuner import main as tune_main

        return tune_main(args)
    if args.command == "demo":
        from flashoverlap.demo import main as demo_main

        return demo_main(args.m, args.n, args.k, args.dtype, args.world_size, args.cpu, args.op)
    return 2


if __name__ == "__main__":
    sys.exit(main())
