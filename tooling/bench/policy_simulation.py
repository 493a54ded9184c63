"""The goodput policy against fixed draft lengths, in a simulated machine (batch 1).

    python -m tooling.bench.policy_simulation [--seeds 20] [--tokens 2000]
        [--noise 0.05,0.25,0.5] [--acceptance 0.3,0.46,0.65]
        [--forward-ms 6.5,7.6,8.7,9.8,11.0] [--draft-ms 0.45] [--overhead-ms 0.4]

On a real machine the policy and a fixed length are a few percent apart while repeats of one
prompt scatter by tens of percent, so a bench cannot tell a policy that loses 3% from one that
wins. Here the engine's own ``GoodputPolicy`` chooses every step of a simulated stream, whose
costs and acceptance are known: the target's forward pass over n tokens takes ``FORWARD[n]``
(the shape a 2-core CPU measured for SmolLM2-135M: 1 token 6.5 ms, each more about 1.1 ms;
``--forward-ms`` gives another machine's, 1 to 5 tokens, as the bench prints them) and
``KEY_SECONDS`` for each key its tokens attend to, drafting ``DRAFT_SECONDS`` a token, the rest
of a step ``OVERHEAD`` (``--draft-ms``, ``--overhead-ms``); each of these is scattered by a
log-normal factor of spread ``--noise`` per step (a noisy VM); a draft chain stands up to its
first rejection, each draft right with the stretch's acceptance, which is redrawn every
``STRETCH`` tokens around ``--acceptance`` (text is easier in some places than others).

It prints, per noise and mean acceptance, tokens per simulated second of fixed k = 1 and 2 and
of the policy (k <= 4) over plain decoding, and the share of the policy's steps that ran plain.
Seeded: the same arguments print the same table.
"""

from __future__ import annotations

import argparse
import math
import random
from dataclasses import dataclass

FORWARD = {1: 6.5e-3, 2: 7.6e-3, 3: 8.7e-3, 4: 9.8e-3, 5: 11.0e-3}  # seconds by step tokens
KEY_SECONDS = 1e-7  # and per key a step's tokens attend to
DRAFT_SECONDS = 0.45e-3  # a draft token (hydra-like on the same CPU)
OVERHEAD = 0.4e-3  # a step outside its forward pass and drafting
VERIFY_EXTRA = 1.05  # a verification pass against a plain pass of as many tokens
STRETCH = 20  # tokens of text at one acceptance
CONTEXT = 100  # prompt tokens
MAX_DRAFTS = 4


def forward_seconds(tokens: int, keys: int) -> float:
    return FORWARD[tokens] + KEY_SECONDS * keys


@dataclass
class Outcome:
    tokens_per_second: float
    plain_share: float  # of the steps


def simulate(length: int | None, acceptance: float, noise: float, seed: int,
             tokens: int = 2000) -> Outcome:  # fmt: skip
    """One stream of ``tokens`` tokens: drafting ``length`` tokens every step, or with None
    as the goodput policy chooses (up to MAX_DRAFTS)."""
    from engine.toolkit import GoodputPolicy, StepTimings

    draws = random.Random(seed)
    policy = None
    if length is None:
        timings = StepTimings(  # what the engine's calibration would measure
            short={n: forward_seconds(n, n * 16) for n in FORWARD}, context=16,
            long={n: forward_seconds(n, n * 512) for n in (1, 2, 4)}, long_context=512,
        )  # fmt: skip
        policy = GoodputPolicy(calibrate=lambda: timings)
    made, clock, steps, plain, rate = 0, 0.0, 0, 0, acceptance
    while made < tokens:
        if made // STRETCH != (made - 1) // STRETCH:
            rate = draws.betavariate(acceptance * 8, (1 - acceptance) * 8)
        if policy is None:
            k = length
        else:
            k = policy.choose("drafter", 1, MAX_DRAFTS, context=CONTEXT + made)
            k += policy.explore  # batch 1: the one sequence is the explorer
        drafting = DRAFT_SECONDS * k * math.exp(draws.gauss(0, noise))
        keys = (1 + k) * (CONTEXT + made)
        forward = forward_seconds(1 + k, keys) * math.exp(draws.gauss(0, noise))
        forward *= VERIFY_EXTRA if k else 1
        rest = OVERHEAD * math.exp(draws.gauss(0, noise))
        accepted = 0
        while accepted < k and draws.random() < rate:
            accepted += 1
        if policy is not None:
            if k:
                policy.observe_draft("drafter", k, 1, drafting)
                policy.observe_run("drafter", k, accepted)
            policy.observe_step(1 + k, forward, keys, k > 0)
            policy.observe_overhead(rest, k > 0)
        clock += drafting + forward + rest
        made, steps, plain = made + 1 + accepted, steps + 1, plain + (k == 0)
    return Outcome(made / clock, plain / steps)


def compare(acceptance: float, noise: float, seeds: int, tokens: int) -> dict[str, Outcome]:
    """Mean outcome over ``seeds`` streams of plain decoding, k = 1, k = 2 and the policy
    (the same seeds for each, so each meets the same text and the same noise draws)."""
    rows = {}
    for name, length in (("plain", 0), ("k1", 1), ("k2", 2), ("goodput", None)):
        runs = [simulate(length, acceptance, noise, seed, tokens) for seed in range(seeds)]
        rows[name] = Outcome(
            sum(r.tokens_per_second for r in runs) / seeds,
            sum(r.plain_share for r in runs) / seeds,
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--noise", default="0.05,0.25,0.5", help="log-normal spreads of a step")
    parser.add_argument("--acceptance", default="0.3,0.46,0.65", help="mean acceptances")
    parser.add_argument("--forward-ms", help="a forward pass over 1..5 tokens, comma-separated")
    parser.add_argument("--draft-ms", type=float, help="a draft token")
    parser.add_argument("--overhead-ms", type=float, help="a step outside forward and drafting")
    args = parser.parse_args(argv)
    global FORWARD, DRAFT_SECONDS, OVERHEAD
    if args.forward_ms:
        times = [float(x) * 1e-3 for x in args.forward_ms.split(",")]
        if len(times) != MAX_DRAFTS + 1:
            parser.error(f"--forward-ms takes {MAX_DRAFTS + 1} times (1..{MAX_DRAFTS + 1} tokens)")
        FORWARD = dict(enumerate(times, start=1))
    if args.draft_ms is not None:
        DRAFT_SECONDS = args.draft_ms * 1e-3
    if args.overhead_ms is not None:
        OVERHEAD = args.overhead_ms * 1e-3
    print("| noise | acceptance | k = 1 | k = 2 | goodput | goodput's plain steps |")
    print("|---|---|---|---|---|---|")
    for noise in (float(x) for x in args.noise.split(",")):
        for acceptance in (float(x) for x in args.acceptance.split(",")):
            rows = compare(acceptance, noise, args.seeds, args.tokens)
            base = rows["plain"].tokens_per_second
            ratio = {k: r.tokens_per_second / base for k, r in rows.items()}
            print(f"| {noise} | {acceptance} | {ratio['k1']:.3f}x | {ratio['k2']:.3f}x | "
                  f"{ratio['goodput']:.3f}x | {rows['goodput'].plain_share:.0%} |")  # fmt: skip


if __name__ == "__main__":
    main()
