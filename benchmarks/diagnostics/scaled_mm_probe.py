"""Which ``torch._scaled_mm`` calls cuBLAS takes on this GPU: rows (odd, even, multiples of 16), output dtype, bias,
scaling mode (tensor-wise, row-wise, block-wise), a fresh output or ``out=`` a row slice of a larger one. Prints one
line per combination that raised, and a summary; each kept call is also checked against the dequantised product.

PYTHONPATH=src:. python -m benchmarks.diagnostics.scaled_mm_probe [out.json]
"""

import itertools

import torch

from benchmarks.diagnostics.results_file import require_cuda, results_meta, write_results

E4M3 = torch.float8_e4m3fn


def main() -> None:
    require_cuda("benchmarks.diagnostics.scaled_mm_probe", path_only=True)
    n, k = 1008, 1024
    rows_tried = (501, 502, 504, 512, 1001, 1002)
    b = (torch.randn(n, k, device="cuda") * 3).to(E4M3).t()
    results = []
    for rows, out_dtype, bias_on, mode, sliced in itertools.product(rows_tried, (torch.bfloat16, torch.float32),
                                                                     (False, True), ("tensor", "row", "block"),
                                                                     (False, True)):
        a = (torch.randn(rows, k, device="cuda") * 3).to(E4M3)
        if mode == "tensor":
            sa, sb = torch.rand((), device="cuda") + 0.5, torch.rand((), device="cuda") + 0.5
        elif mode == "row":
            sa, sb = torch.rand(rows, 1, device="cuda") + 0.5, torch.rand(1, n, device="cuda") + 0.5
        else:
            sa = (torch.rand(rows, k // 128, device="cuda") + 0.5).t().contiguous().t()
            sb = (torch.rand(-(-n // 128), k // 128, device="cuda") + 0.5).t()
        bias = torch.randn(n, device="cuda").to(out_dtype) if bias_on else None
        kwargs = dict(bias=bias, out_dtype=out_dtype)
        if sliced:
            whole = torch.empty(2 * rows + 3, n, dtype=out_dtype, device="cuda")
            kwargs["out"] = whole[rows + 3 : 2 * rows + 3]  # a row slice at an odd row offset
        key = dict(rows=rows, out_dtype=str(out_dtype)[6:], bias=bias_on, mode=mode, sliced=sliced)
        try:
            got = torch._scaled_mm(a, b, sa, sb, **kwargs)
            torch.cuda.synchronize()
        except RuntimeError as error:
            results.append({**key, "ok": False, "error": str(error)[:160]})
            print(f"refused {key}: {str(error)[:120]}", flush=True)
            continue
        if mode == "block":
            a32 = a.float() * sa.repeat_interleave(128, 1)
            b32 = b.float() * sb.repeat_interleave(128, 0).repeat_interleave(128, 1)[:, :n]
        else:
            a32, b32 = a.float() * sa.reshape(-1, 1), b.float() * sb.reshape(1, -1)
        want = a32 @ b32 + (0 if bias is None else bias.float())
        err = ((got.float() - want).norm() / want.norm()).item()
        results.append({**key, "ok": err < 1e-2, "error": None if err < 1e-2 else f"relative error {err:.3g}"})
        if err >= 1e-2:
            print(f"wrong {key}: relative error {err:.3g}", flush=True)
    refused = [r for r in results if not r["ok"]]
    print(f"{len(results)} combinations, {len(refused)} refused or wrong", flush=True)
    write_results({"meta": results_meta("PYTHONPATH=src:. python -m benchmarks.diagnostics.scaled_mm_probe"),
                   "rows": results})


if __name__ == "__main__":
    main()
