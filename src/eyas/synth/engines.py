"""Engines for synthesis: prompt token ids in, completions out.

Both engines take the ids eyas.chat rendered with the serving template, so the target
runs exactly those ids: in-process through `vllm.LLM.generate(TokensPrompt)`, over HTTP
through `/v1/completions` with the prompt as a list of ids. Any HF model dir works as a
target, a quantized one (`eyas quantize --emulate`) included; vLLM is imported lazily.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from eyas.host import apply_vllm_env, engine_dtype
from eyas.vllm_fixes import engine_options

RETRIES = 5  # tries per request / connection before an endpoint counts as unreachable
BACKOFF_S = 1.0  # first wait between tries, doubled each time
TIMEOUT_S = 600.0  # one HTTP request


class EngineError(RuntimeError):
    """The engine cannot serve at all (unreachable endpoint, dead server)."""


@dataclass(frozen=True)
class Request:
    prompt_ids: list[int]  # [T] rendered by eyas.chat.render_prompt_ids
    max_tokens: int
    seed: int


@dataclass
class Completion:
    text: str = ""
    completion_tokens: int = 0
    prompt_tokens: int = 0
    finish_reason: str = ""
    error: str | None = None  # a request the engine refused (the run goes on without it)
    # synth.capture: (token ids [T] = prompt + reply[:-1], states [T, n_ids, H], seen bool [T]), see eyas.synth.capture
    captured: tuple | None = None


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0


OnDone = Callable[[Completion], None]
Then = Callable[[object, Completion], "Request | None"]  # (tag, its completion) -> the tag's next request, or None
# `stream`'s first requests: pulled one at a time, as a slot frees, so the caller may stop handing out new
# conversations (a time budget) while the replies already in the engine finish
Firsts = Iterable[tuple[object, Request]]


class InProcessEngine:
    """`vllm.LLM` in this process; build it under `if __name__ == "__main__":` (spawned workers)."""

    def __init__(self, model: str, *, max_model_len: int = 2048, kv_cache_gib: float = 2.0, seed: int = 0,
                 enforce_eager: bool = True, dtype: str = "", max_num_seqs: int = 256,
                 capture_ids: list[int] | None = None):
        """`capture_ids`: vLLM layer ids whose hidden states each completion carries (`Completion.captured`)."""
        from vllm import LLM

        from eyas.synth.capture import EXTENSION

        apply_vllm_env()
        dtype = dtype or engine_dtype()
        self.model, self.dtype, self.max_num_seqs = str(model), dtype, max_num_seqs
        self.capture = bool(capture_ids)
        extra = {"worker_extension_cls": EXTENSION} if self.capture else {}
        # VLLM_CPU_KVCACHE_SPACE, when set, overrides kv_cache_memory_bytes on CPU (vLLM's rule).
        try:
            self.llm = LLM(model=str(model), max_model_len=max_model_len, dtype=dtype, seed=seed,
                           kv_cache_memory_bytes=int(kv_cache_gib * (1 << 30)), enforce_eager=enforce_eager,
                           max_num_seqs=max_num_seqs, disable_log_stats=True, **engine_options(model), **extra)
            if self.capture:
                self.llm.collective_rpc("eyas_capture_start", args=(sorted(capture_ids),))
        except Exception as e:  # noqa: BLE001 - vLLM refuses this model or machine (its log above says why)
            raise self._refused(e) from None
        self.max_model_len = self.llm.llm_engine.model_config.max_model_len

    def _completions(self, outs: list) -> list[Completion]:
        """vLLM's finished RequestOutputs -> Completions (with their captured states under synth.capture)."""
        from eyas.synth.capture import take

        if not outs:
            return []
        caps = take(self.llm, [o.request_id for o in outs]) if self.capture else [None] * len(outs)
        res = []
        for o, cap in zip(outs, caps, strict=True):
            c = o.outputs[0]
            # the tokens the states belong to: the prompt and the reply but its last (sampled, never fed back)
            captured = (list(o.prompt_token_ids) + list(c.token_ids)[:-1], *cap) if cap is not None else None
            res.append(Completion(c.text, len(c.token_ids), len(o.prompt_token_ids), str(c.finish_reason),
                                  captured=captured))
        return res

    def _refused(self, e: Exception) -> ValueError:
        """vLLM could not start or run the target (an unsupported model or layout, out of memory): one
        line naming it; the root cause is in vLLM's log above."""
        last = str(e).strip().splitlines()[-1:] or [type(e).__name__]
        return ValueError(f"vLLM could not run the target {self.model}: {last[0][:500]} "
                          "(vLLM's log above has the root cause; check the model is one vLLM supports on this "
                          "machine; what was written so far is kept: re-run to resume)")

    def generate(self, reqs: list[Request], sampling: Sampling, on_done: OnDone | None = None) -> list[Completion]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.v1.engine.exceptions import EngineDeadError

        params = [SamplingParams(max_tokens=r.max_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
                                 seed=r.seed) for r in reqs]
        try:
            outs = self.llm.generate([TokensPrompt(prompt_token_ids=r.prompt_ids) for r in reqs], params,
                                     use_tqdm=False)
        except ValueError as e:  # a request vLLM refuses; the engine itself is fine
            return [Completion(error=f"vLLM refused the batch: {e}") for _ in reqs]
        except EngineDeadError as e:  # the engine started lazily and died on its first step
            raise self._refused(e) from None
        res = self._completions(outs)
        for c in res:
            if on_done:
                on_done(c)
        return res

    def stream(self, first: Firsts, sampling: Sampling, then: Then) -> None:
        """Continuous turns: each tag's next request (`then(tag, completion)`) enters the engine as soon as
        its previous one is done, and a new tag from `first` whenever fewer than `max_num_seqs` requests are
        in flight, so the engine keeps its batch full while conversations move through their turns at their
        own pace (and `first` is only read as far as the engine has room)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.v1.engine.exceptions import EngineDeadError

        eng, live, n, firsts = self.llm.llm_engine, {}, 0, iter(first)

        def add(tag: object, r: Request | None) -> None:
            nonlocal n
            while r is not None:
                n += 1
                params = SamplingParams(max_tokens=r.max_tokens, temperature=sampling.temperature,
                                        top_p=sampling.top_p, seed=r.seed)
                try:
                    eng.add_request(f"eyas-{n}", TokensPrompt(prompt_token_ids=r.prompt_ids), params)
                except ValueError as e:  # a request vLLM refuses; the engine itself is fine
                    r = then(tag, Completion(error=f"vLLM refused the request: {e}"))
                    continue
                live[f"eyas-{n}"] = tag
                return

        def fill() -> None:
            while len(live) < self.max_num_seqs and (item := next(firsts, None)) is not None:
                add(*item)

        fill()
        try:
            while live:
                done = [o for o in eng.step() if o.finished]
                for o, c in zip(done, self._completions(done)):
                    tag = live.pop(o.request_id)
                    add(tag, then(tag, c))
                fill()
        except EngineDeadError as e:
            raise self._refused(e) from None

    def close(self) -> None:
        del self.llm


class EndpointEngine:
    """OpenAI-compatible `vllm serve` endpoints; `concurrency` requests in flight on each.

    Connection errors, 5xx and 429 are retried with exponential backoff; after `retries`
    tries the endpoint counts as unreachable and `generate` raises EngineError. Other 4xx
    answers fail that request only.
    """

    def __init__(self, urls: list[str], concurrency: int = 8, retries: int | None = None,
                 backoff_s: float | None = None):
        import requests

        if not urls:
            raise ValueError("EndpointEngine needs at least one endpoint URL")
        self.urls = [u.rstrip("/").removesuffix("/v1") for u in urls]
        self.concurrency = max(1, concurrency)
        self.retries = RETRIES if retries is None else retries
        self.backoff_s = BACKOFF_S if backoff_s is None else backoff_s
        self._local = threading.local()
        self._requests = requests
        self.models = {u: self._call(u, "GET", "/v1/models")["data"][0]["id"] for u in self.urls}
        self.max_model_len = min(
            self.tokenize_chat([{"role": "user", "content": "hi"}], u)[1] or 1 << 30 for u in self.urls
        )

    def _session(self):
        if not hasattr(self._local, "s"):
            self._local.s = self._requests.Session()
        return self._local.s

    def _call(self, url: str, method: str, path: str, body: dict | None = None) -> dict:
        """One HTTP call with retries; a 4xx other than 408/429 raises ValueError at once."""
        last = ""
        for i in range(self.retries):
            if i:
                time.sleep(self.backoff_s * 2 ** (i - 1))
            try:
                r = self._session().request(method, url + path, json=body, timeout=TIMEOUT_S)
            except self._requests.RequestException as e:
                last = f"{type(e).__name__}: {e}"
                continue
            if r.status_code < 400:
                return r.json()
            last = f"HTTP {r.status_code}: {r.text[:300]}"
            if r.status_code < 500 and r.status_code not in (408, 429):
                raise ValueError(last)
        raise EngineError(
            f"endpoint {url} unreachable: {method} {path} failed {self.retries} times, last: {last}. "
            f"Is a vLLM OpenAI server running there (`python -m vllm.entrypoints.openai.api_server --model DIR`)?"
        )

    def tokenize_chat(self, messages: list[dict], url: str | None = None) -> tuple[list[int], int | None]:
        """The server's own rendering of a chat (its /tokenize) and its max_model_len."""
        url = url or self.urls[0]
        body = {"model": self.models[url], "messages": messages, "add_generation_prompt": True}
        out = self._call(url, "POST", "/tokenize", body)
        return out["tokens"], out.get("max_model_len")

    def _complete(self, url: str, r: Request, sampling: Sampling) -> Completion:
        body = {"model": self.models[url], "prompt": r.prompt_ids, "max_tokens": r.max_tokens,
                "temperature": sampling.temperature, "top_p": sampling.top_p, "seed": r.seed}
        try:
            out = self._call(url, "POST", "/v1/completions", body)
        except ValueError as e:
            return Completion(error=str(e))
        c, usage = out["choices"][0], out["usage"]
        return Completion(c["text"], usage["completion_tokens"], usage["prompt_tokens"], str(c["finish_reason"]))

    def generate(self, reqs: list[Request], sampling: Sampling, on_done: OnDone | None = None) -> list[Completion]:
        res: list[Completion | None] = [None] * len(reqs)

        def keep(i: object, c: Completion) -> None:
            res[i] = c  # type: ignore[index]
            if on_done:
                on_done(c)

        self.stream(list(enumerate(reqs)), sampling, keep)
        assert all(r is not None for r in res)
        return res  # type: ignore[return-value]

    def stream(self, first: Firsts, sampling: Sampling, then: Then) -> None:
        """Continuous turns: `concurrency` conversations in flight per endpoint, each taking its turns
        one after another (`then(tag, completion)` gives its next request), the next conversation
        taken from `first` as soon as one is done."""
        firsts = iter(first)
        fatal: list[EngineError] = []
        lock = threading.Lock()

        def worker(url: str) -> None:
            while not fatal:
                with lock:
                    item = next(firsts, None)
                if item is None:
                    return
                tag, r = item
                while r is not None and not fatal:
                    try:
                        c = self._complete(url, r, sampling)
                    except EngineError as e:
                        fatal.append(e)
                        return
                    with lock:
                        r = then(tag, c)

        threads = [threading.Thread(target=worker, args=(u,), daemon=True)
                   for u in self.urls for _ in range(self.concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if fatal:
            raise fatal[0]

    def close(self) -> None:
        pass
