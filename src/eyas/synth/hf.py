"""Synthesis without vLLM: transformers' batched greedy generation (`synth.engine: hf`).

For machines where vLLM is not installed (a GPU box without its wheel) or an architecture vLLM
does not run yet. It takes the same prompt ids eyas.chat renders for vLLM, stops where vLLM stops
(the generation config's and the tokenizer's EOS ids, or `max_tokens`), and decodes the reply as
vLLM does (special tokens skipped). Greedy only: batched sampling with a seed per request is not
reproducible request by request. The dtype is the one the target is served in for evaluation
(`eyas.host.engine_dtype` unless given): HF float32 and vLLM float32 agree at every position on the
embedded target (`eyas bench drift`), bf16 does not.

    reqs sorted by (max_tokens, prompt length), `batch` per generate call, left-padded:
    input_ids [B, P_max], attention_mask [B, P_max] -> generated ids [B, <= max_tokens]
"""

from __future__ import annotations

import os
from typing import Any

from eyas.host import engine_dtype
from eyas.synth.engines import Completion, OnDone, Request, Sampling

DTYPES = {"bf16": "bfloat16", "fp32": "float32", "auto": ""}


class HFEngine:
    def __init__(self, model: str | os.PathLike, *, device: str = "cpu", dtype: str = "auto",
                 max_model_len: int = 2048, batch: int = 8):
        import torch

        from eyas.chat import load_tokenizer
        from eyas.target import load_language_model, text_config

        self.dtype = DTYPES.get(dtype, dtype) or engine_dtype()
        self.device = torch.device(device)
        self.model = load_language_model(model, getattr(torch, self.dtype)).to(self.device).eval()
        self.tok = load_tokenizer(model)
        limit = getattr(text_config(self.model.config), "max_position_embeddings", None) or max_model_len
        self.max_model_len = min(max_model_len, int(limit))
        eos = self.model.generation_config.eos_token_id
        stop = set([eos] if isinstance(eos, int) else list(eos or []))
        if self.tok.eos_token_id is not None:
            stop.add(self.tok.eos_token_id)
        if not stop:
            raise ValueError(f"{model}: neither generation_config.json nor the tokenizer names an EOS token: "
                             "the hf engine would never stop a reply")
        self.stop = sorted(stop)
        self.pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.stop[0]
        self.batch = max(1, batch)

    def generate_ids(self, reqs: list[Request]) -> list[tuple[list[int], str]]:
        """(reply ids [G], "stop" | "length") per request, in order; a stopped reply ends with its stop
        token, as vLLM's `token_ids` do."""
        import torch

        out: list[tuple[list[int], str] | None] = [None] * len(reqs)
        order = sorted(range(len(reqs)), key=lambda i: (reqs[i].max_tokens, len(reqs[i].prompt_ids)))
        for start in range(0, len(order), self.batch):
            idx = order[start : start + self.batch]
            width = max(len(reqs[i].prompt_ids) for i in idx)
            ids = torch.full((len(idx), width), self.pad, dtype=torch.long)  # [B, P_max], left-padded
            mask = torch.zeros((len(idx), width), dtype=torch.long)
            for row, i in enumerate(idx):
                p = reqs[i].prompt_ids
                ids[row, width - len(p):] = torch.tensor(p)
                mask[row, width - len(p):] = 1
            with torch.inference_mode():
                gen = self.model.generate(
                    input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                    max_new_tokens=max(reqs[i].max_tokens for i in idx), do_sample=False, num_beams=1,
                    eos_token_id=self.stop, pad_token_id=self.pad, temperature=None, top_p=None, top_k=None)
            for row, i in enumerate(idx):
                toks = gen[row, width:].tolist()[: reqs[i].max_tokens]
                cut = next((j for j, t in enumerate(toks) if t in self.stop), None)
                out[i] = (toks, "length") if cut is None else (toks[: cut + 1], "stop")
        return out  # type: ignore[return-value]

    def generate(self, reqs: list[Request], sampling: Sampling, on_done: OnDone | None = None) -> list[Completion]:
        if sampling.temperature > 0:
            raise ValueError("synth.engine=hf generates greedily only: set synth.temperature=0, or use vLLM")
        res = []
        for r, (ids, reason) in zip(reqs, self.generate_ids(reqs)):
            # vLLM counts the stop token among the completion tokens and leaves it out of the text
            text = self.tok.decode(ids[:-1] if reason == "stop" else ids, skip_special_tokens=True)
            res.append(Completion(text, len(ids), len(r.prompt_ids), reason))
            if on_done:
                on_done(res[-1])
        return res

    def describe(self) -> dict[str, Any]:
        return {"engine": "hf", "dtype": self.dtype, "device": str(self.device), "batch": self.batch}

    def close(self) -> None:
        del self.model
