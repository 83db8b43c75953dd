"""The ``faircast-ds`` command."""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="faircast-ds", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("check", help="show whether the interpreter-start hook is active")
    args = parser.parse_args(argv)
    if args.command == "check":
        from faircast_ds import _autoload

        active = any(isinstance(f, _autoload._EngineWatcher) for f in sys.meta_path)
        print(f"faircast-ds autoload hook: {'active' if active else 'NOT active'}")
        return 0 if active else 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
