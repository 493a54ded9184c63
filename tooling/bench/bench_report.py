"""The decoder benchmark's report (tooling/bench/bench_decoders.py measures): the table, why each
variant slower than autoregressive is slower, and the plot of speedups, a PNG drawn with
matplotlib's Agg backend (no display needed) for docs/.

Rows with step costs (``costs``) are ours; rows without are transformers'.
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine.toolkit import DECODERS, DecoderConfig


def plot_speedups(
    speedups: dict[str, dict[str, float]], path: str | Path, title: str, baseline: set[str]
) -> Path:
    """Horizontal bars of ``speedups[prompt_set][method]``; methods in first-seen order,
    the ``baseline`` ones (other implementations, e.g. transformers) hatched. Returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = list(speedups)
    methods = list(dict.fromkeys(m for per_set in speedups.values() for m in per_set))
    height = 0.8 / max(1, len(sets))
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(methods) * max(1, len(sets)) / 1.6 + 1.6))
    for j, set_name in enumerate(sets):
        rows = [(i, speedups[set_name][m], m) for i, m in enumerate(methods)]
        rows = [r for r in rows if r[2] in speedups[set_name]]
        y = [i + (j - (len(sets) - 1) / 2) * height for i, _, _ in rows]
        bars = ax.barh(y, [s for _, s, _ in rows], height, label=set_name, color=f"C{j}")
        for bar, (_, value, method) in zip(bars, rows, strict=True):
            if method in baseline:
                bar.set_hatch("//")
                bar.set_alpha(0.6)
            ax.annotate(
                f"{value:.2f}x",
                (bar.get_width(), bar.get_y() + bar.get_height() / 2),
                xytext=(3, 0),
                textcoords="offset points",
                va="center",
                fontsize=7,
            )
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks(range(len(methods)), methods, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("speedup over autoregressive (same run; >1 is faster)")
    ax.set_title(title, fontsize=9)
    ax.legend(title="prompts", fontsize=8, loc="lower right")
    ax.set_xlim(0, max([1.2] + [v for s in speedups.values() for v in s.values()]) * 1.15)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def describe(config: DecoderConfig) -> str:
    """The settings that make a variant what it is, in one line."""
    parts = [f"{config.method}, k={config.num_speculative_tokens}"]
    if config.method in ("draft", "hierarchical"):
        d = config.draft
        layers = "all layers" if d.num_layers is None else f"first {d.num_layers} layers"
        parts.append(f"draft {d.model} ({d.quantization}, {layers})")
    if config.method == "ngram":
        parts.append(f"n-grams {config.prompt_lookup_min}-{config.prompt_lookup_max}")
        if config.prompt_lookup_candidates > 1:
            parts.append(f"trees of up to {config.prompt_lookup_candidates} matches")
    if config.method == "layerskip":
        s = config.layerskip
        parts.append(
            f"skip_attention {s.skip_attention}, skip_mlp {s.skip_mlp}, exit_layer {s.exit_layer}"
        )
    if DECODERS[config.method].trained:
        drafter = getattr(config, config.method).drafter
        chain = config.method in ("eagle", "kangaroo")
        shape = "chain of up to k drafts" if chain else "tree of k nodes"
        if config.method == "eagle" and config.eagle.tree_top_k:
            top_k, depth = config.eagle.tree_top_k, config.eagle.tree_depth
            shape = f"dynamic tree of k nodes (top {top_k} per depth, {depth} deep)"
        parts.append(f"drafter {drafter or 'shipped for the model'}, {shape}")
        if config.method == "kangaroo":
            parts.append(f"exit threshold {config.kangaroo.exit_threshold}")
    if config.method == "hierarchical":
        h = config.hierarchical
        parts.append(f"level 1 {h.level1}, tau2 {h.tau2}")
    if config.method != "ngram":
        w = config.window
        detail = {"adaptive_exit": f" gamma {w.gamma}", "entropy": f" tau {w.tau}"}
        parts.append(f"window {w.policy}{detail.get(w.policy, '')}")
    if config.draft_policy != "fixed":
        parts.append(f"draft policy {config.draft_policy}")
    if config.gate.min_target_prob is not None:
        parts.append(f"gate min_target_prob {config.gate.min_target_prob}")
    return "; ".join(parts)


def print_header(llm, options, configs, context_len: int, forward_s: list[float]) -> None:
    print(
        f"model {llm.model_dir} ({llm.engine.model.arch.num_layers} layers, {llm.config.dtype}), "
        f"torch threads {torch.get_num_threads()}; greedy, batch 1, max_tokens "
        f"{options.max_tokens}, k={options.k}, prompt sets {', '.join(options.prompt_sets)} "
        f"({options.prompts_per_set or 'all'} prompts each), prefix cache off; methods "
        f"interleaved prompt by prompt, fastest of {options.repeats} run(s) per prompt\n"
    )
    one = forward_s[0]
    passes = ", ".join(f"{n + 1}: {1e3 * s:.1f}" for n, s in enumerate(forward_s))
    print(
        f"target forward pass after a {context_len}-token context, ms by new tokens (median of "
        f"7): {passes}; {len(forward_s)} tokens cost {forward_s[-1] / one:.2f}x one token\n"
    )
    print("variants:")
    for name, config in configs.items():
        print(f"- {name}: {describe(config)}")
    print(
        "\n| prompts | method | tok/s | speedup vs autoregressive | acceptance rate | "
        "mean acceptance length | identical to autoregressive | tokens/step | "
        "ms/step: draft + verify + rest |\n|---|---|---|---|---|---|---|---|---|"
    )


def print_rows(set_name: str, results: dict) -> None:
    reference = results["autoregressive"]
    for name, r in results.items():
        rate = "-" if r.acceptance_rate is None else f"{r.acceptance_rate:.0%}"
        length = "-" if r.mean_acceptance_length is None else f"{r.mean_acceptance_length:.2f}"
        same = sum(a == b for a, b in zip(r.token_ids, reference.token_ids, strict=True))
        if same == len(reference.token_ids) and r.repeatable and reference.repeatable:
            identical = "yes"
        else:  # ours must never differ; transformers' float arithmetic may
            identical = f"{'NO, ' if r.costs else ''}{same}/{len(reference.token_ids)} prompts"
            identical += "" if r.repeatable else ", changed between repeats"
        steps = tokens = "-"
        if r.costs is not None and r.costs.steps:
            c = r.costs
            tokens = f"{c.tokens / c.steps:.2f}"
            steps = " + ".join(f"{c.per_step_ms(s):.1f}" for s in (c.draft_s, c.verify_s, c.rest_s))
        print(
            f"| {set_name} | {name} | {r.tokens_per_s:.1f} | "
            f"{r.tokens_per_s / reference.tokens_per_s:.2f}x | {rate} | {length} | {identical} | "
            f"{tokens} | {steps} |"
        )


def losing_reason(r, results: dict) -> str:
    """Why ``r`` is slower than autoregressive, in units of an autoregressive decode step."""
    c, a = r.costs, results["autoregressive"].costs
    unit = a.per_step_ms(a.step_s)  # ms of one autoregressive step = one token
    draft = c.per_step_ms(c.draft_s) / unit
    verify = (c.per_step_ms(c.verify_s) - a.per_step_ms(a.verify_s)) / unit
    rest = (c.per_step_ms(c.rest_s) - a.per_step_ms(a.rest_s)) / unit
    per_draft = 1e3 * c.draft_s / r.draft_tokens if r.draft_tokens else 0.0
    largest = max((draft, "drafting"), (verify, "verification"), (rest, "step overhead"))[1]
    if not r.draft_tokens:
        return (
            f"It proposed no drafts (nothing found, or gated), so it can at best match "
            f"autoregressive; its steps cost {c.per_step_ms(c.step_s) / unit:.2f} "
            f"autoregressive steps (verification {verify:+.2f}, rest {rest:+.2f})."
        )
    return (
        f"A decode step emits {c.tokens / c.steps:.2f} tokens (acceptance "
        f"{r.acceptance_rate or 0:.0%}, {r.draft_tokens / c.steps:.2f} drafts per step) but "
        f"costs {c.per_step_ms(c.step_s) / unit:.2f} autoregressive steps: drafting "
        f"+{draft:.2f} ({per_draft:.1f} ms per draft token, {per_draft / unit:.2f} steps), "
        f"verifying {c.rows / c.steps:.2f} tokens {verify:+.2f}, rest {rest:+.2f}. "
        f"Largest cost: {largest}."
    )


def print_summary(results: dict, losing: list[str]) -> None:
    print()
    for set_name, per_set in results.items():
        base = per_set["autoregressive"].tokens_per_s
        ours = {n: r for n, r in per_set.items() if r.costs is not None and n != "autoregressive"}
        if ours:
            best = max(ours, key=lambda n: ours[n].tokens_per_s)
            line = f"{set_name}: best decoder {best} {ours[best].tokens_per_s / base:.2f}x"
            # transformers' assisted generation: every row of theirs but plain generate().
            theirs = {
                n: r for n, r in per_set.items() if r.costs is None and not n.endswith("generate()")
            }
            if theirs:
                top = max(theirs, key=lambda n: theirs[n].tokens_per_s)
                ratio = ours[best].tokens_per_s / theirs[top].tokens_per_s
                line += f"; best assisted transformers: {top} "
                line += f"{theirs[top].tokens_per_s / base:.2f}x (ours is {ratio:.2f}x its tok/s)"
            print(line)
    spreads = sorted(r.spread for per_set in results.values() for r in per_set.values())
    if spreads[-1] > 0:
        print(
            f"repeats of one prompt with one method differed by up to {spreads[-1]:.0%} "
            f"(median over methods and sets {spreads[len(spreads) // 2]:.0%}): the machine's noise"
        )
    if losing:
        print("\nslower than autoregressive (costs in autoregressive decode steps):")
        print("\n".join(losing))


def plot_decoder_bench(options, model_name: str) -> Path:
    """The speedups of ``options.results`` (``{set: {method: result}}``) as ``options.plot``."""
    speedups = {
        s: {
            n: r.tokens_per_s / per_set["autoregressive"].tokens_per_s
            for n, r in per_set.items()
            if n != "autoregressive"  # 1.0 by definition: the plot's vertical line
        }
        for s, per_set in options.results.items()
    }
    theirs = {
        n for per_set in options.results.values() for n, r in per_set.items() if r.costs is None
    }
    title = (
        f"{model_name}: greedy, batch 1, {options.max_tokens} tokens, k={options.k}\n"
        "tokens/s over our autoregressive decoding in the same run (transformers hatched)"
    )
    return plot_speedups(speedups, options.plot, title, theirs)
