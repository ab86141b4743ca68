"""What a CPU-only machine installs, measured: fresh virtual environments in a temporary directory, each the
README's CPU install in its order (torch's CPU build first, then the package), without extras and with ``[test]``;
the size of each one's site-packages (``du``). With ``--suite``, also the time of the suite in one process (plain
``pytest``, random order) in the ``[test]`` environment: not the README's test command, which installs ``[test,hf]``
and runs two workers (``pytest -n 2``).

The README names the CPU build by its index (``pip install torch --index-url https://download.pytorch.org/whl/cpu``);
this script installs the pinned ``pip install torch==2.13.0`` as this machine's pip resolves it: the machines that
measure it hold that CPU wheel locally (pip's ``find-links``, no network to the index), where it resolves to
``torch==2.13.0+cpu`` (the packages recorded say so). Where it resolves to another build (PyPI's Linux wheel is the
CUDA one, with its ``nvidia-*`` dependencies) the run stops, naming the index: the sizes would not be the CPU
install's.

    python benchmarks/cpu_install.py [--suite] [--out benchmarks/results/cpu-install.json]

Writes the results file that README.md renders (``benchmarks/readme_tables.py``: ``cpu-install``, ``suite-time``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TORCH = "torch==2.13.0"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"  # README.md's
INSTALLS = [("", "pip install -e ."), ("[test]", 'pip install -e ".[test]"')]


def _run(cmd: list[str], **kw) -> str:
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, check=True, capture_output=True, text=True, **kw).stdout


def _site_packages(venv: Path) -> Path:
    return next(venv.glob("lib/python*/site-packages"))


def _mib(path: Path) -> int:
    return int(_run(["du", "-sk", str(path)]).split()[0]) // 1024


def _packages(python: Path) -> list[str]:
    listed = json.loads(_run([str(python), "-m", "pip", "list", "--format", "json"]))
    return sorted(f"{p['name']}=={p['version']}" for p in listed if p["name"] not in ("pip", "setuptools"))


def measure(extra: str, tmp: Path) -> tuple[dict, Path]:
    venv = tmp / f"venv{extra.strip('[]') or '-core'}"
    _run([sys.executable, "-m", "venv", str(venv)])
    python = venv / "bin" / "python"
    _run([str(python), "-m", "pip", "install", "--quiet", TORCH])
    cuda = _run([str(python), "-c", "import torch; print(torch.version.cuda)"]).strip()
    if cuda != "None":  # the measurement is the CPU install's: another build's sizes would be recorded under its name
        raise SystemExit(f"cpu_install.py: pip resolved {TORCH} to a CUDA {cuda} build, not the CPU one: make the "
                         f"CPU build the one pip finds (PIP_INDEX_URL={CPU_INDEX}, or its wheel in a find-links "
                         "folder) and run again")
    _run([str(python), "-m", "pip", "install", "--quiet", "-e", f"{ROOT}{extra}"])
    site = _site_packages(venv)
    packages = _packages(python)
    return {"extra": extra or None, "site_packages_mib": _mib(site), "packages": packages,
            "has_triton": any(p.lower().startswith("triton==") for p in packages),
            "has_cuda_bindings": any(p.lower().startswith("cuda-bindings==") for p in packages)}, python


def suite(python: Path) -> dict:
    """The suite in one process (plain ``pytest``) in that environment, timed (wall clock, and the CPU time of pytest
    and every process it started); its closing line parsed for the counts, its header for pytest-randomly's seed.
    The load average before and after is kept: other work on the machine lengthens the wall time, not the CPU
    time."""
    load_before = os.getloadavg()[0]
    cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run([str(python), "-m", "pytest", "-p", "no:cacheprovider"], cwd=ROOT, capture_output=True,
                          text=True)
    seconds = time.perf_counter() - start
    cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (cpu_after.ru_utime - cpu_before.ru_utime) + (cpu_after.ru_stime - cpu_before.ru_stime)
    tail = proc.stdout.strip().splitlines()[-1]
    seed = re.search(r"randomly-seed=(\d+)", proc.stdout)
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)", tail)}
    if proc.returncode != 0:
        print(proc.stdout[-5000:], proc.stderr[-3000:])
        raise SystemExit(f"pytest failed ({tail}); no time recorded")
    return {"command": "pytest", "seconds": round(seconds, 1), "cpu_seconds": round(cpu, 1), "counts": counts,
            "randomly_seed": int(seed.group(1)) if seed else None, "cores": os.cpu_count(),
            "load_average_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)]}


def out_file(text: str) -> str:
    """``--out``: a file this run can write once its installs are measured (minutes): not a folder, in a writable
    folder that exists."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder; name the results file")
    if not path.parent.is_dir() or not os.access(path if path.exists() else path.parent, os.W_OK):
        raise argparse.ArgumentTypeError(f"{path if path.exists() else path.parent} is not a writable folder or file")
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", action="store_true", help="also time `pytest` in the [test] environment")
    parser.add_argument("--out", type=out_file, default=str(ROOT / "benchmarks" / "results" / "cpu-install.json"),
                        help="the results file (default benchmarks/results/cpu-install.json)")
    args = parser.parse_args()
    commit = _run(["git", "-C", str(ROOT), "rev-parse", "HEAD"]).strip()
    dirty = _run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"]).strip()
    result = {"meta": {"command": "python benchmarks/cpu_install.py" + (" --suite" if args.suite else ""),
                       "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       "commit": commit + ("-dirty" if dirty else ""), "python": platform.python_version(),
                       "torch": TORCH, "machine": f"{os.cpu_count()} cores, no GPU"},
              "installs": []}
    with tempfile.TemporaryDirectory(prefix="flashoverlap-install-") as tmp:
        for extra, command in INSTALLS:
            record, python = measure(extra, Path(tmp))
            record["command"] = f"pip install {TORCH}; {command}"
            result["installs"].append(record)
            print(f"{command}: {record['site_packages_mib']} MiB", flush=True)
        if args.suite:
            result["suite"] = suite(python)
            print(f"pytest: {result['suite']['seconds']} s {result['suite']['counts']}", flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
