"""The serving chat template, rendered exactly as vLLM renders it, and the assistant loss mask.

vLLM renders a chat with the tokenizer's Jinja template (or `--chat-template FILE`) to
text, then tokenizes that text with `add_special_tokens=False`. Synthesis, extraction
and training all go through `render` below, so the token ids the draft trains on are
the ones the engine sees when it serves. The loss mask covers the assistant turns: the
characters each assistant message adds to the rendering (content + end-of-turn token),
mapped to tokens through the tokenizer's offsets, which holds for any template whose
renderings of growing prefixes are prefixes of each other (checked, never assumed).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eyas.io import read_text
from eyas.manifest import sha256_text

ROLES = ("system", "user", "assistant")


def load_tokenizer(model_dir: str | os.PathLike):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def load_chat_template(model_dir: str | os.PathLike, template_file: str = "", tok: Any = None) -> str:
    """The template file given (as `vllm serve --chat-template`), else the tokenizer's own
    (`tok`, when the caller has it loaded already)."""
    if template_file:
        p = Path(template_file)
        if not p.exists():
            raise ValueError(f"chat template file {p} does not exist")
        return read_text(p)
    tok = tok if tok is not None else load_tokenizer(model_dir)
    if not tok.chat_template:
        raise ValueError(f"{model_dir}: the tokenizer has no chat template; pass a template file (--chat-template)")
    return tok.chat_template if isinstance(tok.chat_template, str) else tok.chat_template["default"]


def template_hash(template: str) -> str:
    return sha256_text(template)


def validate_messages(messages: Any, where: str) -> list[dict[str, str]]:
    """Refuse what no engine renders sensibly; ValueError says what and where."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: 'messages' must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"{where}: message {i} needs 'role' and 'content'")
        if m["role"] not in ROLES:
            raise ValueError(f"{where}: message {i} has unknown role {m['role']!r} (expected one of {ROLES})")
        if not isinstance(m["content"], str) or not m["content"].strip():
            raise ValueError(f"{where}: message {i} ({m['role']}) has empty content")
    if not any(m["role"] == "user" for m in messages):
        raise ValueError(f"{where}: no user turn")
    return messages


def render_text(tok, messages: list[dict[str, str]], template: str, add_generation_prompt: bool) -> str:
    return tok.apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=add_generation_prompt
    )


def render_prompt_ids(tok, messages: list[dict[str, str]], template: str) -> list[int]:
    """Token ids of the prompt vLLM would run for `messages` (generation prompt appended)."""
    text = render_text(tok, messages, template, add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


@dataclass
class Rendered:
    input_ids: list[int]  # [T]
    loss_mask: list[int]  # [T], 1 on assistant tokens
    text: str


def render_with_mask(tok, messages: list[dict[str, str]], template: str, where: str = "conversation") -> Rendered:
    """Render a whole conversation and mark the tokens of every assistant turn."""
    full = render_text(tok, messages, template, add_generation_prompt=False)
    spans: list[tuple[int, int]] = []  # [start, end) character spans of assistant turns
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render_text(tok, messages[:i], template, add_generation_prompt=True) if i else ""
        after = render_text(tok, messages[: i + 1], template, add_generation_prompt=False)
        if not (full.startswith(before) and full.startswith(after) and after.startswith(before)):
            raise ValueError(
                f"{where}: the chat template does not render turn {i} as a prefix of the whole conversation; "
                "the assistant mask cannot be derived (use a template without history-dependent rewriting)"
            )
        end = len(after.rstrip())  # the turn's content and end-of-turn token, not the trailing newline
        spans.append((len(before), end))
    enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    mask = [0] * len(ids)
    for t, (s, e) in enumerate(offsets):
        if e > s and any(a <= s and e <= b for a, b in spans):
            mask[t] = 1
    return Rendered(input_ids=list(ids), loss_mask=mask, text=full)
