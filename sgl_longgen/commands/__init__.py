"""Subcommands of ``sgl-longgen``; each module has ``add_parser(subparsers)``."""
