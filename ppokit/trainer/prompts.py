"""The text the policy sees for each prompt row: its prompt, or its chat messages in the
tokenizer's chat template (``data.chat_template``, ``data.system_prompt``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ppokit.errors import UserError
from ppokit.spec import DataSpec

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["chat_messages", "chat_text", "format_prompts"]


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
    (:func:`chat_messages`) in the tokenizer's chat template when ``data.chat_template``."""
    if not data_spec.chat_template:
        return [str(row["prompt"]) for row in rows]
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(
            "data.chat_template is true but the tokenizer has no chat template; "
            "set data.chat_template: false"
        )
    return [chat_text(tokenizer, chat_messages(row, data_spec.system_prompt), True) for row in rows]


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
