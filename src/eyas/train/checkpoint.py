"""Checkpoints: torch.distributed.checkpoint (DCP) shards, written atomically, resharded on load.

    RUN/checkpoints/step_N/
        dcp/                 model + optimizer, sharded (any world size can load it)
        trainer.json         step, data position (global), schedule, world size that wrote it
        dcp.sig              HMAC of dcp/ with this user's key: resume loads only what eyas wrote here
        draft.safetensors    the full draft state (vLLM's names): what export and serve-eval read
        rng/rank_R.safetensors  RNG states per rank
        draft.json           draft config.json dict, layer ids, draft vocab info, target path
    RUN/checkpoints/latest   the name of the newest complete checkpoint ("step_N"; names: eyas.checkpoints)

Every rank writes its DCP shards into `.tmp_step_N/`; rank 0 adds the JSON files and
renames the directory, then updates `latest`, so a kill never leaves a checkpoint that
looks complete. Readers (export, serve-eval) take the draft weights back from
`draft.safetensors` with `eyas.checkpoints.load_draft_state` (no pickle, no process group).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from eyas.checkpoints import WEIGHTS, check_dcp, checkpoints_dir, mark_latest, sign_dcp, step_name
from eyas.faults import failpoint
from eyas.io import open_safetensors, plain_mode, read_json, write_error


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
    with open_safetensors(path, "resume from an earlier checkpoint") as f:
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
    """Collective: every rank calls it. Returns RUN/checkpoints/step_N. A write that fails leaves no
    part of it behind and raises an OSError naming where (eyas.io.write_error)."""
    ck = checkpoints_dir(run_dir)
    final, tmp, old = ck / step_name(step), ck / f".tmp_{step_name(step)}", ck / f".old_{step_name(step)}"
    try:
        return _save(ck, final, tmp, old, step, model, optimizer, trainer_state, draft_meta, rank, world)
    except Exception as e:
        # a failed write (a full disk, a read-only dir): the checkpoints that were complete stay complete
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            if old.exists() and not final.exists():
                os.replace(old, final)  # the re-save that failed half way: the earlier save is back
            shutil.rmtree(old, ignore_errors=True)
        err = write_error(e, final)
        if err is not None and err is not e:
            raise err from None
        raise


def _save(ck: Path, final: Path, tmp: Path, old: Path, step: int, model: torch.nn.Module,
          optimizer: torch.optim.Optimizer, trainer_state: dict[str, Any], draft_meta: dict[str, Any], rank: int,
          world: int) -> Path:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict

    if rank == 0:
        ck.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    if world > 1:
        dist.barrier()
    msd, osd = get_state_dict(model, optimizer)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp / "dcp"))
    failpoint("checkpoint.dcp", tmp / "dcp")
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    (tmp / "rng").mkdir(exist_ok=True)
    _save_rng_state(tmp / "rng" / f"rank_{rank}.safetensors")
    if world > 1:
        dist.barrier()
    if rank == 0:
        save_file({n: t.detach().contiguous() for n, t in full.items()}, str(tmp / WEIGHTS),
                  metadata={"format": "pt", "step": str(step)})
        plain_mode(tmp / WEIGHTS)
        sign_dcp(tmp)
        (tmp / "trainer.json").write_text(json.dumps({**trainer_state, "step": step, "world_size": world}, indent=2) + "\n")
        (tmp / "draft.json").write_text(json.dumps({**draft_meta, "step": step}, indent=2, default=str) + "\n")
        if final.exists():  # a re-save of the same step (e.g. after a resume): swap it whole, then drop the old
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        failpoint("checkpoint.renamed", ck / "latest")
        mark_latest(ck.parent, final)
        shutil.rmtree(old, ignore_errors=True)
    if world > 1:
        dist.barrier()
    return final


def load_checkpoint(
    ckpt_dir: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int,
    trust: bool = False,
) -> dict[str, Any]:
    """Collective: load model + optimizer (resharded to this world) and return trainer.json. The DCP
    files are read only when eyas signed them here (`eyas.checkpoints.check_dcp`) or `trust`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    ckpt_dir = Path(ckpt_dir)
    check_dcp(ckpt_dir, trust)
    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=str(ckpt_dir / "dcp"))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    trainer = read_json(ckpt_dir / "trainer.json", "the checkpoint's state")
    rng = ckpt_dir / "rng" / f"rank_{rank}.safetensors"
    if rng.exists() and trainer.get("world_size") is not None:
        _load_rng_state(rng)
    return trainer
