"""How every `hf-alibi` command ends: an error is one line, `hf-alibi: error: ...`, and exit status 2; `--debug` (or
HF_ALIBI_DEBUG=1) shows the traceback instead.

Below both the CLI (`hf_alibi.cli`, which dispatches the subcommands) and the commands it runs
(`hf_alibi.experiments.commands.*`, whose `python -m` entry points end the same way): neither imports the other for
it. Standard library only.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

DEBUG_VARIABLE = "HF_ALIBI_DEBUG"
EXIT_ERROR = 2  # argparse's status for a bad invocation; every refusal here is one
# Errors that are the user's to fix (a path, a value, a missing extra): their message is the whole story.
EXPECTED_ERRORS = (ValueError, OSError, ImportError)


def error_line(exc: BaseException) -> str:
    """`hf-alibi: error: ...` on one line; errors that are not the user's to fix carry their type and the way to
    the traceback."""
    message = " ".join(str(exc).split()) or type(exc).__name__
    if not isinstance(exc, EXPECTED_ERRORS):
        message = f"{type(exc).__name__}: {message} (rerun with --debug for the traceback)"
    return f"hf-alibi: error: {message}"


def run_command(command: Callable[[list[str]], object], argv: list[str] | None = None) -> int:
    """Run `command(argv)` (default `sys.argv[1:]`, `--debug` taken out); 0 on success, 2 after a one-line error."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get(DEBUG_VARIABLE, "").strip().lower() in ("1", "true", "yes", "on")
    argv = [arg for arg in argv if arg != "--debug"]
    try:
        command(argv)
    except SystemExit as exc:  # --help, and argparse inside the commands' own parsers
        return exc.code if isinstance(exc.code, int) else EXIT_ERROR
    except Exception as exc:  # noqa: BLE001  (every error becomes one line; --debug shows the traceback)
        if debug:
            raise
        print(error_line(exc), file=sys.stderr)
        return EXIT_ERROR
    return 0


__all__ = ["DEBUG_VARIABLE", "EXIT_ERROR", "EXPECTED_ERRORS", "error_line", "run_command"]
