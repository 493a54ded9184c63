"""Would a global suffix index over the target's own answers draft well? A simulation.

    python -m tooling.bench.suffix_simulation [--corpus-requests 1000] [--corpus-max-tokens 256]
        [--eval chat,grounded,held_out] [--gates 1:0.5,16:0.5,64:0.5] [--min-n 2] [--max-n 8]

SuffixDecoding (Arctic Inference's ``suffix`` method) drafts from a tree of every earlier
output as well as from the request's own context: where the model keeps saying what it said
before, a match in that global tree proposes the continuation for free. Before building it
into the engine this measures, on known greedy answers, what such an index would add to the
prompt lookup that ``ngram`` and ``hybrid`` already do. The target answers
``--corpus-requests`` of our own training requests (tooling/training/prompt_mix.py, its
"train" subjects: never a benchmark prompt) greedily; that is the index. Then, for the
evaluation sets' greedy answers (the bench's chat and grounded prompts, held-out requests),
it replays decoding step by step: at each position a source drafts up to k tokens, the draft
stands up to its first token that differs from the answer, and the step emits those plus one.

Sources: ``local`` (prompt lookup on the sequence, n-grams 2-4, as ``ngram``), ``global``
(the index alone: the longest suffix of the context, n from ``--max-n`` down to ``--min-n``,
found in the index; its continuations' most frequent path, cut where a token's share of the
matches falls under the gate's share, and only where the suffix occurs at least the gate's
count of times), ``both`` (prompt lookup where it matches at least 3 tokens, as ``hybrid``,
else the index). It prints tokens a step, drafted rows a step and the share of drafted rows
that stood, per gate ("count:share"). No timing: what a verified row costs decides whether a
rate pays (docs/benchmarks.md has that per machine).
"""

from __future__ import annotations

import argparse
import random
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.toolkit import find_continuation

END = -1  # between sequences in the index: no continuation crosses it
K = 4  # drafts a step


class SuffixIndex:
    """Every n-gram (n up to ``max_n``) of ``sequences`` with the positions that follow it."""

    def __init__(self, sequences: Sequence[Sequence[int]], max_n: int = 8):
        self.max_n = max_n
        self.tokens: list[int] = []
        self.after: dict[tuple[int, ...], list[int]] = defaultdict(list)
        for seq in sequences:
            base = len(self.tokens)
            self.tokens.extend([*seq, END])
            for i in range(len(seq)):
                for n in range(1, min(max_n, i + 1) + 1):
                    self.after[tuple(seq[i + 1 - n : i + 1])].append(base + i + 1)

    def draft(
        self, context: Sequence[int], k: int, min_n: int = 2, share: float = 0.5,
        min_count: int = 1, most_matches: int = 256,
    ) -> list[int]:  # fmt: skip
        """Up to ``k`` tokens continuing the longest suffix of ``context`` found (at least
        ``min_n`` long and ``min_count`` times): the most travelled path of what followed its
        latest ``most_matches`` occurrences, while each token was taken by at least ``share``
        of them."""
        for n in range(min(self.max_n, len(context)), min_n - 1, -1):
            live = self.after.get(tuple(context[-n:]))
            if not live or len(live) < min_count:
                continue
            live = live[-most_matches:]
            total, out = len(live), []
            for depth in range(k):
                following: dict[int, list[int]] = defaultdict(list)
                for p in live:
                    if self.tokens[p + depth] != END:
                        following[self.tokens[p + depth]].append(p)
                if not following:
                    break
                token, live = max(following.items(), key=lambda item: len(item[1]))
                if len(live) < share * total:
                    break
                out.append(token)
            return out
        return []


@dataclass
class Replay:
    tokens_per_step: float
    rows_per_step: float  # drafted tokens verified a step
    acceptance: float  # of the drafted tokens


def replay(answers: Sequence[tuple[list[int], list[int]]], drafter: Callable) -> Replay:
    """Decode each (prompt, answer) again with ``drafter(context, k)`` proposing each step."""
    steps = rows = stood = 0
    for prompt, answer in answers:
        t = 0
        while t < len(answer):
            draft = drafter(prompt + answer[:t], K)
            m = 0
            while m < len(draft) and t + m < len(answer) and draft[m] == answer[t + m]:
                m += 1
            rows, stood, steps, t = rows + len(draft), stood + m, steps + 1, t + m + 1
    total = sum(len(a) for _, a in answers)
    return Replay(total / max(steps, 1), rows / max(steps, 1), stood / max(rows, 1))


def sources(index: SuffixIndex, min_n: int, count: int, share: float) -> dict[str, Callable]:
    def local(ctx, k):
        return find_continuation(ctx, 2, 4, k)

    def global_(ctx, k):
        return index.draft(ctx, k, min_n, share, count)

    def both(ctx, k):
        return find_continuation(ctx, 3, 4, k) or global_(ctx, k)

    return {"local": local, "global": global_, "both": both}


def _answers(llm, conversations, max_tokens: int) -> list[tuple[list[int], list[int]]]:
    from engine.toolkit import SamplingParams

    prompts = [llm.render_chat(c) for c in conversations]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    return [(p, list(o.outputs[0].token_ids)) for p, o in zip(prompts, outs, strict=True)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus-requests", type=int, default=1000)
    parser.add_argument("--corpus-max-tokens", type=int, default=256)
    parser.add_argument("--eval", default="chat,grounded,held_out")
    parser.add_argument("--eval-max-tokens", type=int, default=128)
    parser.add_argument("--gates", default="1:0.5,16:0.5,64:0.5", help="count:share, ...")
    parser.add_argument("--min-n", type=int, default=2)
    parser.add_argument("--max-n", type=int, default=8)
    args = parser.parse_args(argv)

    from engine.toolkit import LLM
    from tooling.bench.bench_decoders import load_prompt_set
    from tooling.training.prompt_mix import request

    llm = LLM("smollm2-135m-instruct")
    draws = random.Random(1234)
    corpus = [request(draws, "train", follow_up_share=0.0).opening()
              for _ in range(args.corpus_requests)]  # fmt: skip
    index_answers = _answers(llm, corpus, args.corpus_max_tokens)
    index = SuffixIndex([a for _, a in index_answers], args.max_n)
    print(f"index: {len(index_answers)} answers, {len(index.tokens) - len(index_answers)} tokens")
    sets = {}
    for name in args.eval.split(","):
        if name == "held_out":
            draws = random.Random(99)
            convs = [request(draws, "held_out", follow_up_share=0.0).opening() for _ in range(100)]
        else:
            convs = [[{"role": "user", "content": t}] for t in load_prompt_set(name)]
        sets[name] = _answers(llm, convs, args.eval_max_tokens)
    print("\n| gate (count:share) | set | source | tokens/step | drafted rows/step | stood |")
    print("|---|---|---|---|---|---|")
    for gate in args.gates.split(","):
        count, share = gate.split(":")
        drafters = sources(index, args.min_n, int(count), float(share))
        for name, answers in sets.items():
            for source, drafter in drafters.items():
                r = replay(answers, drafter)
                print(f"| {gate} | {name} | {source} | {r.tokens_per_step:.3f} | "
                      f"{r.rows_per_step:.2f} | {r.acceptance:.1%} |")  # fmt: skip


if __name__ == "__main__":
    main()
