"""``specserve bench``: benchmark commands (they print ratios measured in one run)."""

from __future__ import annotations

import argparse

from server.cli_generate import add_model_arguments, engine_config_from_args


def _cmd_bench_offline(args: argparse.Namespace) -> int:
    from engine.bench import run_offline

    run_offline(
        engine_config_from_args(args),
        args.batch,
        args.max_tokens,
        args.prompt_len,
        with_hf=not args.no_hf,
    )
    return 0


def _cmd_bench_linear(args: argparse.Namespace) -> int:
    from engine.bench_linear import run_linear_bench

    run_linear_bench()
    return 0


def _cmd_bench_serve(args: argparse.Namespace) -> int:
    from server.bench_serve import LoadSpec, run_serve_bench

    spec = LoadSpec(args.concurrency, args.requests or args.concurrency, args.max_tokens)
    run_serve_bench(args.model, args.config, spec, with_baseline=not args.no_baseline, url=args.url)
    return 0


def _cmd_bench_decoders(args: argparse.Namespace) -> int:
    from engine.bench_decoders import run_decoder_bench
    from engine.decoders import DECODERS

    decoders = list(DECODERS) if args.decoders == "all" else args.decoders.split(",")
    run_decoder_bench(
        engine_config_from_args(args),
        decoders,
        args.num_speculative_tokens or 4,
        args.max_tokens,
        with_hf=not args.no_hf,
    )
    return 0


def add_bench_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("bench", help="benchmarks")
    which = p.add_subparsers(dest="bench", metavar="BENCH", required=True)
    offline = which.add_parser(
        "offline",
        help="decode tokens/s (batch 1 and N) and TTFT vs transformers generate()",
    )
    add_model_arguments(offline)
    offline.add_argument("--batch", type=int, default=16)
    offline.add_argument("--max-tokens", type=int, default=128)
    offline.add_argument("--prompt-len", type=int, default=512)
    offline.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    offline.set_defaults(func=_cmd_bench_offline)
    linear = which.add_parser(
        "linear", help="GB/s of F.linear vs transposed matmul vs oneDNN for SmolLM2's shapes"
    )
    linear.set_defaults(func=_cmd_bench_linear)
    decoders = which.add_parser(
        "decoders",
        help="speculative decoders vs autoregressive (and transformers) on chat and "
        "input-grounded prompts",
    )
    add_model_arguments(decoders)
    decoders.add_argument("--decoders", default="all", help="comma-separated, or all")
    decoders.add_argument("--max-tokens", type=int, default=128)
    decoders.add_argument("--no-hf", action="store_true", help="skip transformers")
    decoders.set_defaults(func=_cmd_bench_decoders)
    serve = which.add_parser(
        "serve",
        help="concurrent streaming chat: throughput, TTFT and ITL vs transformers serve",
    )
    serve.add_argument("--model", help="model (default: the embedded SmolLM2)")
    serve.add_argument("--config", help="engine config YAML for specserve")
    serve.add_argument("--concurrency", type=int, default=8)
    serve.add_argument("--requests", type=int, help="total requests (default: --concurrency)")
    serve.add_argument("--max-tokens", type=int, default=64)
    serve.add_argument("--url", help="benchmark an already running specserve at this URL")
    serve.add_argument("--no-baseline", action="store_true", help="skip transformers serve")
    serve.set_defaults(func=_cmd_bench_serve)
