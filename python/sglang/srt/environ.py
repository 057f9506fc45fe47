"""Every environment knob the engine reads, declared once, typed and validated.

Modules never read ``os.environ`` for a project knob; they ask ``envs.NAME.get()``. A bad value
raises :class:`EnvValueError`, which names the variable, the value and what is accepted, so a
typo in a launch script fails at the first read instead of silently using a default.

Tests override a knob temporarily with ``with envs.NAME.override(value): ...``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Generic, TypeVar

T = TypeVar("T")

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})


class EnvValueError(ValueError):
    """An environment variable holds a value its knob does not accept."""

    def __init__(self, name: str, raw: object, accepted: str) -> None:
        super().__init__(f"{name}={raw!r} is invalid: expected {accepted}")
        self.name = name
        self.raw = raw
        self.accepted = accepted


class EnvField(Generic[T]):
    """One knob: its variable name, default and parser. Reads the environment on every ``get``
    so that a value set after import (by a launcher or a test) takes effect."""

    accepted: str = "a value"

    def __init__(self, default: T, doc: str = "") -> None:
        self.default = default
        self.doc = doc
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: object, owner: type | None = None) -> EnvField[T]:
        return self

    def parse(self, raw: str) -> T:
        raise NotImplementedError

    def get(self) -> T:
        raw = os.environ.get(self.name)
        if raw is None:
            return self.default
        return self.parse(raw)

    def is_set(self) -> bool:
        return self.name in os.environ

    def set(self, value: T) -> None:
        text = self.format(value)
        self.parse(text)  # validate before writing, so a bad set leaves the old value in place
        os.environ[self.name] = text

    def clear(self) -> None:
        os.environ.pop(self.name, None)

    def format(self, value: T) -> str:
        return str(value)

    @contextmanager
    def override(self, value: T | None) -> Iterator[None]:
        """Set (or, with ``None``, unset) the variable for the body; restore it on exit."""
        previous = os.environ.get(self.name)
        try:
            if value is None:
                self.clear()
            else:
                self.set(value)
            yield
        finally:
            if previous is None:
                os.environ.pop(self.name, None)
            else:
                os.environ[self.name] = previous

    def _fail(self, raw: str) -> EnvValueError:
        return EnvValueError(self.name, raw, self.accepted)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name}, default={self.default!r})"


class EnvInt(EnvField[int]):
    def __init__(
        self,
        default: int,
        doc: str = "",
        *,
        min_value: int | None = None,
        max_value: int | None = None,
    ) -> None:
        super().__init__(default, doc)
        self.min_value = min_value
        self.max_value = max_value
        if min_value is not None and max_value is not None:
            self.accepted = f"an integer in [{min_value}, {max_value}]"
        elif min_value is not None:
            self.accepted = f"an integer >= {min_value}"
        elif max_value is not None:
            self.accepted = f"an integer <= {max_value}"
        else:
            self.accepted = "an integer"

    def parse(self, raw: str) -> int:
        try:
            value = int(raw.strip(), 10)
        except ValueError:
            raise self._fail(raw) from None
        if self.min_value is not None and value < self.min_value:
            raise self._fail(raw)
        if self.max_value is not None and value > self.max_value:
            raise self._fail(raw)
        return value


class EnvFloat(EnvField[float]):
    def __init__(self, default: float, doc: str = "", *, min_value: float | None = None) -> None:
        super().__init__(default, doc)
        self.min_value = min_value
        self.accepted = "a number" if min_value is None else f"a number >= {min_value}"

    def parse(self, raw: str) -> float:
        try:
            value = float(raw.strip())
        except ValueError:
            raise self._fail(raw) from None
        if math.isnan(value) or (self.min_value is not None and value < self.min_value):
            raise self._fail(raw)
        return value


class EnvBool(EnvField[bool]):
    accepted = "one of 1/0, true/false, yes/no, on/off"

    def parse(self, raw: str) -> bool:
        text = raw.strip().lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
        raise self._fail(raw)

    def format(self, value: bool) -> str:
        if not isinstance(value, bool):
            raise self._fail(str(value))
        return "1" if value else "0"


class EnvStr(EnvField[str]):
    def __init__(
        self, default: str, doc: str = "", *, choices: tuple[str, ...] | None = None
    ) -> None:
        super().__init__(default, doc)
        self.choices = choices
        self.accepted = "a string" if choices is None else f"one of {', '.join(choices)}"

    def parse(self, raw: str) -> str:
        if self.choices is not None and raw not in self.choices:
            raise self._fail(raw)
        return raw


class Envs:
    """The registry. Attribute names are the variable names."""

    # --- MegaMoE (DeepGEMM fused MoE) -------------------------------------------------------
    SGLANG_OPT_DEEPGEMM_MEGA_MOE_RESERVED_SMS = EnvInt(
        2,
        "SMs left free while the whole-grid MegaMoE kernel runs, so a kernel on another stream "
        "cannot stop the grid barrier from completing. 0 turns the reservation off.",
        min_value=0,
    )
    SGLANG_MEGA_MOE_WAIT_TIMEOUT_MS = EnvFloat(
        1000.0,
        "Milliseconds a wait inside our Triton MegaMoE kernel may last before it gives up and "
        "reports (instead of hanging the GPU). Its tile queue never waits on a CTA that is not "
        "running, so only a badly stalled GPU reaches this.",
        min_value=0.001,
    )
    SGLANG_MEGA_MOE_STATUS_CHECK_INTERVAL = EnvInt(
        64,
        "Read the Triton MegaMoE kernel's status word (a host sync) every N launches outside "
        "CUDA-graph capture, raising if a wait gave up. 1: every launch; 0: never.",
        min_value=0,
    )
    SGLANG_OPT_DEEPGEMM_MEGA_MOE_NUM_MAX_TOKENS_PER_RANK = EnvInt(
        8192,
        "Tokens per rank the MegaMoE symmetric buffer is sized for; larger batches take the "
        "normal MoE path.",
        min_value=1,
    )

    # --- NCCL and symmetric memory (--enable-symm-mem) ---------------------------------------
    SGLANG_NCCL_SO_PATH = EnvStr(
        "",
        "Path of libnccl.so.2 for the ctypes NCCL binding. Empty: the library this process already "
        "loaded, else the nvidia-nccl wheel's copy, else the system loader.",
    )
    SGLANG_SYMM_MEM_PREALLOC_GB_SIZE = EnvFloat(
        4.0,
        "GiB allocated once (and released back into the pool) in the NCCL symmetric pool after "
        "warm-up, so later eager allocations reuse one registered segment. 0 turns it off.",
        min_value=0.0,
    )
    SGLANG_DEBUG_SYMM_MEM = EnvBool(
        False,
        "Log (once per call site) any all-reduce that would take the symmetric path but whose "
        "input is not in the symmetric pool, and check that pool segments match across ranks.",
    )
    SGLANG_SYMM_MEM_ALL_REDUCE_POLICY = EnvStr(
        "table",
        "Which pool-resident all-reduces take NCCL's symmetric kernels: 'table' (only the sizes "
        "measured to win for the world size), 'always' or 'never' (for measurements).",
        choices=("table", "always", "never"),
    )

    # --- kernels --------------------------------------------------------------------------------
    SGLANG_DEEP_GEMM_MOE_LAYOUT = EnvStr(
        "auto",
        "What the deep_gemm MoE runner runs a batch with: 'auto' (by token count, from the H200 "
        "measurements in docs/performance.md: our Triton kernels up to 1024 tokens, DeepGEMM's "
        "contiguous layout above; never contiguous under CUDA-graph capture), or always "
        "'contiguous', 'masked' or 'triton'.",
        choices=("auto", "contiguous", "masked", "triton"),
    )
    SGLANG_FP8_DENSE_GEMM = EnvStr(
        "auto",
        "Which GEMM runs the block-FP8 dense layers on CUDA: 'auto' (DeepGEMM's fp8_gemm_nt "
        "where it is usable and takes the shape, else our Triton kernel), 'deep_gemm' (the same, "
        "but a shape it cannot take is logged as a warning) or 'triton' (always Triton).",
        choices=("auto", "deep_gemm", "triton"),
    )
    SGLANG_FP8_FUSED_ACT_QUANT = EnvBool(
        False,
        "DeepSeek V4 with FP8 dense layers: quantise activations inside their producers (q_norm "
        "after wq_a, the shared expert's activation, wo_a's epilogue for wo_b) instead of a "
        "separate quantiser launch per GEMM. Same maths; off until measured to pay.",
    )
    SGLANG_MHC_BACKEND = EnvStr(
        "auto",
        "Backend of the mHC pre and fused post+pre kernels (DeepSeek V4) for CUDA tensors: 'auto' "
        "(Triton, else TileLang when it imports, else torch; Triton measured faster up to 512 "
        "tokens), 'tilelang', 'triton' or 'torch'. CPU tensors always take torch.",
        choices=("auto", "tilelang", "triton", "torch"),
    )

    # --- serving --------------------------------------------------------------------------------
    SGLANG_CACHE_DIR = EnvStr(
        "",
        "Where generated files (the built-in default model) are cached. Empty: "
        "$XDG_CACHE_HOME/sglang, else ~/.cache/sglang.",
    )
    SGLANG_STARTUP_TIMEOUT_S = EnvFloat(
        600.0,
        "Seconds the launcher waits for every scheduler rank to load its model and report ready "
        "before it gives up and stops them.",
        min_value=1.0,
    )
    SGLANG_CPU_THREADS = EnvInt(
        0,
        "Torch threads of each scheduler process when serving on CPU. 0: automatic, one core left "
        "for the HTTP process and the rest split over the TP ranks (at most 16 each).",
        min_value=0,
    )
    SGLANG_DSV4_LENGTH_AWARE_DECODE = EnvBool(
        True,
        "DeepSeek V4 static decode through the length-aware Triton kernels (attention over the "
        "live window rows and chosen entries only, indexer scores over the visible keys) for "
        "bf16/fp16 pools on CUDA; 0: the torch path (every ring row and entry, under masks). "
        "The kernels equal the torch path to ~3e-7 per layer on the H200 (docs/performance.md).",
    )
    SGLANG_DSV4_TOPK_KERNEL = EnvBool(
        True,
        "With the length-aware decode kernels on, pick the indexer's top-k with the length-aware "
        "Triton radix select (kernels/ops/attention/indexer_topk.py: the stable sort's set, from "
        "the visible columns only; its GPU test passes on the H200) instead of a stable sort of "
        "every column. 0: the sort.",
    )
    SGLANG_K3_ATTN_RES_KERNEL = EnvBool(
        True,
        "Kimi K3's AttnRes reads as one Triton launch each (kernels/ops/layernorm/"
        "attn_res_read.py; its GPU test passes on the H200) on CUDA instead of ~15 torch ops. "
        "0: the torch ops.",
    )
    SGLANG_K3_KDA_PREFILL = EnvStr(
        "tf32x3",
        "Kimi K3's KDA prefill (multi-token segments) on CUDA: the chunked Triton kernels "
        "(kernels/ops/kda/chunk_prefill.py) with their tensor-core products in 'tf32x3' (three "
        "tf32 products, ~fp32), 'ieee' (fp32 FMA) or 'tf32' (one tf32 product), or 'torch' "
        "(the chunked torch form, the reference).",
        choices=("tf32x3", "ieee", "tf32", "torch"),
    )
    SGLANG_K3_STATIC_DECODE = EnvBool(
        True,
        "Kimi K3 decode through its slot pool's static decode (KDA states and MLA latents by "
        "slot, fixed shapes, no host sync), so CUDA graphs capture it (or, with "
        "SGLANG_STATIC_DECODE_WITHOUT_GRAPHS, it runs eagerly at the graph sizes); its graph "
        "tests pass on the H200. 0: K3 decodes eagerly on per-request caches.",
    )
    SGLANG_MIXED_STEP_GRAPHS = EnvBool(
        True,
        "With the static decode on, a step that mixes decode rows and prefill chunks runs its "
        "decode rows through the static decode (a CUDA-graph replay where one is captured) and "
        "its prefill chunks eagerly, as two forwards. 0: the whole step as one eager forward "
        "(every decode row walks its cache per request).",
    )
    SGLANG_STATIC_DECODE_WITHOUT_GRAPHS = EnvBool(
        False,
        "When CUDA graphs are off (--disable-cuda-graph, or no CUDA), decode through the slot "
        "pool's static decode eagerly, padded to the batch sizes graphs would capture: the exact "
        "A/B of a graph replay (same kernels, same shapes). Off: the per-request eager decode.",
    )
    SGLANG_DIST_JOIN_TIMEOUT_S = EnvFloat(
        300.0,
        "Seconds the ranks of a multi-node launch (--nnodes > 1) wait for every node to join at "
        "--dist-init-addr before each node fails with an error naming who is missing.",
        min_value=1.0,
    )
    SGLANG_DIST_HEARTBEAT_S = EnvFloat(
        30.0,
        "Seconds between the empty plans an idle rank 0 broadcasts: a follower that dies (or a "
        "node that goes away) is noticed within this long even when no request comes, and "
        "followers never reach --dist-timeout while the server sits idle.",
        min_value=0.1,
    )
    SGLANG_SCHEDULER_IDLE_POLL_S = EnvFloat(
        0.5,
        "Seconds an idle scheduler (rank 0) waits for a new request before it checks that its "
        "parent process is still alive.",
        min_value=0.001,
    )
    SGLANG_LPM_MAX_WAIT_S = EnvFloat(
        5.0,
        "--schedule-policy lpm: a request that has waited this many seconds is offered "
        "admission before the longest-prefix order (in arrival order), so none starves.",
        min_value=0.0,
    )

    SGLANG_GRAMMAR_MAX_BYTES = EnvInt(
        64 * 1024,
        "Largest grammar source (JSON schema, regex, EBNF) a request may give, in bytes; larger "
        "ones get a 400.",
        min_value=1,
    )
    SGLANG_GRAMMAR_MAX_DEPTH = EnvInt(
        32,
        "Deepest nesting a request's JSON schema may have; deeper ones get a 400.",
        min_value=1,
    )
    SGLANG_GRAMMAR_COMPILE_TIMEOUT_S = EnvFloat(
        10.0,
        "Seconds a request's grammar may take to compile before the request gets a 400 (the "
        "server keeps serving; the compile finishes in the background).",
        min_value=0.001,
    )
    SGLANG_GRAMMAR_MAX_WHITESPACE = EnvInt(
        16,
        "Whitespace characters JSON output may hold in a row under a JSON grammar (unbounded "
        "whitespace lets a model loop on spaces while the grammar stays satisfied).",
        min_value=0,
    )

    @classmethod
    def fields(cls) -> dict[str, EnvField[Any]]:
        return {k: v for k, v in vars(cls).items() if isinstance(v, EnvField)}

    @classmethod
    def validate_all(cls) -> None:
        """Read every knob once; raises on the first bad value (used at server start)."""
        for field in cls.fields().values():
            field.get()


envs = Envs()
