"""Process group, device and FSDP2 for the draft (torchtitan's `parallelize`, cut to size).

Under `torchrun` the environment names the world; a plain `python -m eyas train` starts a
world of one (in-process store) so the same DCP checkpoints and collectives run everywhere; the draft is
sharded with FSDP2 over 2+ ranks (`shards`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Dist:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    backend: str
    owns_group: bool  # we created the process group (destroy it at the end)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(timeout_s: int = 7200) -> Dist:
    """torchrun's world, or a world of one; nccl on CUDA, gloo on CPU."""
    cuda = torch.cuda.is_available()
    if not dist.is_initialized():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if cuda:
            torch.cuda.set_device(local_rank)
        backend = "nccl" if cuda else "gloo"
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
            dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
        else:  # a world of one, in-process store: no port, no environment changes
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                    timeout=timedelta(seconds=timeout_s))
        owns = True
    else:
        owns = False
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    return Dist(dist.get_rank(), dist.get_world_size(), local_rank, device, dist.get_backend(), owns)


def destroy(d: Dist) -> None:
    if d.owns_group and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def broadcast_object(obj, d: Dist):
    if d.world == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def resolve_precision(precision: str, device: torch.device) -> str:
    """auto: bf16 compute where the device has fast bf16 (CUDA; CPUs with AVX512-BF16 / AMX), else fp32."""
    if precision not in ("auto", "bf16", "fp32"):
        raise ValueError(f"train.precision must be auto | bf16 | fp32, got {precision!r}")
    if precision == "auto":
        if device.type == "cuda":
            return "bf16" if torch.cuda.is_bf16_supported() else "fp32"
        return "bf16" if device.type == "cpu" and torch.backends.mkldnn.is_available() and _cpu_has_bf16() else "fp32"
    return precision


def _cpu_has_bf16() -> bool:
    """Native bf16 matmul on this CPU (oneDNN's own check), measured faster than fp32 here."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def shards(d: Dist, fsdp: str = "auto") -> bool:
    """Whether the draft is wrapped in FSDP2: over 2+ ranks, or on one with `train.fsdp: always`. A world
    of one trains the bare module (bf16 through autocast): FSDP2's DTensor bookkeeping cost the demo
    trainer 1.10x in tokens/s on a 2-core CPU, and DCP checkpoints load either way (any world, either
    path). `fsdp` is checked with the train section (`check_choices`)."""
    return d.world > 1 or fsdp == "always"


def apply_fsdp(model: torch.nn.Module, d: Dist, precision: str) -> torch.nn.Module:
    """Shard the draft over every rank (one FSDP2 group: the head is one layer).

    Parameters stay fp32 (the optimizer's master weights); with bf16 they are cast for
    compute and gradients are reduced in fp32 (MixedPrecisionPolicy)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(d.device.type, (d.world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if precision == "bf16" else None
    kw = {"mp_policy": mp} if mp is not None else {}
    fully_shard(model, mesh=mesh, reshard_after_forward=True, **kw)
    return model
