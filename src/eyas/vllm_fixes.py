"""What eyas tells vLLM about a target wherever it builds an engine (synthesis, extraction, serve-eval,
eval, benches): the options the target's architecture needs, and workarounds for defects of vLLM's
CPU build, each named with the vLLM version it was seen in and pinned by tests in
tests/test_targets.py that fail when the defect is gone (drop the workaround) or when the
workaround stops working.

    engine_options(target)    keywords for `vllm.LLM(...)` (and `engine_cli_args` for `vllm serve`)
    register()                the `vllm.general_plugins` entry point: runs in every vLLM process

Workarounds (CPU only; GPUs run these architectures natively):

    MLA_ROPE        vLLM 0.32.0 CPU: the `_C.rotary_embedding` kernel treats every head of the 3-D
                    strided q_pe / k_pe views that MLA attention (DeepSeek-V3, Kimi-K2.5) hands it as a
                    token, so a default-rope MLA target decodes wrong from its first token. Fix: the
                    op's native PyTorch path, `compilation_config.custom_ops = ["-rotary_embedding"]`.
                    (A yarn rope, as the released DeepSeek-V3 / Kimi use, already runs natively.)
    SIGMOID_ROUTER  vLLM 0.32.0 CPU: `CPURouter._compute_routing` asserts softmax scoring, so
                    MiniMax-M2 (sigmoid scores + a correction bias, no groups) cannot start. Fix: route
                    it with vLLM's own CPU `_grouped_topk` over one group, which is the math of
                    `fused_topk_bias` on GPUs and of transformers' MiniMaxM2TopKRouter. vLLM forces
                    `spawn` for its CPU workers, so the patch is loaded through vLLM's plugin entry
                    point (pyproject: `vllm.general_plugins`), in every process vLLM starts.
    GPTOSS_QUARK_SWIGLU  vLLM 0.32.0 CPU: gpt-oss's experts layer is built without its swiglu alpha /
                    limit, and the Quark OCP-MX MoE method passes those Nones to the CPU MXFP4 kernel,
                    which then runs plain SiLU on split halves instead of gpt-oss's clamped, interleaved
                    activation: a Quark MXFP4 gpt-oss decodes wrong (its features ~100% off the
                    dequantized copy's). Fix (the same plugin): the method fills in gpt-oss's constants
                    (alpha 1.702, beta 1.0, limit 7.0, what vLLM's own gpt-oss MXFP4 method hardcodes).

    SPEC_SAMPLING_EXPAND  vLLM 0.32.0 CPU: speculative decoding with temperature > 0 samples from
                    garbage. The rejection sampler spreads each request's temperature (and top-k / top-p)
                    over its draft positions with `expand_batch_to_tokens`, whose CPU kernel override
                    (`cpu_triton_utils._expand_kernel_impl`) casts the float32 output to an int64 copy,
                    writes the copy and drops it: the target's logits are divided by uninitialized memory
                    (NaN, 0 or huge), so drafts are rejected and "recovered" tokens drawn from nonsense
                    (n-gram at temperature 1 on a two-token target: 1 in 4 tokens outside the two).
                    Greedy decoding never calls it. Fix (the plugin): the same expansion in PyTorch
                    (`repeat_interleave`), for every dtype.

A limit with no workaround (eyas stops with `DraftNotServable` before vLLM starts; EYAS_VLLM_FIXES=0
lets vLLM try, which is how tests/test_targets.py shows the limit is still there):

    MLA_DRAFT_BLOCKS  vLLM 0.32.0 CPU without AMX (AMD EPYC, ARM): an MLA target's attention runs
                    CPU_MLA, whose decode kernel takes 16-token KV blocks only, and the EAGLE-3 draft's
                    attention runs CPU_ATTN, which takes multiples of 32; target and draft share one KV
                    cache group, so the engine cannot start ("No common block size for 16 (CPU_MLA:
                    [16]; CPU_ATTN: [MultipleOf(32)])"). With AMX, MLA runs AMX_MLA (multiples of 32)
                    and the draft serves. Extraction, training, export and n-gram speculation run anywhere.

Options, off unless asked (`run.trust_remote_code`, `run.language_model_only`, which `eyas run`
and every stage pass on through EYAS_TRUST_REMOTE_CODE / EYAS_LANGUAGE_MODEL_ONLY):

    trust_remote_code      only for a checkpoint whose code is not in transformers / vLLM
    language_model_only    a multimodal wrapper (Kimi-K2.5) served text-only: vLLM builds no vision
                           tower and loads none of its weights; eyas sends no images
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

SEEN_IN = "0.32.0"  # the vLLM version the CPU defects below were measured in
ENV_TRUST = "EYAS_TRUST_REMOTE_CODE"
ENV_LM_ONLY = "EYAS_LANGUAGE_MODEL_ONLY"


def _flag(name: str) -> bool:
    return os.environ.get(name, "").lower() in ("1", "true", "yes")


def set_target_options(trust_remote_code: bool, language_model_only: bool) -> None:
    """Hand the run's target options to every engine eyas starts, in this process and its children."""
    os.environ[ENV_TRUST] = "1" if trust_remote_code else "0"
    os.environ[ENV_LM_ONLY] = "1" if language_model_only else "0"


def trust_remote_code() -> bool:
    """The run's `run.trust_remote_code` (False unless asked), for the HF loaders too."""
    return _flag(ENV_TRUST)


def _config(target: str | os.PathLike) -> dict[str, Any]:
    try:
        return json.loads((Path(target) / "config.json").read_text())
    except (OSError, ValueError):
        return {}  # not a local dir (a hub name vLLM resolves itself): no fixes known


def is_multimodal(cfg: dict[str, Any]) -> bool:
    return "text_config" in cfg and any(k in cfg for k in ("vision_config", "audio_config"))


def is_mla(cfg: dict[str, Any]) -> bool:
    return bool((cfg.get("text_config") or cfg).get("kv_lora_rank"))


def fixes_on() -> bool:
    """`EYAS_VLLM_FIXES=0` turns every workaround off (the tests that show a defect is still there)."""
    return os.environ.get("EYAS_VLLM_FIXES", "1") != "0"


@functools.lru_cache(maxsize=1)
def on_cpu() -> bool:
    import torch

    return not (torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available()))


def cpu_workarounds(target: str | os.PathLike, cpu: bool | None = None) -> list[str]:
    """The names of the workarounds `engine_options` applies for `target` (on vLLM CPU; None: this machine)."""
    if not fixes_on() or not (on_cpu() if cpu is None else cpu):
        return []
    return ["MLA_ROPE"] if is_mla(_config(target)) else []


class DraftNotServable(RuntimeError):
    """vLLM on this machine cannot serve an EAGLE-3 draft with this target (a named limit above)."""


def draft_limit(target: str | os.PathLike, cpu: bool | None = None) -> str | None:
    """Why vLLM here cannot serve an EAGLE-3 draft beside `target` (None: it can)."""
    if not fixes_on() or not (on_cpu() if cpu is None else cpu) or not is_mla(_config(target)):
        return None
    import torch

    if torch.cpu._is_amx_tile_supported():  # vLLM's own test for AMX_MLA (platforms/cpu.py)
        return None
    return (f"MLA_DRAFT_BLOCKS: vLLM CPU cannot serve an EAGLE-3 draft beside the MLA target {target} on a "
            "CPU without AMX (its MLA kernel takes 16-token KV blocks, the draft's attention multiples of 32). "
            "Serve it on a GPU or an AMX CPU (Intel Sapphire Rapids or later), or measure the n-gram "
            "baseline (draft=ngram) here; extraction, training and export run on this machine.")


def engine_options(target: str | os.PathLike, cpu: bool | None = None) -> dict[str, Any]:
    """Keywords for `vllm.LLM(model=target, ...)`: the target options asked for and the CPU workarounds
    (`cpu`: for vLLM CPU or not; None: this machine)."""
    cfg = _config(target)
    kw: dict[str, Any] = {}
    if trust_remote_code():
        kw["trust_remote_code"] = True
    if _flag(ENV_LM_ONLY) and is_multimodal(cfg):
        kw["language_model_only"] = True
    if "MLA_ROPE" in cpu_workarounds(target, cpu):
        kw["compilation_config"] = {"custom_ops": ["-rotary_embedding"]}
    return kw


def engine_cli_args(target: str | os.PathLike, cpu: bool | None = None) -> list[str]:
    """`engine_options` as `vllm serve` / api_server flags."""
    args: list[str] = []
    for k, v in engine_options(target, cpu).items():
        flag = "--" + k.replace("_", "-")
        args += [flag] if v is True else [flag, json.dumps(v)]
    return args


# ---------------------------------------------------------------- SIGMOID_ROUTER (a vLLM plugin)

def _sigmoid_routing(orig):
    """CPURouter._compute_routing that routes sigmoid scoring (+ correction bias, one group) with vLLM's
    own CPU `_grouped_topk` and leaves every other router to `orig`."""
    from vllm.model_executor.layers.fused_moe.router import cpu_router

    def compute_routing(self, hidden_states, router_logits, indices_type, **kw):
        if (self.scoring_func != "sigmoid" or getattr(self, "use_grouped_topk", False)
                or getattr(self, "custom_routing_function", None) is not None):
            return orig(self, hidden_states, router_logits, indices_type, **kw)
        # router_logits [T, E] -> weights [T, top_k] (float32), ids [T, top_k] (int32)
        return cpu_router._grouped_topk(router_logits, self.top_k, self.renormalize, 1, 1, "sigmoid",
                                        self.routed_scaling_factor, self.e_score_correction_bias)

    compute_routing.eyas_fix = "SIGMOID_ROUTER"
    compute_routing.eyas_original = orig
    return compute_routing


GPTOSS_SWIGLU = {"swiglu_alpha": 1.702, "swiglu_beta": 1.0, "swiglu_limit": 7.0}


def _quark_swiglu(orig):
    """QuarkOCP_MX_MoEMethod.get_fused_moe_quant_config that gives a swigluoai (gpt-oss) layer without
    its constants gpt-oss's before building the kernel's config."""

    def get_fused_moe_quant_config(self, layer):
        act = getattr(layer, "activation", None)
        if str(getattr(act, "value", act)) == "swigluoai" and getattr(layer, "swiglu_alpha", None) is None:
            for k, v in GPTOSS_SWIGLU.items():
                setattr(layer, k, v)
        return orig(self, layer)

    get_fused_moe_quant_config.eyas_fix = "GPTOSS_QUARK_SWIGLU"
    get_fused_moe_quant_config.eyas_original = orig
    return get_fused_moe_quant_config


def expand_batch_to_tokens(x: Any, cu_num_tokens: Any, num_tokens: int, replace_from: int = 0,
                           replace_to: int = 0) -> Any:
    """vLLM's `rejection_sampler.expand_batch_to_tokens` in PyTorch (SPEC_SAMPLING_EXPAND): x [batch_size]
    -> [num_tokens], request i's value (replace_from replaced by replace_to) repeated for its
    cu_num_tokens[i] - cu_num_tokens[i - 1] draft positions."""
    import torch

    cu = cu_num_tokens.to(torch.int64)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    x = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
    return x.repeat_interleave(counts, output_size=num_tokens)


expand_batch_to_tokens.eyas_fix = "SPEC_SAMPLING_EXPAND"


def register() -> None:
    """vLLM general plugin (runs in the frontend, the engine core and each worker): on CPU, route
    sigmoid-scored MoE layers, give Quark MXFP4 gpt-oss experts their activation constants and expand
    sampling parameters over draft positions in PyTorch.
    Idempotent; off with `EYAS_VLLM_FIXES=0`."""
    if not fixes_on() or not on_cpu():
        return
    try:
        from vllm.model_executor.layers.fused_moe.router import cpu_router
        from vllm.model_executor.layers.quantization.quark import quark_moe
    except ImportError:  # another vLLM layout: nothing to patch
        return
    try:
        from vllm.v1.sample import rejection_sampler
    except ImportError:
        rejection_sampler = None
    cur = getattr(rejection_sampler, "expand_batch_to_tokens", None)
    if cur is not None and getattr(cur, "eyas_fix", None) != "SPEC_SAMPLING_EXPAND":
        expand_batch_to_tokens.eyas_original = cur
        rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens
    cur = cpu_router.CPURouter._compute_routing
    if getattr(cur, "eyas_fix", None) != "SIGMOID_ROUTER":
        cpu_router.CPURouter._compute_routing = _sigmoid_routing(cur)
    cls = quark_moe.QuarkOCP_MX_MoEMethod
    if getattr(cls.get_fused_moe_quant_config, "eyas_fix", None) != "GPTOSS_QUARK_SWIGLU":
        cls.get_fused_moe_quant_config = _quark_swiglu(cls.get_fused_moe_quant_config)
