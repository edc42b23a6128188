"""Shared test setup: make the numbered stage files importable, and run Triton kernels on the CPU
through the interpreter when there is no GPU (it must be set before triton is imported)."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
