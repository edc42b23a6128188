"""Shared test setup: make the numbered stage files importable, and run Triton kernels on the CPU
through the interpreter when there is no GPU (it must be set before triton is imported)."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def trainer_plain_path(monkeypatch):
    """The trainer's --plain path for one test (its switches put back after): what the stages equal bit for bit."""
    from qerl import grpo_variants
    for owner, name in grpo_variants.PLAIN_SWITCHES:
        monkeypatch.setattr(owner, name, False)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run faster on one thread, far faster on a busy CPU; both sides of a comparison run alike."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_configure(config):
    config.addinivalue_line("markers", "real_model: needs the real SmolLM2 model (a 93 MB download, 540 MB cached in "
                                       "~/.cache/qerl); QERL_SKIP_REAL_MODEL=1 or -m 'not real_model' skips it")


def pytest_collection_modifyitems(config, items):
    if os.environ.get("QERL_SKIP_REAL_MODEL", "") not in ("", "0"):
        import pytest
        skip = pytest.mark.skip(reason="QERL_SKIP_REAL_MODEL is set: the real SmolLM2 model is not tested")
        for item in items:
            if "real_model" in item.keywords:
                item.add_marker(skip)
