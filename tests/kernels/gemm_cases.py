"""The signalling GEMM's interpreter cases, as data: importing this module changes nothing (the child process in
``interpreted_cases`` sets TRITON_INTERPRET; the pytest process must not, or the GPU tests would run interpreted)."""

# (name, m, n, k, dtype, b transposed, TMA loads, TMA store, programs, groups, profile, signal)
CASES = [
    ("odd-pointer-fp16", 37, 45, 29, "float16", False, False, False, 5, 3, "even", True),
    ("odd-pointer-bt-fp16", 70, 33, 50, "float16", True, False, False, 100, 4, "small-first", True),
    ("tma-fp32", 64, 48, 40, "float32", False, True, False, 3, 3, "small-last", True),
    ("tma-bt-store-fp16", 96, 64, 72, "float16", True, True, True, 4, 2, "even", True),
    ("tma-ragged-fp16", 53, 40, 24, "float16", False, True, False, 2, 4, "even", True),
    ("one-tile-fp32", 1, 1, 1, "float32", False, False, False, 1, 1, "even", True),
    ("no-signal-fp16", 45, 31, 17, "float16", True, False, False, 3, 2, "even", False),
]
