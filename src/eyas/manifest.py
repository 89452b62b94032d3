"""Every artifact carries a `manifest.json`: what made it, the resolved config, hashes, counts.

A stage that finds a complete manifest for the same inputs skips itself; writes are
atomic (temp file + rename) so a kill never leaves a half-written manifest.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

import eyas
from eyas.host import machine
from eyas.io import atomic_write_text

MANIFEST = "manifest.json"


@functools.lru_cache(maxsize=1)
def _git_commit() -> str | None:  # once per process: manifests are rewritten after every shard
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=5
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


def write_manifest(directory: str | os.PathLike, stage: str, config: Any = None, **fields: Any) -> dict[str, Any]:
    """Write `directory/manifest.json`; `config` may be a dataclass or a dict."""
    import dataclasses

    if dataclasses.is_dataclass(config):
        config = dataclasses.asdict(config)  # type: ignore[arg-type]
    data = {
        "stage": stage,
        "eyas_version": eyas.__version__,
        "git_commit": _git_commit(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": platform.node(),
        "machine": machine(),  # CPU model and numeric ISA flags: figures from two machines are never compared blind
        "config": config,
        **fields,
    }
    atomic_write_text(Path(directory) / MANIFEST, json.dumps(data, indent=2, default=str) + "\n")
    return data


def read_manifest(directory: str | os.PathLike) -> dict[str, Any] | None:
    path = Path(directory) / MANIFEST
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: corrupt manifest ({e}); delete it to redo this stage") from None


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def tokenizer_hash(model_dir: str | os.PathLike) -> str:
    """Hash of the tokenizer files (vocab, merges, special tokens, chat template) of a model dir."""
    h = hashlib.sha256()
    d = Path(model_dir)
    for name in sorted(["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"]):
        p = d / name
        if p.exists():
            h.update(name.encode())
            h.update(p.read_bytes())
    return h.hexdigest()
