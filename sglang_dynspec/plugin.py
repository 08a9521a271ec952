"""Entry point (group ``sglang.srt.plugins``): registers EAGLE3_DYNAMIC and its flags.

SGLang calls :func:`register` with no arguments in every process that may need the
algorithm: the launcher (``sglang serve``, ``python -m sglang.launch_server``,
``sglang.Engine``) before it parses arguments, and every spawned scheduler process
before it builds workers. It may be called more than once per process, so it is
idempotent.

SGLang logs and swallows exceptions raised while plugins load; a failure here would
surface much later as "Unknown speculative algorithm name". So ``register`` never
raises for configuration problems: those are raised from ``validate_server_args``
(argument resolution, before any weights load) and from the worker factory.

Set ``SGLANG_DYNSPEC_ENABLED=0`` to keep the plugin from registering anything.
"""

from __future__ import annotations

import argparse
import logging
import os

from sglang_dynspec import config, refusals

logger = logging.getLogger("sglang_dynspec")

_registered = False


def register() -> None:
    """Register EAGLE3_DYNAMIC and the plugin's flags in this process (idempotent)."""
    global _registered
    if _registered:
        return
    _registered = True
    try:
        enabled = config.env_bool(config.ENABLED_ENV, True)
    except config.ConfigError as e:
        # Raising here would only be logged by SGLang; refuse to register, loudly.
        logger.error("[sglang-dynspec] not registered: %s", e)
        return
    if not enabled:
        logger.info("[sglang-dynspec] disabled by %s", config.ENABLED_ENV)
        return
    try:
        from sglang_dynspec import compat
    except ImportError as e:
        # SGLang would log this and later fail with "Unknown speculative algorithm
        # name"; say which internal is missing and what is supported.
        logger.error(
            "[sglang-dynspec] cannot register EAGLE3_DYNAMIC: this SGLang lacks an internal "
            "the plugin needs (%s). Supported: %s.",
            e,
            refusals.SUPPORTED_SGLANG,
        )
        return

    from sglang_dynspec import spec_class

    compat.register_cli_args_hook(add_cli_flags)
    compat.register_parsed_args_hook(warn_flags_without_the_algorithm)
    spec_class.register_algorithm(
        config.ALGORITHM_NAME,
        validate_server_args=validate_server_args,
        worker_factory=worker_factory,
    )


# ------------------------------------------------------------------------------ flags
def _env_writing_action(flag: config.Flag) -> type:
    class WriteToEnvironment(argparse.Action):
        """Store the value and export it, so spawned scheduler processes see it."""

        def __call__(self, parser, namespace, values, option_string=None):
            if flag.choices is None and values < 0:
                parser.error(f"argument {flag.option}: must be a non-negative integer, got {values}")
            os.environ[flag.env] = str(values)
            setattr(namespace, self.dest, values)

    return WriteToEnvironment


def add_cli_flags(parser: argparse.ArgumentParser) -> None:
    """Add the plugin's flags to SGLang's server argument parser."""
    group = parser.add_argument_group(f"{config.ALGORITHM_NAME} (sglang-dynspec plugin)")
    for flag in config.FLAGS:
        kind = dict(type=int, metavar="N") if flag.choices is None else dict(type=str, choices=flag.choices)
        group.add_argument(
            flag.option,
            default=None,
            dest=flag.dest,
            action=_env_writing_action(flag),
            help=flag.help,
            **kind,
        )


def warn_flags_without_the_algorithm(server_args, namespace) -> None:
    """Warn, naming them, about plugin flags given with another speculative algorithm:
    only EAGLE3_DYNAMIC reads them, so they would do nothing without a word."""
    algorithm = getattr(server_args, "speculative_algorithm", None)
    if algorithm == config.ALGORITHM_NAME or namespace is None:
        return
    given = [flag.option for flag in config.FLAGS if getattr(namespace, flag.dest, None) is not None]
    if given:
        logger.warning(
            "[sglang-dynspec] %s given %s: %s only with --speculative-algorithm %s, so %s ignored",
            ", ".join(given),
            "without --speculative-algorithm"
            if algorithm is None
            else f"with --speculative-algorithm {algorithm}",
            "these flags apply" if len(given) > 1 else "this flag applies",
            config.ALGORITHM_NAME,
            "they are" if len(given) > 1 else "it is",
        )


# ------------------------------------------------------------------------- validation
def validate_server_args(server_args) -> None:
    """Refuse, before weights load, anything EAGLE3_DYNAMIC cannot run.

    Called by SGLang's argument resolution with the server arguments (or, on 0.5.23,
    a recorder that reads through to them). Raises ValueError naming the flag.
    """
    from sglang_dynspec import compat

    missing = compat.missing_host_symbols()
    if missing:
        raise RuntimeError(
            f"sglang-dynspec cannot run on the installed SGLang {compat.SGLANG_VERSION}: "
            f"it lacks {', '.join(missing)}. Supported: {refusals.SUPPORTED_SGLANG}."
        )
    settings = config.settings_from_environ()  # raises ConfigError naming the flag
    reason = refusals.unsupported_reason(server_args) or refusals.settings_error(settings, server_args)
    if reason:
        raise config.ConfigError(reason)
    draft = getattr(server_args, "speculative_draft_model_path", None)
    try:
        architectures = (
            refusals.draft_architectures(
                draft, getattr(server_args, "speculative_draft_model_revision", None)
            )
            if draft
            else None
        )
    except (OSError, ValueError) as e:
        raise config.ConfigError(
            f"--speculative-draft-model-path {draft}: cannot read its config.json ({e})"
        ) from e
    error = refusals.draft_architecture_error(draft, architectures)
    if error:
        raise config.ConfigError(error)


def worker_factory(server_args):
    """SGLang's worker factory for EAGLE3_DYNAMIC (runs in each scheduler process)."""
    # The settings are read again here, from this process's environment: raise now,
    # before the worker loads a draft model, if they differ from what was validated.
    config.settings_from_environ()
    from sglang_dynspec.worker import DynamicEagleWorker

    return DynamicEagleWorker
