"""The draft head, its vocab and the TTT unroll against vLLM's inference path."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys

import pytest
import torch

from eyas.draft.model import Eagle3Draft
from eyas.draft.spec import DraftSpec, draft_config_dict
from eyas.draft.ttt import Batch, TargetHead, step_masks, ttt_loss
from eyas.draft.unroll import shift_left, ttt_mask, unroll
from eyas.draft.vocab import TokenCounter, build_draft_vocab, check_vocab, top_n_vocab
from eyas.target import load_head as load_target_head

VLLM_KEYS = {
    "fc.weight", "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight",
    "midlayer.post_attention_layernorm.weight", "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight",
    "norm.weight", "lm_head.weight", "d2t", "t2d", "embed_tokens.weight",
}


def small_spec(V=300, Vd=64, H=32, nh=4, nkv=2, hd=8, n_aux=3, **kw) -> DraftSpec:
    return DraftSpec(hidden_size=H, num_heads=nh, num_kv_heads=nkv, head_dim=hd, intermediate_size=48,
                     rms_norm_eps=1e-5, vocab_size=V, draft_vocab_size=Vd, target_hidden_size=H,
                     layer_ids=tuple(range(1, n_aux + 1)), max_position_embeddings=512,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **kw)


def random_draft(spec: DraftSpec, seed: int = 0) -> Eagle3Draft:
    torch.manual_seed(seed)
    m = Eagle3Draft(spec)
    m.init_weights(torch.randn(spec.vocab_size, spec.hidden_size), std=0.3, seed=seed)
    with torch.no_grad():  # non-trivial norm weights, so a swapped norm shows
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    ids = torch.sort(torch.randperm(spec.vocab_size)[: spec.draft_vocab_size]).values
    m.set_vocab(ids - torch.arange(spec.draft_vocab_size), torch.isin(torch.arange(spec.vocab_size), ids))
    return m.eval()


# ---------------------------------------------------------------------------------------------- model


@pytest.mark.parametrize("which", ["tiny_llama", "tiny_moe"])
def test_spec_keys_and_shapes(which, request):
    from transformers import AutoConfig

    target = request.getfixturevalue(which)
    tcfg = AutoConfig.from_pretrained(target)
    spec = DraftSpec.from_target_config(tcfg, [1, 2, 3], 512)
    m = Eagle3Draft(spec)
    sd = m.state_dict()
    assert set(sd) == VLLM_KEYS
    H, V = tcfg.hidden_size, tcfg.vocab_size
    q_out = tcfg.num_attention_heads * spec.head_dim
    kv_out = tcfg.num_key_value_heads * spec.head_dim
    assert sd["fc.weight"].shape == (H, 3 * H)
    assert sd["midlayer.self_attn.q_proj.weight"].shape == (q_out, 2 * H)
    assert sd["midlayer.self_attn.k_proj.weight"].shape == (kv_out, 2 * H)
    assert sd["midlayer.self_attn.o_proj.weight"].shape == (H, q_out)
    assert sd["lm_head.weight"].shape == (512, H)
    assert sd["d2t"].dtype == torch.int64 and sd["d2t"].shape == (512,)
    assert sd["t2d"].dtype == torch.bool and sd["t2d"].shape == (V,)
    assert sd["embed_tokens.weight"].shape == (V, H) and not m.embed_tokens.weight.requires_grad
    embed, head, cfg = load_target_head(target)
    assert embed.shape == (V, H) and head.shape == (V, H)
    if cfg.get("tie_word_embeddings"):
        assert torch.equal(embed, head)


def test_draft_config_dict_roundtrip(tiny_llama):
    from transformers import AutoConfig, LlamaConfig

    tcfg = AutoConfig.from_pretrained(tiny_llama)
    spec = DraftSpec.from_target_config(tcfg, [1, 2, 3], 1000, fc_norm=True)
    d = draft_config_dict(spec)
    assert d["architectures"] == ["LlamaForCausalLMEagle3"] and d["model_type"] == "llama"
    assert d["num_hidden_layers"] == 1 and d["tie_word_embeddings"] is False and d["fc_norm"] is True
    assert d["vocab_size"] == tcfg.vocab_size and d["draft_vocab_size"] == 1000
    assert d["target_hidden_size"] == tcfg.hidden_size and d["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert "num_aux_hidden_states" not in d
    for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size", "rms_norm_eps",
              "max_position_embeddings", "head_dim"):
        assert d[k] == getattr(tcfg, k), k
    assert d["rope_parameters"]["rope_theta"] == tcfg.rope_parameters["rope_theta"]
    hf = LlamaConfig(**d)
    assert hf.rope_parameters["rope_theta"] == tcfg.rope_parameters["rope_theta"]
    assert DraftSpec.from_draft_config(json.loads(json.dumps(d))) == spec
    two = draft_config_dict(DraftSpec.from_target_config(tcfg, [1, 3], 1000))
    assert two["num_aux_hidden_states"] == 2
    with pytest.raises(ValueError, match="ascending"):
        DraftSpec.from_target_config(tcfg, [3, 1], 10)


# ---------------------------------------------------------------------------------------------- vocab


def test_vocab_top_n_and_maps():
    counts = torch.zeros(20, dtype=torch.int64)
    counts[[7, 3, 15, 9]] = torch.tensor([5, 9, 5, 1])
    v = top_n_vocab(counts, 6)
    # top by count (3, then 7 and 15 tied -> both, then 9), then the lowest unseen ids fill: 0, 1
    assert v.draft_ids.tolist() == [0, 1, 3, 7, 9, 15]
    assert v.d2t.tolist() == [0, 0, 1, 4, 5, 10]
    assert (torch.arange(6) + v.d2t).tolist() == v.draft_ids.tolist()
    assert v.t2d.nonzero().flatten().tolist() == v.draft_ids.tolist()
    assert v.coverage == 1.0 and v.num_seen == 4
    check_vocab(v.d2t, v.t2d, 20)
    assert top_n_vocab(counts, 2).draft_ids.tolist() == [3, 7]
    with pytest.raises(ValueError):
        top_n_vocab(counts, 21)
    bad = v.d2t.clone()
    bad[0] = 5
    with pytest.raises(AssertionError):
        check_vocab(bad, v.t2d, 20)


def test_vocab_counts_only_loss_tokens_and_caches_by_content(tmp_path):
    ids = [torch.tensor([1, 2, 3, 4, 4]), torch.tensor([5, 5, 6])]
    masks = [torch.tensor([0, 0, 1, 1, 1]).bool(), torch.tensor([1, 1, 0]).bool()]
    c = TokenCounter(10)
    for a, b in zip(ids, masks):
        c.add(a, b)
    assert c.counts.tolist() == [0, 0, 0, 1, 2, 2, 0, 0, 0, 0]
    with pytest.raises(ValueError, match="outside the target vocab"):
        c.add(torch.tensor([10]), torch.tensor([True]))
    v1 = build_draft_vocab(zip(ids, masks), 3, 10, cache_dir=tmp_path)
    assert v1.draft_ids.tolist() == [3, 4, 5]
    assert len(list(tmp_path.glob("draft_vocab_*.safetensors"))) == 1
    v2 = build_draft_vocab(zip(ids, masks), 3, 10, cache_dir=tmp_path)  # same content: cache hit
    assert v2.key == v1.key and len(list(tmp_path.glob("draft_vocab_*.safetensors"))) == 1
    masks2 = [masks[0], torch.tensor([0, 0, 1]).bool()]  # same ids, other mask: another key
    v3 = build_draft_vocab(zip(ids, masks2), 3, 10, cache_dir=tmp_path)
    assert v3.key != v1.key and v3.draft_ids.tolist() == [3, 4, 6]
    assert build_draft_vocab(zip(ids, masks), 4, 10, cache_dir=tmp_path).key != v1.key  # N is in the key


# ---------------------------------------------------------------------------------------------- TTT


def test_ttt_mask_pattern():
    m = ttt_mask(3, 2)
    want = [
        [1, 0, 0, 1, 0, 0, 1, 0, 0],
        [1, 1, 0, 0, 1, 0, 0, 1, 0],
        [1, 1, 1, 0, 0, 1, 0, 0, 1],
    ]
    assert m.int().tolist() == want


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("B,T,nh,nkv", [(2, 37, 4, 2), (1, 130, 3, 3)])
def test_diagonal_merge_equals_the_dense_masked_attention(dtype, tol, B, T, nh, nkv):
    """The CPU path of TTT steps 1..2 (a causal flash pass merged with the diagonal keys) against one
    dense SDPA over all (i+1)T keys with `ttt_mask`: outputs and every input's gradient."""
    import torch.nn.functional as F

    from eyas.draft.unroll import attend

    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, nh, T, 16, generator=g).to(dtype).requires_grad_()
    ks = [torch.randn(B, nkv, T, 16, generator=g).to(dtype).requires_grad_() for _ in range(3)]
    vs = [torch.randn(B, nkv, T, 16, generator=g).to(dtype).requires_grad_() for _ in range(3)]
    for i in (1, 2):
        ins = [q, *ks[: i + 1], *vs[: i + 1]]
        got = attend(q, ks[: i + 1], vs[: i + 1])
        want = F.scaled_dot_product_attention(q, torch.cat(ks[: i + 1], 2), torch.cat(vs[: i + 1], 2),
                                              attn_mask=ttt_mask(T, i), enable_gqa=nh != nkv)
        dout = torch.randn(want.shape, generator=g).to(dtype)
        for a, b in zip([got, *torch.autograd.grad(got, ins, dout)], [want, *torch.autograd.grad(want, ins, dout)]):
            assert a.dtype == b.dtype and a.shape == b.shape
            assert (a.float() - b.float()).abs().max() <= tol * b.float().abs().max()


def brute_force(model: Eagle3Draft, ids: torch.Tensor, aux: torch.Tensor, K: int):
    """Inference simulated token by token with an explicit KV cache (one sequence).

    For every chain start p: prefill positions 0..p with (fc(aux_t), x_{t+1}), then K-1 draft
    steps at positions p+1.. with the teacher token x_{p+1+i} and the fed-back pre-norm hidden.
    Returns {(i, p): (prenorm [H], logits [Vd])}."""
    s = model.spec
    T = ids.shape[0]
    out = {}
    g = model.combine_hidden_states(aux)  # [T, H]
    rep = s.num_heads // s.num_kv_heads

    def layer(tok, hidden, pos, cache):
        q, k, v, res = model.qkv(tok.view(1, 1), hidden.view(1, 1, -1), torch.tensor([[pos]]))
        cache.append((k[0, :, 0], v[0, :, 0]))  # [nkv, D]
        K_ = torch.stack([c[0] for c in cache], 1).repeat_interleave(rep, 0)  # [nh, n, D]
        V_ = torch.stack([c[1] for c in cache], 1).repeat_interleave(rep, 0)
        att = torch.softmax((q[0, :, 0, None, :] * K_).sum(-1) / math.sqrt(s.head_dim), dim=-1)  # [nh, n]
        o = (att[..., None] * V_).sum(1)  # [nh, D]
        return model.after_attention(o.view(1, s.num_heads, 1, s.head_dim), res)[0, 0]

    for p in range(T - 1):
        cache: list = []
        for t in range(p + 1):
            pre = layer(ids[t + 1], g[t], t, cache)
        out[(0, p)] = (pre, model.compute_logits(pre))
        for i in range(1, K):
            if p + 1 + i >= T:
                break
            pre = layer(ids[p + 1 + i], model.feedback(pre), p + i, cache)
            out[(i, p)] = (pre, model.compute_logits(pre))
    return out


@pytest.mark.parametrize("kw", [{}, {"nkv": 4, "fc_norm": True}, {"n_aux": 2, "norm_before_fc": True}])
def test_ttt_unroll_matches_token_by_token_inference(kw):
    spec = small_spec(**kw)
    model = random_draft(spec)
    B, T, K = 2, 12, 4
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, spec.vocab_size, (B, T), generator=g)
    aux = torch.randn(B, T, spec.n_aux * spec.hidden_size, generator=g)
    lens = [T, 9]
    rows = [torch.ones(B, T, dtype=torch.bool) for _ in range(K)]
    with torch.no_grad():
        _, pre = unroll(model, ids, aux, rows)
        for b in range(B):
            L = lens[b]  # right padding must not change the real positions
            ref = brute_force(model, ids[b, :L], aux[b, :L], K)
            assert len(ref) > 10
            for (i, p), (r_pre, r_logits) in ref.items():
                torch.testing.assert_close(pre[i][b, p], r_pre, rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(model.compute_logits(pre[i][b, p]), r_logits, rtol=1e-4, atol=1e-4)


class _Oracle(torch.nn.Module):
    """Stands in for the draft: at step i, index p, its top-1 is x_{p+2+i} under our convention."""

    def __init__(self, vocab_ids: torch.Tensor, V: int):
        super().__init__()
        self.ids = vocab_ids
        self.register_buffer("d2t", vocab_ids - torch.arange(vocab_ids.numel()))
        self.t2d_index = torch.full((V,), -1, dtype=torch.int64)
        self.t2d_index[vocab_ids] = torch.arange(vocab_ids.numel())

    def forward(self, input_ids, aux, row_masks):
        out = []
        for i, m in enumerate(row_masks):
            nxt = torch.zeros_like(input_ids)
            nxt[:, : input_ids.shape[1] - 2 - i] = input_ids[:, 2 + i :]
            out.append(torch.nn.functional.one_hot(self.t2d_index[nxt[m]], self.ids.numel()).float() * 30)
        return out, None

    def draft_to_target(self, d):
        return d + self.d2t[d]


def test_loss_labels_follow_vllm_shift():
    """Target top-1 at position j is x_{j+1} (on-policy); the oracle predicting x_{p+2+i} at
    (step i, index p) must score 100% at every step and a near-zero loss."""
    V, H, B, T, K = 50, 64, 2, 16, 4
    g = torch.Generator().manual_seed(0)
    W = torch.randn(V, H, generator=g)
    ids = torch.randint(0, V, (B, T), generator=g)
    nxt = torch.cat([ids[:, 1:], ids[:, :1]], 1)
    last = W[nxt] * 3.0  # the target at j puts its mass on x_{j+1}
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[:, :3] = False
    mask[1, 12:] = False  # padding / prompt
    vocab = torch.arange(V)
    head = TargetHead(W, vocab)
    oracle = _Oracle(vocab, V)
    loss, st = ttt_loss(oracle, Batch(ids, mask, torch.zeros(B, T, 3 * H), last), head, K, 0.8)
    assert st["rows"].tolist() == [m.sum().item() for m in step_masks(mask, K)]
    assert st["correct"].tolist() == st["rows"].tolist()
    assert st["cond_num"].tolist() == st["cond_den"].tolist()
    assert float(loss) < 0.5
    # a draft one position late scores at chance
    late = _Oracle(vocab, V)
    late.forward = lambda input_ids, aux, rm: oracle.forward(torch.cat([input_ids[:, :1], input_ids[:, :-1]], 1), aux, rm)
    _, st2 = ttt_loss(late, Batch(ids, mask, torch.zeros(B, T, 3 * H), last), head, K, 0.8)
    assert st2["correct"].sum() < 0.2 * st2["rows"].sum()
    # unscored micro-batches: same loss and CE counts, no accuracy counts
    loss3, st3 = ttt_loss(oracle, Batch(ids, mask, torch.zeros(B, T, 3 * H), last), head, K, 0.8, score=False)
    assert torch.equal(loss3, loss) and st["scored"].tolist() == st["rows"].tolist()
    for k in ("loss_sum", "rows", "ent_sum"):
        assert torch.equal(st3[k], st[k]), k
    for k in ("scored", "correct", "cond_den", "cond_num", "in_vocab"):
        assert not st3[k].any(), k


def test_hard_label_mix():
    """hard=1 is the CE against the argmax of the target's draft-vocab distribution; hard=h mixes linearly."""
    V, H, B, T, K = 40, 32, 2, 12, 2
    g = torch.Generator().manual_seed(1)
    W = torch.randn(V, H, generator=g)
    ids = torch.randint(0, V, (B, T), generator=g)
    b = Batch(ids, torch.ones(B, T, dtype=torch.bool), torch.randn(B, T, 3 * H, generator=g),
              torch.randn(B, T, H, generator=g))
    spec = small_spec(V=V, Vd=V)
    model = random_draft(spec)
    head = TargetHead(W, torch.arange(V))
    soft, st = ttt_loss(model, b, head, K, 0.5)
    hard, _ = ttt_loss(model, b, head, K, 0.5, hard=1.0)
    mix, st_mix = ttt_loss(model, b, head, K, 0.5, hard=0.25)
    assert torch.allclose(mix, 0.75 * soft + 0.25 * hard, atol=1e-5)
    assert torch.equal(st_mix["loss_sum"], st["loss_sum"])  # the logged CE stays the soft one
    # by hand: step 0 rows, label = argmax of the target's distribution at position p+1
    masks = step_masks(b.loss_mask, K)
    logits, _ = model(b.input_ids, b.aux, masks)
    y = (b.last @ W.T).argmax(-1)  # [B, T] target argmax at each position
    want = 0.0
    for i, lg in enumerate(logits):
        rows = torch.nn.functional.cross_entropy(lg.float(), shift_left(y, 1 + i, 0)[masks[i]], reduction="mean")
        want += 0.5**i * rows
    assert torch.allclose(hard, want, atol=1e-5)


def test_lk_loss_and_peaked_positions():
    """loss=lk is -log Σ min(p, q) per row (the acceptance probability of a sampled proposal);
    min_prob trains only rows whose target top probability reaches it, and logs every row."""
    V, H, B, T, K = 40, 32, 2, 12, 2
    g = torch.Generator().manual_seed(2)
    W = torch.randn(V, H, generator=g)
    ids = torch.randint(0, V, (B, T), generator=g)
    b = Batch(ids, torch.ones(B, T, dtype=torch.bool), torch.randn(B, T, 3 * H, generator=g),
              torch.randn(B, T, H, generator=g) * 0.5)
    model = random_draft(small_spec(V=V, Vd=V))
    head = TargetHead(W, torch.arange(V))
    masks = step_masks(b.loss_mask, K)
    logits, _ = model(b.input_ids, b.aux, masks)
    q_all = torch.softmax(b.last @ W.T, -1)  # [B, T, V] the target's distribution at each position
    qs = [shift_left(q_all, 1 + i, 0.0)[masks[i]] for i in range(K)]  # step i's labels
    ps = [torch.softmax(lg.float(), -1) for lg in logits]

    lk, st_lk = ttt_loss(model, b, head, K, 0.5, loss="lk")
    want = sum(0.5**i * -torch.log(torch.minimum(p, q).sum(-1)).mean() for i, (p, q) in enumerate(zip(ps, qs)))
    assert torch.allclose(lk, want, atol=1e-5)
    soft, st = ttt_loss(model, b, head, K, 0.5)
    assert torch.equal(st_lk["loss_sum"], st["loss_sum"])  # the logged CE stays the soft one
    lk.backward()
    assert model.lm_head.weight.grad.abs().sum() > 0

    thr = float(qs[0].amax(-1).median())  # about half of step 0's rows are peaked enough
    peaked, st_p = ttt_loss(model, b, head, K, 0.5, min_prob=thr)
    want = 0.0
    for i, (p, q) in enumerate(zip(ps, qs)):
        keep = q.amax(-1) >= thr
        assert 0 < int(keep.sum()) < keep.numel()
        want += 0.5**i * -(q[keep] * torch.log(p[keep])).sum(-1).mean()
    assert torch.allclose(peaked, want, atol=1e-5)
    for k in ("loss_sum", "rows", "correct"):
        assert torch.equal(st_p[k], st[k]), k  # the counts still cover every row
    top = max(float(q.amax()) for q in qs)
    assert top < 1
    none, _ = ttt_loss(model, b, head, K, 0.5, min_prob=(top + 1) / 2)  # no row is that peaked: nothing to train
    assert float(none.detach()) == 0.0


def test_loss_decreases_on_a_fixed_batch():
    spec = small_spec(V=100, Vd=100)
    model = random_draft(spec)
    model.train()
    g = torch.Generator().manual_seed(2)
    W = torch.randn(100, spec.hidden_size, generator=g)
    ids = torch.randint(0, 100, (2, 24), generator=g)
    b = Batch(ids, torch.ones(2, 24, dtype=torch.bool), torch.randn(2, 24, 3 * spec.hidden_size, generator=g),
              torch.randn(2, 24, spec.hidden_size, generator=g))
    head = TargetHead(W, torch.arange(100))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for _ in range(30):
        loss, _ = ttt_loss(model, b, head, 3, 0.8)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.7 * losses[0]


# ---------------------------------------------------------------------------------------------- vLLM's own layer

VLLM_REF = r'''
import socket, sys, torch
from torch import nn
from transformers import LlamaConfig
import vllm.model_executor.models.llama as vllama
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel

class KVAttention(nn.Module):
    """Stands in for vLLM's paged Attention: a plain KV cache, causal over cache + new tokens."""
    def __init__(self, num_heads, head_dim, scale, num_kv_heads=None, **kw):
        super().__init__()
        self.nh, self.hd, self.scale, self.nkv = num_heads, head_dim, scale, num_kv_heads or num_heads
        self.reset()
    def reset(self):
        self.k = torch.zeros(0, self.nkv, self.hd); self.v = torch.zeros(0, self.nkv, self.hd)
    def forward(self, q, k, v):
        n = q.shape[0]
        self.k = torch.cat([self.k, k.view(n, self.nkv, self.hd)]); self.v = torch.cat([self.v, v.view(n, self.nkv, self.hd)])
        L = self.k.shape[0]
        rep = self.nh // self.nkv
        K = self.k.repeat_interleave(rep, 1); V = self.v.repeat_interleave(rep, 1)   # [L, nh, D]
        s = torch.einsum("qhd,khd->hqk", q.view(n, self.nh, self.hd), K) * self.scale
        allowed = torch.arange(L)[None, :] <= (torch.arange(n)[:, None] + L - n)
        s = s.masked_fill(~allowed, float("-inf"))
        return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), V).reshape(n, self.nh * self.hd)

vllama.Attention = KVAttention
inp = torch.load(sys.argv[1])
sd, cfgd, ids, aux, K = inp["state"], inp["config"], inp["ids"], inp["aux"], inp["K"]
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
vc = VllmConfig()
with set_current_vllm_config(vc):
    init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                 local_rank=0, backend="gloo")
    initialize_model_parallel(1, 1)
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.models.llama_eagle3 import LlamaDecoderLayer, LlamaModel
    LlamaDecoderLayer.get_quant_config = lambda self, vc: None
    cfg = LlamaConfig(**cfgd)
    layer = LlamaDecoderLayer(vc, prefix="model.layers.30", config=cfg, layer_idx=0)
    norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
    # vLLM's own name mapping: midlayer. -> layers.0., q/k/v -> qkv_proj shards, gate/up -> gate_up_proj
    mapper = LlamaModel.hf_to_vllm_mapper
    params = dict(layer.named_parameters())
    with torch.no_grad():
        for name, w in sd.items():
            if not name.startswith("midlayer."):
                continue
            sub = name[len("midlayer."):]
            for src, (dst, shard) in mapper.orig_to_new_stacked.items():
                if src + "." in "." + sub:
                    p = params[sub.replace(src[1:], dst[1:])]
                    p.weight_loader(p, w, shard)
                    break
            else:
                params[sub].copy_(w)
        norm.weight.copy_(sd["norm.weight"])
    for m in layer.modules():
        if getattr(m, "quant_method", None) is not None:
            m.quant_method.process_weights_after_loading(m)
    attn = layer.self_attn.attn
    fc_w, embed, lm_head = sd["fc.weight"], sd["embed_tokens.weight"], sd["lm_head.weight"]
    d2t = sd["d2t"]
    V, Vd = cfgd["vocab_size"], cfgd["draft_vocab_size"]

    def model(tok, hidden, pos):  # LlamaModel.forward of llama_eagle3, one layer
        h, res = layer(positions=pos, embeds=embed[tok], hidden_states=hidden, residual=None)
        normed, prenorm = norm(h, res)
        return normed, prenorm

    def compute_logits(normed):  # Eagle3LlamaForCausalLM.compute_logits
        lg = normed @ lm_head.T
        full = lg.new_full((lg.shape[0], V), float("-inf"))
        full[:, torch.arange(Vd) + d2t] = lg
        return full

    T = ids.shape[0]
    out = {}
    with torch.no_grad():
        g = aux @ fc_w.T  # combine_hidden_states
        for p in range(T - 1):
            attn.reset()
            tok = torch.cat([ids[1:], ids[-1:]])[: p + 1]  # first pass: ids rotated left, positions unchanged
            normed, prenorm = model(tok, g[: p + 1], torch.arange(p + 1))
            out[(0, p)] = compute_logits(normed[-1:])[0]
            hidden = prenorm[-1:]
            for i in range(1, K):
                if p + 1 + i >= T:
                    break
                normed, hidden = model(ids[p + 1 + i].view(1), hidden, torch.tensor([p + i]))
                out[(i, p)] = compute_logits(normed)[0]
    torch.save(out, sys.argv[2])
'''


ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "partial": {"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5},  # MiniMax-M2
    "llama3": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "yarn_partial": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 64,
                     "partial_rotary_factor": 0.5},
    "kimi_yarn": {"rope_type": "yarn", "rope_theta": 5e4, "factor": 64.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                  "beta_fast": 1.0, "beta_slow": 1.0, "original_max_position_embeddings": 4},  # Kimi-K2's, short
}


@pytest.mark.parametrize("rope", list(ROPES))
def test_matches_vllm_llama_eagle3_layer(tmp_path, rope):
    """Same weights, same inputs: our TTT logits == vLLM's own Eagle3 decoder layer run as the
    proposer runs it (first pass over the prefix, then one token per draft step), full vocab via d2t;
    for each rope the draft config can carry (a partial one rotates only the first dims of a head)."""
    spec = dataclasses.replace(small_spec(V=200, Vd=64, H=64, nh=4, nkv=2, hd=16), rope_parameters=ROPES[rope])
    model = random_draft(spec, seed=3)
    g = torch.Generator().manual_seed(4)
    T, K = 10, 4
    ids = torch.randint(0, spec.vocab_size, (T,), generator=g)
    aux = torch.randn(T, 3 * spec.hidden_size, generator=g)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    torch.save({"state": sd, "config": draft_config_dict(spec, torch_dtype="float32"), "ids": ids, "aux": aux, "K": K},
               tmp_path / "in.pt")
    script = tmp_path / "vllm_ref.py"
    script.write_text(VLLM_REF)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref = torch.load(tmp_path / "out.pt")
    with torch.no_grad():
        rows = [torch.ones(1, T, dtype=torch.bool) for _ in range(K)]
        logits, _ = unroll(model, ids[None], aux[None], rows)
    n = 0
    for (i, p), full in ref.items():
        ours = logits[i][p]  # [Vd] at index p (rows are all of [0, T))
        mapped = torch.full_like(full, float("-inf"))
        mapped[model.draft_to_target(torch.arange(spec.draft_vocab_size))] = ours
        kept = torch.isfinite(full)
        assert torch.equal(kept, torch.isfinite(mapped))
        torch.testing.assert_close(mapped[kept], full[kept], rtol=1e-4, atol=1e-4)
        assert int(mapped.argmax()) == int(full.argmax())
        n += 1
    assert n == sum(1 for p in range(T - 1) for i in range(K) if p + 1 + i < T)


# ---------------------------------------------------------------- simulated acceptance


def test_walk_follows_greedy_verification():
    """The module docstring's example, a draft wrong from step 1 on, and spans per request."""
    from eyas.draft.simulate import spans, walk

    T, k = 12, 3
    ids = torch.arange(100, 100 + T)
    gen = torch.zeros(T, dtype=torch.bool)
    gen[3:10] = True  # one reply: x3..x9
    perfect = torch.stack([torch.cat([ids[2 + i:], torch.full((2 + i,), -1)]) for i in range(k)])  # [k, T]
    assert walk(perfect, ids, gen) == (2, [2, 2, 1])  # AL 3.5 for 7 tokens
    first_only = perfect.clone()
    first_only[1:] = -1
    assert walk(first_only, ids, gen) == (3, [3, 0, 0])  # p = 2, 4, 6 (8 would end at x9 after x8 + bonus)
    nothing = torch.full_like(perfect, -1)
    assert walk(nothing, ids, gen) == (6, [0, 0, 0])  # one token per step: drafts at p = 2..7
    two = gen.clone()
    two[6] = False  # two replies: x3..x5 and x7..x9
    assert spans(two) == [(3, 5), (7, 9)]
    assert walk(perfect, ids, two) == (2, [2, 2, 0])  # one draft per reply, each cut at its end


def test_simulated_acceptance_of_an_oracle_draft():
    """A draft that always proposes the data: every chain accepted up to the span's end."""
    from eyas.draft.simulate import simulate_acceptance

    V, B, T, k = 50, 2, 16, 3
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (B, T), generator=g)
    oracle = _Oracle(torch.arange(V), V)
    gen = torch.zeros(B, T, dtype=torch.bool)
    gen[:, 4:] = True
    c = simulate_acceptance(oracle, ids, torch.zeros(B, T, 1), gen, k)
    # per row: span [4, 15], p = 3 -> 7 -> 11 (3 accepted each) -> 15 stops: 3 drafts, 9 accepted
    assert c == {"num_drafts": 6, "num_draft_tokens": 18, "num_accepted_tokens": 18, "accepted_per_pos": [6, 6, 6]}
