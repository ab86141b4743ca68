"""Break the code on purpose, one named mutation at a time, and check that the tests catch it.

Each mutation removes or weakens one wait, flag, signal, barrier or join of one path (a text replacement that
must match exactly once), is applied to a temporary copy of the repository, and runs the tests that claim to
catch it; "caught" means they failed. Run by hand (the whole list: about 30 minutes on 2 cores):

    python tools/mutate.py [--only NAME ... --out FILE]

The results file, ``benchmarks/results/mutations.json`` for the whole list, is what docs/testing.md's table is
rendered from; a subset (``--only``) writes its own ``--out`` and never that file. ``meta.command`` is the exact
command line.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NCCL = "src/flashoverlap/comm/tp/nccl.py"
RING = "src/flashoverlap/comm/tp/ring_schedule.py"
P2P = "src/flashoverlap/comm/tp/p2p.py"
NCCL_TEST = "tests/comm/test_nccl_executor.py"
RING_TEST = "tests/comm/test_ring_protocol.py::test_back_to_back_calls_of_every_op_are_right_in_random_interleavings"
P2P_TEST = "tests/comm/test_p2p_executor.py"
OPS_DRIVER = "src/flashoverlap/comm/stream_ops.py"
DRIVER_TEST = "tests/comm/test_stream_ops.py"
CALLS = "src/flashoverlap/runtime/calls.py"
CALLS_TEST = "tests/runtime/test_calls.py"
DISAGREE_TEST = "tests/runtime/test_disagreement.py"
POLICY = "src/flashoverlap/runtime/policy.py"
POLICY_TEST = "tests/runtime/test_policy.py"
COLLECTIVES = "src/flashoverlap/comm/collectives.py"
COLLECTIVES_TEST = "tests/comm/test_collectives.py"

REPLAY = "src/flashoverlap/comm/replay.py"
REPLAY_TEST = "tests/comm/test_replay.py"
PLAN = "src/flashoverlap/plan.py"
PLAN_TEST = "tests/test_plan.py"
GUARDS = "src/flashoverlap/guards.py"
GUARDS_TEST = "tests/test_guards.py"

GROUPED = "src/flashoverlap/kernels/grouped_gemm.py"
BLOCK_SCALED = "src/flashoverlap/kernels/block_scaled.py"
BLOCK_SCALED_TEST = "tests/kernels/test_grouped_fp8.py::test_the_gluon_block_kernel_keeps_each_mma_in_flight_on_hopper"
QUANTISE = "src/flashoverlap/kernels/quantise.py"
QUANTISE_TEST = "tests/kernels/test_quantise.py"
GROUPED_TEST = "tests/kernels/test_grouped_gemm.py"
POLICY_GROUPED = "src/flashoverlap/tune/grouped.py"
POLICY_GROUPED_TEST = "tests/tune/test_grouped.py"
EXPERT_NCCL = "src/flashoverlap/comm/expert/nccl.py"
CHUNKED = "src/flashoverlap/comm/expert/chunked_gemm.py"
EXPERT_P2P = "src/flashoverlap/comm/expert/p2p.py"
EXPERT_P2P_TEST = "tests/comm/test_expert_p2p_executor.py"
HYBRID_TEST = "tests/moe/test_hybrid.py"

TESTING = "src/flashoverlap/testing.py"
TESTING_TEST = "tests/test_testing.py"
TIMING = "benchmarks/harness/timing.py"

# (name, what it breaks, file, exact text, replacement, tests)
MUTATIONS = [
    ("spawn-keeps-the-forkservers-environment", "testing.spawn: a rank keeps the environment the forkserver started "
     "with, adding the caller's on top (a variable the caller removed survives)", TESTING,
     "    target.clear()\n", "", TESTING_TEST),
    ("spawn-output-not-relayed-at-the-end", "testing.spawn: what the ranks print after the last look while they run "
     "never reaches the caller's streams", TESTING,
     "            _relay(output, world_size, offsets)\n        if errors:", "        if errors:", TESTING_TEST),
    ("spawn-import-time-variables-ignored", "testing.spawn: a call whose environment differs from the forkserver's in a "
     "variable read when torch is imported still forks from the server", TESTING,
     "    if read_at_import:\n", "    if False:\n", TESTING_TEST),
    ("agreement-digest-salted", "Debug mode: the plan's digest is Python's salted string hash, which differs between "
     "processes", "src/flashoverlap/runtime/agreement.py",
     "zlib.crc32(json.dumps(plan.to_dict(), sort_keys=True).encode())",
     "hash(json.dumps(plan.to_dict(), sort_keys=True))",
     "tests/ops/test_errors.py::test_debug_mode_catches_ranks_that_disagree_or_never_come"),
    ("paired-figures-are-medians-apart", "harness.timing: the paired difference is the difference of the medians",
     TIMING, "1e6 * statistics.median(ours - base for ours, base in rounds)",
     "1e6 * (statistics.median(times[name]) - statistics.median(times[baseline]))", "tests/benchmarks/test_rows.py"),
    ("interleaved-order-only-rotates", "harness.timing: the interleaved rounds only rotate, so a name's neighbours never "
     "change and the name after another always runs warm behind it", TIMING,
     "    order = [names[(index + row) % count] for index in base]\n",
     "    order = [names[(index + row) % count] for index in range(count)]\n", "tests/benchmarks/test_rows.py"),
    ("interleaved-odd-count-unreversed", "harness.timing: with an odd number of callables the design's rows are never "
     "reversed, so some pairs always run in one order", TIMING,
     "    return order[::-1] if row >= count else order", "    return order", "tests/benchmarks/test_rows.py"),
    ("debug-deadline-per-wait", "Debug mode: each of a call's waits gets its own deadline, so a stuck call takes "
     "longer than the timeout to raise", GUARDS, "poll_until(event.query, deadline, lambda what=what: failure(what))",
     "poll_until(event.query, time.monotonic() + timeout, lambda what=what: failure(what))", GUARDS_TEST),
    ("nccl-collective-one-tile-early", "NCCL path: a group's collective waits for tile_count - 1 tiles", NCCL,
     "stream_ops.wait_reset(self.comm_stream, base + 4 * grp.index, grp.tile_count)",
     "stream_ops.wait_reset(self.comm_stream, base + 4 * grp.index, grp.tile_count - 1)", NCCL_TEST),
    ("nccl-band-event-wait-removed", "NCCL path: a cuBLAS band's collective does not wait for the band's event", NCCL,
     "                    self.comm_stream.wait_event(ready[grp.index])\n", "                    pass\n", NCCL_TEST),
    ("nccl-counter-not-reset", "NCCL path: a group's counter is not reset after its wait", NCCL,
     "stream_ops.wait_reset(self.comm_stream, base + 4 * grp.index, grp.tile_count)",
     "stream_ops.wait_geq(self.comm_stream, base + 4 * grp.index, grp.tile_count)", NCCL_TEST),
    ("nccl-band-flag-not-raised", "NCCL all-gather: a band's arrival flag is not raised", NCCL,
     "                    stream_ops.write(self.comm_stream, base + 4 * grp.index, 1)\n",
     "                    pass\n", NCCL_TEST),
    ("nccl-flags-not-cleared", "NCCL all-gather: the band flags are not cleared after the GEMM", NCCL,
     "        self.flags[: plan.num_groups].zero_()\n", "", NCCL_TEST),
    ("nccl-replay-signature-without-b", "NCCL path and sequential plan: a replayed call's signature "
     "(replay.gemm_call_signature, shared) leaves out where b lies (a graph captured for one weight would multiply "
     "by it when called with another)", REPLAY,
     "address(call.a), address(call.b),\n", "address(call.a),\n",
     NCCL_TEST + "::test_the_replay_signature_names_every_tensor_a_call_touches "
     "tests/comm/test_sequential.py::test_the_sequential_replay_signature_names_every_tensor_a_call_touches"),
    ("nccl-replay-signature-without-buffers", "NCCL path and sequential plan: a replayed call's signature leaves out "
     "the buffers the call writes (a graph would write into the previous call's memory)", REPLAY,
     "    return signature(gemm_call_inputs(call), buffers)", "    return signature(gemm_call_inputs(call), ())",
     NCCL_TEST + "::test_the_replay_signature_names_every_tensor_a_call_touches "
     "tests/comm/test_sequential.py::test_the_sequential_replay_signature_names_every_tensor_a_call_touches"),
    ("agreement-absent-rank-not-named", "Agreement check: a rank that never reached the call is not told apart "
     "(every rank counted as arrived)", "src/flashoverlap/runtime/agreement.py",
     "            absent = known = [rank for rank in absent if not store.check([key := _arrival_key(exchange, rank)])\n"
     "                              or store.get(key).decode() != mark]\n",
     "            absent = known = []\n", "tests/ops/test_errors.py::test_debug_mode_catches_ranks_that_disagree_or_never_come"),
    ("fp8-grouped-loop-threshold-off", "fp8 grouped GEMM choice: the per-expert loop taken from 512 rows per expert "
     "(DeepSeek-V3's down projection: 4.7x slower than ours)", "src/flashoverlap/tune/grouped_fp8.py",
     "LOOP_MIN_ROWS = 2048", "LOOP_MIN_ROWS = 512", "tests/tune/test_grouped_fp8.py"),
    ("quantise-kernel-subnormal-spacing-lost", "fp8 quantise kernel: values below fp8's smallest normal rounded at "
     "their own binade's spacing (finer than fp8 holds there)", QUANTISE,
     "binade = tl.maximum((bits >> 23) & 0xFF, 127 + MIN_EXPONENT)", "binade = (bits >> 23) & 0xFF", QUANTISE_TEST),
    ("quantise-kernel-nan-block-scale-finite", "fp8 quantise kernel, block-wise: a block holding a NaN gets a finite "
     "scale (Triton's maximum drops the NaN)", QUANTISE, "            scale = tl.where(nans > 0, float(\"nan\"), scale)\n",
     "", QUANTISE_TEST),
    ("quantise-kernel-sign-of-zero-lost", "fp8 quantise kernel: -0.0 written as +0.0 (the sign bit not carried over)",
     QUANTISE, ".to(tl.int32, bitcast=True) | (bits & -2147483648)", ".to(tl.int32, bitcast=True)", QUANTISE_TEST),
    ("quantise-kernel-last-block-scale-dropped", "fp8 quantise kernel, block-wise: the scale of a chunk's last block "
     "not stored", QUANTISE, "tl.store(s_row + firsts // BLOCK, scale, mask=firsts < k)",
     "tl.store(s_row + firsts // BLOCK, scale, mask=firsts + BLOCK < k)", QUANTISE_TEST),
    ("quantise-kernel-constants-ignore-the-mode", "fp8 quantise kernel: the kept constants asked for without the "
     "scaling mode (every call's BLOCKWISE off: block-wise calls quantise row-wise)", QUANTISE,
     "_constants(q.dtype, blockwise))", "_constants(q.dtype, False))", QUANTISE_TEST),
    ("p2p-graph-waits-stay-memops", "P2P path: a graph's flag waits stay stream memory operations (a launch "
     "prepares each again: 1.3 ms for 48)", P2P,
     '        kernel_waits = captured and self._graph_waits() == "kernel"\n',
     "        kernel_waits = False\n", P2P_TEST + "::test_a_graph_waits_on_flags_with_the_wait_kernel"),
    ("p2p-graph-waits-default-memops", "P2P paths: a graph on a GPU waits with stream memory operations by default",
     "src/flashoverlap/comm/stream_ops.py", '    return "kernel" if device.type == "cuda" else "memop"',
     '    return "memop"', "tests/comm/test_stream_ops.py::test_graphs_wait_with_the_kernel_on_a_gpu_unless_told"),
    ("expert-p2p-graph-waits-stay-memops", "P2P expert path: a graph's flag waits stay stream memory operations",
     EXPERT_P2P, '_row_bytes(call), captured and self._graph_waits() == "kernel")', "_row_bytes(call), False)",
     EXPERT_P2P_TEST + "::test_a_graph_waits_on_flags_with_the_wait_kernel"),
    ("expert-p2p-wait-kind-not-in-the-program-key", "P2P expert path: the resolved program's cache key leaves out "
     "how a graph waits", EXPERT_P2P, "key = (op, chunks.send, chunks.recv, gathered, row_bytes, kernel_waits)",
     "key = (op, chunks.send, chunks.recv, gathered, row_bytes)",
     EXPERT_P2P_TEST + "::test_a_graph_waits_on_flags_with_the_wait_kernel"),
    ("expert-p2p-graph-wait-kernel-wrong-flag", "P2P expert path: a graph's wait kernel spins on the next flag slot",
     EXPERT_P2P, "program.append((_KERNEL_WAIT, _STREAMS[item.stream], item.flag.row))",
     "program.append((_KERNEL_WAIT, _STREAMS[item.stream], item.flag.row + 1))",
     EXPERT_P2P_TEST + "::test_a_graph_waits_on_flags_with_the_wait_kernel"),
    ("p2p-wait-kernel-not-loaded", "P2P path: a plan's first call does not load the wait kernel its graphs launch "
     "behind flag waits (deadlock rule 3)", P2P, "            stream_ops.load_wait_kernel(self.device)\n",
     "            pass\n",
     P2P_TEST + "::test_a_plans_first_call_loads_the_wait_kernel_on_a_gpu_before_anything_else"),
    ("expert-p2p-wait-kernel-not-loaded", "P2P expert path: a plan's first call does not load the wait kernel its "
     "graphs launch behind flag waits (deadlock rule 3)", EXPERT_P2P,
     "            stream_ops.load_wait_kernel(self.device)\n",
     "            pass\n", EXPERT_P2P_TEST + "::test_a_plans_first_call_loads_the_wait_kernel_on_a_gpu_before_anything_else"),
    ("device-script-steps-unchecked", "device scripts: a misspelt STEPS or SETTINGS name runs nothing (or nvlink "
     "under the misspelt name) and exits 0",
     "benchmarks/steps.sh", """if [[ " $known " != *" $word "* ]]; then""", "if false; then",
     "tests/test_device_scripts.py"),
    ("moe-layout-takes-bound-true", "moe_layout: bound=True runs as a bound of 1 row",
     "src/flashoverlap/runtime/experts.py",
     "        if not isinstance(bound, int) or isinstance(bound, bool) or bound < 1:  # True is no row count\n",
     "        if not isinstance(bound, int) or bound < 1:\n",
     "tests/moe/test_moe_errors.py"),
    ("ranks-beyond-gpus-never-said", "bench.ranks_beyond_gpus: more torchrun ranks on a node than GPUs pass (bench, "
     "tune, the harness and the Llama example start them; a rank fails in set_device, the others hang)",
     "src/flashoverlap/bench.py", "    if local.isascii() and local.isdigit() and int(local) > gpus:\n",
     "    if False:\n",
     "tests/test_cli_edges.py::test_bench_and_tune_refuse_more_ranks_on_a_node_than_gpus "
     "tests/benchmarks/test_options.py tests/test_example_command_lines.py"),
    ("llama-example-passes-having-timed-nothing", "examples/hf_llama_tp.py exits 0 where its own variants, or all of "
     "them, timed nothing (every line 'skipped')", "examples/hf_llama_tp.py",
     "    return 1 if ours or nothing else 0\n", "    return 0\n",
     "tests/test_example_command_lines.py"),
    ("ring-plan-takes-fp8-on-the-cpu", "policy: an fp8 call with a ring plan on the CPU passes reason_not_ring (the "
     "ring reads no scales)", "src/flashoverlap/runtime/policy.py",
     "        if request.dtype in checks.FP8_DTYPES and request.plan is not None and not request.plan.sequential:\n",
     "        if False:\n", "tests/comm/test_ring_nccl.py tests/ops/test_given_plans.py"),
    ("ring-communicator-ignores-scales", "ring communicator: a call with scales runs the unscaled product, should "
     "the policy let one through", "src/flashoverlap/comm/tp/ring_nccl.py",
     "        if call.scales is not None:  # the policy refuses fp8 ring plans", "        if False:  #",
     "tests/comm/test_ring_nccl.py"),
    ("tile-shared-memory-unchecked", "runtime: a given plan whose tile cannot fit the GPU's shared memory with the "
     "call's operands (an fp8 tile on bf16) reaches Triton's launcher (OutOfResources deep inside it)",
     "src/flashoverlap/runtime/calls.py", "        if room is not None and need + SHARED_SLACK > room:\n",
     "        if False:\n", "tests/runtime/test_calls.py"),
    ("example-takes-any-argument", "examples/ops.py runs whatever arguments it is given (a misspelt option passes "
     "for a run of it)", "examples/ops.py",
     "    if sys.argv[1:]:  # it takes no options: a misspelt one must not pass for a run of the example\n",
     "    if False:\n", "tests/test_example_command_lines.py"),
    ("cli-gpus-before-options", "flashoverlap bench/tune: the GPU check before the command line's and the variables' "
     "(a bad --out on a CPU machine answered 'needs CUDA GPUs')", "src/flashoverlap/cli.py",
     '    _check_settings(f"{args.command} {what}")\n    if args.command == "tune":\n',
     '    _needs_gpus(f"{args.command} {what}")\n    _check_settings(f"{args.command} {what}")\n'
     '    if args.command == "tune":\n', "tests/test_cli_edges.py"),
    ("shared-ranks-gpu-run-named-cpu", "shared_ranks: a GPU run's results file takes the CPU check's name (cpux1-), "
     "not its GPU's", "benchmarks/shared_ranks.py", "        args.gpu = gpu_tag()\n", "",
     "tests/benchmarks/test_shared_ranks.py::test_the_results_file_is_named_for_the_gpu_that_ran_it"),
    ("shared-ranks-merge-of-mixed-gpus", "shared_ranks --merge: files of different GPUs merged into one file, named "
     "for one of them", "benchmarks/shared_ranks.py", "    if len(named) > 1:\n", "    if False:\n",
     "tests/benchmarks/test_shared_ranks.py::test_a_merge_of_mixed_gpus_or_of_cpu_checks_into_the_results_is_refused"),
    ("shared-ranks-merge-cpu-into-results", "shared_ranks --merge: --device cpu checks merged into the committed "
     "results", "benchmarks/shared_ranks.py", '    if args.gpu == "cpu" and _is_committed_results(args.out):\n',
     "    if False:\n",
     "tests/benchmarks/test_shared_ranks.py::test_a_merge_of_mixed_gpus_or_of_cpu_checks_into_the_results_is_refused"),
    ("packed-rows-slots-ignore-the-offset", "comm/scaled.PackedRows: the own slots' views start at the storage's "
     "first byte, not the buffer's (a buffer of rows of a larger one)", "src/flashoverlap/comm/scaled.py",
     "        start, band = self.base + rank * rows * self.width, world * rows * self.width\n",
     "        start, band = rank * rows * self.width, world * rows * self.width\n",
     "tests/comm/test_bands.py::test_packed_rows_views_are_unpack_rows_and_own_slots"),
    ("soak-last-checks-unread", "soak: the checks queued since the last read (up to READ_EVERY bursts) never read "
     "at a sample (the end's among them)", "benchmarks/shared/soak.py",
     "        read_checks()  # the sample's synchronisation reads the checks queued since the last read\n", "",
     "tests/benchmarks/test_shared_ranks.py::test_the_soak_ranks_check_every_call_on_cpu_ranks"),
    ("soak-reads-only-at-samples", "soak: the checks never read every READ_EVERY bursts (only at samples)",
     "benchmarks/shared/soak.py", "        return self.queued_bursts >= self.bursts\n",
     "        return False\n", "tests/benchmarks/test_shared_ranks.py::"
     "test_the_soak_reads_its_checks_every_read_every_bursts_however_few_checks_each_queued"),
    ("expert-chunk-ends-not-kept", "chunked_gemm.chunk_ends: an exact layout's chunk ends made again on every call "
     "(both fast expert paths: two launches a call more)", CHUNKED,
     "            cache[ends_in] = kept\n", "            pass\n",
     f"{EXPERT_P2P_TEST}::test_exact_chunk_ends_are_kept_per_layout_and_bounded_ones_read_the_layout_every_call "
     "tests/comm/test_expert_nccl.py::test_expert_nccl_communicator_matches_the_reference"),
    ("expert-chunk-ends-ignore-in-place-writes", "chunked_gemm.chunk_ends: an exact layout's kept chunk ends still "
     "used after its segment tensors were written in place (stale ends)", CHUNKED,
     "    if kept is None or kept[0] != version:\n", "    if kept is None:\n",
     f"{EXPERT_P2P_TEST}::test_exact_chunk_ends_are_kept_per_layout_and_bounded_ones_read_the_layout_every_call"),
    ("agreement-no-arrival-grace", "agreement: a failed exchange names at once the ranks not yet arrived (a rank "
     "merely slower than the failure named with the one that left)", "src/flashoverlap/runtime/agreement.py",
     "            if not absent or time.monotonic() >= deadline:\n", "            if True:\n",
     "tests/runtime/test_agreement_edges.py::"
     "test_a_rank_that_arrives_after_the_exchange_failed_is_not_named_with_the_one_that_left"),
    ("agreement-store-death-forgets", "agreement: a store that stops answering during the grace loses the absent "
     "ranks it had already named (the error says the store cannot say)", "src/flashoverlap/runtime/agreement.py",
     "        return known\n", "        return None\n",
     "tests/runtime/test_agreement_edges.py::test_a_store_that_dies_during_the_grace_leaves_its_last_answer"),
    ("gpu-tests-not-serialised", "tests/conftest.py: the GPU tests' lock never taken (the README's two workers "
     "would run GPU tests side by side)", "tests/conftest.py", "        fcntl.flock(handle, fcntl.LOCK_EX)\n",
     "        pass\n", "tests/test_readme.py::test_the_gpu_tests_take_one_lock_in_turn"),
    ("shared-ranks-step-options-unchecked", "shared_ranks: an option the step never reads (--families to the soak, "
     "--calls to mechanics, anything with --merge) is ignored and the run goes on",
     "benchmarks/shared_ranks.py", "    if given:  # an option", "    if False:  # an option",
     "tests/benchmarks/test_shared_ranks.py::test_an_option_the_step_does_not_read_is_refused_by_name"),
    ("known-names-unchecked", "cli.names_of: a misspelt or empty name list passes (the fp8 grouped benchmarks' "
     "--only, moe_gemm's lists, the op lists: nothing run, or the wrong thing, and exit 0)",
     "src/flashoverlap/cli.py", "        if unknown or not names:\n", "        if False:\n",
     "tests/benchmarks/test_options.py tests/test_cli.py"),
    ("expert-p2p-replay-captured-as-eager", "P2P expert path: a replayed call's capture issued as an eager call "
     "(memory-operation waits in the graph)", EXPERT_P2P, "self.issue(call, a, chunks, outputs, captured=True)",
     "self.issue(call, a, chunks, outputs)",
     EXPERT_P2P_TEST + "::test_calls_are_issued_as_captured_inside_our_graph_and_the_users_only"),
    ("expert-p2p-users-capture-as-eager", "P2P expert path: a call inside the user's capture issued as an eager call",
     EXPERT_P2P, "captured=guards.capturing(a))", "captured=False)",
     EXPERT_P2P_TEST + "::test_calls_are_issued_as_captured_inside_our_graph_and_the_users_only"),
    ("p2p-wait-kind-not-in-the-program-key", "P2P path: the resolved program's cache key leaves out how a graph "
     "waits (a program of memory operations reused where the wait kernel was asked for)", P2P,
     "gathered_own, captured, batch, kernel_waits)  # a new workspace empties it",
     "gathered_own, captured, batch)  # a new workspace empties it",
     P2P_TEST + "::test_a_graph_waits_on_flags_with_the_wait_kernel"),
    ("p2p-eager-waits-spin", "P2P path: eager calls wait with the wait kernel too (an SM-holding spin outside graphs)",
     P2P, '        kernel_waits = captured and self._graph_waits() == "kernel"\n',
     '        kernel_waits = self._graph_waits() == "kernel"\n',
     P2P_TEST + "::test_a_graph_waits_on_flags_with_the_wait_kernel"),
    ("p2p-graph-wait-kernel-wrong-flag", "P2P path: a graph's wait kernel spins on the next flag slot, not the wait's",
     P2P, "program.append((_KERNEL_WAIT, stream_index[item.stream], item.flag.row))",
     "program.append((_KERNEL_WAIT, stream_index[item.stream], item.flag.row + 1))",
     P2P_TEST + "::test_a_graph_waits_on_flags_with_the_wait_kernel"),
    ("ipc-shared-gpu-not-seen", "P2P workspace: ranks sharing one GPU are mapped by symmetric memory (which refuses "
     "them) instead of CUDA IPC", "src/flashoverlap/comm/symmetric.py",
     "    shared = len({(host, uuid) for host, uuid, _ in everyone}) < len(everyone)\n",
     "    shared = False\n", "tests/comm/test_symmetric.py"),
    ("ring-start-join-removed", "P2P ring: the copy stream does not wait for the call's start on C", RING,
     '    ops: list = [WaitEvent("X", 0)]\n', "    ops: list = []\n", RING_TEST),
    ("ring-local-start-join-removed", "P2P ring: the local copy stream does not wait for the call's start", RING,
     '        ops.append(WaitEvent("L", 0))\n', "        pass\n", RING_TEST),
    ("ring-region-free-wait-removed", "P2P ring: a partial's region is overwritten without its consumer's free flag",
     RING, '            ops += [Wait(stream, Loc("flag", rank, free_slot(kind, c)), f"region {kind} free at rank {c}")\n'
     "                    for c in consumers]\n", "", RING_TEST),
    ("ring-partial-full-wait-removed", "P2P ring: a partial is pulled without waiting for its producer's flag", RING,
     '                ops += [Wait("X", Loc("flag", rank, full_slot(prv, s - 1, j)), f"partial {s - 1}.{j} from {prv}"),\n'
     "                        Copy(", "                ops += [Copy(", RING_TEST),
    ("ring-partial-signal-removed", "P2P ring: a written partial is not signalled to its consumer", RING,
     '                ops += [Signal("C", Loc("flag", c, full_slot(rank, kind, j))) for c in consumers]\n',
     "                pass\n", RING_TEST),
    ("ring-free-signal-removed", "P2P ring: the consumer does not free a pulled region", RING,
     '                    ops.append(Signal("X", Loc("flag", prv, free_slot(s - 1, rank))))\n',
     "                    pass\n", RING_TEST),
    ("ring-addmm-before-pull", "P2P ring: cuBLAS adds onto a partial before its pull has landed", RING,
     '                ops += [Record("X", event), WaitEvent("C", event)]\n', '                ops += [Record("X", event)]\n',
     RING_TEST),
    ("ring-reduced-copy-early", "P2P all-reduce: the own reduced rows are copied out before cuBLAS wrote them", RING,
     '            ops += [WaitEvent("L", ev), Copy(', "            ops += [Copy(", RING_TEST),
    ("ring-reduced-full-wait-removed", "P2P all-reduce: a peer's reduced rows are pulled before they are written",
     RING, '                ops += [Wait("X", Loc("flag", rank, full_slot(p, RED, j)), f"reduced {j} from {p}"),\n'
     "                        Copy(", "                ops += [Copy(", RING_TEST),
    ("ring-reduced-free-signal-removed", "P2P all-reduce: the reduced region is never freed for the next call", RING,
     '            ops += [Signal("X", Loc("flag", p, free_slot(RED, rank))) for p in peers]\n', "            pass\n",
     RING_TEST),
    ("ag-shard-free-wait-removed", "P2P all-gather: the shard region is overwritten before the peers pulled it",
     RING, '    ops += [Wait("L", Loc("flag", rank, free_slot(SHARD, c)), f"shard free at rank {c}") for c in peers]\n',
     "", RING_TEST),
    ("ag-shard-signal-removed", "P2P all-gather: a published shard sub-band is not signalled", RING,
     '        ops += [Signal("L", Loc("flag", c, full_slot(rank, SHARD, j))) for c in peers]\n', "", RING_TEST),
    ("ag-shard-full-wait-removed", "P2P all-gather: a peer's shard is pulled before it is published", RING,
     '            ops += [Wait("X", Loc("flag", rank, full_slot(q, SHARD, j)), f"shard {j} of {q}"),\n'
     "                    Copy(", "            ops += [Copy(", RING_TEST),
    ("ag-shard-free-signal-removed", "P2P all-gather: a pulled shard is never freed", RING,
     '                ops.append(Signal("X", Loc("flag", q, free_slot(SHARD, rank))))\n', "                pass\n",
     RING_TEST),
    ("ag-multiply-before-pull", "P2P all-gather: cuBLAS multiplies a sub-band before its pull has landed", RING,
     '            ops += [Record("X", event), WaitEvent("C", event),\n                    Mm(',
     '            ops += [Record("X", event),\n                    Mm(', RING_TEST),
    ("p2p-flag-not-reset", "P2P driver: a flag wait does not reset the flag (a batch of the wait alone)", OPS_DRIVER,
     "        if self._batch(stream, 2, self._pair, 0):\n", "        if self._batch(stream, 1, self._pair, 0):\n",
     DRIVER_TEST),
    ("p2p-flag-reset-before-wait", "P2P driver: the flag is reset before the wait (the signal is lost)", OPS_DRIVER,
     "self._pair, 0, _WAIT_VALUE_32, address, value, 0, 0, _WRITE_VALUE_32, address, 0, 0,",
     "self._pair, 0, _WRITE_VALUE_32, address, 0, 0, 0, _WAIT_VALUE_32, address, value, 0,", DRIVER_TEST),
    ("p2p-wait-not-issued", "P2P executor: a flag wait is not issued at all", P2P,
     "                wait_reset(handles[stream], flag)\n", "                pass\n", P2P_TEST),
    ("replay-output-not-in-signature", "P2P replay: a call whose output lies elsewhere replays the old graph", P2P,
     "        return out.data_ptr(), None if gathered", "        return None, None if gathered", P2P_TEST),
    ("replay-hit-skips-nothing-after-release", "P2P replay: release keeps the graphs, so a later call replays one "
     "captured on the freed workspace", P2P, "        self.graphs.clear()\n        self._programs.clear()\n"
     "        self._ready.clear()\n", "        self._programs.clear()\n        self._ready.clear()\n", P2P_TEST),
    ("p2p-signal-copies-no-one", "P2P executor: a signal copies some other word than the one that holds 1", P2P,
     "3, flag, 3, self._one.data_ptr(), 4))", "3, flag, 3, 0, 4))", P2P_TEST),
    ("p2p-forked-signal-on-the-callers-stream", "P2P executor: in a graph the caller's stream copies its own "
     "signals (its next matmul waits for a copy engine)", P2P,
     "                copy(handles[3], step[1], one, 4)", "                copy(handles[0], step[1], one, 4)",
     P2P_TEST),
    ("p2p-signal-stream-not-joined", "P2P executor: the signal stream is not joined back into the caller's stream "
     "(a capture ends with a stream outside it)", P2P, '            joined += (stream_index["S"],)',
     "            joined += ()", P2P_TEST),
    ("replay-signature-ignores-fp16-accumulation", "P2P replay: a call after cuBLAS's fp16-accumulation switch "
     "changed replays the old graph", REPLAY, "_fp16_reduced_precision_reduction(), _FP16_ACCUMULATION(),",
     "_fp16_reduced_precision_reduction(),", P2P_TEST),
    ("p2p-user-capture-signals-by-stream-write", "P2P executor: a call captured into a user's graph signals with "
     "stream writes (graph nodes that cost the host at every launch)", P2P,
     "captured=not call.replay and guards.capturing(a),", "captured=False,", P2P_TEST),
    ("p2p-replay-graph-signals-by-stream-write", "P2P executor: the replay graph is captured with stream-write "
     "signals", P2P, "a, out, gathered, captured=True, packed_own=own)):",
     "a, out, gathered, captured=False, packed_own=own)):", P2P_TEST),
    ("replay-evicts-the-newest", "P2P replay: a capture over the capacity drops the most recently used graph",
     REPLAY, "oldest = min(self._graphs,", "oldest = max(self._graphs,", REPLAY_TEST),
    ("plan-hash-ignores-fields", "Plan: the cached hash leaves out the last fields (sequential, path, gemm)", PLAN,
     "for item in dataclass_fields(self))", "for item in dataclass_fields(self)[:-3])", PLAN_TEST),
    ("plan-hash-pickled", "Plan: the cached hash travels in a pickle (another process salts strings otherwise)",
     PLAN, 'if key != "_hash"}', "if True}", PLAN_TEST),
    ("sequential-hook-skips-device-check", "Runtime: a sequential call with a hook skips the current-device check",
     CALLS, "        if entry[2] and call.hook is None or guards", "        if entry[2] or guards", CALLS_TEST),
    ("replay-inside-user-capture", "Runtime: a call inside a user's capture may launch a graph of its own",
     CALLS, "env.timeout, env.replay and not capturing, spec.scales)", "env.timeout, env.replay, spec.scales)",
     CALLS_TEST),
    ("dispatch-sequential-plan-overlapped", "Runtime: a sequential plan is handed to its path's overlapped communicator",
     CALLS, 'bare = plan.sequential and path != "reference"', "bare = False", CALLS_TEST),
    ("policy-p2p-ignores-group-verdict", "Path policy: P2P is allowed on a group whose ranks lack peer access",
     POLICY, "    reason = request.p2p_reason()\n", "    reason = None\n", POLICY_TEST),
    ("policy-float32-overlapped", "Path policy: float32 may take an overlapped path", POLICY,
     "    if request.dtype in HALF_DTYPES or request.plan is not None and request.plan.sequential:\n        return None",
     "    if True:\n        return None", POLICY_TEST),
    ("policy-auto-ignores-nccl-p2p-disable", "Path policy: path='auto' takes P2P with NCCL_P2P_DISABLE=1", POLICY,
     '        return "NCCL_P2P_DISABLE=1 is set"\n', "        return None\n", POLICY_TEST),
    ("p2p-join-removed", "P2P executor: the copy streams are not joined back into the caller's stream", P2P,
     "            wait_event(handles[0], joins[index])\n", "            pass\n", P2P_TEST),
    ("runtime-fast-path-ignores-shape", "Runtime: a repeated call's cached answer is keyed without a's shape", CALLS,
     "        return (spec.op, spec.name, a.shape, b.shape,", "        return (spec.op, spec.name, b.shape,", CALLS_TEST),
    ("runtime-fast-path-ignores-path", "Runtime: a repeated call's cached answer is keyed without the path asked",
     CALLS, "resolved_group(group),\n                plan, spec.path, env.nccl_p2p_disabled",
     "resolved_group(group),\n                plan, env.nccl_p2p_disabled",
     CALLS_TEST),
    ("sequential-inside-coalescing-manager", "Sequential plan: a call inside a coalescing manager on its group runs, "
     "its collective deferred past the GEMM that needs it", "src/flashoverlap/comm/tp/sequential.py",
     "        refuse_coalescing(self.group.process_group, call.name)\n", "", COLLECTIVES_TEST),
    ("collectives-now-ignore-torch-function", "Sequential plan's collectives: issued straight under a "
     "__torch_function__ mode or subclass, which torch's function would hand them to", COLLECTIVES,
     " or has_torch_function((tensor,))", "", COLLECTIVES_TEST),
    ("collectives-now-reduce-scatter-sums-nothing", "Sequential plan's reduce-scatter: each rank keeps its rows of "
     "its own product, unsummed", COLLECTIVES,
     "_base_now(_REDUCE_SCATTER_METHOD, _OPTIONS[1], reduce_scatter_tensor, out, inp, group)",
     "out.copy_(inp[: out.shape[0]])", COLLECTIVES_TEST),
    ("p2p-matmul-reads-wrong-rows", "P2P executor: every matmul reads the first row block of its input", P2P,
     "                src = parts[src_space][src_part]\n", "                src = parts[src_space][0]\n", P2P_TEST),
    ("p2p-start-event-not-recorded", "P2P executor: the call's start is not recorded on the caller's stream", P2P,
     "        record(events[0], handles[0])\n", "", P2P_TEST),
    ("row-map-store-unmapped", "Grouped GEMM: a row-mapped tile stores its results at its logical rows, not at the "
     "rows the map names", GROUPED, "        c_ptrs = out + gathered[:, None] * stride_om + cols[None, :] * stride_on",
     "        c_ptrs = out + rows[:, None].to(tl.int64) * stride_om + cols[None, :] * stride_on", GROUPED_TEST),
    ("row-map-dense-check-skipped", "Grouped GEMM: every row-mapped tile loads through TMA from its first row, also "
     "one whose rows do not follow each other", GROUPED,
     "            dense = tl.sum(((gathered - first) == tl.arange(0, ROWS)).to(tl.int32), axis=0) == ROWS",
     "            dense = first >= 0", GROUPED_TEST),
    ("policy-ignores-host-time", "Grouped GEMM policy: a way costs its GPU time alone, however small (Triton's "
     "two launches chosen for calls shorter than they take to issue)", POLICY_GROUPED,
     "    return max(gpu_ms(way, call, costs), host_calls(way, call) * costs.host_us / 1e3)",
     "    return gpu_ms(way, call, costs)", POLICY_GROUPED_TEST + "::test_host_time_decides_where_the_gpu_time_is_short"),
    ("policy-host-time-of-one-chunk", "Grouped GEMM policy: the host time of one call counted however many chunks "
     "the op issues", POLICY_GROUPED, "    return max(call.chunks, 1)", "    return 1",
     POLICY_GROUPED_TEST + "::test_host_time_decides_where_the_gpu_time_is_short"),
    ("policy-no-padding", "Grouped GEMM policy: a segment's rows are not rounded up to the way's tile (the small "
     "segments of skewed routing cost nothing extra)", POLICY_GROUPED,
     "        padded = sum(-(-rows // pad_rows) * pad_rows for rows in group)", "        padded = sum(group)",
     POLICY_GROUPED_TEST + "::test_skewed_routing_changes_the_cost"),
    ("policy-cublas-for-any-dtype", "Grouped GEMM policy: torch._grouped_mm allowed for fp16 rows (it takes bf16 "
     "only)", POLICY_GROUPED, "    if dtype == torch.bfloat16 and k % 8 == 0", "    if k % 8 == 0",
     POLICY_GROUPED_TEST + "::test_the_cheapest_allowed_way_is_chosen"),
    ("layout-counts-shifted", "Expert layout: each expert's count taken from the sorted indices' left edges (every "
     "count moved one expert down)", "src/flashoverlap/comm/expert/layout.py",
     "    ends = torch.searchsorted(sorted_expert, experts, right=True)",
     "    ends = torch.searchsorted(sorted_expert, experts, right=False)",
     "tests/moe/test_contract.py::test_layout_on_one_rank"),
    ("layout-host-counts-transposed", "Expert layout: the received counts read to the host taken by expert, not by "
     "source (the loop's segments on the host disagree with the device's)", "src/flashoverlap/comm/expert/layout.py",
     "tuple(tuple(received[s * local : (s + 1) * local]) for s in range(world))",
     "tuple(tuple(received[s :: world][:local]) for s in range(world))",
     "tests/comm/test_expert_nccl.py::test_expert_nccl_communicator_matches_the_reference"),
    ("cublas-chunk-tail-unmasked", "Expert paths, cuBLAS's grouped GEMM in bounded mode: the rows past a chunk's "
     "last segment (undefined in its result) are copied as they are, not zeroed", CHUNKED,
     "            product.masked_fill_(torch.arange(rows, dtype=ends.dtype, device=x.device)[:, None] >= ends[-1:], 0)",
     "            pass",
     "tests/comm/test_expert_nccl.py::test_expert_nccl_communicator_matches_the_reference"),
    ("hybrid-light-experts-skipped", "Hybrid expert GEMM: the light experts' launch is never made", CHUNKED,
     "    if kind != \"hybrid\":\n        return None\n    tables = light_tables(layout, plan.hybrid.heavy_rows)",
     "    if True:\n        return None\n    tables = light_tables(layout, plan.hybrid.heavy_rows)", HYBRID_TEST),
    ("hybrid-heavy-part-runs-every-expert", "Hybrid expert GEMM: the per-chunk part multiplies the light experts "
     "too", CHUNKED, "            if end > start and (only is None or expert in only):",
     "            if end > start:", HYBRID_TEST),
    ("hybrid-row-map-source-order", "Hybrid expert GEMM: the light row map takes each segment's rows from its "
     "source's first segment start", CHUNKED, "        first = torch.cumsum(sizes, 0) - sizes",
     "        first = torch.cumsum(sizes, 0)", HYBRID_TEST),
    ("hybrid-split-cached-without-threshold", "Hybrid expert GEMM: a layout's split is kept when a call cuts it at "
     "another heavy_rows (the chunked part and the light launch then disagree)", CHUNKED,
     "    if cached is None or cached[0] != heavy_rows:", "    if cached is None:", HYBRID_TEST),
    ("hybrid-light-tile-ignores-the-cut", "Hybrid expert GEMM: the light launch's tile ignores the plan's "
     "light_flat_rows", CHUNKED, "    return row_map.numel() >= cut.light_flat_rows * experts.numel()",
     "    return row_map.numel() >= 256 * experts.numel()", HYBRID_TEST),
    ("hybrid-nccl-own-chunk-not-received", "NCCL expert path, hybrid: dispatch leaves the own chunk out of the "
     "received rows unless they are returned (the light launch reads NaN)", EXPERT_NCCL,
     "        if (call.return_gathered or light is not None) and chunks.recv[me]:",
     "        if call.return_gathered and chunks.recv[me]:",
     "tests/comm/test_expert_nccl.py::test_the_hybrid_gemm_matches_the_reference"),
    ("hybrid-p2p-own-chunk-not-gathered", "P2P expert path, hybrid: dispatch's schedule copies the own chunk among "
     "the received rows only when they are returned", EXPERT_P2P,
     "(call.return_gathered or light is not None) and plan.op == \"dispatch\"",
     "call.return_gathered and plan.op == \"dispatch\"", "tests/comm/test_expert_p2p_executor.py"),
    ("hybrid-p2p-light-kernels-not-loaded", "P2P expert path, hybrid: the light launch's kernels are not loaded "
     "before a call queues them behind its flag waits", EXPERT_P2P,
     "        if variant in self._light_warm:\n            return\n",
     "        return\n", "tests/comm/test_expert_p2p_executor.py"),
    ("expert-p2p-schedule-kept-past-workspace-growth", "P2P expert executor: a resolved schedule (slot and peer "
     "addresses) is kept when the workspace grows", EXPERT_P2P,
     "                self.graphs.clear()\n                self._programs.clear()\n",
     "                self.graphs.clear()\n", "tests/comm/test_expert_p2p_executor.py"),
    # This session's (issues 33-35): the agreement check's switch and message, the backend error's op, the fp8 ops.
    ("agreement-ignores-torch-distributed-debug", "Agreement check: TORCH_DISTRIBUTED_DEBUG=DETAIL does not turn it on",
     "src/flashoverlap/settings.py", "AGREEMENT_TIMEOUT if detail else None", "None",
     "tests/runtime/test_mismatch.py"),
    ("agreement-names-no-field", "Agreement check: the error names no argument that differs",
     "src/flashoverlap/runtime/agreement.py", "for field, mine, theirs in zip(fields, row, other[2:]) if mine != theirs]",
     "for field, mine, theirs in zip(fields, row, other[2:]) if False]", "tests/runtime/test_mismatch.py"),
    ("backend-error-not-named", "A backend's error escapes a call without the op, the group or the hint",
     CALLS, "                result = communicator.run(call)\n    except (RuntimeError, dist.DistBackendError) as exc:\n"
     "        agreement.reraise(exc, spec.name, spec.group, env)\n",
     "                result = communicator.run(call)\n    except (RuntimeError, dist.DistBackendError) as exc:\n",
     "tests/runtime/test_mismatch.py"),
    # Issue 42: no silent wrong result by default (the first call of each new call is agreed, with no switch set).
    ("agreement-first-call-skipped", "Agreement without a switch: a call the group has not agreed on runs without "
     "the exchange (ranks that disagree return a wrong result or fail inside the backend)", CALLS,
     "            kind.agree(spec, None, once=True)\n", "            pass\n", DISAGREE_TEST),
    ("agreement-once-skips-new-rows", "Agreement without a switch: every row taken as agreed before (nothing is "
     "ever exchanged)", "src/flashoverlap/runtime/agreement.py", "    if once and key in context.agreed_rows:\n",
     "    if once:\n", DISAGREE_TEST),
    ("agreement-layout-debug-only", "Agreement without a switch: the expert layout agrees only in debug mode (ranks "
     "with other expert counts exchange counts of other sizes)", "src/flashoverlap/runtime/experts.py",
     "    if not guards.capturing():  # else on the group's first layout", "    if debug:  # else on the group's first "
     "layout", DISAGREE_TEST),
    ("agreement-expert-first-call-skipped", "Agreement without a switch: an expert call agrees only in debug mode",
     "src/flashoverlap/runtime/experts.py", "    def agree(self, spec: ExpertSpec, timeout: float | None, once: bool = "
     "False) -> None:\n        if guards.capturing()", "    def agree(self, spec: ExpertSpec, timeout: float | None, "
     "once: bool = False) -> None:\n        if once or guards.capturing()", DISAGREE_TEST),
    ("agreement-inside-capture", "Agreement without a switch: a first call inside a CUDA-graph capture exchanges "
     "its row (a collective and a host sync inside the capture)", CALLS,
     "        if guards.capturing():\n            return\n        scales = spec.scales\n",
     "        scales = spec.scales\n", CALLS_TEST + "::test_a_first_call_is_agreed_once_and_never_inside_a_capture"),
    ("agreement-registry-miss-exchanges", "Agreement without a switch: a registry miss exchanges the row again "
     "though the group agreed on it (a rank whose registry forgot would exchange alone)",
     "src/flashoverlap/runtime/agreement.py", "    if once and key in context.agreed_rows:\n", "    if False:\n",
     CALLS_TEST + "::test_a_first_call_is_agreed_once_and_never_inside_a_capture"),
    # Issue 42: a gloo group may bootstrap the P2P path (it moves no bytes through the backend); nothing else on CUDA.
    ("policy-gloo-moves-cuda-bytes", "Path policy: a gloo group with CUDA tensors is taken for one that moves them "
     "(the NCCL, ring and reference paths and sequential plans allowed)", POLICY,
     '    if request.device.type != "cuda" or "nccl" in request.backend.lower():\n        return None\n',
     "    return None\n", POLICY_TEST),
    ("policy-gloo-refuses-p2p", "Path policy: a gloo group with CUDA tensors refuses the P2P path too (the old rule)",
     POLICY, '    why = _needs_cuda("p2p", request) or _full_precision("p2p", request)\n',
     '    why = _needs_cuda("p2p", request) or _full_precision("p2p", request) or _needs_nccl("p2p", request)\n',
     POLICY_TEST),
    ("policy-gloo-sequential-plan-runs", "Path policy: a P2P call too small to overlap runs its sequential plan on a "
     "gloo group (its collective needs NCCL)", POLICY, "    if plan.sequential and refused is not None:",
     "    if False:", POLICY_TEST),
    ("policy-gloo-small-shapes-sequential", "Path policy: a small P2P call on a gloo group gets the sequential plan "
     "(whose collective needs NCCL) where the schedule could overlap it", POLICY,
     "                        allow_sequential=not overlap_only)", "                        allow_sequential=True)",
     POLICY_TEST),
    ("policy-decide-ignores-tuned-plan", "Path and plan in one pass: the plan tuned for the shape is passed over",
     POLICY, "    plan = tuned or plan_of(path, facts)\n", "    plan = plan_of(path, facts)\n", POLICY_TEST),
    ("policy-plan-rates-for-every-path", "Path and plan in one pass: the default plan of every CUDA path is sized "
     "by the measured rates (P2P measures the NCCL collective it never runs)", POLICY,
     '    if cuda and path == "nccl":  # the ring', "    if cuda:  # the ring", POLICY_TEST),
    ("fp8-partials-unrounded", "fp8 reference: the partial products are summed before rounding to the output dtype",
     "src/flashoverlap/comm/tp/reference.py", "collective(summed, partial.to(self.dtype).float())",
     "collective(summed, partial.float())", "tests/ops/test_scaled.py"),
    ("fp8-gather-own-scales", "fp8 all-gather: every row takes this rank's scales, not its own shard's",
     "src/flashoverlap/comm/tp/reference.py", "                c[rows].copy_(bands(a_rows, slice(0, grp.rows), scale_rows))",
     "                c[rows].copy_(bands(a_rows, slice(0, grp.rows)))", "tests/ops/test_scaled.py"),
    ("fp8-block-scales-ignored", "fp8: block-wise B scales taken as one per column",
     "src/flashoverlap/comm/scaled.py", "        scale = scale.repeat_interleave(BLOCK, dim=0).repeat_interleave(BLOCK, dim=1)[: b.shape[0], : b.shape[1]]",
     "        scale = scale[:1, :1]", "tests/ops/test_scaled.py"),
    ("fp8-block-k-unchecked", "fp8: block-wise K not a multiple of 128 accepted",
     "src/flashoverlap/runtime/checks.py", '    if scales.mode == "block" and k % BLOCK:', "    if False:",
     "tests/ops/test_scaled.py"),
    # Session 16 (issue 35): the NCCL path in fp8, the wire format, the fp8 plan policy.
    ("fp8-bands-scaled-by-the-first-rows", "NCCL path, fp8 cuBLAS bands: every band scaled by the first rows' scales",
     NCCL, "scale_rows = None if scales.mode == \"tensor\" else scales.a[first : first + rows]",
     "scale_rows = None if scales.mode == \"tensor\" else scales.a[:rows]", "tests/comm/test_bands.py"),
    ("fp8-packed-scales-unaligned", "fp8 all-gather: a packed row's scales start right after its K bytes, not at a "
     "16-byte boundary (no TMA, no fp32 view on odd K)", "src/flashoverlap/comm/scaled.py",
     "    offset = _aligned(k)\n", "    offset = k\n", "tests/comm/test_bands.py"),
    ("fp8-plan-counts-bf16-output", "fp8 plans: the overlap rule counts output bytes as bf16 whatever the output dtype",
     "src/flashoverlap/tune/fp8.py", "element_size=out_size,", "element_size=2,", "tests/tune/test_fp8.py"),
    ("fp8-block-always-triton", "fp8 plans: block-wise never takes torch's block-wise kernel (cuBLAS bands)",
     "src/flashoverlap/tune/fp8.py", 'gemm = "cublas" if path == "nccl" and scaling == "block" and cublas_block else',
     'gemm = "cublas" if False else', "tests/tune/test_fp8.py"),
    ("fp8-paths-unchecked", "Path policy: an fp8 call may take an overlapped path that does not run fp8",
     POLICY, "        if path in FP8_PATHS:\n", "        if True:\n", POLICY_TEST),
    ("fp8-sequential-gather-local-scales", "Sequential fp8 all-gather: the gathered rows multiplied with this rank's "
     "scales, not the gathered ones", "src/flashoverlap/comm/tp/sequential.py",
     "scaled.scaled_mm(a_full, b, scales, scale_full, out=c)", "scaled.scaled_mm(a_full, b, scales, out=c)",
     "tests/comm/test_collectives.py::test_the_sequential_communicator_runs_fp8_calls"),
    ("fp8-stages-flat", "fp8 tiles: one pipeline depth everywhere, not the sweep's (4 for deep K and the all-gather)",
     "src/flashoverlap/tune/fp8.py", 'stages = 4 if op == "all_gather" or k >= DEEP_PIPELINE_K else 3',
     "stages = 3", "tests/tune/test_fp8.py"),
    ("moe-layout-agrees-once-on-the-cpu", "moe_layout: CPU routing agreed on once per (experts, top-k), as on a "
     "GPU, so ranks each repeating a different layout return it", "src/flashoverlap/runtime/experts.py",
     "    every = debug or calls.agree_every_call(topk_idx, \"auto\", group)", "    every = debug",
     "tests/runtime/test_disagreement.py::test_ranks_each_repeating_a_different_call_raise_on_the_reference_path"),
    ("scales-signature-without-devices", "fp8 calls: the scales' devices left out of the call's signature, so a "
     "repeated call with a scale moved to another device skips the device check", "src/flashoverlap/comm/scaled.py",
     "self.a.dtype, self.a.device, self.b.shape,\n                self.b.dtype, self.b.device, self.out_dtype,",
     "self.a.dtype, self.b.shape,\n                self.b.dtype, self.out_dtype,",
     "tests/ops/test_errors.py::test_a_repeated_fp8_call_whose_scale_moved_to_another_device_is_refused"),
    ("sparse-operands-unchecked", "The ops' operand check: a sparse a or b is not refused (a torch error deep inside "
     "the call instead)", "src/flashoverlap/runtime/checks.py",
     "        check_dense(op, name, t)\n        if t.ndim != 2:", "        if t.ndim != 2:",
     "tests/ops/test_errors.py::test_sparse_operands_are_named_before_anything_runs"),
    ("moe-weight-grad-ignores-alignment", "The experts' weight gradient: torch._grouped_mm on rows that are not a "
     "multiple of 16 bytes (it refuses their strides)", "src/flashoverlap/ops/moe_library.py",
     "    if aligned and (rows.device.type", "    if (rows.device.type",
     "tests/moe/test_moe_nn.py::test_widths_off_sixteen_bytes_train_as_the_plain_block"),
    ("styles-uneven-weight-through-the-ops", "Styles: a weight whose sharded width does not divide runs through the "
     "ops (whose agreement refuses the ranks' different widths) rather than PyTorch's style",
     "src/flashoverlap/nn/styles.py", "        return module.weight.shape[self._sharded_dim] % binding.world != 0",
     "        return False",
     "tests/nn/test_styles.py::test_a_weight_whose_width_does_not_divide_runs_as_pytorchs_style"),
    ("spawn-fresh-interpreters-start-without-env", "testing.spawn: fresh interpreters start with the caller's "
     "environment, env= applied only after torch's import (too late for what torch reads then)", TESTING,
     "        with _environment(environ):  # a fresh interpreter starts with it", "        with contextlib.nullcontext("
     "):  # a fresh interpreter starts with it",
     "tests/test_testing.py::test_a_variable_read_at_import_is_there_when_the_fresh_interpreter_starts"),
    ("spawn-lingering-rank-gets-a-minute", "testing.spawn: once every rank reported, a rank that does not end gets a "
     "fixed minute, not what is left of the call's timeout", TESTING,
     "                       else max(1.0, min(60.0, deadline - time.monotonic())))",
     "                       else 60.0)",
     "tests/test_testing.py::test_spawn_keeps_its_timeout_while_the_ranks_end"),
    ("expert-auto-choice-not-logged", "The expert ops' path='auto' choice on CUDA is not logged",
     "src/flashoverlap/runtime/experts.py",
     '    if path == "auto" and context.device.type == "cuda":  # as the tensor-parallel ops\' choice (CPU tensors: '
     'no log)', "    if False:",
     "tests/runtime/test_policy.py::test_the_expert_ops_say_once_per_group_which_path_auto_took_and_why"),
    ("expert-auto-choice-logged-every-call", "path='auto''s choice (the expert ops', the tensor-parallel ops') logged "
     "on every call, not once a group", "src/flashoverlap/runtime/plans.py", '        context.logged.add(("auto", what))\n',
     "",
     "tests/runtime/test_policy.py::test_the_expert_ops_say_once_per_group_which_path_auto_took_and_why"),
    ("spawn-world-of-zero-returns-nothing", "testing.spawn: a world of 0 ranks returns [] instead of being refused",
     TESTING, "    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:",
     "    if not isinstance(world_size, int) or isinstance(world_size, bool):",
     "tests/test_testing.py::test_spawn_refuses_a_world_it_cannot_start"),
    ("group-name-takes-anything", "The ops through their custom op (autograd): any group passes, a DeviceMesh meets "
     "an AttributeError and a group's name is taken", "src/flashoverlap/ops/library.py",
     "    if not isinstance(group, dist.ProcessGroup):\n        check_group(op, group)", "    if False:\n        pass",
     "tests/ops/test_errors.py::test_a_device_mesh_or_a_group_name_is_refused_alike_with_and_without_autograd"),
    ("release-takes-anything", "release: a DeviceMesh or a group's name matches no context, and nothing is freed, "
     "silently", "src/flashoverlap/runtime/context.py", "    refuse_non_group(\"release\", group)", "    pass",
     "tests/ops/test_errors.py::test_a_device_mesh_or_a_group_name_is_refused_alike_with_and_without_autograd"),
    ("gathered-input-gradient-dropped", "all_gather_gemm: the gathered input's gradient (return_gathered) is not "
     "passed back to the shard", "src/flashoverlap/ops/library.py",
     "    if grad_gathered is not None and ctx.needs_input_grad[0]:", "    if False:",
     "tests/ops/test_all_gather_gemm.py::test_the_gathered_input_passes_its_gradient_back"),
    ("float8-input-amax-local", "Float8 styles: the row-wise style's input scale from this rank's amax, not the group's",
     "src/flashoverlap/nn/float8.py", "x_split = True if rowwise else",
     "x_split = False if rowwise else",
     "tests/nn/test_float8_styles.py::test_float8_styles_at_two_ranks_match_the_unsharded_model_as_torchaos_do"),
    ("launch-fingerprint-ignores-alignment", "Direct launches: a tensor's fingerprint leaves out its 16-byte alignment, "
     "so a kernel compiled for aligned operands is launched on misaligned ones", "src/flashoverlap/kernels/launch.py",
     "        return value.dtype, value.data_ptr() % 16 == 0", "        return value.dtype",
     "tests/kernels/test_launch.py"),
    ("nccl-all-gather-own-shard-in-slot-0", "NCCL all-gather: the one strided copy puts this rank's shard in slot 0 of "
     "every band", COLLECTIVES, "plan.world_size, rows, -1)[:, rank]", "plan.world_size, rows, -1)[:, 0]",
     NCCL_TEST + "::test_nccl_communicator_code_with_an_asynchronous_producer"),
    ("nccl-all-gather-direct-slot-at-band-start", "NCCL all-gather, direct calls: this rank's slot is taken at its "
     "band's start", NCCL, "(g.out_row_start + self.rank * g.rows) * width * size", "g.out_row_start * width * size",
     NCCL_TEST + "::test_nccl_communicator_code_with_an_asynchronous_producer"),
    ("expert-nccl-bounded-h-not-zeroed", "Expert NCCL path, bounded mode: dispatch's output is not zeroed inside the "
     "issued (and captured) work, so its padding rows keep what the allocator left", EXPERT_NCCL,
     "        if bounded:\n            h.zero_()\n", "",
     "tests/comm/test_expert_nccl.py::test_bounded_calls_replay_and_exact_ones_do_not"),
    ("replay-recaptures-dropped-signatures", "Replay: a signature whose graph was dropped for room is captured "
     "again (a model with more signatures than the capacity pays a capture on every other call)",
     "src/flashoverlap/comm/replay.py", "        if signature in self._dropped:", "        if False:",
     "tests/comm/test_replay.py"),
    ("sequential-product-not-into-its-buffer", "Sequential plan: the matmul allocates its product instead of writing "
     "the call's buffer (a replayed graph's output is not the buffer the call returns)",
     "src/flashoverlap/comm/tp/sequential.py", "torch.mm(a, b, out=product)", "product = torch.mm(a, b)",
     "tests/comm/test_sequential.py::test_the_sequential_communicator_matches_plain_pytorch_and_replays"),
    ("expert-nccl-combine-rows-not-quantised", "Expert NCCL path, fp8 from bf16 rows: combine does not quantise its "
     "rows as its first issued step (it multiplies the unwritten wire buffer)", EXPERT_NCCL,
     "        call, a = wired(call, a, self._new)  # fp8 from bf16 rows: quantised, into the call's own wire rows\n"
     "        out, back = outputs[0]", "        out, back = outputs[0]",
     "tests/moe/test_fp8_paths.py::test_fp8_nccl_path_matches_the_oracle"),
    ("expert-p2p-rows-not-quantised", "Expert P2P path, fp8 from bf16 rows: the issued schedule does not quantise "
     "the rows first (it sends and multiplies the bf16 rows as they came)", EXPERT_P2P,
     "        call, a = wired(call, a, self._new)  # fp8 from bf16 rows: quantised, into the call's own wire rows\n"
     "        plan, layout, scales", "        plan, layout, scales",
     "tests/moe/test_fp8_paths.py::test_fp8_p2p_path_matches_the_oracle"),
    ("expert-wire-rows-unwritten", "fp8 experts from bf16 rows: the call's wire rows are allocated but never written "
     "(the quantisation left out of the issued step)", "src/flashoverlap/comm/expert/scaled.py",
     "    quantise_into(a, q, scale, scales.mode)\n    return dataclasses.replace(",
     "    return dataclasses.replace(", "tests/moe/test_fp8_paths.py::test_fp8_nccl_path_matches_the_oracle"),
    ("expert-nccl-wire-before-the-lookup", "Expert NCCL path, fp8 from bf16 rows: the wire rows made before the "
     "graph lookup (a replayed call's host allocates and quantises them on every call; the signature names them)",
     EXPERT_NCCL, "        outputs = self._outputs(call, a)\n        issue = ",
     "        call, a = wired(call, a, self._new)\n        outputs = self._outputs(call, a)\n        issue = ",
     "tests/moe/test_fp8_paths.py::test_fp8_rows_from_bf16_are_quantised_inside_the_replayed_work"),
    ("nccl-wait-kernel-loaded-inside-a-capture", "NCCL path: the graphs' counter-wait kernel loaded by a plan's first "
     "call even inside a capture (a module load recorded into the user's graph, deadlock rule 3)", NCCL,
     'and self.device.type == "cuda"\n                and not guards.capturing(self.counters)):',
     'and self.device.type == "cuda"\n                and True):',
     NCCL_TEST + "::test_the_graphs_wait_kernel_is_loaded_once_eagerly_by_the_first_plan_that_uses_it"),
    ("nccl-wait-kernel-loaded-by-every-plan", "NCCL path: the counter-wait kernel loaded by all-gather and cuBLAS-band "
     "plans too (their first call compiles a kernel they never launch)", NCCL,
     "not self._wait_loaded and plan.counts_tiles", "not self._wait_loaded",
     NCCL_TEST + "::test_the_graphs_wait_kernel_is_loaded_once_eagerly_by_the_first_plan_that_uses_it"),
    ("nccl-fp8-shard-packed-into-another-slot", "NCCL path, fp8 all-gather: the own shard's packed rows written into "
     "the next rank's slots of the bands (the gathered A holds a peer's rows twice and its own nowhere)", NCCL,
     "a_slots, scale_slots = self.packed.slots(bands, plan.world_size, rows, rank)",
     "a_slots, scale_slots = self.packed.slots(bands, plan.world_size, rows, (rank + 1) % plan.world_size)",
     NCCL_TEST + "::test_the_fp8_all_gather_packs_its_rows_into_their_slots_and_gathers_them"),
    ("nccl-fp8-shard-placed-twice", "NCCL path, fp8 all-gather: a shard packed into its slots is placed again from "
     "itself as if it were a packed buffer (the rows land in the wrong rows of the bands)", NCCL,
     "        if not shard_placed:\n", "        if True:\n",
     NCCL_TEST + "::test_the_fp8_all_gather_packs_its_rows_into_their_slots_and_gathers_them"),
    ("nccl-fp8-triton-branch-places-again", "NCCL path, fp8 all-gather under the signalling GEMM: the shard packed "
     "into its slots is placed again from itself as if it were a packed buffer", NCCL,
     "            self.all_gather(gathered, shard, plan, shard_placed=placed)",
     "            self.all_gather(gathered, shard, plan)",
     NCCL_TEST + "::test_the_fp8_all_gather_packs_its_rows_into_their_slots_and_gathers_them"),
    ("nccl-own-shard-product-in-the-next-block", "NCCL path, all-gather under cuBLAS bands (every captured call):"
     " the own shard's product written into the next rank's block of the result", NCCL,
     "operand.product(*own, b, c_blocks[comm.rank])",
     "operand.product(*own, b, c_blocks[(comm.rank + 1) % plan.world_size])",
     NCCL_TEST + "::test_the_fp8_all_gather_packs_its_rows_into_their_slots_and_gathers_them"),
    ("nccl-own-shard-product-skipped", "NCCL path, all-gather under cuBLAS bands (every captured call): the own "
     "shard's rows never multiplied", NCCL,
     "    operand.product(*own, b, c_blocks[comm.rank])", "    pass",
     NCCL_TEST + "::test_the_fp8_all_gather_packs_its_rows_into_their_slots_and_gathers_them"),
    ("moe-layout-errors-unnamed", "moe_layout: the errors of its own collective check (ranks that disagree on the "
     "mode or the bound, a bad index, a routing beyond the bound) name the internal expert_layout, not the op",
     "src/flashoverlap/runtime/experts.py",
     "                         name=name)", "                         )",
     "tests/runtime/test_disagreement.py::test_moe_layouts_own_collective_errors_name_the_op"),
    ("nccl-own-slots-fallback-skipped", "NCCL path, fp8 all-gather under cuBLAS bands with a shard cuBLAS does not "
     "take as it lies: the own rows' slots never multiplied", NCCL,
     "        for grp in plan.groups:\n            multiply(grp, comm.rank)\n", "        pass\n",
     NCCL_TEST + "::test_the_fp8_all_gather_packs_its_rows_into_their_slots_and_gathers_them"),
    ("cublas-takes-misaligned-fp8", "comm/scaled.cublas_takes: an fp8 operand that starts off a 16-byte boundary, or "
     "whose rows are not 16-byte multiples apart, goes to cuBLAS", "src/flashoverlap/comm/scaled.py",
     "    if (a.data_ptr() % ALIGN or b.data_ptr() % ALIGN or (a.shape[0] > 1 and a.stride(0) % ALIGN)\n",
     "    if False and (0\n",
     "tests/comm/test_bands.py::test_cublas_takes_fp8_operands_only_on_16_byte_boundaries"),
    ("pack-own-drops-the-scales", "NCCL path, fp8 all-gather with even bands: the own rows are written into their "
     "slots but not their scales", NCCL,
     "        scale_slots.copy_(scale_rows.reshape(bands, rows, -1))\n", "",
     NCCL_TEST + "::test_the_fp8_all_gather_packs_its_rows_into_their_slots_and_gathers_them"),
    ("pack-own-rows-to-the-wrong-bands", "NCCL path, fp8 all-gather with even bands: the own rows are written into "
     "their slots band-major in the wrong order (a band's slot holds rows of another band)", NCCL,
     "        a_slots.copy_(a_shard.reshape(bands, rows, self.k))\n",
     "        a_slots.copy_(a_shard.reshape(rows, bands, self.k).transpose(0, 1))\n",
     NCCL_TEST + "::test_the_fp8_all_gather_packs_its_rows_into_their_slots_and_gathers_them"),
    ("packed-rows-slot-scales-over-the-rows", "comm/scaled.PackedRows.slots: the own slots' scales view starts at "
     "the row's first byte (the scales written over the fp8 rows, read from the wrong bytes)",
     "src/flashoverlap/comm/scaled.py",
     "                                           (start + _aligned(self.k)) // 4))",
     "                                           start // 4))",
     "tests/comm/test_bands.py::test_packed_rows_views_are_unpack_rows_and_own_slots"),
    ("expert-rows-allocated-before-the-lookup", "Expert calls: the received/returned rows allocated before the graph "
     "lookup even where the call does not return them (a replayed call's host allocates them on every call)",
     "src/flashoverlap/comm/expert/contract.py",
     "    return first, _rows_shape(call, a) if call.return_gathered else None",
     "    return first, _rows_shape(call, a)",
     "tests/moe/test_fp8_paths.py::test_fp8_rows_from_bf16_are_quantised_inside_the_replayed_work"),
    ("expert-p2p-rows-buffer-not-issued", "Expert P2P path: a combine that does not return its rows sends the "
     "products from a buffer the schedule never allocated (the rows are taken from the call's outputs as they are)",
     EXPERT_P2P, "            out, back = outputs[0], issued_rows(call, a, outputs, self._new)",
     "            out, back = outputs[0], outputs[1] if outputs[1] is not None else torch.empty(0)",
     "tests/comm/test_expert_p2p_executor.py"),
    ("plan-cublas-counts-tiles", "Plan.counts_tiles: a cuBLAS-band plan said to count tiles (its communicator would "
     "wait on counters nothing bumps)", PLAN,
     '        return self.op != "all_gather" and self.gemm != "cublas" and not self.sequential',
     '        return self.op != "all_gather" and not self.sequential', PLAN_TEST),
    ("one-queue-capture-keeps-the-signalling-gemm", "Inside a user's capture under CUDA_DEVICE_MAX_CONNECTIONS=1, an "
     "NCCL reduction keeps the signalling GEMM and its spinning counter waits (a graph's launch order could put a "
     "wait ahead of the GEMM on the one queue)", CALLS,
     "            plan = policy.captured_plan(plan, env.single_queue)", "            plan = plan",
     CALLS_TEST + "::test_inside_a_users_capture_on_one_queue_the_nccl_reductions_wait_on_edges"),
    ("one-queue-bands-every-plan", "Under CUDA_DEVICE_MAX_CONNECTIONS=1 every captured plan is made cuBLAS bands, "
     "all-gathers and P2P plans included", POLICY,
     '    if single_queue and plan.path == "nccl" and plan.counts_tiles:', "    if single_queue:",
     CALLS_TEST + "::test_inside_a_users_capture_on_one_queue_the_nccl_reductions_wait_on_edges"),
    ("fp8-expert-scale-shape-unchecked", "fp8 expert ops: a scale tensor of the wrong shape is taken (the kernels "
     "would read past it or apply the wrong scales)", "src/flashoverlap/runtime/experts.py",
     "    if t.dtype is not torch.float32 or t.shape != want or t.device != device:",
     "    if t.dtype is not torch.float32 or t.device != device:",
     "tests/moe/test_fp8_moe_ops.py::test_fp8_errors_name_the_argument_before_anything_is_sent"),
    ("fp8-expert-grad-unchecked", "fp8 expert ops: an operand that requires grad is taken (the ops record no "
     "autograd: its gradient silently never comes)", "src/flashoverlap/ops/moe.py",
     "    refuse_grad(name, ((rows_name, rows),", "    (lambda *_: None)(name, ((rows_name, rows),",
     "tests/moe/test_fp8_moe_ops.py::test_fp8_errors_name_the_argument_before_anything_is_sent"),
    ("hybrid-light-boundary-is-light", "hybrid GEMM: an expert with exactly the threshold's rows counted light on the "
     "device (the host counts it heavy), so the light launch multiplies another expert's rows",
     "src/flashoverlap/comm/expert/chunked_gemm.py", "is_light = (rows > 0) & (rows < heavy_rows)",
     "is_light = (rows > 0) & (rows <= heavy_rows)",
     "tests/moe/test_hybrid.py::test_the_light_experts_on_the_device_are_the_hosts_at_every_threshold"),
    ("launch-one-pass-ignores-alignment", "Launcher: the launch's own pass over its arguments leaves a plain tensor's "
     "16-byte alignment out, so a kernel compiled for aligned operands is launched on misaligned ones",
     "src/flashoverlap/kernels/launch.py", "            append((value.dtype, value.data_ptr() % 16 == 0))\n",
     "            append((value.dtype, True))\n", "tests/kernels/test_launch.py"),
    ("launch-integer-class-ignores-divisibility", "Launcher: an integer's class leaves out Triton's divisibility-by-16 "
     "hint, so a kernel compiled for a row count that is a multiple of 16 is relaunched for one that is not",
     "src/flashoverlap/kernels/launch.py", "    return int, _width(value), value == 1, value % 16 == 0",
     "    return int, _width(value), value == 1", "tests/kernels/test_launch.py"),
    ("launch-integers-keyed-by-value", "Launcher: integers keyed by value, so every exact-mode expert call whose row "
     "count is new goes through the JIT", "src/flashoverlap/kernels/launch.py",
     "            found = self.by_value[value] = integer_class(value)\n",
     "            found = self.by_value[value] = (int, value)\n",
     "tests/kernels/test_launch.py::test_a_new_row_count_of_a_known_class_launches_directly"),
    ("launch-unspecialised-keyed-by-value", "Direct launches: a do_not_specialize integer keyed by its value, so each "
     "new group index or tile count of the graphs' counter wait goes through the JIT (inside a capture)",
     "src/flashoverlap/kernels/launch.py", "unspecialised(value) if i in self._by_width else",
     "fingerprint(value) if i in self._by_width else", "tests/kernels/test_launch.py"),
    ("nccl-graph-waits-are-memops", "NCCL path: inside a graph the counter waits stay stream memory operations (the "
     "graph's launch then costs the host about 2 us per group)", NCCL,
     "in_graph = ready is None and guards.capturing(self.counters)", "in_graph = False",
     NCCL_TEST + "::test_a_captured_call_waits_on_counters_with_the_wait_kernel"),
    ("wait-kernel-does-not-spin", "kernels/counters: the graph's counter wait looks once instead of spinning",
     "src/flashoverlap/kernels/counters.py", "    while seen < value:\n", "    if seen < value:\n",
     "tests/kernels/test_counters.py"),
    ("wait-kernel-resets-the-wrong-counter", "kernels/counters: the graph's counter wait resets the first counter, "
     "not its own", "src/flashoverlap/kernels/counters.py", "tl.atomic_xchg(counters_ptr + index, 0",
     "tl.atomic_xchg(counters_ptr, 0", "tests/kernels/test_counters.py"),
    ("nccl-workspace-in-the-signature", "NCCL path: the replay signature holds the workspace's address too (a replayed "
     "call must then allocate its workspace on every call)", NCCL,
     "        return addresses(self.returned)",
     "        return addresses([t for t in (*self.returned, self.product, self.gathered) if t is not None])",
     NCCL_TEST + "::test_the_replay_signature_names_every_tensor_a_call_touches"),
    ("nccl-graph-wait-off-the-comm-stream", "NCCL path with the direct NCCL calls: inside a graph the counter wait "
     "kernel is launched on the caller's stream (the collectives would no longer wait for their group)", NCCL,
     "with contextlib.nullcontext() if direct and not in_graph else", "with contextlib.nullcontext() if direct else",
     NCCL_TEST + "::test_a_captured_call_waits_on_counters_with_the_wait_kernel"),
    ("expert-agreement-without-out-dtype", "expert ops: ranks whose fp8 combine outputs differ in dtype agree (the "
     "row leaves out_dtype out): gloo aborts the process", "src/flashoverlap/runtime/experts.py",
     "                  0 if spec.scales is None else DTYPE_CODES[spec.scales.out_dtype],", "                  0,",
     "tests/moe/test_fp8_moe_ops.py::test_fp8_errors_name_the_argument_before_anything_is_sent"),
    ("expert-agreement-without-local-experts", "expert ops: the row leaves the weights' L out: a rank passing every "
     "expert's weights raises alone after the exchange while its peers wait in the all-to-all",
     "src/flashoverlap/runtime/experts.py", "                  b.shape[0]]", "                  0]",
     "tests/moe/test_moe_errors.py::test_a_rank_whose_weights_hold_other_experts_makes_every_rank_raise"),
    ("agreement-values-by-code", "agreement: the values that differ shown by their codes, not their names",
     "src/flashoverlap/runtime/agreement.py", "    return field[1][code]\n", "    return str(code)\n",
     DISAGREE_TEST + " tests/moe/test_moe_errors.py"),
    ("fp8-ops-take-operands-that-require-grad", "fp8 ops: an operand that requires grad runs (partial gradients "
     "through the bias and scales, none through the collective)", "src/flashoverlap/ops/library.py",
     "            if getattr(t, \"requires_grad\", False):\n                raise ValueError(f\"{name}: {arg} requires grad",
     "            if False:\n                raise ValueError(f\"{name}: {arg} requires grad",
     "tests/ops/test_scaled.py::test_bad_input_is_named_before_anything_is_sent"),
    ("fp8-scales-not-tensors-in-the-signature", "fp8 ops: a Python float scale reaches the call's signature (an "
     "AttributeError naming nothing)", CALLS,
     "            return None  # not cacheable: the first call's checks", "            pass  # not cacheable: the first call's checks",
     "tests/ops/test_errors.py::test_fp8_scales_that_are_not_tensors_are_named_before_the_signature"),
    ("expert-ops-take-e5m2", "expert ops: e5m2 rows or weights run (torch's grouped fp8 kernel refuses them mid-call)",
     "src/flashoverlap/runtime/experts.py", "if fp8 and t.dtype is not torch.float8_e4m3fn:",
     "if fp8 and t.dtype not in FP8:",
     "tests/moe/test_fp8_moe_ops.py::test_fp8_errors_name_the_argument_before_anything_is_sent"),
    ("moe-routing-infers-k-from-no-tokens", "nn: a rank with no tokens routed by the gate (reshape to [0, -1] fails)",
     "src/flashoverlap/nn/moe.py", "route(logits.reshape(rows.shape[0], logits.shape[-1]),",
     "route(logits.reshape(rows.shape[0], -1),",
     "tests/moe/test_moe_nn.py::test_a_rank_without_tokens_routes_by_the_gate"),
    ("moe-block-no-rows-off-the-graph", "nn: the plain MoEBlock on no rows returns a zeros tensor that is off "
     "x's graph (backward() raises 'does not require grad')",
     "src/flashoverlap/nn/moe.py", "        if rows.shape[0] == 0:", "        if False:",
     "tests/moe/test_moe_nn.py::test_a_rank_without_tokens_routes_by_the_gate"),
    ("fp8-block-scale-of-the-tile-not-the-block", "fp8 grouped GEMM, block-wise: a tile narrower than 128 takes "
     "the weight scale of block off_n // BLOCK_N, not off_n // 128 (a tile starting mid-block reads the next block's)",
     GROUPED, "(off_n // 128 if scalar_w else cols_in // 128)", "(off_n // BLOCK_N if scalar_w else cols_in // 128)",
     "tests/kernels/test_grouped_fp8.py::test_interpreted_block_scales_at_other_tile_widths"),
    ("fp8-block-scale-per-column-at-128", "fp8 grouped GEMM, block-wise: the weight's scale taken per column even "
     "where the tile lies in one 128-wide block (two tile-sized multiplies per K step, not one)", GROUPED,
     "            scalar_w: tl.constexpr = BLOCK_N <= 128", "            scalar_w: tl.constexpr = False",
     "tests/kernels/test_grouped_fp8.py::test_every_fp8_kernel_variant_compiles_for_hopper"),
    ("gluon-block-reads-a-product-across-the-back-edge", "Gluon block-wise kernel: the first half issues step k's "
     "MMA, then waits for all but it and scales step k-1's product (issued in the iteration before): ptxas serialises "
     "every MMA (C7514), undoing the overlap", BLOCK_SCALED,
     "            odd = warpgroup_mma_wait(num_outstanding=0, deps=(odd,))\n"
     "            even = _product(a_bufs, b_bufs, ready, even, base + k, STAGES)\n",
     "            even = _product(a_bufs, b_bufs, ready, even, base + k, STAGES)\n"
     "            odd = warpgroup_mma_wait(num_outstanding=1, deps=(odd,))\n", BLOCK_SCALED_TEST),
    ("gluon-block-scaling-not-pinned", "Gluon block-wise kernel: the scaled sum left free (the compiler moves it past "
     "the next MMA's issue; ptxas then serialises the MMAs)", BLOCK_SCALED,
     "    return warpgroup_mma_wait(num_outstanding=1, deps=(acc + product * scale[:, None],))\n",
     "    return acc + product * scale[:, None]\n", BLOCK_SCALED_TEST),
    ("short-k-tile-never-taken", "fp8 grouped GEMM: block-wise on Hopper the launcher never takes the short-K "
     "Gluon tile (64x128, two programs an SM)", GROUPED,
     "        return SCALED_TILE_HOPPER_SHORT_K if k < SHORT_K else SCALED_TILE_HOPPER\n",
     "        return SCALED_TILE_HOPPER\n",
     "tests/kernels/test_grouped_fp8.py::test_the_launchers_own_fp8_tile_by_mode_kernel_and_k"),
    ("launch-fingerprint-ignores-gluon-layout", "Launcher: a Gluon descriptor's shared layout left out of the key (a "
     "kernel compiled for one swizzle relaunched for another)", "src/flashoverlap/kernels/launch.py",
     "getattr(value, \"padding\", None), getattr(value, \"layout\", None))",
     "getattr(value, \"padding\", None), None)",
     "tests/kernels/test_launch.py::test_a_gluon_descriptors_fingerprint_holds_its_shared_layout"),
    ("reference-agreed-on-first-calls-only", "agreement: the reference path agrees on a call's first call only "
     "(ranks each repeating a different call return wrong values)", CALLS,
     "    return dist.get_world_size(group) > 1\n", "    return False\n", DISAGREE_TEST),
    ("replicated-grads-summed-after-accumulation", "styles: ReplicatedWithGradAllReduce sums .grad after each "
     "accumulation (a sum of sums over micro-batches)", "src/flashoverlap/nn/styles.py",
     "                    param.register_hook(summed)",
     "                    param.register_post_accumulate_grad_hook(lambda p: torch.distributed.all_reduce(p.grad, "
     "group=group))", "tests/nn/test_styles.py::test_replicated_modules_sum_their_gradients_over_the_ranks"),
    ("parallelize-takes-float8-linear", "parallelize: torchao's Float8Linear sharded as a bf16 layer, silently",
     "src/flashoverlap/nn/layers.py", '                if type(module).__name__ == "Float8Linear":',
     "                if False:", "tests/nn/test_layers.py::test_layer_errors_name_the_argument"),
    ("fp8-step-scales-early-return", "fp8 grouped GEMM, block-wise: a constexpr branch returns early (the "
     "interpreter stops there, the compiler does not: tiles at most 128 wide fail to compile)", GROUPED,
     "    if SCALAR_W:\n        s = (sa * sb)[:, None]\n    else:\n        s = sa[:, None] * sb[None, :]\n    return s\n",
     "    if SCALAR_W:\n        return (sa * sb)[:, None]\n    return sa[:, None] * sb[None, :]\n",
     "tests/kernels/test_grouped_fp8.py::test_every_fp8_kernel_variant_compiles_for_hopper"),
    ("every-call-rule-by-exact-type", "agreement: the every-call rule asks a tensor's exact type, so a Parameter "
     "operand on one rank decides apart from a plain tensor on another (a deadlock)", CALLS,
     "not (isinstance(a, torch.Tensor) and a.is_cpu)", "not (type(a) is torch.Tensor and a.is_cpu)",
     DISAGREE_TEST + "::test_a_parameter_operand_on_one_rank_is_the_same_call"),
    ("fp8-layer-cast-by-to-dtype", "nn: .to(torch.bfloat16) casts a Float8ExpertParallelMLP's fp8 weights and "
     "scales (the next call fails)", "src/flashoverlap/nn/fp8_moe.py",
     "            if moved.dtype != kept.dtype:", "            if False:",
     "tests/moe/test_moe_nn.py::test_an_fp8_layer_keeps_its_format_under_to_dtype"),
    ("block-widths-unchecked-at-build", "nn: fp8='block' with widths not multiples of 128 is built, and fails at its "
     "first call's dispatch", "src/flashoverlap/nn/fp8_experts.py",
     "    if hidden % BLOCK or ffn % BLOCK:", "    if False:",
     "tests/moe/test_moe_nn.py::test_block_wise_widths_are_checked_when_the_layer_is_built"),
    ("moe-layer-width-unchecked", "nn: an input of another width than H is reshaped into other rows by the expert "
     "layer, without an error", "src/flashoverlap/nn/moe.py",
     "    if x.dim() == 0 or x.shape[-1] != hidden:", "    if x.dim() == 0:",
     "tests/moe/test_moe_nn.py::test_shapes_and_gradients_are_refused_by_the_layer_before_anything_runs"),
    ("fp8-layer-gate-grad-unchecked", "nn: a gated fp8 inference layer called with autograd on is refused by the "
     "combine, after the dispatch, naming topk_weights", "src/flashoverlap/nn/fp8_moe.py",
     "        if torch.is_grad_enabled() and (x.requires_grad or topk_weights.requires_grad):",
     "        if torch.is_grad_enabled() and x.requires_grad:",
     "tests/moe/test_moe_nn.py::test_shapes_and_gradients_are_refused_by_the_layer_before_anything_runs"),
    ("moe-gate-dtype-unchecked", "nn: an input of another dtype than the gate's is refused by the gate's matmul, in "
     "torch's words", "src/flashoverlap/nn/moe.py",
     "                if x.dtype != self.gate.weight.dtype and not torch.is_autocast_enabled(x.device.type):",
     "                if False:",
     "tests/moe/test_moe_nn.py::test_shapes_and_gradients_are_refused_by_the_layer_before_anything_runs"),
    ("expert-width-field-says-F", "runtime: ranks whose dispatch weights differ in width are told they disagree on "
     "the expert width F, with 2F's values", "src/flashoverlap/runtime/experts.py",
     "\"expert weights' width (dispatch's N, combine's K)\"", "\"expert width F\"",
     DISAGREE_TEST + "::test_ranks_that_disagree_raise_on_every_rank_and_none_returns_a_tensor_with_no_switch_set"),
    ("style-runs-a-subclass-as-linear", "nn: a style runs an nn.Linear subclass with a forward of its own as a "
     "plain linear (wrong values, no error)", "src/flashoverlap/nn/styles.py",
     "        if own_forward(module) is nn.Linear.forward:", "        if True:",
     "tests/nn/test_style_edges.py::test_the_styles_fast_path_stands_aside_where_it_must"),
    ("parallelize-shards-a-subclass", "nn: parallelize shards an nn.Linear subclass with a forward of its own, whose "
     "shard runs nn.Linear's", "src/flashoverlap/nn/layers.py",
     "                if type(module).forward is not nn.Linear.forward:", "                if False:",
     "tests/nn/test_style_edges.py::test_the_styles_fast_path_stands_aside_where_it_must"),
    ("style-fallback-unagreed", "nn: a style's rank that runs PyTorch's path while a peer runs the op takes no part "
     "in the agreement (one returns, the group hangs)", "src/flashoverlap/nn/styles.py",
     "        self._agree_on_branch(x, binding, True)\n", "\n",
     "tests/nn/test_style_edges.py::test_the_styles_fast_path_stands_aside_where_it_must"),
    ("colwise-local-branch-unagreed", "nn: a colwise rank whose op's forward is local takes no part in the "
     "agreement while a peer falls back to PyTorch's path (one returns, the other waits)",
     "src/flashoverlap/nn/styles.py",
     "            self._agree_on_branch(local, binding, False)  # linear_column's forward exchanges nothing\n", "",
     "tests/nn/test_style_edges.py::test_the_styles_fast_path_stands_aside_where_it_must"),
    ("replicate-dtensor-grad-partial", "nn: a Replicate DTensor under input_layouts=Shard(1) gets a Partial gradient "
     "where PyTorch's style reduces it", "src/flashoverlap/nn/styles.py",
     "isinstance(layout, Replicate) and isinstance(x, DTensor) and not isinstance(self.input_layouts[0],",
     "False and not isinstance(self.input_layouts[0],",
     "tests/nn/test_style_edges.py::test_the_styles_fast_path_stands_aside_where_it_must"),
    ("tied-linear-one-name", "nn: parallelize replaces a tied linear under the matched name only (the tie breaks)",
     "src/flashoverlap/nn/layers.py", "                    for alias in names[id(module)]:",
     "                    for alias in [name]:",
     "tests/nn/test_style_edges.py::test_the_styles_fast_path_stands_aside_where_it_must"),
    ("style-path-unchecked", "nn: a style built with a misspelt path raises only in a backward",
     "src/flashoverlap/nn/styles.py", "        self.path = check_path_name(type(self).__name__, path)",
     "        self.path = path",
     "tests/nn/test_style_edges.py::test_the_styles_fast_path_stands_aside_where_it_must"),
    ("compile-empty-operands-rewritten", "compile: an empty product's all-reduce is rewritten into the op, which "
     "refuses M = 0 where the model compiled without the pass runs", "src/flashoverlap/compile.py",
     "        if _empty(_val(mm), *map(_val, _operands(mm))):\n            return self._left(\"all_reduce\"",
     "        if False:\n            return self._left(\"all_reduce\"",
     "tests/test_compile_pass.py::test_collectives_that_are_not_exactly_the_ops_are_left"),
    ("compile-switch-keeps-compiled-code", "compile: enable()/disable() leave torch.compile's caches, so a model "
     "compiled before runs its old code under a new torch.compile", "src/flashoverlap/compile.py",
     "    torch._dynamo.reset()", "    pass",
     "tests/test_compile_pass.py::test_turning_the_pass_on_or_off_resets_compiled_code"),
    ("hf-plan-unknown-sorted-raw", "nn: styles_from_hf_plan sorts unknown plan values as they are: None beside a "
     "string is a TypeError, not the error naming them", "src/flashoverlap/nn/styles.py",
     "sorted({repr(style) for style in plan.values()", "sorted({style for style in plan.values()",
     "tests/nn/test_styles.py::test_hf_plan_maps_onto_the_styles"),
    ("exit-handler-leaves-cycles", "runtime: the exit handler drops its contexts but collects no cycle, so a "
     "destroyed gloo group held by a layer in a cycle is freed in the interpreter's teardown (std::terminate)",
     "src/flashoverlap/runtime/context.py", "        self.contexts.clear()\n        gc.collect()\n",
     "        self.contexts.clear()\n",
     "tests/runtime/test_context.py::test_the_exit_handler_lets_go_of_a_group_held_in_a_reference_cycle"),
    ("non-member-group-unnamed", "a rank outside a group passes new_group's NON_GROUP_MEMBER: a type error that "
     "does not say it is not a member", "src/flashoverlap/runtime/checks.py",
     "    if isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER:",
     "    if False:",
     "tests/ops/test_errors.py::test_a_rank_outside_the_group_is_told_so_and_num_experts_takes_any_integer"),
    # The replay lane (runtime/calls.execute, Communicator.replayer).
    ("lane-key-without-strides", "Replay lane: the key leaves out a's strides (a square operand's transpose, one "
     "address and shape, takes the lane of the operand itself)", CALLS, "a.data_ptr(), a.shape, a.stride(), a.dtype,",
     "a.data_ptr(), a.shape, a.dtype,", CALLS_TEST + "::test_a_call_on_the_tensors_of_a_replayed_call_takes_the_lane_"
     "and_nothing_else_does"),
    ("lane-key-without-scales", "Replay lane: an fp8 call's key leaves out its scales and bias (a call with other "
     "scales replays the graph of the first ones)", CALLS,
     "            fp8 = (scales.mode, scales.out_dtype, laid_out(scale_a), laid_out(scale_b),\n",
     "            fp8 = (scales.mode, scales.out_dtype,\n", CALLS_TEST + "::test_fp8_lanes_name_the_scales_and_the_bias"),
    ("lane-inside-a-capture", "Replay lane: a call inside a user's capture launches the lane's graph", CALLS,
     "guards.on_current_device(spec.a) and not guards.capturing(spec.a):", "guards.on_current_device(spec.a):",
     CALLS_TEST + "::test_a_call_on_the_tensors_of_a_replayed_call_takes_the_lane_and_nothing_else_does"),
    ("lane-in-debug-mode", "Replay lane: taken with the agreement check on (TORCH_DISTRIBUTED_DEBUG=DETAIL), so "
     "repeated calls skip it", CALLS, "    lanes = env.replay and env.agreement is None and not every",
     "    lanes = env.replay and not every",
     CALLS_TEST + "::test_a_call_on_the_tensors_of_a_replayed_call_takes_the_lane_and_nothing_else_does"),
    ("lane-miss-returns-none", "Replay lane: a lane whose graph is gone returns its None as the call's result",
     CALLS, "            if done is not None:\n                return done\n", "            return done\n",
     CALLS_TEST + "::test_a_call_on_the_tensors_of_a_replayed_call_takes_the_lane_and_nothing_else_does"),
    ("lane-backend-error-not-named", "Replay lane: a backend's error in a replayed lane escapes without the op, the "
     "group or the hint", CALLS, "                done = lane(spec)\n            except (RuntimeError, "
     "dist.DistBackendError) as exc:\n                agreement.reraise(exc, spec.name, spec.group, env)\n",
     "                done = lane(spec)\n            except (RuntimeError, dist.DistBackendError) as exc:\n",
     CALLS_TEST + "::test_a_call_on_the_tensors_of_a_replayed_call_takes_the_lane_and_nothing_else_does"),
    ("lanes-kept-after-release", "Replay lane: release(group) keeps the lanes (a call after it would replay a "
     "released communicator's graph)", "src/flashoverlap/runtime/context.py",
     "        self.resolved.clear()\n        self.lanes.clear()\n        for key in", "        self.resolved.clear()\n"
     "        for key in", CALLS_TEST + "::test_a_call_on_the_tensors_of_a_replayed_call_takes_the_lane_and_nothing_"
     "else_does"),
    ("nccl-lane-allocates-the-result-only", "NCCL replay lane: an all-gather that returns its gathered input allocates "
     "only the result (the graph under run's signature is not found; fp8's dense rows never returned)", NCCL,
     "            tensors = allocate(shapes, device)", "            tensors = allocate(shapes[:1], device)", NCCL_TEST + "::test_the_replay_lane_finds_the_graph_run_captured"),
    ("p2p-lane-with-a-hook", "P2P replay lane: built for a call with a hook (its graph holds the hook's tensors, "
     "which the lane key does not name)", P2P, "        if (not call.replay or call.hook is not None or not "
     "self.graphs", "        if (not call.replay or not self.graphs", P2P_TEST),
    ("p2p-lane-strided-shard", "P2P replay lane: built for an all-gather whose shard run copies (a new address every "
     "call)", P2P, "                or plan.op == \"all_gather\" and not a.is_contiguous()):", "                ):",
     P2P_TEST),
    ("sequential-lane-inside-coalescing", "Sequential replay lane: replays inside torch.distributed's coalescing "
     "manager, which run refuses", "src/flashoverlap/comm/tp/sequential.py",
     "            refuse_coalescing(process_group, name)  # as ``run``", "            pass  # as ``run``",
     "tests/comm/test_sequential.py::test_the_sequential_communicator_matches_plain_pytorch_and_replays"),
    ("lane-key-only-when-lanes-held", "Replay lane: a call's replayer is kept only where its key was made before the "
     "call, which happens only once a lane is held (so none ever is)", CALLS,
     "            lane_key = kind.lane_key(spec, env) if lane_key is None else lane_key\n",
     "", CALLS_TEST + "::test_a_call_on_the_tensors_of_a_replayed_call_takes_the_lane_and_nothing_else_does"),
    # The expert ops' replay lane (runtime/experts.ExpertKind.lane_key, comm/expert/contract.replayer).
    ("expert-lane-key-without-layout", "Expert replay lane: the key leaves out the layout's tensors (a call on another "
     "layout of the same shapes replays the graph of the first one's routing)", "src/flashoverlap/runtime/experts.py",
     "                tuple([calls.laid_out(t) for t in routing.tensors()]), routing.bound,",
     "                routing.bound,", CALLS_TEST + "::test_a_bounded_expert_call_on_the_tensors_of_a_replayed_one_takes_"
     "the_lane"),
    ("expert-lane-in-exact-mode", "Expert replay lane: taken in exact mode, whose calls are issued eagerly (split "
     "sizes from the host)", "src/flashoverlap/runtime/experts.py",
     "        if (spec.hook is not None or type(routing) is not Layout or routing.mode != \"bounded\"",
     "        if (spec.hook is not None or type(routing) is not Layout",
     CALLS_TEST + "::test_a_bounded_expert_call_on_the_tensors_of_a_replayed_one_takes_the_lane"),
    ("expert-lane-key-without-router-weights", "Expert replay lane: the key leaves out where the router weights lie "
     "(a combine with other weights skips their checks)", "src/flashoverlap/runtime/experts.py",
     "                routing.experts, None if weights is None else calls.laid_out(weights),",
     "                routing.experts, None,",
     CALLS_TEST + "::test_a_bounded_expert_call_on_the_tensors_of_a_replayed_one_takes_the_lane"),
    ("expert-lane-skips-the-gather", "Expert replay lane: a weighted combine's lane reads the layout's own weights "
     "instead of gathering the call's router weights (the graph captured for the gathered ones is never found)",
     "src/flashoverlap/comm/expert/contract.py",
     "        weights = layout.send_ordered(spec.topk_weights) if gathers else layout.weights",
     "        weights = layout.weights", "tests/comm/test_expert_nccl.py::test_the_replay_lane_finds_the_graph_run_"
     "captured"),
    ("expert-lane-allocates-out-of-order", "Expert replay lane: the rows buffer allocated before the result (run's "
     "order reversed: the caching allocator's addresses differ, the graph is never found)",
     "src/flashoverlap/comm/expert/contract.py",
     "        first = spec.out if first_shape is None else new(*first_shape)\n"
     "        extra = None if rows_shape is None else new(*rows_shape)\n",
     "        extra = None if rows_shape is None else new(*rows_shape)\n"
     "        first = spec.out if first_shape is None else new(*first_shape)\n",
     "tests/comm/test_expert_nccl.py::test_the_replay_lane_finds_the_graph_run_captured"),
    ("expert-p2p-lane-workspace-read-once", "P2P expert replay lane: the workspace's address read when the lane is "
     "built (after the workspace moves, the lane replays a graph of the old one)", "src/flashoverlap/comm/expert/p2p.py",
     "        return replayer(call, self.graphs, self._new, lambda: (self.workspace.buffer.data_ptr(),))",
     "        own = (self.workspace.buffer.data_ptr(),)\n        return replayer(call, self.graphs, self._new, "
     "lambda: own)", "tests/comm/test_expert_p2p_executor.py::test_the_replay_lane_replays_the_graph_run_captured_and_"
     "names_the_workspace"),
    # Session 17: the settings' switches and the debug deadline refuse values they would misread.
    ("switch-reads-any-value", "Settings: a switch given `true` or `false` is read one way silently instead of "
     "raising", "src/flashoverlap/settings.py", "    if value not in (\"0\", \"1\"):\n",
     "    if False:\n", "tests/runtime/test_settings.py"),
    ("agreement-keys-outlive-release", "Agreement: a released context's arrival keys pass for arrivals at the next "
     "context's exchanges (the missing rank goes unnamed)", "src/flashoverlap/runtime/agreement.py",
     "store.add(f\"flashoverlap/contexts/{context.rank}\", 1)", "1",
     "tests/runtime/test_agreement_edges.py::test_a_rank_absent_after_release_is_named"),
    ("agreement-own-deadline", "Agreement without a switch: a deadline of its own, not the group's timeout",
     "src/flashoverlap/runtime/agreement.py", "    return seconds - min(30.0, 0.1 * seconds)",
     "    return settings.AGREEMENT_TIMEOUT",
     "tests/runtime/test_agreement_edges.py::test_the_check_without_a_switch_waits_as_long_as_the_groups_own_timeout"),
    # The CLI and plan-cache audit's fixes.
    ("curve-past-max-bytes", "tune bandwidth: the curve's sizes double past --max-mib (a P2P copy larger than its "
     "landing buffer)", "src/flashoverlap/tune/tuner.py", "        size = min(2 * size, max_bytes)\n",
     "        size = 2 * size\n", "tests/tune/test_tuner_edges.py"),
    ("cache-exact-entry-unchecked", "Plan cache: an exact entry's plan taken whatever its op, world size or shape",
     "src/flashoverlap/tune/cache.py",
     "    if (plan.op, plan.world_size, f\"{plan.m}x{plan.n}x{plan.k}\") != (op, world_size, shape):",
     "    if False:", "tests/tune/test_cache_edges.py"),
    ("tune-bandwidth-without-cache", "tune bandwidth with the cache off measures and stores nothing, silently",
     "src/flashoverlap/tune/tuner.py", "    if cache.cache_dir() is None:\n        raise RuntimeError(cache.NO_CACHE)\n",
     "", "tests/tune/test_tuner_edges.py"),
    ("tune-plan-paths-on-rank-zero-only", "tune plan: a rank with a problem of its own skips the paths' collective "
     "question its peers ask", "src/flashoverlap/cli.py",
     "    paths = tune_paths(args.path, target) if plan else None\n", "    paths = None\n",
     "tests/test_cli_edges.py"),
    ("debug-timeout-nan-off", "Settings: FLASHOVERLAP_DEBUG_TIMEOUT=nan read as no bound", "src/flashoverlap/settings.py",
     "    if math.isnan(seconds):", "    if False:", "tests/runtime/test_settings.py"),
    # The documented-commands audit's fixes.
    ("cli-unknown-option-top-usage", "CLI: an option a command does not take (`tune bandwidth --bogus`) refused with "
     "the top-level usage, which lists none of that command's options", "src/flashoverlap/cli.py",
     "        top.commands.get((args.command, what), top).error(", "        top.error(",
     "tests/test_cli.py::test_an_unknown_option_is_refused_with_its_commands_usage"),
    ("cpu-run-out-unchecked", "The labelled CPU measurements (nccl_host_python.py, fp8_moe_host_python.py): --out "
     "not checked until every row is measured (a folder, or another script's file: a traceback, the rows lost)",
     "benchmarks/cpu_runs.py", "    parser.add_argument(\"--out\", default=None, type=results_out(script),",
     "    parser.add_argument(\"--out\", default=None,",
     "tests/benchmarks/test_options.py::test_a_cpu_measurement_refuses_an_out_it_could_not_merge_into_before_measuring"),
    ("fp8-ops-cases-unchecked", "benchmarks.fp8_ops: --out and --shapes not checked before the group starts (a "
     "folder, M not divisible by the ranks, K not by the block: a traceback from every rank mid-run)",
     "benchmarks/fp8_ops.py", "    problem = out_problem(args.out) or case_problem(args, world)",
     "    problem = None", "tests/benchmarks/test_fp8_ops.py::test_an_out_or_a_case_it_could_not_run_is_refused_before_"
     "the_group_starts"),
    ("fp8-block-dry-run-ignores-options", "benchmarks.fp8_block --dry-run: the GPU run's --tokens, --steps silently "
     "ignored", "benchmarks/fp8_block.py", "        if ignored:\n", "        if False:\n",
     "tests/benchmarks/test_fp8_block.py::test_the_dry_run_refuses_an_out_it_could_not_write_and_the_gpu_runs_options"),
    ("diagnostic-out-folder-taken", "The grouped-GEMM fit and validation: a results path that is a folder taken, "
     "opened after the first sample (a traceback)", "benchmarks/diagnostics/results_file.py",
     "    if os.path.isdir(text):\n        raise argparse.ArgumentTypeError(f\"{text} is a folder; name the file\")\n",
     "", "tests/benchmarks/test_grouped_gemm_fit.py::test_a_results_path_or_count_it_could_not_use_is_refused_before_"
     "measuring"),
    ("mutate-out-unchecked", "tools/mutate.py: --out a folder taken, written after every mutation ran (a traceback, "
     "the rows lost)", "tools/mutate.py", "    if out.is_dir():\n        parser.error(", "    if False:\n        parser.error(",
     "tests/test_mutate_cli.py::test_an_out_it_could_not_write_is_refused_before_any_mutation_runs"),
    ("diagnostic-help-needs-cuda", "The GPU diagnostics: --help answered by the GPU check (\"needs 1 CUDA GPU\"; on a GPU "
     "the whole run, then \"None\")", "benchmarks/diagnostics/results_file.py",
     "    if path_only:\n        results_argument(doc)\n    elif any(", "    if False:\n        results_argument(doc)\n    "
     "elif False and any(", "tests/benchmarks/test_diagnostics_need_cuda.py"),
]


def run(name: str, what: str, path: str, old: str, new: str, tests: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="flashoverlap-mutant-") as tmp:
        copy = Path(tmp) / "repo"
        shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(".git", "__pycache__", "*.egg-info", ".ruff_cache"))
        target = copy / path
        text = target.read_text()
        if text.count(old) != 1:
            return {"name": name, "what": what, "file": path, "tests": tests, "caught": None,
                    "note": f"the mutation's text occurs {text.count(old)} times (the code changed: update the list)"}
        target.write_text(text.replace(old, new))
        env = dict(os.environ, PYTHONPATH=f"{copy / 'src'}{os.pathsep}{copy}")
        start = time.time()
        proc = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests.split()],
                              cwd=copy, env=env, capture_output=True, text=True, timeout=900)
        tail = [line for line in proc.stdout.splitlines() if line.strip()][-1:]
        # A failing test is a catch; a mutant that does not even import (pytest's exit code 2, collection errors)
        # is a broken mutation, not a catch.
        return {"name": name, "what": what, "file": path, "tests": tests,
                "caught": proc.returncode == 1 if proc.returncode != 2 else None,
                "seconds": round(time.time() - start, 1), "pytest": tail[0] if tail else proc.stderr[-200:]}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="*", default=None,
                        help="mutation names to run (default: all); a subset needs --out (the committed results "
                             "file holds the whole list's run)")
    parser.add_argument("--out", default=None, help="the results file (default, for the whole list: "
                                                    "benchmarks/results/mutations.json)")
    args = parser.parse_args(argv)
    committed = ROOT / "benchmarks" / "results" / "mutations.json"
    if args.only is not None:
        known = {m[0] for m in MUTATIONS}
        unknown = [name for name in args.only if name not in known]
        if unknown or not args.only:
            parser.error(f"--only: unknown mutation(s) {unknown}" if unknown else "--only names no mutation")
        if args.out is None or Path(args.out).resolve() == committed.resolve():
            parser.error(f"--only runs a subset: give --out another file (the committed {committed.relative_to(ROOT)} "
                         "holds the whole list's run)")
    args.out = args.out or str(committed)
    out = Path(args.out)  # written once every mutation has run (minutes to half an hour): checked first
    if out.is_dir():
        parser.error(f"--out {args.out}: is a folder; name the results file")
    if not out.parent.is_dir() or not os.access(out if out.exists() else out.parent, os.W_OK):
        parser.error(f"--out {args.out}: {out if out.exists() else out.parent} is not a writable folder or file")
    chosen = [m for m in MUTATIONS if args.only is None or m[0] in args.only]
    rows = []
    for mutation in chosen:
        row = run(*mutation)
        rows.append(row)
        print(f"{'CAUGHT' if row['caught'] else 'MISSED' if row['caught'] is False else 'BROKEN'}  {row['name']}: "
              f"{row.get('pytest', row.get('note'))}", flush=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    command = " ".join(["python tools/mutate.py", *map(shlex.quote, argv)])
    meta = {"commit": commit + ("-dirty" if dirty else ""), "command": command,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    missed = [r["name"] for r in rows if not r["caught"]]
    print(f"{len(rows) - len(missed)} of {len(rows)} caught" + (f"; not caught: {missed}" if missed else ""))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
