"""The signalling GEMM's interpreter cases, as data: importing this module changes nothing (the child process in
``interpreted_cases`` sets TRITON_INTERPRET; the pytest process must not, or the GPU tests would run interpreted)."""

# (name, m, n, k, dtype, b transposed, TMA loads, TMA store, programs, groups, profile, signal, op, world size)
CASES = [
    ("odd-pointer-fp16", 37, 45, 29, "float16", False, False, False, 5, 3, "even", True, "all_reduce", 2),
    ("odd-pointer-bt-fp16", 70, 33, 50, "float16", True, False, False, 100, 4, "small-first", True, "all_reduce", 2),
    ("tma-fp32", 64, 48, 40, "float32", False, True, False, 3, 3, "small-last", True, "all_reduce", 2),
    ("tma-bt-store-fp16", 96, 64, 72, "float16", True, True, True, 4, 2, "even", True, "all_reduce", 2),
    ("tma-ragged-fp16", 53, 40, 24, "float16", False, True, False, 2, 4, "even", True, "all_reduce", 2),
    ("one-tile-fp32", 1, 1, 1, "float32", False, False, False, 1, 1, "even", True, "all_reduce", 2),
    ("no-signal-fp16", 45, 31, 17, "float16", True, False, False, 3, 2, "even", False, "all_reduce", 2),
    ("rs-pointer-fp16", 100, 45, 29, "float16", False, False, False, 5, 3, "even", True, "reduce_scatter", 2),
    ("rs-tma-bt-fp16", 96, 48, 40, "float16", True, True, True, 4, 2, "small-first", True, "reduce_scatter", 4),
    ("rs-ragged-fp32", 54, 40, 24, "float32", False, True, False, 3, 2, "even", True, "reduce_scatter", 3),
]

# All-gather waits: (name, rows per rank, n, k, dtype, world size, rank, groups, TMA loads, flags set, max spins)
ALL_GATHER_CASES = [
    ("ag-ready-rank0", 40, 33, 24, "float16", 2, 0, 3, False, "all", 0),
    ("ag-ready-rank1-tma", 48, 32, 32, "float16", 2, 1, 2, True, "all", 0),
    ("ag-ready-rank2-of-3", 21, 40, 17, "float32", 3, 2, 2, False, "all", 0),
    ("ag-never-arrives", 40, 33, 24, "float16", 2, 1, 3, False, "first", 20),
]

# The SM copy kernel: (name, elements, programs).
COPY_CASES = [("copy-1x1", 1, 1), ("copy-1000x3", 1000, 3), ("copy-5000x2", 5000, 2)]
