"""The trainer: data order, checkpoints, exact resume, FSDP2 across ranks, sources, hooks."""

from __future__ import annotations

import dataclasses

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_draft import (
    VLLM_KEYS,  # the golden list of names vLLM's llama_eagle3 loads
    random_draft,
    small_spec,
)

from eyas.config import ExtractConfig, TrainConfig

TORCHRUN = str(Path(sys.executable).parent / "torchrun")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
WORDS = ("the a cat dog runs fast slow blue red green house tree river code python list sum of two "
         "numbers is what why how many apples does she have left after giving").split()


def _make_conversations(target: Path, path: Path, n: int, seed: int = 0) -> None:
    """On-policy conversations: the tiny target writes the assistant turn greedily."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            user = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 24)))
            ids = tok.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True,
                                          return_tensors="pt", return_dict=True)
            with torch.no_grad():
                out = model.generate(**ids, max_new_tokens=rng.randint(16, 40), min_new_tokens=8, do_sample=False)
            reply = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip() or "ok ok ok"
            f.write(json.dumps({"id": f"c{i}", "messages": [{"role": "user", "content": user},
                                                          {"role": "assistant", "content": reply}]}) + "\n")


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory, tiny_llama) -> dict[str, Path]:
    from eyas.extract import extract

    d = tmp_path_factory.mktemp("tiny_data")
    _make_conversations(tiny_llama, d / "conv.jsonl", 48)
    extract(ExtractConfig(target=str(tiny_llama), data=str(d / "conv.jsonl"), out=str(d / "feat"),
                          compute_dtype="fp32", samples_per_shard=16))
    return {"target": tiny_llama, "conv": d / "conv.jsonl", "features": d / "feat"}


def _cfg(data, out: Path, **kw) -> TrainConfig:
    base = dict(target=str(data["target"]), features=str(data["features"]), out=str(out), max_steps=6,
                token_budget=256, draft_vocab_size=2048, lr=2e-3, warmup_steps=2, log_every=1, save_every=0,
                progress=False, threads=1, ttt_steps=4, precision="fp32")
    base.update(kw)
    return TrainConfig(**base)


def _metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]


def _flags(cfg: TrainConfig) -> list[str]:
    out = []
    for k in ("target", "features", "out", "max_steps", "token_budget", "draft_vocab_size", "lr", "warmup_steps",
              "log_every", "save_every", "ttt_steps", "grad_accum", "lr_decay_steps", "threads", "precision"):
        out += ["--" + k.replace("_", "-"), str(getattr(cfg, k))]
    return out + ["--no-progress"] + (["--resume"] if cfg.resume else [])


def _run_cli(cfg: TrainConfig, nproc: int = 1, extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    if nproc == 1:
        cmd = [sys.executable, "-m", "eyas", "train", *_flags(cfg), *extra]
    else:
        cmd = [TORCHRUN, "--standalone", "--nproc_per_node", str(nproc), "-m", "eyas", "train", *_flags(cfg), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


# ---------------------------------------------------------------------------------------------- data


def test_global_order_is_split_between_ranks_and_resumes_anywhere():
    from eyas.train.data import GlobalBatches

    lengths = [random.Random(i).randint(5, 120) for i in range(200)]

    def fresh():
        return GlobalBatches(lengths, 256, seed=3)

    one, two = fresh(), fresh()
    for _ in range(5):
        a = one.for_rank(1, 2, 0)
        g = two.take(2)  # what two ranks x accum 1 take together
        assert a == [g[0], g[1]]
    # 2 ranks for 7 steps, saved, then 1 rank x accum 3: the global order continues unbroken
    ref = fresh()
    want = ref.take(7 * 2 + 20 * 3)
    g2 = [fresh(), fresh()]
    seen = []
    for _ in range(7):
        per = [g.for_rank(2, 1, r) for r, g in enumerate(g2)]
        seen += [per[0][0], per[1][0]]
    st = json.loads(json.dumps(g2[0].state_dict()))
    assert st["consumed"] == 14 and g2[1].state_dict() == g2[0].state_dict()
    g1 = fresh()
    g1.load_state_dict(st)
    for _ in range(20):
        seen += g1.for_rank(1, 3, 0)
    assert seen == want  # crosses an epoch boundary too
    assert g1.pos.epoch >= 1
    flat = [i for b in want[: len(fresh().plan(0))] for i in b]
    assert sorted(flat) == list(range(200))  # an epoch covers every sample once
    bad = fresh()
    with pytest.raises(ValueError, match="other data"):
        bad.load_state_dict({**st, "token_budget": 512})


def test_collate_pads_right(tiny_data):
    from eyas.features import open_features
    from eyas.train.data import collate

    ds = open_features(tiny_data["features"])
    items = [ds[0], ds[1], ds[2]]
    b = collate(items, max_len=30)
    lens = [min(30, int(it["input_ids"].shape[0])) for it in items]
    n, H = items[0]["aux_hidden_states"].shape[1:]
    assert b.input_ids.shape == (3, max(lens)) and b.aux.shape == (3, max(lens), n * H)
    assert b.num_tokens == sum(lens)
    for i, L in enumerate(lens):
        assert torch.equal(b.input_ids[i, :L], items[i]["input_ids"][:L])
        assert not b.loss_mask[i, L:].any() and b.aux[i, L:].abs().sum() == 0
        assert torch.equal(b.aux[i, :L].view(L, n, H), items[i]["aux_hidden_states"][:L])
        assert torch.equal(b.loss_mask[i, :L], items[i]["loss_mask"][:L].bool())
    everything = collate(items, max_len=30, loss_tokens="all")  # prompts too: every real token, no padding
    assert [int(m.sum()) for m in everything.loss_mask] == lens and int(b.loss_mask.sum()) < sum(lens)
    with pytest.raises(ValueError, match="loss_tokens"):
        collate(items, max_len=30, loss_tokens="prompt")


# ---------------------------------------------------------------------------------------------- training


def test_train_checkpoint_and_load_draft_state(tiny_data, tmp_path):
    from eyas.checkpoints import latest_checkpoint, load_draft_state
    from eyas.draft.vocab import check_vocab
    from eyas.train import train

    run = tmp_path / "run"
    s = train(_cfg(tiny_data, run, max_steps=4, save_every=2))
    assert s["step"] == 4
    ck = run / "checkpoints"
    assert (ck / "latest").read_text().strip() == "step_4" and latest_checkpoint(run) == ck / "step_4"
    assert (ck / "step_2" / "trainer.json").exists() and not list(ck.glob(".tmp_*"))
    recs = _metrics(run)
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    for key in ("loss", "acc", "cond_acc", "est_al", "lr", "tokens_per_s"):
        assert key in recs[-1]
    assert len(recs[-1]["acc"]) == 4 and recs[-1]["est_al"] >= 1.0
    assert (run / "tb").is_dir() and json.loads((run / "manifest.json").read_text())["complete"]
    state, meta = load_draft_state(ck / "step_4")
    assert set(state) == VLLM_KEYS
    assert all(t.device.type == "cpu" and not hasattr(t, "full_tensor") for t in state.values())
    check_vocab(state["d2t"], state["t2d"], state["t2d"].numel())
    assert meta["draft_config"]["architectures"] == ["LlamaForCausalLMEagle3"]
    assert meta["layer_ids"] == meta["draft_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert meta["step"] == 4 and Path(meta["target"]) == Path(tiny_data["target"]).resolve()
    from eyas.target import load_head as load_target_head

    # the frozen embedding is the target's, untouched by training
    assert torch.equal(state["embed_tokens.weight"], load_target_head(tiny_data["target"])[0].float())
    s2, _ = load_draft_state(ck / "step_2")
    assert not torch.equal(s2["fc.weight"], state["fc.weight"])
    # the run is complete: the same command does nothing; a longer one needs --resume
    assert train(_cfg(tiny_data, run, max_steps=4)).get("skipped")
    with pytest.raises(ValueError, match="--resume"):
        train(_cfg(tiny_data, run, max_steps=6))


def test_accuracy_sampled_every_nth_micro_batch(tiny_data, tmp_path):
    """score_every skips the target's full-vocab top-1 on most micro-batches; every log window still
    scores its first one, and the CE counts cover every row."""
    from eyas.train import train

    every = train(_cfg(tiny_data, tmp_path / "a", max_steps=4, log_every=2))["last"]
    sampled = train(_cfg(tiny_data, tmp_path / "b", max_steps=4, log_every=2, score_every=100))["last"]
    assert sampled["loss"] == pytest.approx(every["loss"]) and sampled["ce"] == pytest.approx(every["ce"])
    assert sampled["loss_tokens"] == every["loss_tokens"]
    assert all(v > 0 for v in sampled["in_vocab"]) and len(sampled["acc"]) == len(every["acc"])


def test_export_reads_the_checkpoint(tiny_data, tmp_path):
    from eyas import export
    from eyas.train import train

    run = tmp_path / "run"
    train(_cfg(tiny_data, run, max_steps=2))
    out = export.export_checkpoint(run / "checkpoints" / "step_2", tmp_path / "draft")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 2048


def test_resume_reproduces_an_uninterrupted_run(tiny_data, tmp_path):
    from eyas.train import train

    full, part = tmp_path / "full", tmp_path / "part"
    train(_cfg(tiny_data, full, max_steps=8, lr_decay_steps=8))
    train(_cfg(tiny_data, part, max_steps=4, lr_decay_steps=8))
    train(_cfg(tiny_data, part, max_steps=8, lr_decay_steps=8, resume=True))
    a, b = _metrics(full), _metrics(part)
    assert [r["step"] for r in b] == list(range(1, 9))
    for x, y in zip(a, b):
        assert x["lr"] == y["lr"]
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-6), (x["step"], x["loss"], y["loss"])
        assert x["acc"] == pytest.approx(y["acc"], abs=1e-9)
    st = json.loads((part / "checkpoints" / "step_8" / "trainer.json").read_text())
    assert st["data"]["consumed"] == 8


def test_two_ranks_match_one_rank(tiny_data, tmp_path):
    """FSDP2 over 2 ranks x accum 1 == 1 rank x accum 2 on the same global micro-batches."""
    one, two = tmp_path / "one", tmp_path / "two"
    _run_cli(_cfg(tiny_data, one, max_steps=5, grad_accum=2))
    _run_cli(_cfg(tiny_data, two, max_steps=5, grad_accum=1), nproc=2)
    a, b = _metrics(one), _metrics(two)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3, 4, 5]
    for x, y in zip(a, b):
        assert x["micro_batches"] == y["micro_batches"] == 2
        assert x["tokens"] == y["tokens"]
        assert x["loss"] == pytest.approx(y["loss"], rel=2e-4), (x["step"], x["loss"], y["loss"])
    assert json.loads((two / "manifest.json").read_text())["world_size"] == 2


@pytest.mark.parametrize("precision", ["bf16", "fp32"])  # torch's Muon step; eyas's float32 Newton-Schulz
def test_muon_resumes_exactly_and_shards_like_one_rank(tiny_data, tmp_path, precision):
    """optimizer=muon: Muon on fc and the layer's matrices, AdamW on the rest; both optimizers' states
    go through the DCP checkpoint (a resumed run repeats an uninterrupted one) and 2 FSDP2 ranks step
    like one (Newton-Schulz runs on the whole matrix, not on each rank's shard)."""
    from eyas.train import train
    from eyas.train.loop import Optimizers, build_optimizer

    full, part = tmp_path / "full", tmp_path / "part"
    mk = dict(optimizer="muon", precision=precision)
    train(_cfg(tiny_data, full, max_steps=6, lr_decay_steps=6, **mk))
    train(_cfg(tiny_data, part, max_steps=3, lr_decay_steps=6, **mk))
    train(_cfg(tiny_data, part, max_steps=6, lr_decay_steps=6, resume=True, **mk))
    a, b = _metrics(full), _metrics(part)
    assert [r["step"] for r in b] == list(range(1, 7))
    for x, y in zip(a, b):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-6), (x["step"], x["loss"], y["loss"])
    adamw = _metrics(_trained(tiny_data, tmp_path / "adamw", max_steps=6, lr_decay_steps=6))
    assert [r["loss"] for r in adamw][1:] != [r["loss"] for r in a][1:]  # a different update rule

    model = random_draft(small_spec())
    opts = build_optimizer(_cfg(tiny_data, tmp_path / "x", optimizer="muon"), model, "fp32")
    muon = {id(p) for p in opts[0].param_groups[0]["params"]}
    names = {n for n, p in model.named_parameters() if id(p) in muon}
    assert isinstance(opts, Optimizers) and names == {"fc.weight"} | {
        f"midlayer.{m}.weight" for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                         "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}

    one, two = tmp_path / "one", tmp_path / "two"  # FSDP2 on both sides: its sharding is what is compared
    _run_cli(_cfg(tiny_data, one, max_steps=4, grad_accum=2, **mk), extra=("--fsdp", "always"))
    _run_cli(_cfg(tiny_data, two, max_steps=4, grad_accum=1, **mk), nproc=2)
    for x, y in zip(_metrics(one), _metrics(two)):
        assert x["loss"] == pytest.approx(y["loss"], rel=2e-4), (x["step"], x["loss"], y["loss"])


def test_bare_module_steps_like_fsdp_and_checkpoints_move_between_them(tiny_data, tmp_path):
    """A world of one trains the bare module (`train.fsdp: auto`): in fp32 it steps like FSDP2 on one
    rank; in bf16 (autocast against FSDP2's cast parameters) its first loss is within rounding; a
    checkpoint written under FSDP2 resumes bare like an uninterrupted bare run, and a bare one resumes
    under FSDP2 over 2 ranks."""
    from eyas.train import train

    mk = dict(optimizer="muon", lr_decay_steps=6)
    bare, fsdp, mixed = tmp_path / "bare", tmp_path / "fsdp", tmp_path / "mixed"
    train(_cfg(tiny_data, bare, max_steps=6, **mk))
    train(_cfg(tiny_data, fsdp, max_steps=6, fsdp="always", **mk))
    a, b = _metrics(bare), _metrics(fsdp)
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, 7))
    for x, y in zip(a, b):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5), (x["step"], x["loss"], y["loss"])
    assert a[-1]["loss"] < a[0]["loss"]
    assert json.loads((bare / "manifest.json").read_text())["fsdp"] is False
    assert json.loads((fsdp / "manifest.json").read_text())["fsdp"] is True

    train(_cfg(tiny_data, mixed, max_steps=3, save_every=3, fsdp="always", **mk))
    train(_cfg(tiny_data, mixed, max_steps=6, resume=True, **mk))
    for x, y in zip(a, _metrics(mixed)):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5), (x["step"], x["loss"], y["loss"])
    _run_cli(_cfg(tiny_data, mixed, max_steps=8, resume=True, **mk), nproc=2, extra=("--optimizer", "muon"))
    st = json.loads((mixed / "checkpoints" / "step_8" / "trainer.json").read_text())
    assert st["world_size"] == 2 and [r["step"] for r in _metrics(mixed)] == list(range(1, 9))

    first = {}
    for mode in ("auto", "always"):
        run = tmp_path / f"bf16-{mode}"
        train(_cfg(tiny_data, run, max_steps=1, precision="bf16", fsdp=mode, **mk))
        first[mode] = _metrics(run)[0]["loss"]
    assert first["auto"] == pytest.approx(first["always"], rel=2e-2), first


def test_muon_float32_newton_schulz_matches_torch(monkeypatch):
    """eyas's Muon is torch's step with ns_dtype="bf16"; with "fp32", against torch's step
    with its iteration patched to float32 it is equal to rounding (momentum, Nesterov, weight decay,
    lr adjustment, wide and tall matrices, several steps); against torch's bf16 step it is close; its
    state loads into torch's Muon."""
    import torch.optim._muon as tm

    from eyas.train.muon import Muon, newton_schulz

    def run(cls, shapes, steps=3, **kw):
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
        opt = cls(ps, lr=2e-3, weight_decay=0.01, adjust_lr_fn="match_rms_adamw", **kw)
        for i in range(steps):
            for p in ps:
                p.grad = torch.randn_like(p) * (i + 1)
            opt.step()
        return ps, opt

    shapes = [(24, 72), (64, 16), (32, 32)]
    bf16, _ = run(torch.optim.Muon, shapes)
    assert all(torch.equal(a, b) for a, b in zip(run(Muon, shapes, ns_dtype="bf16")[0], bf16))
    ours, opt = run(Muon, shapes, ns_dtype="fp32")
    for a, b in zip(ours, bf16):
        assert not torch.equal(a, b) and torch.allclose(a, b, atol=2e-4, rtol=0)  # bf16 rounding only
    monkeypatch.setattr(tm, "_zeropower_via_newtonschulz", newton_schulz)
    f32, _ = run(torch.optim.Muon, shapes)
    for a, b in zip(ours, f32):
        assert torch.allclose(a, b, atol=1e-7, rtol=0)
    o = newton_schulz(torch.randn(48, 96), (3.4445, -4.7750, 2.0315), 5, 1e-7)
    s = torch.linalg.svdvals(o)
    assert o.dtype == torch.float32 and s.min() > 0.5 and s.max() < 1.5  # near-orthogonal, as torch's
    torch.optim.Muon(ours, adjust_lr_fn="match_rms_adamw").load_state_dict(opt.state_dict())


def test_warm_start_from_an_exported_draft(tiny_data, tmp_path):
    """train.init_from: an exported draft's weights and vocab are the start (a 0-lr step keeps them), its
    coverage of the new data is logged; a draft for other aux layers, an FP8 one, or an init_head on top
    is refused with the field to fix."""
    from eyas import export
    from eyas.checkpoints import load_draft_state
    from eyas.draft.exported import load_exported

    src = _trained(tiny_data, tmp_path / "src", max_steps=2, draft_vocab_size=512)
    draft = export.export_checkpoint(src / "checkpoints" / "step_2", tmp_path / "draft")
    run = _trained(tiny_data, tmp_path / "warm", max_steps=1, lr=1e-12, warmup_steps=0, init_from=str(draft))
    state, meta = load_draft_state(run / "checkpoints" / "step_1")
    want = load_exported(draft, tiny_data["target"]).state_dict()
    for name, t in want.items():
        assert torch.allclose(state[name].float(), t.float(), atol=1e-6), name  # the bf16 export, kept
    info = json.loads((run / "manifest.json").read_text())["draft_vocab"]
    assert info["draft_vocab_size"] == 512 and 0 < info["coverage"] <= 1  # the draft's vocab, not train's 2048
    assert meta["draft_config"]["draft_vocab_size"] == 512

    with pytest.raises(ValueError, match="init_head"):
        _trained(tiny_data, tmp_path / "bad1", max_steps=1, init_from=str(draft), init_head="target")
    other = tmp_path / "other"
    shutil.copytree(draft, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["eagle_aux_hidden_state_layer_ids"] = [0, 1, 2]
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"init_from .*aux layers \[0, 1, 2\].*extract.layer_ids"):
        _trained(tiny_data, tmp_path / "bad2", max_steps=1, init_from=str(other))
    fp8 = export.export_checkpoint(src / "checkpoints" / "step_2", tmp_path / "fp8", dtype="fp8")
    with pytest.raises(ValueError, match="bf16 export"):
        _trained(tiny_data, tmp_path / "bad3", max_steps=1, init_from=str(fp8))
    with pytest.raises(ValueError, match="init_from .*config.json"):
        _trained(tiny_data, tmp_path / "bad4", max_steps=1, init_from=str(tmp_path / "nowhere"))


class _Payload:
    """Unpickling this runs a shell command: what a crafted DCP `.metadata` can do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_crafted_checkpoint_runs_nothing(tiny_data, tmp_path):
    """Export reads a checkpoint's draft.safetensors (no pickle); resume loads DCP only when eyas signed it
    here: a crafted dcp/.metadata executes nothing through `eyas export`, `eyas eval` or a resume, unless the user
    trusts it (then it does: the payload is live)."""
    import pickle

    run = _trained(tiny_data, tmp_path / "run", max_steps=2)
    ckpt = run / "checkpoints" / "step_2"
    assert (ckpt / "draft.safetensors").exists() and (ckpt / "dcp.sig").exists()
    marker = tmp_path / "pwned"
    (ckpt / "dcp" / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))

    proc = subprocess.run([sys.executable, "-m", "eyas", "export", "--run", str(run), "--checkpoint", "step_2",
                           "--out", str(tmp_path / "draft")], capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "draft" / "model.safetensors").exists() and not marker.exists()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "messages": [{"role": "user", "content": "hi"}]}) + "\n")
    for draft in (ckpt, run):  # eval serves exported drafts only: a checkpoint or run dir is refused, unread
        proc = subprocess.run([sys.executable, "-m", "eyas", "eval", "--target", str(tiny_data["target"]),
                               "--draft", str(draft), "--prompts", str(prompts)], capture_output=True, text=True,
                              env=ENV, timeout=300)
        assert proc.returncode == 2 and f"{draft}/config.json" in proc.stderr, proc.stderr[-3000:]
    assert not marker.exists()

    proc = subprocess.run([sys.executable, "-m", "eyas", "train", *_flags(_cfg(tiny_data, run, max_steps=3)),
                           "--resume"], capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode != 0 and "not loading its DCP state" in proc.stderr and "trust_checkpoint" in proc.stderr
    assert not marker.exists()
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    with pytest.raises((ValueError, RuntimeError, CheckpointException)):  # trusted: the crafted file is unpickled
        _trained(tiny_data, run, max_steps=3, resume=True, trust_checkpoint=True)
    assert marker.exists()

    # a torn draft.safetensors names itself; a checkpoint without one says how to get one
    from eyas.checkpoints import load_draft_state

    w = ckpt / "draft.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"draft.safetensors: not a readable safetensors file"):
        load_draft_state(ckpt)
    w.unlink()
    with pytest.raises(ValueError, match=r"no draft.safetensors .*--resume"):
        load_draft_state(ckpt)


def test_features_of_another_target_or_corrupt_shards_are_refused(tiny_data, tmp_path):
    """Training checks that the features come from its target (tokenizer files and weights) and that each
    shard's bytes match the manifest's sha256 (on first read), and names the file and the fix."""
    from safetensors.torch import load_file, save_file

    other = tmp_path / "other"  # same architecture and tokenizer, one weight changed: a "fine-tune"
    shutil.copytree(tiny_data["target"], other)
    sd = load_file(str(other / "model.safetensors"))
    name = next(n for n in sd if n.endswith("mlp.down_proj.weight"))
    sd[name] = sd[name] + 0.01
    save_file(sd, str(other / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"whose weights differ from the target .*other"):
        _trained(tiny_data, tmp_path / "r1", max_steps=1, target=str(other))
    tok = tmp_path / "tok"  # same weights, another tokenizer
    shutil.copytree(tiny_data["target"], tok)
    tc = json.loads((tok / "tokenizer_config.json").read_text())
    tc["model_max_length"] = 12345
    (tok / "tokenizer_config.json").write_text(json.dumps(tc))
    with pytest.raises(ValueError, match=r"made with the tokenizer of"):
        _trained(tiny_data, tmp_path / "r2", max_steps=1, target=str(tok))

    feats = tmp_path / "feats"
    shutil.copytree(tiny_data["features"], feats)
    shard = sorted(feats.glob("shard-*.safetensors"))[0]
    raw = bytearray(shard.read_bytes())
    raw[-100:-90] = bytes(10)  # 10 bytes of hidden state zeroed: loads fine, trains on wrong numbers
    shard.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=rf"{shard.name}: sha256 differs .*eyas extract verify"):
        _trained(tiny_data, tmp_path / "r3", max_steps=1, features=str(feats))


def test_a_run_dir_resumes_only_the_same_run(tiny_data, tmp_path):
    """A finished or resumed run dir refuses settings that change the run (lr, features, loss) and names
    them; how long and how often to log may change."""
    run = _trained(tiny_data, tmp_path / "run", max_steps=2)
    with pytest.raises(ValueError, match=r"other settings \(train.lr: 0.002 -> 0.001\)"):
        _trained(tiny_data, run, max_steps=2, lr=1e-3)  # finished: no silent "nothing to do"
    with pytest.raises(ValueError, match=r"train.loss: 'kl' -> 'lk'.*another --out"):
        _trained(tiny_data, run, max_steps=3, resume=True, loss="lk")
    feats = tmp_path / "feats"
    shutil.copytree(tiny_data["features"], feats)
    with pytest.raises(ValueError, match=r"train.features"):
        _trained(tiny_data, run, max_steps=3, resume=True, features=str(feats))
    _trained(tiny_data, run, max_steps=3, resume=True, log_every=5, features=str(tiny_data["features"]) + "/")
    assert [r["step"] for r in _metrics(run)] == [1, 2, 3]


class _Measure:
    """A checkpoint callback with serve-eval's contract (a record per call, `measured(step)`) that
    measures nothing: it records which steps it was called for, and can stand for a kill mid-call."""

    def __init__(self, die_at: int = -1):
        self.calls: list[int] = []
        self.records: dict[int, dict] = {}
        self.die_at = die_at

    def __call__(self, ckpt, step, estimates):
        self.calls.append(step)
        if step == self.die_at:
            raise OSError("killed")  # stands for a kill during the evaluation: no record
        self.records[step] = {"step": step, "acceptance_length": 1.0}
        return self.records[step]

    def measured(self, step):
        return step in self.records


def test_a_cut_off_evaluation_is_redone_on_resume(tiny_data, tmp_path):
    """Killed during a checkpoint's evaluation (the final one, or one mid-run): re-running the same
    command measures that checkpoint again before going on, and never twice when it has its record."""
    from eyas.train import train

    cb = _Measure(die_at=4)
    cfg = _cfg(tiny_data, tmp_path / "run", max_steps=4, eval_every=2, resume=True)
    with pytest.raises(RuntimeError, match="step_4"):
        train(cfg, on_checkpoint=cb)  # killed during the final evaluation
    assert cb.calls == [2, 4]
    cb.die_at = -1
    assert train(cfg, on_checkpoint=cb)["step"] == 4  # not "nothing to do": step 4 is measured now
    assert cb.calls == [2, 4, 4] and cb.measured(4)
    assert train(cfg, on_checkpoint=cb)["skipped"] and cb.calls == [2, 4, 4]  # measured: nothing to do

    cb2 = _Measure(die_at=2)
    cfg2 = _cfg(tiny_data, tmp_path / "run2", max_steps=4, eval_every=2, resume=True)
    with pytest.raises(RuntimeError, match="step_2"):
        train(cfg2, on_checkpoint=cb2)
    cb2.die_at = -1
    train(cfg2, on_checkpoint=cb2)
    assert cb2.calls == [2, 2, 4]
    assert [r["step"] for r in _metrics(tmp_path / "run2") if "loss" in r] == [1, 2, 3, 4]


def test_a_lone_final_checkpoint_is_left_to_the_eval_stage(tiny_data, tmp_path):
    """`train.eval_lone_final: false` (what `eyas run` sets): the final checkpoint is not serve-evaluated when no
    earlier one was (nothing to choose between; the eval stage measures it), and a resume does not redo it;
    with an earlier one measured, the final one is, so the best can be picked."""
    from eyas.train import train

    cb = _Measure()
    cfg = _cfg(tiny_data, tmp_path / "run", max_steps=3, eval_every=5, resume=True, eval_lone_final=False)
    assert train(cfg, on_checkpoint=cb)["step"] == 3 and cb.calls == []
    assert train(cfg, on_checkpoint=cb)["skipped"] and cb.calls == []  # a re-run: nothing to measure
    cb = _Measure()
    train(_cfg(tiny_data, tmp_path / "run2", max_steps=4, eval_every=2, eval_lone_final=False), on_checkpoint=cb)
    assert cb.calls == [2, 4]
    cb = _Measure()
    train(_cfg(tiny_data, tmp_path / "run3", max_steps=3, eval_every=5), on_checkpoint=cb)  # the default
    assert cb.calls == [3]


def test_other_data_at_the_same_path_is_another_run(tiny_data, tmp_path):
    """Features rewritten in place (same path, other shards) make the run dir another run's:
    a ChangedOutput naming the data, which `eyas run` sets aside."""
    from eyas.stage import ChangedOutput

    feats = tmp_path / "feats"
    shutil.copytree(tiny_data["features"], feats)
    run = _trained(tiny_data, tmp_path / "run", max_steps=2, features=str(feats))
    man = json.loads((feats / "manifest.json").read_text())
    man["shards"] = man["shards"][:-1]  # as if extracted again from fewer conversations
    (feats / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(ChangedOutput, match=r"the data in .*feats") as e:
        _trained(tiny_data, run, max_steps=3, resume=True, features=str(feats))
    assert e.value.dir == run


def test_damaged_checkpoint_and_torn_log_are_named(tiny_data, tmp_path):
    """A truncated trainer.json in the latest checkpoint names itself and the previous intact one; a
    torn last line of metrics.jsonl (a kill mid-write) is cut off on resume, not a traceback."""
    run = _trained(tiny_data, tmp_path / "run", max_steps=2, save_every=1)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "lo')
    _trained(tiny_data, run, max_steps=3, resume=True, save_every=1)
    assert [r["step"] for r in _metrics(run) if "loss" in r] == [1, 2, 3]
    tj = run / "checkpoints" / "step_3" / "trainer.json"
    tj.write_text(tj.read_text()[:40])
    with pytest.raises(ValueError, match=r"checkpoint .*step_3 is damaged .*not valid JSON.*previous intact "
                                         r"checkpoint, step_2"):
        _trained(tiny_data, run, max_steps=4, resume=True, save_every=1)
    shutil.move(str(run / "checkpoints" / "step_3"), str(tmp_path / "step_3.damaged"))
    assert _trained(tiny_data, run, max_steps=4, resume=True, save_every=1)
    shard = max((run / "checkpoints" / "step_4" / "dcp").glob("*.distcp"), key=lambda f: f.stat().st_size)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # a disk that filled up
    with pytest.raises(ValueError, match=r"step_4: not loading its DCP state: its files differ .*damaged.*previous "
                                         r"intact checkpoint, step_3"):
        _trained(tiny_data, run, max_steps=5, resume=True, save_every=1)


def _trained(data, run: Path, **kw) -> Path:
    from eyas.train import train

    train(_cfg(data, run, **kw))
    return run


@pytest.mark.slow
def test_two_rank_run_resumed_on_one_rank(tiny_data, tmp_path):
    run = tmp_path / "run"
    _run_cli(_cfg(tiny_data, run, max_steps=20, save_every=10, lr_decay_steps=30, ttt_steps=3), nproc=2)
    st20 = json.loads((run / "checkpoints" / "step_20" / "trainer.json").read_text())
    assert st20["world_size"] == 2 and st20["data"]["consumed"] == 40
    _run_cli(_cfg(tiny_data, run, max_steps=30, save_every=10, lr_decay_steps=30, ttt_steps=3, resume=True))
    st30 = json.loads((run / "checkpoints" / "step_30" / "trainer.json").read_text())
    assert st30["world_size"] == 1 and st30["data"]["consumed"] == 50
    recs = _metrics(run)
    assert [r["step"] for r in recs] == list(range(1, 31))  # no step repeated or skipped
    assert [r["micro_batches"] for r in recs] == [2] * 20 + [1] * 10
    # the random tiny target's labels are high-entropy (CE floor ~7 nats): the KL to them is what falls
    kl = [sum(r["kl"]) / len(r["kl"]) for r in recs]
    loss = [r["loss"] for r in recs]
    assert sum(kl[-5:]) < 0.7 * sum(kl[:5]), kl
    assert sum(loss[-5:]) < sum(loss[:5]), loss


def test_online_source_equals_offline(tiny_data, tmp_path):
    from eyas.train import train

    off, on = tmp_path / "off", tmp_path / "on"
    train(_cfg(tiny_data, off, max_steps=3))
    train(_cfg(tiny_data, on, max_steps=3, source="online", features=str(tiny_data["conv"])))
    a, b = _metrics(off), _metrics(on)
    for x, y in zip(a, b):
        assert x["tokens"] == y["tokens"]
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-4)


def test_checkpoint_callback(tiny_data, tmp_path):
    """The trainer hands each checkpoint due for evaluation to the callback it was given, on rank 0."""
    from eyas.train import train

    calls = []

    def on_checkpoint(ckpt_dir, step, estimates):
        assert (Path(ckpt_dir) / "draft.json").exists()
        calls.append((Path(ckpt_dir).name, step, estimates))
        return {"acceptance_length": 1.5}

    run = tmp_path / "run"
    train(_cfg(tiny_data, run, max_steps=4, eval_every=2, holdout=3), on_checkpoint=on_checkpoint)
    assert [c[:2] for c in calls] == [("step_2", 2), ("step_4", 4)]
    for _, _, est in calls:  # the trainer's estimate, and the simulated AL on 3 held-out samples (k = ttt_steps 4)
        assert est["est_al"] >= 1.0 and 1.0 <= est["sim_al"] <= 1 + 4 and len(est["sim_per_pos"]) == 4
        assert est["sim_drafts"] > 0
    logged = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if "sim_al" in r] == [2, 4]
    train(_cfg(tiny_data, tmp_path / "run2", max_steps=1))  # no callback: checkpoints only

    def broken(*args):
        raise OSError("vLLM exited")

    with pytest.raises(RuntimeError, match=r"evaluating \S*step_1 failed: OSError: vLLM exited"):
        train(_cfg(tiny_data, tmp_path / "run3", max_steps=1), on_checkpoint=broken)
    assert (tmp_path / "run3" / "checkpoints" / "step_1" / "draft.json").exists()  # the checkpoint is kept


def test_bench_reports_where_time_goes(tiny_data, capsys):
    from eyas.bench.train import run_bench

    tc = TrainConfig(token_budget=256, draft_vocab_size=512, ttt_steps=3)  # the recipe's train section
    r = run_bench(str(tiny_data["target"]), tc, features=str(tiny_data["features"]), steps=2)
    assert r["tokens_per_s"] > 0 and r["ttt_steps"] == 3 and r["draft_vocab_size"] == 512
    for k in ("data_s", "target_head_s", "draft_fwd_s", "draft_bwd_s", "optim_s"):
        assert r[k] > 0  # the target head timed by TargetHead(timed=True), not patched
    assert "tokens/s" in capsys.readouterr().out
    # scored as the trainer scores: the full-vocab top-1 on every score_every-th micro-batch only,
    # so fewer FLOPs per token are counted than when every micro-batch is scored
    r2 = run_bench(str(tiny_data["target"]), dataclasses.replace(tc, score_every=4), features=str(tiny_data["features"]),
                   steps=2)
    assert r2["score_every"] == 4 and r["score_every"] == 1
    assert r2["flops_per_token"] < r["flops_per_token"]


def test_streaming_source_trains_until_the_stream_ends(tiny_data, tmp_path):
    import socket

    from eyas.train import train

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    producer = subprocess.Popen(
        [sys.executable, "-m", "eyas", "extract", "--mode", "streaming", "--target", str(tiny_data["target"]), "--data",
         str(tiny_data["conv"]), "--connect", f"tcp://127.0.0.1:{port}", "--compute-dtype", "fp32"],
        env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        run = tmp_path / "run"
        s = train(_cfg(tiny_data, run, max_steps=1000, source="streaming",
                       features=f"tcp://127.0.0.1:{port}?producers=1&timeout=120"))
        _, err = producer.communicate(timeout=120)
    finally:
        producer.kill()
    assert producer.returncode == 0, err[-2000:]
    recs = _metrics(run)
    assert 3 <= s["step"] == recs[-1]["step"] == len(recs) < 1000  # stopped when the stream ended
    st = json.loads((run / "checkpoints" / f"step_{s['step']}" / "trainer.json").read_text())
    assert st["data"]["streaming"] and st["data"]["stream_consumed"] == 48  # every conversation, once
    from eyas.features import open_features

    ds = open_features(tiny_data["features"])
    assert sum(r["tokens"] for r in recs) == sum(ds.lengths)


def test_unfrozen_embedding_and_fc_norm_train(tiny_data, tmp_path):
    from eyas.checkpoints import load_draft_state
    from eyas.target import load_head as load_target_head
    from eyas.train import train

    run = tmp_path / "run"
    train(_cfg(tiny_data, run, max_steps=2, freeze_embed=False, fc_norm=True))
    state, meta = load_draft_state(run / "checkpoints" / "step_2")
    assert meta["draft_config"]["fc_norm"] is True and {"fc_norm.0.weight", "fc_norm.2.weight"} <= set(state)
    assert not torch.equal(state["embed_tokens.weight"], load_target_head(tiny_data["target"])[0].float())


def test_init_from_target(tiny_data, tmp_path):
    """init_head=target: lm_head starts as the target's rows of the draft vocab, the final norm as the target's;
    init_layer=target: the decoder layer from the target's first and last layers."""
    from safetensors.torch import load_file, save_file

    from eyas.checkpoints import load_draft_state
    from eyas.target import load_head as load_target_head
    from eyas.train import train

    target = tmp_path / "target"  # the tiny target with a final norm that is not all ones
    shutil.copytree(tiny_data["target"], target)
    sd = load_file(str(target / "model.safetensors"))
    sd["model.norm.weight"] = torch.linspace(0.5, 1.5, sd["model.norm.weight"].numel()).to(sd["model.norm.weight"])
    save_file(sd, str(target / "model.safetensors"), metadata={"format": "pt"})
    from eyas.extract import extract  # features of this target (training checks where features come from)

    feats = tmp_path / "feat"
    extract(ExtractConfig(target=str(target), data=str(tiny_data["conv"]), out=str(feats), compute_dtype="fp32",
                          samples_per_shard=16))
    tiny_data = {**tiny_data, "features": feats}
    run = tmp_path / "run"
    train(_cfg(tiny_data, run, target=str(target), max_steps=1, lr=1e-12, warmup_steps=0, init_head="target",
               hard_label=0.5))
    state, _ = load_draft_state(run / "checkpoints" / "step_1")
    ids = state["d2t"] + torch.arange(state["d2t"].numel())  # draft id i -> target id i + d2t[i]
    lm_head = load_target_head(target)[1].float()
    assert torch.allclose(state["lm_head.weight"], lm_head[ids], atol=1e-6)
    assert torch.allclose(state["norm.weight"], sd["model.norm.weight"].float(), atol=1e-6)
    assert not torch.equal(state["midlayer.mlp.down_proj.weight"], sd["model.layers.1.mlp.down_proj.weight"].float())

    # init_layer=target: the layer from the target's first (embedding half) and last (hidden half, the rest)
    run2 = tmp_path / "run2"
    train(_cfg(tiny_data, run2, target=str(target), max_steps=1, lr=1e-12, warmup_steps=0, init_layer="target"))
    state, _ = load_draft_state(run2 / "checkpoints" / "step_1")
    n = json.loads((target / "config.json").read_text())["num_hidden_layers"]
    H = sd["model.norm.weight"].numel()
    first, last = "model.layers.0.", f"model.layers.{n - 1}."

    def close(name, ref):
        assert torch.allclose(state[name], ref.float(), atol=1e-6), name

    close("midlayer.self_attn.q_proj.weight", torch.cat([sd[first + "self_attn.q_proj.weight"],
                                                          sd[last + "self_attn.q_proj.weight"]], 1))
    close("midlayer.self_attn.v_proj.weight", torch.cat([sd[first + "self_attn.v_proj.weight"],
                                                          sd[last + "self_attn.v_proj.weight"]], 1))
    close("midlayer.mlp.down_proj.weight", sd[last + "mlp.down_proj.weight"])
    close("midlayer.input_layernorm.weight", sd[first + "input_layernorm.weight"])
    close("midlayer.hidden_norm.weight", sd[last + "input_layernorm.weight"])
    close("fc.weight", torch.cat([torch.zeros(H, 2 * H), torch.eye(H)], 1))  # the highest aux layer
    with pytest.raises(ValueError, match="hard_label"):
        train(_cfg(tiny_data, tmp_path / "bad", max_steps=1, hard_label=1.5))


def test_bench_levers_table(tiny_data, tmp_path, monkeypatch, capsys):
    """Each lever trains on the same features with its overrides and is served once at the end; the n-gram
    row is served on the same prompts; a finished row is read back; a changed lever under an old name is refused.
    (vLLM faked here: the served path is the eval tests' and the README's table.)"""
    from eyas import evaluate, serve_eval
    from eyas.bench import levers
    from eyas.config import Recipe, finalize

    served = []

    def fake_measure(target, draft, prompts, **kw):
        served.append(str(draft))
        al = 1.3 if draft == "ngram" else 1.1 + 0.1 * len(served)
        return {"acceptance_length": al, "per_pos": [al - 1, 0, 0], "al_at_k": [al] * 3, "load_seconds": 1.0,
                "n_prompts": len(prompts), "generated_tokens": 10, "tokens_per_s": 5.0, "tokens_per_step": al - 0.1,
                "domains": {"chat": {"acceptance_length": al}}}

    monkeypatch.setattr(serve_eval, "measure_acceptance", fake_measure)
    monkeypatch.setattr(evaluate, "measure_acceptance", fake_measure)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "domain": "chat", "messages": [{"role": "user", "content": "Hi"}]}) + "\n")
    cfg = Recipe()
    for k, v in vars(_cfg(tiny_data, tmp_path / "unused", max_steps=2, holdout=3, eval_every=1)).items():
        setattr(cfg.train, k, v)
    cfg.run.target = str(tiny_data["target"])
    cfg.eval.prompts = str(prompts)
    cfg = finalize(cfg)
    res = levers.bench_levers(cfg, ["hard: train.hard_label=0.5, train.lr=0.001"], tmp_path / "b")
    rows = {r["name"]: r for r in res["rows"]}
    assert list(rows) == ["ngram", "baseline", "hard"] and served[0] == "ngram"
    assert rows["hard"]["overrides"] == ["train.hard_label=0.5", "train.lr=0.001"]
    assert rows["baseline"]["steps"] == 2 and len(served) == 3  # one serve per row: eval_every is the end only
    assert rows["hard"]["sim_al"] >= 1.0 and rows["hard"]["draft_params"] > 0
    meta = json.loads((tmp_path / "b/levers/hard/train/checkpoints/step_2/trainer.json").read_text())
    assert meta["config"]["hard_label"] == 0.5 and meta["config"]["lr"] == 0.001
    assert "+0.100" in res["table"] and "ngram" in res["table"] and rows["hard"]["generated_tokens"] > 0
    again = levers.bench_levers(cfg, ["hard: train.hard_label=0.5, train.lr=0.001"], tmp_path / "b")
    assert again["rows"] == res["rows"] and len(served) == 3  # read back, nothing re-run
    # a row stopped after training, before vLLM measured it: measured on the next call, not retrained
    (tmp_path / "b/levers/hard/row.json").unlink()
    (tmp_path / "b/levers/hard/train/serve_eval.jsonl").unlink()
    again = levers.bench_levers(cfg, ["hard: train.hard_label=0.5, train.lr=0.001"], tmp_path / "b")
    assert len(served) == 4 and again["rows"][2]["steps"] == 2 and again["rows"][2]["seconds_per_step"] is None
    with pytest.raises(ValueError, match="holds lever 'hard'"):
        levers.bench_levers(cfg, ["hard: train.hard_label=0.25"], tmp_path / "b")
    with pytest.raises(ValueError, match="changes nothing"):
        levers.parse_lever("lonely")

    # the learning curve: nested subsets, same steps; a log fit and the tokens it predicts
    from eyas.bench.curve import bench_curve, fit_log, predict_tokens

    cur = bench_curve(cfg, [10, 0], tmp_path / "b")
    assert [r["samples"] for r in cur["rows"]] == [10, 45] and (tmp_path / "b/learning_curve.png").stat().st_size
    assert cur["rows"][0]["generated_tokens"] < cur["rows"][1]["generated_tokens"]
    a, b = fit_log([(1000, 1.5), (10000, 2.0)])
    assert predict_tokens(a, b, 2.5) == pytest.approx(100000) and predict_tokens(a, -b, 2.5) is None
    with pytest.raises(ValueError, match="two or more"):
        bench_curve(cfg, [0, 0], tmp_path / "b")
    scaled = bench_curve(cfg, [10, 0], tmp_path / "b", steps=[1, 3])  # steps scaled with the data
    assert [(r["samples"], r["steps"]) for r in scaled["rows"]] == [(10, 1), (45, 3)]
    with pytest.raises(ValueError, match="one positive step count per"):
        bench_curve(cfg, [10, 0], tmp_path / "b", steps=[2])


def test_bf16_compute_keeps_fp32_master_weights(tiny_data, tmp_path):
    from eyas.checkpoints import load_draft_state
    from eyas.train import train

    run = tmp_path / "run"
    s = train(_cfg(tiny_data, run, max_steps=3, precision="bf16"))
    assert json.loads((run / "manifest.json").read_text())["precision"] == "bf16"
    assert all(x == x for x in s["last"]["acc"]) and s["last"]["loss"] == s["last"]["loss"]  # finite
    state, _ = load_draft_state(run / "checkpoints" / "step_3")
    assert state["fc.weight"].dtype == torch.float32 and state["lm_head.weight"].dtype == torch.float32


def test_holdout_keeps_samples_out_of_training(tiny_data):
    from eyas.train.data import OfflineSource

    full = OfflineSource(tiny_data["features"], 2048)
    src = OfflineSource(tiny_data["features"], 2048, holdout=3)
    held = {full.ds.ids[i] for i in src.heldout}
    trained = {s["id"] for s in src.load(list(range(len(src))))}
    assert len(held) == 3 and len(src) == len(full) - 3 and not held & trained
    assert sum(1 for _ in src.ids_masks()) == len(src)  # the vocab is counted without them too
    assert OfflineSource(tiny_data["features"], 2048, holdout=3).heldout == src.heldout  # by id hash: stable
    with pytest.raises(ValueError, match="train.holdout"):
        OfflineSource(tiny_data["features"], 2048, holdout=len(full))
    # max_samples: nested subsets of the rest, never the held-out samples; their assistant tokens counted
    small, big = (OfflineSource(tiny_data["features"], 2048, holdout=3, max_samples=m) for m in (10, 20))
    assert len(small) == 10 and len(big) == 20 and set(small.index) < set(big.index) <= set(src.index)
    assert small.heldout == src.heldout
    assert 0 < small.generated_tokens < big.generated_tokens < src.generated_tokens
    assert small.generated_tokens == sum(int(s["loss_mask"].sum()) for s in small.load(list(range(10))))
    assert src.describe()["generated_tokens"] == src.generated_tokens


@pytest.mark.slow
def test_holdout_simulates_on_two_ranks(tiny_data, tmp_path):
    """Every rank runs the held-out forwards (FSDP gathers collectively); rank 0 logs them once."""
    run = tmp_path / "run"
    _run_cli(_cfg(tiny_data, run, max_steps=4), nproc=2, extra=("train.holdout=3", "train.eval_every=2"))
    logged = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if "sim_al" in r] == [2, 4]


def test_step_budget_arithmetic():
    from eyas.train.budget import StepBudget

    b = StepBudget(60, max_steps=1000, skip=2, window=8)
    for s in [5.0, 5.0] + [1.0] * 8:
        assert not b.due()
        b.add(s)
    assert b.due() and b.per_step() == 1.0  # the two set-up steps are not the pace
    assert b.fit(10, 1000, 1.0) == 10 + 42  # 60 s - 18 s spent, at 1 s a step
    assert b.fit(10, 30, 1.0) == 30  # never past max_steps
    assert b.fit(10, 1000, 100.0) == 10  # the budget buys no more: the run ends now
    with pytest.raises(ValueError, match="seconds > 0"):
        StepBudget(0, 10)


def test_a_run_budget_leaves_training_what_the_stages_before_it_left():
    """run.max_minutes: training gets the run's minutes less those gone and the reserve for the stages
    after it, at most its own train.max_minutes, at least the minute it times its steps in."""
    from eyas.train.budget import MIN_TRAIN_MINUTES, minutes_for_training

    assert minutes_for_training(120, 15, 80 * 60, 34) == pytest.approx(25)  # a slow synthesis: fewer minutes
    assert minutes_for_training(120, 15, 50 * 60, 34) == 34  # a fast one: its own cap
    assert minutes_for_training(120, 15, 50 * 60, 0) == pytest.approx(55)  # no cap of its own: all that is left
    assert minutes_for_training(120, 15, 110 * 60, 34) == MIN_TRAIN_MINUTES  # past the deadline


def test_a_step_budget_fits_the_run_and_a_resume_finishes_it(tiny_data, tmp_path, monkeypatch):
    """train.max_minutes: the trainer times its first steps, trains what fits (here 10 steps timed, then
    what a 1-minute budget buys at a pace pinned to 10 s a step: 5 more) and ends its cosine there; killed
    after step 12, a resume finishes the same 15 steps on the same schedule instead of fitting again."""
    from eyas.manifest import read_manifest
    from eyas.train import budget as B
    from eyas.train import train
    from eyas.train.loop import WarmupCosine

    monkeypatch.setattr(B.StepBudget, "per_step", lambda self: 10.0)
    run = tmp_path / "run"
    out = train(_cfg(tiny_data, run, max_steps=80, max_minutes=1.0, save_every=4))  # timed: 2 + 8 steps
    assert out["step"] == 15 and out["budget"]["fitted_steps"] == 15 and out["budget"]["max_steps"] == 80
    man = read_manifest(run)
    assert man["complete"] and man["fitted_steps"] == 15
    first = _metrics(run)
    assert [r["step"] for r in first if "loss" in r] == list(range(1, 16))
    lr_last = [r["lr"] for r in first if "lr" in r][-1]
    assert lr_last == pytest.approx(WarmupCosine(2e-3, 2, 15, 0.1)(14))  # the cosine ends at the fitted step
    assert train(_cfg(tiny_data, run, max_steps=80, max_minutes=1.0, save_every=4, resume=True))["skipped"]

    shutil.rmtree(run / "checkpoints" / "step_15")  # killed after step 12's checkpoint
    out = train(_cfg(tiny_data, run, max_steps=80, max_minutes=1.0, save_every=4, resume=True))
    assert out["step"] == 15 and out["steps_run"] == 3
    again = _metrics(run)
    assert [r["step"] for r in again if "loss" in r] == list(range(1, 16))
    assert [r["lr"] for r in again if "lr" in r][-1] == pytest.approx(lr_last)
