"""The reference backend: a transformers forward with pre-hooks on the decoder layers.

Aux id k is the *input* of decoder layer k (the residual stream after k layers, HF
`hidden_states[k]`), captured by a forward pre-hook on `layers[k]`, so only the wanted
layers are kept (never all L+1). `last_hidden_states` is the decoder's
`last_hidden_state`: after the final norm, the lm_head input (= HF `hidden_states[L]`).
The lm_head itself is never run. Batches are length-sorted and right-padded.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from eyas.extract.base import Extractor
from eyas.packing import pack_by_length

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def decoder_layers(model) -> tuple[torch.nn.Module, torch.nn.ModuleList]:
    """(decoder, its ModuleList of L decoder layers) of a HF causal LM."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"{type(model).__name__}: cannot find the decoder layers (expected `.model.layers`)")
    return decoder, layers


def pad_batch(seqs: list[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T_i] id tensors -> right-padded ids [B, T] and attention mask [B, T] (int64)."""
    T = max(int(x.shape[0]) for x in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.int64)
    attn = torch.zeros((len(seqs), T), dtype=torch.int64)
    for b, x in enumerate(seqs):
        ids[b, : x.shape[0]] = x
        attn[b, : x.shape[0]] = 1
    return ids, attn


class HFExtractor(Extractor):
    backend = "hf"

    def __init__(self, target: str | os.PathLike, layer_ids: list[int] | None = None, *,
                 compute_dtype: str = "bf16", device: str = "cpu", max_len: int = 2048,
                 batch_tokens: int = 8192, chat_template: str = "", out_dtype: Any = None,
                 out_device: str = "cpu"):
        from eyas.target import load_language_model

        super().__init__(target, layer_ids, max_len=max_len, chat_template=chat_template, out_dtype=out_dtype)
        if compute_dtype not in DTYPES:
            raise ValueError(f"unknown compute dtype {compute_dtype!r}: {' | '.join(DTYPES)}")
        self.compute_dtype = compute_dtype
        self.device = torch.device(device)
        self.batch_tokens = batch_tokens
        self.out_device = torch.device(out_device)
        self.model = load_language_model(self.target, DTYPES[compute_dtype])  # a multimodal wrapper's LM only
        self.model.to(self.device).eval()
        self.decoder, layers = decoder_layers(self.model)
        assert len(layers) == self.num_layers, (len(layers), self.num_layers)
        pad = getattr(self.model.config, "pad_token_id", None)
        self.pad_id = int(pad) if isinstance(pad, int) else 0
        self._captured: dict[int, torch.Tensor] = {}
        self._hooks = [layers[k].register_forward_pre_hook(self._hook(k), with_kwargs=True) for k in self.layer_ids]

    def _hook(self, k: int):
        def pre_hook(module, args, kwargs):
            hs = args[0] if args else kwargs["hidden_states"]  # [B, T, H]: the input of layer k
            self._captured[k] = hs.detach()

        return pre_hook

    @torch.inference_mode()
    def _forward(self, input_ids: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        lengths = [int(x.shape[0]) for x in input_ids]
        out: list[Any] = [None] * len(input_ids)
        for batch in pack_by_length(lengths, self.batch_tokens):
            ids, attn = pad_batch([input_ids[i] for i in batch], self.pad_id)
            self._captured.clear()
            res = self.decoder(input_ids=ids.to(self.device), attention_mask=attn.to(self.device), use_cache=False)
            last = res.last_hidden_state  # [B, T, H], after the final norm
            aux = torch.stack([self._captured[k] for k in self.layer_ids], dim=2)  # [B, T, n, H]
            self._captured.clear()
            for b, i in enumerate(batch):
                n = lengths[i]
                out[i] = (aux[b, :n].to(self.out_device, self.out_dtype), last[b, :n].to(self.out_device, self.out_dtype))
        return out

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
