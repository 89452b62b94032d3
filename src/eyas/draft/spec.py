"""The draft's config keys and weight names, defined once: what fixes its shapes
(`DraftSpec`), the keys it is saved with (`draft_config_dict`, into every checkpoint), the
config.json vLLM reads (`build_config`, or `speculators_config`), and vLLM's weight names.

    DraftSpec.from_target_config(target cfg, layer ids, Vd) -> spec -> draft_config_dict(spec)
        -> (checkpoint) -> build_config(draft keys, target text config, weights, dtype) -> config.json
    load_draft_config(draft dir) -> the same keys back, from either format

Validation against a target is `eyas.draft.contract.validate_draft`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from eyas.io import read_json
from eyas.target import text_config

ARCH = "LlamaForCausalLMEagle3"
MID = "midlayer."  # vLLM's name for draft layer 0 (speculators writes `layers.0.`)
LINEARS = [  # the linear layers FP8 quantizes (lm_head is an embedding-like layer in vLLM: never quantized)
    "fc",
    "midlayer.self_attn.q_proj",
    "midlayer.self_attn.k_proj",
    "midlayer.self_attn.v_proj",
    "midlayer.self_attn.o_proj",
    "midlayer.mlp.gate_proj",
    "midlayer.mlp.up_proj",
    "midlayer.mlp.down_proj",
]
NORMS = ["midlayer.hidden_norm", "midlayer.input_layernorm", "midlayer.post_attention_layernorm", "norm"]
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)
# llama fields the draft layer takes from the target unless the draft config sets them
FROM_TARGET = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "max_position_embeddings",
    "rope_theta",
    "rope_parameters",
    "rope_scaling",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)


def canonical(name: str) -> str:
    """Accept `model.`-prefixed and speculators (`layers.0.`) names; return vLLM's names."""
    name = name.removeprefix("model.")
    if name.startswith("layers.0."):
        name = MID + name[len("layers.0.") :]
    return name


def build_config(
    draft_config: dict[str, Any], target_cfg: dict[str, Any], state: dict[str, Any], dtype: str
) -> dict[str, Any]:
    """The vLLM-format config.json: draft keys over the target's llama fields, eagle keys forced."""
    cfg = {k: target_cfg[k] for k in FROM_TARGET if k in target_cfg}
    cfg.update({k: v for k, v in draft_config.items() if k not in ("architectures", "auto_map")})
    ids = cfg.get("eagle_aux_hidden_state_layer_ids") or (cfg.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids"
    )
    if not ids:
        raise ValueError("draft_config: eagle_aux_hidden_state_layer_ids is missing (the target layers fc reads)")
    vd = int(state["lm_head.weight"].shape[0]) if "lm_head.weight" in state else cfg.get("draft_vocab_size")
    cfg.update(
        architectures=[ARCH],
        model_type="llama",
        num_hidden_layers=1,
        vocab_size=int(target_cfg["vocab_size"]),
        draft_vocab_size=int(vd),
        target_hidden_size=int(target_cfg["hidden_size"]),
        eagle_aux_hidden_state_layer_ids=[int(i) for i in ids],
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
        dtype="bfloat16",
    )
    cfg.pop("eagle_config", None)
    if len(ids) != 3:
        cfg["num_aux_hidden_states"] = len(ids)
    else:
        cfg.pop("num_aux_hidden_states", None)
    # norm flags: written when used (vLLM reads them from the top level)
    cfg["fc_norm"] = bool(cfg.get("fc_norm")) or any(k.startswith("fc_norm.") for k in state)
    cfg["norm_before_fc"] = bool(cfg.get("norm_before_fc")) or "input_norm.weight" in state
    for flag in ("fc_norm", "norm_before_fc", "norm_output", "norm_before_residual"):
        if not cfg.get(flag):
            cfg.pop(flag, None)
    if dtype == "fp8":
        cfg["quantization_config"] = {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "weight_scheme": "per_tensor",  # informational; vLLM reads quant_method/activation_scheme
        }
    return cfg


def speculators_config(cfg: dict[str, Any], target_dir: Path, target_cfg: dict[str, Any], k: int) -> dict[str, Any]:
    """The same draft in the `speculators` format (vLLM reads `speculators_config` and these keys)."""
    layer = {
        key: v
        for key, v in cfg.items()
        if key
        not in (
            "architectures",
            "draft_vocab_size",
            "target_hidden_size",
            "eagle_aux_hidden_state_layer_ids",
            "num_aux_hidden_states",
            "norm_before_residual",
            "norm_before_fc",
            "fc_norm",
            "norm_output",
            "torch_dtype",
            "dtype",
        )
    }  # quantization_config stays inside: vLLM builds the draft's hf_config from this mapping
    out: dict[str, Any] = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.1.0",
        "transformer_layer_config": layer,
        "draft_vocab_size": cfg["draft_vocab_size"],
        "target_hidden_size": cfg["target_hidden_size"],
        "eagle_aux_hidden_state_layer_ids": cfg["eagle_aux_hidden_state_layer_ids"],
        # vLLM defaults this to True for the speculators format (False for vLLM's own): always write it
        "norm_before_residual": bool(cfg.get("norm_before_residual", False)),
        "norm_before_fc": bool(cfg.get("norm_before_fc", False)),
        "fc_norm": bool(cfg.get("fc_norm", False)),
        "norm_output": bool(cfg.get("norm_output", False)),
        "torch_dtype": "bfloat16",
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(k)}],
            "default_proposal_method": "greedy",
            "verifier": {
                "name_or_path": str(target_dir),
                "architectures": target_cfg.get("architectures", []),
            },
        },
    }
    if "num_aux_hidden_states" in cfg:
        out["num_aux_hidden_states"] = cfg["num_aux_hidden_states"]
    return out


@dataclass(frozen=True)
class DraftSpec:
    """Everything that fixes the draft's shapes and numerics (all read from the target config)."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    vocab_size: int  # the target's
    draft_vocab_size: int
    target_hidden_size: int
    layer_ids: tuple[int, ...]  # aux layer ids, ascending: HF hidden_states[k]
    max_position_embeddings: int
    rope_parameters: dict[str, Any] = field(default_factory=dict)
    fc_norm: bool = False  # one RMSNorm per aux chunk before fc
    norm_before_fc: bool = False  # one RMSNorm over the whole concatenation before fc
    norm_output: bool = False  # feed back the post-norm hidden instead of the pre-norm one

    @property
    def n_aux(self) -> int:
        return len(self.layer_ids)

    @classmethod
    def from_target_config(
        cls, tcfg: Any, layer_ids: list[int] | tuple[int, ...], draft_vocab_size: int, fc_norm: bool = False,
        norm_before_fc: bool = False, num_heads: int = 0, num_kv_heads: int = 0, head_dim: int = 0,
        intermediate_size: int = 0,
    ) -> DraftSpec:
        """Sizes from a transformers config of the target (dense, MoE, MLA; a multimodal wrapper's text
        config); a size given (> 0) replaces the one `draft_geometry` derives."""
        tcfg = text_config(tcfg)
        ids = tuple(int(i) for i in layer_ids)
        L = int(tcfg.num_hidden_layers)
        if list(ids) != sorted(set(ids)) or not ids or ids[0] < 0 or ids[-1] > L:
            raise ValueError(f"layer ids {list(ids)} must be ascending, unique and within 0..{L}")
        H = int(tcfg.hidden_size)
        geo = draft_geometry(tcfg)
        nh, nkv = num_heads or geo["num_heads"], num_kv_heads or num_heads or geo["num_kv_heads"]
        head_dim, inter = head_dim or geo["head_dim"], intermediate_size or geo["intermediate_size"]
        if nh % nkv:
            raise ValueError(f"draft heads {nh} must be a multiple of its kv heads {nkv} (train.draft_num_kv_heads)")
        if not 0 < draft_vocab_size <= int(tcfg.vocab_size):
            raise ValueError(f"draft_vocab_size {draft_vocab_size} must be in 1..{tcfg.vocab_size} (target vocab)")
        return cls(
            hidden_size=H,
            num_heads=int(nh),
            num_kv_heads=int(nkv),
            head_dim=int(head_dim),
            intermediate_size=int(inter),
            rms_norm_eps=float(getattr(tcfg, "rms_norm_eps", 1e-6)),
            vocab_size=int(tcfg.vocab_size),
            draft_vocab_size=int(draft_vocab_size),
            target_hidden_size=H,
            layer_ids=ids,
            max_position_embeddings=int(getattr(tcfg, "max_position_embeddings", 4096)),
            rope_parameters=_rope_parameters(tcfg),
            fc_norm=fc_norm,
            norm_before_fc=norm_before_fc,
        )

    @classmethod
    def from_draft_config(cls, d: dict[str, Any]) -> DraftSpec:
        """Inverse of `draft_config_dict` (reads a draft config.json / draft.json)."""
        return cls(
            hidden_size=d["hidden_size"],
            num_heads=d["num_attention_heads"],
            num_kv_heads=d["num_key_value_heads"],
            head_dim=d["head_dim"],
            intermediate_size=d["intermediate_size"],
            rms_norm_eps=d["rms_norm_eps"],
            vocab_size=d["vocab_size"],
            draft_vocab_size=d["draft_vocab_size"],
            target_hidden_size=d["target_hidden_size"],
            layer_ids=tuple(d["eagle_aux_hidden_state_layer_ids"]),
            max_position_embeddings=d["max_position_embeddings"],
            rope_parameters=dict(d.get("rope_parameters") or {"rope_type": "default", "rope_theta": d["rope_theta"]}),
            fc_norm=bool(d.get("fc_norm", False)),
            norm_before_fc=bool(d.get("norm_before_fc", False)),
            norm_output=bool(d.get("norm_output", False)),
        )


def draft_geometry(tcfg: Any) -> dict[str, int]:
    """The draft layer's heads, kv heads, head dim and MLP width for a target text config. A Llama-style
    target's own; an MLA target (DeepSeek-V3, Kimi-K2.5: `kv_lora_rank`) has no per-head k/v of its own
    size (its `head_dim` is the rope part, 64), so the draft takes its value head dim (128) and one kv
    head per head; a MoE target whose `intermediate_size` is an expert's width (below 2 x hidden:
    MiniMax-M2, gpt-oss) gets a 4 x hidden MLP."""
    H, nh = int(tcfg.hidden_size), int(tcfg.num_attention_heads)
    head_dim = int(getattr(tcfg, "head_dim", None) or H // nh)
    nkv = int(getattr(tcfg, "num_key_value_heads", None) or nh)
    if getattr(tcfg, "kv_lora_rank", None):
        head_dim, nkv = int(getattr(tcfg, "v_head_dim", None) or head_dim), nh
    inter = int(getattr(tcfg, "intermediate_size", None) or 4 * H)
    if inter < 2 * H:
        inter = 4 * H
    return {"num_heads": nh, "num_kv_heads": nkv, "head_dim": head_dim, "intermediate_size": inter}


def _rope_parameters(tcfg: Any) -> dict[str, Any]:
    rp = getattr(tcfg, "rope_parameters", None)
    if isinstance(rp, dict) and "full_attention" in rp:  # per-layer-type dict: the draft is full attention
        rp = rp["full_attention"]
    if not rp:
        scaling = dict(getattr(tcfg, "rope_scaling", None) or {})
        rp = {"rope_type": scaling.pop("rope_type", scaling.pop("type", "default")), **scaling}
        rp["rope_theta"] = float(getattr(tcfg, "rope_theta", 10000.0))
    return {k: v for k, v in dict(rp).items() if v is not None}


def draft_config_dict(spec: DraftSpec, torch_dtype: str = "bfloat16", **extra: Any) -> dict[str, Any]:
    """The HF config.json vLLM reads for the draft (`LlamaForCausalLMEagle3`)."""
    d: dict[str, Any] = {
        "architectures": [ARCH],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": spec.hidden_size,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "intermediate_size": spec.intermediate_size,
        "hidden_act": "silu",
        "rms_norm_eps": spec.rms_norm_eps,
        "vocab_size": spec.vocab_size,
        "draft_vocab_size": spec.draft_vocab_size,
        "target_hidden_size": spec.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(spec.layer_ids),
        "max_position_embeddings": spec.max_position_embeddings,
        "rope_parameters": dict(spec.rope_parameters),
        "rope_theta": spec.rope_parameters.get("rope_theta", 10000.0),
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": torch_dtype,
    }
    if spec.n_aux != 3:
        d["num_aux_hidden_states"] = spec.n_aux
    if spec.fc_norm:
        d["fc_norm"] = True
    if spec.norm_before_fc:
        d["norm_before_fc"] = True
    if spec.norm_output:
        d["norm_output"] = True
    d.update(extra)
    return d


def spec_dict(spec: DraftSpec) -> dict[str, Any]:
    d = asdict(spec)
    d["layer_ids"] = list(spec.layer_ids)
    return d


def load_draft_config(draft_dir: Path) -> tuple[dict[str, Any], str]:
    """config.json normalized to vLLM's flat keys; returns (cfg, format)."""
    raw = read_json(draft_dir / "config.json")
    if "speculators_config" not in raw:
        return raw, "vllm"
    if raw.get("speculators_model_type") != "eagle3":
        raise ValueError(f"{draft_dir}/config.json: speculators_model_type must be 'eagle3'")
    sc = raw["speculators_config"]
    try:
        int(sc["proposal_methods"][0]["speculative_tokens"])
        sc["verifier"]["name_or_path"]
    except (KeyError, IndexError, TypeError, ValueError):
        raise ValueError(
            f"{draft_dir}/config.json: speculators_config needs proposal_methods[0].speculative_tokens "
            "and verifier.name_or_path"
        ) from None
    if not isinstance(raw.get("transformer_layer_config"), dict):
        raise ValueError(f"{draft_dir}/config.json: speculators format needs a transformer_layer_config mapping")
    cfg = dict(raw["transformer_layer_config"])
    for key in (
        "draft_vocab_size",
        "target_hidden_size",
        "eagle_aux_hidden_state_layer_ids",
        "num_aux_hidden_states",
        "norm_before_fc",
        "fc_norm",
        "norm_output",
    ):
        if key in raw:
            cfg[key] = raw[key]
    cfg["norm_before_residual"] = raw.get("norm_before_residual", True)  # vLLM's default for this format
    cfg.setdefault("architectures", [ARCH])
    cfg.setdefault("num_hidden_layers", 1)
    return cfg, "speculators"
