"""What every device diagnostic writes: its results file's ``meta`` and the file itself (at ``sys.argv[1]``); and the
one line it exits with where this machine has not the GPUs it needs (``require_cuda``)."""

import json
import os
import sys
import tempfile
import time

import torch


def require_cuda(name: str, gpus: int = 1, per_rank: bool = False, path_only: bool = False) -> None:
    """Exit with one line (status 1, no traceback) where this machine has fewer than ``gpus`` CUDA GPUs: a
    diagnostic's first step, before anything touches CUDA or starts a process group, so that under torchrun every
    rank exits on its own (none waits for a peer). ``per_rank``: one GPU per rank torchrun started on this node
    (``LOCAL_WORLD_SIZE``), at least ``gpus``. First, ``-h``/``--help`` prints the diagnostic's docstring (it said
    "needs CUDA" on a CPU machine, and on a GPU ran the whole diagnostic), and with ``path_only`` (its one argument
    is the results file's path) any other option is refused (``results_argument``)."""
    main = sys.modules.get("__main__")
    doc = getattr(main, "__doc__", None) or ""
    if path_only:
        results_argument(doc)
    elif any(arg in ("-h", "--help") for arg in sys.argv[1:]):
        print(doc)
        sys.exit(0)
    if per_rank:
        gpus = max(gpus, int(os.environ.get("LOCAL_WORLD_SIZE", gpus)))
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found < gpus:
        each = ", one per rank" if per_rank else ""
        raise SystemExit(f"{name}: needs {gpus} CUDA GPU{'s' if gpus > 1 else ''}{each}, found {found or 'none'}: "
                         "run it on a GPU machine, as its docstring shows")


def results_meta(command: str, gpus: str | None = None, **extra) -> dict:
    """A results file's ``meta``: the GPUs (default: this one's name), torch, the commit (``FLASHOVERLAP_COMMIT``,
    set from the tree sent: the device machine's git snapshot is stale), ``command``, the date, and ``extra``."""
    return {"gpus": gpus or torch.cuda.get_device_name(), "torch": torch.__version__,
            "commit": os.environ.get("FLASHOVERLAP_COMMIT", "unknown"), "command": command,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **extra}


def results_argument(doc: str | None) -> None:
    """A diagnostic's command line, checked before it runs: ``-h``/``--help`` prints ``doc`` and exits; any other
    option is refused (the one argument is the results file's path)."""
    arg = sys.argv[1] if len(sys.argv) > 1 else ""
    if arg in ("-h", "--help"):
        print(doc)
        sys.exit(0)
    if arg.startswith("-"):
        sys.exit(f"unknown option {arg}: the one argument is the results file's path (or none)")


def out_path(text: str) -> str:
    """An argparse type for a results file a diagnostic opens for writing itself (no folder is made): refused at
    once where that ``open`` would fail later, after its measurements: a folder, a folder that does not exist or
    one not writable."""
    import argparse

    folder = os.path.dirname(os.path.abspath(text))
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is a folder; name the file")
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"{folder} is not a folder (create it first)")
    if not os.access(text if os.path.exists(text) else folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text if os.path.exists(text) else folder} is not writable")
    return text


def in_path(text: str) -> str:
    """An argparse type for a file a diagnostic reads (``--refit``): one that exists."""
    import argparse

    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"{text}: no such file")
    return text


def write_results(results: dict) -> None:
    """Write ``results`` as JSON to the path the command line gives (``sys.argv[1]``), where it gives one."""
    results_argument(None)  # never a file named after an option
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f, indent=1)


def in_one_rank_nccl_group(main):
    """``main()`` on GPU 0 inside a one-rank NCCL group (file rendezvous in a temporary directory), which is destroyed
    after it; returns what ``main`` returns."""
    import torch.distributed as dist

    torch.cuda.set_device(0)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl", init_method=f"file://{tmp}/rv", rank=0, world_size=1,
                                device_id=torch.device("cuda", 0))
        try:
            return main()
        finally:
            dist.destroy_process_group()


def one_gpu_setup(replay: bool) -> tuple[torch.device, int, torch.Generator]:
    """A one-GPU diagnostic's start: the library's replay switch set (``FLASHOVERLAP_REPLAY``, read again), and GPU 0,
    its SM count and a generator on it seeded 0."""
    from flashoverlap import settings

    os.environ["FLASHOVERLAP_REPLAY"] = "1" if replay else "0"
    settings.refresh()
    device = torch.device("cuda", 0)
    return (device, torch.cuda.get_device_properties(device).multi_processor_count,
            torch.Generator(device=device).manual_seed(0))


def one_rank_nccl_diagnostic(name: str, main) -> None:
    """A one-GPU diagnostic's whole run: refuse without a GPU, ``main()`` in a one-rank NCCL group, its result
    written as JSON to ``sys.argv[1]`` where given."""
    require_cuda(name, path_only=True)
    result = in_one_rank_nccl_group(main)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(result, f, indent=1)
