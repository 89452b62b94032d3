"""Checkpoints: torch.distributed.checkpoint (DCP) shards, written atomically, resharded on load.

    RUN/checkpoints/step_N/
        dcp/                 model + optimizer, sharded (any world size can load it)
        trainer.json         step, data position (global), schedule, world size that wrote it
        rng/rank_R.pt        RNG states per rank
        draft.json           draft config.json dict, layer ids, draft vocab info, target path
    RUN/checkpoints/latest   the name of the newest complete checkpoint ("step_N")

Every rank writes its DCP shards into `.tmp_step_N/`; rank 0 adds the JSON files and
renames the directory, then updates `latest`, so a kill never leaves a checkpoint that
looks complete. `load_draft_state(ckpt)` reads the model back as full CPU tensors with
vLLM's names (what export needs), with or without a process group.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

from eyas.manifest import atomic_write_text

CKPT_DIR = "checkpoints"
LATEST = "latest"


def checkpoints_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / CKPT_DIR


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The checkpoint `latest` names, or the highest complete step_N, or None."""
    ck = checkpoints_dir(run_dir)
    p = ck / LATEST
    if p.is_file():
        cand = ck / p.read_text().strip()
        if (cand / "trainer.json").exists():
            return cand
    steps = sorted((int(d.name[5:]), d) for d in ck.glob("step_*") if d.name[5:].isdigit() and (d / "trainer.json").exists())
    return steps[-1][1] if steps else None


def _save_rng_state(path: Path) -> None:
    """This rank's torch / numpy / python (/ cuda) RNG states as safetensors (no pickle)."""
    import random

    import numpy as np
    from safetensors.torch import save_file

    name, keys, pos, has_gauss, gauss = np.random.get_state()
    tensors = {"torch": torch.get_rng_state(), "numpy_keys": torch.from_numpy(keys.astype(np.int64))}
    if torch.cuda.is_available():
        tensors["cuda"] = torch.cuda.get_rng_state()
    meta = {"python": random.getstate(), "numpy": [name, int(pos), int(has_gauss), float(gauss)]}
    save_file(tensors, str(path), metadata={"state": json.dumps(meta)})


def _load_rng_state(path: Path) -> None:
    import random

    import numpy as np
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        meta = json.loads(f.metadata()["state"])
        torch.set_rng_state(f.get_tensor("torch"))
        name, pos, has_gauss, gauss = meta["numpy"]
        np.random.set_state((name, f.get_tensor("numpy_keys").numpy().astype(np.uint32), pos, has_gauss, gauss))
        if "cuda" in f.keys() and torch.cuda.is_available():
            torch.cuda.set_rng_state(f.get_tensor("cuda"))
    version, state, py_gauss = meta["python"]
    random.setstate((version, tuple(state), py_gauss))


def save_checkpoint(
    run_dir: str | os.PathLike,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict[str, Any],
    draft_meta: dict[str, Any],
    rank: int,
    world: int,
) -> Path:
    """Collective: every rank calls it. Returns RUN/checkpoints/step_N."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    ck = checkpoints_dir(run_dir)
    final, tmp = ck / f"step_{step}", ck / f".tmp_step_{step}"
    if rank == 0:
        ck.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    if world > 1:
        dist.barrier()
    msd, osd = get_state_dict(model, optimizer)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp / "dcp"))
    (tmp / "rng").mkdir(exist_ok=True)
    _save_rng_state(tmp / "rng" / f"rank_{rank}.safetensors")
    if world > 1:
        dist.barrier()
    if rank == 0:
        (tmp / "trainer.json").write_text(json.dumps({**trainer_state, "step": step, "world_size": world}, indent=2) + "\n")
        (tmp / "draft.json").write_text(json.dumps({**draft_meta, "step": step}, indent=2, default=str) + "\n")
        if final.exists():  # a re-save of the same step (e.g. after a resume): replace it whole
            shutil.rmtree(final)
        os.replace(tmp, final)
        atomic_write_text(ck / LATEST, final.name + "\n")
    if world > 1:
        dist.barrier()
    return final


def load_checkpoint(
    ckpt_dir: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int
) -> dict[str, Any]:
    """Collective: load model + optimizer (resharded to this world) and return trainer.json."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    ckpt_dir = Path(ckpt_dir)
    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=str(ckpt_dir / "dcp"))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    trainer = json.loads((ckpt_dir / "trainer.json").read_text())
    rng = ckpt_dir / "rng" / f"rank_{rank}.safetensors"
    if rng.exists() and trainer.get("world_size") is not None:
        _load_rng_state(rng)
    return trainer


def load_draft_state(ckpt_dir: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(state_dict full on CPU with vLLM's names incl. d2t / t2d / embed_tokens, meta from draft.json).

    Reads only the model part of the DCP checkpoint, without collectives (safe to call on
    one rank while the others wait)."""
    import torch.distributed.checkpoint as dcp

    from eyas.draft.model import DraftSpec, Eagle3Draft

    ckpt_dir = Path(ckpt_dir)
    meta_path = ckpt_dir / "draft.json"
    if not meta_path.exists():
        raise ValueError(f"{ckpt_dir}: no draft.json (not an eyas training checkpoint, or an unfinished one)")
    meta = json.loads(meta_path.read_text())
    spec = DraftSpec.from_draft_config(meta["draft_config"])
    with torch.device("meta"):
        shell = Eagle3Draft(spec)
    state = {k: torch.empty(v.shape, dtype=v.dtype) for k, v in shell.state_dict().items()}
    with warnings.catch_warnings():  # "torch.distributed is disabled ... single process": that is the intent
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({"model": state}, checkpoint_id=str(ckpt_dir / "dcp"), no_dist=True)
    return state, meta
