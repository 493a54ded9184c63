"""``specserve tune``: search a decoder's settings for measured speed and write them to a config."""

from __future__ import annotations

import argparse
from pathlib import Path

from server.cli_generate import add_model_arguments, engine_config_from_args


def _k_range(args: argparse.Namespace) -> tuple[int, int]:
    if args.num_speculative_tokens is not None:
        return args.num_speculative_tokens, args.num_speculative_tokens
    if args.max_k < 1:
        raise ValueError("--max-k must be at least 1")
    return 1, args.max_k


def _cmd_tune_layerskip(args: argparse.Namespace) -> int:
    from tooling.bench.tune_layerskip import TuneOptions, run_tune_layerskip

    if args.decoder not in (None, "layerskip"):
        raise ValueError("tune layerskip always tunes the layerskip decoder: drop --decoder")
    if min(args.trials, args.max_tokens, args.num_prompts, args.confirm_top) < 1:
        raise ValueError("--trials, --max-tokens, --num-prompts and --confirm-top must be >= 1")
    options = TuneOptions(
        prompt_sets=tuple(s for s in args.prompts.split(",") if s),
        num_prompts=args.num_prompts,
        max_tokens=args.max_tokens,
        num_trials=args.trials,
        seed=args.seed,
        k_range=_k_range(args),
        early_exit=args.early_exit,
        confirm_top=args.confirm_top,
        min_speedup=args.min_speedup,
        output=Path(args.output),
        write_anyway=args.write_anyway,
    )
    run_tune_layerskip(engine_config_from_args(args), options)
    return 0  # "no skip set beat autoregressive" is a result, not an error


def add_tune_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("tune", help="search a decoder's settings for measured tokens/s")
    which = p.add_subparsers(dest="tune", metavar="DECODER", required=True)
    layerskip = which.add_parser(
        "layerskip",
        help="search layerskip's skip set (Bayesian optimisation) and write it to a config",
        description=(
            "Search the layerskip draft (a span of skipped attention sublayers, one of MLP "
            "sublayers, k) with optuna's TPE for its measured tokens/s over autoregressive "
            "decoding's, the two interleaved prompt by prompt on calibration prompts (greedy, "
            "batch 1). The best drafts are measured again; the config (--config/--model with "
            "decoder.method layerskip and the best draft) is written only if one beats "
            "autoregressive, unless --write-anyway. Either outcome exits 0."
        ),
    )
    add_model_arguments(layerskip)
    layerskip.add_argument(
        "--trials",
        type=int,
        default=20,
        help="drafts to measure (default 20; empty ones are pruned, not counted)",
    )
    layerskip.add_argument("--seed", type=int, default=0, help="TPE sampler seed")
    layerskip.add_argument(
        "--prompts", default="chat,grounded", help="prompt sets from configs/prompts"
    )
    layerskip.add_argument(
        "--num-prompts", type=int, default=3, help="prompts from each set (default 3)"
    )
    layerskip.add_argument("--max-tokens", type=int, default=64)
    layerskip.add_argument(
        "--max-k",
        type=int,
        default=6,
        help="search k in 1..MAX_K (--num-speculative-tokens fixes k)",
    )
    layerskip.add_argument(
        "--early-exit", action="store_true", help="also search an early-exit layer"
    )
    layerskip.add_argument(
        "--confirm-top", type=int, default=3, help="best drafts measured again (default 3)"
    )
    layerskip.add_argument(
        "--min-speedup",
        type=float,
        default=1.0,
        help="confirmed speedup over autoregressive a draft must exceed to be written",
    )
    layerskip.add_argument("--output", default="configs/layerskip-tuned.yaml")
    layerskip.add_argument(
        "--write-anyway",
        action="store_true",
        help="write the best draft even if it does not beat autoregressive",
    )
    layerskip.set_defaults(func=_cmd_tune_layerskip)
