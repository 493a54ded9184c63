"""The runtime's command line: ``python -m server.cli pull|generate|serve``; the ``specserve``
command (``tooling.cli``) adds the tooling's subcommands to it.

One small ``add_<name>_parser(subparsers)`` function per subcommand registers its arguments and
sets ``func`` to the function that runs it; ``main`` builds the parser from them. Heavy modules
(torch, transformers) are imported inside the subcommand functions, never at import time, so
``specserve --help`` and a cached ``specserve pull`` stay instant.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from engine.models.pull import DEFAULT_MODEL, resolve_model
from server.cli_generate import add_generate_parser
from server.cli_serve import add_serve_parser


def _cmd_pull(args: argparse.Namespace) -> int:

    if args.cache_dir:
        os.environ["SPECSERVE_CACHE_DIR"] = args.cache_dir
    path = resolve_model(args.name or DEFAULT_MODEL)
    print(path)  # the only line on stdout: MODEL_DIR=$(specserve pull)
    return 0


def add_pull_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "pull",
        help="download/prepare a model in the local cache and print its directory",
        description=(
            "Make a model available locally and print its model directory. NAME is the "
            "embedded default alias smollm2-135m-instruct (the default), a local HF directory, "
            "a .gguf file (kept as the weights of a directory prepared once in the cache) or a "
            "hub id org/name. The cache is $SPECSERVE_CACHE_DIR or ~/.cache/specserve. "
            "Progress goes to stderr."
        ),
    )
    p.add_argument("name", nargs="?", metavar="NAME")
    p.add_argument("--cache-dir", help="override $SPECSERVE_CACHE_DIR for this call")
    p.set_defaults(func=_cmd_pull)


def build_parser(extra: Sequence[Callable] = ()) -> argparse.ArgumentParser:
    """The parser of the runtime's commands (pull, generate, serve), and of the subcommands
    each ``extra`` registers (the tooling adds bench, tune and train this way, so the runtime
    never imports it)."""
    parser = argparse.ArgumentParser(
        prog="specserve",
        description="OpenAI-compatible inference server for lossless speculative decoding.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_pull_parser(subparsers)
    add_generate_parser(subparsers)
    add_serve_parser(subparsers)
    for add_parser in extra:
        add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None, extra: Sequence[Callable] = ()) -> int:
    parser = build_parser(extra)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ValueError as e:  # bad user input (unknown model, invalid parameter): no traceback
        print(f"specserve {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
