"""Runs one of the Rust commands built into the extension module in this process.

The console scripts ``mooncake_master`` and ``mooncake_client`` call :func:`run`: the
server runs inside the interpreter's own process, so the command's pid is the
server's pid (an operator's ``kill`` reaches it), and it stops cleanly on SIGINT or
SIGTERM exactly as the binaries built by ``cargo build`` do.
"""

import signal
import sys


def run(name, argv=None):
    """Runs command ``name`` (``"master"`` or ``"client"``) with ``argv`` (default: this
    process's arguments without the program name) and returns its exit status."""
    from . import _store

    command = {"master": _store._run_master, "client": _store._run_client}[name]
    program = f"mooncake_{name}"
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        # Non-UTF-8 bytes arrive as surrogates, which cannot cross into Rust strings.
        for arg in args:
            arg.encode("utf-8")
    except UnicodeEncodeError:
        print(f"{program}: arguments must be valid UTF-8", file=sys.stderr)
        return 2
    # The command handles SIGINT and SIGTERM itself. Python's own SIGINT handler would
    # run as well and raise KeyboardInterrupt once the command has returned, so SIGINT
    # goes back to its default action (what the command finds in a binary) first.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    return command(args)
