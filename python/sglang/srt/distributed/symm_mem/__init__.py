"""NCCL symmetric memory behind ``--enable-symm-mem`` (see docs/symmetric_memory.md).

``allocator``: enabling, the per-device pool, window registration and ``use_symmetric_memory``;
``nccl_pool``: the real pool over ``ncclMemAlloc``; ``alloc_shim``: the C allocator shim;
``windows``: the registered address ranges of one communicator. Layers and models do not enter
the scope themselves: they call ``symmetric_output_scope()`` (``layers/dp_attention.py``), which
owns the rule of when an allocation may go to the pool.
"""
