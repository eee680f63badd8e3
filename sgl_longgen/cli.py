"""``sgl-longgen``: one command, one subcommand per job."""

from __future__ import annotations

import argparse
import sys

from .errors import LonggenError


def build_parser() -> argparse.ArgumentParser:
    from .commands import batch, bench, demo, eval, generate, models, train

    parser = argparse.ArgumentParser(
        prog="sgl-longgen",
        description="Lossless speculative decoding for ultra-long generation.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (generate, demo, batch, train, eval, bench, models):
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except LonggenError as exc:
        print(f"sgl-longgen: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
