"""CPU test bed: real SGLang (plain and EAGLE-3) served on a CPU without GPU or AMX.

Test-only infrastructure for this project's tests, CI and CPU demo:

* ``_shim/sgl_kernel``: pure-PyTorch stand-in for the CUDA-only ``sgl_kernel`` wheel.
* ``models``: tiny deterministic target / EAGLE-3 draft models.
* ``serve``: ``python -m sglang_dynspec.testbed.serve [SGLang server args]``.
* ``plugin``: env-gated SGLang plugin that enables the spec-v2 overlap scheduler on CPU.
* ``server``: ``CpuServer`` context manager and HTTP request helpers.
"""

from pathlib import Path

# The directory to put first on PYTHONPATH so that ``import sgl_kernel`` finds the
# stand-in instead of the CUDA-only wheel.
SHIM_DIR = Path(__file__).resolve().parent / "_shim"
