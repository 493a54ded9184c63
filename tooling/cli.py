"""The ``specserve`` command: the runtime's subcommands (pull, generate, serve, from
``server.cli``) and the tooling's (bench, tune, train)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from server import cli as runtime_cli
from tooling.cli_bench import add_bench_parser
from tooling.cli_export import add_export_parser
from tooling.cli_train import add_train_parser
from tooling.cli_tune import add_tune_parser

TOOLING_COMMANDS = (add_bench_parser, add_tune_parser, add_train_parser, add_export_parser)


def build_parser():
    return runtime_cli.build_parser(TOOLING_COMMANDS)


def main(argv: Sequence[str] | None = None) -> int:
    return runtime_cli.main(argv, TOOLING_COMMANDS)


if __name__ == "__main__":
    sys.exit(main())
