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


VLLM_CHAT = r'''
import json, sys
if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    llm = LLM(model=sys.argv[1], dtype="bfloat16", max_model_len=1024, enforce_eager=True)
    outs = llm.chat(
        [[{"role": "user", "content": "What is the capital of France?"}],
         [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Name a primary color."}]],
        SamplingParams(temperature=0.0, max_tokens=24),
    )
    print("RESULT " + json.dumps([o.outputs[0].text for o in outs]))
'''


@pytest.mark.slow
def test_vllm_serves_embedded_target_through_chat_template(embedded_target, tmp_path):
    """`eyas models path` gives a dir vLLM (CPU) loads and answers sensibly through the chat template."""
    import os
    import subprocess
    import sys

    script = tmp_path / "chat.py"
    script.write_text(VLLM_CHAT)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run([sys.executable, str(script), str(embedded_target)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    answers = json.loads(line[len("RESULT "):])
    assert "paris" in answers[0].lower()
    assert any(c in answers[1].lower() for c in ("red", "blue", "yellow", "green"))
