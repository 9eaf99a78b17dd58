"""Long-context probes with a known answer: the passkey document (infinity-Bench Retrieve.PassKey format)."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

PASSKEY_INSTRUCTION = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
                       "I will quiz you about the important information there.\n\n")
PASSKEY_NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
PASSKEY_QUESTION = "\n\nWhat is the pass key? The pass key is"


@dataclass(frozen=True)
class PasskeyDocument:
    prompt: str     # instruction + haystack with the needle + question
    answer: str     # the 5-digit key
    depth: float    # where the needle sits, 0 = start, 1 = end


def passkey_document(num_tokens: int, depth: float, count_tokens: Callable[[str], int],
                     seed: int = 0) -> PasskeyDocument:
    """A haystack of about ``num_tokens`` tokens with a random 5-digit pass key at ``depth``."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth is a fraction of the document in [0, 1], got {depth!r}.")
    if num_tokens < 64:
        raise ValueError(f"num_tokens must be at least 64 to hold the instruction and the needle, got {num_tokens}.")
    key = str(random.Random(seed).randint(10_000, 99_999))
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
    fixed = count_tokens(PASSKEY_INSTRUCTION + needle + PASSKEY_QUESTION)
    # A sentence repeated tokenises shorter than alone (merges across the joins): measure it in a run.
    per_repeat = count_tokens(PASSKEY_NOISE * 16) / 16
    repeats = max(1, math.ceil((num_tokens - fixed) / per_repeat))
    while True:  # guarantee at least num_tokens: callers rely on the length (e.g. "4x the trained context")
        before = round(repeats * depth)
        prompt = (PASSKEY_INSTRUCTION + PASSKEY_NOISE * before + needle + PASSKEY_NOISE * (repeats - before)
                  + PASSKEY_QUESTION)
        missing = num_tokens - count_tokens(prompt)
        if missing <= 0:
            return PasskeyDocument(prompt, key, depth)
        repeats += max(1, math.ceil(missing / per_repeat))
