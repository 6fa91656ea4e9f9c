"""The ``mooncake_client`` command installed with the package: runs the node's real
client (the same code as the ``mooncake_client`` binary) in this process, so the
command's pid is the real client's. ``mooncake_client --help`` lists the flags."""

import sys

from ._command import run


def main():
    """Entry point of the ``mooncake_client`` console script; returns the exit status."""
    return run("client")


if __name__ == "__main__":
    sys.exit(main())
