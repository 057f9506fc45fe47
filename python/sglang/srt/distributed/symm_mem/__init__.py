"""NCCL symmetric memory behind ``--enable-symm-mem`` (see docs/symmetric_memory.md).

``allocator``: enabling, the per-device pool, window registration and ``use_symmetric_memory``;
``nccl_pool``: the real pool over ``ncclMemAlloc``; ``alloc_shim``: the C allocator shim;
``windows``: the registered address ranges of one communicator; ``output_scope``: the rule of when
an allocation may go to the pool, ``symmetric_output_scope()``, which layers and models call
instead of entering ``use_symmetric_memory`` themselves.
"""
