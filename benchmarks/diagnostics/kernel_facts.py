"""What Triton makes of the fp8 grouped GEMM (``kernels.grouped_gemm.scaled_grouped_gemm_kernel``) for one tile,
compiled for a GPU architecture on any machine, GPU or not (Triton's wheel carries ptxas and cuobjdump): registers
per thread, spills, shared memory, how many of its programs fit on one SM at once, how its MMAs are waited on, and
how many tile-sized multiplies scale its products.

    PYTHONPATH=src:. python -m benchmarks.diagnostics.kernel_facts [--arch 90]

prints the facts of the kernel's own tiles (``SCALED_TILE``, ``SCALED_TILE_ROW``); the tile sweep records those of
every tile it times (``fp8_grouped_tiles``, ``meta.facts``).

The kernel is specialised as the launcher's calls are (Triton's JIT specialises integers equal to 1 and marks
pointers and widths divisible by 16): unit inner strides for the rows, the weights' K (the ``w.transpose(1, 2)``
view of ``[E, N, K]`` weights) and the output, fp8 e4m3 operands, bf16 out.

Why it exists: the block-wise kernel scales each 128-deep K step's product before adding it. Triton keeps an MMA in
flight across loop iterations only where its result feeds nothing but the next MMA's accumulator
(``warp_group_dot_wait {pendings = 1}``, as row-wise does); any other use waits for it (``pendings = 0``). So a
block-wise step's tensor-core work and its scaling do not overlap inside one program, and two programs per SM
(registers and shared memory permitting) is the way left to overlap them. The tile sweep
(``fp8_grouped_tiles``) records these facts beside each tile's time."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

POINTERS = {"x": "*fp8e4nv", "x_scale": "*fp32", "w": "*fp8e4nv", "w_scale": "*fp32", "out": "*bf16",
            "table_ptr": "*i32"}
UNIT_STRIDES = {"stride_xk": 1, "stride_wk": 1, "stride_on": 1}
DIVISIBLE = ("stride_xm", "stride_we", "stride_wn", "stride_om", "N", "K", "total_rows")
SM_REGISTERS, SM_SHARED, SM_WARPS, RESERVED_SHARED = 65536, 233472, 64, 1024  # Hopper (sm_90), per SM


def compile_fp8_kernel(tile, mode: str, arch: int = 90):
    """The kernel compiled for ``tile`` (a ``GroupedTile``) and ``mode`` (``"row"`` or ``"block"``), sm_``arch``."""
    import triton
    from triton import compiler
    from triton.backends.compiler import GPUTarget

    from flashoverlap.kernels import grouped_gemm

    kernel = grouped_gemm.scaled_grouped_gemm_kernel
    names = kernel.arg_names
    constants = dict(BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, BLOCK_S=16,
                     GROUP_M=tile.group_m, BLOCKWISE=mode == "block", **UNIT_STRIDES)
    signature = {n: POINTERS.get(n, "constexpr" if n in constants else "i32") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if n in POINTERS or n in DIVISIBLE}
    source = compiler.ASTSource(kernel, signature, {(names.index(n),): v for n, v in constants.items()}, attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": tile.num_warps, "num_stages": tile.num_stages})


def _resources(cubin: bytes) -> dict:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", text)
    if found is None:
        raise RuntimeError(f"cuobjdump printed no resource usage: {text[-300:]}")
    return {"registers": int(found.group(1)), "spill_bytes": int(found.group(2)) + int(found.group(3))}


def _programs_per_sm(registers: int, shared: int, warps: int) -> int:
    """How many programs of ``warps`` warps, ``registers`` a thread and ``shared`` bytes of shared memory fit on one
    Hopper SM at once (0: none)."""
    per_warp = -(-registers * 32 // 256) * 256  # registers are allocated per warp, 256 at a time
    return min(SM_REGISTERS // (per_warp * warps), SM_SHARED // (shared + RESERVED_SHARED), SM_WARPS // warps)


def fp8_kernel_facts(tile, mode: str, arch: int = 90) -> dict:
    """``{registers, spill_bytes, shared_bytes, programs_per_sm_fit, mma_waits, async_loads, scale_multiplies}`` for
    Hopper (``arch`` 90: the per-SM limits here are Hopper's, and its MMA waits are what the facts read):
    ``programs_per_sm_fit`` how many programs of this tile fit on one SM at once (registers, shared memory, warps; 0:
    it does not launch); ``mma_waits`` the ``pendings`` of each MMA wait in order (a 1 inside the K loop keeps an MMA in
    flight across steps); ``scale_multiplies`` the tile-sized fp32 multiplies in the kernel (block-wise: per K
    step)."""
    if arch != 90:
        raise ValueError(f"kernel_facts: sm_{arch} is not Hopper (sm_90): its SM limits and MMA waits are not "
                         "the ones these facts read")
    compiled = compile_fp8_kernel(tile, mode, arch)
    ttgir = compiled.asm["ttgir"]
    facts = _resources(compiled.asm["cubin"])
    shared = int(compiled.metadata.shared)
    fit = _programs_per_sm(facts["registers"], shared, tile.num_warps)
    tile_type = f"tensor<{tile.block_m}x{tile.block_n}xf32"
    multiplies = sum(1 for line in ttgir.splitlines() if "arith.mulf" in line and line.rstrip().split(":")[-1]
                     .strip().startswith(tile_type))
    return facts | {"shared_bytes": shared, "programs_per_sm_fit": fit,
                    "mma_waits": [int(p) for p in re.findall(r"warp_group_dot_wait[^\n]*pendings = (\d+)", ttgir)],
                    "async_loads": ttgir.count("async_copy_global_to_local"), "scale_multiplies": multiplies}


def compile_block_scaled(tile, arch: int = 90):
    """The Gluon block-wise kernel (``kernels.block_scaled.block_scaled_kernel``) compiled for ``tile`` (a
    ``GroupedTile`` the kernel ``fits``), sm_``arch``, as its launcher specialises it: fp8 e4m3 operands through
    TMA descriptors, bf16 out."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    from flashoverlap.kernels import block_scaled

    k, n, experts, rows, fp8 = 2048, 1536, 4, 1024, torch.float8_e4m3fn
    x, w = torch.empty(rows, k, dtype=fp8), torch.empty(experts * n, k, dtype=fp8)
    x_layout, w_layout, mma, table = block_scaled._layouts(tile.block_m, tile.block_n, tile.num_warps, False)
    kernel = block_scaled.block_scaled_kernel
    names = kernel.arg_names
    constants = dict(BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=block_scaled.STEP, BLOCK_S=64,
                     GROUP_M=tile.group_m, STAGES=tile.num_stages, MMA=mma, TABLE=table)
    values = dict(x_desc=TensorDescriptor(x, [rows, k], [k, 1], [tile.block_m, block_scaled.STEP], x_layout),
                  w_desc=TensorDescriptor(w, [experts * n, k], [k, 1], [tile.block_n, block_scaled.STEP], w_layout),
                  x_scale=torch.empty(1),
                  w_scale=torch.empty(1), out=torch.empty(1, dtype=torch.bfloat16),
                  table_ptr=torch.empty(1, dtype=torch.int32))
    signature = {name: "constexpr" if name in constants else mangle_type(values[name]) if name in values else "i32"
                 for name in names}
    source = GluonASTSource(kernel, signature, {(names.index(name),): v for name, v in constants.items()}, {})
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": tile.num_warps})


def block_scaled_facts(tile, arch: int = 90) -> dict:
    """``{registers, spill_bytes, shared_bytes, programs_per_sm_fit, mma_waits, serialised}`` of the Gluon
    block-wise kernel for ``tile`` on Hopper: ``mma_waits`` the ``pendings`` of each MMA wait in order (the loop's
    1s keep a step's MMA in flight while the step before it is scaled); ``serialised`` whether ptxas, assembling the
    kernel's PTX again with ``-v``, reports that it serialised the MMAs (its warning C7514: a register an MMA in
    flight writes read by another instruction), which would undo the overlap the kernel exists for."""
    from triton.backends.nvidia.compiler import get_ptxas

    if arch != 90:
        raise ValueError(f"kernel_facts: sm_{arch} is not Hopper (sm_90)")
    compiled = compile_block_scaled(tile, arch)
    facts = _resources(compiled.asm["cubin"])
    shared = int(compiled.metadata.shared)
    fit = _programs_per_sm(facts["registers"], shared, tile.num_warps)
    with tempfile.NamedTemporaryFile(suffix=".ptx", mode="w") as f:
        f.write(compiled.asm["ptx"])
        f.flush()
        run = subprocess.run([get_ptxas(arch).path, f"-arch=sm_{arch}a", "-v", f.name, "-o", os.devnull],
                             capture_output=True, text=True, check=True)
    return facts | {"shared_bytes": shared, "programs_per_sm_fit": fit,
                    "mma_waits": [int(p) for p in re.findall(r"warp_group_dot_wait[^\n]*pendings = (\d+)",
                                                             compiled.asm["ttgir"])],
                    "serialised": "C7514" in run.stdout + run.stderr}


def main() -> None:
    from flashoverlap.kernels.grouped_gemm import SCALED_TILE, SCALED_TILE_ROW

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, choices=[90], help="the compute capability to compile for "
                        "(Hopper, the only one whose limits these facts know)")
    args = parser.parse_args()
    for scaling, tile in (("block", SCALED_TILE), ("row", SCALED_TILE_ROW)):  # the sweep's tiles: its meta.facts
        print(scaling, tile, fp8_kernel_facts(tile, scaling, args.arch), flush=True)


if __name__ == "__main__":
    main()
