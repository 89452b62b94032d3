"""A training run's checkpoints by name: where they live, which is `latest`, which is `best`,
and the draft weights inside one. The trainer writes them (`eyas.train.checkpoint`); export,
serve-eval and the report read them here.

    RUN/checkpoints/step_N/      one complete checkpoint (trainer.json written last)
    RUN/checkpoints/latest       a file naming the newest complete one ("step_N")
    RUN/checkpoints/best         a relative symlink to the checkpoint with the highest true AL
    RUN/checkpoints/best.json    that checkpoint's serve-eval record

`best` is the pointer a validator's number moves (`mark_best`); when no serve-eval ran,
`resolve_checkpoint(run, "best")` says so and takes `latest`.

Nothing here unpickles. A checkpoint's draft weights are read from its `draft.safetensors`;
its DCP part (resume state, whose reader unpickles `dcp/.metadata`) is loaded only when
`dcp.sig` holds an HMAC of every file under `dcp/` made with this user's key
(`$EYAS_HOME/checkpoint.key`, created 0600 on first use), i.e. when eyas wrote it here;
another's run dir needs the user's explicit trust (`train.trust_checkpoint`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import sys
from pathlib import Path
from typing import Any

from eyas.io import atomic_write_text, load_safetensors, read_json, remove_temp_files

CKPT_DIR = "checkpoints"
LATEST = "latest"
BEST = "best"
WEIGHTS = "draft.safetensors"
SIGNATURE = "dcp.sig"


def checkpoints_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / CKPT_DIR


def step_name(step: int) -> str:
    return f"step_{step}"


def is_complete(ckpt: Path) -> bool:
    return (ckpt / "trainer.json").exists()


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The checkpoint `latest` names, or the highest complete step_N, or None."""
    ck = checkpoints_dir(run_dir)
    p = ck / LATEST
    if p.is_file():
        cand = ck / p.read_text().strip()
        if is_complete(cand):
            return cand
    steps = sorted((int(d.name[5:]), d) for d in ck.glob("step_*") if d.name[5:].isdigit() and is_complete(d))
    return steps[-1][1] if steps else None


def checkpoint_step(ckpt: Path) -> int:
    """The step a complete checkpoint holds (its trainer.json). A damaged one is a ValueError naming
    it and the previous intact checkpoint, to move it aside and resume from that one."""
    try:
        return int(read_json(ckpt / "trainer.json", "the checkpoint's state")["step"])
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"checkpoint {ckpt} is damaged ({e}): {previous_hint(ckpt)}") from None


def previous_hint(ckpt: Path) -> str:
    """What to do about a damaged checkpoint: move it aside to resume from the previous intact one."""
    earlier = sorted((int(d.name[5:]), d) for d in ckpt.parent.glob("step_*")
                     if d.name[5:].isdigit() and d != ckpt and is_complete(d))
    intact = [d for n, d in earlier if n < _step_of(ckpt) and _readable(d / "trainer.json")]
    return (f"move {ckpt} out of {ckpt.parent} to resume from the previous intact checkpoint, {intact[-1].name}"
            if intact else "no earlier checkpoint is intact; choose another --out")


def _step_of(ckpt: Path) -> int:
    return int(ckpt.name[5:]) if ckpt.name[5:].isdigit() else 1 << 62


def _readable(p: Path) -> bool:
    try:
        return "step" in read_json(p)
    except ValueError:
        return False


def mark_latest(run_dir: str | os.PathLike, ckpt: Path) -> None:
    atomic_write_text(checkpoints_dir(run_dir) / LATEST, ckpt.name + "\n")


def repair_latest(run_dir: str | os.PathLike, ckpt: Path) -> None:
    """After a kill: `latest` names `ckpt`, the checkpoint a run resumes from (a kill between a
    checkpoint's rename and its `latest` write left `latest` on the one before, or absent), and no
    temp file of a killed `latest` / `best` write is left beside it."""
    ck = checkpoints_dir(run_dir)
    remove_temp_files(ck)  # `latest`, `best`, best.json
    p = ck / LATEST
    if not (p.is_file() and p.read_text().strip() == ckpt.name):
        mark_latest(run_dir, ckpt)


def resolve_checkpoint(run_dir: str | os.PathLike, which: str) -> Path:
    """RUN/checkpoints/{best,latest,step_N,N}: a dir, a symlink, or a file holding a dir name."""
    ck = checkpoints_dir(run_dir)
    if not ck.is_dir():
        raise ValueError(f"{run_dir}: no {CKPT_DIR}/ directory (is this a training run dir?)")
    if which.isdigit():
        which = step_name(int(which))

    def follow(p: Path) -> Path | None:
        if p.is_dir():
            return p.resolve()
        for cand in (p, p.with_suffix(".json")):
            if cand.is_file():
                text = cand.read_text().strip()
                if cand.suffix == ".json":
                    text = str(json.loads(text).get("checkpoint", ""))
                q = Path(text) if Path(text).is_absolute() else ck / text
                if text and q.is_dir():
                    return q.resolve()
        return None

    got = follow(ck / which)
    if got is None and which == BEST:
        got = follow(ck / LATEST)
        if got is not None:
            print(f"eyas: {ck}: no {BEST} (no serve-eval ran); using {LATEST} = {got.name}", file=sys.stderr)
    if got is None:
        have = sorted(p.name for p in ck.iterdir())
        raise ValueError(f"{ck}: no checkpoint {which!r}; available: {', '.join(have) or 'none'}")
    return got


def best_record(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    p = checkpoints_dir(run_dir) / f"{BEST}.json"
    return json.loads(p.read_text()) if p.exists() else None


def mark_best(run_dir: str | os.PathLike, ckpt_dir: Path, record: dict[str, Any]) -> None:
    """Point `checkpoints/best` at `ckpt_dir` (relative symlink, replaced atomically) and write best.json."""
    ck = checkpoints_dir(run_dir)
    ck.mkdir(parents=True, exist_ok=True)
    link = ck / BEST
    if link.exists() and not link.is_symlink():
        raise RuntimeError(f"{link} exists and is not a symlink; refusing to replace it")
    rel = os.path.relpath(Path(ckpt_dir).resolve(), ck.resolve())
    tmp = ck / f".{BEST}.tmp.{os.getpid()}"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(rel, tmp)
    os.replace(tmp, link)
    atomic_write_text(ck / f"{BEST}.json", json.dumps({**record, "checkpoint": rel}, indent=2) + "\n")


def load_draft_state(ckpt_dir: str | os.PathLike):
    """(state_dict full on CPU with vLLM's names incl. d2t / t2d / embed_tokens, meta from draft.json),
    from the checkpoint's `draft.safetensors` (nothing is unpickled; no collectives, so one rank
    may call it while the others wait). Every tensor the draft config implies must be there."""
    import torch

    from eyas.draft.model import Eagle3Draft
    from eyas.draft.spec import DraftSpec

    ckpt_dir = Path(ckpt_dir)
    meta_path, wfile = ckpt_dir / "draft.json", ckpt_dir / WEIGHTS
    if not meta_path.exists():
        raise ValueError(f"{ckpt_dir}: no draft.json (not an eyas training checkpoint, or an unfinished one)")
    if not wfile.exists():
        raise ValueError(f"{ckpt_dir}: no {WEIGHTS} (a checkpoint from before eyas wrote one); continue the run "
                         "one step with `eyas train --resume` (add train.trust_checkpoint=true if eyas did not "
                         "write it on this machine) and read that step")
    try:
        meta = json.loads(meta_path.read_text())
        spec = DraftSpec.from_draft_config(meta["draft_config"])
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{meta_path}: not a draft.json eyas wrote ({type(e).__name__}: {e})") from None
    state = load_safetensors(wfile, "use an earlier checkpoint of the run")
    with torch.device("meta"):
        want = Eagle3Draft(spec).state_dict()
    bad = [n for n, t in want.items() if n not in state or tuple(state[n].shape) != tuple(t.shape)]
    if bad:
        raise ValueError(f"{wfile}: missing or misshapen for its draft.json: {', '.join(bad[:5])}")
    return {n: state[n] for n in want}, meta


def _key() -> bytes:
    """This user's checkpoint key (32 random bytes, 0600), made on first use."""
    from eyas.models import eyas_home

    path = eyas_home() / "checkpoint.key"
    if not path.exists():  # made whole under a temp name, then linked into place: never seen empty
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(os.urandom(32))
                f.flush()
                os.fsync(f.fileno())
            os.link(tmp, path)
        except FileExistsError:
            pass  # another process linked its key first: use that one
        finally:
            tmp.unlink(missing_ok=True)
    key = path.read_bytes()
    if len(key) != 32:
        raise ValueError(f"{path}: a checkpoint key is 32 bytes, this one {len(key)}; remove it (checkpoints signed "
                         "with it then need train.trust_checkpoint=true)")
    return key


def dcp_digest(ckpt_dir: str | os.PathLike) -> str:
    """HMAC-SHA256, with this user's key, of every file's name and bytes under CKPT/dcp/."""
    root = Path(ckpt_dir) / "dcp"
    mac = hmac.new(_key(), digestmod=hashlib.sha256)
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        mac.update(str(f.relative_to(root)).encode() + b"\0")
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                mac.update(chunk)
        mac.update(b"\0")
    return mac.hexdigest()


def sign_dcp(ckpt_dir: str | os.PathLike) -> None:
    (Path(ckpt_dir) / SIGNATURE).write_text(dcp_digest(ckpt_dir) + "\n")


def check_dcp(ckpt_dir: str | os.PathLike, trust: bool = False) -> None:
    """Refuse to unpickle a DCP checkpoint eyas did not write here, unless `trust`."""
    if trust:
        return
    sig = Path(ckpt_dir) / SIGNATURE
    if sig.exists() and hmac.compare_digest(sig.read_text().strip(), dcp_digest(ckpt_dir)):
        return
    if sig.exists():
        raise ValueError(f"{ckpt_dir}: not loading its DCP state: its files differ from what eyas signed when it "
                         f"wrote them (damaged or edited; reading DCP unpickles them, which can run code); "
                         f"{previous_hint(Path(ckpt_dir))}, or if you know why they changed and trust them, pass "
                         "train.trust_checkpoint=true")
    raise ValueError(f"{ckpt_dir}: not loading its DCP state: it has no {SIGNATURE}, so eyas did not write it here "
                     "(another user or machine), and reading DCP unpickles its files (which can run code). If you "
                     "trust where it came from, pass train.trust_checkpoint=true")
