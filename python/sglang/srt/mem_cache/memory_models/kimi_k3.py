"""Kimi K3's memory model, from the shape its slot pool allocates (``kimi_k3_slot_pool.py``).

- Per cached token: every MLA layer's latent row, ``kv_lora_rank + qk_rope_head_dim`` wide, as the
  cache stores it (``--kv-cache-dtype``: the model dtype, or a 648-byte FP8 row at 512 + 64;
  the latents are replicated over the attention-TP ranks).
- Fixed, per running request: every KDA layer's conv state ``[W - 1, 3 * H_local * D]`` (model
  dtype) and recurrent state ``[H_local, D, D]`` (the state dtype, fp32 by default), and the slot's
  block-table row (int64, ``ceil(context / B)`` entries). Once per pool: the scratch slot (one
  more request's states and table row) and the null block (``B`` latent rows per MLA layer). The
  eager decode and the static one use the same pool.
- Workspace: DeepSeek V4's per-layer temporaries on a ``hidden``-wide stream, plus the AttnRes
  state: the bank and partial sum held over the whole forward (``num_bank_rows + 1`` rows of
  ``[T, hidden]`` in the model dtype) and a read's stacked ``[T, rows, hidden]`` in fp32, twice
  (the torch read's upcast and normed copies; the Triton read stacks once in the model dtype).
"""

from __future__ import annotations

from dataclasses import dataclass

from sglang.srt.mem_cache.kimi_k3_cache import KimiK3CacheShape
from sglang.srt.mem_cache.memory_models.workspace import StepWorkspace, activation_bytes, mib
from sglang.srt.mem_cache.slot_blocks import DEFAULT_BLOCK_TOKENS

_TABLE_ENTRY_BYTES = 8  # the block tables are int64


@dataclass(frozen=True)
class KimiK3MemoryModel(StepWorkspace):
    pool: KimiK3CacheShape  # this rank's: KDA heads split over the attention-TP ranks
    hidden_size: int
    vocab_size: int
    bank_rows: int  # AttnRes bank snapshots (0: plain residuals)
    dtype_bytes: int
    state_dtype_bytes: int  # the KDA recurrent state's
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    latent_row_bytes: int | None = None  # one stored latent row (None: latent_dim model values)
    kv_cache: str = "bf16"  # the --kv-cache-dtype layout's name, for the startup log

    def __post_init__(self) -> None:
        if min(self.dtype_bytes, self.state_dtype_bytes, self.block_tokens) < 1:
            raise ValueError(
                f"Kimi K3 memory model: dtype bytes {self.dtype_bytes}, state dtype bytes "
                f"{self.state_dtype_bytes} and block tokens {self.block_tokens} must be >= 1"
            )

    @property
    def num_mla(self) -> int:
        return sum(1 for k in self.pool.layer_kinds if k == "mla")

    @property
    def num_kda(self) -> int:
        return sum(1 for k in self.pool.layer_kinds if k == "kda")

    @property
    def latent_bytes(self) -> int:
        """One MLA layer's stored latent row."""
        return self.latent_row_bytes or self.pool.latent_dim * self.dtype_bytes

    def bytes_per_cached_token(self) -> float:
        return max(float(self.num_mla * self.latent_bytes), 1.0)

    def request_state_bytes(self) -> int:
        """Every KDA layer's conv and recurrent state of one request (fixed: any length)."""
        p = self.pool
        conv = (p.conv_size - 1) * 3 * p.kda_heads * p.kda_head_dim * self.dtype_bytes
        recurrent = p.kda_heads * p.kda_head_dim * p.kda_head_dim * self.state_dtype_bytes
        return self.num_kda * (conv + recurrent)

    def snapshot_bytes(self) -> int:
        """A request's KDA states (the latents are shared by block)."""
        return self.request_state_bytes()

    def table_row_bytes(self, context_length: int) -> int:
        """One request's block-table row: a block id per ``block_tokens`` of the context."""
        return -(-context_length // self.block_tokens) * _TABLE_ENTRY_BYTES

    def null_block_bytes(self) -> int:
        """The block every latent store allocates once more (unused table entries point there)."""
        return self.num_mla * self.block_tokens * self.latent_bytes

    def fixed_bytes(self, running_requests: int, context_length: int) -> int:
        slots = running_requests + 1  # and the scratch slot
        per_slot = self.request_state_bytes() + self.table_row_bytes(context_length)
        return slots * per_slot + self.null_block_bytes()

    def attn_res_bytes(self, tokens_in_flight: int) -> int:
        if self.bank_rows == 0:
            return 0
        rows = self.bank_rows + 1  # the bank and the partial sum
        return tokens_in_flight * self.hidden_size * rows * (self.dtype_bytes + 2 * 4)

    def activation_bytes(self, tokens_in_flight: int) -> int:
        return activation_bytes(tokens_in_flight, self.hidden_size) + self.attn_res_bytes(
            tokens_in_flight
        )

    def describe(self) -> str:
        return (
            f"Kimi K3: {self.bytes_per_cached_token():.0f} B per cached token ({self.num_mla} "
            f"MLA layers' {self.pool.latent_dim}-wide latents, {self.latent_bytes} B a row in "
            f"the {self.kv_cache} KV cache), {mib(self.request_state_bytes())} "
            f"per running request ({self.num_kda} KDA layers' conv and recurrent states, "
            f"{self.pool.kda_heads} heads on this rank) plus its block-table row"
        )
