"""RAG / summarization / long-context prompts over Python's own `pydoc_data.topics` prose.

The text differs between Python versions, so the manifest records the version.
Long-context prompts are padded with real documentation and measured with the target's
own tokenizer (through its chat template when it has one), so a bucket of 4096 tokens
means 4096 tokens of prompt as the target sees it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from random import Random
from typing import Any

from eyas.data.normalize import Counts, make_record

SUMMARIZE = [
    "Summarize the following documentation:",
    "Summarize the following Python documentation in three bullet points:",
    "Write a one-paragraph summary of this text for a programmer new to Python:",
    "Give a short summary of the key rules described below:",
]
QUESTIONS = [
    "What does the documentation say about {h}?",
    "According to the documentation, how does {h} work? Give a short example.",
    "Which rules or restrictions apply to {h}, according to the documentation?",
    "Explain {h} in your own words, citing the documentation.",
]
RAG_HEAD = "Using the documentation below, answer the question at the end."
CHUNK_CHARS = 2500


@dataclass(frozen=True)
class Para:
    topic: str
    heading: str  # nearest section heading above the paragraph
    text: str


def paragraphs() -> list[Para]:
    """Every blank-line-separated paragraph of every topic, headings tracked, in topic order."""
    from pydoc_data.topics import topics

    out = []
    for topic in sorted(topics):
        heading = topic
        for block in re.split(r"\n\s*\n", topics[topic]):
            lines = block.strip("\n").splitlines()
            if len(lines) >= 2 and re.fullmatch(r"[*=\-]{3,}", lines[1].strip()):
                heading = lines[0].strip()
            if block.strip():
                out.append(Para(topic, heading, block.strip("\n")))
    return out


def chunks(paras: list[Para], max_chars: int = CHUNK_CHARS) -> list[Para]:
    """Consecutive paragraphs of one topic joined up to `max_chars` (a longer paragraph stands alone)."""
    out: list[Para] = []
    for p in paras:
        last = out[-1] if out else None
        if last and last.topic == p.topic and len(last.text) + len(p.text) + 2 <= max_chars:
            out[-1] = Para(last.topic, last.heading, last.text + "\n\n" + p.text)
        else:
            out.append(p)
    return out


def read_pydoc(seed: int, counts: Counts) -> list[dict[str, Any]]:
    """One summarization and one RAG prompt (answer chunk + one distractor) per chunk."""
    cs = chunks(paragraphs())
    out = []
    for i, c in enumerate(cs):
        rng = Random(f"{seed}:{i}")
        if len(c.text) < 200:
            counts.skipped["too_short"] += 1
            continue
        meta = {"topic": c.topic, "heading": c.heading}
        text = f"{rng.choice(SUMMARIZE)}\n\n{c.text}"
        out.append(make_record("pydoc", "summarization", [{"role": "user", "content": text}], meta))
        other = cs[rng.randrange(len(cs))]
        docs = [c.text, other.text] if rng.random() < 0.5 else [other.text, c.text]
        body = "\n\n".join(f"Document {k + 1}:\n{d}" for k, d in enumerate(docs))
        text = f"{RAG_HEAD}\n\n{body}\n\nQuestion: {rng.choice(QUESTIONS).format(h=c.heading)}"
        out.append(make_record("pydoc", "rag", [{"role": "user", "content": text}], meta))
    return out


def count_tokens(tokenizer: Any, content: str) -> int:
    """Tokens of a one-turn user prompt as the target sees it (template text, no added specials)."""
    msgs = [{"role": "user", "content": content}]
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        return len(tokenizer.encode(text, add_special_tokens=False))
    return len(tokenizer.encode(content, add_special_tokens=False))


def _fill(tokenizer: Any, head: str, tail: str, pool: list[Para], start: int, target: int) -> tuple[str, int]:
    """`head + paragraphs + tail` with as much pydoc text as fits in `target` tokens."""
    def n(body: str) -> int:
        return count_tokens(tokenizer, head + body + tail)

    if n("") + 16 > target:
        raise ValueError(f"long-context target of {target} tokens is too small for the prompt; use >= {n('') + 16}")
    parts: list[str] = []
    est, budget, i = 0, target - n(""), start
    while est < budget:  # estimate by summing paragraph counts (cheap), then correct exactly
        p = pool[i % len(pool)].text
        parts.append(p)
        est += len(tokenizer.encode(p + "\n\n", add_special_tokens=False))
        i += 1
    while parts and n("\n\n".join(parts)) > target:
        parts.pop()
        i -= 1
    body = "\n\n".join(parts)
    pieces = re.split(r"(\s+)", pool[i % len(pool)].text)  # top up with a word-prefix of the next paragraph
    lo, hi = 0, len(pieces)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if n(body + "\n\n" + "".join(pieces[:mid]).rstrip()) <= target:
            lo = mid
        else:
            hi = mid - 1
    if lo:
        body += "\n\n" + "".join(pieces[:lo]).rstrip()
    return head + body + tail, n(body)


def long_context_prompts(tokenizer: Any, target_tokens: list[int], n: int, seed: int = 0) -> list[dict[str, Any]]:
    """`n` prompts per target length, each at most (and close to) that many tokens.

    `tokenizer`: a HF tokenizer (or a model dir to load one from). Records have domain
    "long_context" and meta {"task": "summarization"|"rag", "target_tokens", "tokens"}.
    """
    if isinstance(tokenizer, str) or hasattr(tokenizer, "__fspath__"):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer)
    pool = paragraphs()
    out = []
    for target in target_tokens:
        for k in range(n):
            rng = Random(f"{seed}:{target}:{k}")
            start = rng.randrange(len(pool))
            task = rng.choice(["summarization", "rag"])
            if task == "summarization":
                head, tail = rng.choice(SUMMARIZE) + "\n\n", ""
            else:
                head = RAG_HEAD + "\n\n"
                tail = "\n\nQuestion: " + rng.choice(QUESTIONS).format(h=pool[start].heading)
            text, tokens = _fill(tokenizer, head, tail, pool, start, target)
            meta = {"task": task, "target_tokens": target, "tokens": tokens, "topic": pool[start].topic}
            out.append(make_record("pydoc", "long_context", [{"role": "user", "content": text}], meta))
    return out
