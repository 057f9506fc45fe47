"""Write a DeepSeek V4 or Kimi K3 checkpoint in the layout its release publishes, every tensor
drawn at random (``sglang.test.release_checkpoint``), and print what it wrote: the file bytes per
tensor group, whole and for one rank of ``--tp-size`` / ``--ep-size``.

Presets: ``tiny`` (the CPU tests' configs) and ``wide`` (real widths: DeepSeek V4-Flash's hidden
4096, 256 experts top-6 of 2048, 64 heads of 512; Kimi K3's hidden 7168, latent 3584, 896 experts
top-16 of 3072, KDA 96 x 128, MLA 96 heads), ``--layers`` layers and ``--experts`` routed experts.
On a GPU machine draw and quantise there (``--device cuda``): a 4-layer V4-Flash-width checkpoint
(20 GB with its MTP layer, 16.4 GB without) takes about a minute, mostly writing.

Usage: python scripts/write_release_checkpoint.py --model deepseek_v4 --preset wide --layers 4
       --out /tmp/dsv4-flash-4l --device cuda [--experts 256] [--no-mtp] [--tp-size 8]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from sglang.test.release_checkpoint import deepseek_v4, kimi_k3

GB = 1000**3


def preset_config(model: str, preset: str, layers: int | None, experts: int | None) -> dict:
    """The text config of ``preset`` for ``model`` with ``layers`` / ``experts`` overridden."""
    if model == "deepseek_v4":
        if preset == "tiny":
            return deepseek_v4.tiny_config(layers, experts)
        n = layers or 4
        return deepseek_v4.flash_config(
            deepseek_v4.flash_ratios(n), n_routed_experts=experts or 256
        )
    if preset == "tiny":
        return kimi_k3.tiny_config(layers, experts)
    return kimi_k3.k3_config(layers or 4, num_experts=experts or 896)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("deepseek_v4", "kimi_k3"), required=True)
    parser.add_argument("--preset", choices=("tiny", "wide"), required=True)
    parser.add_argument("--layers", type=int, help="decoder layers (default: the preset's)")
    parser.add_argument("--experts", type=int, help="routed experts (default: the preset's)")
    parser.add_argument("--out", type=Path, required=True, help="directory to write (created)")
    parser.add_argument("--device", default="cpu", help="where tensors are drawn and quantised")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-mtp", action="store_true", help="DeepSeek V4: no mtp.0.* layer")
    parser.add_argument("--max-shard-gb", type=float, default=5.0)
    parser.add_argument("--tp-size", type=int, default=1, help="print this TP rank's share")
    parser.add_argument("--ep-size", type=int, default=1, help="print this EP rank's share")
    args = parser.parse_args()
    if args.layers is not None and args.layers < 1:
        parser.error(f"--layers must be >= 1, got {args.layers}")
    if args.experts is not None and args.experts < 1:
        parser.error(f"--experts must be >= 1, got {args.experts}")
    if args.max_shard_gb <= 0:
        parser.error(f"--max-shard-gb must be positive, got {args.max_shard_gb}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: no CUDA device here")
    if args.out.exists() and any(args.out.iterdir()):
        parser.error(f"--out {args.out} is not empty")
    config = preset_config(args.model, args.preset, args.layers, args.experts)
    common: dict[str, Any] = {
        "seed": args.seed,
        "device": args.device,
        "keep_values": False,
        "max_shard_bytes": int(args.max_shard_gb * GB),
    }
    started = time.perf_counter()
    if args.model == "deepseek_v4":
        result = deepseek_v4.write_random(args.out, config, mtp=not args.no_mtp, **common)
    else:
        result = kimi_k3.write_random(args.out, config, **common)
    elapsed = time.perf_counter() - started
    layout = result.layout
    shards = len(list(args.out.glob("model-*.safetensors")))
    total = layout.total_bytes()
    print(
        f"{args.model} {args.preset}: {config['num_hidden_layers']} layers, "
        f"{layout.num_experts} routed experts -> {args.out} ({shards} shards, "
        f"{total / GB:.2f} GB in {elapsed:.1f}s, {total / GB / max(elapsed, 1e-9):.2f} GB/s)"
    )
    print(layout.format_table(args.tp_size, args.ep_size))


if __name__ == "__main__":
    main()
