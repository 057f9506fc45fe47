"""Start the server in every configuration and check that it serves or is refused by name.

The matrix: model (DeepSeek V4, Kimi K3) x checkpoint format x ``--dtype`` (bfloat16, float16,
float32) x ``--moe-runner-backend`` x ``--moe-a2a-backend`` x CUDA graphs on / off. Formats:

- ``tiny``: small random models made on the spot: DeepSeek V4 is the built-in model (no
  ``--model-path``), Kimi K3 a bf16 checkpoint written into a temporary directory;
- ``release``: the releases' layouts at tiny widths (FP8 dense layers, MXFP4 experts), written by
  the test kit's ``sglang.test.release_checkpoint``; left out, with the reason, where the test
  kit has no writers.

For each combination ``python -m sglang.launch_server`` starts (small context, 16 running
requests, 256-token prefill chunks, graphs up to batch 16: each start takes seconds), then either

- it serves: 16 concurrent greedy requests (token ids) all complete with their 16 tokens, then
  one request alone, whose tokens are compared with the same request served with graphs off by
  the same static decode run eagerly at the graph sizes (``SGLANG_STATIC_DECODE_WITHOUT_GRAPHS``):
  the same kernels on the same shapes, so equal by construction; compared only where both
  servers say so (graphs ``on`` in one, the eager static decode in the other: "same maths");
  then it shuts down cleanly (SIGINT, exit status 0);
- or it is refused at startup, and the refusal must name one of the combination's flags.

``--part i/n`` runs every n-th combination from the i-th (about 20 of the 216 a part of 10), so
each part fits a 10-minute call; ``--list`` prints the combinations. The result is a markdown
table (docs/testing.md takes it). Exit status 0 when every combination served or was refused by
name.

Usage: python scripts/start_matrix.py [--part 1/10] [--list] [--formats tiny,release]
  [--models dsv4,k3] [--dtypes bfloat16,float16,float32] [--runners triton,torch,deep_gemm]
  [--a2a none,ep,megamoe] [--graphs on,off]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("dsv4", "k3")
FORMATS = ("tiny", "release")
DTYPES = ("bfloat16", "float16", "float32")
RUNNERS = ("triton", "torch", "deep_gemm")
A2A = ("none", "ep", "megamoe")
GRAPHS = ("on", "off")
CONCURRENT = 16
NEW_TOKENS = 16
# Hang guards, >= 5x what an unloaded H200 takes (a start ~20-40 s with compiled kernels cached,
# the 16 requests ~2 s, a shutdown ~3 s).
STARTUP_GUARD_S = 300.0
REQUEST_GUARD_S = 120.0
SHUTDOWN_GUARD_S = 60.0
# Flags every server of the matrix gets: small and fast to start.
COMMON_FLAGS = (
    "--skip-tokenizer-init",
    "--context-length", "512",
    "--max-running-requests", "16",
    "--max-total-tokens", "8192",
    "--chunked-prefill-size", "256",
    "--cuda-graph-max-bs", "16",
    "--random-seed", "0",
    "--log-level", "warning",
)  # fmt: skip


@dataclass(frozen=True)
class Combo:
    model: str
    fmt: str
    dtype: str
    runner: str
    a2a: str
    graphs: str

    def flags(self) -> list[str]:
        out = ["--dtype", self.dtype, "--moe-runner-backend", self.runner]
        out += ["--moe-a2a-backend", self.a2a]
        if self.graphs == "off":
            out.append("--disable-cuda-graph")
        return out

    @property
    def twin(self) -> Combo:
        """The same combination with graphs the other way."""
        return Combo(self.model, self.fmt, self.dtype, self.runner, self.a2a,
                     "off" if self.graphs == "on" else "on")  # fmt: skip


@dataclass
class Outcome:
    combo: Combo
    result: str = "not run"  # "served", "refused", "FAIL"
    detail: str = ""
    startup_s: float = 0.0
    cuda_graph: str = ""
    alone: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.result in ("served", "refused")


def combos(
    models: list[str], formats: list[str], dtypes: list[str], runners: list[str],
    a2a: list[str], graphs: list[str],
) -> list[Combo]:  # fmt: skip
    """Every combination, twins (graphs on / off) next to each other so a part holds both."""
    out = []
    for m, f, d, r, a in itertools.product(models, formats, dtypes, runners, a2a):
        out += [Combo(m, f, d, r, a, g) for g in graphs]
    return out


def part_of(items: list[Combo], i: int, n: int) -> list[Combo]:
    """Part ``i`` of ``n`` (1-based): consecutive pairs of twins dealt round robin, so parts are
    within one pair of each other and each pair stays together."""
    pairs = [items[k : k + 2] for k in range(0, len(items), 2)]
    return [c for j, pair in enumerate(pairs) if j % n == i - 1 for c in pair]


def names_a_flag(message: str, combo: Combo) -> bool:
    """Whether a startup refusal names one of the flags this combination's server was given."""
    given = [*combo.flags(), *COMMON_FLAGS, "--model-path"]
    flags = {f for f in given if f.startswith("--")}
    return any(re.search(re.escape(f) + r"\b", message) for f in flags)


def refusal_line(log: str) -> str:
    """The line of a failed start that says why (the last naming a flag, else the last one)."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    flagged = [ln for ln in lines if re.search(r"--[a-z][a-z0-9-]+", ln)]
    return (flagged or lines or ["(no output)"])[-1][:300]


# --- checkpoints ---------------------------------------------------------------------------------


def make_checkpoint(model: str, fmt: str, root: Path) -> str | None:
    """The ``--model-path`` of a model and format (None: the built-in DeepSeek V4 model)."""
    if model == "dsv4" and fmt == "tiny":
        return None
    path = root / f"{model}-{fmt}"
    if (path / "config.json").is_file():
        return str(path)
    from sglang.test.release_checkpoint import deepseek_v4, kimi_k3

    if model == "dsv4":
        deepseek_v4.write_random(path, deepseek_v4.tiny_config(), dense="fp8", experts="mxfp4")
    else:
        experts = "bf16" if fmt == "tiny" else "mxfp4"
        kimi_k3.write_random(path, kimi_k3.tiny_config(), experts=experts)
    return str(path)


# --- one server ----------------------------------------------------------------------------------


def _http(url: str, body: dict[str, Any] | None = None, timeout: float = REQUEST_GUARD_S) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def _prompts(vocab: int) -> list[list[int]]:
    """16 prompts of 3 to 48 token ids (fixed, so every server sees the same)."""
    return [[(7 * i + 13 * j) % (vocab - 2) + 2 for j in range(3 + 3 * i)] for i in range(16)]


def run_combo(combo: Combo, model_path: str | None, log_dir: Path) -> Outcome:
    from sglang.srt.distributed.parallel_state import find_free_port

    out = Outcome(combo)
    port = find_free_port()
    cmd = [sys.executable, "-m", "sglang.launch_server", "--host", "127.0.0.1", "--port", str(port)]
    cmd += [*COMMON_FLAGS, *combo.flags()]
    if model_path is not None:
        cmd += ["--model-path", model_path]
    env = dict(os.environ)
    if combo.graphs == "off":  # the eager twin runs the static decode at the graph sizes
        env["SGLANG_STATIC_DECODE_WITHOUT_GRAPHS"] = "1"
    log_path = log_dir / (
        f"{combo.model}-{combo.fmt}-{combo.dtype}-{combo.runner}-{combo.a2a}-{combo.graphs}.log"
    )
    base = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        try:
            return _serve(proc, combo, base, started, log_path, out)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _serve(
    proc: subprocess.Popen[bytes], combo: Combo, base: str, started: float, log_path: Path,
    out: Outcome,
) -> Outcome:  # fmt: skip
    while True:  # startup
        if proc.poll() is not None:
            line = refusal_line(log_path.read_text(errors="replace"))
            out.startup_s = time.monotonic() - started
            named = names_a_flag(line, combo)
            out.result = "refused" if named and proc.returncode != 0 else "FAIL"
            out.detail = line if named else f"exited {proc.returncode} naming no flag: {line}"
            return out
        try:
            _http(base + "/health", timeout=2.0)
            break
        except (urllib.error.URLError, OSError, ValueError):
            pass
        if time.monotonic() - started > STARTUP_GUARD_S:
            out.result, out.detail = "FAIL", f"not healthy after {STARTUP_GUARD_S:.0f} s"
            return out
        time.sleep(0.25)
    out.startup_s = time.monotonic() - started
    info = _http(base + "/get_server_info")["model_info"]
    out.cuda_graph = str(info.get("cuda_graph", ""))
    params = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    prompts = _prompts(int(info.get("vocab_size") or 64))
    try:
        with concurrent.futures.ThreadPoolExecutor(CONCURRENT) as pool:
            results = list(
                pool.map(
                    lambda ids: _http(
                        base + "/generate", {"input_ids": ids, "sampling_params": params}
                    ),
                    prompts,
                )
            )
        lengths = [len(r["output_ids"]) for r in results]
        alone = _http(base + "/generate", {"input_ids": prompts[5], "sampling_params": params})
        out.alone = list(alone["output_ids"])
    except (urllib.error.URLError, OSError, KeyError, ValueError) as exc:
        out.result, out.detail = "FAIL", f"requests failed: {type(exc).__name__}: {exc}"
        return out
    if lengths != [NEW_TOKENS] * CONCURRENT or len(out.alone) != NEW_TOKENS:
        out.result, out.detail = "FAIL", f"output lengths {lengths}, alone {len(out.alone)}"
        return out
    proc.send_signal(signal.SIGINT)
    try:
        code = proc.wait(timeout=SHUTDOWN_GUARD_S)
    except subprocess.TimeoutExpired:
        out.result, out.detail = "FAIL", f"did not exit within {SHUTDOWN_GUARD_S:.0f} s of SIGINT"
        return out
    if code != 0:
        out.result, out.detail = "FAIL", f"exited {code} after SIGINT"
        return out
    out.result, out.detail = "served", f"{CONCURRENT}/{CONCURRENT} requests"
    return out


def same_maths(a: Outcome, b: Outcome) -> bool:
    """Graph replay in one, the same static decode run eagerly at the graph sizes in the other."""
    on, off = (a, b) if a.combo.graphs == "on" else (b, a)
    return on.cuda_graph.startswith("on") and "static decode eager at the" in off.cuda_graph


def compare_twins(outcomes: list[Outcome]) -> None:
    """Add the graph == eager verdict to each served pair with the same maths."""
    by = {o.combo: o for o in outcomes}
    for o in outcomes:
        twin = by.get(o.combo.twin)
        if o.combo.graphs != "on" or twin is None or "served" not in (o.result, twin.result):
            continue
        if o.result != "served" or twin.result != "served":
            continue
        if not same_maths(o, twin):
            verdict = "graph == eager: n/a (not the same maths: " + (o.cuda_graph or "?")[:60] + ")"
        elif o.alone == twin.alone:
            verdict = "graph == eager: yes"
        else:
            first = next(i for i, (x, y) in enumerate(zip(o.alone, twin.alone)) if x != y)
            verdict = f"graph == eager: NO (part at token {first})"
            o.result = twin.result = "FAIL"
        for x in (o, twin):
            x.detail = f"{x.detail}; {verdict}"


def table(outcomes: list[Outcome]) -> str:
    lines = [
        "| model | format | dtype | runner | a2a | graphs | result | start s | detail |",
        "|---|---|---|---|---|---|---|---:|---|",
    ]
    for o in outcomes:
        c = o.combo
        detail = o.detail.replace("|", "/")
        lines.append(
            f"| {c.model} | {c.fmt} | {c.dtype} | {c.runner} | {c.a2a} | {c.graphs} | "
            f"{o.result} | {o.startup_s:.1f} | {detail} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", default="1/1")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--formats", default="tiny,release")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--runners", default=",".join(RUNNERS))
    parser.add_argument("--a2a", default=",".join(A2A))
    parser.add_argument("--graphs", default=",".join(GRAPHS))
    parser.add_argument("--log-dir", type=Path, default=None)
    args = parser.parse_args()
    i, n = (int(x) for x in args.part.split("/"))
    if not 1 <= i <= n:
        parser.error(f"--part {args.part}: need 1 <= i <= n")
    formats = args.formats.split(",")
    allc = combos(
        args.models.split(","), formats, args.dtypes.split(","), args.runners.split(","),
        args.a2a.split(","), args.graphs.split(","),
    )  # fmt: skip
    mine = part_of(allc, i, n)
    if args.list:
        print(f"{len(allc)} combinations; part {i}/{n}: {len(mine)}")
        for c in mine:
            print(" ".join([c.model, c.fmt, *c.flags()]))
        return 0
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="start-matrix-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    ckpt_root = Path(tempfile.mkdtemp(prefix="start-matrix-models-"))
    outcomes = []
    for c in mine:
        try:
            path = make_checkpoint(c.model, c.fmt, ckpt_root)
        except Exception as exc:  # noqa: BLE001 - reported as this combination's failure
            outcomes.append(Outcome(c, "FAIL", f"no checkpoint: {type(exc).__name__}: {exc}"))
            continue
        o = run_combo(c, path, log_dir)
        print(f"{o.result:8s} {c.model} {c.fmt} {' '.join(c.flags())}: {o.detail}", flush=True)
        outcomes.append(o)
    compare_twins(outcomes)
    print(f"\nstart matrix part {i}/{n} (logs in {log_dir}):\n")
    print(table(outcomes))
    bad = [o for o in outcomes if not o.ok]
    print(f"\n{len(outcomes) - len(bad)}/{len(outcomes)} served or refused by name")
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
