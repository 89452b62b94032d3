"""The machine beside every figure, the engine thread layout, and the drift / threads benches' arithmetic."""

from __future__ import annotations

import json
import os

import pytest
import torch


def test_machine_names_cpu_and_numeric_flags():
    from eyas.host import NUMERIC_FLAGS, machine, machine_line

    m = machine()
    assert m["cpu"] and m["cores"] >= 1 and set(m["isa"]) <= set(NUMERIC_FLAGS)
    flags = open("/proc/cpuinfo").read()
    assert ("amx_bf16" in m["isa"]) == (" amx_bf16" in flags)
    assert m["cpu"] in machine_line()


def test_every_manifest_records_the_machine(tmp_path):
    from eyas.host import machine
    from eyas.manifest import read_manifest, write_manifest

    write_manifest(tmp_path, "test", {"a": 1}, complete=True)
    assert read_manifest(tmp_path)["machine"] == json.loads(json.dumps(machine()))


def test_thread_layouts_and_engine_env(monkeypatch):
    from eyas import host

    assert host.thread_layout("bind-all", cpus=[5, 4, 6]) == {"VLLM_CPU_OMP_THREADS_BIND": "4,5,6",
                                                              "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    assert host.thread_layout("omp-all", cpus=[0, 1]) == {"OMP_NUM_THREADS": "2"}
    with pytest.raises(ValueError, match="unknown thread layout 'x'; choose one of default"):
        host.thread_layout("x")
    monkeypatch.setattr(host, "ENGINE_LAYOUT", "omp-all")
    assert host.vllm_env({})["OMP_NUM_THREADS"] == str(host.machine()["cores"])
    # a user's own thread settings win, whole: nothing of the layout is mixed in
    assert host.vllm_env({"OMP_NUM_THREADS": "1"})["OMP_NUM_THREADS"] == "1"
    assert "OMP_NUM_THREADS" not in host.vllm_env({"VLLM_CPU_OMP_THREADS_BIND": "0"})
    assert host.vllm_env({})["TOKENIZERS_PARALLELISM"] == "false"


def test_drift_agreement_counts_first_divergence_and_near_ties(tiny_llama):
    """Replies written by the model's own greedy decoding agree everywhere; one changed token is one
    disagreement, a diverged reply at that index, with the model's top-1/top-2 gap."""
    from transformers import AutoModelForCausalLM

    from eyas.bench.drift import agreement

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    replies = []
    for seed in range(3):
        prompt = torch.randint(0, 500, (7,), generator=torch.Generator().manual_seed(seed)).tolist()
        out = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12)
        replies.append((prompt, out[0, len(prompt):].tolist()))
    r = agreement(model, replies)
    assert (r["positions"], r["agree"], r["diverged"], r["disagreements"]) == (36, 36, 0, 0)
    prompt, gen = replies[1]
    bad = gen[:5] + [(gen[5] + 1) % 500] + gen[6:]
    r = agreement(model, [replies[0], (prompt, bad), replies[2]])
    assert r["agree"] < 36 and r["diverged"] == 1 and r["first_divergence_median"] == 5
    assert r["disagreements"] == 36 - r["agree"] and r["gap_max"] > 0 and r["top1_agreement"] == r["agree"] / 36


def test_drift_reads_the_hf_engine_beside_vllm(tiny_llama):
    """The hf synthesis engine's replies, as the drift bench takes them, are the model's own greedy text
    (teacher-forced agreement 100% in float32), and `same_replies` counts identical replies and common starts."""
    from transformers import AutoModelForCausalLM

    from eyas.bench.drift import _hf_engine_replies, agreement, same_replies

    prompts = [[{"role": "user", "content": t}] for t in ("hi", "name a bird", "2+2?", "why is the sky blue?")]
    rep, speed = _hf_engine_replies(tiny_llama, prompts, 10, "float32", batch=3)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    r = agreement(model, rep)
    assert r["agree"] == r["positions"] > 0 and speed > 0
    assert same_replies(rep, rep) == {"identical_share": 1.0, "common_start_mean": sum(len(g) for _, g in rep) / 4}
    cut = [(p, g[:3] + [(g[3] + 1) % 500] + g[4:]) if i == 0 else (p, g) for i, (p, g) in enumerate(rep)]
    assert same_replies(rep, cut)["identical_share"] == 0.75


def test_threads_bench_rotates_layouts_and_divides_by_default(monkeypatch):
    from eyas.bench import threads
    cpus, seen = sorted(os.sched_getaffinity(0)), []
    omp, bind = str(len(cpus)), ",".join(map(str, cpus))

    def synth(target, prompts, max_tokens, env):
        seen.append(env.get("OMP_NUM_THREADS") or env.get("VLLM_CPU_OMP_THREADS_BIND") or "default")
        return {"default": 100.0, omp: 150.0}.get(seen[-1], 50.0)

    monkeypatch.setattr(threads, "_synthesis", synth)
    monkeypatch.setattr(threads, "_serving", lambda t, p, m, conc, env: {c: 10.0 * c for c in conc})
    res = threads.bench_threads("t", [[]], [1, 4], repeats=3)
    assert seen[:3] == ["default", omp, bind] and seen[3:6] == [omp, bind, "default"]  # order rotates
    s = res["summary"]
    assert s["omp-all"]["synthesis_ratio"] == pytest.approx(1.5) and s["bind-all"]["synthesis_ratio"] == 0.5
    assert s["default"]["serving_ratio"] == {1: 1.0, 4: 1.0} and len(s["default"]["synthesis_all"]) == 3


def test_engine_dtype_follows_native_bf16(monkeypatch, tmp_path):
    from eyas import host

    monkeypatch.delenv("EYAS_ENGINE_DTYPE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for isa, want in ((["avx2"], "float32"), (["avx2", "avx512f", "avx512_bf16"], "bfloat16"),
                      (["avx2", "amx_bf16", "amx_tile"], "bfloat16")):
        monkeypatch.setattr(host, "machine", lambda isa=isa: {"cpu": "x", "cores": 2, "isa": isa, "system": "x"})
        assert host.engine_dtype() == want, isa
    monkeypatch.setattr(host, "machine", lambda: {"cpu": "x", "cores": 2, "isa": ["avx2"], "system": "x"})
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "fp8"}}))
    assert host.engine_dtype(tmp_path) == "bfloat16"  # vLLM's fp8 method refuses a float32 engine
    assert host.engine_dtype(tmp_path / "missing") == "float32"
    monkeypatch.setenv("EYAS_ENGINE_DTYPE", "bfloat16")
    assert host.engine_dtype() == "bfloat16"
    monkeypatch.setenv("EYAS_ENGINE_DTYPE", "bf16")
    with pytest.raises(ValueError, match="EYAS_ENGINE_DTYPE='bf16': use bfloat16, float32 or float16"):
        host.engine_dtype()
