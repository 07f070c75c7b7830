"""What every command shares: bad input is one line naming what was wrong, exit status non-zero,
and a traceback only with --debug."""
from __future__ import annotations

import argparse
import sys


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one `error:` line (exit 2) instead of the usage block."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.add_argument("--debug", action="store_true", help="show the full traceback on errors")

    def error(self, message):
        self.exit(2, f"error: {message}; see {self.prog} --help\n")


def run(main, args, status: int = 1) -> int:
    """main(args) -> exit status; any exception becomes `error: ...` on one line and `status`."""
    try:
        return main(args)
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if args.debug:
            raise
        message = " ".join(str(e).split()) or type(e).__name__
        print(f"error: {message}", file=sys.stderr)
        return status


def peak_rss_bytes() -> int | None:
    """This process's peak resident memory so far, or None off Linux. Linux's VmHWM counts the image after exec alone;
    the rusage a parent reads from wait4 also counts the pages of the parent it was forked from."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return None
