"""One vLLM server, two proposers (#31, step 2): the EAGLE-3 draft, and prompt lookup per request and step.

A `vllm.general_plugins` entry point (pyproject: `eyas_hybrid`), so it runs in every vLLM process,
on CPUs and GPUs. It wraps vLLM's `GPUModelRunner.propose_draft_token_ids` (the CPU runner inherits
it): the draft proposes as always (its forward keeps its KV cache), then, when the served EAGLE-3
draft's config.json names a lookup policy, each decoding request's history is looked up with vLLM's
own n-gram matcher and the rule (`eyas.draft.hybrid.rule`) picks, per request, the draft's k tokens or
the lookup's (padded to k with the draft's, which greedy verification accepts only where they are
the target's own tokens: the output is the target's whatever is proposed).

    config.json  "eyas_lookup": {"rule": "lookup>draft", "ngram": [2, 4]}    (eyas export --lookup)
    EYAS_HYBRID=0                     serve the draft alone (vLLM without eyas does the same)
    EYAS_HYBRID_STATS=FILE            per-source counts, rewritten each step: verified proposals, accepted tokens

A request's history at this point (before vLLM's bookkeeping, in the padded-batch path it drafts in)
is `input_batch.token_ids_cpu[i, :num_tokens_no_spec[i]]` plus its valid sampled tokens this step;
requests in a partial prefill (`discard_request_mask`) are left alone. The accepted count of the
previous proposal is read off this step's valid sampled tokens (all but the bonus token).

Not handled: Model Runner V2 (GPU default in recent vLLM; serve with VLLM_USE_V2_MODEL_RUNNER=0, as
Arctic Inference does), and the draft's probabilities when sampling (`draft_sample_method:
probabilistic`): a lookup row there would need one-hot probabilities; the hybrid refuses non-greedy
requests' rows and leaves them the draft's.
"""

from __future__ import annotations

import json
import os
from typing import Any

POLICY_KEY = "eyas_lookup"


def parse_lookup(spec: str, k: int = 3) -> dict[str, Any] | None:
    """`none` -> None; `ngram:MIN:MAX[:RULE]` -> the policy a draft's config.json carries (RULE: a name of
    eyas.draft.hybrid.rule, default lookup>draft)."""
    if spec in ("", "none"):
        return None
    parts = spec.split(":", 3)
    if parts[0] != "ngram" or len(parts) < 3 or not (parts[1].isdigit() and parts[2].isdigit()) \
            or not 1 <= int(parts[1]) <= int(parts[2]):
        raise ValueError(f"export.lookup={spec!r}: expected none or ngram:MIN:MAX[:RULE] with 1 <= MIN <= MAX "
                         "(e.g. ngram:2:4:lookup>draft)")
    from eyas.draft.hybrid import rule

    name = parts[3] if len(parts) == 4 else "lookup>draft"
    rule(name, k)  # an unknown rule is a ValueError naming the known ones
    return {"rule": name, "ngram": [int(parts[1]), int(parts[2])]}


def policy_of(hf_config: Any) -> dict[str, Any] | None:
    """The lookup policy a draft's config carries, or None."""
    pol = getattr(hf_config, POLICY_KEY, None)
    if pol is None and isinstance(hf_config, dict):
        pol = hf_config.get(POLICY_KEY)
    return dict(pol) if pol else None


class Hybrid:
    def __init__(self, policy: dict[str, Any], k: int, max_model_len: int):
        from eyas.draft.hybrid import rule

        self.name = str(policy.get("rule", "lookup>draft"))
        self.rule = rule(self.name, k)
        self.ngram = tuple(int(x) for x in policy.get("ngram", (2, 4)))
        self.k, self.max_model_len = k, max_model_len
        self.prev: dict[str, str] = {}  # req id -> the source of its last proposal
        self.stats = {s: {"steps": 0, "accepted": 0} for s in ("draft", "lookup")}
        self.stats_path = os.environ.get("EYAS_HYBRID_STATS", "")

    def step(self, runner: Any, sampled: Any, drafts: Any) -> Any:
        """drafts [num_reqs, k] (the draft's proposal, on the runner's device) -> the proposal to verify."""
        import numpy as np
        import torch

        from eyas.draft.hybrid import lookup

        batch = runner.input_batch
        before = torch.is_tensor(sampled)  # the padded path drafts before bookkeeping: add this step's tokens
        rows = sampled.tolist() if before else sampled
        out = drafts.cpu()
        changed = False
        for i, req_id in enumerate(batch.req_ids):
            valid = [int(t) for t in rows[i] if t >= 0] if i < len(rows) else []
            if not valid or bool(runner.discard_request_mask.np[i]):
                continue
            if req_id in self.prev:  # its last proposal was verified this step: count it for its source
                self.stats[self.prev[req_id]]["steps"] += 1
                self.stats[self.prev[req_id]]["accepted"] += len(valid) - 1
            n = int(batch.num_tokens_no_spec[i])
            hist = batch.token_ids_cpu[i, :n].astype(np.int32)
            if before:
                hist = np.concatenate([hist, np.asarray(valid, dtype=np.int32)])
            lk, m = lookup(hist, self.ngram[0], self.ngram[1], self.k, self.max_model_len)
            draft = out[i].tolist()
            prop, source = self.rule(draft, 1.0, lk, m)
            if source == "lookup" and prop and batch.all_greedy:
                row = (prop + draft[len(prop):])[: self.k]
                out[i, : len(row)] = torch.tensor(row, dtype=out.dtype)
                changed = True
            else:
                source = "draft"
            self.prev[req_id] = source
        live = set(batch.req_ids)
        self.prev = {r: s for r, s in self.prev.items() if r in live}
        if self.stats_path:
            tmp = f"{self.stats_path}.tmp.{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump({"rule": self.name, "ngram": list(self.ngram), **self.stats}, f)
            os.replace(tmp, self.stats_path)
        if changed:
            drafts.copy_(out.to(drafts.device))
        return drafts


def _hybrid_of(runner: Any) -> Hybrid | None:
    """The runner's Hybrid (made once), or None when the served draft names no policy."""
    if "_eyas_hybrid" not in runner.__dict__:
        spec = getattr(runner, "speculative_config", None)
        pol = None
        if spec is not None and spec.method == "eagle3" and spec.draft_model_config is not None:
            pol = policy_of(spec.draft_model_config.hf_config)
        runner._eyas_hybrid = Hybrid(pol, int(spec.num_speculative_tokens), int(runner.max_model_len)) \
            if pol else None
    return runner._eyas_hybrid


def _wrap(orig):
    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, *args, **kwargs):
        drafts = orig(self, scheduler_output, sampled_token_ids, *args, **kwargs)
        hybrid = _hybrid_of(self)
        if hybrid is None or not hasattr(drafts, "shape") or drafts.dim() != 2:
            return drafts
        return hybrid.step(self, sampled_token_ids, drafts)

    propose_draft_token_ids.eyas_hybrid = True
    return propose_draft_token_ids


def register() -> None:
    """vLLM general plugin: wrap the runner's draft proposal (idempotent; off with EYAS_HYBRID=0)."""
    if os.environ.get("EYAS_HYBRID", "1") == "0":
        return
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError:  # another vLLM layout: the draft serves alone
        return
    if not getattr(GPUModelRunner.propose_draft_token_ids, "eyas_hybrid", False):
        GPUModelRunner.propose_draft_token_ids = _wrap(GPUModelRunner.propose_draft_token_ids)
