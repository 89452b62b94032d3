"""The normalized prompt record: `{"id", "domain", "messages", "meta"?}`, stable ids, dedup.

`id = f"{source}-{sha256(content)[:16]}"` where content is the canonical JSON of the whole
conversation. Dedup is on the prompt side (system + user turns): the target regenerates
assistant turns downstream, so two records that differ only in assistant text are the
same prompt, and keeping both would let one land in train and the other in eval.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable

ROLES = ("system", "user", "assistant")
ROLE_MAP = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
}


@dataclass
class Counts:
    """Why records were skipped (`skipped`) or repaired (`fixed`), by reason."""

    skipped: Counter = field(default_factory=Counter)
    fixed: Counter = field(default_factory=Counter)


def _canonical(messages: Iterable[dict[str, str]]) -> str:
    return json.dumps([[m["role"], m["content"]] for m in messages], ensure_ascii=False, separators=(",", ":"))


def content_hash(messages: list[dict[str, str]]) -> str:
    return hashlib.sha256(_canonical(messages).encode()).hexdigest()


def prompt_key(messages: list[dict[str, str]]) -> str:
    """Hash of the system + user turns: the dedup key (and the 'same content' test)."""
    return content_hash([m for m in messages if m["role"] != "assistant"])


def make_record(source: str, domain: str, messages: list[dict[str, str]], meta: dict | None = None) -> dict[str, Any]:
    rec: dict[str, Any] = {"id": f"{source}-{content_hash(messages)[:16]}", "domain": domain, "messages": messages}
    if meta:
        rec["meta"] = meta
    return rec


def clean_messages(turns: list[tuple[Any, Any]], counts: Counts) -> list[dict[str, str]] | None:
    """(role, content) pairs -> valid messages, or None (reason counted in `counts.skipped`).

    Roles are mapped (human/gpt -> user/assistant), text stripped, empty turns dropped,
    consecutive same-role turns merged, leading assistant turns dropped (nothing to
    regenerate them from); at least one user turn must remain.
    """
    out: list[dict[str, str]] = []
    for role, content in turns:
        if role not in ROLE_MAP:
            counts.skipped["unknown_role"] += 1
            return None
        if not isinstance(content, str):
            counts.skipped["bad_content"] += 1
            return None
        role, content = ROLE_MAP[role], content.strip()
        if not content:
            counts.fixed["empty_turn_dropped"] += 1
            continue
        if out and out[-1]["role"] == role:
            counts.fixed["same_role_merged"] += 1
            out[-1]["content"] += "\n\n" + content
            continue
        out.append({"role": role, "content": content})
    lead = 1 if out and out[0]["role"] == "system" else 0
    if any(m["role"] == "system" for m in out[lead:]):
        counts.skipped["system_not_first"] += 1
        return None
    if len(out) > lead and out[lead]["role"] == "assistant":
        counts.fixed["leading_assistant_dropped"] += 1
        del out[lead]
    if not any(m["role"] == "user" for m in out):
        counts.skipped["no_user_turn"] += 1
        return None
    return out


def record_error(rec: Any) -> str | None:
    """Why `rec` is not a valid normalized record, or None."""
    if not isinstance(rec, dict) or not isinstance(rec.get("id"), str) or not isinstance(rec.get("domain"), str):
        return "bad_record"
    msgs = rec.get("messages")
    if not isinstance(msgs, list) or not msgs:
        return "no_messages"
    for m in msgs:
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            return "bad_message"
    if not any(m["role"] == "user" for m in msgs):
        return "no_user_turn"
    return None


def dedup(records: Iterable[dict], counts: Counts) -> list[dict]:
    """First occurrence wins; duplicates (same prompt key) counted as `duplicate`."""
    seen: set[str] = set()
    out = []
    for rec in records:
        key = prompt_key(rec["messages"])
        if key in seen:
            counts.skipped["duplicate"] += 1
            continue
        seen.add(key)
        out.append(rec)
    return out
