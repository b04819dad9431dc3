"""Passkey retrieval (Mohtashami & Jaggi, 2023), as the seed papers describe it.

A five-digit pass key is hidden at a relative depth inside repetitive filler text; the model is
asked for it at the end. A KV policy that loses the needle's page cannot answer, however fluent
the rest is, which makes the task a sharp test of retrieval under a small budget (IceCache §5.2
runs it at budgets 64-256 with depths 0-95%).

Written from the task's description (not copied from any implementation). Layout of a prompt::

    <task description> <filler ...> <needle> <filler ...> What is the pass key? The pass key is

with the filler "The grass is green. The sky is blue. The sun is yellow. Here we go. There and
back again." repeated and the needle "The pass key is NNNNN. Remember it. NNNNN is the pass key.".
When the tokenizer has a chat template, everything up to the question is the user's turn and the
assistant's reply is begun with "The pass key is", so instruct models answer with the key.

The prompt ends exactly where the key's tokens begin in the needle. Tokenizers that split digits
(Llama 2, Qwen2, SmolLM2) encode " 60494" as a lone-space token and then the digits; there the
prompt ends with "The pass key is " (the lone space included), because a model asked to continue
"The pass key is" must otherwise produce that rare lone-space token before it can copy the key
(SmolLM2-135M-Instruct with full attention, at 3k and 6k tokens: 0 of 6 keys without the space,
10 of 10 with it; it answers "a special type of pass ..." instead). Tokenizers that glue the space
to the number get no space.

Only the standard library is used; the tokenizer is any Hugging Face tokenizer. Tokenize prompts
with :func:`encode`: lengths are measured with it, so ``len(encode(tok, text)) == n_tokens`` up to
the granularity of one filler sentence (about 5 tokens).
"""

from __future__ import annotations

import random
import re

TASK = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about the important information there."
)
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key?"
ANSWER_PREFIX = "The pass key is"

# The filler is added one sentence at a time, so the prompt length can be hit to within a sentence.
_SENTENCES = [s if s.endswith(".") else s + "." for s in FILLER.split(". ")]


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of a prompt made by :func:`make_passkey_prompt`.

    A chat-templated prompt already holds its special tokens, so none are added (adding them again
    would double the BOS of e.g. Llama 3); a plain prompt gets the tokenizer's usual ones.
    """
    return tokenizer(text, add_special_tokens=not has_chat_template(tokenizer))["input_ids"]


def make_key(seed: int) -> str:
    """The five-digit pass key of sample ``seed`` (deterministic)."""
    return str(random.Random(seed).randint(10000, 99999))


def _haystack(n_sentences: int, depth: float, key: str) -> str:
    filler = [_SENTENCES[i % len(_SENTENCES)] for i in range(n_sentences)]
    at = round(depth * n_sentences)
    return " ".join([*filler[:at], NEEDLE.format(key=key), *filler[at:]])


def _answer_prefix(tokenizer) -> str:
    """``ANSWER_PREFIX``, plus a space when the needle's tokens hold the space before the key alone."""

    def ids(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    spaced = ids(ANSWER_PREFIX + " ")
    in_needle = ids(f"{ANSWER_PREFIX} {make_key(0)}")
    return ANSWER_PREFIX + " " if in_needle[: len(spaced)] == spaced else ANSWER_PREFIX


def _render(tokenizer, haystack: str, answer_prefix: str) -> str:
    user = f"{TASK} {haystack}\n\n{QUESTION}"
    if has_chat_template(tokenizer):
        turn = tokenizer.apply_chat_template(
            [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True
        )
        return turn + answer_prefix
    return f"{user} {answer_prefix}"


def make_passkey_prompt(tokenizer, n_tokens: int, depth: float, seed: int = 0) -> tuple[str, str]:
    """A passkey prompt of about ``n_tokens`` tokens -> ``(prompt_text, answer)``.

    ``depth`` in [0, 1]: where the needle sits in the filler (0: right after the task description,
    1: just before the question; the papers use 0-0.95). ``seed`` picks the key. The prompt is the
    longest one whose :func:`encode` length is ``<= n_tokens`` (shorter by less than one filler
    sentence). Raises ``ValueError`` when even a prompt without filler is longer than ``n_tokens``.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1] (a fraction of the filler), got {depth}")
    key = make_key(seed)
    prefix = _answer_prefix(tokenizer)

    def render(n: int) -> str:
        return _render(tokenizer, _haystack(n, depth, key), prefix)

    def length(n: int) -> int:
        return len(encode(tokenizer, render(n)))

    if length(0) > n_tokens:
        raise ValueError(f"n_tokens={n_tokens} is shorter than a passkey prompt without filler ({length(0)} tokens)")
    # Length grows with the number of sentences: bracket, then bisect for the longest that fits.
    lo, hi = 0, max(1, n_tokens // 8)
    while length(hi) <= n_tokens:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if length(mid) <= n_tokens else (lo, mid)
    return render(lo), key


def score(answer: str, completion: str) -> bool:
    """True when the key ``answer`` appears in ``completion`` as a whole number (not inside a longer one)."""
    return re.search(rf"(?<!\d){re.escape(answer)}(?!\d)", completion) is not None
