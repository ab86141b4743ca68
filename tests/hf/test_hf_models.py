"""Hugging Face transformers' Llama, Qwen2 and Qwen3 (tiny configs, random weights, no download) at tensor
parallelism on gloo ranks, W = 2 and 4: logits and every parameter's gradient equal to the unsharded model's (fp32
at 1e-5, bf16 at 2e-2), with

- flashoverlap's styles on the model's own ``base_model_tp_plan`` (``styles_from_hf_plan``), eager (Qwen3's plan
  holds ``replicated_with_grad_allreduce`` norms: their gradients summed over the ranks);
- flashoverlap's styles on a torchtitan-style sequence-parallel plan (``SequenceParallel`` norms,
  ``PrepareModuleInput``, ``Shard(1)`` between the projections), eager;
- PyTorch's styles compiled with ``flashoverlap.compile`` on, at W = 2 (Llama on the sequence-parallel plan, Qwen2
  on Hugging Face's): the number of matmul + collective patterns it rewrote is asserted. (The rewrites do not depend
  on W; each compiled variant costs about 20 s at W = 4 on two cores, so W = 4 runs eager only.)

One set of W processes per (W, part) runs that part's variants of every family: W = 2 eager, W = 2 compiled, W = 4
eager. Compiled: Inductor with ATen kernels (its C++ code generation costs about a minute per model on two cores;
``tests/test_compile_pass.py`` compiles with it)."""

import copy

import pytest
import torch

from flashoverlap.testing import spawn

pytest.importorskip("transformers")

SEQ = 16
LIMITS = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _model(family: str, dtype: torch.dtype):
    import transformers

    config_cls, model_cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                             "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
                             "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[family]
    config = config_cls(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                        num_key_value_heads=4, vocab_size=128, max_position_embeddings=64,
                        attn_implementation="sdpa")
    torch.manual_seed(0)
    return model_cls(config).to(dtype)


def sequence_parallel_plan(styles, layers: int) -> dict:
    """torchtitan's plan on Hugging Face's module names, with ``styles``' ``ColwiseParallel`` /
    ``RowwiseParallel`` (PyTorch's or flashoverlap's: the only difference)."""
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


def _hf_plan(styles, config) -> dict:
    import flashoverlap.nn as fnn

    if styles is fnn:
        return fnn.styles_from_hf_plan(config.base_model_tp_plan, prefix="model.")
    return {"model." + name: {"colwise": styles.ColwiseParallel, "rowwise": styles.RowwiseParallel}[style]()
            for name, style in config.base_model_tp_plan.items()}


def _rel(got, want) -> float:
    got = got.full_tensor() if hasattr(got, "full_tensor") else got
    return float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))


def _loss(logits, labels):
    return torch.nn.functional.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1))


def _variant(family, plan_kind, dtype, compiled, mesh):
    """Errors of one variant against the unsharded model, and the pass's rewrites."""
    import torch.distributed.tensor.parallel as torch_styles
    from torch.distributed.tensor.parallel import parallelize_module

    import flashoverlap.compile as fc
    import flashoverlap.nn as fnn

    full = _model(family, dtype)
    ids = torch.randint(0, full.config.vocab_size, (1, SEQ))
    labels = torch.randint(0, full.config.vocab_size, (1, SEQ))
    positions = torch.arange(SEQ)[None]  # explicit: with sequence parallelism the embeddings hold S/W tokens
    want = full(input_ids=ids, position_ids=positions).logits
    _loss(want, labels).backward()

    styles = torch_styles if compiled else fnn
    model = copy.deepcopy(full)
    model.zero_grad()
    plan = (_hf_plan(styles, full.config) if plan_kind == "hf"
            else sequence_parallel_plan(styles, full.config.num_hidden_layers))
    parallelize_module(model, mesh, plan)
    fc.reset_counts()
    run = model
    if compiled:
        torch._dynamo.reset()
        fc.enable()
        run = torch.compile(model, options={"fallback_by_default": True})
    try:
        logits = run(input_ids=ids, position_ids=positions).logits
        _loss(logits, labels).backward()
    finally:
        fc.disable()
    errors = {"logits": _rel(logits, want)}
    for name, p in model.named_parameters():
        errors[name] = _rel(p.grad, full.get_parameter(name).grad) if p.grad is not None else float("inf")
    bad = {k: v for k, v in errors.items() if not v < LIMITS[dtype]}
    return bad, fc.rewrite_counts()


def _families(rank, world_size, variants):
    from torch.distributed.device_mesh import init_device_mesh

    torch._inductor.config.fx_graph_cache = False  # a cached graph would skip the pass (and its counts)
    mesh = init_device_mesh("cpu", (world_size,))
    return {variant: _variant(*variant, mesh) for variant in variants}


# Rewrites in the compiled forward and backward of the two-layer models. Sequence parallel: all-gathers before
# attention, the MLP (each fused with one of the projections reading it) and lm_head, and of o_proj's and down_proj's
# output gradients; reduce-scatters after o_proj and down_proj, and of lm_head's input gradient. Hugging Face's plan:
# the all-reduces after o_proj and down_proj, and of q, k, v, gate and up's input gradients.
REWRITES = {"sequence": {"all_gather_gemm": 9, "gemm_reduce_scatter": 5}, "hf": {"gemm_all_reduce": 14}}
F32, BF16 = torch.float32, torch.bfloat16
VARIANTS = {  # (W, part): one test each, so that the compiled part (the slowest) runs beside the others
    (2, "eager"): [("llama", "hf", F32, False), ("llama", "sequence", F32, False), ("llama", "sequence", BF16, False),
                   ("qwen2", "hf", F32, False), ("qwen2", "sequence", F32, False), ("qwen2", "hf", BF16, False),
                   ("qwen3", "hf", F32, False)],
    (2, "compiled"): [("llama", "sequence", F32, True), ("qwen2", "hf", F32, True)],
    (4, "eager"): [("llama", "hf", F32, False), ("llama", "sequence", F32, False),
                   ("qwen2", "hf", F32, False), ("qwen2", "sequence", F32, False), ("qwen3", "hf", F32, False)],
}


@pytest.mark.parametrize("world_size, part", list(VARIANTS), ids=[f"{w}-{part}" for w, part in VARIANTS])
def test_hf_models_match_the_unsharded_model(world_size, part):
    for rank, results in enumerate(spawn(_families, world_size, args=(VARIANTS[world_size, part],))):
        for (family, plan, dtype, compiled), (bad, counts) in results.items():
            what = f"{family} {plan} plan {str(dtype)[6:]} {'compiled' if compiled else 'eager'}, rank {rank}"
            assert not bad, f"{what}: {bad}"
            assert counts == (REWRITES[plan] if compiled else {}), f"{what}: rewrote {counts}"
