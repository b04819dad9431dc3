"""Prompt rendering shared by the generated tasks: chat templates, answer prefixes, length fitting."""

from __future__ import annotations

from collections.abc import Callable


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render(tokenizer, user: str, answer_prefix: str = "", chat: bool | None = None) -> str:
    """The prompt text: the user's turn (chat template when the tokenizer has one) + ``answer_prefix``.

    The answer prefix opens the assistant's reply (RULER's way of pinning the answer format).
    """
    if chat is None:
        chat = has_chat_template(tokenizer)
    if chat:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True
        )
        return text + answer_prefix.lstrip()
    return user + answer_prefix


def encode(tokenizer, text: str, chat: bool | None = None) -> list[int]:
    """Token ids of a rendered prompt (a chat-templated text already holds its special tokens).

    ``chat``: whether ``text`` was rendered with the chat template (default: the tokenizer has one).
    """
    if chat is None:
        chat = has_chat_template(tokenizer)
    return tokenizer(text, add_special_tokens=not chat)["input_ids"]


def fit(tokenizer, build: Callable[[int], str], n_tokens: int, start: int = 16) -> tuple[str, int]:
    """The text ``build(n)`` for the largest ``n`` whose :func:`encode` length is ``<= n_tokens``.

    ``build(n)`` must grow with ``n`` (n units of haystack). Returns ``(text, n)``; raises
    ``ValueError`` when even ``build(0)`` is too long.
    """
    length = lambda n: len(encode(tokenizer, build(n)))
    if length(0) > n_tokens:
        raise ValueError(f"n_tokens={n_tokens} is shorter than the prompt without any haystack ({length(0)} tokens)")
    lo, hi = 0, max(1, start)
    while length(hi) <= n_tokens:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if length(mid) <= n_tokens else (lo, mid)
    return build(lo), lo


def truncate_middle(ids: list[int], n_tokens: int) -> list[int]:
    """Keep the first and last halves of ``ids`` when longer than ``n_tokens`` (LongBench's truncation)."""
    if len(ids) <= n_tokens:
        return ids
    half = n_tokens // 2
    return ids[:half] + ids[len(ids) - (n_tokens - half) :]
