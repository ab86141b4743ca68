"""Hugging Face Llama at tensor parallelism with sequence parallelism, five ways, timed on GPUs.

An 8B-shaped ``LlamaForCausalLM`` (hidden 4096, FFN 14336, 32 heads, 8 KV heads, 32 layers, vocabulary 128256) with
random weights, sharded over every rank of ``torchrun`` by a torchtitan-style plan (``SequenceParallel`` norms,
``PrepareModuleInput`` before attention and the MLP, ``Shard(1)`` between the projections), bf16, batch 1.
For each variant it times prefill (the base model's forward at ``--tokens`` tokens, no grad) and one training step
(forward, cross-entropy over every token, backward; no optimizer) and prints tokens per second:

- ``ours_eager``: ``flashoverlap.nn.ColwiseParallel`` / ``RowwiseParallel`` (the same plan, only the import
  differs), eager;
- ``torch_styles_our_pass``: PyTorch's styles, each decoder layer compiled with ``flashoverlap.compile`` on;
- ``torch_eager``, ``torch_compiled``: plain PyTorch TP, eager and compiled (matmul, then NCCL);
- ``async_tp``: PyTorch's async TP: compiled with ``torch._inductor.config._micro_pipeline_tp = True`` and
  symmetric memory enabled for the group.

Compiled variants compile each decoder layer (as torchtitan does: one graph for all layers); embeddings, the final
norm and ``lm_head`` run eager. A variant that cannot run here (async TP needs NVLink and symmetric memory, and more
than one rank) is reported with the reason and skipped; the run then still writes the others' figures, and exits 1
where one of the library's own variants (``ours_eager``, ``torch_styles_our_pass``) or every variant failed.

Run::

    torchrun --nproc-per-node 2 examples/hf_llama_tp.py --out benchmarks/results/h200x2-hf-llama-tp.json
    torchrun --nproc-per-node 1 examples/hf_llama_tp.py --layers 2 --tokens 2048   # a dry run on one GPU (TP = 1)

``--out`` writes the results JSON (``meta``: commit, command, date, torch, GPUs, config; ``rows``: mode, tokens,
variant, ms and tokens/s, or a note) that documentation figures are rendered from.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import subprocess
import sys

import torch
import torch.distributed as dist

VARIANTS = ("ours_eager", "torch_styles_our_pass", "torch_eager", "torch_compiled", "async_tp")


def sequence_parallel_plan(styles, layers: int) -> dict:
    """torchtitan's tensor-parallel plan on Hugging Face Llama's module names, with ``styles``' ``ColwiseParallel`` /
    ``RowwiseParallel`` (``torch.distributed.tensor.parallel`` or ``flashoverlap.nn``)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, SequenceParallel

    col, row = styles.ColwiseParallel, styles.RowwiseParallel
    plan = {"model.embed_tokens": row(input_layouts=Replicate(), output_layouts=Shard(1)),
            "model.norm": SequenceParallel(),
            "lm_head": col(input_layouts=Shard(1), output_layouts=Replicate())}
    for i in range(layers):
        layer = f"model.layers.{i}."
        plan.update({
            layer + "input_layernorm": SequenceParallel(),
            layer + "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                                    desired_input_kwarg_layouts={"hidden_states": Replicate()}),
            **{layer + f"self_attn.{p}_proj": col() for p in "qkv"},
            layer + "self_attn.o_proj": row(output_layouts=Shard(1)),
            layer + "post_attention_layernorm": SequenceParallel(),
            layer + "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            layer + "mlp.gate_proj": col(), layer + "mlp.up_proj": col(),
            layer + "mlp.down_proj": row(output_layouts=Shard(1)),
        })
    return plan


def build_model(args: argparse.Namespace, styles, mesh, device: torch.device):
    """The model on the meta device, sharded by the plan, then materialised shard by shard with random weights
    (no rank ever holds the whole 8B model)."""
    import transformers
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    config = transformers.LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.ffn, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
        max_position_embeddings=max(args.tokens, 8192), attn_implementation="sdpa", use_cache=False)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # weights in bf16; the rotary frequencies stay fp32, as HF makes them
    try:
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default_dtype)
    parallelize_module(model, mesh, sequence_parallel_plan(styles, config.num_hidden_layers))
    model.to_empty(device=device)
    torch.manual_seed(1234 + mesh.get_local_rank())
    with torch.no_grad():
        for name, param in model.named_parameters():
            local = param.to_local() if isinstance(param, DTensor) else param
            if name.endswith("norm.weight"):
                local.fill_(1.0)
            else:
                local.normal_(0.0, 0.02)
    # The rotary frequencies are buffers computed at construction, lost on the meta device: computed again.
    model.model.rotary_emb = type(model.model.rotary_emb)(config).to(device)
    return model


def set_compiled(model, compiled: bool) -> None:
    """Compile each decoder layer (or undo it): one graph serves every layer."""
    torch._dynamo.reset()  # the compiled code of another variant must not be reused
    for layer in model.model.layers:
        if compiled:
            layer.compile()
        else:
            layer._compiled_call_impl = None


def _count(least: int):
    """A parser of an integer ``>= least`` in ASCII digits: ``--steps 0`` or ``--tokens -8`` is refused here, not
    after the model is built (every variant's timing failing, each reported as skipped)."""
    def parse(text: str) -> int:
        if not (text.isascii() and text.isdigit()) or int(text) < least:
            raise argparse.ArgumentTypeError(f"expected an integer >= {least} (digits only), got {text!r}")
        return int(text)
    return parse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    positive = _count(1)
    parser.add_argument("--tokens", type=positive, default=8192, help="sequence length (batch 1)")
    parser.add_argument("--layers", type=positive, default=32)
    parser.add_argument("--hidden", type=positive, default=4096)
    parser.add_argument("--ffn", type=positive, default=14336)
    parser.add_argument("--heads", type=positive, default=32)
    parser.add_argument("--kv-heads", type=positive, default=8)
    parser.add_argument("--vocab", type=positive, default=128256)
    parser.add_argument("--steps", type=positive, default=10, help="timed steps per figure (median)")
    parser.add_argument("--warmup", type=_count(0), default=3)
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--out", default=None, help="results JSON to write")
    args = parser.parse_args(argv)
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")
    from flashoverlap.bench import out_problem, ranks_beyond_gpus

    problem = out_problem(args.out)  # rank 0 writes it after every variant has run
    if problem:
        parser.error(problem)
    # What it needs, each missing piece named in one line (not a traceback from deep inside torch).
    if not torch.cuda.is_available():
        sys.exit("examples/hf_llama_tp.py needs CUDA GPUs (one per rank, under torchrun): it times an 8B-shaped "
                 "model; on a CPU, examples/hf_tp_plan.py checks the same kind of sharding")
    if "RANK" not in os.environ:
        sys.exit("start it under torchrun: torchrun --nproc-per-node 2 examples/hf_llama_tp.py")
    beyond = ranks_beyond_gpus()  # one GPU per rank: a rank past the last GPU would fail in torch.cuda.set_device
    if beyond is not None:
        local_ranks, gpus = beyond
        sys.exit(f"examples/hf_llama_tp.py: {local_ranks} ranks on this node but {gpus} CUDA GPU"
                 f"{'s' if gpus > 1 else ''}: one per rank; use torchrun --nproc-per-node {gpus} or fewer")
    if importlib.util.find_spec("transformers") is None:
        sys.exit("examples/hf_llama_tp.py needs transformers: pip install 'transformers>=4.51' (the hf extra)")

    import torch.distributed.tensor.parallel as torch_styles
    from torch.distributed.device_mesh import init_device_mesh

    import flashoverlap.compile
    import flashoverlap.nn
    from flashoverlap.tune.timing import time_ms

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    world = dist.get_world_size()
    if args.tokens % world:
        parser.error(f"--tokens {args.tokens} must be divisible by the {world} ranks (sequence parallelism)")
    mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("tp",))
    rank0 = dist.get_rank() == 0

    torch.manual_seed(0)  # the same tokens on every rank
    ids = torch.randint(0, args.vocab, (1, args.tokens), device=device)
    labels = torch.randint(0, args.vocab, (1, args.tokens), device=device)
    positions = torch.arange(args.tokens, device=device)[None]  # explicit: each rank embeds S/W tokens

    models = {}
    if "ours_eager" in variants:
        models["ours"] = build_model(args, flashoverlap.nn, mesh, device)
    if set(variants) - {"ours_eager"}:
        models["torch"] = build_model(args, torch_styles, mesh, device)

    rows = []
    for variant in variants:
        model = models["ours" if variant == "ours_eager" else "torch"]
        compiled = variant in ("torch_styles_our_pass", "torch_compiled", "async_tp")
        note = None
        try:
            if variant == "torch_styles_our_pass":
                flashoverlap.compile.enable()
            if variant == "async_tp":
                from torch.distributed._symmetric_memory import enable_symm_mem_for_group

                enable_symm_mem_for_group(mesh.get_group().group_name)
                torch._inductor.config._micro_pipeline_tp = True
            set_compiled(model, compiled)

            def prefill(model=model):
                with torch.no_grad():
                    model.model(input_ids=ids, position_ids=positions)

            def train(model=model):
                logits = model(input_ids=ids, position_ids=positions).logits
                loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]).float(), labels.view(-1))
                loss.backward()

            def clear(model=model):
                model.zero_grad(set_to_none=True)

            times = {"prefill": time_ms(prefill, warmup=args.warmup, iters=args.steps),
                     "train": time_ms(train, warmup=args.warmup, iters=args.steps, before=clear)}
            clear()
        except Exception as exc:  # noqa: BLE001  (a variant that cannot run here: say why, time the others)
            times, note = {}, f"{type(exc).__name__}: {str(exc)[:300]}"
        finally:
            flashoverlap.compile.disable()
            torch._inductor.config._micro_pipeline_tp = False
            set_compiled(model, False)
        for mode in ("prefill", "train"):
            ms = times.get(mode)
            row = {"mode": mode, "tokens": args.tokens, "variant": variant, "ms": ms,
                   "tokens_per_s": args.tokens / ms * 1e3 if ms else None}
            if note:
                row["note"] = note
            rows.append(row)
            if rank0:
                cell = f"{ms:9.2f} ms {row['tokens_per_s']:12.0f} tokens/s" if ms else f"skipped ({note})"
                print(f"{mode:>8} {args.tokens:>6} tokens {variant:>22}: {cell}", flush=True)

    if rank0 and args.out:
        meta = {"commit": _commit(), "command": "torchrun --nproc-per-node {} examples/hf_llama_tp.py {}".format(
                    world, " ".join(sys.argv[1:] if argv is None else argv)).strip(),
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "torch": torch.__version__, "gpus": f"{world}x {torch.cuda.get_device_name()}", "world_size": world,
                "config": {k: getattr(args, k) for k in ("layers", "hidden", "ffn", "heads", "kv_heads", "vocab")},
                "dtype": "bfloat16", "batch": 1}
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        print(f"wrote {args.out}")
    dist.destroy_process_group()
    return exit_status(rows, rank0)


OURS = ("ours_eager", "torch_styles_our_pass")


def exit_status(rows: list[dict], say: bool = True) -> int:
    """1 where a variant of this library's, or every variant, has no figure (each named on stderr), else 0: a run
    whose every line read "skipped" must not pass for one that timed something."""
    failed = sorted({row["variant"] for row in rows if row["ms"] is None}, key=VARIANTS.index)
    ours = [v for v in failed if v in OURS]
    nothing = all(row["ms"] is None for row in rows)
    if say and failed:
        why = "no variant ran" if nothing else f"{', '.join(ours)} {'is' if len(ours) == 1 else 'are'} this library's"
        print(f"examples/hf_llama_tp.py: no figure for {', '.join(failed)} (the reasons above)"
              + (f"; failing, since {why}" if ours or nothing else ""), file=sys.stderr, flush=True)
    return 1 if ours or nothing else 0


def _commit() -> str:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True).stdout.strip()
        return commit.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("FLASHOVERLAP_COMMIT", "unknown")


if __name__ == "__main__":
    raise SystemExit(main())
