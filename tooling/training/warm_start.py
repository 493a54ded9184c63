"""Training on from a drafter that exists (``--init-from``): a drafter trained on the first part
of a data set that has since grown goes on with the rest (``--data-from``) instead of paying
again for the part it has learnt, and a downloaded drafter (a public layout) can be fitted to a
user's own conversations. Its weights and draft vocabulary are the start; the optimizer and the
learning-rate schedule start afresh."""

from __future__ import annotations

from engine.toolkit import TrainedDrafter, load_drafter
from tooling.training.epochs import TrainingRun

# ``--init-from shipped``: the drafter specserve ships for the model.
SHIPPED = "shipped"


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
