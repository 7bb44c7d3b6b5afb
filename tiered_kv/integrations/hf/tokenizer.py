r"""A byte-level tokenizer with a minimal chat template, built in code: text for models that come without one.

Primitives: :class:`ByteTokenizer` (the tokenizer of the server example's default random Llama, whose
vocabulary has no text of its own), :data:`IM_START`, :data:`IM_END`, :data:`END_OF_TEXT`.

Ids ``0..255`` are the UTF-8 bytes of the text; ``256..258`` are the special tokens of the chat template
(ChatML)::

    <|im_start|>{role}\n{content}<|im_end|>\n ... <|im_start|>assistant\n

Special tokens are only ever produced by the template: text that spells one is encoded as its bytes. Decoding
turns bytes back into text (invalid UTF-8 as U+FFFD), special tokens into their spelling, and any other id
(a model's vocabulary beyond these 259) into U+FFFD. It offers the part of the transformers tokenizer
interface that a server uses: ``encode``, ``decode``, ``apply_chat_template``, ``chat_template``,
``vocab_size``, ``eos_token_id``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = ["END_OF_TEXT", "IM_END", "IM_START", "ByteTokenizer"]

#: special token ids (after the 256 byte values)
IM_START, IM_END, END_OF_TEXT = 256, 257, 258
_SPECIAL = {IM_START: "<|im_start|>", IM_END: "<|im_end|>", END_OF_TEXT: "<|endoftext|>"}
_REPLACEMENT = "\ufffd"


class ByteTokenizer:
    """UTF-8 bytes as token ids, plus the three special tokens of a ChatML chat template.

    Args:
        roles: the message roles the chat template accepts.
    """

    vocab_size = 259
    eos_token_id = IM_END
    #: the template :meth:`apply_chat_template` applies, in the Jinja form transformers tokenizers carry
    chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )

    def __init__(self, roles: Iterable[str] = ("system", "developer", "user", "assistant")) -> None:
        self.roles = tuple(roles)

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of ``text`` (a special token's spelling is bytes too)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``: bytes as UTF-8 (invalid sequences as U+FFFD), special tokens spelled, others U+FFFD."""
        out: list[str] = []
        run = bytearray()
        for i in ids:
            t = int(i)
            if 0 <= t < 256:
                run.append(t)
                continue
            if run:
                out.append(run.decode("utf-8", errors="replace"))
                run.clear()
            out.append(_SPECIAL.get(t, _REPLACEMENT))
        if run:
            out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = True,
        **_: Any,
    ) -> list[int] | str:
        """The prompt of a chat: token ids (``tokenize=True``) or its text.

        Raises:
            ValueError: a message without a known ``role`` or a string ``content``.
        """
        ids: list[int] = []
        for m in messages:
            role, content = m.get("role"), m.get("content")
            if role not in self.roles or not isinstance(content, str):
                raise ValueError(f"each message needs a role ({', '.join(self.roles)}) and a string content")
            ids += [IM_START, *self.encode(f"{role}\n{content}"), IM_END, *self.encode("\n")]
        if add_generation_prompt:
            ids += [IM_START, *self.encode("assistant\n")]
        return ids if tokenize else self.decode(ids)

    def __repr__(self) -> str:
        return f"<ByteTokenizer vocab_size={self.vocab_size} template=ChatML>"
