import json

import pytest


@pytest.mark.slow
def test_embedded_target_converted(embedded_target):
    cfg = json.loads((embedded_target / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["num_hidden_layers"] == 30 and cfg["hidden_size"] == 576 and cfg["vocab_size"] == 49152
    assert "quantization_config" not in cfg
    assert (embedded_target / "model.safetensors").exists()
    man = json.loads((embedded_target / "manifest.json").read_text())
    assert man["complete"] and man["tokenizer_hash"]
    # `models fetch` answers its check prompt in HF float32: every reply token up to "Paris" wins by >= 1.50 nats
    assert "paris" in man["check"]["reply"].lower()


@pytest.mark.slow
def test_embedded_target_chat_template(embedded_target):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(embedded_target)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nhi<|im_end|>" in text


def test_resolve_target_errors(tmp_path):
    from eyas.models import resolve_target

    with pytest.raises(ValueError, match="no target given"):
        resolve_target("")
    with pytest.raises(ValueError, match="neither a known model"):
        resolve_target(str(tmp_path))


def test_models_path_cli(embedded_target, capsys):
    from eyas.cli import main

    assert main(["models", "path", "smollm2-135m-instruct"]) == 0
    assert capsys.readouterr().out.strip() == str(embedded_target)


def test_tiny_targets(tiny_llama, tiny_moe):
    import torch
    from transformers import AutoModelForCausalLM

    for d in (tiny_llama, tiny_moe):
        m = AutoModelForCausalLM.from_pretrained(d)
        out = m(torch.tensor([[1, 2, 3]]), output_hidden_states=True)
        assert len(out.hidden_states) == m.config.num_hidden_layers + 1


# Prompts whose greedy answers win every step by a clear margin, so the check tests eyas's
# conversion and vLLM's template, not which side of a near-tie one CPU's bf16 kernels land on.
# HF float32, smallest top-1/top-2 log-prob gap over the reply up to the answer word:
# 1.50 nats (France, "The capital of France is Paris."), 1.84 nats (Japan, with a system turn).
# The bare "What is the capital of France?" opens on a 0.10-nat tie ("The" vs "L") that an
# Intel AMX machine's vLLM bf16 resolves to "L'Étoile, ...".
CHATS = [
    ([{"role": "user", "content": "What is the capital of France? Answer in one sentence."}], "paris"),
    ([{"role": "system", "content": "You are a helpful assistant."},
      {"role": "user", "content": "What is the capital of Japan? Answer in one word."}], "tokyo"),
]
VLLM_CHAT = r'''
import json, sys
if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    chats = json.loads(sys.argv[2])
    llm = LLM(model=sys.argv[1], dtype=sys.argv[3], max_model_len=1024, enforce_eager=True)
    outs = llm.chat(chats, SamplingParams(temperature=0.0, max_tokens=24, logprobs=2))
    gaps = [[(lp[t].decoded_token, sorted((x.logprob for x in lp.values()), reverse=True)) for t, lp in
             zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outs]
    print("RESULT " + json.dumps({"texts": [o.outputs[0].text for o in outs],
                                  "prompt_ids": [list(o.prompt_token_ids) for o in outs],
                                  "gaps": [[(t, v[0] - v[1]) for t, v in g] for g in gaps]}))
'''


def vllm_chat(target, tmp_path) -> dict:
    import os
    import subprocess
    import sys

    from eyas.host import engine_dtype, vllm_env

    script = tmp_path / "chat.py"
    script.write_text(VLLM_CHAT)
    proc = subprocess.run([sys.executable, str(script), str(target), json.dumps([c for c, _ in CHATS]), engine_dtype()],
                          capture_output=True, text=True, env=vllm_env({**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}),
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


@pytest.mark.slow
def test_vllm_serves_embedded_target_through_chat_template(embedded_target, tmp_path):
    """`eyas models path` gives a dir vLLM (CPU) loads, renders through the target's own chat
    template (token for token what `apply_chat_template` gives), and answers sensibly."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(embedded_target)
    got = vllm_chat(embedded_target, tmp_path)
    for (conv, answer), ids, text, gaps in zip(CHATS, got["prompt_ids"], got["texts"], got["gaps"]):
        assert ids == tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True, return_dict=False)
        upto = next((i for i, (t, _) in enumerate(gaps) if answer in t.lower()), len(gaps))
        margins = [f"{t!r} {g:.2f}" for t, g in gaps[:upto + 1]]
        assert answer in text.lower(), f"{text!r}; vLLM top-1/top-2 gaps (nats): {margins}"
