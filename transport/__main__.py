"""Command line: ``python -m transport doctor`` and ``python -m transport fr DUMP...``."""

from __future__ import annotations

import sys

__all__ = ["main"]

_USAGE = """usage: python -m transport COMMAND [...]

commands:
  doctor   what this machine can use (planes, CUDA, NCCL) and why; --peer NAME shows the plane chosen for a peer
  fr       pair flight-recorder dumps from both sides of a channel and name the op and peer that stalled
"""


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(_USAGE)
        return 0 if args else 2
    cmd, rest = args[0], args[1:]
    if cmd == "doctor":
        from .doctor import main as doctor

        return doctor(rest)
    if cmd == "fr":
        from .fr_analyze import main as fr

        return fr(rest)
    print(f"unknown command {cmd!r}\n\n{_USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
