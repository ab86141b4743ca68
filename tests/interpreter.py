"""The interpreted kernel cases' harness: whether this machine's Triton interpreter can run them (Triton 3.6's fails
with numpy >= 2.4, the GPU machines' pair; the Triton that installs on CPU machines today, 3.9, does not), and a
module's output under ``TRITON_INTERPRET=1``."""

import atexit
import json
import os
import select
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import numpy as np
import pytest


def _release(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(".")[:2])


INTERPRETER_OK = _release(np.__version__) < (2, 4) or _release(version("triton")) >= (3, 9)
needs_interpreter = pytest.mark.skipif(
    not INTERPRETER_OK, reason=f"Triton {version('triton')}'s interpreter needs numpy < 2.4: {np.__version__}")


ROOT = Path(__file__).resolve().parent.parent

# The interpreter server: one child, started with TRITON_INTERPRET=1, that imports torch and triton once and forks a
# process per module asked for (``python -m module`` as that process's ``__main__``), so that the interpreted test
# modules do not each pay the imports (about 2.7 s a child on two cores). It forks before anything computes (no
# thread pool yet). Linux only; elsewhere each module runs in a fresh ``python -m``.
_SERVER_CODE = r"""
import json, os, runpy, sys, tempfile, traceback
import torch, triton  # noqa: F401
for line in sys.stdin:
    module = line.strip()
    out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    pid = os.fork()
    if pid == 0:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        code = 0
        try:
            sys.argv = [module]
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    out.seek(0)
    err.seek(0)
    reply = {"code": os.waitstatus_to_exitcode(status), "out": out.read().decode(errors="replace"),
             "err": err.read().decode(errors="replace")[-4000:]}
    print(json.dumps(reply), flush=True)
"""
_server: subprocess.Popen | None = None


def _stop_server() -> None:
    global _server
    if _server is not None:
        _server.stdin.close()
        try:
            _server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            _server.kill()
            _server.wait()
        _server = None


atexit.register(_stop_server)  # whichever server is running when the session ends


def interpreted_output(module: str, timeout: float = 600) -> str:
    """The standard output of ``python -m module`` under ``TRITON_INTERPRET=1`` (a process forked from the
    interpreter server where it can); the module must exit 0."""
    global _server
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    if not hasattr(os, "fork"):
        proc = subprocess.run([sys.executable, "-m", module], capture_output=True, text=True, timeout=timeout,
                              env=env, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr[-4000:]
        return proc.stdout
    if _server is None or _server.poll() is not None:
        _server = subprocess.Popen([sys.executable, "-c", _SERVER_CODE], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    _server.stdin.write(module + "\n")
    _server.stdin.flush()
    ready, _, _ = select.select([_server.stdout], [], [], timeout)
    if not ready:  # the module hangs: the server waits on it; end both, the next call starts a new server
        _server.kill()
        _server.wait()
        _server = None
        raise AssertionError(f"{module}: no result within {timeout} s under the interpreter")
    line = _server.stdout.readline()
    if not line:  # the server itself ended (killed from outside): the next call starts a new one
        _server.wait()
        _server = None
        raise AssertionError(f"{module}: the interpreter server ended before it answered")
    reply = json.loads(line)
    assert reply["code"] == 0, reply["err"]
    return reply["out"]


def interpreted_json(module: str, timeout: float = 600) -> object:
    """Run ``python -m module`` with ``TRITON_INTERPRET=1`` (``interpreted_output``) and return the JSON its last
    line of output holds."""
    return json.loads(interpreted_output(module, timeout).strip().splitlines()[-1])


def interpreted_lines(module: str, timeout: float = 600) -> list:
    """The JSON rows (lines starting with ``{``) that ``python -m module`` prints under the interpreter."""
    return [json.loads(line) for line in interpreted_output(module, timeout).splitlines() if line.startswith("{")]


def interpreted_rows(module: str, timeout: float = 600) -> dict:
    """``interpreted_lines``' rows by their ``name``."""
    return {row["name"]: row for row in interpreted_lines(module, timeout)}
