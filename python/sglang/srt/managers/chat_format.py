"""The server's chat format: the chat encoding (by ``--chat-template``, else the checkpoint's
model type, else the tokenizer's own Jinja template) and the parsers that read its output
(``--reasoning-parser``, ``--tool-call-parser``, else the encoding's own)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sglang.srt.chat.encoding import ChatEncoding, ToolChoice
from sglang.srt.chat.registry import resolve_chat_encoding
from sglang.srt.managers.tokenizer import TextTokenizer
from sglang.srt.parsers.chat_output import ChatOutputParser
from sglang.srt.parsers.reasoning import ReasoningFormat, ReasoningParser
from sglang.srt.parsers.registry import REASONING_FORMATS, TOOL_CALL_FORMATS, ToolCallFormat
from sglang.srt.server_args import ServerArgs
from sglang.srt.utils.log import get_logger

logger = get_logger(__name__)


def model_type(model_path: str | None) -> str | None:
    if not model_path:
        return None
    path = os.path.join(model_path, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        value = json.load(f).get("model_type")
    return value if isinstance(value, str) else None


@dataclass(frozen=True)
class ChatFormat:
    encoding: ChatEncoding
    reasoning: ReasoningFormat | None
    tool_calls: ToolCallFormat | None

    @classmethod
    def resolve(cls, args: ServerArgs, tokenizer: TextTokenizer) -> ChatFormat:
        kind = model_type(args.model_path)
        own = tokenizer.chat_template if tokenizer.has_own_chat_template else None
        encoding = resolve_chat_encoding(
            args.chat_template, kind, own, tokenizer.bos_token or "", tokenizer.eos_token or ""
        )
        reasoning_name = args.reasoning_parser or encoding.reasoning_parser
        tool_name = args.tool_call_parser or encoding.tool_call_parser
        fmt = cls(
            encoding,
            None if reasoning_name is None else REASONING_FORMATS[reasoning_name],
            None if tool_name is None else TOOL_CALL_FORMATS.create(tool_name),
        )
        missing = [t for t in encoding.marker_tokens if tokenizer.token_id(t) is None]
        if missing:
            logger.warning(
                f"the tokenizer has no single token for {missing}: the {encoding.name} prompts "
                "will not tokenize as the model was trained"
            )
        logger.info(
            f"chat encoding: {encoding.name} (model type {kind}); reasoning parser: "
            f"{reasoning_name}; tool-call parser: {tool_name}"
        )
        return fmt

    def output_parser(
        self,
        *,
        thinking: bool,
        tools: Sequence[Mapping[str, Any]] = (),
        choice: ToolChoice | None = None,
        parallel: bool = True,
        id_offset: int = 0,
    ) -> ChatOutputParser:
        """A parser for one choice's output. The reasoning parser runs when thinking is on; the
        tool-call parser always runs when the format has one (it keeps tool markup out of the
        content even when the request has no tools, and Kimi K3 wraps every answer in it)."""
        reasoning = None
        if self.reasoning is not None and thinking:
            reasoning = ReasoningParser(self.reasoning, in_reasoning=True)
        tool_parser = None
        if self.tool_calls is not None:
            tool_parser = self.tool_calls.parser(tools, choice, parallel, id_offset)
        return ChatOutputParser(reasoning, tool_parser)
