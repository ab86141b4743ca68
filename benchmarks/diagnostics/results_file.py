"""What every device diagnostic writes: its results file's ``meta`` and the file itself (at ``sys.argv[1]``)."""

import json
import os
import sys
import time

import torch


def results_meta(command: str, gpus: str | None = None, **extra) -> dict:
    """A results file's ``meta``: the GPUs (default: this one's name), torch, the commit (``FLASHOVERLAP_COMMIT``,
    set from the tree sent: the device machine's git snapshot is stale), ``command``, the date, and ``extra``."""
    return {"gpus": gpus or torch.cuda.get_device_name(), "torch": torch.__version__,
            "commit": os.environ.get("FLASHOVERLAP_COMMIT", "unknown"), "command": command,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **extra}


def write_results(results: dict) -> None:
    """Write ``results`` as JSON to the path the command line gives (``sys.argv[1]``), where it gives one."""
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f, indent=1)
