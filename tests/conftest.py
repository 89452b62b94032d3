import os
from pathlib import Path

import pytest


def pytest_configure(config):
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@pytest.fixture(scope="session")
def embedded_target() -> Path:
    """The real SmolLM2-135M-Instruct HF dir (fetched and converted once, cached in EYAS_HOME)."""
    from eyas.models import fetch

    return fetch("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, embedded_target) -> Path:
    from eyas.testing import make_tiny_target

    return make_tiny_target(tmp_path_factory.mktemp("tiny_llama"), embedded_target, arch="llama")


@pytest.fixture(scope="session")
def tiny_moe(tmp_path_factory, embedded_target) -> Path:
    from eyas.testing import make_tiny_target

    return make_tiny_target(tmp_path_factory.mktemp("tiny_moe"), embedded_target, arch="qwen3_moe")


@pytest.fixture(scope="session")
def vllm_target(tmp_path_factory, embedded_target) -> Path:
    """A tiny random llama vLLM CPU can run (its attention needs head_dim >= 32: hidden 128, 4 heads)."""
    from eyas.testing import make_tiny_target

    return make_tiny_target(tmp_path_factory.mktemp("tiny128"), embedded_target, hidden=128)
