"""``sgl-longgen models``: fetch the models that are downloaded on request (``get``), list them (``list``)."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    from ..runtime.fetched import MODELS

    p = sub.add_parser("models", help="fetch a published model into the model home (models get smollm2)")
    msub = p.add_subparsers(dest="models_command", required=True, metavar="ACTION")
    get = msub.add_parser("get", help="download and convert a model once; later runs say it is there")
    get.add_argument("name", choices=sorted(MODELS), help="the model")
    get.set_defaults(run=run_get)
    listing = msub.add_parser("list", help="the models `get` knows, and where each is (or would be)")
    listing.set_defaults(run=run_list)


def run_get(args: argparse.Namespace) -> int:
    from ..runtime.fetched import get

    get(args.name, log=lambda line: print(line, flush=True))
    return 0


def run_list(args: argparse.Namespace) -> int:
    from ..runtime.fetched import MODELS, fetched_dir, model_dir

    for name, model in sorted(MODELS.items()):
        done = fetched_dir(name)
        state = f"fetched: {done}" if done else f"not fetched (would go to {model_dir(name)})"
        print(f"{name}\t{model.summary}\n\t{state}")
    return 0
