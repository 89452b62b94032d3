"""Tiny random targets with a real tokenizer and chat template, for tests and quick benches.

One builder per architecture the seed's pipeline serves, each a few MB (hidden 64-128, 4 layers),
built from transformers' own config classes and saved as a served checkpoint would be:

    llama, qwen3              dense
    mixtral, qwen3_moe        MoE, per-expert 2-D weights, softmax router
    gpt_oss                   MoE, fused 3-D experts with biases, attention sinks, sliding window
    deepseek_v3               MLA attention (LoRA'd q, a 512 + 64 latent kv, interleaved rope on 64 of 96 q/k dims),
                              shared + routed experts, sigmoid router with a correction bias
    minimax_m2                MoE with a sigmoid router + bias, rope on half of each head, qk norm
    kimi_k25                  deepseek_v3 inside a multimodal wrapper (`text_config`, a vision
                              tower and projector), tensors named as the released checkpoint names them
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
ARCHS = ("llama", "qwen3", "mixtral", "qwen3_moe", "gpt_oss", "deepseek_v3", "minimax_m2", "kimi_k25")


def _deepseek_v3(hidden: int) -> dict[str, Any]:
    # vLLM CPU's MLA kernel compiles only for a latent of kv_lora_rank 512 + rope 64 (DeepSeek-V3's own)
    return dict(q_lora_rank=hidden // 2, kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64,
                v_head_dim=32, head_dim=64, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                moe_intermediate_size=hidden // 2, first_k_dense_replace=1, n_group=1, topk_group=1,
                num_key_value_heads=4, routed_scaling_factor=2.5,
                topk_method="noaux_tc", scoring_func="sigmoid")  # as the released config.json says (vLLM reads them)


def arch_config(arch: str, tok, num_layers: int = 4, hidden: int = 64) -> Any:
    """The transformers config of a tiny `arch` target over `tok`'s vocabulary."""
    from transformers import AutoConfig

    common: dict[str, Any] = dict(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=4096,
        rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    if arch in ("llama", "qwen3"):
        return AutoConfig.for_model(arch, **common)
    if arch == "mixtral":
        return AutoConfig.for_model("mixtral", num_local_experts=4, num_experts_per_tok=2, **common)
    if arch == "qwen3_moe":
        return AutoConfig.for_model("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden,
                                    decoder_sparse_step=1, **common)
    if arch == "gpt_oss":
        return AutoConfig.for_model(
            "gpt_oss", **{**common, "intermediate_size": hidden, "tie_word_embeddings": False}, num_local_experts=4,
            num_experts_per_tok=2, sliding_window=64,
            layer_types=["sliding_attention", "full_attention"] * (num_layers // 2),
        )
    if arch == "deepseek_v3":
        return AutoConfig.for_model("deepseek_v3", **{**common, **_deepseek_v3(hidden), "tie_word_embeddings": False})
    if arch == "minimax_m2":
        head_dim = hidden // 4
        return AutoConfig.for_model(
            "minimax_m2", **{**common, "intermediate_size": hidden, "tie_word_embeddings": False}, num_local_experts=4,
            num_experts_per_tok=2,
            rope_parameters={"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5},
            # what the released config.json says beside rope_parameters (vLLM reads these names)
            rotary_dim=head_dim // 2, scoring_func="sigmoid", use_routing_bias=True, use_qk_norm=True,
            qk_norm_type="per_layer",
        )
    if arch == "kimi_k25":
        text = {"model_type": "deepseek_v3", **common, **_deepseek_v3(hidden), "tie_word_embeddings": False}
        vision = dict(num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                      pos_emb_height=8, pos_emb_width=8)
        return AutoConfig.for_model("kimi_k25", text_config=text, vision_config=vision, projection_hidden_size=64,
                                    tie_word_embeddings=False, image_token_id=tok.unk_token_id or 0)
    raise ValueError(f"unknown tiny arch {arch!r}: {' | '.join(ARCHS)}")


def _peaked_init(model) -> None:
    """Larger-than-default init so the random target has peaked, varied outputs; random biases, sinks
    and router correction biases so a backend that drops one shows."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
            elif name.endswith("sinks") or name.endswith("bias"):
                p.normal_(0.0, 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)


def _save_kimi(cfg, out: Path) -> None:
    """A Kimi-K2.5-shaped checkpoint as released: the language model's tensors (as transformers writes a
    DeepSeek-V3, per-expert) under `language_model.`, the vision tower and projector at the top level,
    architecture `KimiK25ForConditionalGeneration`, and the image preprocessing config vLLM reads."""
    import tempfile

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    text = AutoModelForCausalLM.from_config(cfg.text_config, dtype=torch.float32)
    _peaked_init(text)
    mm = AutoModelForImageTextToText.from_config(cfg, dtype=torch.float32)
    _peaked_init(mm)
    with tempfile.TemporaryDirectory() as tmp:
        text.to(torch.bfloat16).save_pretrained(tmp, safe_serialization=True)
        sd = {"language_model." + k: v for f in sorted(Path(tmp).glob("*.safetensors"))
              for k, v in load_file(f).items()}
    for k, v in mm.to(torch.bfloat16).state_dict().items():
        for a in ("model.vision_tower.", "model.mm_projector."):
            if k.startswith(a):
                sd[k[len("model."):]] = v.contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    d = cfg.to_dict()
    d["architectures"] = ["KimiK25ForConditionalGeneration"]
    d["media_placeholder_token_id"] = d["image_token_id"]  # the released config's name (vLLM's EAGLE-3 reads it)
    (out / "config.json").write_text(json.dumps(d, indent=2))
    (out / "preprocessor_config.json").write_text(json.dumps({"media_proc_cfg": KIMI_MEDIA}, indent=2))


# The image preprocessing the released checkpoint ships (vLLM builds its processor even for text-only serving)
KIMI_MEDIA = {"patch_size": 14, "merge_kernel_size": 2, "temporal_merge_kernel_size": 4, "in_patch_limit": 16384,
              "patch_limit_on_one_side": 512, "in_patch_limit_each_frame": 4096, "fixed_output_tokens": None,
              "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "sample_fps": 2.0,
              "config_type": "media_proc"}


def make_tiny_target(
    out: str | Path,
    tokenizer_dir: str | Path,
    arch: str = "llama",
    num_layers: int = 4,
    hidden: int = 64,
    seed: int = 0,
) -> Path:
    """Save a random `arch` target (one of ARCHS) using `tokenizer_dir`'s tokenizer.

    Weights are bf16 safetensors, as a served target would be. Returns the directory.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = arch_config(arch, tok, num_layers, hidden)
    torch.manual_seed(seed)
    if arch == "kimi_k25":
        _save_kimi(cfg, out)
    else:
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        _peaked_init(model)
        model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    for name in TOKENIZER_FILES:  # keep the exact template file the real target serves with
        src = Path(tokenizer_dir) / name
        if src.exists() and not (out / name).exists():
            shutil.copy(src, out / name)
    return out
