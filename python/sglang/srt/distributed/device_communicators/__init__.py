"""Communicators beside torch's c10d: the ctypes NCCL binding and its communicator. The NCCL
symmetric-memory pool is in :mod:`sglang.srt.distributed.symm_mem`."""
