"""Issue 21 §1 on the H200: SGLang's parity and logprob kits, unchanged, with SGLang's own fixture.

    python3 benchmarks/h200/kits_gpu.py MODELS_DIR RESULTS.jsonl [CLASS ...]   # after kits.sh put sglang/test in place

``SpecParityKit`` and ``SpecLogprobKit`` (SGLang 0.5.17's ``sglang.test.kits.spec_server_kits``)
are mixed into SGLang's ``SpecEagleServerBase`` exactly as SGLang's own test classes do; only the
class attributes (the fixture's launch knobs) are set here: the test bed's ``wide`` pair (random
weights, 32,000-id vocabulary; built on the device by ``python -m dynspec_testbed.models``),
triton attention, bf16, and ``--enable-deterministic-inference`` on the kit's reference server and
the server under test. Two servers under test: EAGLE3_DYNAMIC at thresholds that make the kits'
requests cross both modes, and stock EAGLE3 as the control (SGLang's verify numerics differ from
its decode's, so the parity kit may fail for stock EAGLE3 on requests that speculate).
CLASS names the classes to run (default both; one class with its servers fits a device call
that the pair may not), or one method as CLASS.METHOD. Each kit method's result is one JSON line in RESULTS.jsonl (the servers' output goes to this
process's stdout and stderr); the exit code is unittest's.
"""

import faulthandler
import json
import os
import signal
import subprocess
import sys
import threading
import unittest

from sglang.test.kits.spec_server_kits import SpecLogprobKit, SpecParityKit
from sglang.test.server_fixtures.spec_eagle_fixture import SpecEagleServerBase

MODELS, RESULTS, CLASSES = sys.argv[1], sys.argv[2], sys.argv[3:]
CHUNKED_PREFILL_SIZE = 1024
# With --enable-deterministic-inference and triton attention, SGLang 0.5.17 cuts a chunked
# prefill only at multiples of this (default 4,096, scheduler.init_deterministic_inference_config):
# above the chunk size no chunk is ever cut, a prompt longer than one chunk is never admitted and
# the queue behind it waits forever (test_logprob_mixed's 2,000-token prompts, 2026-12-03). Set
# here, before any server starts, so the kit's reference server cuts at the same places.
os.environ["SGLANG_TRITON_PREFILL_TRUNCATION_ALIGN_SIZE"] = str(CHUNKED_PREFILL_SIZE)
# A kit method that hangs would take the rest of the device call: after this many seconds its
# result is "timeout", the servers' Python stacks are dumped into the log (PYTHONFAULTHANDLER,
# set here for the servers, prints them on SIGABRT) and this process ends.
METHOD_TIMEOUT_S = float(os.environ.get("KIT_METHOD_TIMEOUT_S", "240"))
os.environ["PYTHONFAULTHANDLER"] = "1"


class _Knobs:
    model = f"{MODELS}/target-wide"
    draft_model = f"{MODELS}/draft-wide"
    spec_steps = 3
    spec_topk = 1
    spec_tokens = 4
    attention_backend = "triton"
    dtype = "bfloat16"
    trust_remote_code = False
    enable_deterministic_inference = True
    mem_fraction_static = 0.5
    max_running_requests = 64
    chunked_prefill_size = CHUNKED_PREFILL_SIZE


class DynamicCrossingModes(_Knobs, SpecParityKit, SpecLogprobKit, SpecEagleServerBase):
    spec_algo = "EAGLE3_DYNAMIC"
    extra_args = (
        "--speculative-dynamic-policy", "threshold",
        "--speculative-disable-batch-threshold", "2",
        "--speculative-min-dwell-steps", "0",
    )  # fmt: skip


class StockEagle3(_Knobs, SpecParityKit, SpecLogprobKit, SpecEagleServerBase):
    spec_algo = "EAGLE3"


def _time_out(test):
    _write_line(test, "timeout", f"no result after {METHOD_TIMEOUT_S:.0f} s (KIT_METHOD_TIMEOUT_S)")
    subprocess.run(["pkill", "-ABRT", "-f", "sglang::scheduler"], check=False)
    threading.Event().wait(10)  # the schedulers' stacks reach the log
    faulthandler.dump_traceback()
    os.kill(os.getpid(), signal.SIGKILL)


def _write_line(test, outcome, detail=""):
    with open(RESULTS, "a") as out:
        out.write(json.dumps({"test": test.id(), "outcome": outcome, "detail": detail[-2000:]}) + "\n")


class _JsonResult(unittest.TextTestResult):
    def startTest(self, test):
        self._timer = threading.Timer(METHOD_TIMEOUT_S, _time_out, (test,))
        self._timer.daemon = True
        self._timer.start()
        super().startTest(test)

    def stopTest(self, test):
        self._timer.cancel()
        super().stopTest(test)

    def _line(self, test, outcome, detail=""):
        _write_line(test, outcome, detail)

    def addSuccess(self, test):
        super().addSuccess(test)
        self._line(test, "passed")

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._line(test, "failed", self._exc_info_to_string(err, test))

    def addError(self, test, err):
        super().addError(test, err)
        self._line(test, "error", self._exc_info_to_string(err, test))


if __name__ == "__main__":
    cases = {case.__name__: case for case in (DynamicCrossingModes, StockEagle3)}
    unknown = sorted({name.split(".")[0] for name in CLASSES} - set(cases))
    if unknown:
        sys.exit(f"unknown classes {unknown}; choose from {sorted(cases)}")
    loader = unittest.defaultTestLoader
    suite = unittest.TestSuite(
        loader.loadTestsFromName(name.split(".", 1)[1], cases[name.split(".")[0]])
        if "." in name
        else loader.loadTestsFromTestCase(cases[name])
        for name in (CLASSES or cases)
    )
    result = unittest.TextTestRunner(resultclass=_JsonResult, verbosity=2).run(suite)
    sys.exit(0 if result.wasSuccessful() else 1)
