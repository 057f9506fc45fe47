"""Communicators beside torch's c10d: the ctypes NCCL binding, its communicator and the
NCCL symmetric-memory pool."""
