"""Run a function on N ranks, each in its own spawned process, for distributed tests.

``run_distributed(fn, world_size, *args)`` starts ``world_size`` processes, initialises
torch.distributed in each (gloo on CPU by default, over a free local TCP port), calls
``fn(rank, world_size, *args)``, tears the distributed state down, and returns the per-rank
results in rank order. A rank that raises makes the call raise :class:`DistributedTestError`
carrying that rank's traceback; the other ranks are stopped.

``fn`` must be a module-level function. It is found again in the child by module name, or, when
that name does not lead to the same file (pytest's importlib mode, ``python test_x.py``), by
loading its file. Return plain picklable values; tensors are moved to the CPU.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


class DistributedTestError(RuntimeError):
    """A rank failed, died, or the ranks did not finish in time."""


@dataclass(frozen=True)
class _FnRef:
    module: str
    file: str
    qualname: str


def _ref(fn: Callable[..., Any]) -> _FnRef:
    if "<locals>" in fn.__qualname__ or fn.__name__ == "<lambda>":
        raise ValueError(f"run_distributed needs a module-level function, got {fn.__qualname__}")
    return _FnRef(fn.__module__, os.path.abspath(inspect.getfile(fn)), fn.__qualname__)


def _same_file(module: Any, file: str) -> bool:
    path = getattr(module, "__file__", None)
    return path is not None and os.path.abspath(path) == file


def _resolve(ref: _FnRef) -> Callable[..., Any]:
    module: Any = sys.modules.get(ref.module)
    if module is None or not _same_file(module, ref.file):
        module = None
        if ref.module not in ("__main__", "__mp_main__"):
            try:
                candidate = importlib.import_module(ref.module)
                if _same_file(candidate, ref.file):
                    module = candidate
            except Exception:  # noqa: BLE001 - any import failure: load the file by path below
                module = None
    if module is None:
        name = "_sglang_rank_" + hashlib.sha1(ref.file.encode()).hexdigest()[:12]
        module = sys.modules.get(name)
        if module is None:
            spec = importlib.util.spec_from_file_location(name, ref.file)
            if spec is None or spec.loader is None:
                raise ImportError(f"cannot load {ref.file}")
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
    target: Any = module
    for part in ref.qualname.split("."):
        target = getattr(target, part)
    return target


def _to_cpu(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, list):
        return [_to_cpu(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_to_cpu(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    return value


def _worker(
    ref: _FnRef,
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    args: tuple[Any, ...],
    env: dict[str, str],
    enable_symm_mem: bool,
    init: bool,
    results: Any,
) -> None:
    os.environ.update(env)
    code = 0
    try:
        from sglang.srt.distributed import parallel_state as ps
        from sglang.srt.distributed.symm_mem.allocator import (
            set_symmetric_memory_enabled,
        )

        if enable_symm_mem:  # before any NCCL init: it sets NCCL_CUMEM_ENABLE
            set_symmetric_memory_enabled(True)
        fn = _resolve(ref)
        if init:
            ps.init_distributed_environment(
                world_size,
                rank,
                backend=backend,
                init_method=f"tcp://127.0.0.1:{port}",
                local_rank=rank,
            )
        value = fn(rank, world_size, *args)
        ps.destroy_distributed_environment()
        # Plain pickle copies tensor data; the queue's own pickler would share it through file
        # descriptors that die with this process.
        results.put((rank, True, pickle.dumps(_to_cpu(value))))
    except BaseException as exc:  # noqa: BLE001 - report everything, SystemExit included
        code = 1
        results.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        results.close()
        results.join_thread()
        # Skip interpreter teardown: a half-torn process group must not hang the exit.
        os._exit(code)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout_s: float = 120.0,
    env: Mapping[str, str] | None = None,
    enable_symm_mem: bool = False,
    init: bool = True,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks; return results by
    rank. ``env`` is applied in each child first; ``enable_symm_mem`` calls
    ``set_symmetric_memory_enabled(True)`` before torch.distributed starts; ``init=False``
    leaves initialisation to ``fn`` (the rendezvous port is then in ``MASTER_PORT``)."""
    from sglang.srt.distributed.parallel_state import find_free_port

    ref = _ref(fn)
    port = find_free_port()
    child_env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), **(env or {})}
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_worker,
            args=(
                ref,
                rank,
                world_size,
                port,
                backend,
                args,
                child_env,
                enable_symm_mem,
                init,
                results,
            ),
            name=f"sglang-rank-{rank}",
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    outcomes: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout_s
    failure: str | None = None
    try:
        while len(outcomes) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(outcomes))
                failure = f"ranks {missing} did not finish within {timeout_s:.0f}s"
                break
            try:
                rank, ok, payload = results.get(timeout=min(0.5, remaining))
            except queue_mod.Empty:
                dead = [
                    r for r, p in enumerate(procs) if r not in outcomes and p.exitcode is not None
                ]
                if dead:
                    try:  # its report may still be in flight
                        rank, ok, payload = results.get(timeout=2.0)
                    except queue_mod.Empty:
                        codes = {r: procs[r].exitcode for r in dead}
                        failure = f"ranks died without reporting (exit codes {codes})"
                        break
                else:
                    continue
            outcomes[rank] = (ok, pickle.loads(payload) if ok else payload)
            if not ok:
                failure = f"rank {rank} failed:\n{payload}"
                break
    finally:
        for p in procs:
            if failure is not None and p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=10.0)
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        results.close()
    if failure is not None:
        raise DistributedTestError(failure)
    return [outcomes[r][1] for r in range(world_size)]
