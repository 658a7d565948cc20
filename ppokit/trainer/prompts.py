"""The text the policy sees for each prompt row: its prompt, or its chat messages in the
tokenizer's chat template (``data.chat_template``, ``data.system_prompt``); and the bounds on
text before it is tokenized (:class:`TextBounds`: cut by characters first, so that a
megabyte of tool output is never tokenized whole; what UTF-8 cannot encode replaced)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ppokit.errors import UserError
from ppokit.spec import DataSpec

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "MAX_TOKEN_CHARS",
    "TextBounds",
    "chat_messages",
    "chat_text",
    "encodable",
    "format_prompts",
]

#: The longest a token may count for, in characters, whatever the vocabulary says.
MAX_TOKEN_CHARS = 256
_SURROGATES = re.compile("[\ud800-\udfff]")


def encodable(text: str) -> str:
    """``text`` with what UTF-8 cannot encode (a lone surrogate, from a tool's output or a
    file name) replaced by U+FFFD, the replacement character."""
    return _SURROGATES.sub("\ufffd", text)


class TextBounds:
    """Character bounds that stand for token bounds: no token of ``tokenizer`` covers more
    than :attr:`chars` characters (its longest token's text), so text of ``n`` tokens or
    fewer has at most ``n · chars`` characters, and cutting a text to that many characters
    before it is tokenized keeps its first (or last) ``n`` tokens."""

    def __init__(self, tokenizer: Any) -> None:
        try:
            pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
            longest = max((len(p) for p in pieces if isinstance(p, str)), default=1)
        except Exception:  # a tokenizer that cannot list its vocabulary
            longest = MAX_TOKEN_CHARS
        self.chars = max(1, min(longest, MAX_TOKEN_CHARS))

    def head(self, text: str, tokens: int) -> str:
        """``text`` cut to what its first ``tokens`` tokens (and one more) can hold."""
        return encodable(text[: (tokens + 1) * self.chars])

    def tail(self, text: str, tokens: int) -> str:
        """``text`` cut to what its last ``tokens`` tokens (and one more) can hold."""
        keep = (tokens + 1) * self.chars
        return encodable(text[-keep:] if len(text) > keep else text)


def chat_messages(row: Mapping[str, Any], system_prompt: str | None = None) -> list[dict[str, Any]]:
    """The chat messages of a row: its ``messages`` when they end with its prompt as the user's
    message (the messages layout), else the prompt as one user message; ``system_prompt``
    comes first unless the messages have a system message."""
    prompt = str(row["prompt"])
    messages = row.get("messages")
    if (
        isinstance(messages, list)
        and messages
        and all(isinstance(m, Mapping) for m in messages)
        and messages[-1].get("role") == "user"
        and messages[-1].get("content") == prompt
    ):
        out = [dict(m) for m in messages]
    else:
        out = [{"role": "user", "content": prompt}]
    if system_prompt is not None and not any(m.get("role") == "system" for m in out):
        out.insert(0, {"role": "system", "content": system_prompt})
    return out


def format_prompts(
    rows: list[dict[str, Any]], tokenizer: PreTrainedTokenizerBase, data_spec: DataSpec
) -> list[str]:
    """The text the policy sees for each row: its prompt, or its chat messages
    (:func:`chat_messages`) in the tokenizer's chat template when ``data.chat_template``;
    what UTF-8 cannot encode replaced (:func:`encodable`)."""
    if not data_spec.chat_template:
        return [encodable(str(row["prompt"])) for row in rows]
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(
            "data.chat_template is true but the tokenizer has no chat template; "
            "set data.chat_template: false"
        )
    return [
        encodable(chat_text(tokenizer, chat_messages(row, data_spec.system_prompt), True))
        for row in rows
    ]


def chat_text(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], generation_prompt: bool
) -> str:
    """``messages`` in the tokenizer's chat template, as text (``generation_prompt``: the
    assistant's turn opened after them)."""
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt
    )
    assert isinstance(text, str)  # tokenize=False renders text
    return text
