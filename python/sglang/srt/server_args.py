"""Launch options: one frozen :class:`ServerArgs`, its command line, and its validation.

The flags keep SGLang's names (``--model-path``, ``--tp-size`` ...), so launch commands written for
SGLang work here for the options this engine has. ``ServerArgs(**kwargs)`` takes the same names
(underscored) for the offline :class:`sglang.Engine`.

Two steps turn user input into the options the engine runs with:
- :meth:`ServerArgs.resolved` fills every "auto" value (device, dtype, seed, budgets) from the
  machine, so the rest of the engine never sees ``None`` for them;
- :meth:`ServerArgs.validate` rejects impossible combinations with a message that says what to
  change (raised as :class:`ServerArgsError`).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sglang.srt.mem_cache.kv_cache_dtype import KV_CACHE_DTYPES, kv_cache_dtype_error
from sglang.srt.utils.log import get_logger

logger = get_logger(__name__)

DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32")
DEVICE_CHOICES = ("cuda", "cpu")
LOG_LEVEL_CHOICES = ("debug", "info", "warning", "error", "critical")
SCHEDULE_POLICY_CHOICES = ("fcfs", "lpm")
GRAMMAR_BACKEND_CHOICES = ("xgrammar", "none")


class ServerArgsError(ValueError):
    """The options cannot work together (or on this machine); the message says what to change."""


# The least default --max-logit-rows-per-step: with every running request decoding, a prompt
# log-prob (echo) request still gets this many rows minus the decodes per step.
DEFAULT_MIN_LOGIT_ROWS = 512


def default_max_logit_rows(max_running_requests: int) -> int:
    """The default ``--max-logit-rows-per-step``: room for one row per running request and, at
    the least, ``DEFAULT_MIN_LOGIT_ROWS`` in all."""
    return max(max_running_requests, DEFAULT_MIN_LOGIT_ROWS)


def moe_a2a_choices() -> tuple[str, ...]:
    from sglang.srt.layers.moe.a2a import MOE_A2A_BACKENDS

    return MOE_A2A_BACKENDS.names()


def moe_runner_choices() -> tuple[str, ...]:
    from sglang.srt.layers.moe.moe_runner import MOE_RUNNERS

    return ("auto", *MOE_RUNNERS.names())


@dataclass(frozen=True)
class ServerArgs:
    # --- model and tokenizer
    model_path: str | None = None
    tokenizer_path: str | None = None
    served_model_name: str | None = None
    skip_tokenizer_init: bool = False
    context_length: int | None = None
    # --- runtime
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    device: str | None = None
    tp_size: int = 1
    dp_size: int = 1
    enable_dp_attention: bool = False
    random_seed: int | None = None
    # --- multi-node (one launch per node; node 0 serves HTTP)
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None  # host:port of node 0's rendezvous
    dist_timeout: float | None = None  # seconds a collective waits for a peer; None: 2 hours
    # --- MoE and communication
    moe_runner_backend: str = "auto"
    moe_a2a_backend: str = "none"
    ep_size: int = 1
    enable_symm_mem: bool = False
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int | None = None
    # --- scheduling and memory
    max_running_requests: int | None = None
    max_total_tokens: int | None = None
    chunked_prefill_size: int | None = None
    max_logit_rows_per_step: int | None = None
    mem_fraction_static: float = 0.85
    page_size: int | None = None
    # --- prefix cache
    disable_radix_cache: bool = False
    schedule_policy: str = "fcfs"
    max_state_snapshots: int | None = None
    # --- HTTP server
    host: str = "127.0.0.1"
    port: int = 30000
    enable_metrics: bool = False
    log_level: str = "info"
    log_stats_interval: float = 10.0
    api_key: str | None = None
    max_request_bytes: int = 16 * 1024 * 1024
    max_json_depth: int = 64
    shutdown_timeout: float = 30.0
    # --- chat and structured output
    chat_template: str | None = None  # a built-in encoding name or a Jinja file
    reasoning_parser: str | None = None  # default: the chat encoding's
    tool_call_parser: str | None = None  # default: the chat encoding's
    grammar_backend: str = "xgrammar"

    # --- derived ------------------------------------------------------------------------------

    @property
    def ranks_per_node(self) -> int:
        return self.tp_size // max(1, self.nnodes)

    @property
    def local_ranks(self) -> range:
        """The TP ranks this node's launcher starts (all of them on one node)."""
        n = self.ranks_per_node
        return range(self.node_rank * n, (self.node_rank + 1) * n)

    @property
    def attn_tp_size(self) -> int:
        """Ranks that split one DP group's attention (the whole TP group without DP)."""
        return self.tp_size // max(1, self.dp_size)

    def dist_init_host_port(self) -> tuple[str, int]:
        """``--dist-init-addr`` split into host and port (validated by :meth:`validate`)."""
        assert self.dist_init_addr is not None
        host, port = parse_dist_init_addr(self.dist_init_addr)
        return host, port

    @property
    def chunked_prefill_enabled(self) -> bool:
        return self.chunked_prefill_size is not None and self.chunked_prefill_size > 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> ServerArgs:
        return dataclasses.replace(self, **changes)

    # --- resolution ---------------------------------------------------------------------------

    def resolved(self) -> ServerArgs:
        """Every "auto" filled in from this machine. Idempotent. Budgets that depend on the model
        (``max_total_tokens`` on a GPU, ``context_length``) stay ``None`` here and are settled by
        the scheduler once the model is loaded."""
        import torch

        device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        on_gpu = device == "cuda"
        dtype = self.dtype
        if dtype == "auto":
            # bf16 is what the checkpoints ship; CPU matmuls are faster and exact enough in fp32.
            dtype = "bfloat16" if on_gpu else "float32"
        seed = self.random_seed if self.random_seed is not None else random.randint(0, 2**31 - 1)
        chunk = self.chunked_prefill_size
        if chunk is None:
            chunk = 8192 if on_gpu else 512
        max_running = self.max_running_requests
        if max_running is None:
            max_running = 256 if on_gpu else 32
        max_logit_rows = self.max_logit_rows_per_step
        if max_logit_rows is None:
            max_logit_rows = default_max_logit_rows(max_running)
        cuda_graph_max_bs = self.cuda_graph_max_bs
        if cuda_graph_max_bs is None:
            cuda_graph_max_bs = min(max_running, 160)
        snapshots = self.max_state_snapshots
        if snapshots is None:
            snapshots = 2 * max_running
        a2a, ep_size = resolve_expert_parallel(self.moe_a2a_backend, self.ep_size, self.tp_size)
        return dataclasses.replace(
            self,
            moe_a2a_backend=a2a,
            ep_size=ep_size,
            device=device,
            dtype=dtype,
            random_seed=seed,
            chunked_prefill_size=chunk,
            max_running_requests=max_running,
            max_logit_rows_per_step=max_logit_rows,
            cuda_graph_max_bs=cuda_graph_max_bs,
            max_state_snapshots=snapshots,
        )

    # --- validation ---------------------------------------------------------------------------

    def validate(self) -> None:
        """Raise :class:`ServerArgsError` for options that cannot work, or for SGLANG_* knobs
        with bad values (all of them named at once). Call on a resolved copy."""
        import torch

        from sglang.srt.utils.env_check import env_errors, unknown_env_vars

        bad_env = env_errors()
        if bad_env:
            raise ServerArgsError(
                "; ".join(bad_env) + " (python -m sglang.check_env lists every knob)"
            )
        for message in unknown_env_vars():
            logger.warning(message)

        _check(self.tp_size >= 1, f"--tp-size must be >= 1, got {self.tp_size}")
        _check(1 <= self.port <= 65535, f"--port must be in 1..65535, got {self.port}")
        for choice_flag, choice, choices in (
            ("--dtype", self.dtype, DTYPE_CHOICES),
            ("--device", self.device, DEVICE_CHOICES),
            ("--log-level", self.log_level, LOG_LEVEL_CHOICES),
            ("--schedule-policy", self.schedule_policy, SCHEDULE_POLICY_CHOICES),
            ("--moe-a2a-backend", self.moe_a2a_backend, moe_a2a_choices()),
            ("--moe-runner-backend", self.moe_runner_backend, moe_runner_choices()),
        ):
            _check(choice in choices, f"{choice_flag} must be one of {choices}, got {choice!r}")
        why_kv = kv_cache_dtype_error(self.kv_cache_dtype, self.dtype)
        _check(why_kv is None, str(why_kv))
        for flag, value in (
            ("--max-running-requests", self.max_running_requests),
            ("--max-total-tokens", self.max_total_tokens),
            ("--cuda-graph-max-bs", self.cuda_graph_max_bs),
            ("--context-length", self.context_length),
            ("--max-state-snapshots", self.max_state_snapshots),
            ("--page-size", self.page_size),
        ):
            _check(value is None or value >= 1, f"{flag} must be >= 1, got {value}")
        _check(
            self.chunked_prefill_size is None
            or self.chunked_prefill_size == -1
            or self.chunked_prefill_size >= 1,
            f"--chunked-prefill-size must be >= 1, or -1 to turn chunking off; "
            f"got {self.chunked_prefill_size}",
        )
        _check(
            self.max_logit_rows_per_step is None or self.max_logit_rows_per_step >= 1,
            f"--max-logit-rows-per-step must be >= 1, got {self.max_logit_rows_per_step}",
        )
        _check(
            self.max_logit_rows_per_step is None
            or self.max_running_requests is None
            or self.max_logit_rows_per_step >= self.max_running_requests,
            f"--max-logit-rows-per-step {self.max_logit_rows_per_step} is below "
            f"--max-running-requests {self.max_running_requests}: a decode step samples one row "
            "per running request; raise it, or lower --max-running-requests",
        )
        _check(
            math.isfinite(self.log_stats_interval) and self.log_stats_interval >= 0,
            f"--log-stats-interval must be >= 0 seconds (0: off), got {self.log_stats_interval}",
        )
        _check(
            self.max_request_bytes >= 1024,
            f"--max-request-bytes must be >= 1024, got {self.max_request_bytes}",
        )
        _check(
            1 <= self.max_json_depth <= 512,
            f"--max-json-depth must be in [1, 512], got {self.max_json_depth}",
        )
        _check(
            math.isfinite(self.shutdown_timeout) and self.shutdown_timeout >= 0,
            f"--shutdown-timeout must be >= 0 seconds, got {self.shutdown_timeout}",
        )
        _check(
            self.api_key is None or (self.api_key.strip() != "" and self.api_key.isprintable()),
            "--api-key must be a non-empty printable string",
        )
        _check(
            0.0 < self.mem_fraction_static <= 1.0,
            f"--mem-fraction-static must be in (0, 1], got {self.mem_fraction_static}",
        )
        if self.model_path is not None:
            _check(
                os.path.isfile(os.path.join(self.model_path, "config.json")),
                f"--model-path {self.model_path!r} is not a directory with a config.json "
                "(this engine loads local checkpoints only; download the model first, or omit "
                "--model-path to serve the built-in default model)",
            )
        if self.tokenizer_path is not None:
            _check(
                os.path.isdir(self.tokenizer_path),
                f"--tokenizer-path {self.tokenizer_path!r} is not a directory",
            )
        self._validate_chat()
        self._validate_parallel()
        self._validate_device(torch)
        self._validate_moe()
        why_not_ep = expert_parallel_error(self)
        _check(why_not_ep is None, str(why_not_ep))

    def _validate_chat(self) -> None:
        from sglang.srt.chat.registry import chat_template_error
        from sglang.srt.parsers.registry import reasoning_parser_names, tool_call_parser_names

        if self.chat_template is not None:
            why = chat_template_error(self.chat_template)
            _check(why is None, str(why))
        for flag, value, names in (
            ("--reasoning-parser", self.reasoning_parser, reasoning_parser_names()),
            ("--tool-call-parser", self.tool_call_parser, tool_call_parser_names()),
            ("--grammar-backend", self.grammar_backend, GRAMMAR_BACKEND_CHOICES),
        ):
            _check(
                value is None or value in names,
                f"{flag} must be one of {tuple(names)}, got {value!r}",
            )

    def _validate_parallel(self) -> None:
        _check(self.dp_size >= 1, f"--dp-size must be >= 1, got {self.dp_size}")
        _check(
            self.dp_size == 1 or self.enable_dp_attention,
            f"--dp-size {self.dp_size} needs --enable-dp-attention: data parallelism here is DP "
            "attention (each DP group attends over its own requests, the MoE spans all ranks); "
            "for independent replicas start one server per replica",
        )
        _check(
            not self.enable_dp_attention or self.dp_size > 1,
            "--enable-dp-attention needs --dp-size > 1 (the number of DP attention groups); "
            f"got --dp-size {self.dp_size}",
        )
        _check(
            self.tp_size % self.dp_size == 0,
            f"--dp-size {self.dp_size} must divide --tp-size {self.tp_size} (each DP group "
            "attends with tp/dp ranks)",
        )
        _check(self.nnodes >= 1, f"--nnodes must be >= 1, got {self.nnodes}")
        _check(
            0 <= self.node_rank < self.nnodes,
            f"--node-rank must be in [0, --nnodes {self.nnodes}), got {self.node_rank}",
        )
        _check(
            self.tp_size % self.nnodes == 0,
            f"--tp-size {self.tp_size} must be divisible by --nnodes {self.nnodes} (every node "
            "runs the same number of ranks)",
        )
        _check(
            self.nnodes == 1 or self.dist_init_addr is not None,
            f"--nnodes {self.nnodes} needs --dist-init-addr HOST:PORT (node 0's address, the "
            "same on every node)",
        )
        if self.dist_init_addr is not None:
            try:
                parse_dist_init_addr(self.dist_init_addr)
            except ValueError as exc:
                raise ServerArgsError(f"--dist-init-addr {self.dist_init_addr!r}: {exc}") from None
        _check(
            self.dist_timeout is None
            or (math.isfinite(self.dist_timeout) and self.dist_timeout > 0),
            f"--dist-timeout must be > 0 seconds, got {self.dist_timeout}",
        )

    def _validate_device(self, torch: Any) -> None:
        if self.device == "cpu":
            _check(
                not self.enable_symm_mem,
                "--enable-symm-mem needs CUDA GPUs (NCCL symmetric memory); drop the flag to run "
                "on CPU, or run with --device cuda on a GPU machine",
            )
            return
        _check(
            torch.cuda.is_available(),
            "--device cuda but no CUDA device is visible; use --device cpu (or leave --device "
            "out to pick the CPU automatically)",
        )
        gpus = torch.cuda.device_count()
        need = self.ranks_per_node
        where = "" if self.nnodes == 1 else f" on each of the {self.nnodes} nodes"
        _check(
            need <= gpus,
            f"--tp-size {self.tp_size} needs {need} GPUs{where} but {gpus} are visible; lower "
            "--tp-size or make more GPUs visible (CUDA_VISIBLE_DEVICES)",
        )

    def _validate_moe(self) -> None:
        """The flag-level rows of the MoE expert table (``layers/moe/expert_plan.py``); the rows
        that need the checkpoint's expert format are asked by the loader before it reads."""
        import torch

        from sglang.srt.layers.moe.expert_plan import flags_refusal, live_flag_facts

        device = torch.device(self.device or "cpu")
        dtype = {"float32": torch.float32, "float16": torch.float16}.get(self.dtype, torch.bfloat16)
        facts = live_flag_facts(device, self.moe_runner_backend)
        why = flags_refusal(self.moe_runner_backend, self.moe_a2a_backend, dtype, facts)
        _check(why is None, str(why))


def resolve_expert_parallel(a2a: str, ep_size: int, tp_size: int) -> tuple[str, int]:
    """``(--moe-a2a-backend, --ep-size)`` as the engine runs them. ``--ep-size E > 1`` with the
    default ``none`` selects the ``ep`` backend; a named ``ep`` (or ``megamoe``, which places
    whole experts too) spans the TP group, so its ep size is the TP size; on one rank ``ep`` is
    the plain layer, so it becomes ``none`` (no new collectives, today's path)."""
    if a2a == "none" and ep_size > 1:
        a2a = "ep"
    if a2a in ("ep", "megamoe") and ep_size == 1:
        ep_size = tp_size
    if a2a == "ep" and tp_size == 1 and ep_size == 1:
        a2a = "none"
    return a2a, ep_size


def expert_parallel_error(args: ServerArgs) -> str | None:
    """Why ``--ep-size`` cannot work with the other flags (None: it can). Call on resolved args.
    ``E`` divides ``T``: each rank holds ``num_experts / E`` experts, each TP-sliced over the
    ``T / E`` ranks that share them (whole when ``E == T``). Only the ``ep`` backend splits the
    experts over part of the group (``E < T``); MegaMoE's fused kernel needs ``E == T``."""
    e, t = args.ep_size, args.tp_size
    if e < 1:
        return f"--ep-size must be >= 1, got {e}"
    if e > 1 and args.moe_a2a_backend not in ("ep", "megamoe"):
        return (
            f"--ep-size {e} needs an expert-parallel --moe-a2a-backend (ep or megamoe), "
            f"got {args.moe_a2a_backend!r}"
        )
    if t % e:
        return (
            f"--ep-size {e} must divide --tp-size {t}: each rank holds num_experts / ep_size "
            "experts, each sliced over the tp_size / ep_size ranks that share them"
        )
    if e < t and args.moe_a2a_backend == "megamoe":
        return (
            f"--moe-a2a-backend megamoe needs --ep-size equal to --tp-size {t}, got {e}: the "
            "MegaMoE kernel dispatches, computes and combines whole experts over the whole TP "
            "group in one fused call and cannot reduce TP-sliced experts over part of it; use "
            "--moe-a2a-backend ep (the default with --ep-size) for --ep-size < --tp-size"
        )
    return None


def parse_dist_init_addr(addr: str) -> tuple[str, int]:
    """``host:port`` (``[v6addr]:port`` for IPv6) -> ``(host, port)``; ValueError says why not."""
    host, sep, port_text = addr.rpartition(":")
    if not sep or not host:
        raise ValueError("expected HOST:PORT, e.g. 10.0.0.1:5000")
    host = host.removeprefix("[").removesuffix("]")
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise ValueError(f"the port must be a number in 1..65535, got {port_text!r}")
    return host, int(port_text)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ServerArgsError(message)


# --- command line ----------------------------------------------------------------------------


_ArgGroup = argparse._ActionsContainer  # a parser or one of its argument groups

# A help text that states its own default (one that depends on the machine or on other flags).
_STATED_DEFAULT = re.compile(r"\bDefault:")


def _show_default(value: object) -> str:
    if value is False:
        return "off"
    if value is True:
        return "on"
    return str(value).replace("%", "%%")  # argparse %-formats the help text


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """``--help`` names every option's default: the help's own "Default: ..." where the default
    depends on the machine, the model or other flags, else "(default: VALUE)" from the parser."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (
            not action.option_strings
            or action.default is argparse.SUPPRESS
            or _STATED_DEFAULT.search(text)
        ):
            return text
        return f"{text} (default: {_show_default(action.default)})"


def _add_bool(parser: _ArgGroup, flag: str, help_text: str) -> None:
    parser.add_argument(flag, action="store_true", help=help_text)


def _add_option(
    parser: _ArgGroup,
    flag: str,
    value_type: type,
    help_text: str,
    choices: Sequence[str] | None = None,
) -> None:
    """``--some-flag`` with the type given, defaulting to ServerArgs' ``some_flag`` field."""
    default = getattr(ServerArgs(), flag.removeprefix("--").replace("-", "_"))
    parser.add_argument(flag, type=value_type, default=default, choices=choices, help=help_text)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model")
    _add_option(
        g,
        "--model-path",
        str,
        "Local directory with config.json and *.safetensors: a DeepSeek V4 "
        "(DeepseekV4ForCausalLM) or Kimi K3 (KimiK3ForCausalLM) checkpoint. Default: the "
        "built-in default model, a tiny random-weight DeepSeek V4 that produces gibberish and "
        "exists to exercise the engine (generated in seconds, no download, cached under "
        "SGLANG_CACHE_DIR, else $XDG_CACHE_HOME/sglang or ~/.cache/sglang).",
    )
    _add_option(
        g,
        "--tokenizer-path",
        str,
        "Directory with tokenizer.json (and tokenizer_config.json). Default: --model-path.",
    )
    _add_option(
        g,
        "--served-model-name",
        str,
        "Model name reported by /v1/models and in responses. Default: the model path.",
    )
    _add_bool(
        g,
        "--skip-tokenizer-init",
        "Load no tokenizer: requests must send token ids (input_ids) and responses carry ids only.",
    )
    _add_option(
        g,
        "--context-length",
        int,
        "Longest prompt plus output in tokens. Default: the model's max_position_embeddings.",
    )
    g = parser.add_argument_group("runtime")
    _add_option(
        g,
        "--dtype",
        str,
        "Weight and activation dtype. auto: bfloat16 on CUDA, float32 on CPU.",
        DTYPE_CHOICES,
    )
    _add_option(
        g,
        "--kv-cache-dtype",
        str,
        "How the caches that grow with every token store their rows: bf16 (the model dtype), "
        "fp8_e4m3 (FP8 rows with UE8M0 group scales, positional dims bf16: DeepSeek V4's "
        "compressed entries and indexer keys, Kimi K3's MLA latents; about 1.75x the tokens "
        "in the same memory), or auto (DeepSeek V4 in bf16: fp8_e4m3, as DeepSeek's inference "
        "recipe; otherwise the model dtype). docs/kv_cache.md.",
        KV_CACHE_DTYPES,
    )
    _add_option(
        g,
        "--device",
        str,
        "Where the model runs. Default: cuda when a GPU is visible, else cpu.",
        DEVICE_CHOICES,
    )
    g.add_argument(
        "--tp-size",
        "--tp",
        dest="tp_size",
        type=int,
        default=ServerArgs().tp_size,
        help="Tensor-parallel ranks: one scheduler/model worker process each (NCCL on GPU, gloo "
        "on CPU); rank 0 schedules and broadcasts every batch.",
    )
    g.add_argument(
        "--dp-size",
        "--dp",
        dest="dp_size",
        type=int,
        default=ServerArgs().dp_size,
        help="DP attention groups (needs --enable-dp-attention; must divide --tp-size): each group "
        "attends over its own requests with tp/dp ranks, the MoE still spans every rank.",
    )
    _add_bool(
        g,
        "--enable-dp-attention",
        "Data-parallel attention over --dp-size groups (tokens are gathered across groups "
        "before the MoE and scattered back after it).",
    )
    _add_option(
        g,
        "--random-seed",
        int,
        "Seed of the sampler for requests that give no seed. Default: random.",
    )
    g = parser.add_argument_group("multi-node")
    _add_option(
        g,
        "--nnodes",
        int,
        "Nodes the TP ranks span (--tp-size / --nnodes ranks each). Run one launch_server per "
        "node with the same flags and its own --node-rank; node 0 serves HTTP.",
    )
    _add_option(
        g,
        "--node-rank",
        int,
        "This node's index in [0, --nnodes). Nodes > 0 run only their scheduler ranks and wait "
        "for node 0 to shut them down.",
    )
    _add_option(
        g,
        "--dist-init-addr",
        str,
        "HOST:PORT of node 0 where the ranks rendezvous (torch.distributed's TCP store; the "
        "same value on every node). Nodes that do not all join within "
        "SGLANG_DIST_JOIN_TIMEOUT_S fail with an error. Default: none (needed when "
        "--nnodes > 1; one node rendezvouses through a local file).",
    )
    _add_option(
        g,
        "--dist-timeout",
        float,
        "Seconds a collective waits for a peer before it fails. Also bounds how long an idle "
        "follower waits for node 0. Default: 7200 (long enough for first-use kernel "
        "compilation on one rank).",
    )
    g = parser.add_argument_group("MoE and communication")
    _add_option(
        g,
        "--moe-runner-backend",
        str,
        "Routed-expert kernels. auto: triton on CUDA, torch on CPU.",
        moe_runner_choices(),
    )
    _add_option(
        g,
        "--moe-a2a-backend",
        str,
        "none: experts tensor-parallel with one all-reduce. ep: experts expert-parallel, rows "
        "dispatched to their experts' ranks and combined back with all-to-all (chosen by "
        "--ep-size > 1). megamoe: whole experts a rank through one fused MegaMoE kernel on a "
        "reserved-SM budget: DeepGEMM's (Blackwell, and Hopper for FP8 SwiGLU experts) or, "
        "where DeepGEMM's cannot run on one GPU (no DeepGEMM, bf16 or SiTU experts such as "
        "Kimi K3's, a shape it does not take), our Triton persistent MegaMoE kernel; a batch "
        "neither takes, or where ours measured slower, runs the runner plus all-reduce, with one "
        "log line saying why. docs/moe.md.",
        moe_a2a_choices(),
    )
    _add_option(
        g,
        "--ep-size",
        int,
        "Expert-parallel ranks E, dividing --tp-size T: 1 (experts tensor-parallel), T (each "
        "rank holds num_experts / E whole experts) or between (num_experts / E experts a rank, "
        "each TP-sliced over the T / E ranks that share them). Each rank loads only its part. "
        "Selects --moe-a2a-backend ep unless megamoe (E = T only) is named. "
        "docs/expert_parallelism.md.",
    )
    _add_bool(
        g,
        "--enable-symm-mem",
        "Allocate MoE outputs in NCCL symmetric memory so the TP all-reduce takes NCCL's "
        "symmetric kernels (CUDA and NCCL >= 2.27.3 only).",
    )
    _add_bool(
        g,
        "--disable-cuda-graph",
        "Run decode eagerly. Otherwise, on CUDA, DeepSeek V4 and Kimi K3 decode steps (and the "
        "decode rows of steps that also prefill) replay CUDA graphs over a preallocated cache "
        "slot pool. Graphs need a capture-safe MoE path (the triton runner; a2a none or "
        "megamoe, not ep) and no DP attention; otherwise decode runs eagerly. The startup log "
        "says which and why. docs/cuda_graphs.md.",
    )
    _add_option(
        g,
        "--cuda-graph-max-bs",
        int,
        "Largest decode batch size to capture in CUDA graphs (sizes 1, 2, 4, 8, then every 8); "
        "larger decode batches run the same static decode eagerly. Default: "
        "min(--max-running-requests, 160).",
    )
    g = parser.add_argument_group("scheduling and memory")
    _add_option(
        g,
        "--max-running-requests",
        int,
        "Requests decoded together at most; more wait in the queue. Default: 256 on CUDA, "
        "32 on CPU.",
    )
    _add_option(
        g,
        "--max-total-tokens",
        int,
        "Token budget of all running requests together (prompt + max new tokens each, "
        "reserved on admission). A request that would exceed it waits; one that can never fit "
        "is rejected. Default: from free GPU memory on CUDA, context length x "
        "max running requests on CPU.",
    )
    _add_option(
        g,
        "--chunked-prefill-size",
        int,
        "Prompt tokens prefilled per step at most; longer prompts are split across steps, "
        "mixed with running decodes. -1 turns chunking off. Default: 8192 on CUDA, 512 on CPU.",
    )
    _add_option(
        g,
        "--max-logit-rows-per-step",
        int,
        "Rows whose fp32 logits one step computes at most: one per sampling request plus the "
        "prompt rows of requests that ask for prompt log-probs (echo, logprob_start_len); such a "
        "request's prefill chunk is shortened to fit and continues next step. The GPU memory "
        "budget reserves logits for this many rows. Must be >= --max-running-requests. "
        f"Default: max(--max-running-requests, {DEFAULT_MIN_LOGIT_ROWS}).",
    )
    _add_option(
        g,
        "--page-size",
        int,
        "Tokens a cache block holds: the unit of admission, of the paged caches and of the "
        "prefix cache (a cached prefix is whole blocks). DeepSeek V4 needs a multiple of its "
        "compress ratios. Default: 256 (DeepSeek V4: the least multiple of its ratios >= 256).",
    )
    _add_option(
        g,
        "--mem-fraction-static",
        float,
        "Fraction of GPU memory the weights and request caches may use together (sizes the "
        "default --max-total-tokens on CUDA).",
    )
    g = parser.add_argument_group("prefix cache")
    _add_bool(
        g,
        "--disable-radix-cache",
        "Turn the prefix cache off: every request prefills its whole prompt. Otherwise a request "
        "resumes from the longest cached prefix of whole cache blocks (a radix tree over token "
        "ids; needs the paged slot pool, see the startup line). docs/prefix_caching.md.",
    )
    _add_option(
        g,
        "--schedule-policy",
        str,
        "Order of the waiting queue: fcfs (first come, first served) or lpm (longest cached "
        "prefix first; a request waiting SGLANG_LPM_MAX_WAIT_S seconds goes first, fcfs beyond "
        "128 waiting requests or without the prefix cache).",
        SCHEDULE_POLICY_CHOICES,
    )
    _add_option(
        g,
        "--max-state-snapshots",
        int,
        "Copies of a request's fixed-size state at a block edge the prefix cache keeps (DeepSeek "
        "V4: window rings and overlap rows; Kimi K3: KDA conv and recurrent states): a cached "
        "prefix resumes only where one is kept. Their memory comes out of the token budget "
        "(the startup line gives one's size). Default: 2 x --max-running-requests.",
    )
    g = parser.add_argument_group("HTTP server")
    _add_option(g, "--host", str, "Address to listen on.")
    _add_option(g, "--port", int, "Port to listen on.")
    _add_bool(
        g,
        "--enable-metrics",
        "Serve Prometheus metrics at /metrics (requests, tokens, queue, latencies, prefix-cache "
        "hit rate); without this flag /metrics answers 404.",
    )
    _add_option(
        g,
        "--log-level",
        str,
        "Logging level of the server and the scheduler processes.",
        LOG_LEVEL_CHOICES,
    )
    _add_option(
        g,
        "--log-stats-interval",
        float,
        "Seconds between the scheduler's activity lines (info level: steps by kind with their "
        "mean time, generation throughput, running and queued requests, token usage), written "
        "only while steps run. 0: off.",
    )
    _add_option(
        g,
        "--api-key",
        str,
        "Require 'Authorization: Bearer <key>' on every endpoint except /health (401 without). "
        "Default: none (no key needed).",
    )
    _add_option(
        g,
        "--max-request-bytes",
        int,
        "Largest request body in bytes; a larger one gets 413 before it is read or parsed. "
        "Default: 16777216 (16 MiB).",
    )
    _add_option(
        g,
        "--max-json-depth",
        int,
        "Deepest nesting of arrays and objects a JSON body may have (400 beyond).",
    )
    _add_option(
        g,
        "--shutdown-timeout",
        float,
        "Seconds SIGTERM/SIGINT lets requests in flight finish (new ones get 503) before the "
        "rest are ended with an error and the server exits 0. A second signal ends them at once.",
    )
    _add_chat_args(parser)


def _add_chat_args(parser: argparse.ArgumentParser) -> None:
    from sglang.srt.chat.registry import CHAT_ENCODINGS
    from sglang.srt.parsers.registry import reasoning_parser_names, tool_call_parser_names

    g = parser.add_argument_group("chat and structured output")
    _add_option(
        g,
        "--chat-template",
        str,
        "The chat encoding: a built-in one "
        f"({', '.join(CHAT_ENCODINGS.names())}) or a Jinja template file. Default: the "
        "built-in encoding of the checkpoint's model type, else the tokenizer's own template. "
        "docs/chat_api.md.",
    )
    _add_option(
        g,
        "--reasoning-parser",
        str,
        "How reasoning is separated from the answer (reasoning_content). Default: the chat "
        "encoding's (deepseek-v4 or kimi-k3 for those models).",
        reasoning_parser_names(),
    )
    _add_option(
        g,
        "--tool-call-parser",
        str,
        "How tool calls are read from the output (tool_calls). Default: the chat encoding's.",
        tool_call_parser_names(),
    )
    _add_option(
        g,
        "--grammar-backend",
        str,
        "Structured output (response_format, json_schema / regex / ebnf, required tool "
        "calls): xgrammar, or none to refuse such requests.",
        GRAMMAR_BACKEND_CHOICES,
    )


def build_parser(prog: str = "python -m sglang.launch_server") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Serve a DeepSeek V4 or Kimi K3 model over an OpenAI-compatible and "
        "SGLang-native HTTP API. Without --model-path it serves the built-in tiny random-weight "
        "model (DeepSeek V4 architecture).",
        formatter_class=DefaultsHelpFormatter,
    )
    add_cli_args(parser)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> ServerArgs:
    ns = build_parser().parse_args(argv)
    fields = {f.name for f in dataclasses.fields(ServerArgs)}
    return ServerArgs(**{k: v for k, v in vars(ns).items() if k in fields})
