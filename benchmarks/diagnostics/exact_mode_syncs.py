"""Why an exact-mode MoE layer's host time is GPU time (issue 44: the fp8 layer's host time against bf16's, exact
mode): the layer of ``fp8_moe_host.py`` on a one-rank NCCL group, Mixtral-8x7B-like, bf16 and fp8 row- and
block-wise, with its layout made once outside the timed calls. Per dtype: where each host synchronisation of one
layer call is issued (``testing.host_synchronisations``), and the host time to issue the dispatch alone, the combine
alone and the whole layer while the GPU is busy ahead (``host_us_interleaved``), so that a part which waits for the
GPU shows as one whose host time follows the GPU work queued before it.

PYTHONPATH=src python -m benchmarks.diagnostics.exact_mode_syncs [out.json]
"""

from __future__ import annotations

import shlex
import sys

import torch
import torch.nn.functional as F

from benchmarks.diagnostics.fp8_moe_host import CONFIGS, layer_inputs, layer_weights
from benchmarks.diagnostics.results_file import one_rank_nccl_diagnostic, results_meta
from benchmarks.harness.timing import host_us_interleaved


def main() -> dict:
    import flashoverlap as fo
    from flashoverlap.ops.moe import moe_dispatch_gemm, moe_gemm_combine
    from flashoverlap.testing import host_synchronisations

    device = torch.device("cuda", 0)
    out = {"meta": results_meta("python -m benchmarks.diagnostics.exact_mode_syncs " + shlex.join(sys.argv[1:])),
           "rows": []}
    for name, local, hidden, ffn, top_k, tokens in CONFIGS:
        x, idx, weights, w13, w2 = layer_inputs(local, hidden, ffn, top_k, tokens, device)
        for mode in ("exact", "bounded"):
            layout = fo.moe_layout(idx, local, mode=mode, bound=tokens * top_k if mode == "bounded" else None)
            fns, syncs = {}, {}
            for dtype in ("bf16", "fp8-row", "fp8-block"):
                w_up, w_down, s_up, s_down = layer_weights(dtype, w13, w2)
                with torch.no_grad():
                    h = moe_dispatch_gemm(x, w_up, layout, path="nccl", scale_w=s_up)
                    a = (F.silu(h[:, :ffn]) * h[:, ffn:]).contiguous()

                def dispatch(w_up=w_up, s_up=s_up, layout=layout, x=x):
                    with torch.no_grad():
                        return moe_dispatch_gemm(x, w_up, layout, path="nccl", scale_w=s_up)

                def combine(a=a, w_down=w_down, s_down=s_down, layout=layout, weights=weights):
                    with torch.no_grad():
                        return moe_gemm_combine(a, w_down, weights, layout, path="nccl", scale_w=s_down)

                def layer(dispatch=dispatch, combine=combine):
                    dispatch()
                    return combine()

                for fn in (dispatch, combine, layer):
                    fn()
                torch.cuda.synchronize()
                syncs[dtype] = {"dispatch": host_synchronisations(dispatch), "combine": host_synchronisations(combine)}
                fns.update({f"{dtype} dispatch": dispatch, f"{dtype} combine": combine, f"{dtype} layer": layer})
            host = host_us_interleaved(fns, calls=24)
            row = {"config": name, "mode": mode, "host_us": {key: round(v, 1) for key, v in host.items()},
                   "synchronisations": syncs}
            print(name, mode, row["host_us"], flush=True)
            for dtype, where in syncs.items():
                print(f"   {dtype}: {where}", flush=True)
            out["rows"].append(row)
    return out


if __name__ == "__main__":
    one_rank_nccl_diagnostic("benchmarks.diagnostics.exact_mode_syncs", main)
