"""Training on from a drafter that exists (``--init-from``): a drafter trained on the first part
of a data set that has since grown goes on with the rest (``--data-from``) instead of paying
again for the part it has learnt, and a downloaded drafter (a public layout) can be fitted to a
user's own conversations. Its weights and draft vocabulary are the start; the optimizer and the
learning-rate schedule start afresh."""

from __future__ import annotations

import torch

from engine.toolkit import TrainedDrafter, load_drafter
from tooling.training.epochs import TrainingRun

# ``--init-from shipped``: the drafter specserve ships for the model.
SHIPPED = "shipped"


def grown_vocabulary(start: torch.Tensor, labels: torch.Tensor, size: int) -> torch.Tensor:
    """A warm start's draft vocabulary for a run that asks for ``size`` tokens: the start's,
    in its order (its trained rows stay where they are), then the most frequent label tokens
    it lacks, up to ``size`` in all. Never cut: a start with ``size`` tokens or more keeps its
    own. A target token outside the vocabulary can never be drafted, so the bench's answers
    that fall outside it (SmolLM2, 4096 tokens: 13% of chat, 17% of grounded answers' tokens)
    are steps that no training of the drafter can win."""
    if size <= len(start):
        return start
    labels = labels[labels >= 0]
    counts = torch.bincount(labels, minlength=int(max(labels.max(), start.max())) + 1)
    counts[start] = 0
    extra = counts.topk(min(size - len(start), int((counts > 0).sum()))).indices
    return torch.cat([start, extra.to(start.dtype)])


def initial_drafter(options, kind: str, network_class: type, model, run: TrainingRun,
                    wanted: dict | None = None) -> TrainedDrafter | None:  # fmt: skip
    """The drafter ``options.init_from`` names, checked against ``model`` and against the
    shape the run's own options ask for (``wanted``: shape key -> value), ready to train, and
    noted in ``run`` (the new drafter's record says what it grew from); None when the run
    starts from scratch."""
    source = getattr(options, "init_from", None)
    if not source:
        return None
    drafter = load_drafter(None if source == SHIPPED else str(source), kind, network_class, model)
    shape = drafter.network.shape
    for key, value in (wanted or {}).items():
        if shape.get(key) != value:
            raise ValueError(
                f"--init-from {source}: the {kind} drafter has {key} {shape.get(key)!r}, this "
                f"run asks for {value!r} (leave the option out or set it to match)"
            )
    network = drafter.network.float().train()
    for parameter in network.parameters():
        parameter.requires_grad_(True)
    # What the start had learnt from in all: its own run and, when it was warm-started too,
    # what its own start had (so a chain of runs draws one learning curve).
    learnt = drafter.info.get("training_answer_tokens")
    earlier = (drafter.info.get("started_from") or {}).get("training_answer_tokens") or 0
    run.started_from = {
        "drafter": str(source),
        "training_answer_tokens": None if learnt is None else learnt + earlier,
        "data": drafter.info.get("data"),
    }
    print(
        f"starting from the {kind} drafter in {source} "
        f"(its {len(drafter.draft_vocab)}-token draft vocabulary)"
    )
    return drafter
