"""The EAGLE-3 draft head: one Llama layer computing exactly what vLLM's `llama_eagle3.py` runs.

vLLM (`Eagle3LlamaForCausalLM`, `LlamaModel`, `LlamaDecoderLayer` in llama_eagle3.py):

    g      = fc(cat(aux_k for k in layer_ids ascending))            # combine_hidden_states, [T, H]
    x      = cat([input_layernorm(embed(tok)), hidden_norm(h)], -1)  # [T, 2H], embeddings first
    a      = o_proj(attn(rope(q_proj(x)), rope(k_proj(x)), v_proj(x)))
    r      = a + h                                                  # residual = the un-normed hidden
    m      = mlp(post_attention_layernorm(r))
    h_out  = m + r                                                  # pre-norm output, fed back next step
    logits = lm_head(norm(h_out))                                   # [T, Vd]; target id = i + d2t[i]

where h is g at the first draft step and the previous step's `h_out` at later ones. The
state_dict keys of `Eagle3Draft` are the names vLLM loads (`fc.weight`,
`midlayer.self_attn.q_proj.weight`, ..., `d2t`, `t2d`), so export is a plain copy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from eyas.draft.spec import DraftSpec, draft_config_dict
from eyas.draft.unroll import unroll


class RMSNorm(nn.Module):
    """vLLM's RMSNorm: statistics in fp32, scale applied in the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Rope(nn.Module):
    """Neox-style rotary embedding of the target's type (default, llama3, yarn, ...) via transformers,
    on the first R = head_dim * partial_rotary_factor dims of each head as vLLM's `get_rope` applies it
    (MiniMax rotates half of each head): inv_freq = theta^(-2i/R), dims R.. pass through unrotated."""

    def __init__(self, spec: DraftSpec):
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        cfg = LlamaConfig(**draft_config_dict(spec))
        self.inner = LlamaRotaryEmbedding(cfg)
        rp = spec.rope_parameters
        rot = int(rp.get("rope_dim") or spec.head_dim * float(rp.get("partial_rotary_factor", 1.0)))
        if 2 * self.inner.inv_freq.numel() != rot:  # Llama's default init rotates every dim: give it R
            theta = float(rp.get("rope_theta", 10000.0))
            inv = 1.0 / theta ** (torch.arange(0, rot, 2, dtype=torch.int64).float() / rot)
            self.inner.register_buffer("inv_freq", inv, persistent=False)
            self.inner.original_inv_freq = inv

    def forward(self, positions: torch.Tensor, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """positions [B, T], each x [B, heads, T, D] -> the rotated xs (cos/sin [B, T, R] computed once)."""
        cos, sin = self.inner(xs[0], positions)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        R = cos.shape[-1]
        out = []
        for x in xs:
            xr, rest = x[..., :R], x[..., R:]
            x1, x2 = xr.chunk(2, dim=-1)
            out.append(torch.cat((xr * cos + torch.cat((-x2, x1), dim=-1) * sin, rest), dim=-1))
        return tuple(out)


class SelfAttention(nn.Module):
    def __init__(self, spec: DraftSpec):
        super().__init__()
        H2, nh, nkv, hd = 2 * spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_proj = nn.Linear(H2, nh * hd, bias=False)  # [nh*hd, 2H]
        self.k_proj = nn.Linear(H2, nkv * hd, bias=False)
        self.v_proj = nn.Linear(H2, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, spec.hidden_size, bias=False)


class MLP(nn.Module):
    def __init__(self, spec: DraftSpec):
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, spec: DraftSpec):
        super().__init__()
        eps = spec.rms_norm_eps
        self.hidden_norm = RMSNorm(spec.hidden_size, eps)
        self.input_layernorm = RMSNorm(spec.hidden_size, eps)
        self.self_attn = SelfAttention(spec)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, eps)
        self.mlp = MLP(spec)


class Eagle3Draft(nn.Module):
    """EAGLE-3 head with vLLM's parameter names. The attention itself lives in the caller
    (`eyas.draft.ttt` for training, a KV-cache loop for inference): this module gives the
    pieces before and after it, so both paths share every weight and every op."""

    def __init__(self, spec: DraftSpec, freeze_embed: bool = True):
        super().__init__()
        self.spec = spec
        H, eps = spec.hidden_size, spec.rms_norm_eps
        self.embed_tokens = nn.Embedding(spec.vocab_size, H)
        self.embed_tokens.weight.requires_grad_(not freeze_embed)
        if spec.norm_before_fc:
            self.input_norm = RMSNorm(spec.n_aux * spec.target_hidden_size, eps)
        if spec.fc_norm:
            self.fc_norm = nn.ModuleList([RMSNorm(spec.target_hidden_size, eps) for _ in range(spec.n_aux)])
        self.fc = nn.Linear(spec.n_aux * spec.target_hidden_size, H, bias=False)  # [H, n_aux*H_t]
        self.midlayer = MidLayer(spec)
        self.norm = RMSNorm(H, eps)
        self.lm_head = nn.Linear(H, spec.draft_vocab_size, bias=False)  # [Vd, H]
        self.register_buffer("d2t", torch.zeros(spec.draft_vocab_size, dtype=torch.int64))  # [Vd] offsets
        self.register_buffer("t2d", torch.zeros(spec.vocab_size, dtype=torch.bool))  # [V]
        self.rope = Rope(spec)  # non-persistent buffers only: no state_dict keys

    # ---- init -------------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self, embed: torch.Tensor | None = None, std: float = 0.02, seed: int = 0) -> None:
        """Deterministic init (same on every rank): linears N(0, std), norms 1, embedding copied."""
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if name == "embed_tokens.weight":
                continue
            if name.endswith("norm.weight") or ".fc_norm." in name or name.startswith("fc_norm."):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32) * std)
        if embed is not None:
            if tuple(embed.shape) != tuple(self.embed_tokens.weight.shape):
                raise ValueError(f"target embedding {tuple(embed.shape)} != draft {tuple(self.embed_tokens.weight.shape)}")
            self.embed_tokens.weight.copy_(embed)

    @torch.no_grad()
    def init_head(self, lm_head: torch.Tensor, norm: torch.Tensor | None) -> None:
        """Start the output side as the target's: lm_head [Vd, H] (the target's rows of the draft
        vocab) and the final norm [H] (None: keep ones), so the draft begins in a space the target's
        head already decodes and learns only to reach it."""
        if tuple(lm_head.shape) != tuple(self.lm_head.weight.shape):
            raise ValueError(f"target lm_head rows {tuple(lm_head.shape)} != draft {tuple(self.lm_head.weight.shape)}")
        self.lm_head.weight.copy_(lm_head)
        if norm is not None:
            self.norm.weight.copy_(norm)

    @torch.no_grad()
    def init_layer(self, first: dict[str, torch.Tensor], last: dict[str, torch.Tensor]) -> None:
        """Start the decoder layer from two of the target's (`eyas.target.target_layer` dicts): the
        embedding half of q/k/v and `input_layernorm` from its first layer (which reads embeddings),
        the hidden half, o_proj, the MLP and the other norms from its last; `fc` starts as the
        projection onto the highest aux layer. The draft then begins as a target layer on target
        states and learns the shift to the next token from there."""
        s, H = self.spec, self.spec.hidden_size
        if s.target_hidden_size != H:
            raise ValueError(f"init_layer needs the draft's hidden size {H} to equal the target's {s.target_hidden_size}")
        want = [f"self_attn.{n}_proj.weight" for n in "qkvo"] + [f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")]
        want += ["input_layernorm.weight", "post_attention_layernorm.weight"]
        missing = [n for n in want if n not in first or n not in last]
        if missing:  # e.g. an MoE layer (experts, no dense mlp)
            raise ValueError(f"init_layer: the target's layers lack {missing}; use init_layer=random for this target")
        lyr = self.midlayer
        for name in ("q_proj", "k_proj", "v_proj"):
            w = getattr(lyr.self_attn, name).weight  # [out, 2H]: embeddings first
            w[:, :H].copy_(first[f"self_attn.{name}.weight"])
            w[:, H:].copy_(last[f"self_attn.{name}.weight"])
        lyr.self_attn.o_proj.weight.copy_(last["self_attn.o_proj.weight"])
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(lyr.mlp, name).weight.copy_(last[f"mlp.{name}.weight"])
        lyr.input_layernorm.weight.copy_(first["input_layernorm.weight"])
        lyr.hidden_norm.weight.copy_(last["input_layernorm.weight"])
        lyr.post_attention_layernorm.weight.copy_(last["post_attention_layernorm.weight"])
        self.fc.weight.zero_()
        self.fc.weight[:, (s.n_aux - 1) * H:].copy_(torch.eye(H))

    @torch.no_grad()
    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        assert d2t.shape == self.d2t.shape and t2d.shape == self.t2d.shape
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def forward(
        self, input_ids: torch.Tensor, aux: torch.Tensor, row_masks: list[torch.Tensor]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The training forward: the TTT unroll (`eyas.draft.unroll`). Under FSDP2 the
        parameters are gathered for the whole call, so the unroll may use every piece below."""
        return unroll(self, input_ids, aux, row_masks)

    # ---- the pieces around attention --------------------------------------------------
    def combine_hidden_states(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [..., n_aux * H_t] (aux states concatenated, ascending layer ids) -> fc out [..., H]."""
        x = aux.to(self.fc.weight.dtype)
        if self.spec.norm_before_fc:
            x = self.input_norm(x)
        if self.spec.fc_norm:
            chunks = x.chunk(self.spec.n_aux, dim=-1)
            x = torch.cat([n(c) for n, c in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(x)

    def qkv(
        self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """ids [B, T], hidden [B, T, H], positions [B, T] -> q [B, nh, T, D], k, v [B, nkv, T, D] (roped),
        residual [B, T, H]."""
        lyr, s = self.midlayer, self.spec
        emb = lyr.input_layernorm(self.embed_tokens(input_ids).to(hidden.dtype))
        residual = hidden  # vLLM's default `_norm_after_residual`
        x = torch.cat([emb, lyr.hidden_norm(hidden)], dim=-1)  # [B, T, 2H], embeddings first
        B, T, _ = x.shape
        q = lyr.self_attn.q_proj(x).view(B, T, s.num_heads, s.head_dim).transpose(1, 2)
        k = lyr.self_attn.k_proj(x).view(B, T, s.num_kv_heads, s.head_dim).transpose(1, 2)
        v = lyr.self_attn.v_proj(x).view(B, T, s.num_kv_heads, s.head_dim).transpose(1, 2)
        q, k = self.rope(positions, q, k)
        return q, k, v, residual

    def after_attention(self, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """attn [B, nh, T, D] (softmax(qk)v), residual [B, T, H] -> pre-norm output [B, T, H]."""
        lyr = self.midlayer
        B, _, T, _ = attn.shape
        r = lyr.self_attn.o_proj(attn.transpose(1, 2).reshape(B, T, -1)) + residual
        return lyr.mlp(lyr.post_attention_layernorm(r)) + r

    def feedback(self, prenorm: torch.Tensor) -> torch.Tensor:
        """The hidden the next draft step takes (vLLM: pre-norm unless `norm_output`)."""
        return self.norm(prenorm) if self.spec.norm_output else prenorm

    def compute_logits(self, prenorm: torch.Tensor) -> torch.Tensor:
        """[..., H] -> draft-vocab logits [..., Vd]."""
        return self.lm_head(self.norm(prenorm))

    def draft_ids(self) -> torch.Tensor:
        """[Vd] int64 target ids of the draft vocab, ascending."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]
