"""Stage 2: extraction parity (hf, vllm) against an independent HF fp32 forward, the loss mask,
offline resume after SIGKILL, fp8 storage, streaming backpressure and crash handling."""

import dataclasses
import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from eyas.config import ExtractConfig

CONVS = [
    {"id": "a", "domain": "test", "messages": [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "6, of course."},
    ]},
    {"id": "b", "domain": "test", "messages": [
        {"role": "user", "content": "Name the colour of a clear daytime sky and say why."},
        {"role": "assistant", "content": "Blue: air scatters short wavelengths (Rayleigh scattering) the most."},
        {"role": "user", "content": "Thanks!"},
        {"role": "assistant", "content": "You're welcome."},
    ]},
]
ERRORS: dict[str, float] = {}  # parity errors measured, printed at the end of a test


def write_convs(path: Path, n: int) -> Path:
    from pydoc_data.topics import topics

    keys = sorted(topics)
    with open(path, "w") as f:
        for i in range(n):
            words = topics[keys[i]].split()
            a = 30 + 5 * (i % 9)
            msgs = [{"role": "system", "content": "You are helpful."},
                    {"role": "user", "content": f"Explain {keys[i]}."},
                    {"role": "assistant", "content": " ".join(words[:a]) or keys[i]},
                    {"role": "user", "content": "More."},
                    {"role": "assistant", "content": " ".join(words[a : 2 * a]) or "Done."}]
            f.write(json.dumps({"id": f"c{i}", "domain": "pydoc", "messages": msgs}) + "\n")
    return path


def glob_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ over all tokens (the parity metric)."""
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def tok_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean over tokens of the per-token relative error: not dominated by attention-sink tokens."""
    a, b = a.float(), b.float()
    return ((a - b).norm(dim=-1) / b.norm(dim=-1)).mean().item()


@functools.lru_cache(maxsize=1)
def _fp32_model(target: Path):
    from eyas.target import load_language_model

    return load_language_model(target, torch.float32).eval()  # a multimodal wrapper's language model


def hf_reference(target: Path, input_ids: torch.Tensor):
    """Independent HF fp32 forward -> (hidden_states [L+1] of [T, H], layer L's raw output,
    final norm applied to it, lm_head(hidden_states[L]), logits)."""
    model = _fp32_model(Path(target))
    pre = {}
    hook = model.model.layers[-1].register_forward_hook(
        lambda m, a, o: pre.setdefault("x", o[0] if isinstance(o, tuple) else o))
    try:
        with torch.no_grad():
            out = model(input_ids[None], output_hidden_states=True)
            normed = model.model.norm(pre["x"])
            lm = model.lm_head(out.hidden_states[-1])
    finally:
        hook.remove()
    return [h[0] for h in out.hidden_states], pre["x"][0], normed[0], lm[0], out.logits[0]


def check_parity(name: str, target: Path, samples: list[dict], layer_ids: list[int], tol: float, last_tol: float):
    for s in samples:
        hs, pre, normed, lm, logits = hf_reference(target, s["input_ids"])
        L = len(hs) - 1
        # HF hidden_states[L] is after the final norm (the lm_head input), not layer L's raw output
        assert torch.allclose(hs[L], normed, atol=1e-5) and glob_err(pre, hs[L]) > 0.1
        assert torch.allclose(lm, logits, atol=1e-4)
        aux = s["aux_hidden_states"]
        assert aux.shape == (s["input_ids"].shape[0], len(layer_ids), hs[0].shape[-1])
        for j, k in enumerate(layer_ids):
            e = glob_err(aux[:, j], hs[k])
            ERRORS[f"{name} {s['id']} layer {k}"] = e
            assert e < tol, (name, k, e)
            # off-by-one guard: id k is HF hidden_states[k], clearly closer than k-1 or k+1
            near = tok_err(aux[:, j], hs[k])
            for kk in (k - 1, k + 1):
                if 0 <= kk < L:
                    assert near < 0.25 * tok_err(aux[:, j], hs[kk]), (name, k, kk, near)
        e = glob_err(s["last_hidden_states"], hs[L])
        ERRORS[f"{name} {s['id']} last"] = e
        assert e < last_tol, (name, "last", e)


def print_errors(title: str) -> None:
    print(f"\n{title}")
    for k, v in ERRORS.items():
        print(f"  {k:<40} {100 * v:.3f}%")
    ERRORS.clear()


# ---------------------------------------------------------------- interface, rendering

def test_layer_ids():
    from eyas.target import default_layer_ids, resolve_layer_ids

    assert default_layer_ids(30) == [2, 15, 27]
    assert default_layer_ids(4) == [1, 2, 3]
    assert resolve_layer_ids([27, 2, 15], 30) == [2, 15, 27]
    for bad, msg in (([2, 30], "outside"), ([2, 2, 5], "repeat"), ([-1, 3], "outside")):
        with pytest.raises(ValueError, match=msg):
            resolve_layer_ids(bad, 30)


def test_loss_mask_golden(tiny_llama):
    """ChatML, system prompt, two assistant turns: exactly the assistant contents + <|im_end|>."""
    from eyas.extract import make_extractor

    with make_extractor(tiny_llama, "hf", [1, 2, 3]) as ex:
        s = ex.extract([CONVS[0]])[0]
        tok = ex.renderer.tokenizer
    ids, mask = s["input_ids"], s["loss_mask"]
    assert mask.dtype == torch.bool and ids.dtype == torch.int64
    assert tok.decode(ids[mask]) == "4.<|im_end|>6, of course.<|im_end|>"
    runs, cur = [], []
    for t, m in zip(ids.tolist(), mask.tolist()):
        if m:
            cur.append(t)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    runs += [tok.decode(cur)] if cur else []
    assert runs == ["4.<|im_end|>", "6, of course.<|im_end|>"]
    assert tok.decode(ids) == (
        "<|im_start|>system\nYou are a terse assistant.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4.<|im_end|>\n<|im_start|>user\nAnd 3+3?<|im_end|>\n"
        "<|im_start|>assistant\n6, of course.<|im_end|>\n"
    )


# ---------------------------------------------------------------- hf parity

@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_moe", "embedded_target"])
def test_hf_parity(request, fixture):
    from eyas.extract import make_extractor

    target = request.getfixturevalue(fixture)
    layer_ids = None if fixture == "embedded_target" else [1, 2, 3]
    with make_extractor(target, "hf", layer_ids, compute_dtype="fp32", out_dtype=torch.float32) as ex:
        exact = ex.extract(CONVS)  # both conversations in one padded batch
        ids = ex.layer_ids
        again = ex.extract(CONVS[1:])  # online use: cheap to call again, same result
    assert torch.equal(again[0]["aux_hidden_states"], exact[1]["aux_hidden_states"]) or \
        glob_err(again[0]["aux_hidden_states"], exact[1]["aux_hidden_states"]) < 1e-5
    if fixture == "embedded_target":
        assert ids == [2, 15, 27]
    check_parity(f"{fixture} hf-fp32", target, exact, ids, tol=1e-4, last_tol=1e-4)
    with make_extractor(target, "hf", layer_ids, compute_dtype="bf16") as ex:
        bf16 = ex.extract(CONVS)
    assert bf16[0]["aux_hidden_states"].dtype == torch.bfloat16
    check_parity(f"{fixture} hf-bf16", target, bf16, ids, tol=0.02, last_tol=0.04)
    print_errors(f"hf parity vs HF fp32 hidden_states[k] ({fixture})")


# ---------------------------------------------------------------- vllm parity

@pytest.fixture(scope="module")
def tiny_moe_hd32(tmp_path_factory, embedded_target):
    """The tiny qwen3_moe with head_dim 32 (vLLM CPU attention has no head size 16 kernel)."""
    from eyas.testing import make_tiny_target

    return make_tiny_target(tmp_path_factory.mktemp("tiny_moe_hd32"), embedded_target, arch="qwen3_moe", hidden=128)


@pytest.mark.slow
@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_moe"])
def test_vllm_tiny_fixtures_unsupported(request, fixture):
    from eyas.extract import make_extractor
    from eyas.extract.vllm_backend import vllm_cpu_unsupported_reason

    target = request.getfixturevalue(fixture)
    reason = vllm_cpu_unsupported_reason(target)
    if reason is None:
        pytest.skip("this vLLM build runs head_dim 16: covered by the parity tests")
    with pytest.raises(ValueError, match="head_dim 16"):
        make_extractor(target, "vllm")  # refused up front, not after a minute of engine start
    pytest.skip(f"vLLM CPU cannot run the {fixture} fixture: {reason} (tiny_moe_hd32 covers qwen3_moe)")


@pytest.mark.slow
def test_vllm_parity_embedded(embedded_target):
    from eyas.extract import make_extractor

    with make_extractor(embedded_target, "vllm", max_len=512, compute_dtype="bf16") as ex:
        out = ex.extract(CONVS)
        assert ex.vllm_ids == [2, 15, 27, 30]  # the final (pre-norm) state is requested as id L
        t0 = time.time()
        again = ex.extract(CONVS[:1])
        assert time.time() - t0 < 30
    assert torch.equal(again[0]["aux_hidden_states"], out[0]["aux_hidden_states"])
    check_parity("embedded vllm-bf16", embedded_target, out, [2, 15, 27], tol=0.06, last_tol=0.06)
    print_errors("vllm parity vs HF fp32 hidden_states[k] (embedded target)")


@pytest.mark.slow
def test_vllm_offline_moe(tmp_path, tiny_moe_hd32):
    """The whole offline path through vLLM on a qwen3_moe target: render, vLLM, shards, read back."""
    from eyas.extract import extract
    from eyas.features import open_features, verify_features

    data = tmp_path / "convs.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in CONVS))
    cfg = ExtractConfig(target=str(tiny_moe_hd32), data=str(data), out=str(tmp_path / "feat"), backend="vllm",
                        layer_ids=[1, 2, 3], max_len=512)
    extract(cfg)
    verify_features(tmp_path / "feat")
    ds = open_features(tmp_path / "feat")
    assert ds.manifest["backend"] == "vllm" and ds.layer_ids == [1, 2, 3]
    check_parity("tiny_moe_hd32 vllm-bf16", tiny_moe_hd32, list(ds), [1, 2, 3], tol=0.06, last_tol=0.06)
    print_errors("vllm parity vs HF fp32 hidden_states[k] (tiny qwen3_moe, head_dim 32)")


# ---------------------------------------------------------------- offline: fp8, resume

def test_offline_fp8_vs_bf16(tmp_path, tiny_llama):
    from eyas.extract import extract
    from eyas.features import open_features

    data = write_convs(tmp_path / "convs.jsonl", 6)
    base = ExtractConfig(target=str(tiny_llama), data=str(data), layer_ids=[1, 2, 3], samples_per_shard=4, max_len=96)
    extract(dataclasses.replace(base, out=str(tmp_path / "bf16")))
    extract(dataclasses.replace(base, out=str(tmp_path / "fp8"), dtype="fp8"))
    a, b = open_features(tmp_path / "bf16"), open_features(tmp_path / "fp8")
    assert a.manifest["truncated"] > 0 and max(a.lengths) == 96  # long conversations are cut and counted
    for x, y in zip(a, b):
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["loss_mask"], y["loss_mask"])
        assert tok_err(y["aux_hidden_states"], x["aux_hidden_states"]) < 0.04
        assert tok_err(y["last_hidden_states"], x["last_hidden_states"]) < 0.04
    assert b.manifest["bytes"] < 0.56 * a.manifest["bytes"]
    man = a.manifest
    for key in ("target", "layer_ids", "dtype", "hidden_size", "num_target_layers", "tokenizer_hash",
                "template_hash", "num_samples", "num_tokens", "bytes", "complete"):
        assert key in man, key
    assert all("sha256" in s for s in man["shards"])
    extract(dataclasses.replace(base, out=str(tmp_path / "bf16")))  # complete: skipped, nothing rewritten
    assert open_features(tmp_path / "bf16").manifest["created"] == man["created"]


def test_offline_refuses_empty_input(tmp_path, tiny_llama):
    """An empty conversations file, or one whose conversations have no assistant token within max_len,
    is an error naming the file, never a complete 0-sample feature dir."""
    from eyas.extract import extract

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match=r"empty.jsonl: no conversations"):
        extract(ExtractConfig(target=str(tiny_llama), data=str(empty), out=str(tmp_path / "f1"), backend="hf"))
    assert not (tmp_path / "f1").exists()
    noasst = tmp_path / "noasst.jsonl"
    noasst.write_text(json.dumps({"id": "a", "messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(ValueError, match=r"noasst.jsonl: none of its 1 conversations has an assistant token"):
        extract(ExtractConfig(target=str(tiny_llama), data=str(noasst), out=str(tmp_path / "f2"), backend="hf"))
    assert json.loads((tmp_path / "f2" / "manifest.json").read_text())["complete"] is False


def test_offline_killed_resumes(tmp_path, tiny_llama):
    """SIGKILL `eyas extract` after its first shard; the rerun finishes; shards verify; no id twice."""
    from eyas.extract import make_extractor
    from eyas.features import open_features, verify_features

    data = write_convs(tmp_path / "convs.jsonl", 60)
    out = tmp_path / "feat"
    cmd = [sys.executable, "-m", "eyas.cli", "extract", "--target", str(tiny_llama), "--data", str(data),
           "--out", str(out), "--samples-per-shard", "2", "--layer-ids", "1", "2", "3"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    man_path = out / "manifest.json"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if man_path.exists():
            try:
                if len(json.loads(man_path.read_text())["shards"]) >= 2:
                    break
            except (json.JSONDecodeError, KeyError):
                pass
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    partial = json.loads(man_path.read_text())
    assert not partial["complete"], "finished before the kill: make the run longer"
    n_done = partial["num_samples"]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"{n_done} already extracted" in res.stderr
    rep = verify_features(out)
    assert rep["samples"] == 60
    ds = open_features(out)
    assert sorted(ds.ids) == sorted(f"c{i}" for i in range(60))
    with make_extractor(tiny_llama, "hf", [1, 2, 3]) as ex:
        for i in (0, len(ds) - 1):
            ref = ex.extract([{"id": ds.ids[i], "input_ids": ds[i]["input_ids"]}])[0]
            assert tok_err(ds[i]["aux_hidden_states"], ref["aux_hidden_states"]) < 0.01


# ---------------------------------------------------------------- streaming

def start_producer(target, data, address, *extra):
    cmd = [sys.executable, "-m", "eyas", "extract", "--mode", "streaming", "--target", str(target), "--data", str(data),
           "--connect", address, "--layer-ids", "1", "2", "3", *extra]
    return subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def test_stream_wire_roundtrip():
    from eyas.extract.stream import decode_sample, encode_sample

    s = {"id": "x", "input_ids": torch.arange(7), "loss_mask": torch.tensor([0, 1, 1, 0, 1, 1, 1]).bool(),
         "aux_hidden_states": torch.randn(7, 3, 16).bfloat16(), "last_hidden_states": torch.randn(7, 16).bfloat16()}
    frames = [bytes(f) if not isinstance(f, bytes) else f for f in encode_sample(s)]
    r = decode_sample(frames)
    assert r["id"] == "x" and all(torch.equal(r[k], s[k]) for k in s if k != "id")


def test_stream_backpressure(tmp_path, tiny_llama):
    """A fast producer and a slow consumer: the queue never exceeds the window, the producer blocks."""
    from eyas.extract import make_extractor
    from eyas.extract.stream import StreamConsumer

    data = write_convs(tmp_path / "convs.jsonl", 16)
    window = 2
    consumer = StreamConsumer("tcp://127.0.0.1:0", num_producers=1, window=window, connect_timeout=120)
    proc = start_producer(tiny_llama, data, consumer.address, "--batch-tokens", "256", "--max-len", "256")
    got = []
    try:
        info = consumer.wait_ready()
        assert info["layer_ids"] == [1, 2, 3] and info["hidden_size"] == 64
        for s in consumer:
            got.append(s)
            time.sleep(0.25)  # the slow trainer
    finally:
        consumer.close()
        assert proc.wait(timeout=60) == 0, proc.stderr.read()[-3000:]
    st = consumer.stats
    print(f"\nstream stats: {st}")
    assert [s["id"] for s in got] == [f"c{i}" for i in range(16)]
    assert st["max_queued"] <= window  # the bound: credits, not the producer's speed
    per_sample = max(s["aux_hidden_states"].numel() * 2 + s["last_hidden_states"].numel() * 2 + 9 * s["input_ids"].numel()
                     for s in got)
    assert st["max_queued_bytes"] <= window * per_sample
    (prod,) = st["producers"].values()
    assert prod["sent"] == 16 and prod["blocked_s"] > 1.0  # the producer waited for credit
    with make_extractor(tiny_llama, "hf", [1, 2, 3], max_len=256) as ex:
        ref = ex.extract([{"id": got[3]["id"], "input_ids": got[3]["input_ids"]}])[0]
    assert tok_err(got[3]["aux_hidden_states"], ref["aux_hidden_states"]) < 0.01
    assert got[3]["input_ids"].dtype == torch.int64 and got[3]["loss_mask"].dtype == torch.bool


def test_stream_producer_killed_is_an_error(tmp_path, tiny_llama):
    from eyas.extract.stream import StreamConsumer, StreamError

    data = write_convs(tmp_path / "convs.jsonl", 16)
    consumer = StreamConsumer("tcp://127.0.0.1:0", num_producers=1, window=2, connect_timeout=120,
                              disconnect_grace=1.0)
    proc = start_producer(tiny_llama, data, consumer.address)
    t_kill = None
    with pytest.raises(StreamError, match="disconnected .* without end of stream"):
        try:
            for i, _ in enumerate(consumer):
                if i == 1:
                    proc.send_signal(signal.SIGKILL)
                    proc.wait()
                    t_kill = time.time()
                time.sleep(0.1)
        finally:
            consumer.close()
    assert t_kill is not None and time.time() - t_kill < 15


def test_stream_producer_failure_is_reported(tmp_path, tiny_llama):
    from eyas.extract.stream import StreamConsumer, StreamError

    consumer = StreamConsumer("tcp://127.0.0.1:0", num_producers=1, connect_timeout=120)
    proc = start_producer(tiny_llama, tmp_path / "missing.jsonl", consumer.address)
    with pytest.raises(StreamError, match="missing.jsonl does not exist"):
        try:
            list(consumer)
        finally:
            consumer.close()
    assert proc.wait(timeout=60) != 0


def test_stream_no_producer_times_out():
    from eyas.extract.stream import StreamConsumer, StreamError

    with StreamConsumer("tcp://127.0.0.1:0", connect_timeout=1.0) as consumer:
        with pytest.raises(StreamError, match="no producer connected"):
            list(consumer)


def test_open_consumer_address():
    from eyas.extract.stream import open_consumer

    c = open_consumer("tcp://127.0.0.1:0?producers=2&window=3&timeout=5", rank=1)
    try:
        assert c.num_producers == 2 and c.window == 3 and c.idle_timeout == 5.0
        assert c.address.startswith("tcp://127.0.0.1:")
    finally:
        c.close()
    with pytest.raises(ValueError, match="unknown options"):
        open_consumer("tcp://127.0.0.1:0?prodcers=2")
