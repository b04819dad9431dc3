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

The tokenizer is any Hugging Face tokenizer; rendering and length fitting are `prompting`'s. Tokenize prompts
with :func:`encode`: lengths are measured with it, so ``len(encode(tok, text)) == n_tokens`` up to
the granularity of one filler sentence (about 5 tokens).
"""

from __future__ import annotations

import random
import re

from kvdex.eval import prompting

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


# Prompts are tokenized like every generated task's (chat-templated text holds its special tokens).
encode = prompting.encode


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
        return prompting.render(tokenizer, f"{TASK} {_haystack(n, depth, key)}\n\n{QUESTION}", " " + prefix)

    if len(encode(tokenizer, render(0))) > n_tokens:
        raise ValueError(
            f"n_tokens={n_tokens} is shorter than a passkey prompt without filler "
            f"({len(encode(tokenizer, render(0)))} tokens)"
        )
    text, _ = prompting.fit(tokenizer, render, n_tokens, start=max(1, n_tokens // 8))
    return text, key


def score(answer: str, completion: str) -> bool:
    """True when the key ``answer`` appears in ``completion`` as a whole number (not inside a longer one)."""
    return re.search(rf"(?<!\d){re.escape(answer)}(?!\d)", completion) is not None
