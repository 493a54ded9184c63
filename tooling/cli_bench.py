"""``specserve bench``: benchmark commands (they print ratios measured in one run)."""

from __future__ import annotations

import argparse

from server.cli_generate import add_model_arguments, engine_config_from_args
from server.cli_serve import at_least_one
from server.ray_serve.cluster_env import PROXIES


def _cmd_bench_offline(args: argparse.Namespace) -> int:
    if args.decoder:  # the decoder comparison: --decoder all, or variant names
        return _run_decoder_bench(args, args.decoder)
    from tooling.bench.bench import LlamaCppOptions, run_offline

    run_offline(
        engine_config_from_args(args),
        args.batch,
        args.max_tokens,
        args.prompt_len,
        with_hf=not args.no_hf,
        llamacpp=LlamaCppOptions(not args.no_llamacpp, args.gguf, args.llamacpp_n_batch),
    )
    return 0


def _cmd_bench_linear(args: argparse.Namespace) -> int:
    from tooling.bench.bench_linear import run_linear_bench, run_stored_linear_bench

    if args.dense:
        run_linear_bench()
    else:
        run_stored_linear_bench(engine_config_from_args(args))
    return 0


def httpx_models(url: str) -> list[str]:
    """The model ids a running server lists."""
    import httpx

    return [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]]


def _cmd_bench_serve(args: argparse.Namespace) -> int:
    from tooling.bench.bench_serve import LoadSpec, run_concurrency_sweep, run_serve_bench

    if args.url and args.config:
        raise ValueError("--config configures a server the bench starts; not with --url")
    if args.conversations:
        from tooling.bench.bench_conversations import print_conversations

        if not args.url or args.turns < 1:
            raise ValueError("--conversations needs --url (a running server) and --turns >= 1")
        if args.think_time < 0:
            raise ValueError("--think-time must be at least 0")
        models = httpx_models(args.url)
        print_conversations(args.url, args.model or models[0], args.conversations, args.turns,
                            args.max_tokens, args.think_time)  # fmt: skip
        return 0
    if args.compare:
        concurrencies = [int(c) for c in args.concurrencies.split(",") if c.strip()]
        if not concurrencies or min(concurrencies) < 1:
            raise ValueError("--concurrencies: comma-separated counts of at least 1")
        if args.rounds < 1:
            raise ValueError("--rounds: at least 1")
        run_concurrency_sweep(
            args.model, args.config, args.compare, concurrencies, args.requests_per_stream,
            args.max_tokens, rounds=args.rounds, url=args.url,
        )  # fmt: skip
        return 0
    spec = LoadSpec(args.concurrency, args.requests or args.concurrency, args.max_tokens)
    run_serve_bench(args.model, args.config, spec, with_baseline=not args.no_baseline, url=args.url)
    return 0


def _cmd_bench_ray(args: argparse.Namespace) -> int:
    from tooling.bench.bench_ray import run_ray_bench

    if args.replicas < 1 or args.streams < 1:
        raise ValueError("--replicas and --streams must be at least 1")
    kill = None if args.kill == "none" else args.kill
    run_ray_bench(args.model, args.config, args.replicas, args.streams, args.max_tokens, kill,
                  args.stream_interval, args.ray_proxy)  # fmt: skip
    return 0


def _cmd_bench_constraints(args: argparse.Namespace) -> int:
    from tooling.bench.bench_constraints import run_constraints_bench

    decoders = [d.strip() for d in args.decoders.split(",") if d.strip()]
    run_constraints_bench(engine_config_from_args(args), decoders, args.max_tokens)
    return 0


def _cmd_bench_profile(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tooling.bench.bench_profile import ProfileOptions, run_profile_bench

    options = ProfileOptions(
        args.decoder or "autoregressive", args.steps, args.top,
        Path(args.trace) if args.trace else None, args.prompt, args.python,
    )  # fmt: skip
    # --decoder names variants here, as in bench offline: the base config keeps its own.
    config = engine_config_from_args(argparse.Namespace(**{**vars(args), "decoder": None}))
    run_profile_bench(config, options)
    return 0


def _cmd_bench_decoders(args: argparse.Namespace) -> int:
    return _run_decoder_bench(args, args.decoders or args.decoder or "all")


def _run_decoder_bench(args: argparse.Namespace, variants: str) -> int:
    from tooling.bench.bench_decoders import DecoderBenchOptions, run_decoder_bench

    # --decoder names variants here, not the engine's decoder: the base config keeps its own.
    config = engine_config_from_args(argparse.Namespace(**{**vars(args), "decoder": None}))
    options = DecoderBenchOptions(
        decoders=variants,
        k=args.num_speculative_tokens or 4,
        max_tokens=args.max_tokens,
        prompts_per_set=args.prompts_per_set,
        repeats=args.repeats,
        with_hf=not args.no_hf,
        layerskip_config=args.layerskip_config,
    )
    if args.plot:
        options.plot = None if args.plot == "none" else args.plot
    run_decoder_bench(config, options)
    return 0


def _add_decoder_bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts-per-set", type=int, help="first N prompts of each set (default: all)")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="rounds over every prompt and method; each one's fastest run counts (a shared "
        "machine's bursts of load hit single runs)",
    )
    p.add_argument(
        "--layerskip-config",
        help="YAML with the layerskip variant's skip set (as `specserve tune layerskip` "
        "writes); default: a fixed set of late MLPs",
    )
    p.add_argument(
        "--plot",
        help="PNG of the speedups to write (default: docs/decoders-benchmark.png), or none",
    )


def _add_llamacpp_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--gguf",
        help="GGUF file for the llama.cpp column (default: the *.gguf in the model directory)",
    )
    p.add_argument(
        "--llamacpp-n-batch",
        type=int,
        default=512,
        help="llama.cpp prompt batch size; 1 where its multi-token prompt evaluation crashes "
        "(seen on some Intel AMX machines)",
    )
    p.add_argument("--no-llamacpp", action="store_true", help="skip the llama.cpp baseline")


def add_bench_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("bench", help="benchmarks")
    which = p.add_subparsers(dest="bench", metavar="BENCH", required=True)
    offline = which.add_parser(
        "offline",
        help="decode tokens/s (batch 1 and N) and TTFT vs transformers generate() and llama.cpp; "
        "with --decoder all (or variant names), speculative decoders vs autoregressive",
        description="Without --decoder: decode tokens/s at batch 1 and N and TTFT against "
        "transformers generate() and llama.cpp (llama-cpp-python on the model's GGUF file, "
        "pip install 'specserve[bench]'). With --decoder all, or comma-separated variant names "
        "(ngram, ngram-tree4, ngram-tree4-k8, draft-int8, draft-int4, draft-bf16, "
        "draft-int8-8layers, layerskip, hierarchical, medusa, hydra, hydra-k2, hydra-k8, "
        "eagle, eagle-k2, eagle-k3, kangaroo, kangaroo-k2, hydra-goodput, eagle-goodput, "
        "kangaroo-goodput, ngram-goodput, "
        "draft-int8-adaptive, draft-int8-entropy, draft-int8-gate0.3): each speculative "
        "decoder against autoregressive decoding and transformers' assisted generation on the "
        "chat and input-grounded prompt sets, a table, and a PNG plot.",
    )
    add_model_arguments(offline, decoder_choices=False)
    offline.add_argument("--batch", type=int, default=16)
    offline.add_argument("--max-tokens", type=int, default=128)
    offline.add_argument("--prompt-len", type=int, default=512)
    offline.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    _add_llamacpp_arguments(offline)
    _add_decoder_bench_arguments(offline)
    offline.set_defaults(func=_cmd_bench_offline)
    linear = which.add_parser(
        "linear",
        help="every candidate product (kernels per instruction set, dequantize+BLAS, PyTorch) "
        "on the model's stored weights per row count, and the one autotune picks",
    )
    add_model_arguments(linear)
    linear.add_argument(
        "--dense",
        action="store_true",
        help="instead: F.linear vs transposed matmul vs oneDNN on float32 weights of "
        "SmolLM2's shapes",
    )
    linear.set_defaults(func=_cmd_bench_linear)
    decoders = which.add_parser(
        "decoders", help="the same as `bench offline --decoder all` (--decoders picks variants)"
    )
    add_model_arguments(decoders, decoder_choices=False)
    decoders.add_argument("--decoders", help="comma-separated variant names, or all (default)")
    decoders.add_argument("--max-tokens", type=int, default=128)
    decoders.add_argument("--no-hf", action="store_true", help="skip transformers")
    _add_decoder_bench_arguments(decoders)
    decoders.set_defaults(func=_cmd_bench_decoders)
    constraints = which.add_parser(
        "constraints",
        help="mask cost per token of the grammar libraries installed, and JSON-schema chats "
        "with and without speculation",
    )
    add_model_arguments(constraints)
    constraints.add_argument(
        "--decoders", default="ngram,eagle", help="comma-separated decoders to compare"
    )
    constraints.add_argument("--max-tokens", type=int, default=256)
    constraints.set_defaults(func=_cmd_bench_constraints)
    profile = which.add_parser(
        "profile",
        help="where a decode step goes: ms, operators and device kernels a step, and the "
        "operators by self time (torch.profiler), per decoder variant",
        description="One greedy chat request per decoder variant (--decoder: autoregressive "
        "and bench offline's variant names, comma-separated) on one engine: decode steps "
        "timed unprofiled, then as many under torch.profiler, counting the operators called "
        "a step, the kernels the device ran and the launches (a CUDA graph replay is one), "
        "with the operators that took the most self time.",
    )
    add_model_arguments(profile, decoder_choices=False)
    profile.add_argument("--steps", type=int, default=32, help="decode steps a pass")
    profile.add_argument("--top", type=int, default=12, help="operators listed per variant")
    profile.add_argument("--trace", help="also write each variant's Chrome trace in this folder")
    profile.add_argument("--prompt", help="the user message (default: the chat set's first)")
    profile.add_argument(
        "--python",
        type=int,
        default=0,
        metavar="N",
        help="also a pass under cProfile: the interpreter's own time a step and the N Python "
        "functions with the most self time",
    )
    profile.set_defaults(func=_cmd_bench_profile)
    serve = which.add_parser(
        "serve",
        help="concurrent streaming chat: throughput, TTFT and ITL vs transformers serve",
    )
    serve.add_argument("--model", help="model (default: the embedded SmolLM2)")
    serve.add_argument("--config", help="engine config YAML for specserve")
    serve.add_argument("--concurrency", type=int, default=8)
    serve.add_argument("--requests", type=int, help="total requests (default: --concurrency)")
    serve.add_argument("--max-tokens", type=int, default=64)
    serve.add_argument(
        "--url",
        help="benchmark an already running specserve at this URL (with --compare: it must "
        "load METHOD, e.g. --extra-decoders METHOD)",
    )
    serve.add_argument("--no-baseline", action="store_true", help="skip transformers serve")
    serve.add_argument(
        "--compare",
        metavar="METHOD",
        help="instead: one specserve server (started here, or the one at --url), and at each "
        "of --concurrencies the same load on autoregressive decoding and on METHOD (chosen per "
        "request; --config must load it, else --decoder METHOD is used)",
    )
    serve.add_argument("--concurrencies", default="1,4,8,16,32", help="with --compare")
    serve.add_argument(
        "--requests-per-stream", type=int, default=2, help="with --compare: requests = this x c"
    )
    serve.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="with --compare: runs of the load per method, alternating which goes first (a "
        "drifting machine weighs on both alike)",
    )
    serve.add_argument(
        "--conversations",
        type=int,
        help="instead: this many concurrent multi-turn conversations against --url, each turn "
        "carrying its history: TTFT and the prefix-cache hit rate (prefix-aware routing)",
    )
    serve.add_argument("--turns", type=int, default=6, help="with --conversations")
    serve.add_argument(
        "--think-time",
        type=float,
        default=0.0,
        help="with --conversations: mean seconds a conversation pauses before each turn "
        "(exponential, seeded), so conversations run out of step as real users do (default 0: "
        "in lockstep)",
    )
    serve.set_defaults(func=_cmd_bench_serve)
    ray = which.add_parser(
        "ray",
        help="replicas on Ray Serve vs one specserve serve under the same load, then a replica "
        "killed under load (pip install 'specserve[ray]')",
    )
    ray.add_argument("--model", help="model (default: the embedded SmolLM2)")
    ray.add_argument("--config", help="engine config YAML for every server")
    ray.add_argument("--replicas", type=int, default=2)
    ray.add_argument("--streams", type=int, default=40, help="concurrent streaming chats")
    ray.add_argument("--max-tokens", type=int, default=64,
                     help="per stream (the kill's streams ask for 4x as many)")  # fmt: skip
    ray.add_argument("--kill", choices=("server", "actor", "none"), default="server",
                     help="what of one replica to kill under load: its specserve server, "
                     "its Ray actor, or nothing")  # fmt: skip
    ray.add_argument("--stream-interval", type=at_least_one, default=1,
                     help="every server's --stream-interval (tokens a chunk gathers)")  # fmt: skip
    ray.add_argument("--ray-proxy", choices=PROXIES, default="ray",
                     help="the cluster's HTTP proxy (specserve serve --ray-proxy)")  # fmt: skip
    ray.set_defaults(func=_cmd_bench_ray)
