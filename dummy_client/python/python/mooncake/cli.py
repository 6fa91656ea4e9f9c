"""The ``mooncake_master`` command installed with the package: runs the standalone
master (the same code as the ``mooncake_master`` binary) in this process, so the
command's pid is the master's. ``mooncake_master --help`` lists the flags."""

import sys

from ._command import run


def main():
    """Entry point of the ``mooncake_master`` console script; returns the exit status."""
    return run("master")


if __name__ == "__main__":
    sys.exit(main())
