"""One vLLM server, two proposers (#31, step 2): the EAGLE-3 draft, and prompt lookup per request and step.

A `vllm.general_plugins` entry point (pyproject: `eyas_hybrid`), so it runs in every vLLM process,
on CPUs and GPUs. It wraps vLLM's `GPUModelRunner.propose_draft_token_ids` (the CPU runner inherits
it): the draft proposes as always (its forward keeps its KV cache), then, when the served EAGLE-3
draft's config.json names a lookup policy, each decoding request's history is looked up with vLLM's
own n-gram matcher (or Arctic Inference's suffix trees, as vLLM's suffix proposer runs them) and the rule (`eyas.draft.hybrid.rule`) picks, per request, the draft's k tokens or
the lookup's (padded to k with the draft's, which greedy verification accepts only where they are
the target's own tokens: the output is the target's whatever is proposed).

    config.json  "eyas_lookup": {"rule": "lookup>draft", "ngram": [2, 4]}    (eyas export --lookup)
                 "eyas_lookup": {"rule": "lookup>draft", "suffix": {"max_tree_depth": 24, ...}}
                 (suffix decoding, Arctic Inference's trees over the prompt and every earlier response)
    EYAS_HYBRID=0                     serve the draft alone (vLLM without eyas does the same)
    EYAS_HYBRID_STATS=FILE            per-source counts, rewritten each step: verified proposals, accepted tokens

A request's history at this point (before vLLM's bookkeeping, in the padded-batch path it drafts in)
is `input_batch.token_ids_cpu[i, :num_tokens_no_spec[i]]` plus its valid sampled tokens this step;
requests in a partial prefill (`discard_request_mask`) are left alone. The accepted count of the
previous proposal is read off this step's valid sampled tokens (all but the bonus token).

Sampling stays lossless: by default vLLM verifies EAGLE drafts as if their tokens were one-hot (no draft
probabilities), so any proposal keeps the target's distribution; with `draft_sample_method:
probabilistic` the lookup's rows of the draft's probabilities are made one-hot (`Hybrid._one_hot`).
(On vLLM 0.32 CPU any sampled speculation also needs eyas.vllm_fixes' SPEC_SAMPLING_EXPAND.)

Model Runner V2 (the GPU default in recent vLLM) has no propose_draft_token_ids: the plugin adds a draft
with a lookup policy to vLLM's list of what V2 does not support, so vLLM picks the V1 runner and logs why
(`_v1_for_policies`; Arctic Inference asks users for VLLM_USE_V2_MODEL_RUNNER=0 instead, which works too).
Not run on a GPU.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

POLICY_KEY = "eyas_lookup"


def parse_lookup(spec: str, k: int = 3) -> dict[str, Any] | None:
    """`none` -> None; `ngram:MIN:MAX[:RULE]` or `suffix[:RULE]` -> the policy a draft's config.json carries
    (RULE: a name of eyas.draft.hybrid.rule, default lookup>draft; suffix: vLLM's default tree settings)."""
    if spec in ("", "none"):
        return None
    if spec == "auto":
        raise ValueError("export.lookup=auto: only `eyas run` can pick a policy (it serves each of "
                         "export.lookup_candidates on the eval prompts); here name one: ngram:MIN:MAX[:RULE] or none")
    if spec == "suffix" or spec.startswith("suffix:"):
        name = spec.partition(":")[2] or "lookup>draft"
        _check_rule(spec, name, k)
        return {"rule": name, "suffix": dict(SUFFIX_DEFAULTS)}
    parts = spec.split(":", 3)
    if parts[0] != "ngram" or len(parts) < 3 or not (parts[1].isdigit() and parts[2].isdigit()) \
            or not 1 <= int(parts[1]) <= int(parts[2]):
        raise ValueError(f"export.lookup={spec!r}: expected none, ngram:MIN:MAX[:RULE] with 1 <= MIN <= MAX "
                         "(e.g. ngram:2:4:lookup>draft) or suffix[:RULE]")
    from eyas.draft.hybrid import rule

    name = parts[3] if len(parts) == 4 else "lookup>draft"
    _check_rule(spec, name, k)
    return {"rule": name, "ngram": [int(parts[1]), int(parts[2])]}


# vLLM's own defaults for method "suffix" (SpeculativeConfig.suffix_decoding_*)
SUFFIX_DEFAULTS = {"max_tree_depth": 24, "max_cached_requests": 10000, "max_spec_factor": 1.0, "min_token_prob": 0.1}


def _check_rule(spec: str, name: str, k: int) -> None:
    from eyas.draft.hybrid import rule

    rule(name, k)  # an unknown rule is a ValueError naming the known ones
    if name.startswith("conf<"):
        raise ValueError(f"export.lookup={spec!r}: a conf<C rule needs the draft's probabilities, which vLLM's greedy "
                         "draft does not compute; it is for `eyas bench rules` only (serve lookup>draft, lookupL>=M or "
                         "agree)")


def policy_spec(policy: dict[str, Any] | None) -> str:
    """The `export.lookup` spelling of a policy (inverse of parse_lookup)."""
    if not policy:
        return "none"
    if "suffix" in policy:
        return f"suffix:{policy.get('rule', 'lookup>draft')}"
    lo, hi = policy.get("ngram", (2, 4))
    return f"ngram:{lo}:{hi}:{policy.get('rule', 'lookup>draft')}"


HYBRID = "hybrid"  # a bench method: the draft with prompt lookup beside it, `hybrid`, `hybrid:ngram:MIN:MAX[:RULE]`
# or `hybrid:suffix[:RULE]`


def is_hybrid(method: str | os.PathLike | None) -> bool:
    return method is not None and (str(method) == HYBRID or str(method).startswith(HYBRID + ":"))


def with_policy(draft: str | os.PathLike, policy: dict[str, Any] | None, dest: str | os.PathLike | None = None) -> Path:
    """A directory that serves `draft`'s weights with `policy` (None: the draft alone) in its config.json; every
    other file is a symlink into `draft`, nothing is copied or changed there. `dest`: where (default: a temp dir
    named by the draft and the policy, reused)."""
    import hashlib
    import tempfile

    src = Path(draft).resolve()
    config = json.loads((src / "config.json").read_text())
    config.pop(POLICY_KEY, None)
    if policy:
        config[POLICY_KEY] = policy
    if dest is None:
        tag = hashlib.sha256(f"{src}|{json.dumps(policy, sort_keys=True)}".encode()).hexdigest()[:16]
        dest = Path(tempfile.gettempdir()) / f"eyas-served-{os.getuid()}" / tag
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        link = dest / f.name
        if f.name == "config.json" or link.is_symlink() and link.resolve() == f.resolve():
            continue
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(f)
    tmp = dest / f".config.json.tmp.{os.getpid()}"
    tmp.write_text(json.dumps(config, indent=2) + "\n")
    os.replace(tmp, dest / "config.json")
    return dest


def hybrid_method(method: str, draft: str | os.PathLike | None, k: int = 3) -> Path:
    """A bench method `hybrid[:ngram:MIN:MAX[:RULE]|:suffix[:RULE]]` -> the draft dir to serve: `draft` with that policy
    (bare `hybrid`: the draft's own exported policy, else ngram:2:4:lookup>draft)."""
    if draft is None or str(draft).lower() in ("", "none") or str(draft).startswith("ngram"):
        raise ValueError(f"method {method!r}: a hybrid needs an exported EAGLE-3 draft dir (--draft DIR)")
    if method == HYBRID:
        own = json.loads((Path(draft) / "config.json").read_text()).get(POLICY_KEY)
        policy = dict(own) if own else parse_lookup("ngram:2:4", k)
    else:
        policy = parse_lookup(method[len(HYBRID) + 1:], k)
    return with_policy(draft, policy)


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
        self.suffix = None
        if "suffix" in policy:  # Arctic Inference's suffix trees, as vLLM's SuffixDecodingProposer runs them
            from arctic_inference.suffix_decoding import SuffixDecodingCache

            self.sx = {**SUFFIX_DEFAULTS, **policy["suffix"]}
            self.suffix = SuffixDecodingCache(max_tree_depth=int(self.sx["max_tree_depth"]),
                                              max_cached_requests=int(self.sx["max_cached_requests"]))
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
            if self.suffix is not None:
                lk, m = self._suffix(batch, i, req_id, hist, valid)
            else:
                lk, m = lookup(hist, self.ngram[0], self.ngram[1], self.k, self.max_model_len)
            draft = out[i].tolist()
            prop, source = self.rule(draft, 1.0, lk, m)
            if source == "lookup" and prop:
                row = (prop + draft[len(prop):])[: self.k]
                out[i, : len(row)] = torch.tensor(row, dtype=out.dtype)
                self._one_hot(runner, req_id, lk)
                changed = True
            else:
                source = "draft"
            self.prev[req_id] = source
        live = set(batch.req_ids)
        self.prev = {r: s for r, s in self.prev.items() if r in live}
        if self.suffix is not None:  # finished requests: their responses stay in the cache's global tree
            for req_id in self.suffix.active_requests - live:
                self.suffix.stop_request(req_id)
        if self.stats_path:
            tmp = f"{self.stats_path}.tmp.{os.getpid()}"
            with open(tmp, "w") as f:
                source = {"suffix": self.sx} if self.suffix is not None else {"ngram": list(self.ngram)}
                json.dump({"rule": self.name, **source, **self.stats}, f)
            os.replace(tmp, self.stats_path)
        if changed:
            drafts.copy_(out.to(drafts.device))
        return drafts


    def _suffix(self, batch: Any, i: int, req_id: str, hist: Any, valid: list[int]) -> tuple[list[int], int]:
        """Suffix decoding's proposal for request i (its prompt's tree and every earlier response's), and the
        length of the suffix it matched: what vLLM's SuffixDecodingProposer.propose does for one request."""
        import numpy as np

        cache = self.suffix
        if req_id not in cache.active_requests:
            if req_id in cache.cached_requests:
                cache.evict_cached_response(req_id)
            index = batch.req_id_to_index[req_id]
            cache.start_request(req_id, batch.token_ids_cpu[index, : batch.num_prompt_tokens[index]])
        cache.add_active_response(req_id, valid)
        n = len(hist)
        if n >= self.max_model_len - 1:
            return [], 0
        pattern = np.ascontiguousarray(hist[max(0, n - int(self.sx["max_tree_depth"])):])
        d = cache.speculate(req_id, pattern, max_spec_tokens=min(self.k, self.max_model_len - n - 1),
                            max_spec_factor=float(self.sx["max_spec_factor"]),
                            min_token_prob=float(self.sx["min_token_prob"]))
        return list(d.token_ids), int(d.match_len)

    @staticmethod
    def _one_hot(runner: Any, req_id: str, tokens: list[int]) -> None:
        """With `draft_sample_method: probabilistic` vLLM verifies against the draft's probabilities
        (runner._draft_probs [num_reqs, k, V]): the lookup's tokens were not drawn from them, so their rows
        become one-hot on those tokens (what vLLM assumes for n-gram, which has none). The draft's tokens after
        a shorter lookup keep their rows: they were drawn from them. Greedy batches carry no probabilities."""
        probs, ids = getattr(runner, "_draft_probs", None), getattr(runner, "_draft_prob_req_ids", None)
        if os.environ.get("EYAS_HYBRID_ONE_HOT", "1") == "0":  # only the lossless test's negative control
            return
        if probs is None or ids is None or req_id not in ids:
            return
        row = ids.index(req_id)
        n = min(len(tokens), probs.shape[1])
        probs[row, :n] = 0
        probs[row, range(n), tokens[:n]] = 1


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
    try:
        from vllm.config import VllmConfig
    except ImportError:
        return
    cur = getattr(VllmConfig, "_get_v2_model_runner_unsupported_features", None)
    if cur is not None and not getattr(cur, "eyas_hybrid", False):
        VllmConfig._get_v2_model_runner_unsupported_features = _v1_for_policies(cur)


V2_REASON = "eyas's prompt lookup beside the EAGLE-3 draft (eyas.hybrid_serve)"


def _v1_for_policies(orig):
    """Model Runner V2 (the GPU default) has no propose_draft_token_ids to wrap: a served draft that names a
    lookup policy is one more feature V2 does not support, so vLLM picks the V1 runner itself and logs why
    ("Model Runner V2 does not yet support ...; using the V1 model runner instead"). An explicit
    VLLM_USE_V2_MODEL_RUNNER=1 still wins (then the draft serves alone)."""
    def unsupported(self):
        out = list(orig(self))
        spec = getattr(self, "speculative_config", None)
        dm = getattr(spec, "draft_model_config", None) if spec is not None else None
        if spec is not None and spec.method == "eagle3" and dm is not None and policy_of(dm.hf_config):
            out.append(V2_REASON)
        return out

    unsupported.eyas_hybrid = True
    return unsupported
