"""Messages between the tokenizer manager (main process) and scheduler rank 0.

They travel pickled over two one-way pipes: requests down, outputs up. Keep them plain dataclasses
of builtins so pickling stays cheap.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sglang.srt.constrained.grammar_spec import GrammarSpec
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.sampling.thinking_budget import ReasoningControl

# --- down: tokenizer manager -> scheduler -----------------------------------------------------


@dataclass
class TokenizedGenerateReq:
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    return_logprob: bool = False
    top_logprobs_num: int = 0
    # First prompt position whose input log-prob is wanted; -1: none.
    logprob_start_len: int = -1
    # What the output must match (compiled by rank 0 before the request is admitted).
    grammar: GrammarSpec | None = None
    # Set when the output starts inside the reasoning: where it ends, and the thinking budget.
    reasoning: ReasoningControl | None = None


@dataclass
class AbortReq:
    rid: str


@dataclass
class StatsReq:
    req_id: int


@dataclass
class FlushCacheReq:
    """Drop every cached prefix (refused while requests run or wait)."""

    req_id: int


@dataclass
class ShutdownReq:
    pass


# --- up: scheduler -> tokenizer manager --------------------------------------------------------


@dataclass
class FinishReason:
    """Why a request stopped: ``stop`` (EOS, a stop token or a stop string: ``matched``),
    ``length`` (max_new_tokens or the context length), ``abort`` (client gone, or an error)."""

    kind: str
    matched: int | str | None = None
    message: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.kind}
        if self.kind == "stop" and self.matched is not None:
            out["matched"] = self.matched
        if self.message is not None:
            out["message"] = self.message
        return out


@dataclass
class ReqOutput:
    """New tokens of one request since its previous output."""

    rid: str
    new_token_ids: list[int]
    new_logprobs: list[float | None] = field(default_factory=list)
    new_top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    # Sent once, with the request's first output: log-probs of prompt tokens from
    # logprob_start_len on (None for position 0, which has no context).
    input_logprobs: list[float | None] | None = None
    input_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    finish: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens it resumed from the prefix cache


@dataclass
class BatchOutput:
    outputs: list[ReqOutput]


@dataclass
class ReqError:
    """The scheduler refused a request (it checks again what the tokenizer manager checked)."""

    rid: str
    message: str
    status_code: int = 400


@dataclass
class SchedulerFailed:
    """Rank 0 lost another rank (a collective failed: a rank or a whole node died, or the network
    went away) and is exiting; the front end fails every request with this message."""

    message: str


@dataclass
class SchedulerStats:
    req_id: int
    num_running_reqs: int
    num_waiting_reqs: int
    num_active_caches: int
    reserved_tokens: int
    max_total_tokens: int
    num_steps: int
    num_generated_tokens: int
    last_step_time_s: float
    # Prefix cache, since start (zeros without one): admitted prompt tokens and the cached ones
    # among them, the tokens the cached blocks hold, the blocks and snapshots evicted, and rank
    # 0's pool as it is (free blocks of how many; -1: caches not pooled).
    prompt_tokens: int = 0
    cached_tokens: int = 0
    cache_tokens: int = 0
    evicted_blocks: int = 0
    evicted_snapshots: int = 0
    state_snapshots: int = 0
    free_blocks: int = -1
    total_blocks: int = -1


@dataclass
class FlushCacheResult:
    req_id: int
    ok: bool
    message: str


@dataclass
class ModelInfo:
    """What rank 0 reports once every rank has loaded the model."""

    model_path: str
    architecture: str
    vocab_size: int
    context_length: int
    eos_token_ids: list[int]
    max_total_tokens: int
    max_running_requests: int
    chunked_prefill_size: int
    dtype: str
    device: str
    moe_runner: str
    moe_a2a_backend: str
    symm_mem: str
    mega_moe_sm_budget: int | None
    cuda_graph: str
    prefix_cache: str = "off"
    extra: dict[str, Any] = field(default_factory=dict)
    kv_cache_dtype: str = "bf16"  # what --kv-cache-dtype resolved to (bf16: the model dtype)
