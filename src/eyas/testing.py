"""Tiny random targets with a real tokenizer and chat template, for tests and quick benches."""

from __future__ import annotations

import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def make_tiny_target(
    out: str | Path,
    tokenizer_dir: str | Path,
    arch: str = "llama",
    num_layers: int = 4,
    hidden: int = 64,
    seed: int = 0,
) -> Path:
    """Save a random causal LM (llama | mixtral | qwen3_moe) using `tokenizer_dir`'s tokenizer.

    Weights are bf16 safetensors, as a served target would be. Returns the directory.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out = Path(out)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    common = dict(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    if arch == "llama":
        cfg = AutoConfig.for_model("llama", **common)
    elif arch == "mixtral":
        cfg = AutoConfig.for_model("mixtral", num_local_experts=4, num_experts_per_tok=2, **common)
    elif arch == "qwen3_moe":
        cfg = AutoConfig.for_model(
            "qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden, decoder_sparse_step=1,
            **common,
        )
    else:
        raise ValueError(f"unknown tiny arch {arch!r}: llama | mixtral | qwen3_moe")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # larger-than-default init so the random target has peaked, varied outputs
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    for name in TOKENIZER_FILES:  # keep the exact template file the real target serves with
        src = Path(tokenizer_dir) / name
        if src.exists() and not (out / name).exists():
            shutil.copy(src, out / name)
    return out
