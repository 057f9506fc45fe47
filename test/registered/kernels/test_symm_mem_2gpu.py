"""NCCL symmetric memory across two GPUs (TP=2).

On each rank, with ``--enable-symm-mem`` semantics:
* a pool tensor's pynccl all-reduce runs NCCL symmetric kernels (profiler names ``ncclSymk...``),
  a default-allocator tensor's runs the regular ones, and both give the exact sum;
* ``GroupCoordinator.all_reduce`` sends a pool tensor of a winning size (16 KiB) to the symmetric
  kernels and one of a losing size (64 KiB) to the regular path;
* a CUDA graph captured after an eager warm-up on the capture stream replays the symmetric
  kernel;
* the pool's segment list (sizes, allocation order) and the registered windows are identical on
  both ranks; NCCL_CUMEM_ENABLE is 1 and NCCL_NVLS_ENABLE is left as the host set it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from sglang.test.ci_register import register_cuda_ci
from sglang.test.multiprocess import run_distributed
from sglang.test.run import run_this_file

register_cuda_ci(est_time=180, suite="h200-2gpu", num_gpus=2)

KiB = 1 << 10
SYMK = "ncclSymk"


def _nccl_kernels(fn: Callable[[], object]) -> list[str]:
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = {evt.key for evt in prof.key_averages()}
    return sorted(n for n in names if n.startswith(("ncclSymk", "ncclDevKernel", "ncclKernel")))


def _pattern(n: int, rank: int, device: torch.device) -> torch.Tensor:
    # Small integers: exact in bf16, and so is their two-rank sum.
    return ((torch.arange(n, device=device) % 13) + 16 * rank).to(torch.bfloat16)


def _expected(n: int, device: torch.device) -> torch.Tensor:
    return ((torch.arange(n, device=device) % 13) * 2 + 16).to(torch.bfloat16)


def _two_rank_flow(rank: int, world_size: int) -> dict[str, Any]:
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.distributed.symm_mem import allocator as pa
    from sglang.test.symm_graph_capture import capture_in_graph_pool

    tp = ps.initialize_model_parallel(2)
    assert tp.pynccl_comm is not None, "symm-mem turns pynccl on for the TP group"
    comm, device = tp.pynccl_comm, tp.device
    out: dict[str, Any] = {
        "cumem": os.environ.get("NCCL_CUMEM_ENABLE"),
        "nvls": os.environ.get("NCCL_NVLS_ENABLE"),
    }

    # pynccl directly: pool tensor -> symmetric kernels, default tensor -> regular kernels.
    for nbytes in (16 * KiB, 1024 * KiB):
        n = nbytes // 2
        with pa.use_symmetric_memory(tp):
            x = torch.empty(n, dtype=torch.bfloat16, device=device)
        assert pa.is_tensor_in_symmetric_pool(x, tp)
        x.copy_(_pattern(n, rank, device))
        comm.all_reduce(x)  # warm-up: the first symmetric call initialises NCCL's kernels
        x.copy_(_pattern(n, rank, device))
        pool_names = _nccl_kernels(lambda x=x: comm.all_reduce(x))
        y = _pattern(n, rank, device).clone()
        assert not pa.is_tensor_in_symmetric_pool(y, tp)
        comm.all_reduce(y.clone())
        plain_names = _nccl_kernels(lambda y=y: comm.all_reduce(y))
        assert any(k.startswith(SYMK) for k in pool_names), (nbytes, pool_names)
        assert plain_names and not any(k.startswith(SYMK) for k in plain_names), (
            nbytes,
            plain_names,
        )
        assert torch.equal(x, _expected(n, device)) and torch.equal(y, _expected(n, device))
        out[f"pynccl_{nbytes}"] = (pool_names, plain_names)

    # Through the dispatcher: 16 KiB is in the world-2 table, 64 KiB is not.
    for nbytes, symmetric in ((16 * KiB, True), (64 * KiB, False)):
        n = nbytes // 2
        with pa.use_symmetric_memory(tp):
            a = torch.empty(n, dtype=torch.bfloat16, device=device)
        a.copy_(_pattern(n, rank, device))
        tp.all_reduce(a)
        a.copy_(_pattern(n, rank, device))
        names = _nccl_kernels(lambda a=a: tp.all_reduce(a))
        assert names and any(k.startswith(SYMK) for k in names) is symmetric, (nbytes, names)
        assert torch.equal(a, _expected(n, device))
        out[f"dispatch_{nbytes}"] = names

    # CUDA graph: warm up eagerly on the capture stream, capture, replay symmetric.
    n = 8 * KiB // 2
    src = _pattern(n, rank, device)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            with pa.use_symmetric_memory(tp):
                w = torch.empty(n, dtype=torch.bfloat16, device=device)
            w.copy_(src)
            tp.all_reduce(w)
            del w
    torch.cuda.synchronize()
    windows_before = pa.registered_windows(tp)
    graph = torch.cuda.CUDAGraph()
    with capture_in_graph_pool(graph, stream):
        with pa.use_symmetric_memory(tp):
            z = torch.empty(n, dtype=torch.bfloat16, device=device)
        z.copy_(src)
        tp.all_reduce(z)
    assert pa.is_tensor_in_symmetric_pool(z, tp)
    assert pa.registered_windows(tp) == windows_before, "no registration during capture"
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(z, _expected(n, device))
    replay_names = _nccl_kernels(graph.replay)
    assert torch.equal(z, _expected(n, device))
    # Some profiler setups do not list kernels launched by a graph; when they do, they are Symk.
    assert all(k.startswith(SYMK) for k in replay_names), replay_names
    out["graph_replay"] = replay_names

    segments = [size for _, size in pa.pool_segments(device)]
    windows = [size for _, size in pa.registered_windows(tp)]
    everyone = tp.all_gather_object((segments, sorted(windows)))
    assert everyone[0] == everyone[1], f"pool differs across ranks: {everyone}"
    out["segments"] = segments
    out["windows"] = sorted(windows)
    return out


def test_symmetric_all_reduce_on_two_gpus() -> None:
    results = run_distributed(
        _two_rank_flow, 2, backend="nccl", enable_symm_mem=True, timeout_s=400
    )
    r0, r1 = results
    assert r0["segments"] == r1["segments"] and r0["segments"], (r0["segments"], r1["segments"])
    assert r0["windows"] == r1["windows"] == sorted(r0["segments"])
    for r in results:
        assert r["cumem"] == "1"
        assert r["nvls"] == os.environ.get("NCCL_NVLS_ENABLE"), "NCCL_NVLS_ENABLE must be untouched"
    print({k: v for k, v in r0.items() if k.startswith(("pynccl", "dispatch", "graph"))})


if __name__ == "__main__":
    run_this_file(__file__)
