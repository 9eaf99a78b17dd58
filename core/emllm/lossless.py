"""Refuse text that the tokenizer would change without a word.

A byte-level vocabulary can lack tokens for a few bytes (SmolLM2's has none for 0x04 0x06 0x13 0x14 0x16 0x1d 0xf1
0xf2), and its tokenizer then drops them silently: "a\\x04b" is read as "ab", and a character whose UTF-8 holds 0xf1
comes back as replacement characters. The memory would then hold another text than the one the user gave.

Whether a tokenizer is lossless by design is checked once, on a probe of mixed scripts, spacing and punctuation:
if decoding its tokens gives back the probe (after the tokenizer's own normaliser, e.g. Qwen's NFC), every other
difference on a user's text is a loss, and the text is refused with the first character that would be lost.
Tokenizers that are not exact inverses by design (SentencePiece's leading space, word-level vocabularies) are not
judged: the check stays off for them rather than refusing good text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

PROBE = ("Plain ASCII 0123456789 !\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~ two  spaces\ttab\nnewline\r\n"
         "accents é ñ ü ß, Ελληνικά, русский, עברית, العربية, हिन्दी, 中文, 日本語, 한국어, emoji 🙂👍🏽.")


class LosslessCheck:
    """Compares a text with what its token ids decode to, for tokenizers where the two must be equal."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._normalizer = getattr(backend, "normalizer", None)
        self.enabled = True
        self.enabled = self.first_loss(PROBE, tokenizer(PROBE, add_special_tokens=False)["input_ids"]) is None

    def first_loss(self, text: str, ids: Sequence[int]) -> tuple[int, str] | None:
        """(index, character) of the first character the ids do not give back, or None if none is lost."""
        if not self.enabled:
            return None
        expected = self._normalizer.normalize_str(text) if self._normalizer is not None else text
        decoded = self._tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if decoded == expected:
            return None
        index = next((i for i, (a, b) in enumerate(zip(expected, decoded)) if a != b), min(len(expected), len(decoded)))
        return index, expected[min(index, len(expected) - 1)]

    def check(self, text: str, ids: Sequence[int]) -> None:
        """Raise ValueError naming the first character this tokenizer cannot represent."""
        loss = self.first_loss(text, ids)
        if loss is None:
            return
        index, char = loss
        raise ValueError(
            f"The text holds {char!r} (U+{ord(char):04X}) at character {index}, which this model's tokenizer has no "
            f"token for: it would be dropped or changed silently, so the text is refused. Remove or replace such "
            f"characters first, e.g. text.replace({char!r}, ' ').")
