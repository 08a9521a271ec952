"""Log lines of the plugin's modes: switches, catch-ups, the first step after a resume."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from sglang_dynspec.policy import Mode, Switch
from sglang_dynspec.telemetry import TelemetrySink

logger = logging.getLogger("sglang_dynspec")


class ModeLog(TelemetrySink):
    """Writes one line per switch, per completed catch-up (plain-mode flushes at DEBUG)
    and per first speculative step after a resume."""

    def on_switch(self, switch: Switch, steps_before: Mapping[Mode, int]) -> None:
        logger.info(
            "[sglang-dynspec] %s -> %s at decode batch size %d (decode step %d; "
            "steps before it: spec %d, plain %d)%s",
            switch.old.value,
            switch.new.value,
            switch.batch_size,
            switch.step,
            steps_before[Mode.SPEC],
            steps_before[Mode.PLAIN],
            f": {switch.reason}" if switch.reason else "",
        )

    def on_catch_up_done(self, reason: str, requests: int, tokens: int, seconds: float) -> None:
        logger.log(
            logging.DEBUG if reason == "buffer_full" else logging.INFO,
            "[sglang-dynspec] draft catch-up (%s): %d positions of %d requests in %.2f ms",
            reason,
            tokens,
            requests,
            seconds * 1e3,
        )

    def on_resume_step(self, accept_lens: Sequence[int]) -> None:
        if accept_lens:
            logger.info(
                "[sglang-dynspec] first speculative step after resume: %.2f tokens accepted "
                "per request (%d requests)",
                sum(accept_lens) / len(accept_lens),
                len(accept_lens),
            )
