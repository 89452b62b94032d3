import os
import shutil
import tempfile
from pathlib import Path

import pytest


SHARED = ("models", "data")  # caches the suite shares with the user's $EYAS_HOME: fetched once, read by all


def pytest_configure(config):
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    _own_home(config)


def _own_home(config) -> None:
    """The suite runs in an EYAS_HOME of its own, made empty for each run: what earlier runs left in
    the user's (a draft vocab cache, a checkpoint key) cannot change what a test sees. The model and
    data caches are the user's, linked in: they are the same whatever made them, and slow to make."""
    from eyas.models import eyas_home

    user = eyas_home()
    home = Path(tempfile.mkdtemp(prefix="eyas-test-home-"))
    for name in SHARED:
        (user / name).mkdir(parents=True, exist_ok=True)
        (home / name).symlink_to(user / name, target_is_directory=True)
    os.environ["EYAS_HOME"] = str(home)
    config._eyas_home = home


def pytest_unconfigure(config):
    home = getattr(config, "_eyas_home", None)
    if home is not None:
        shutil.rmtree(home, ignore_errors=True)  # the links only: the shared caches stay


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
