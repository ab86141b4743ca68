"""What README.md, docs/ and the ops' docstrings say about fp8 and about ``torch.compile`` agrees with itself and with
the code: the fp8 statements name exactly the overlapped paths ``runtime.policy.FP8_PATHS`` lists, and say that
``path="auto"`` takes P2P on one node as the policy does; the compile statements name the one exception the MoE
code makes (an exact-mode layout is a graph break) and that the fp8 ops leave autograd to the styles; the op names
docs/usage.md gives ``default_plan`` are the ones it takes, and what it says ``path="auto"`` logs is what a CPU call
logs (nothing)."""

import inspect
import re
from pathlib import Path

import flashoverlap as fo
import flashoverlap.ops.moe as moe_ops
import flashoverlap.ops.scaled as scaled_ops
from flashoverlap.runtime import policy

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
USAGE = (ROOT / "docs" / "usage.md").read_text()


def _section(text: str, heading: str) -> str:
    """A Markdown section's text, from its heading to the next heading of the same level."""
    start = re.search(rf"^{re.escape(heading)}$", text, re.M).start()
    level = heading.split(" ")[0]
    end = text.find(f"\n{level} ", start + len(heading))
    return text[start : end if end >= 0 else None]


def _readme_fp8() -> str:
    """README's fp8 item of its known limits."""
    limits = _section(README, "## Known limits")
    return next(item for item in re.split(r"\n- ", limits) if item.startswith("fp8 "))


FP8_STATEMENTS = {
    "README.md, Known limits": _readme_fp8,
    "docs/usage.md, fp8": lambda: _section(USAGE, "## fp8"),
    "ops/scaled.py": lambda: scaled_ops.__doc__,
    "scaled_gemm_all_reduce's docstring": lambda: inspect.getdoc(fo.scaled_gemm_all_reduce),
}


def _paths_named(text: str) -> set[str]:
    """The paths a text names: P2P, NCCL, ring (``NCCL_P2P_DISABLE`` and ``NCCL group`` are no path)."""
    text = re.sub(r"NCCL (group|collectives?)", "", text)
    return {name.lower() for name in re.findall(r"\b(P2P|NCCL|ring)\b", text)}


def test_every_fp8_statement_names_the_paths_the_policy_runs_fp8_on():
    assert set(policy.FP8_PATHS) <= set(policy.CALL_PATHS)
    for where, statement in FP8_STATEMENTS.items():
        named = _paths_named(statement())
        assert named == set(policy.FP8_PATHS), f"{where} names the fp8 paths {sorted(named)}, the policy runs fp8 " \
                                               f"on {sorted(policy.FP8_PATHS)}"


def test_what_the_fp8_statements_say_of_path_auto_is_what_the_policy_does():
    one_node = policy.automatic_path(None, 2, fp8=True)[0]
    assert one_node == ("p2p" if "p2p" in policy.FP8_PATHS else "nccl")
    assert policy.automatic_path(None, 2, nccl_p2p_disabled=True, fp8=True)[0] == "nccl"
    assert policy.automatic_path("no peer access between GPUs 0 and 1", 2, fp8=True)[0] == "nccl"
    for where, statement in FP8_STATEMENTS.items():
        if where.startswith("ops/"):
            continue  # the module's summary names the paths only
        text = " ".join(statement().split())
        assert re.search(r'path="auto"`* (takes|chooses)', text), f"{where} does not say what path=\"auto\" takes"
        assert "one node" in text and "as for bf16" in text, f"{where}: P2P on one node, as for bf16"


def test_the_fp8_ops_autograd_and_install_statements_agree():
    assert "take no part in autograd" in scaled_ops.__doc__
    assert "all but the fp8\nops have autograd" in README or "all but the fp8 ops have autograd" in README
    assert "take no part in autograd" in _section(USAGE, "## fp8")
    for text in (scaled_ops.__doc__, _section(USAGE, "## fp8")):  # and what a gradient-needing operand gets
        assert "requires grad raises, naming it" in " ".join(text.split())
    for text in (README, USAGE):
        assert "pip install flashoverlap[" not in text  # the package index does not serve flashoverlap


def test_the_compile_statements_name_the_exact_mode_graph_break_the_code_makes():
    source = inspect.getsource(moe_ops)
    assert "torch.compiler.disable" in source and "graph break" in moe_ops.__doc__
    readme = " ".join(README.split())
    assert "torch.compile(fullgraph=True)` and in CUDA graphs, except an exact-mode MoE layout" in readme
    usage = " ".join(USAGE.split())
    assert "a graph break under `torch.compile` and cannot be captured" in usage
    assert "under `torch.compile` it is a graph break" in usage
    assert "bounded" in readme and "bounded mode" in usage


def test_the_op_names_usage_gives_default_plan_are_the_ones_it_takes():
    # The ops are called by their API names everywhere else (`gemm_all_reduce`, `tune plan --op gemm_all_reduce`);
    # default_plan takes the plan's short names, so the sentence that shows it must say which.
    from flashoverlap.plan import OPS

    sentence = " ".join(USAGE[USAGE.index("`fo.default_plan(") :].split("\n\n")[0].split())
    named = tuple(re.findall(r'`"([a-z_]+)"`', sentence.split("builds the untuned one")[0]))
    assert named == OPS, f"docs/usage.md names default_plan's op as {named}; it takes {OPS}"
    for op in named:
        assert fo.default_plan(op, 64, 64, 64, 2).op == op


def _auto_path_log(rank: int, world_size: int) -> list[str]:
    """What logger ``flashoverlap`` records at DEBUG while this rank calls each op with CPU tensors, no plan."""
    import logging

    import torch

    records: list[str] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("flashoverlap")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    a, b = torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(8, 4, dtype=torch.bfloat16)
    fo.gemm_all_reduce(a, b), fo.gemm_reduce_scatter(a, b), fo.all_gather_gemm(a, b)
    return records


def test_what_usage_says_path_auto_logs_is_what_it_logs_on_the_cpu():
    from flashoverlap.testing import spawn

    paths = " ".join(_section(USAGE, "## Paths").split())
    assert "logged once per group and op at debug level" in paths
    assert spawn(_auto_path_log, 2, "gloo") == [[], []]  # nothing to choose: the reference path, unlogged
    assert "CPU tensors, fp32 and a given plan leave nothing to choose, and log nothing" in paths, \
        "docs/usage.md says path='auto' logs its choice; on CPU tensors it logs nothing: say so"
