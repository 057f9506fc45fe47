"""What every model's config parser shares: its error, required keys, reading config.json."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self needs Python 3.11


class ConfigError(ValueError):
    """config.json describes something this implementation does not support, or is inconsistent."""


def required(d: Mapping[str, Any], key: str) -> Any:
    if key not in d or d[key] is None:
        raise ConfigError(f"config.json lacks the required key {key!r}")
    return d[key]


class JsonModelConfig:
    """Base of a config class parsed from a config.json dict by its ``from_dict``."""

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Self:
        raise NotImplementedError

    @classmethod
    def from_json_file(cls, path: str | os.PathLike[str]) -> Self:
        """From ``path``: the config.json file or the model directory holding it."""
        return cls.from_dict(read_config_json(path))


def read_config_json(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The config.json dict at ``path``: the file or the model directory holding it."""
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    with open(path, encoding="utf-8") as f:
        config: dict[str, Any] = json.load(f)
    return config
