"""An exported draft read back as the module vLLM runs: for the simulated AL of a served draft
(`eyas bench simulated`) and for warm starts (`train.init_from`)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from eyas.draft.contract import validate_draft
from eyas.draft.model import Eagle3Draft
from eyas.draft.spec import DraftSpec, canonical, load_draft_config
from eyas.io import load_safetensors
from eyas.target import load_head


def load_exported(draft_dir: str | os.PathLike, target_dir: str | os.PathLike) -> Eagle3Draft:
    """An exported draft dir as the module vLLM runs: its weights (embed_tokens from the target
    when the export dropped it; no d2t when the draft vocab is the target's)."""
    cfg, _ = load_draft_config(Path(draft_dir))
    spec = DraftSpec.from_draft_config(cfg)
    model = Eagle3Draft(spec)
    state = {canonical(n): t for n, t in load_safetensors(Path(draft_dir) / "model.safetensors", "export the draft again").items()}
    if "embed_tokens.weight" not in state:
        state["embed_tokens.weight"] = load_head(target_dir)[0]
    if "d2t" not in state:
        state["d2t"] = torch.zeros(spec.draft_vocab_size, dtype=torch.int64)
        state["t2d"] = torch.ones(spec.vocab_size, dtype=torch.bool)
    model.load_state_dict({n: t.float() if t.is_floating_point() else t for n, t in state.items()})
    return model.eval()


def load_warm_start(draft_dir: str | os.PathLike, target_dir: str | os.PathLike,
                    layer_ids: list[int] | tuple[int, ...]) -> Eagle3Draft:
    """A draft to continue training from (`train.init_from`): validated against the target as vLLM
    would load it, unquantized (an FP8 export has lost precision training cannot recover: start
    from the bf16 one), and reading the aux layers the features hold."""
    where = f"train.init_from {draft_dir}"
    try:
        info = validate_draft(draft_dir, target_dir)
    except (OSError, ValueError) as e:
        raise ValueError(f"{where}: not a draft vLLM would load for {target_dir}: {e}") from None
    if info["quantization"] != "none":
        raise ValueError(f"{where}: a {info['quantization']} draft; warm-start from its bf16 export "
                         "(eyas export --dtype bf16)")
    if list(info["layer_ids"]) != list(layer_ids):
        raise ValueError(f"{where}: the draft reads aux layers {info['layer_ids']} but the features hold "
                         f"{list(layer_ids)}; extract with extract.layer_ids={info['layer_ids']}")
    return load_exported(draft_dir, target_dir)
