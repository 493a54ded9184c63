"""``specserve train``: train a drafter for the model by self-distillation."""

from __future__ import annotations

import argparse
from pathlib import Path

from engine.toolkit import trained_decoders
from server.cli_generate import add_model_arguments, engine_config_from_args


def _common_options(args: argparse.Namespace) -> dict:
    """The options every drafter kind takes, checked; --prompts as (training, held-out), or
    None for the built-in prompts."""
    if min(args.num_prompts, args.held_out, args.max_tokens, args.epochs) < 1:
        raise ValueError("--num-prompts, --held-out, --max-tokens, --epochs must be >= 1")
    if args.data_from and not args.data:
        raise ValueError("--data-from leaves out part of --data: give --data")
    if args.data_from and len(args.data) > 1:
        raise ValueError("--data-from leaves out the start of one set: give one --data")
    if args.data_from and args.data_tokens and args.data_from >= args.data_tokens:
        raise ValueError("--data-from must be below --data-tokens (both count from the start)")
    prompts = None
    if args.prompts:
        lines = [line.strip() for line in Path(args.prompts).read_text().splitlines()]
        lines = [line for line in lines if line]
        if len(lines) <= args.held_out:
            raise ValueError(f"{args.prompts}: {len(lines)} prompts, need more than --held-out")
        prompts = (lines[: -args.held_out], lines[-args.held_out :])
    return {
        "output": Path(args.output),
        "num_prompts": args.num_prompts,
        "num_held_out": args.held_out,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "draft_vocab_size": args.draft_vocab,
        "epochs": args.epochs,
        "learning_rate": args.learning_rate,
        "lr_schedule": args.lr_schedule,
        "precision": args.precision,
        "seed": args.seed,
        "resume": args.resume,
        "prompts": prompts,
        "data": tuple(Path(d) for d in args.data) if args.data else None,
        "data_tokens": args.data_tokens,
        "data_from": args.data_from,
        "init_from": args.init_from,
    }


def _training_llm(args: argparse.Namespace, batch: int = 64):
    """The target, alone (no decoder), with room for ``batch`` sequences at a time."""
    from engine.toolkit import LLM

    config = engine_config_from_args(args).with_overrides(
        decoder={"method": "autoregressive", "extra_methods": [], "load_shipped_drafters": False},
        scheduler={"max_num_seqs": batch, "max_num_batched_tokens": max(4096, 16 * batch)},
    )
    return LLM(config=config)


def _cmd_train_eagle(args: argparse.Namespace) -> int:
    from tooling.training.train_eagle import EagleTrainOptions, run_train_eagle

    common = _common_options(args)
    if args.depth < 1:
        raise ValueError("--depth must be >= 1")
    options = EagleTrainOptions(depth=args.depth, input_norm=not args.no_input_norm, **common)
    run_train_eagle(_training_llm(args), options)
    return 0


def _cmd_train_eagle3(args: argparse.Namespace) -> int:
    from tooling.training.train_eagle3 import Eagle3TrainOptions, run_train_eagle3

    if args.depth < 1:
        raise ValueError("--depth must be >= 1")
    layers = tuple(args.feature_layers) if args.feature_layers else None
    options = Eagle3TrainOptions(depth=args.depth, feature_layers=layers, **_common_options(args))
    run_train_eagle3(_training_llm(args), options)
    return 0


def _cmd_train_kangaroo(args: argparse.Namespace) -> int:
    from tooling.training.train_kangaroo import KangarooTrainOptions, run_train_kangaroo

    options = KangarooTrainOptions(exit_layer=args.exit_layer, **_common_options(args))
    run_train_kangaroo(_training_llm(args), options)
    return 0


def _cmd_train_heads(args: argparse.Namespace) -> int:
    from tooling.training.train_heads import HeadsTrainOptions, run_train_heads

    common = _common_options(args)
    if args.heads < 1:
        raise ValueError("--heads must be >= 1")
    options = HeadsTrainOptions(kind=args.train, num_heads=args.heads, **common)
    run_train_heads(_training_llm(args), options)
    return 0


def parse_token_count(text: str) -> int:
    """``10M``, ``2.5M``, ``400k`` or ``123456`` as a number of tokens."""
    scale = {"k": 1_000, "m": 1_000_000, "g": 1_000_000_000}.get(text[-1:].lower(), 1)
    try:
        value = float(text[:-1] if scale > 1 else text) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a token count: {text!r} (e.g. 10M, 400k)") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"a token count must be >= 1, got {text!r}")
    return int(value)


def _cmd_train_data(args: argparse.Namespace) -> int:
    from tooling.training.self_distillation import progress_bar
    from tooling.training.shards import build, build_from_file, default_root, recipe_for

    temperatures = tuple(float(t) for t in args.temperatures.split(",") if t)
    if args.answers < 1 or args.shard_requests < 1 or args.batch < 1:
        raise ValueError("--answers, --shard-requests and --batch must be >= 1")
    if args.answers > 1 and (not temperatures or min(temperatures) <= 0):
        raise ValueError("--temperatures: one or more values > 0 for the sampled answers")
    if args.first_shard < 0 or (args.first_shard and args.conversations):
        raise ValueError("--first-shard: an index >= 0, for specserve's own requests (not --from)")
    llm = _training_llm(args, batch=args.batch)
    source = Path(args.conversations) if args.conversations else None
    root = Path(args.output) if args.output else default_root(llm.model_dir, source)
    recipe = recipe_for(
        llm,
        seed=args.seed,
        shard_requests=args.shard_requests,
        answers_per_request=args.answers,
        temperatures=temperatures,
        max_tokens=args.max_tokens,
        follow_up_max_tokens=args.follow_up_max_tokens,
        follow_up_share=args.follow_up_share,
    )
    keep = _kept_layers(args.keep_layers, llm.engine.model.arch.num_layers)
    with progress_bar(args.tokens, "answer tokens") as bar:
        bar.unit, bar.unit_scale = "tok", True
        update = _resumed(bar)
        if source is None:
            total = build(llm, root, recipe, args.tokens, args.held_out_shards, update, keep,
                          args.first_shard)  # fmt: skip
        else:
            total = build_from_file(llm, source, root, recipe, args.tokens, None, update, keep)
    print(f"{root}: {total:,} training answer tokens")
    return 0


def _resumed(bar):
    """``bar.update`` for a build whose first report is the tokens made by earlier runs:
    those start the count but not the rate, so tokens/s and the ETA are this run's."""
    first = True

    def update(n: int) -> None:
        nonlocal first
        if first:
            first = False
            bar.initial = bar.n = bar.last_print_n = n
            bar.refresh()
        else:
            bar.update(n)

    return update


def _kept_layers(text: str | None, num_layers: int) -> tuple[int, ...] | None:
    """--keep-layers: "eagle3" (the layers an EAGLE-3 drafter fuses by default) or indices."""
    if text is None:
        return None
    if text == "eagle3":
        from engine.toolkit import default_feature_layers

        return tuple(default_feature_layers(num_layers))
    try:
        layers = tuple(int(i) for i in text.split(","))
    except ValueError:
        raise ValueError(
            f"--keep-layers: 'eagle3' or layer indices like 1,14,26, got {text!r}"
        ) from None
    if any(not 0 <= i < num_layers for i in layers):
        raise ValueError(f"--keep-layers {text}: the model's layers are 0 to {num_layers - 1}")
    return layers


def _cmd_train_prompts(args: argparse.Namespace) -> int:
    from tooling.training.self_distillation import progress_bar
    from tooling.training.self_prompts import load_openers, write_self_prompts

    openers = load_openers(args.openers)
    if args.count < 1 or args.batch < 1 or args.max_tokens < 1:
        raise ValueError("--count, --batch and --max-tokens must be >= 1")
    if args.temperature <= 0 or not 0 < args.top_p <= 1:
        raise ValueError("--temperature must be > 0 and --top-p in (0, 1]")
    llm = _training_llm(args, batch=args.batch)
    output = Path(args.output)
    with progress_bar(args.count, "requests kept") as bar:
        report = write_self_prompts(
            llm, args.count, output, args.seed, args.temperature, args.top_p, args.max_tokens,
            args.batch, bar.update, openers,
        )  # fmt: skip
    print(f"{output}: {report.summary()}")
    print(f"next: specserve train data --from {output}")
    return 0


def _add_prompts_parser(which) -> None:
    p = which.add_parser(
        "prompts",
        help="the target writes user requests itself (JSONL for `train data --from`)",
        description=(
            "The target, given its chat template up to where a user's message begins, writes "
            "users' requests in their own words (Magpie-style); those that ended by themselves, "
            "have 4 to 80 words, are new and are no benchmark prompt are written to --output "
            "as JSONL conversations, which `specserve train data --from FILE` has the target "
            "answer. Nothing but the target goes into them."
        ),
    )
    add_model_arguments(p)
    p.add_argument("--count", type=int, default=10_000, help="requests to keep")
    p.add_argument("--output", required=True, help="JSONL file to write")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--max-tokens", type=int, default=96, help="longer requests are left out")
    p.add_argument("--batch", type=int, default=64, help="requests written together")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--openers",
        help="'builtin' (What, Why, How do I, Explain, Write a, Compare, ...) or a text file "
        "of openers, one a line: request i begins with opener i mod their number and the "
        "model writes the rest (default: the model begins its requests itself)",
    )
    p.set_defaults(func=_cmd_train_prompts)


def _add_data_parser(which) -> None:
    p = which.add_parser(
        "data",
        help="build the self-distillation set (resumable shards) that drafters train on",
        description=(
            "The target answers specserve's own requests (many tasks, formats and subjects; "
            "no benchmark prompt), each several times (greedy, then sampled at --temperatures), "
            "a share of them continued by a follow-up turn, batched at the engine's speed; "
            "shards of conversations with the target's features along them go under --output "
            "(default: the cache directory). Interrupt it at any time: a rerun with the same "
            "options continues where it stopped and makes the same data."
        ),
    )
    add_model_arguments(p)
    p.add_argument("--tokens", type=parse_token_count, default=10_000_000,
                   help="training answer tokens to reach, e.g. 10M (default) or 400k")  # fmt: skip
    p.add_argument("--output", help="data directory (default: <cache>/training-data/<model>)")
    p.add_argument(
        "--from",
        dest="conversations",
        metavar="FILE",
        help="your own conversations (JSONL: OpenAI 'messages' or ShareGPT 'conversations' "
        "per line) instead of specserve's requests: the target answers their user turns",
    )
    p.add_argument("--batch", type=int, default=64, help="sequences decoded together")
    p.add_argument("--shard-requests", type=int, default=128, help="requests per shard")
    p.add_argument("--answers", type=int, default=2, help="answers per request (first greedy)")
    p.add_argument("--temperatures", default="0.7,1.0", help="of the sampled answers, in turn")
    p.add_argument("--max-tokens", type=int, default=384, help="first answer's length")
    p.add_argument("--follow-up-max-tokens", type=int, default=256)
    p.add_argument("--follow-up-share", type=float, default=0.25,
                   help="share of requests continued by a follow-up turn")  # fmt: skip
    p.add_argument("--held-out-shards", type=int, default=1,
                   help="shards on subjects training never sees")  # fmt: skip
    p.add_argument(
        "--keep-layers",
        help="also keep these layers' outputs from the generation, beside each new shard "
        "('eagle3': the layers `train eagle3` fuses; or indices like 1,14,26): 3.5 kB a "
        "token for three layers of a 576-wide model, and `train eagle3` needs no second pass",
    )
    p.add_argument(
        "--first-shard",
        type=int,
        default=0,
        help="make training shards from this index on (each index draws its own requests): "
        "goes on past shards a drafter already learned from, e.g. after the cache was lost",
    )
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_cmd_train_data)


def _cmd_train_evaluate(args: argparse.Namespace) -> int:
    from engine.toolkit import LLM
    from tooling.training.train_eagle import evaluate_eagle, print_accuracies_by_kind
    from tooling.training.train_eagle3 import evaluate_eagle3

    model = {"model": args.model} if args.model else {}
    llm = LLM(**model, decoder={"load_shipped_drafters": False})
    evaluate = evaluate_eagle3 if args.kind == "eagle3" else evaluate_eagle
    accuracies = evaluate(llm, args.drafter, Path(args.data), args.depth)
    print_accuracies_by_kind(accuracies)
    return 0


def _add_evaluate_parser(which) -> None:
    p = which.add_parser(
        "evaluate",
        help="held-out accuracy of an EAGLE drafter on a data set's held-out conversations",
    )
    p.add_argument("--kind", choices=("eagle", "eagle3"), default="eagle")
    p.add_argument("--data", required=True, help="a `specserve train data` directory")
    p.add_argument("--drafter", help="drafter directory (default: the one shipped)")
    p.add_argument("--model", help="the target (default: the embedded model)")
    p.add_argument("--depth", type=int, default=3)
    p.set_defaults(func=_cmd_train_evaluate)


def add_train_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("train", help="train a drafter for the model (self-distillation)")
    which = p.add_subparsers(dest="train", metavar="DRAFTER", required=True)
    _add_data_parser(which)
    _add_prompts_parser(which)
    _add_evaluate_parser(which)
    descriptions = {
        "medusa": "K Medusa heads learn the tokens 2..K+1 places ahead from the hidden state",
        "hydra": "K Hydra heads learn the tokens 2..K+1 places ahead from the hidden state and "
        "the tokens before each (sequentially dependent heads)",
    }
    trainers = {
        "medusa": lambda: _add_heads_parser(which, "medusa", descriptions["medusa"]),
        "hydra": lambda: _add_heads_parser(which, "hydra", descriptions["hydra"]),
        "eagle": lambda: _add_eagle_parser(which),
        "eagle3": lambda: _add_eagle3_parser(which),
        "kangaroo": lambda: _add_kangaroo_parser(which),
    }
    # One trainer per trained decoder in the registry: a trained decoder without one is a
    # registration error, caught here (and by the tests) rather than by a user.
    missing = set(trained_decoders()) - set(trainers)
    if missing:
        raise RuntimeError(f"trained decoders without a trainer: {', '.join(sorted(missing))}")
    for kind in trained_decoders():
        trainers[kind]()


def _add_kangaroo_parser(which) -> None:
    p = which.add_parser(
        "kangaroo",
        help="train Kangaroo's adapter on the model's first layers and write a drafter directory",
        description=(
            "Self-distillation: the model answers specserve's own training prompts (cached in "
            "--output and shared with the other drafters' training), one teacher-forced pass "
            "takes its final features (the teacher) and one through its first --exit-layer "
            "layers the adapter's inputs; the adapter (one attention sublayer and a norm) "
            "learns the model's next-token distribution from them. Checkpoints every epoch "
            "(--resume), held-out accuracy at the end, and a directory that `--decoder "
            "kangaroo --drafter DIR` loads."
        ),
    )
    _add_common_arguments(p)
    p.add_argument("--exit-layer", type=int, default=2, help="layers of the shallow sub-network")
    p.add_argument("--epochs", type=int, default=3)
    p.set_defaults(func=_cmd_train_kangaroo)


def _add_eagle_parser(which) -> None:
    p = which.add_parser(
        "eagle",
        help="train EAGLE's one-layer feature-level drafter and write a drafter directory",
        description=(
            "Self-distillation: the model answers specserve's own training prompts (cached in "
            "--output and shared with the other drafters' training), one teacher-forced pass "
            "takes its features at every position, and a one-layer drafter learns to predict "
            "the next feature and the model's next-token distribution from the token and the "
            "feature before it, unrolled --depth steps on its own guesses as when drafting. "
            "Checkpoints every epoch (--resume), held-out accuracy per depth at the end, and "
            "a directory that `--decoder eagle --drafter DIR` loads."
        ),
    )
    _add_common_arguments(p)
    p.add_argument("--depth", type=int, default=3, help="draft steps it is trained to unroll")
    p.add_argument(
        "--no-input-norm",
        action="store_true",
        help="no norm before the layer's attention: EAGLE-1's layout, which `specserve "
        "export eagle --layout eagle1` writes for vLLM, SGLang and SafeAILab's EAGLE",
    )
    p.add_argument("--epochs", type=int, default=3)
    p.set_defaults(func=_cmd_train_eagle)


def _add_eagle3_parser(which) -> None:
    p = which.add_parser(
        "eagle3",
        help="train an EAGLE-3 drafter (fused low, middle and high layers, its own head)",
        description=(
            "Self-distillation as for eagle; one teacher-forced pass keeps the outputs of a "
            "low, a middle and a high layer of the model, which the drafter fuses; it learns "
            "the model's next-token distribution over a draft vocabulary through its own head, "
            "unrolled --depth steps on its own guesses. Checkpoints every epoch (--resume), "
            "held-out accuracy per depth, and a directory that `--decoder eagle3 --drafter DIR` "
            "loads and `specserve export eagle3 --layout eagle3` writes for vLLM and SGLang."
        ),
    )
    _add_common_arguments(p)
    p.add_argument("--depth", type=int, default=3, help="draft steps it is trained to unroll")
    p.add_argument(
        "--feature-layers",
        type=int,
        nargs=3,
        metavar="LAYER",
        help="the three layers (0-based) whose outputs it fuses (default: 1, L/2 - 1, L - 4)",
    )
    p.add_argument("--epochs", type=int, default=3)
    p.set_defaults(func=_cmd_train_eagle3)


def _add_heads_parser(which, kind: str, what: str) -> None:
    p = which.add_parser(
        kind,
        help=f"train {kind} heads and write a drafter directory",
        description=(
            "Self-distillation: the model answers specserve's own training prompts, one "
            "teacher-forced pass takes its hidden states along the answers (both cached in "
            f"--output), and {what}, read out through the model's frozen LM head cut to a "
            "draft vocabulary. Checkpoints every epoch (--resume), held-out accuracy per head "
            f"at the end, and a directory that `--decoder {kind} --drafter DIR` loads."
        ),
    )
    _add_common_arguments(p)
    p.add_argument("--heads", type=int, default=3)
    p.add_argument("--epochs", type=int, default=4)
    p.set_defaults(func=_cmd_train_heads)


def _add_common_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--output", required=True, help="drafter directory to write")
    p.add_argument(
        "--prompts",
        help="text file of your own prompts, one user message per line (the last --held-out "
        "lines are held out); default: specserve's built-in training prompts",
    )
    p.add_argument(
        "--data",
        action="append",
        help="a data directory of `specserve train data`, or your own conversations (a JSONL "
        "file: OpenAI 'messages' or ShareGPT 'conversations' per line; the target answers "
        "their user turns, kept in the cache); repeat it to learn from several sets together "
        "(e.g. yours and specserve's own); default: answer --prompts or the built-in "
        "prompts now",
    )
    p.add_argument(
        "--data-tokens",
        type=parse_token_count,
        help="train on the first N answer tokens of each --data set, e.g. 2M (default all)",
    )
    p.add_argument(
        "--data-from",
        type=parse_token_count,
        help="leave out the first N answer tokens of --data (whole conversations), e.g. to "
        "train a drafter on from --init-from with the data it has not seen",
    )
    p.add_argument(
        "--init-from",
        help="start from this drafter (a directory: ours or a public layout; or 'shipped', the "
        "one shipped for the model): its weights and draft vocabulary, a fresh optimizer and "
        "learning-rate schedule",
    )
    p.add_argument("--num-prompts", type=int, default=480, help="training prompts")
    p.add_argument("--held-out", type=int, default=48, help="held-out prompts")
    p.add_argument("--max-tokens", type=int, default=192, help="answer length")
    p.add_argument("--temperature", type=float, default=0.0, help="of the answers (0: greedy)")
    p.add_argument("--draft-vocab", type=int, default=4096, help="draft vocabulary size")
    p.add_argument("--learning-rate", type=float, default=1e-3)
    p.add_argument(
        "--lr-schedule",
        choices=("constant", "cosine"),
        default="constant",
        help="the learning rate over the run: constant, or cosine decay to zero (for a run's "
        "last pass; checkpoints within epochs keep its place)",
    )
    p.add_argument(
        "--precision",
        choices=("auto", "float32", "bfloat16"),
        default="auto",
        help="of the training passes (the weights stay float32): bfloat16 autocast, or auto "
        "(the default): whichever a timed batch finds faster on this machine",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --output")
