"""The GPU model's tag in results file names (``h100x2-nvlink.json``): the model token of the device name, lower
case. The name's last word is not it: "NVIDIA H100 80GB HBM3" ends in the memory type (files named ``hbm3x2-...``).

    python3 -m benchmarks.harness.gpu_tag   # the device scripts' call (the current device's tag)
"""

from __future__ import annotations

import re

# A model token: one or two capitals, then two or three digits, an optional capital (H100, H200, A100, B200, GH200,
# L40S), the word's end or a separator after it (A100-SXM4-80GB); never a size (80GB) or memory type (HBM3).
MODEL = re.compile(r"[A-Z]{1,2}\d{2,3}[A-Z]?(?=$|[^A-Za-z0-9])")


def model_tag(name: str) -> str:
    """``name``'s model token in lower case ("NVIDIA H100 80GB HBM3" -> "h100"); with none, its last word's letters
    and digits (the older rule, for a name outside the pattern)."""
    for word in name.split():
        found = MODEL.match(word)
        if found:
            return found.group(0).lower()
    words = name.split()
    return re.sub(r"[^a-z0-9]", "", words[-1].lower()) if words else "gpu"


def gpu_tag(device=None) -> str:
    """The tag of ``device`` (default: the current CUDA device)."""
    import torch

    return model_tag(torch.cuda.get_device_name(device))


if __name__ == "__main__":
    print(gpu_tag())
