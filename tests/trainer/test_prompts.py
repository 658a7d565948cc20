"""The text the policy sees: a row's prompt, or its chat messages in the chat template."""

from __future__ import annotations

import pytest

from ppokit.errors import UserError
from ppokit.spec import DataSpec
from ppokit.trainer.prompts import format_prompts

# --------------------------------------------------------------- format_prompts
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def chat_tokenizer(template: str | None):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={"[UNK]": 0, "hi": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    tokenizer.chat_template = template
    return tokenizer


ROWS = [{"prompt": "What is 1 + 1?", "answer": "2"}, {"prompt": "hi", "answer": ""}]


def test_format_prompts_plain() -> None:
    assert format_prompts(ROWS, None, DataSpec()) == ["What is 1 + 1?", "hi"]
    assert format_prompts(ROWS, chat_tokenizer(TEMPLATE), DataSpec(system_prompt="x")) == [
        "What is 1 + 1?",
        "hi",
    ]


def test_format_prompts_with_chat_template() -> None:
    tokenizer = chat_tokenizer(TEMPLATE)
    assert format_prompts(ROWS, tokenizer, DataSpec(chat_template=True)) == [
        "<|user|>What is 1 + 1?\n<|assistant|>",
        "<|user|>hi\n<|assistant|>",
    ]
    spec = DataSpec(chat_template=True, system_prompt="Be brief.")
    assert format_prompts(ROWS[:1], tokenizer, spec) == [
        "<|system|>Be brief.\n<|user|>What is 1 + 1?\n<|assistant|>"
    ]


def test_format_prompts_without_a_template_is_a_user_error() -> None:
    with pytest.raises(UserError, match="no chat template"):
        format_prompts(ROWS, chat_tokenizer(None), DataSpec(chat_template=True))
