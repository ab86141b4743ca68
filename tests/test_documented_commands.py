"""Every command README.md and docs/ name (``flashoverlap ...``, ``python -m ...``, ``torchrun ... -m ...``, and the
scripts they run with ``python``/``torchrun``) does what the docs say or says in one line why it cannot here.

The commands are collected from the documents themselves (code spans and shell blocks, the rendered sources
included), so a renamed command or option fails here. Each runs in this process (``runpy``, as ``python -m`` or
``python FILE`` would, and a command that execs another, ``python -m benchmarks.block`` say, runs that here too; a
fresh interpreter per command would cost seconds each), in a scratch directory, as rank 0 of ``torchrun`` where the
docs launch it so, and with CUDA reported absent, so that a GPU machine checks the same:

- a command that needs GPUs must parse every documented option (a renamed one is a usage error, and fails), then
  exit non-zero with one line saying why it cannot run here (no GPU; the harness not installed: then how to run it);
- a command the CPU can run runs and prints what it did (none may exit 0 having done nothing);
- a syntax summary (``[--op OP]``, ``ops|block|moe``) and a command too long to run here (``HELP_ONLY``) must list
  every option it names in its ``--help``, and name every option its ``--help`` shows as required;
- ``examples/`` scripts are run end to end by ``tests/test_examples.py``, which must know each.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import runpy
import shlex
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Commands whose real run is long on the CPU (installs, the mutation run, a CPU measurement that rewrites a results
# file): their documented options are checked against --help instead.
HELP_ONLY = {"benchmarks/cpu_install.py": "creates virtual environments and installs torch (minutes)",
             "benchmarks/host_python.py": "a CPU measurement, minutes, writing a results file",
             "benchmarks/fp8_moe_host_python.py": "a CPU measurement, minutes, writing a results file",
             "benchmarks/nccl_host_python.py": "a CPU measurement that fakes torch.cuda for its process, writing a "
                                              "results file",
             "tools/mutate.py": "runs the test suite once per mutation (about 30 minutes on 2 cores)",
             "tools/fuzz_agreement.py": "hundreds of multi-process trials (minutes)"}
# The CPU measurements above that still run here, at their smallest (each in a fresh interpreter: they fake
# torch.cuda for their process), with the documented options: what each adds to make it seconds.
SMALLEST = {"benchmarks/host_python.py": (),
            "benchmarks/nccl_host_python.py": ("--repeat", "1", "--windows", "1", "--calls", "1"),
            "benchmarks/fp8_moe_host_python.py": ("--repeat", "1", "--windows", "1", "--calls", "1")}
# Commands the docs name that still fail on a CPU machine (with a traceback, or with a status that means something
# else), each in files outside this test's owners' reach: the reason, and whose change fixes it. Each still runs, as
# a strict expected failure: once fixed, it fails here until removed from this table.
PENDING: dict[str, str] = {}


def _readme_tables():
    spec = importlib.util.spec_from_file_location("readme_tables", ROOT / "benchmarks" / "readme_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# A results file's record of a command whose module has moved since (the renderer's table: recorded prefix -> the
# current one): the record stays as measured, and its source line must name the current command beside it, which
# runs here as any other.
MOVED = _readme_tables().MOVED
LAUNCHERS = ("flashoverlap", "python", "python3", "torchrun")
_ENV = re.compile(r"^[A-Z_][A-Z0-9_]*=\S*$")
_PLACEHOLDER = re.compile(r"^(?:[A-Z][A-Z_]*|M,N,K|<\w+>)$")  # OP, M,N,K, FILE, <sha>: a syntax summary's


@dataclass(frozen=True)
class Command:
    """A documented command: where it is written, as written, and what it runs."""

    where: str
    text: str
    torchrun: bool  # launched as torchrun's ranks
    module: str | None  # python -m MODULE (flashoverlap's console script is ``-m flashoverlap``)
    script: str | None  # python SCRIPT (a path from the repository's root)
    args: tuple[str, ...]
    summary: bool  # a syntax summary ([--op OP], a|b), not a command to run as it stands

    @property
    def target(self) -> str:
        return self.module or self.script or ""


SHELL_BLOCKS = ("", "bash", "sh", "shell", "console")  # the fenced blocks whose lines are commands


def _candidates(text: str) -> list[tuple[int, str]]:
    """(line, text) of every code span and every line of every fenced shell block."""
    found = []
    # Every fenced block, whatever its language, so that a closing fence is never taken for an opening one (a
    # pattern that matched only shell openings paired a ```python block's closing fence with the next block's
    # opening, and skipped every shell block after it); then the shell ones.
    for block in re.finditer(r"^```(\w*)[^\n]*\n(.*?)^```", text, re.S | re.M):
        if block.group(1) not in SHELL_BLOCKS:
            continue
        body = block.group(2).replace("\\\n", " ")
        first = text.count("\n", 0, block.start()) + 2
        found += [(first + i, line.split(" #", 1)[0]) for i, line in enumerate(body.split("\n"))]
    outside = re.sub(r"^```.*?^```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S | re.M)
    # a code span may wrap onto the next line (markdown joins it with a space)
    found += [(outside.count("\n", 0, m.start()) + 1, m.group(1).replace("\n", " "))
              for m in re.finditer(r"`([^`\n]+(?:\n[^`\n]+)?)`", outside)]
    return found


def _parse(where: str, text: str) -> list[Command]:
    """The commands ``text`` spells (alternatives ``a|b`` each), or none where it is no command of ours."""
    text = text.replace("\\|", "|").strip()
    summary = any(mark in text for mark in ("[", "|", "..."))
    try:
        words = shlex.split(text.replace("[", " ").replace("]", " ").replace("...", " "))
    except ValueError:
        return []
    while words and _ENV.match(words[0]):
        words = words[1:]
    if not words or words[0] not in LAUNCHERS:
        return []
    launcher, rest = words[0], words[1:]
    torchrun = launcher == "torchrun"
    if torchrun:
        while rest and rest[0].startswith("--") and rest[0] != "-m":  # torchrun's own options
            rest = rest[2:] if "=" not in rest[0] and len(rest) > 1 and not rest[1].startswith("-") else rest[1:]
    if launcher == "flashoverlap":
        if not rest or rest[0].split("|")[0] not in ("demo", "bench", "tune", "version"):
            return []
        module, script, args = "flashoverlap", None, rest
    elif rest[:1] == ["-m"] and len(rest) > 1:
        module, script, args = rest[1], None, rest[2:]
    elif rest and rest[0].endswith(".py"):
        module, script, args = None, rest[0], rest[1:]
    else:
        return []
    if module is not None and not module.startswith(("flashoverlap", "benchmarks")):
        return []
    summary = summary or any(_PLACEHOLDER.match(arg) for arg in args)
    alternatives = [[]]
    for arg in args:
        alternatives = [done + [choice] for done in alternatives for choice in arg.split("|")]
    return [Command(where, text, torchrun, module, script, tuple(a), summary) for a in alternatives]


def documented_commands() -> list[Command]:
    commands = []
    for doc in DOCS:
        for line, text in _candidates(doc.read_text()):
            commands += _parse(f"{doc.relative_to(ROOT)}:{line}", text)
    return commands


COMMANDS = documented_commands()
_UNIQUE = list({(c.target, c.args, c.torchrun, c.summary): c for c in COMMANDS}.values())


def _options(args: tuple[str, ...]) -> list[str]:
    return [arg.split("=", 1)[0] for arg in args if arg.startswith("--")]


def _required(help_text: str) -> list[str]:
    """The options argparse's usage line shows outside brackets: those the command cannot run without."""
    usage = help_text.split("usage:", 1)[-1].split("\n\n", 1)[0]
    while (bare := re.sub(r"\[[^\[\]]*\]|\([^()]*\)", " ", usage)) != usage:  # optional groups, and choices
        usage = bare
    return re.findall(r"(?<![\w-])--[a-z][\w-]*", usage)


def test_shell_blocks_after_other_blocks_are_collected():
    text = ("```python\nx = 1\n```\n\nprose\n\n```bash\nflashoverlap demo  # a comment\n```\n\n"
            "```text\nflashoverlap version\n```\n")
    lines = [(line, found.strip()) for line, found in _candidates(text) if found.strip()]
    assert lines == [(8, "flashoverlap demo")], lines
    readme = {c.text.strip() for c in COMMANDS if c.where.startswith("README.md:")}
    assert {"flashoverlap demo", "flashoverlap demo --op moe"} <= readme, "README's Try it block is not collected"


def _description(help_text: str) -> str:
    """argparse's description: the paragraphs between the usage lines and the first heading (``options:``)."""
    after_usage = help_text.split("usage:", 1)[-1].split("\n\n", 1)[1:]
    text = after_usage[0] if after_usage else ""
    return re.split(r"^\S[^\n]*:$", text, maxsplit=1, flags=re.M)[0].strip()


def _cut_description(help_text: str, script: str | None) -> str | None:
    """The description of a ``--help`` whose program's docstring it begins but stops short of that docstring's first
    paragraph (a description taken as ``__doc__.split("\\n")[0]``: a sentence cut at the line's end), else None."""
    import ast

    prog = re.search(r"usage: (?:python -m (\S+)|(\S+))", help_text)
    if prog and prog.group(1):
        spec = importlib.util.find_spec(prog.group(1))
        path = Path(spec.origin) if spec and spec.origin else None
    else:
        path = ROOT / script if script else None
    if path is None or not path.is_file():
        return None
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    paragraph, described = " ".join(doc.split("\n\n")[0].split()), " ".join(_description(help_text).split())
    return described if described and paragraph.startswith(described) and described != paragraph else None


def test_required_options_are_read_from_the_usage_line():
    assert _required("usage: x [-h] --label LABEL [--out OUT] [--shape M,N,K [M,N,K ...]] {a,b}\n\nmore --no") \
        == ["--label"]
    assert _required("usage: x [-h] [--label LABEL]\n   [--mode (a | --b)]\n") == []


@contextlib.contextmanager
def _as_launched(monkeypatch, tmp_path, command: Command, args: tuple[str, ...]):
    """This process as the command's: its argv, a scratch directory (relative output paths land there), torchrun's
    variables for rank 0 where the docs launch it so, and no CUDA."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    if command.torchrun:
        for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1"),
                            ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29599")):
            monkeypatch.setenv(name, value)
    else:
        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
            monkeypatch.delenv(name, raising=False)
    for arg in args:  # an output file's folder, as in a checkout
        if "/" in arg and not arg.startswith(("-", "/")):
            (tmp_path / arg).parent.mkdir(parents=True, exist_ok=True)
    monkeypatch.setattr(sys, "argv", [command.module or str(ROOT / command.script), *args])

    def become(path, argv, env=None):  # os.execv(e) of `python -m MODULE ARGS`: run it here instead
        assert argv[1] == "-m", argv
        monkeypatch.setattr(sys, "argv", [argv[2], *argv[3:]])
        runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
        raise SystemExit(0)

    monkeypatch.setattr(os, "execv", become)
    monkeypatch.setattr(os, "execve", become)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # runpy: "found in sys.modules" for an imported module
        yield


def _run(command: Command, args: tuple[str, ...]) -> object:
    """The command's exit status (SystemExit's code, or 0 where it returns); any other exception propagates."""
    try:
        if command.module is not None:
            runpy.run_module(command.module, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(str(ROOT / command.script), run_name="__main__")
    except SystemExit as stop:
        return 0 if stop.code is None else stop.code
    return 0


def test_the_docs_name_the_commands_this_test_knows():
    targets = {c.target for c in COMMANDS}
    for needed in ("flashoverlap", "flashoverlap.bench"):
        assert needed in targets, f"no documented command runs {needed}: is the collector broken?"
    assert any(c.args[:1] == ("demo",) and not c.summary for c in COMMANDS)
    assert any(c.args[:2] == ("bench", "block") for c in COMMANDS) and any(c.args[:2] == ("tune", "validate")
                                                                           for c in COMMANDS)
    stale = sorted(set(PENDING) - targets)
    assert not stale, f"PENDING names commands no document names any more (remove them): {stale}"
    assert set(HELP_ONLY) <= targets, sorted(set(HELP_ONLY) - targets)


def _moved(command: Command) -> tuple[str, str] | None:
    """(recorded prefix, current prefix) where ``command`` is a moved module's recorded command."""
    spelled = " ".join(("python", "-m", command.module)) if command.module else ""
    return next(((old, now) for old, now in MOVED.items() if spelled == old), None)


def test_every_moved_command_has_moved():
    assert MOVED, "the renderer's MOVED table is gone: is this test's import of it broken?"
    for old, now in MOVED.items():
        assert importlib.util.find_spec(now.split()[-1]) is not None, f"{now}: no such module"
        with contextlib.suppress(ModuleNotFoundError):
            assert importlib.util.find_spec(old.split()[-1]) is None, f"{old}: the module is still there"


def test_a_recorded_command_that_runs_another_program_now_is_shown_with_the_one_that_ran():
    """``python -m flashoverlap.bench`` ran the harness when the two-GPU files were written and runs the installed
    ``bench ops`` now: their source lines name ``benchmarks.ops`` beside it (a module that exists), and only that
    invocation (not ``flashoverlap.bench.block``, an older module's)."""
    tables = _readme_tables()
    for old, now in tables.RESPELT.items():
        assert importlib.util.find_spec(now.split()[-1]) is not None, f"{now}: no such module"
        assert importlib.util.find_spec(old.split()[-1]) is not None, f"{old}: gone: it belongs in MOVED"
    recorded = "NCCL_P2P_DISABLE=1 torchrun --nproc-per-node 2 -m flashoverlap.bench --ops all_reduce"
    assert "`NCCL_P2P_DISABLE=1 torchrun --nproc-per-node 2 -m benchmarks.ops --ops all_reduce` runs what wrote" in \
        tables._command(recorded)
    assert tables._command("torchrun --nproc-per-node 2 -m flashoverlap.bench").endswith(
        "`torchrun --nproc-per-node 2 -m benchmarks.ops` runs what wrote this)")
    assert tables._command("torchrun -m flashoverlap.bench.block") == "`torchrun -m flashoverlap.bench.block`"
    # With the harness's own options the recorded command still runs the harness (bench ops hands them on): as is.
    timeline = "torchrun --nproc-per-node 2 -m flashoverlap.bench --ops all_reduce --timeline /tmp/t.png"
    assert tables._command(timeline) == f"`{timeline}`"


def test_every_moved_command_is_named_beside_the_current_one():
    for command in COMMANDS:
        if (moved := _moved(command)) is None:
            continue
        old, now = moved
        doc, line = command.where.rsplit(":", 1)
        text = (ROOT / doc).read_text().split("\n")[int(line) - 1]
        current = now + command.text.strip()[len(old):]
        assert f"`{current}`" in text, f"{command.where}: `{command.text}` (moved) without `{current}` beside it"


def _smallest(command: Command, out: Path) -> list[str]:
    """``command``'s documented options with its own label and results file, and SMALLEST's in place of its size."""
    args, rest = [], list(command.args)
    while rest:
        arg = rest.pop(0)
        if arg in ("--label", "--out", "--repeat", "--windows", "--calls"):
            rest.pop(0)  # its value
        elif not arg.startswith("--") and not _PLACEHOLDER.match(arg):
            raise AssertionError(f"{command.where}: {command.text}: {arg} (this test knows no such word)")
        else:
            args.append(arg)
    return [*args, "--label", "docs-check", "--out", str(out), *SMALLEST[command.script]]


@pytest.mark.parametrize("script", sorted(SMALLEST))
def test_every_documented_cpu_measurement_runs_at_its_smallest(script, tmp_path):
    """A HELP_ONLY CPU measurement still measures on the CPU (fp8_moe_host_python.py's stand-ins once stubbed the
    kernels but not their direct launchers: on a CPU machine every run ended in Triton's "0 active drivers")."""
    import json

    assert set(SMALLEST) <= set(HELP_ONLY)
    commands = [c for c in COMMANDS if c.script == script]
    assert commands, f"no document names {script} any more: remove it from SMALLEST"
    # The command with the most options (their other forms' options are checked against --help above): seconds each.
    command = max(commands, key=lambda c: len(_options(c.args)))
    out = tmp_path / "rows.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(ROOT / script), *_smallest(command, out)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=240)
    shown = f"{command.where}: `{command.text}` exited {proc.returncode}\n{proc.stdout[-1500:]}\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, shown
    rows = json.loads(out.read_text())["rows"]
    assert rows and all(row.get("label", row.get("mode")) == "docs-check" for row in rows), shown


def test_every_documented_example_is_run_by_the_examples_test():
    from tests.test_examples import NOT_RUN, RUN

    for command in COMMANDS:
        if command.script and command.script.startswith("examples/"):
            name = command.script.removeprefix("examples/")
            assert name in RUN or name in NOT_RUN, f"{command.where}: {command.text}: {name} is not run anywhere"


def _split_by_the_shell(text: str) -> bool:
    """Whether a shell would cut ``text`` into several commands or pipe or background it where a word holds one of
    ``; & |`` unquoted (``--shapes 16,8,8;32,8,8`` runs ``32,8,8`` as a command): this test's own parsing
    (``shlex.split``) keeps such a word whole, so it would run what a pasted line does not."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    tokens = list(lexer)
    return any(set(token) <= set(";&|") for token in tokens) and not re.search(r"(^|\s)(;|&&|\|\|?|&)(\s|$)", text)


def test_every_documented_command_runs_as_one_command_in_a_shell():
    assert _split_by_the_shell("python -m x --shapes 16,8,8;32,8,8")  # the check itself
    assert not _split_by_the_shell("python -m x --shapes '16,8,8;32,8,8'")
    bad = [f"{c.where}: {c.text}" for c in COMMANDS if not c.summary and _split_by_the_shell(c.text)]
    assert not bad, "documented commands a shell would cut apart (quote the word):\n" + "\n".join(bad)


@pytest.mark.parametrize("command", _UNIQUE, ids=lambda c: f"{c.where}:{c.target}:{' '.join(c.args)[:40]}")
def test_every_documented_command_runs_or_says_why_not(command, monkeypatch, tmp_path, capsys, request):
    if command.script and command.script.startswith("examples/"):
        return  # tests/test_examples.py runs them (the test above checks that it knows each)
    if _moved(command):
        return  # a record of a moved module: the test above checks that the current command is named beside it
    if command.target in PENDING:
        request.applymarker(pytest.mark.xfail(reason=f"pending: {PENDING[command.target]}", strict=True))
    if command.script is not None:
        assert (ROOT / command.script).is_file(), f"{command.where}: {command.script} does not exist"
    if command.summary or command.target in HELP_ONLY:
        args = tuple(arg for arg in command.args if not arg.startswith("-") and not _PLACEHOLDER.match(arg))
        args = args[:2] if command.module == "flashoverlap" else ()  # the subcommand's own --help
        with _as_launched(monkeypatch, tmp_path, command, (*args, "--help")):
            code = _run(command, (*args, "--help"))
        out = capsys.readouterr().out
        assert code == 0, f"{command.where}: `{command.text}`: --help exited {code}"
        cut = _cut_description(out, command.script)
        assert cut is None, f"{command.where}: `{command.text}`: --help's description stops mid-sentence: {cut!r}"
        missing = [opt for opt in _options(command.args) if opt not in out]
        assert not missing, f"{command.where}: `{command.text}` names {missing}, which its --help does not list"
        # a summary naming no option is a mention of the command (`flashoverlap tune bandwidth|plan`), not a line
        named = _options(command.args)
        left_out = [opt for opt in _required(out) if opt not in named] if named or not command.summary else []
        assert not left_out, f"{command.where}: `{command.text}` leaves out {left_out}, which it requires"
        return
    with _as_launched(monkeypatch, tmp_path, command, command.args):
        code = _run(command, command.args)
    out, err = capsys.readouterr()
    shown = f"{command.where}: `{command.text}` exited {code!r}\n{out[-2000:]}\n{err[-2000:]}"
    assert "Traceback" not in err, shown
    if code == 0:
        assert out.strip(), f"{command.where}: `{command.text}` exited 0 having printed nothing"
        return
    assert code != 2 and "unrecognized arguments" not in err and "invalid choice" not in err, shown
    message = code if isinstance(code, str) else err.strip()
    assert message and "\n" not in message.strip(), f"not one line: {shown}"
    assert re.search(r"CUDA|GPU|torchrun|harness|source checkout", message), shown


def _checked_words(script: Path) -> dict[str, set[str]]:
    """What ``script`` accepts in each variable it passes to ``steps.sh``'s ``check_words VAR NOUN KNOWN``: KNOWN's
    words (a literal list, or the script's own ``KNOWN_STEPS``-style variable)."""
    text = script.read_text()
    accepted = {}
    for name, known in re.findall(r'\bcheck_words (\w+) \w+ "([^"]*)"', text):
        listed = re.fullmatch(r"\$\{?(\w+)\}?", known)
        if listed:
            known = re.search(rf'^{listed.group(1)}="([^"]*)"', text, re.M).group(1)
        accepted[name] = set(known.split())
    return accepted


def _device_script_calls() -> list[tuple[str, str, dict[str, str]]]:
    """(where, script, {VAR: value}) of every ``VAR=value ... bash benchmarks/SCRIPT.sh`` the docs write."""
    calls = []
    for doc in DOCS:
        for line, text in _candidates(doc.read_text()):
            for match in re.finditer(r"((?:[A-Z_][A-Z0-9_]*=(?:\"[^\"]*\"|'[^']*'|\$\([^)]*\)|\S*)\s+)*)"
                                     r"bash\s+(benchmarks/[\w-]+\.sh)", text):
                env = dict(re.findall(r"([A-Z_][A-Z0-9_]*)=(\"[^\"]*\"|'[^']*'|\$\([^)]*\)|\S*)", match.group(1)))
                env = {name: value.strip("\"'") for name, value in env.items()}
                calls.append((f"{doc.relative_to(ROOT)}:{line}", match.group(2), env))
    return calls


def test_the_steps_and_settings_the_docs_pass_to_a_device_script_are_among_its_words():
    # A device script refuses a misspelt step or setting (tests/test_device_scripts.py), but only on a GPU machine,
    # where a misspelt documented command costs a device call: each word the docs pass is checked here, statically.
    calls = _device_script_calls()
    assert any(env for _, _, env in calls), "no documented `VAR=... bash benchmarks/*.sh` found: the pattern is stale"
    wrong = []
    for where, script, env in calls:
        path = ROOT / script
        assert path.is_file(), f"{where}: {script} does not exist"
        accepted = _checked_words(path)
        for name, value in env.items():
            if name in accepted:
                wrong += [f"{where}: {name} word {word!r} is not one of {script}'s {sorted(accepted[name])}"
                          for word in value.split() if word not in accepted[name]]
            elif re.fullmatch(r"STEPS|SETTINGS|SETTING|PATHS", name):
                wrong.append(f"{where}: {script} takes no {name} (it checks {sorted(accepted)})")
    assert not wrong, "\n".join(wrong)
