"""Every option of the benchmarks, and the strict value parsers that every command shares.

The benchmark modules (``python -m flashoverlap.bench``, ``.bench.block``, ``.bench.moe``) and the command line
(``flashoverlap bench ops|block|moe``, ``demo``, ``tune``) take their options from here, so that ``--help`` lists the
same options everywhere; this module imports nothing of flashoverlap and no torch, so that both sides import it and
neither imports the other (``cli`` hands a benchmark its arguments; a benchmark never reaches back into ``cli``).

Values are parsed by one function each (``shape`` for ``M,N,K``, ``shapes`` for ``M,N,K;M,N,K``,
``positive_ints`` for comma-separated counts), strictly: ASCII digits only, so ``1_6`` is refused rather than read
as 16. A value that starts with ``-`` (``--shape -8,8,8``) reaches its parser and gets its message instead of
argparse's "expected one argument" (``join_values``).
"""

from __future__ import annotations

import argparse
import re

OPS = ["all_reduce", "reduce_scatter", "all_gather"]
DTYPES = ["bfloat16", "float16"]
# The MoE benchmark's choices, by name (bench/moe.py holds what they mean; a test checks the two agree).
MOE_CONFIGS = ["mixtral", "qwen3-30b-a3b", "deepseek-v3"]
MOE_ROUTINGS = ["balanced", "zipf"]
MOE_MODES = ["exact", "bounded"]
MOE_PATHS = ["auto", "nccl", "p2p", "reference"]
MOE_PASSES = ["forward", "forward+backward"]
# Options whose value may start with "-" (a mistyped negative dimension): joined to their option before parsing.
_VALUE_OPTIONS = ("--shape", "--shapes", "--tokens", "--world-size", "--top", "--max-mib", "--iters", "--steps",
                  "--decode-tokens", "--sweep-iters", "--sweep-groups", "--sweep-ctas", "--warmup")
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


# -- the benchmarks' options -----------------------------------------------------------------------------------
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


def add_bench_moe_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of the MoE layer benchmark. Lists are space-separated (``--paths auto nccl``), as the two-GPU run's
    script passes them."""
    def names(flag: str, choices: list[str], default: list[str], what: str, metavar: str) -> None:
        parser.add_argument(flag, nargs="+", choices=choices, default=default, metavar=metavar,
                            help=f"{what}, space-separated, from {', '.join(choices)} (default: "
                                 f"{' '.join(default)})")

    names("--configs", MOE_CONFIGS, MOE_CONFIGS, "model configs", "CONFIG")
    parser.add_argument("--tokens", nargs="+", type=positive, default=[4096, 16384], metavar="T",
                        help="tokens per rank, space-separated (default: 4096 16384)")
    names("--routings", MOE_ROUTINGS, MOE_ROUTINGS, "routings", "ROUTING")
    names("--modes", MOE_MODES, MOE_MODES, "uneven-split modes", "MODE")
    names("--paths", MOE_PATHS, ["auto"], "paths", "PATH")
    names("--passes", MOE_PASSES, MOE_PASSES, "passes", "PASS")
    parser.add_argument("--warmup", type=non_negative, default=3, help="untimed calls first (default 3)")
    parser.add_argument("--iters", type=positive, default=20, help="timed calls per figure (default 20)")
    parser.add_argument("--out", default=None,
                        help="results JSON (default benchmarks/results/<gpu>x<W>-<setting>-moe.json)")

