"""A Hugging Face model sharded by its own ``tp_plan`` with flashoverlap's styles, against the unsharded model.

    torchrun --nproc-per-node 2 examples/hf_tp_plan.py

A ``LlamaForCausalLM`` with random weights (no download; a small config on the CPU, an 8B-shaped one with two
layers on GPUs), sharded by ``config.base_model_tp_plan`` mapped onto ``flashoverlap.nn``'s styles
(``styles_from_hf_plan``) and ``parallelize_module``. Prints the largest relative difference of the logits from the
unsharded model over every rank, and raises beyond bf16 rounding. Needs ``transformers`` (the ``hf`` extra).
"""

import os
import sys

if __name__ == "__main__" and sys.argv[1:]:  # it takes no options: a misspelt one must not pass for a run of it
    sys.exit(f"{sys.argv[0]} takes no arguments, got: {' '.join(sys.argv[1:])}")
if __name__ == "__main__" and "RANK" not in os.environ:  # not under torchrun: one line, before the imports below
    sys.exit(f"start it under torchrun: torchrun --nproc-per-node 2 {sys.argv[0]}")  # (they print load messages)

import copy  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor.parallel import parallelize_module  # noqa: E402

try:
    from transformers import LlamaConfig, LlamaForCausalLM
except ImportError:  # what is missing, in one line
    sys.exit("examples/hf_tp_plan.py needs transformers: pip install 'transformers>=4.51' (the hf extra)")

from flashoverlap.nn import styles_from_hf_plan  # noqa: E402


def main() -> None:
    if not dist.is_initialized():  # under torchrun (the test suite starts its ranks itself)
        gpus = torch.cuda.device_count() >= int(os.environ.get("WORLD_SIZE", 1))
        dist.init_process_group("nccl" if gpus else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    on_gpu = dist.get_backend() == "nccl"
    device = torch.device("cuda", rank % torch.cuda.device_count()) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    size = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8) if on_gpu \
        else dict(hidden_size=64, intermediate_size=96, num_attention_heads=8, num_key_value_heads=4)
    config = LlamaConfig(**size, num_hidden_layers=2, vocab_size=1024, attn_implementation="sdpa")
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("tp",))
    torch.manual_seed(0)  # the same weights and tokens on every rank
    plain = LlamaForCausalLM(config).to(device, torch.bfloat16)
    ids = torch.randint(0, config.vocab_size, (1, 16), device=device)

    model = copy.deepcopy(plain)  # or LlamaForCausalLM.from_pretrained(name, torch_dtype=torch.bfloat16)
    parallelize_module(model, mesh, styles_from_hf_plan(model.config.base_model_tp_plan, prefix="model."))

    with torch.no_grad():
        got, want = model(input_ids=ids).logits.float(), plain(input_ids=ids).logits.float()
    worst = ((got - want).norm() / want.norm()).reshape(1)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    ok = worst.item() <= 2e-2
    if rank == 0:
        print(f"LlamaForCausalLM, base_model_tp_plan with flashoverlap's styles: logits' max relative diff vs the "
              f"unsharded model {worst.item():.1e}, {'OK' if ok else 'MISMATCH'}")
    assert ok, f"the logits differ from the unsharded model's by {worst.item()}"


if __name__ == "__main__":  # under torchrun (checked at the top)
    main()
    dist.destroy_process_group()
