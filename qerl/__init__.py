"""The full QeRL trainer: every variant, task, check, run folder, resume and fast path, built on the five
stages (01_quantize.py ... 05_grpo.py, beside this folder). `python -m qerl.train --help`."""

import os
import sys

# The stages are plain files next to qerl/ (their names start with a digit: no package can list them); the
# checkout goes last on sys.path so `importlib.import_module("01_quantize")` finds them wherever qerl runs from.
CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if CHECKOUT not in sys.path:
    sys.path.append(CHECKOUT)
