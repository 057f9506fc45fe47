"""Symmetric vs regular NCCL all-reduce, in place, bf16, under CUDA-graph replay.

Each graph iteration is the real pattern: a kernel writes the input (a copy from a source
buffer), then the in-place all-reduce through our pynccl communicator. The symmetric case's input
lives in the registered NCCL symmetric pool; the regular case's in the default allocator, so NCCL
runs its ring/tree kernels. Both include the same write, so their ratio compares the all-reduces.
The table drives ``SYMM_ALL_REDUCE_WIN_RANGES`` in
``python/sglang/srt/distributed/all_reduce_dispatch.py``.

Usage: python scripts/bench_all_reduce.py [--world-size 2] [--iters 20]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from sglang.test.multiprocess import run_distributed

KiB, MiB = 1 << 10, 1 << 20
SIZES = [4 * KiB << i for i in range(15)]  # 4 KiB .. 64 MiB
# MoE outputs: hidden x tokens x bf16, for hidden 4096 / 7168 and 1..512 tokens
MOE_SIZES = sorted({h * t * 2 for h in (4096, 7168) for t in (1, 8, 64, 512)})


def _time_graph(x: torch.Tensor, src: torch.Tensor, comm: object, iters: int) -> float:
    """Median microseconds per (write + all-reduce) over graph replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up on the capture stream (registers nothing new)
        for _ in range(3):
            x.copy_(src)
            comm.all_reduce(x)  # type: ignore[attr-defined]
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(iters):
            x.copy_(src)
            comm.all_reduce(x)  # type: ignore[attr-defined]
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(15):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(begin.elapsed_time(end) * 1e3 / iters)
    return statistics.median(times)


def _rank_main(rank: int, world_size: int, iters: int) -> list[tuple[int, float, float]]:
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.distributed.symm_mem import allocator as pa

    tp = ps.initialize_model_parallel(world_size)
    comm = tp.pynccl_comm
    assert comm is not None, "symmetric memory needs pynccl on the TP group"
    rows = []
    for nbytes in sorted(set(SIZES + MOE_SIZES)):
        n = nbytes // 2
        src = torch.randn(n, device=tp.device, dtype=torch.bfloat16)
        with pa.use_symmetric_memory(tp):
            x_symm = torch.empty(n, device=tp.device, dtype=torch.bfloat16)
        assert pa.is_tensor_in_symmetric_pool(x_symm, tp)
        x_plain = torch.empty(n, device=tp.device, dtype=torch.bfloat16)
        regular = _time_graph(x_plain, src, comm, iters)
        symmetric = _time_graph(x_symm, src, comm, iters)
        rows.append((nbytes, regular, symmetric))
        del x_symm, x_plain, src
    ps.destroy_model_parallel()
    return rows


def _fmt(nbytes: int) -> str:
    return (
        f"{nbytes // MiB} MiB" if nbytes >= MiB and nbytes % MiB == 0 else f"{nbytes / KiB:g} KiB"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--world-size", type=int, default=torch.cuda.device_count())
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    results = run_distributed(
        _rank_main,
        args.world_size,
        args.iters,
        backend="nccl",
        enable_symm_mem=True,
        timeout_s=540,
        env={"NCCL_NVLS_ENABLE": "0"},
    )
    print(
        f"\nworld size {args.world_size}, bf16 in-place all-reduce, graph replay, us per (write + "
        "all-reduce)"
    )
    print(f"{'size':>10} {'regular us':>11} {'symmetric us':>13} {'symm/regular':>13}")
    for i, (nbytes, _, _) in enumerate(results[0]):
        # the slowest rank decides the step time
        regular = max(r[i][1] for r in results)
        symmetric = max(r[i][2] for r in results)
        print(
            f"{_fmt(nbytes):>10} {regular:>11.2f} {symmetric:>13.2f} {symmetric / regular:>13.3f}"
        )


if __name__ == "__main__":
    main()
