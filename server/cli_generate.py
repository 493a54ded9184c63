"""``specserve generate``: stream one prompt's completion to the terminal (offline engine)."""

from __future__ import annotations

import argparse
import json
import sys

from engine.decoder_registry import DECODERS, decoders_on_drafters, trained_decoders


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_model_arguments(p: argparse.ArgumentParser, decoder_choices: bool = True) -> None:
    """--config, --model and the decoder choice, shared by generate, serve and bench (whose
    --decoder names bench variants, so it passes ``decoder_choices=False``)."""
    p.add_argument(
        "--config",
        help="engine config YAML (default: the built-in defaults, as in configs/default.yaml)",
    )
    p.add_argument("--model", help="model name, local HF directory, .gguf file or hub id")
    p.add_argument(
        "--device", help="cpu (the default), cuda or cuda:N: where the whole engine runs"
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        default=None,
        help="on a GPU, run every step eagerly instead of replaying CUDA graphs",
    )
    p.add_argument(
        "--batch-invariant",
        action="store_true",
        default=None,
        help="compute every row as it would be alone in its step: speculative output equals "
        "plain decoding bit for bit (float32 on the CPU; may cost speed)",
    )
    p.add_argument(
        "--int8-activations",
        action="store_true",
        default=None,
        help="llama.cpp's CPU numerics (an opt-in): activations rounded to 8 bits before each "
        "quantized weight's product, integer dot products; much faster on AVX-512 VNNI or AVX2, a "
        "slightly different model; turns --batch-invariant on",
    )
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        help="activations' and dense weights' dtype (default float32, the exact one; "
        "bfloat16 changes the model's numerics)",
    )
    p.add_argument(
        "--decoder",
        choices=list(DECODERS) if decoder_choices else None,
        metavar="DECODER",
        help=f"decoder of requests that pick none: {', '.join(DECODERS)} (default autoregressive)",
    )
    p.add_argument(
        "--extra-decoders",
        help="comma-separated decoders also loaded, for requests that pick one "
        '("speculative": {"method": ...})',
    )
    p.add_argument("--num-speculative-tokens", type=int, help="draft tokens per step (k)")
    p.add_argument(
        "--draft-policy",
        choices=["fixed", "goodput"],
        help="goodput (the default): each step's draft length, 0 included, from measured "
        "step costs and acceptance; fixed: draft k every step",
    )
    p.add_argument(
        "--max-step-stretch",
        type=float,
        help="goodput policy: a drafting step may take at most this many times a plain step "
        "(1.1: chunks at most 10%% further apart; default: no bound)",
    )
    p.add_argument(
        "--threads",
        type=_positive_int,
        help="threads of the products (default: every core while the cores are free, one "
        "fewer per core other processes keep busy)",
    )
    p.add_argument(
        "--draft-model",
        help='the draft decoder\'s model: "self" (a cheaper copy of the target, the default) '
        "or a model sharing the target's tokenizer (name, directory, .gguf or hub id)",
    )
    p.add_argument(
        "--drafter",
        help=f"trained drafter directory of the --decoder ({', '.join(trained_decoders())}; "
        "with hybrid: its trained drafter's; "
        "default: the one shipped for the model; `specserve train KIND` writes one)",
    )


def engine_config_from_args(args: argparse.Namespace):
    """The engine config a command runs with: the file (or the defaults), then the flags."""
    # the engine (torch) loads only for a command that runs it: --help stays instant
    from engine.config import EngineConfig

    config = EngineConfig.from_yaml(args.config) if args.config else EngineConfig()
    overrides: dict = {"model": args.model} if args.model else {}
    if getattr(args, "device", None):
        overrides["device"] = args.device
    if getattr(args, "enforce_eager", None):
        overrides["enforce_eager"] = True
    if getattr(args, "batch_invariant", None):
        overrides["batch_invariant"] = True
    if getattr(args, "int8_activations", None):
        overrides["int8_activations"] = True
    if getattr(args, "dtype", None):
        overrides["dtype"] = args.dtype
    if getattr(args, "threads", None):
        overrides["num_threads"] = args.threads
    decoder = {
        "method": args.decoder,
        "num_speculative_tokens": args.num_speculative_tokens,
        "draft_policy": getattr(args, "draft_policy", None),
        "max_step_stretch": getattr(args, "max_step_stretch", None),
    }
    if args.extra_decoders:
        decoder["extra_methods"] = [m.strip() for m in args.extra_decoders.split(",") if m.strip()]
    if args.draft_model:
        decoder["draft"] = {**config.decoder.draft.model_dump(), "model": args.draft_model}
    if getattr(args, "drafter", None):
        method = args.decoder or config.decoder.method
        # hybrid drafts with a trained decoder's drafter: --drafter names that one's
        trained = decoders_on_drafters(config.decoder).get(method, method)
        if trained not in trained_decoders():
            choices = [*trained_decoders(), *decoders_on_drafters(config.decoder)]
            raise ValueError(f"--drafter needs --decoder {' or '.join(choices)}")
        decoder[trained] = {"drafter": args.drafter}
    decoder = {k: v for k, v in decoder.items() if v is not None}
    if decoder:
        overrides["decoder"] = decoder
    return config.with_overrides(**overrides) if overrides else config


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    """One flag per SamplingParams field; unset flags keep SamplingParams' defaults."""
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--min-p", type=float)
    p.add_argument("--repetition-penalty", type=float)
    p.add_argument("--presence-penalty", type=float)
    p.add_argument("--frequency-penalty", type=float)
    p.add_argument("--logit-bias", type=json.loads, help="JSON object, e.g. '{\"42\": -100}'")
    p.add_argument("--seed", type=int)
    p.add_argument("--min-tokens", type=int)
    p.add_argument("--stop-token-ids", type=int, nargs="+")
    p.add_argument("--ignore-eos", action="store_true", default=None)


SAMPLING_FLAGS = (
    "max_tokens temperature top_p top_k min_p repetition_penalty presence_penalty "
    "frequency_penalty logit_bias seed min_tokens stop_token_ids ignore_eos"
).split()


def sampling_params_from_args(args: argparse.Namespace):
    # as above: only for a command that generates
    from engine.sampling_params import SamplingParams

    given = {name: getattr(args, name) for name in SAMPLING_FLAGS}
    return SamplingParams(**{k: v for k, v in given.items() if v is not None})


def build_llm(args: argparse.Namespace):
    # torch and the model: only for a command that generates
    from engine import LLM

    return LLM(config=engine_config_from_args(args))


def _cmd_generate(args: argparse.Namespace) -> int:
    params = sampling_params_from_args(args)  # bad flags fail before the model loads
    llm = build_llm(args)
    prompt = args.prompt
    if args.chat:
        prompt = llm.render_chat([{"role": "user", "content": args.prompt}])
    for text in llm.stream(prompt, params):
        sys.stdout.write(text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def add_generate_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "generate",
        help="generate text for one prompt with the offline engine, streamed to stdout",
    )
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user chat message")
    add_model_arguments(p)
    add_sampling_arguments(p)
    p.set_defaults(func=_cmd_generate)
