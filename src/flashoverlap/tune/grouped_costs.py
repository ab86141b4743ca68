"""The grouped-GEMM cost model's coefficients (``tune/grouped.py``), one ``WayCosts`` per way.
Written by ``benchmarks/diagnostics/grouped_gemm_fit.py`` from the measurements named in
``FITTED_FROM``: refit, do not edit."""

FITTED_FROM = ("benchmarks/results/h200x1-grouped-gemm-fit.json "
               "(commit 0735e7562f908ec2db57f41eefe301e23216ba3a, 2026-12-03)")
COSTS = {
    "triton": {"tflops": 768.8, "tbps": 4.296, "pad_rows": 128,
               "kernel_us": 14.56, "tile_us": 0.0134, "host_us": 188.6},
    "cublas": {"tflops": 768.8, "tbps": 3.978, "pad_rows": 256,
               "kernel_us": 7.72, "tile_us": 0.0639, "host_us": 56.9},
    "loop": {"tflops": 768.8, "tbps": 3.978, "pad_rows": 16,
             "kernel_us": 4.95, "tile_us": 0.0009, "host_us": 23.0},
}
