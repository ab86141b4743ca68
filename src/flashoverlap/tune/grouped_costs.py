"""The grouped-GEMM cost model's coefficients (``tune/grouped.py``), one ``WayCosts`` per way.
Written by ``benchmarks/diagnostics/grouped_gemm_fit.py`` from the measurements named in
``FITTED_FROM``: refit, do not edit."""

FITTED_FROM = ("benchmarks/results/h200x1-moe-gemm.json (commit 3df36115bf, 2026-12-02: t_chunks_ms, "
               "t_cublas_path_ms, t_loop_path_ms) with the host times of "
               "benchmarks/results/logs/issue20/grouped-gemm-host-9a86c27d65.json, refit with --refit")
COSTS = {
    "triton": {"tflops": 819.4, "tbps": 4.639, "pad_rows": 128, "kernel_us": 0.00, "tile_us": 0.0233, "host_us": 152.0},
    "cublas": {"tflops": 819.4, "tbps": 3.684, "pad_rows": 256, "kernel_us": 38.20, "tile_us": 0.0141, "host_us": 23.0},
    "loop": {"tflops": 930.8, "tbps": 3.412, "pad_rows": 256, "kernel_us": 3.84, "tile_us": 0.1451, "host_us": 25.0},
}
