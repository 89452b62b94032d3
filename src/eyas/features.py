"""On-disk hidden-state features: safetensors shards + `manifest.json`, a reader, a sampler.

A feature directory holds `shard-00000.safetensors`, ... and `manifest.json`. A shard packs
many samples as concatenated tensors plus offsets (N samples, Σ tokens = S):

    offsets            int64 [N+1]         sample i is rows offsets[i]:offsets[i+1]
    input_ids          int64 [S]
    loss_mask          bool  [S]           1 on assistant tokens
    aux_hidden_states  bf16  [S, n, H]     layer ids ascending (manifest `layer_ids`)
    last_hidden_states bf16  [S, H]        the target's final *normed* state (lm_head input)

With `dtype: fp8` the two state tensors are float8_e4m3fn, with per-token scales
`aux_scales` fp32 [S, n] and `last_scales` fp32 [S] (x ≈ q * scale; scale = amax / 448,
values clamped to ±448 before the cast). The shard's metadata holds the sample ids.

Shards and the manifest are written atomically (temp + fsync + rename); the manifest
lists every finished shard with its sha256, so a killed extraction resumes by skipping
the ids of listed shards, and `verify_features` re-checks checksums and shapes.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from eyas.config import ExtractConfig, choices
from eyas.faults import failpoint
from eyas.fp8 import dequantize_fp8, quantize_fp8
from eyas.io import atomic_path, open_safetensors
from eyas.manifest import MANIFEST, read_manifest, sha256_file, write_manifest
from eyas.stage import claim

FORMAT = "eyas-features-v1"
# SYNTH_OUT/captured: the states synthesis kept as the target wrote (synth.capture), in this format with the
# final state before the final norm (`last_normed: false`); the extract stage takes a conversation from it
# when its tokens are the rendered conversation's, all but at most CAPTURE_SLACK at the end (the last reply's
# final token, never fed back, and the template's tail)
CAPTURED = "captured"
CAPTURE_SLACK = 3
# CAPTURED/as_generated.jsonl: conversations whose last reply re-renders to other tokens than the engine
# generated (non-canonical tokenization), kept with the engine's own tokens (those the draft meets when it
# serves): {"id", "tokens": the render's length, "sha256": `ids_digest` of the render}. The extract stage
# takes such a sample only while the conversation still renders to those tokens (one edited since
# synthesis is run through the target).
CAPTURE_AS_GENERATED = "as_generated.jsonl"


def ids_digest(ids: Sequence[int]) -> str:
    """sha256 of a token id sequence (as little-endian int64)."""
    import hashlib
    import struct

    return hashlib.sha256(struct.pack(f"<{len(ids)}q", *(int(i) for i in ids))).hexdigest()


STORAGE_DTYPES = choices(ExtractConfig, "dtype")
SHARD_GLOB = "shard-*.safetensors"


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def bytes_per_token(hidden: int, n_aux: int, dtype: str) -> int:
    """Stored bytes per token: ids (8) + mask (1) + states (+ fp8 scales), offsets not counted."""
    if dtype == "bf16":
        return 9 + (n_aux + 1) * hidden * 2
    if dtype == "fp8":
        return 9 + (n_aux + 1) * (hidden + 4)
    raise ValueError(f"unknown storage dtype {dtype!r}: {' | '.join(STORAGE_DTYPES)}")


# ---------------------------------------------------------------- shards

def pack_shard(samples: Sequence[dict], dtype: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Concatenate sample dicts into the shard tensors (+ safetensors metadata)."""
    if dtype not in STORAGE_DTYPES:
        raise ValueError(f"unknown storage dtype {dtype!r}: {' | '.join(STORAGE_DTYPES)}")
    assert samples, "empty shard"
    lengths = [int(s["input_ids"].shape[0]) for s in samples]
    offsets = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0)
    aux = torch.cat([s["aux_hidden_states"] for s in samples])  # [S, n, H]
    last = torch.cat([s["last_hidden_states"] for s in samples])  # [S, H]
    tensors = {
        "offsets": offsets,
        "input_ids": torch.cat([torch.as_tensor(s["input_ids"], dtype=torch.int64) for s in samples]),
        "loss_mask": torch.cat([torch.as_tensor(s["loss_mask"]).to(torch.bool) for s in samples]),
    }
    assert aux.shape[0] == last.shape[0] == tensors["input_ids"].shape[0] == int(offsets[-1])
    if dtype == "bf16":
        tensors["aux_hidden_states"] = aux.to(torch.bfloat16).contiguous()
        tensors["last_hidden_states"] = last.to(torch.bfloat16).contiguous()
    else:
        tensors["aux_hidden_states"], tensors["aux_scales"] = quantize_fp8(aux)
        tensors["last_hidden_states"], tensors["last_scales"] = quantize_fp8(last)
    meta = {"format": FORMAT, "dtype": dtype, "ids": json.dumps([str(s["id"]) for s in samples])}
    return tensors, meta


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_shard_atomic(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
    from safetensors.torch import save_file

    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata=meta)
    _fsync_dir(path.parent)


class FeatureWriter:
    """Appends shards to a feature dir and keeps its manifest current; resumable.

    `header` holds what identifies the features (target, layer ids, dtype, hashes, ...).
    The dir is claimed by eyas.stage's rule (IDENTITY is the key): an existing dir made
    with a different header, or holding anything but eyas features, is refused; one with
    the same header is resumed: its listed shards are kept (`done_ids`), stray temp files
    and shards the manifest does not list (a kill between rename and manifest update;
    the manifest, written before the first shard, proves the dir is ours) are removed.
    """

    IDENTITY = ("format", "layer_ids", "dtype", "hidden_size", "num_target_layers", "tokenizer_hash",
                "template_hash", "max_len", "data_sha256")

    def __init__(self, out: str | os.PathLike, header: dict[str, Any], samples_per_shard: int = 64):
        if samples_per_shard < 1:
            raise ValueError(f"samples_per_shard must be >= 1, got {samples_per_shard}")
        self.out = Path(out)
        self.header = {"format": FORMAT, **header}
        self.samples_per_shard = samples_per_shard
        self.shards: list[dict[str, Any]] = []
        self.removed: list[str] = []
        prev = claim(self.out, "extract", self.identity(self.header), key_of=self.identity).manifest
        self.out.mkdir(parents=True, exist_ok=True)
        if prev is None:
            self.write_manifest(complete=False)  # before any shard: what is written here is provably ours
        else:
            self.shards = list(prev.get("shards", []))
        listed = {s["file"] for s in self.shards}
        for p in self.out.iterdir():
            if p.name.startswith(".") and ".tmp." in p.name or (p.match(SHARD_GLOB) and p.name not in listed):
                p.unlink()
                self.removed.append(p.name)
        for s in self.shards:
            if not (self.out / s["file"]).exists():
                raise ValueError(f"{self.out}: the manifest lists {s['file']} but it is missing; delete the dir to redo")
        self.pending: list[dict] = []

    @classmethod
    def identity(cls, header: dict[str, Any]) -> dict[str, Any]:
        return {k: header.get(k) for k in cls.IDENTITY}

    @property
    def done_ids(self) -> set[str]:
        return {i for s in self.shards for i in s["ids"]}

    @property
    def complete(self) -> bool:
        man = read_manifest(self.out)
        return bool(man and man.get("complete"))

    def add(self, sample: dict, truncated: bool = False) -> None:
        self.pending.append({**sample, "_truncated": bool(truncated)})
        if len(self.pending) >= self.samples_per_shard:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        index = max((int(s["file"][6:11]) for s in self.shards), default=-1) + 1
        path = self.out / shard_name(index)
        tensors, meta = pack_shard(self.pending, self.header["dtype"])
        write_shard_atomic(path, tensors, meta)
        failpoint("extract.shard", self.out / MANIFEST)
        self.shards.append({
            "file": path.name,
            "sha256": sha256_file(path),
            "bytes": path.stat().st_size,
            "num_samples": len(self.pending),
            "num_tokens": int(tensors["offsets"][-1]),
            "num_loss_tokens": int(tensors["loss_mask"].sum()),
            "truncated": sum(s["_truncated"] for s in self.pending),
            "ids": [str(s["id"]) for s in self.pending],
        })
        self.pending = []
        self.write_manifest(complete=False)

    def write_manifest(self, complete: bool, **extra: Any) -> dict[str, Any]:
        counts = {
            "num_samples": sum(s["num_samples"] for s in self.shards),
            "num_tokens": sum(s["num_tokens"] for s in self.shards),
            "num_loss_tokens": sum(s["num_loss_tokens"] for s in self.shards),
            "truncated": sum(s["truncated"] for s in self.shards),
            "bytes": sum(s["bytes"] for s in self.shards),
            "num_shards": len(self.shards),
        }
        header = dict(self.header)
        config = header.pop("config", None)
        return write_manifest(self.out, "extract", config, **header, **counts, **extra,
                              complete=complete, shards=self.shards)

    def finish(self, **extra: Any) -> dict[str, Any]:
        self.flush()
        return self.write_manifest(complete=True, **extra)


# ---------------------------------------------------------------- reader

class FeatureDataset:
    """Random access over a feature dir: `ds[i]` -> dict of tensors (fp8 dequantized to bf16)."""

    def __init__(self, path: str | os.PathLike, allow_partial: bool = False, max_open: int = 8):
        self.path = Path(path)
        man = read_manifest(self.path)
        if man is None or man.get("stage") != "extract":
            raise ValueError(f"{self.path} is not a feature dir (no extract manifest.json); run `eyas extract` first")
        if not man.get("complete") and not allow_partial:
            raise ValueError(f"{self.path}: extraction is not complete; rerun `eyas extract` to resume it")
        if man.get("format") != FORMAT:
            raise ValueError(f"{self.path}: unknown feature format {man.get('format')!r} (expected {FORMAT})")
        self.manifest = man
        self.layer_ids: list[int] = list(man["layer_ids"])
        self.hidden_size: int = int(man["hidden_size"])
        self.num_target_layers: int = int(man["num_target_layers"])
        self.dtype: str = man["dtype"]
        self.target: str = man.get("target", "")
        self._index: list[tuple[int, int]] = []  # (shard, position in shard)
        self.ids: list[str] = []
        for si, s in enumerate(man["shards"]):
            self._index += [(si, j) for j in range(s["num_samples"])]
            self.ids += s["ids"]
        self._files: OrderedDict[int, Any] = OrderedDict()
        self._offsets: dict[int, list[int]] = {}
        self._max_open = max_open
        self._checked: set[int] = set()  # shards whose sha256 matched the manifest
        self._lengths: list[int] | None = None

    def __len__(self) -> int:
        return len(self._index)

    def _open(self, si: int):
        from safetensors import safe_open

        if si in self._files:
            self._files.move_to_end(si)
            return self._files[si]
        shard = self.manifest["shards"][si]
        path = self.path / shard["file"]
        if si not in self._checked:  # once per shard: the bytes are then in the page cache for the reads
            if shard.get("sha256") and sha256_file(path) != shard["sha256"]:
                raise ValueError(f"{path}: sha256 differs from {self.path}/manifest.json (corrupt or modified); "
                                 f"`eyas extract verify {self.path}` lists every bad shard; re-extract them")
            self._checked.add(si)
        f = safe_open(str(path), framework="pt")
        self._files[si] = f
        if si not in self._offsets:
            self._offsets[si] = f.get_tensor("offsets").tolist()
        while len(self._files) > self._max_open:
            self._files.popitem(last=False)
        return f

    @property
    def lengths(self) -> list[int]:
        """Tokens per sample, for `eyas.packing`."""
        if self._lengths is None:
            out: list[int] = []
            for si in range(len(self.manifest["shards"])):
                self._open(si)
                off = self._offsets[si]
                out += [b - a for a, b in zip(off[:-1], off[1:])]
            self._lengths = out
        return self._lengths

    def __getitem__(self, i: int) -> dict[str, Any]:
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        si, j = self._index[i]
        f = self._open(si)
        a, b = self._offsets[si][j], self._offsets[si][j + 1]
        out: dict[str, Any] = {
            "id": self.ids[i],
            "input_ids": f.get_slice("input_ids")[a:b],
            "loss_mask": f.get_slice("loss_mask")[a:b],
        }
        aux, last = f.get_slice("aux_hidden_states")[a:b], f.get_slice("last_hidden_states")[a:b]
        if self.dtype == "fp8":
            aux = dequantize_fp8(aux, f.get_slice("aux_scales")[a:b])
            last = dequantize_fp8(last, f.get_slice("last_scales")[a:b])
        out["aux_hidden_states"], out["last_hidden_states"] = aux, last
        return out

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for i in range(len(self)):
            yield self[i]


def open_features(path: str | os.PathLike, allow_partial: bool = False) -> FeatureDataset:
    return FeatureDataset(path, allow_partial=allow_partial)


def verify_features(path: str | os.PathLike) -> dict[str, Any]:
    """Check every shard's sha256, size, tensor names, dtypes and shapes against the manifest.

    Returns a summary; raises ValueError listing every problem found.
    """
    path = Path(path)
    man = read_manifest(path)
    if man is None or man.get("stage") != "extract":
        raise ValueError(f"{path} is not a feature dir (no extract manifest.json)")
    problems: list[str] = []
    if not man.get("complete"):
        problems.append("manifest says the extraction is not complete")
    n, H, dtype = len(man["layer_ids"]), man["hidden_size"], man["dtype"]
    state_dt = torch.bfloat16 if dtype == "bf16" else torch.float8_e4m3fn
    seen: set[str] = set()
    tokens = samples = 0
    for s in man["shards"]:
        p = path / s["file"]
        if not p.exists():
            problems.append(f"{s['file']}: missing")
            continue
        if p.stat().st_size != s["bytes"]:
            problems.append(f"{s['file']}: {p.stat().st_size} bytes, manifest says {s['bytes']}")
        if sha256_file(p) != s["sha256"]:
            problems.append(f"{s['file']}: sha256 mismatch (corrupt or modified)")
            continue
        with open_safetensors(p, "re-extract it") as f:
            ids = json.loads(f.metadata()["ids"])
            off = f.get_tensor("offsets")
            S = int(off[-1])
            want = {"offsets": ([s["num_samples"] + 1], torch.int64), "input_ids": ([S], torch.int64),
                    "loss_mask": ([S], torch.bool), "aux_hidden_states": ([S, n, H], state_dt),
                    "last_hidden_states": ([S, H], state_dt)}
            if dtype == "fp8":
                want |= {"aux_scales": ([S, n], torch.float32), "last_scales": ([S], torch.float32)}
            for name, (shape, dt) in want.items():
                if name not in f.keys():
                    problems.append(f"{s['file']}: no tensor {name!r}")
                    continue
                sl = f.get_slice(name)
                if list(sl.get_shape()) != shape or _st_dtype(sl.get_dtype()) != dt:
                    problems.append(f"{s['file']}: {name} is {sl.get_dtype()} {sl.get_shape()}, expected {dt} {shape}")
            if ids != s["ids"] or S != s["num_tokens"] or bool((off[1:] <= off[:-1]).any()):
                problems.append(f"{s['file']}: ids / offsets disagree with the manifest")
        dup = seen.intersection(ids)
        if dup:
            problems.append(f"{s['file']}: ids also in an earlier shard: {sorted(dup)[:5]}")
        seen.update(ids)
        tokens += s["num_tokens"]
        samples += s["num_samples"]
    if samples != man.get("num_samples") or tokens != man.get("num_tokens"):
        problems.append(f"counts: shards hold {samples} samples / {tokens} tokens, manifest says "
                        f"{man.get('num_samples')} / {man.get('num_tokens')}")
    if problems:
        raise ValueError(f"{path}: verification failed:\n  " + "\n  ".join(problems))
    return {"path": str(path), "shards": len(man["shards"]), "samples": samples, "tokens": tokens,
            "bytes": man.get("bytes"), "dtype": dtype, "layer_ids": man["layer_ids"], "hidden_size": H}


def _st_dtype(name: str) -> torch.dtype:
    return {"BF16": torch.bfloat16, "F8_E4M3": torch.float8_e4m3fn, "F32": torch.float32, "I64": torch.int64,
            "BOOL": torch.bool, "F16": torch.float16}.get(name, torch.uint8)
