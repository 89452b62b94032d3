"""One command for a GPU machine without vLLM (#32): the target (made from its GGUF where one is given),
on-policy synthesis with the hf engine, extraction, training and export, each timed inside one
wall-clock budget, packed for the trip back. The same eyas code the CPU tests run; `--device`
is the only switch.

    python scripts/gpu_scale.py --gguf .gpu/smollm2.gguf --prompts .gpu/prompts.jsonl.gz \\
        --out runs/gpu --budget-s 420 --pack "$OUT"
    # in miniature on a CPU (the rehearsal):
    python scripts/gpu_scale.py --target TINY_DIR --prompts PROMPTS.jsonl --out /tmp/g --device cpu \\
        --budget-s 120 --batch 8 --max-tokens 16 --token-budget 512

Shares of the budget left after the target is made: synthesis `--synth-share` (it stops starting
batches when its share is spent: synth.max_seconds), extraction whatever it takes for the
conversations written, training the rest but `--reserve-s` (a probe of `--probe-steps` steps times a
step, then the run resumes to as many steps as fit, its cosine horizon set to them), export and pack
in the reserve. `timings.json` holds every stage's seconds and sizes.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from eyas.config import ExportConfig, ExtractConfig, SynthConfig, TrainConfig
from eyas.host import machine


def log(msg: str) -> None:
    print(f"gpu_scale: {msg}", file=sys.stderr, flush=True)


def prompts_file(path: Path, out: Path) -> Path:
    """A plain JSONL copy of `path` (gunzipped when it is .gz)."""
    if path.suffix != ".gz":
        return path
    dest = out / path.with_suffix("").name
    if not dest.exists():
        with gzip.open(path, "rb") as src, open(dest, "wb") as f:
            shutil.copyfileobj(src, f)
    return dest


def make_target(a: argparse.Namespace, out: Path) -> Path:
    if a.target:
        return Path(a.target)
    from eyas.models import convert_gguf

    dest = out / "target"
    if not (dest / "config.json").exists():
        convert_gguf(Path(a.gguf), dest)
    return dest


def train_steps(cfg: TrainConfig, seconds: float, probe: int) -> dict:
    """Train `probe` steps, time one, then resume to the steps that fit in `seconds` (at most cfg.max_steps)."""
    from eyas.train import train

    t0 = time.monotonic()
    train(TrainConfig(**{**cfg.__dict__, "max_steps": probe, "lr_decay_steps": cfg.max_steps}))
    per_step = (time.monotonic() - t0) / probe  # start-up included: an upper bound on a step
    fit = max(probe, min(cfg.max_steps, int((seconds - (time.monotonic() - t0)) / per_step) + probe))
    log(f"train: {per_step:.3f} s per step over the {probe}-step probe (start-up included): {fit} steps fit")
    summary = train(TrainConfig(**{**cfg.__dict__, "max_steps": fit, "lr_decay_steps": fit, "resume": True}))
    return {"steps": fit, "probe_s_per_step": per_step, "summary": {k: v for k, v in summary.items() if k != "last"}}


def pack(out: Path, dest: Path, part_mib: int = 15) -> list[str]:
    """The draft, every manifest, the metrics, the conversations and timings as one tar.gz, split in parts."""
    tar = out / "gpu_scale.tar.gz"
    with tarfile.open(tar, "w:gz") as t:
        for rel in ("timings.json", "draft", "synth/manifest.json", "synth/conversations.jsonl",
                    "features/manifest.json", "train/manifest.json", "train/metrics.jsonl"):
            if (out / rel).exists():
                t.add(out / rel, arcname=rel)
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run(["split", "-b", f"{part_mib}M", "-d", str(tar), str(dest / "gpu_scale.tar.gz.")], check=True)
    return sorted(p.name for p in dest.glob("gpu_scale.tar.gz.*"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", default="", help="the target as a GGUF file (converted here), or --target")
    ap.add_argument("--target", default="", help="an HF model dir")
    ap.add_argument("--prompts", required=True, help="prompts JSONL (.gz too): scripts/scale_prompts.py makes it")
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--budget-s", type=float, default=420)
    ap.add_argument("--synth-share", type=float, default=0.5, help="of the budget left once the target is made")
    ap.add_argument("--reserve-s", type=float, default=30, help="kept for export and packing")
    ap.add_argument("--dtype", default="fp32", help="synthesis dtype: the one the draft is served with (fp32)")
    ap.add_argument("--batch", type=int, default=512, help="sequences per generate call")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--max-steps", type=int, default=20000, help="training steps at most (time decides)")
    ap.add_argument("--probe-steps", type=int, default=20)
    ap.add_argument("--token-budget", type=int, default=16384, help="tokens per training step")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--draft-vocab-size", type=int, default=4096)
    ap.add_argument("--extract-batch-tokens", type=int, default=65536)
    ap.add_argument("--pack", default="", help="a dir for the packed results ($OUT on the device machine)")
    a = ap.parse_args()
    if bool(a.gguf) == bool(a.target):
        ap.error("give one of --gguf and --target")
    t_start = time.monotonic()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    timings: dict = {"machine": machine(), "args": vars(a)}

    def done(stage: str, t0: float, **extra) -> None:
        timings[stage] = {"seconds": round(time.monotonic() - t0, 1), **extra}
        (out / "timings.json").write_text(json.dumps(timings, indent=2) + "\n")
        log(f"{stage}: {timings[stage]}")

    t0 = time.monotonic()
    target = make_target(a, out)
    prompts = prompts_file(Path(a.prompts), out)
    done("target", t0, target=str(target))
    left = a.budget_s - (time.monotonic() - t_start)

    from eyas.synth import synthesize

    t0 = time.monotonic()
    s = SynthConfig(target=str(target), prompts=str(prompts), out=str(out / "synth"), engine="hf", dtype=a.dtype,
                    device=a.device, concurrency=a.batch, max_tokens=a.max_tokens, max_model_len=a.max_model_len,
                    max_seconds=a.synth_share * left)
    synthesize(s)
    sm = json.loads((out / "synth" / "manifest.json").read_text())
    done("synth", t0, **sm["counts"], tokens=sm["tokens"], tokens_per_s=sm["last_run"]["tokens_per_s"])

    from eyas.extract import extract

    t0 = time.monotonic()
    e = ExtractConfig(target=str(target), data=str(out / "synth" / "conversations.jsonl"), out=str(out / "features"),
                      backend="hf", device=a.device, compute_dtype="bf16" if a.device != "cpu" else "fp32",
                      batch_tokens=a.extract_batch_tokens, max_len=a.max_model_len, samples_per_shard=1024)
    extract(e)
    fm = json.loads((out / "features" / "manifest.json").read_text())
    done("extract", t0, samples=fm["num_samples"], tokens=fm["num_tokens"], bytes=fm["bytes"])

    t0 = time.monotonic()
    t = TrainConfig(target=str(target), features=str(out / "features"), out=str(out / "train"), optimizer="muon",
                    max_steps=a.max_steps, token_budget=a.token_budget, lr=a.lr, warmup_steps=max(a.probe_steps, 50),
                    draft_vocab_size=a.draft_vocab_size, ttt_steps=3, loss_tokens="all", save_every=10**9,
                    log_every=50, score_every=4, progress=False, max_len=a.max_model_len)
    left = a.budget_s - (time.monotonic() - t_start) - a.reserve_s
    done("train", t0, **train_steps(t, left, a.probe_steps))

    from eyas.export import export_run

    t0 = time.monotonic()
    draft = export_run(ExportConfig(run=str(out / "train"), out=str(out / "draft"), checkpoint="latest"), k=3,
                       verify=False)
    done("export", t0, draft=str(draft))
    timings["total_s"] = round(time.monotonic() - t_start, 1)
    (out / "timings.json").write_text(json.dumps(timings, indent=2) + "\n")
    if a.pack:
        log(f"packed: {pack(out, Path(a.pack))}")
    log(f"total {timings['total_s']} s of a {a.budget_s} s budget")


if __name__ == "__main__":
    main()
