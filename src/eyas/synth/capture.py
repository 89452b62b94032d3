"""Hidden states captured while the target writes: synthesis and extraction in one pass.

Extraction re-runs every token of every conversation through the target (a prefill), after
synthesis already ran them all: on a 2-core CPU that second pass costs about as much per
generated token as the generation itself. vLLM's own `extract_hidden_states` method keeps
the states of generated tokens too (`include_output_tokens`), but it runs as a speculative
method that verifies one dead draft per step: generation at 0.72x (docs/tokens-per-hour.md).
So eyas hooks the model in vLLM's worker instead:

- `CaptureExtension` is mixed into vLLM's worker (`worker_extension_cls`). `eyas_capture_start`
  registers forward hooks on the decoder layers whose outputs are the aux ids (vLLM's id k =
  the residual stream after k layers, `hidden + residual` of layer k-1) plus id L (before the
  final norm). Each forward's rows are split by request with the step's scheduler output
  (the input batch's request order and scheduled token counts) and kept with their positions.
  The hooks run only where the model runs eagerly: under torch.compile / CUDA graphs a replayed graph
  skips them, so synthesis captures only with `synth.enforce_eager` (its default).
- `eyas_capture_take(ids)` hands back, per finished request, `states` [T, n_ids, H] and a
  `seen` mask [T] (T = prompt + reply - 1: the last sampled token never ran through the model).
  Positions vLLM took from its prefix cache did not run either (`seen` False): the caller
  fills them from the conversation's previous turn (`fill_prefix`), or leaves the conversation
  to the extract stage.

On the AVX2 EPYC the hooks alone cost 1-2.5% of the generation rate and, with the RPC that hands the
states over, 0.905x and 0.965x in two raw-vLLM probes; inside `eyas synth` no difference showed (163.8
against 163.0 tok/s, 172.5 against 172.3). The states agree with HF's float32 forward to 1.4e-5 relative
or better (docs/tokens-per-hour.md).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

EXTENSION = "eyas.synth.capture.CaptureExtension"


def _decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layer list of a vLLM causal LM (`model.model.layers`, or a multimodal wrapper's)."""
    for path in ("model.layers", "language_model.model.layers", "model.language_model.layers"):
        mod: Any = model
        for part in path.split("."):
            mod = getattr(mod, part, None)
        if isinstance(mod, torch.nn.ModuleList):
            return mod
    raise ValueError(f"synth.capture: no decoder layer list found in {type(model).__name__}; "
                     "set synth.capture=false (the extract stage then runs the target again)")


class CaptureExtension:
    """Methods mixed into vLLM's worker (`self.model_runner` is the worker's)."""

    def eyas_capture_start(self, ids: list[int]) -> None:
        """Hook the layers that make vLLM ids `ids` (ascending, L allowed)."""
        runner: Any = self.model_runner  # type: ignore[attr-defined]
        layers = _decoder_layers(runner.model)
        if not ids or min(ids) < 1 or max(ids) > len(layers):
            raise ValueError(f"synth.capture: layer ids {ids} outside 1..{len(layers)}")
        st: dict[str, Any] = {"ids": list(ids), "rows": {}, "pos": None, "sched": None, "buf": {}}
        self._eyas = st
        run = runner.execute_model

        def execute_model(scheduler_output, *a, **k):
            st["sched"] = scheduler_output
            return run(scheduler_output, *a, **k)

        runner.execute_model = execute_model

        def pre(mod, args, kwargs):
            st["rows"], st["pos"] = {}, kwargs["positions"] if "positions" in kwargs else args[0]

        layers[0].register_forward_pre_hook(pre, with_kwargs=True)
        last = max(ids)
        for k in ids:
            def hook(mod, args, out, k=k):
                h, r = out if isinstance(out, tuple) else (out, None)
                st["rows"][k] = h + r if r is not None else h
                if k == last:
                    self._eyas_split(runner)
            layers[k - 1].register_forward_hook(hook)

    def _eyas_split(self, runner: Any) -> None:
        """This forward's rows -> each request's (positions, states) chunks."""
        st, so = self._eyas, self._eyas["sched"]
        counts = so.num_scheduled_tokens if so is not None else {}
        order = [r for r in runner.input_batch.req_ids if r is not None]
        n = [counts.get(r, 0) for r in order]
        total = sum(n)
        if not total:
            return
        states = torch.stack([st["rows"][k][:total] for k in st["ids"]], 1)  # [N, n_ids, H]
        pos = st["pos"][:total]
        o = 0
        for r, c in zip(order, n):
            if c:
                st["buf"].setdefault(r, []).append((pos[o:o + c].to("cpu", copy=True),
                                                    states[o:o + c].to("cpu", copy=True)))
            o += c

    def eyas_capture_take(self, ids: list[str]) -> list[dict[str, Any] | None]:
        """Per external request id its states as raw bytes (vLLM's RPC turns tensors into lists; `take`
        decodes) and its buffer dropped; None when nothing of it ran. vLLM's internal ids are the
        external ones plus a suffix (`ID-xxxxxxxx`)."""
        buf = self._eyas["buf"]
        out: list[dict[str, Any] | None] = []
        for ext in ids:
            key = ext if ext in buf else next((k for k in buf if k.startswith(ext + "-")), None)
            chunks = buf.pop(key, None) if key is not None else None
            if not chunks:
                out.append(None)
                continue
            T = max(int(p.max()) for p, _ in chunks) + 1
            states = torch.zeros((T, *chunks[0][1].shape[1:]), dtype=chunks[0][1].dtype)
            seen = torch.zeros(T, dtype=torch.bool)
            for p, s in chunks:  # in step order: a recomputed position (preemption) keeps its last value
                states[p] = s
                seen[p] = True
            out.append({"shape": list(states.shape), "dtype": str(states.dtype).removeprefix("torch."),
                        "states": states.contiguous().view(torch.uint8).numpy().tobytes(),
                        "seen": seen.numpy().tobytes()})
        return out


def take(llm: Any, ids: list[str]) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """From a `vllm.LLM` built with `worker_extension_cls=EXTENSION` (first rank's answer): per finished
    request id, (states [T, n_ids, H], seen bool [T]), or None."""
    out: list[tuple[torch.Tensor, torch.Tensor] | None] = []
    for r in llm.collective_rpc("eyas_capture_take", args=(list(ids),))[0]:
        if r is None:
            out.append(None)
            continue
        dtype = getattr(torch, r["dtype"])
        states = torch.frombuffer(bytearray(r["states"]), dtype=torch.uint8).view(dtype).view(*r["shape"])
        seen = torch.frombuffer(bytearray(r["seen"]), dtype=torch.bool)
        out.append((states, seen))
    return out


def fill_prefix(ids: list[int], states: torch.Tensor, seen: torch.Tensor,
                prev: tuple[list[int], torch.Tensor] | None) -> torch.Tensor | None:
    """A request's states [T, n, H] with the positions vLLM served from its prefix cache (`seen` False) taken
    from `prev` = (token ids, states) of the same conversation's previous turn, where the tokens agree;
    None when a position is still missing (the extract stage then runs that conversation)."""
    if bool(seen.all()):
        return states
    missing = (~seen).nonzero().flatten()
    if prev is None:
        return None
    pids, pstates = prev
    end = int(missing.max()) + 1
    if end > len(pids) or pids[:end] != ids[:end]:
        return None
    states = states.clone()
    states[missing] = pstates[missing].to(states.dtype)
    return states


# ---------------------------------------------------------------- the synthesis side

def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


class CaptureWriter:
    """Finished conversations' captured states -> `OUT/captured` (eyas features, bf16: the aux ids and the
    final state before the final norm, which the extract stage applies), aligned with the conversation as
    the extract stage renders it. A conversation whose states are incomplete (a prefix vLLM cached from
    another conversation) is left out: the extract stage runs it. One whose last reply re-renders to other tokens
    than the engine generated (non-canonical tokenization: 3-7% of the recipes' conversations) is kept with the
    engine's tokens, the ones the draft meets when serving, and listed in `as_generated.jsonl`
    (`eyas.features.CAPTURE_AS_GENERATED`)."""

    def __init__(self, out: Path, target: Path, tok: Any, template: str, max_len: int, layer_ids: list[int],
                 prompts_sha256: str, compute_dtype: str):
        from eyas.features import CAPTURED, FeatureWriter
        from eyas.manifest import tokenizer_hash
        from eyas.target import facts, resolve_layer_ids, target_fingerprint
        from eyas.chat import template_hash

        f = facts(target)
        self.layer_ids = resolve_layer_ids(layer_ids or None, f["num_layers"])
        self.vllm_ids = sorted(set(self.layer_ids) | {f["num_layers"]})  # + L: the pre-norm final state
        self._cols = [self.vllm_ids.index(k) for k in self.layer_ids]
        self._last = self.vllm_ids.index(f["num_layers"])
        self.tok, self.template, self.max_len = tok, template, max_len
        header = {"target": str(target), "backend": "capture", "compute_dtype": compute_dtype,
                  "layer_ids": self.layer_ids, "dtype": "bf16", "hidden_size": f["hidden_size"],
                  "num_target_layers": f["num_layers"], "tokenizer_hash": tokenizer_hash(target),
                  "target_fingerprint": target_fingerprint(target), "template_hash": template_hash(template),
                  "max_len": max_len, "data_sha256": prompts_sha256,
                  "layer_id_convention": "k = residual stream after k decoder layers = HF hidden_states[k]",
                  "last_hidden_states": "layer L's raw output, before the final norm (the extract stage applies it)",
                  "last_normed": False}
        self.writer = FeatureWriter(out / CAPTURED, header, samples_per_shard=64)
        self.done = self.writer.done_ids
        self.kept = self.left = self.as_generated = 0

    def add(self, conv_id: str, msgs: list[dict[str, str]], captured: tuple[list[int], torch.Tensor] | None) -> None:
        """One finished conversation (`msgs` ending with its last reply) and its last turn's filled states."""
        from eyas.chat import render_with_mask
        from eyas.features import CAPTURE_AS_GENERATED, CAPTURE_SLACK, ids_digest

        if not msgs or conv_id in self.done:
            return
        if captured is None:
            self.left += 1
            return
        engine_ids, states = captured
        r = render_with_mask(self.tok, msgs, self.template, where=f"conversation {conv_id}")
        full, n = r.input_ids[: self.max_len], min(len(engine_ids), states.shape[0], self.max_len)
        k = min(common_prefix(engine_ids, full), n)
        if k and k >= len(full) - CAPTURE_SLACK:  # the render's tokens, all but the last reply's final ones
            ids, mask, n = full[:k], r.loss_mask[:k], k
        else:  # they part inside the last reply (the earlier turns are rendered text in its prompt too)
            last = next((i for i in range(len(full) - 1, 0, -1) if r.loss_mask[i] and not r.loss_mask[i - 1]), None)
            if last is None or k < last:
                self.left += 1
                return
            ids, mask = engine_ids[:n], r.loss_mask[:k] + [1] * (n - k)  # the rest: the last reply as generated
            self.as_generated += 1
            with open(self.writer.out / CAPTURE_AS_GENERATED, "a") as f:  # before its shard: a line alone is harmless
                f.write(json.dumps({"id": conv_id, "tokens": len(full), "sha256": ids_digest(full)}) + "\n")
        self.writer.add({"id": conv_id, "input_ids": torch.tensor(ids, dtype=torch.int64),
                         "loss_mask": torch.tensor(mask, dtype=torch.bool),
                         "aux_hidden_states": states[:n, self._cols].to(torch.bfloat16),
                         "last_hidden_states": states[:n, self._last].to(torch.bfloat16)},  # [n, H], pre-norm
                        truncated=len(r.input_ids) > self.max_len or len(engine_ids) > self.max_len)
        self.kept += 1

    def finish(self) -> dict[str, Any]:
        return self.writer.finish(kept_last_run=self.kept, left_to_extract_last_run=self.left,
                                  as_generated_last_run=self.as_generated)
