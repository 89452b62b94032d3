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
