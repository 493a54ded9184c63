"""``specserve export``: write a drafter in a layout other servers load (vLLM, FasterDecoding)."""

from __future__ import annotations

import argparse
from pathlib import Path

from engine.toolkit import trained_decoders


def _cmd_export(args: argparse.Namespace) -> int:
    from engine.toolkit import LLM, decoder_spec, export_drafter, load_drafter

    model_args = {"model": args.model} if args.model else {}
    llm = LLM(**model_args, decoder={"load_shipped_drafters": False})
    network = decoder_spec(args.kind).network_class()
    drafter = load_drafter(args.drafter, args.kind, network, llm.engine.model)
    export_drafter(drafter, llm.engine.model, args.layout, Path(args.output))
    print(f"{args.output}: {args.kind} drafter in the {args.layout} layout")
    return 0


def add_export_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "export",
        help="write a drafter in a public layout (vLLM's Medusa, Medusa-2, EAGLE-1, EAGLE-3)",
        description="Read a drafter (a `specserve train` directory, a public layout, or the "
        "one shipped for the model when --drafter is not given) and write it in --layout.",
    )
    p.add_argument("kind", choices=trained_decoders(), metavar="KIND")
    p.add_argument("--model", help="the drafter's target (default: the embedded model)")
    p.add_argument("--drafter", help="drafter directory (default: the one shipped)")
    # Checked when it runs (the layouts' table imports torch; --help stays instant).
    p.add_argument("--layout", required=True, help="medusa-vllm, medusa-v2, eagle1 or eagle3")
    p.add_argument("--output", required=True, help="directory to write")
    p.set_defaults(func=_cmd_export)
