"""Checkpoints in the layouts the DeepSeek V4 and Kimi K3 releases publish, written by the test
kit: tensor names, dtypes, FP8 / MXFP4 formats and their scales, sharded safetensors with the
index, ``config.json`` with its ``quantization_config``. See ``docs/parity.md`` ("release-format
checkpoints in the test kit").

- :mod:`.deepseek_v4` / :mod:`.kimi_k3`: each model's layout, presets (tiny for CPU tests, real
  widths for a few layers), ``write_from_tensors`` (quantise a given state dict),
  ``write_random`` (draw every tensor, on the GPU for real widths) and ``release_tensors`` (the
  same in memory);
- :mod:`.layout`: the tensor specs and the byte accounting (:class:`CheckpointLayout`);
- :mod:`.emit`: the quantise-and-write path both share, and the result objects;
- :mod:`.formats`: FP8 UE8M0 block and MXFP4 quantisation; :mod:`.shards`: the shard writer.
"""

from sglang.test.release_checkpoint.emit import ReleaseCheckpoint, ReleaseTensors
from sglang.test.release_checkpoint.layout import CheckpointLayout, Group, Split

__all__ = ["CheckpointLayout", "Group", "ReleaseCheckpoint", "ReleaseTensors", "Split"]
