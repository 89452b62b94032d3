"""A CPU-safe hidden-states KV connector for vLLM's `extract_hidden_states` method.

vLLM ships `ExampleHiddenStatesConnector`, whose write path uses CUDA streams, CUDA
events and pinned host memory: it cannot run on vLLM CPU. This subclass keeps the
whole protocol (scheduler side, lock files, `hidden_states_path` in the request's
`kv_transfer_params`) and replaces only the write: gather the request's slots from the
hidden-state cache and `save_file` them synchronously, then release the lock. On a GPU
the same class works too (the gather is moved to host memory before the write).

Load it with `kv_transfer_config={"kv_connector": "EyasHiddenStatesConnector",
"kv_connector_module_path": "eyas.extract.connector", "kv_role": "kv_producer", ...}`.
Files hold `hidden_states` [T, n_ids, H] (ids in ascending order) and `token_ids` [T].
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class _Done:
    """Stands in for the CUDA event the parent polls: the copy is already complete."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class EyasHiddenStatesConnector(ExampleHiddenStatesConnector):
    """`ExampleHiddenStatesConnector` with a synchronous, device-agnostic write path."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slot_mapping = (block_ids[:, None] * self._block_size + offsets[None, :]).flatten()
        num_tokens = pending.token_ids.shape[0]
        # [T, n_ids, H] gathered from the cache-only layer, copied off the cache now
        hidden = extract_from_kv_cache(self._kv_cache, slot_mapping.to(self._kv_cache.device), num_tokens)
        hidden = hidden.to("cpu", copy=True).contiguous()
        os.makedirs(os.path.dirname(pending.filename) or ".", exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        try:
            tmp = f"{pending.filename}.tmp"
            save_file({"hidden_states": hidden, "token_ids": pending.token_ids.clone()}, tmp)
            os.replace(tmp, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases LOCK_EX: readers blocked on LOCK_SH wake up
        self._req_copy_events[pending.req_id] = _Done()  # type: ignore[assignment]
