"""A character-level tokenizer built in code for the ``tiny`` model.

Every printable ASCII character, tab and newline is one token; anything else maps to
``<unk>``, so arbitrary text encodes (arithmetic prompts, JSONL data, chat templates).
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

__all__ = ["SPECIAL_TOKENS", "char_tokenizer"]

SPECIAL_TOKENS = {"pad": "<pad>", "bos": "<s>", "eos": "</s>", "unk": "<unk>"}

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def char_tokenizer() -> PreTrainedTokenizerFast:
    """A left-padding character-level ``PreTrainedTokenizerFast`` (vocabulary of 101 tokens)."""
    chars = ["\t", "\n", *(chr(c) for c in range(32, 127))]
    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS.values(), *chars])}
    core = Tokenizer(models.WordLevel(vocab, unk_token=SPECIAL_TOKENS["unk"]))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=SPECIAL_TOKENS["pad"],
        bos_token=SPECIAL_TOKENS["bos"],
        eos_token=SPECIAL_TOKENS["eos"],
        unk_token=SPECIAL_TOKENS["unk"],
        padding_side="left",
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok
