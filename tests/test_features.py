"""The feature format: shards + manifest, fp8 storage, verify, resume bookkeeping."""

import json

import pytest
import torch

from eyas.features import FeatureWriter, bytes_per_token, open_features, verify_features
from eyas.fp8 import dequantize_fp8, quantize_fp8

H, N_AUX = 64, 3


def fake_samples(n, seed=0, outliers=True):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        T = int(torch.randint(5, 40, (1,), generator=g))
        aux = torch.randn(T, N_AUX, H, generator=g) * torch.tensor([1.0, 8.0, 30.0])[None, :, None]
        if outliers:
            aux[0, :, 3] = 2000.0  # an attention-sink-like massive activation (beyond fp8's 448)
        out.append({
            "id": f"s{i}",
            "input_ids": torch.randint(0, 1000, (T,), generator=g),
            "loss_mask": torch.rand(T, generator=g) > 0.5,
            "aux_hidden_states": aux.to(torch.bfloat16),
            "last_hidden_states": torch.randn(T, H, generator=g).to(torch.bfloat16),
        })
    return out


def header(dtype="bf16"):
    return {"layer_ids": [1, 2, 3], "dtype": dtype, "hidden_size": H, "num_target_layers": 4,
            "tokenizer_hash": "t", "template_hash": "c", "max_len": 64, "target": "fake"}


def write(path, samples, dtype="bf16", per_shard=4, finish=True):
    w = FeatureWriter(path, header(dtype), samples_per_shard=per_shard)
    for s in samples:
        if s["id"] not in w.done_ids:
            w.add(s)
    if finish:
        w.finish()
    return w


def test_roundtrip_bf16_exact(tmp_path):
    samples = fake_samples(10)
    write(tmp_path / "f", samples)
    ds = open_features(tmp_path / "f")
    assert len(ds) == 10 and ds.layer_ids == [1, 2, 3] and ds.hidden_size == H
    assert ds.lengths == [s["input_ids"].shape[0] for s in samples]
    for a, b in zip(ds, samples):
        assert a["id"] == b["id"]
        assert a["input_ids"].dtype == torch.int64 and a["loss_mask"].dtype == torch.bool
        for k in ("input_ids", "loss_mask", "aux_hidden_states", "last_hidden_states"):
            assert torch.equal(a[k], b[k]), k
    assert ds[-1]["id"] == "s9"
    man = json.loads((tmp_path / "f" / "manifest.json").read_text())
    assert man["complete"] and man["num_shards"] == 3 and man["num_samples"] == 10
    assert all(len(s["sha256"]) == 64 for s in man["shards"])
    rep = verify_features(tmp_path / "f")
    assert rep["samples"] == 10 and rep["tokens"] == sum(ds.lengths)


def test_fp8_roundtrip_error_and_bytes(tmp_path):
    x = torch.randn(200, N_AUX, 576) * 5
    x[0, :, 0] = 1e4  # beyond the e4m3 range: must be clamped through the scale, never inf / nan
    q, scale = quantize_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (200, N_AUX)
    y = dequantize_fp8(q, scale, torch.float32)
    assert torch.isfinite(y).all()
    rel = ((y - x).norm(dim=-1) / x.norm(dim=-1)).max().item()
    assert rel < 0.04, rel  # 3 mantissa bits: per-element error <= 2^-4, per-vector RMS ~2-3%

    samples = fake_samples(12, seed=1)
    write(tmp_path / "bf16", samples)
    write(tmp_path / "fp8", samples, dtype="fp8")
    ds = open_features(tmp_path / "fp8")
    for a, b in zip(ds, samples):
        assert a["aux_hidden_states"].dtype == torch.bfloat16  # dequantized on read
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        for k in ("aux_hidden_states", "last_hidden_states"):
            ref = b[k].float()
            err = ((a[k].float() - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
            assert err < 0.05, (k, err)
    verify_features(tmp_path / "fp8")
    bf16 = json.loads((tmp_path / "bf16" / "manifest.json").read_text())["bytes"]
    fp8 = json.loads((tmp_path / "fp8" / "manifest.json").read_text())["bytes"]
    assert fp8 < 0.56 * bf16, (fp8, bf16)
    assert bytes_per_token(576, 3, "fp8") < 0.51 * bytes_per_token(576, 3, "bf16")


def test_verify_detects_corruption(tmp_path):
    from eyas.cli import main

    write(tmp_path / "f", fake_samples(6))
    assert main(["extract", "--verify", str(tmp_path / "f")]) == 0
    shard = tmp_path / "f" / "shard-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="shard-00001.safetensors: sha256 mismatch"):
        verify_features(tmp_path / "f")
    assert main(["extract", "--verify", str(tmp_path / "f")]) == 2


def test_writer_resume_and_identity(tmp_path):
    samples = fake_samples(10)
    w = FeatureWriter(tmp_path / "f", header(), samples_per_shard=3)
    for s in samples[:7]:
        w.add(s)  # 2 shards flushed, 1 sample pending when "killed"
    assert len(w.shards) == 2
    with pytest.raises(ValueError, match="not complete"):
        open_features(tmp_path / "f")
    assert len(open_features(tmp_path / "f", allow_partial=True)) == 6
    # debris of a kill: a temp file mid-write and a renamed shard the manifest never listed
    (tmp_path / "f" / ".shard-00002.safetensors.tmp.123").write_bytes(b"partial")
    (tmp_path / "f" / "shard-00002.safetensors").write_bytes(b"orphan")
    w2 = FeatureWriter(tmp_path / "f", header(), samples_per_shard=3)
    assert sorted(w2.removed) == [".shard-00002.safetensors.tmp.123", "shard-00002.safetensors"]
    assert w2.done_ids == {f"s{i}" for i in range(6)}
    for s in samples:
        if s["id"] not in w2.done_ids:
            w2.add(s)
    w2.finish()
    ds = open_features(tmp_path / "f")
    assert ds.ids == [s["id"] for s in samples]
    verify_features(tmp_path / "f")
    with pytest.raises(ValueError, match="different settings"):
        FeatureWriter(tmp_path / "f", {**header(), "layer_ids": [0, 1, 2]})
