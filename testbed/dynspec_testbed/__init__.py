"""CPU test bed: real SGLang (plain and EAGLE-3) served on a CPU without GPU or AMX.

Test-only infrastructure for this project's tests, CI and CPU demo, shipped as its own
distribution (``sglang-dynspec-testbed``, directory ``testbed/``) so that a serving
install of ``sglang-dynspec`` contains none of it:

* ``_shim/sgl_kernel``: pure-PyTorch stand-in for the CUDA-only ``sgl_kernel`` wheel.
* ``models``: tiny deterministic target / EAGLE-3 draft models.
* ``serve``: ``python -m dynspec_testbed.serve [SGLang server args]``.
* ``plugin``: env-gated SGLang plugin that enables the spec-v2 overlap scheduler on CPU.
* ``server``: ``CpuServer`` context manager, HTTP request helpers and the end-to-end
  tests' vocabulary (scheduler environments, server arguments, ``serve``, ``assert_no_kv_left``).
* ``draft_kv``: draft-KV dumps of finished requests, for the catch-up tests.
* ``workload``: request sets, load patterns and output comparison.
* ``demo``: ``python -m dynspec_testbed.demo``, the CPU demo.
* ``fake_server``: a fake SGLang HTTP server for the benchmark's tests and dry runs.
"""

from pathlib import Path

# The directory to put first on PYTHONPATH so that ``import sgl_kernel`` finds the
# stand-in instead of the CUDA-only wheel.
SHIM_DIR = Path(__file__).resolve().parent / "_shim"
