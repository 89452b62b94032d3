"""The vLLM backend: the `extract_hidden_states` speculative method + eyas' CPU-safe connector.

vLLM config (vLLM 0.32, read from `vllm/config/speculative.py` and
`vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py`):

    speculative_config = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                          "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": ids}}}
    kv_transfer_config = {"kv_connector": "EyasHiddenStatesConnector",
                          "kv_connector_module_path": "eyas.extract.connector", "kv_role": "kv_producer",
                          "kv_connector_extra_config": {"shared_storage_path": DIR}}

Each prompt runs with `max_tokens=1`; its prefill stacks the aux states of every prompt token
into a cache-only attention layer, and the connector writes them to
`DIR/<request>.safetensors` (`hidden_states` [T, n, H], `token_ids` [T]); the path comes back
in `RequestOutput.kv_transfer_params["hidden_states_path"]`. DIR is on tmpfs (/dev/shm) when
there is one, and every file is deleted as soon as it is read: nothing reaches the disk.

The final normed state is not exposed by the hook: vLLM's aux id k is the residual stream
after k layers (`hidden_states + residual`, taken *before* the final norm), and id L (after the
last layer) is accepted. So we also request id L, and apply the target's own final norm module
(built from its HF class, loaded with its checkpoint weights) in fp32 to get
`last_hidden_states` = HF `hidden_states[L]`. vLLM sorts and deduplicates the ids; columns are
mapped back by id.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from eyas.children import scratch_prefix
from eyas.extract.base import Extractor
from eyas.host import apply_vllm_env
from eyas.target import language_model_prefix, load_language_model, read_tensor, text_config, weight_map
from eyas.vllm_fixes import engine_options

CONNECTOR = "EyasHiddenStatesConnector"
CONNECTOR_MODULE = "eyas.extract.connector"


def vllm_cpu_unsupported_reason(target: str | os.PathLike) -> str | None:
    """Why vLLM's CPU attention cannot run `target` (head size), or None when it can / not on CPU."""
    try:
        from vllm.platforms import current_platform
        if not current_platform.is_cpu():
            return None
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
        sizes = CPUAttentionBackend.get_supported_head_sizes()
    except Exception:  # noqa: BLE001 - an older/newer layout: let vLLM decide
        return None
    cfg = text_config(target)
    head = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if head not in sizes:
        return f"vLLM CPU attention supports head sizes {sizes}; {Path(target).name} has head_dim {head}"
    return None


def load_final_norm(target: str | os.PathLike) -> torch.nn.Module:
    """The target's final norm (HF class, checkpoint weights), fp32, without loading the model."""
    from eyas.extract.hf import decoder_layers

    model = load_language_model(target, torch.float32, meta=True)
    decoder, _ = decoder_layers(model)
    norm = getattr(decoder, "norm", None)
    if norm is None:
        raise ValueError(f"{target}: the decoder has no final `norm`; cannot derive last_hidden_states from vLLM")
    prefix = next(name for name, mod in model.named_modules() if mod is norm)
    where = weight_map(target)
    prefix = language_model_prefix(target, where) + prefix  # `language_model.` in a multimodal checkpoint
    state = {}
    for pname, _ in norm.named_parameters():
        key = f"{prefix}.{pname}"
        if key not in where:
            raise ValueError(f"{target}: checkpoint tensor {key!r} not found; cannot load the final norm")
        state[pname] = read_tensor(target, key, where)
    norm = norm.to_empty(device="cpu")
    norm.load_state_dict(state, strict=False)
    return norm.float().eval()


def _tmpfs_dir() -> str:
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    return tempfile.mkdtemp(prefix=scratch_prefix("hs"), dir=base)  # the watchdog removes it after a kill


def _load_when_ready(path: str, timeout: float) -> dict[str, torch.Tensor]:
    """Wait for the connector to release the file's lock (writes finish one engine step after
    the request), read it, delete it. Bounded: a dead engine is an error, not a hang."""
    from safetensors.torch import load_file

    lock = path + ".lock"
    deadline = time.monotonic() + timeout
    while True:
        if os.path.exists(lock):
            with open(lock) as lf:
                try:
                    fcntl.flock(lf, fcntl.LOCK_SH | fcntl.LOCK_NB)
                except BlockingIOError:
                    pass
                else:
                    if os.path.exists(path):
                        data = load_file(path, device="cpu")
                        break
        elif os.path.exists(path):  # written without a lock file
            data = load_file(path, device="cpu")
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"vLLM did not write hidden states {path} within {timeout:.0f}s (engine dead?)")
        time.sleep(0.005)
    for p in (path, lock):
        try:
            os.remove(p)
        except FileNotFoundError:
            pass
    return data


class VLLMExtractor(Extractor):
    backend = "vllm"

    def __init__(self, target: str | os.PathLike, layer_ids: list[int] | None = None, *, max_len: int = 2048,
                 chat_template: str = "", kv_cache_gib: float = 1.0, out_dtype: Any = None,
                 enforce_eager: bool = True, read_timeout: float = 120.0, dtype: str = "bfloat16",
                 **llm_kwargs: Any):
        super().__init__(target, layer_ids, max_len=max_len, chat_template=chat_template, out_dtype=out_dtype)
        reason = vllm_cpu_unsupported_reason(self.target)
        if reason:
            raise ValueError(f"the vllm backend cannot run this target: {reason}; use --backend hf")
        from vllm import LLM, SamplingParams

        # ids vLLM captures: the wanted ones plus L (pre-norm final state), ascending
        self.vllm_ids = sorted(set(self.layer_ids) | {self.num_layers})
        self._cols = [self.vllm_ids.index(k) for k in self.layer_ids]
        self._last_col = self.vllm_ids.index(self.num_layers)
        self.norm = load_final_norm(self.target)
        self.read_timeout = read_timeout
        self.store = _tmpfs_dir()
        apply_vllm_env()
        if "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, int(kv_cache_gib)))
        self.llm = LLM(
            model=str(self.target),
            dtype=dtype,
            max_model_len=max_len + 1,  # the prompt + the one sampled token
            enable_prefix_caching=False,  # every prompt token must run through the layers
            enforce_eager=enforce_eager,  # no torch.compile warmup (minutes on CPU)
            disable_log_stats=True,
            speculative_config={
                "method": "extract_hidden_states",
                "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": self.vllm_ids}},
            },
            kv_transfer_config={
                "kv_connector": CONNECTOR,
                "kv_connector_module_path": CONNECTOR_MODULE,
                "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": self.store},
            },
            **{**engine_options(self.target), **llm_kwargs},
        )
        self._params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)

    def _forward(self, input_ids: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        prompts = [{"prompt_token_ids": x.tolist()} for x in input_ids]
        outs = self.llm.generate(prompts, self._params, use_tqdm=False)
        result = []
        for x, o in zip(input_ids, outs, strict=True):
            params = o.kv_transfer_params or {}
            if "hidden_states_path" not in params:
                raise RuntimeError(f"vLLM returned no hidden_states_path for request {o.request_id} "
                                   f"(kv_transfer_params={params}); is the connector configured?")
            data = _load_when_ready(params["hidden_states_path"], self.read_timeout)
            hs, tok = data["hidden_states"], data["token_ids"]  # [T, len(vllm_ids), H], [T]
            if tok.shape[0] != x.shape[0] or not torch.equal(tok.to(torch.int64), x):
                raise RuntimeError(f"vLLM hidden states for request {o.request_id} belong to other tokens")
            assert hs.shape == (x.shape[0], len(self.vllm_ids), self.hidden_size), hs.shape
            with torch.no_grad():
                last = self.norm(hs[:, self._last_col].float())  # [T, H], = HF hidden_states[L]
            result.append((hs[:, self._cols].to(self.out_dtype), last.to(self.out_dtype)))
        return result

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:  # noqa: BLE001 - best effort on teardown
                pass
            self.llm = None
        if getattr(self, "store", ""):
            shutil.rmtree(self.store, ignore_errors=True)
            self.store = ""

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter teardown
            pass
