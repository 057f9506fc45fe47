"""Per-architecture memory models: what one cached token, one running request and one step's
workspace cost a rank, which ``model_executor/memory_budget.py`` turns into the default
``--max-total-tokens``. A model offers its own through ``memory_model()``
(``model_abilities.SupportsMemoryModel``): DeepSeek V4's :class:`~.deepseek_v4.CacheShape`,
Kimi K3's :class:`~.kimi_k3.KimiK3MemoryModel`; the protocol is :class:`~.memory_model.MemoryModel`.
"""
