"""The MoE ops without Triton: in a fresh interpreter where every import of ``triton`` fails (and is recorded),
``import flashoverlap`` and the MoE reference path (a one-rank gloo group: layout, dispatch, combine, exact and
bounded) work against plain PyTorch, and nothing asks for Triton (``runtime/experts.py`` imports the grouped-GEMM
policy, whose module imports Triton, only where a fast path chooses its GEMM). Without autograd: the custom ops'
autograd imports torch's Dynamo (seconds), which asks for Triton itself; ``tests/moe/test_moe_ops.py`` covers
autograd."""

import os
import subprocess
import sys
import textwrap

CODE = textwrap.dedent('''
    import sys

    asked = []  # (module, the file whose import statement asked)

    class NoTriton:
        """Behave as if Triton were not installed, and remember who asked."""

        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "triton":
                frame = sys._getframe(1)
                while frame.f_code.co_filename.startswith("<frozen importlib"):
                    frame = frame.f_back
                asked.append((name, frame.f_code.co_filename))
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, NoTriton())

    import tempfile

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import flashoverlap as fo

    assert not asked, f"import flashoverlap asked for {asked}"
    E, T, K, H, FFN = 4, 5, 2, 8, 6
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=gen)
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    weights = torch.softmax(torch.randn(T, K, generator=gen), -1)
    w13 = torch.randn(E, 2 * FFN, H, generator=gen)  # nn.Linear-shaped
    w2 = torch.randn(E, H, FFN, generator=gen)
    h = torch.einsum("tcnh,th->tcn", w13[idx], x)
    want = (weights[..., None] * torch.einsum("tchf,tcf->tch", w2[idx], F.silu(h[..., :FFN]) * h[..., FFN:])).sum(1)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=0, world_size=1)
        try:
            for mode in ("exact", "bounded"):
                layout = fo.moe_layout(idx, E, mode=mode)
                h = fo.moe_dispatch_gemm(x, w13.transpose(1, 2), layout)
                y = fo.moe_gemm_combine(F.silu(h[:, :FFN]) * h[:, FFN:], w2.transpose(1, 2), weights, layout)
                torch.testing.assert_close(y, want, atol=1e-4, rtol=1e-4)
        finally:
            fo.release()
            dist.destroy_process_group()
    assert not asked, f"the MoE reference path asked for {asked}"
    print("MoE reference path OK")
''')


def test_import_and_the_moe_reference_path_never_ask_for_triton(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, env=env, timeout=120,
                          cwd=tmp_path)
    assert proc.returncode == 0 and "MoE reference path OK" in proc.stdout, proc.stderr[-3000:]
