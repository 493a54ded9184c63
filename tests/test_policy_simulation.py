"""The goodput policy in a simulated machine (tooling/bench/policy_simulation.py): seeded, and
on a noisy machine it keeps drafting where drafting pays and ends at least about as fast as
the best fixed length, and plain where the drafter is useless."""

from __future__ import annotations

from tooling.bench.policy_simulation import compare, simulate


def test_the_simulation_is_seeded():
    assert simulate(None, 0.46, 0.5, seed=3, tokens=300) == simulate(None, 0.46, 0.5, 3, 300)
    assert simulate(None, 0.46, 0.5, seed=3, tokens=300) != simulate(None, 0.46, 0.5, 4, 300)


def test_on_a_noisy_machine_the_policy_keeps_drafting_what_pays():
    # A drafter right 46% of the time, each step's costs scattered by a log-normal spread of
    # 0.5: one draft a step gains about 12%. The policy used to run 47% of its steps plain
    # here (an unlucky reading of verification's cost, never corrected while it drafted
    # nothing) and end 4% below fixed k = 1.
    rows = compare(acceptance=0.46, noise=0.5, seeds=12, tokens=2000)
    assert rows["k1"].tokens_per_second > 1.08 * rows["plain"].tokens_per_second
    assert rows["goodput"].plain_share < 0.25
    assert rows["goodput"].tokens_per_second > 0.98 * rows["k1"].tokens_per_second


def test_a_useless_drafter_leaves_the_steps_plain():
    rows = compare(acceptance=0.05, noise=0.25, seeds=6, tokens=1500)
    assert rows["k1"].tokens_per_second < 0.9 * rows["plain"].tokens_per_second
    assert rows["goodput"].plain_share > 0.9
    assert rows["goodput"].tokens_per_second > 0.97 * rows["plain"].tokens_per_second


def test_another_machine_s_costs_come_from_the_command_line(monkeypatch, capsys):
    import pytest

    import tooling.bench.policy_simulation as simulation

    for name in ("FORWARD", "DRAFT_SECONDS", "OVERHEAD"):  # main() sets them for its run
        monkeypatch.setattr(simulation, name, getattr(simulation, name))
    args = ["--seeds", "2", "--tokens", "300", "--noise", "0.05", "--acceptance", "0.3"]
    # A dear drafter (a draft token 0.4 of a step): fixed k = 1 loses, the policy stays plain.
    simulation.main([*args, "--forward-ms", "4.0,5.1,6.1,7.3,9.1", "--draft-ms", "1.6",
                     "--overhead-ms", "0.2"])  # fmt: skip
    assert simulation.FORWARD[2] == pytest.approx(5.1e-3)
    assert simulation.DRAFT_SECONDS == pytest.approx(1.6e-3)
    row = capsys.readouterr().out.strip().splitlines()[-1].split("|")
    k1, goodput = float(row[3].strip(" x")), float(row[5].strip(" x"))
    assert k1 < 0.8 and goodput > 0.95
    with pytest.raises(SystemExit):
        simulation.main([*args, "--forward-ms", "4.0,5.1"])
    assert "takes 5 times" in capsys.readouterr().err
