"""Stage 2: hidden-state extraction — offline (shards), online (per batch), streaming (ZeroMQ).

Per conversation the target sees the exact serving rendering (`eyas.chat.render_with_mask`)
and we keep, per token:

    input_ids          int64 [T]
    loss_mask          bool  [T]           assistant tokens (content + end-of-turn)
    aux_hidden_states  bf16  [T, n, H]     layer ids in vLLM's convention: id k = the residual
                                           stream after k decoder layers = HF hidden_states[k]
    last_hidden_states bf16  [T, H]        the final *normed* state (HF hidden_states[L]), the
                                           lm_head input: the trainer recovers the target's
                                           next-token distribution from it, no logits stored

Backends share one interface, `make_extractor(target, backend, layer_ids, ...)` ->
`Extractor` with `.extract(samples) -> list[dict]`: `hf` (transformers forward, the
reference) and `vllm` (the `extract_hidden_states` speculative method with eyas' CPU-safe
KV connector). Heavy imports happen inside the backends.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from eyas.config import ExtractConfig, RunConfig, check_choices
from eyas.extract.backends import extractor_from_config, make_extractor
from eyas.extract.base import (
    BACKENDS,
    COMPUTE_DTYPES,
    MODES,
    Extractor,
    Renderer,
    read_conversations,
    resolve_compute_dtype,
    resolve_lengths,
)
from eyas.lock import writing
from eyas.manifest import read_manifest, sha256_file
from eyas.models import resolve_target
from eyas.stage import output_dir
from eyas.target import facts as target_facts
from eyas.target import resolve_layer_ids, target_fingerprint

__all__ = ["BACKENDS", "COMPUTE_DTYPES", "MODES", "Extractor", "Renderer", "cli", "extract", "extractor_from_config",
           "make_extractor", "read_conversations", "resolve_compute_dtype"]


# ---------------------------------------------------------------- offline

def _log(msg: str) -> None:
    print(f"eyas extract: {msg}", file=sys.stderr, flush=True)


def extract(cfg: ExtractConfig) -> Path:
    """Offline extraction of `cfg.data` into `cfg.out`; resumes a partial dir, skips a complete one.
    One writer per dir (`eyas.lock`): a second one is refused."""
    with writing(output_dir(cfg.out, "--out"), "eyas extract"):
        return _extract(cfg)


def _extract(cfg: ExtractConfig) -> Path:
    import dataclasses

    from eyas.features import FeatureWriter

    check_choices(cfg, "extract")
    cfg = resolve_lengths(cfg)
    if not cfg.data:
        raise ValueError("no conversations given: pass --data CONV.jsonl (made by `eyas synth`)")
    output_dir(cfg.out, "--out")
    target = resolve_target(cfg.target).resolve()
    facts = target_facts(target)
    layer_ids = resolve_layer_ids(cfg.layer_ids or None, facts["num_layers"])
    renderer = Renderer(target, cfg.chat_template, cfg.max_len)
    header = {
        "config": dataclasses.asdict(cfg),
        "target": str(target),
        "data": str(Path(cfg.data).resolve()),
        "data_sha256": sha256_file(cfg.data),
        "backend": cfg.backend,
        "compute_dtype": resolve_compute_dtype(cfg.backend, cfg.compute_dtype),
        "layer_ids": layer_ids,
        "layer_id_convention": "k = residual stream after k decoder layers = HF hidden_states[k]",
        "last_hidden_states": "final normed state = HF hidden_states[L] = lm_head input",
        "dtype": cfg.dtype,
        "hidden_size": facts["hidden_size"],
        "num_target_layers": facts["num_layers"],
        "tokenizer_hash": renderer.tokenizer_hash,
        "target_fingerprint": target_fingerprint(target),
        "template_hash": renderer.template_hash,
        "max_len": cfg.max_len,
    }
    convs = read_conversations(cfg.data, cfg.limit)  # refuses an empty file before anything is written
    writer = FeatureWriter(cfg.out, header, cfg.samples_per_shard)
    done = writer.done_ids
    prev = read_manifest(cfg.out) or {}
    done |= set(prev.get("skipped_ids", []))
    todo = [c for c in convs if c["id"] not in done]
    if writer.complete and not todo:
        _log(f"{cfg.out} is complete; nothing to do")
        return Path(cfg.out)
    if writer.removed:
        _log(f"resuming: removed partial files {writer.removed}")
    _log(f"{len(convs)} conversations, {len(done)} already extracted, {len(todo)} to do "
         f"(backend {cfg.backend}, layers {layer_ids}, storage {cfg.dtype})")
    skipped: list[str] = []
    t0, ntok, adopted = time.time(), 0, 0
    from eyas.features import CAPTURED

    captured = Captured.open(Path(cfg.data).parent / CAPTURED, header, target) if todo else None
    extractor = None  # started when a conversation needs the target (none may, with everything captured)
    try:
        for start in range(0, len(todo), cfg.samples_per_shard):
            chunk = []
            for c in todo[start : start + cfg.samples_per_shard]:
                r = renderer.render(c, where=f"{cfg.data}: id {c['id']}")
                if not bool(r["loss_mask"].any()):
                    skipped.append(c["id"])  # no assistant token within max_len: nothing to learn
                    continue
                s = captured.sample(r) if captured else None
                if s is not None:
                    writer.add(s, truncated=r["truncated"])
                    adopted += 1
                    continue
                chunk.append(r)
            if chunk:
                if extractor is None:
                    extractor = extractor_from_config(cfg, target)
                for r, s in zip(chunk, extractor.extract(chunk), strict=True):
                    writer.add(s, truncated=r["truncated"])
                    ntok += s["input_ids"].shape[0]
            writer.flush()
            rate = ntok / max(time.time() - t0, 1e-9)
            _log(f"{sum(s['num_samples'] for s in writer.shards)}/{len(convs)} conversations ({adopted} taken from "
                 f"the synthesis' captured states), {rate:.0f} tok/s run through the target")
    finally:
        if extractor is not None:
            extractor.close()
    skipped = sorted(set(prev.get("skipped_ids", [])) | set(skipped))
    if not writer.shards:
        writer.write_manifest(complete=False, skipped_no_assistant=len(skipped), skipped_ids=skipped)
        raise ValueError(f"{cfg.data}: none of its {len(convs)} conversations has an assistant token within "
                         f"extract.max_len={cfg.max_len}: nothing to train on (raise max_len, or check the file)")
    man = writer.finish(skipped_no_assistant=len(skipped), skipped_ids=skipped, captured_last_run=adopted,
                        captured_as_generated_last_run=captured.taken_as_generated if captured else 0)
    _log(f"done: {man['num_samples']} samples, {man['num_tokens']} tokens, {man['truncated']} truncated, "
         f"{len(skipped)} without assistant tokens skipped, {man['bytes'] / 1e6:.1f} MB in {man['num_shards']} shards")
    return Path(cfg.out)


# ---------------------------------------------------------------- states captured in synthesis

class Captured:
    """The synthesis' `captured` feature dir (`synth.capture`), from which conversations are taken as they
    are instead of running the target over them again."""

    MUST_MATCH = ("layer_ids", "hidden_size", "num_target_layers", "tokenizer_hash", "template_hash",
                  "target_fingerprint", "max_len")

    def __init__(self, ds, target: Path, as_generated: dict[str, tuple[int, str]] | None = None):
        from eyas.extract.vllm_backend import load_final_norm

        self.ds = ds
        self.index = {i: n for n, i in enumerate(ds.ids)}
        self.norm = load_final_norm(target)  # captured: layer L's raw output; the features: HF hidden_states[L]
        self.as_generated = as_generated or {}  # id -> (rendered tokens, their digest): kept with the engine's tokens
        self.taken_as_generated = 0

    @classmethod
    def open(cls, path: Path, header: dict, target: Path) -> Captured | None:
        from eyas.features import CAPTURE_AS_GENERATED, open_features

        if not (path / "manifest.json").exists():
            return None
        try:
            ds = open_features(path, allow_partial=True)
        except ValueError as e:
            _log(f"{path} not used ({e}); the target runs every conversation")
            return None
        differ = [k for k in cls.MUST_MATCH if ds.manifest.get(k) != header.get(k)]
        if differ:
            _log(f"{path} was captured with another {', '.join(differ)}: not used; the target runs every conversation")
            return None
        if ds.manifest.get("last_normed") is not False:
            _log(f"{path} does not say its final state is before the norm (last_normed: false): not used")
            return None
        as_generated = {}
        if (path / CAPTURE_AS_GENERATED).exists():
            for line in (path / CAPTURE_AS_GENERATED).read_text().splitlines():
                try:
                    r = json.loads(line)
                    as_generated[str(r["id"])] = (int(r["tokens"]), str(r["sha256"]))
                except (ValueError, KeyError, TypeError):
                    continue  # a line cut off by a crash: its sample, if any, is run through the target
        return cls(ds, target, as_generated)

    def sample(self, r: dict) -> dict | None:
        """The captured sample for rendered conversation `r`: its tokens (all but the last <= SLACK), or the
        engine's own where its last reply re-rendered to others and `r` still renders as it did then; None
        when not captured or `r` renders otherwise now (the target runs it)."""
        import torch

        from eyas.features import CAPTURE_SLACK as SLACK
        from eyas.features import ids_digest

        n = self.index.get(r["id"])
        if n is None:
            return None
        s = self.ds[n]
        T, ids, mask = s["input_ids"].shape[0], r["input_ids"], r["loss_mask"]
        if ids.shape[0] - SLACK <= T <= ids.shape[0] and torch.equal(s["input_ids"], ids[:T]):
            ids, mask = ids[:T], mask[:T]
        elif self.as_generated.get(r["id"]) == (ids.shape[0], ids_digest(ids.tolist())):
            ids, mask = s["input_ids"], s["loss_mask"]
            self.taken_as_generated += 1
        else:
            return None
        with torch.no_grad():
            last = self.norm(s["last_hidden_states"].float())  # [T, H] = HF hidden_states[L]
        return {"id": r["id"], "input_ids": ids, "loss_mask": mask,
                "aux_hidden_states": s["aux_hidden_states"], "last_hidden_states": last.to(torch.bfloat16)}


# ---------------------------------------------------------------- CLI

def cli(ec: ExtractConfig, actions: list[str], run: RunConfig) -> int:
    """`eyas extract [--mode offline|online|streaming] ...`, `eyas extract --verify FEAT`."""
    from eyas.features import verify_features

    if actions and actions[0] == "verify":
        ec.verify = actions[1] if len(actions) > 1 else ec.verify or ec.out
    elif actions:
        raise ValueError(f"unknown action {actions[0]!r}; usage: eyas extract [--verify FEAT] [--mode ...]")
    if ec.verify:
        print(json.dumps(verify_features(ec.verify), indent=2))
        return 0
    check_choices(ec, "extract")
    if ec.mode == "offline":
        print(extract(ec))
        return 0
    if ec.mode == "online":
        _log("online mode writes nothing: the trainer calls make_extractor(...).extract(batch) per step "
             "(train.source=online)")
        return 0
    from eyas.extract.stream import run_producer

    return run_producer(ec)
