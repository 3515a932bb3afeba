"""A rank that fails never leaves its peers hanging, with the ranks started as users start them.

Each scenario starts two ranks under Lightning's launcher (``python script.py``: rank 0 starts rank 1 and
hosts the TCPStore the ranks meet through, so the store dies with rank 0) or under ``torchrun
--standalone`` (the agent hosts the store), makes one rank fail, and times, from the fault, when every
rank's process has ended (see :mod:`tests.integration.launch_faults`). The distributed suite's fault tests
(``tests/distributed/test_faults.py``) meet through a file store that outlives every rank, so they cannot
see what a store dying with rank 0 does to the others.

Every rank must end within 30 s of the fault (the control timeout plus 30 s where a timeout is the only
possible detection: ``apply_placement`` called on one rank only); the failing rank raises its own error,
the other names it. Scenarios run a few at a time to keep the suite's time down (the bound is on each
scenario's own clock).
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.integration.launch_faults import Outcome, launch
from tests.integration.test_strategy_launcher import _clean_env

pytestmark = pytest.mark.distributed

_BOUND_S = 30.0
_CONTROL_S = 5.0
_ROOT = Path(__file__).resolve().parents[2]
_CONCURRENT = 3


def _run_all(
    launcher: str, scenarios: list[tuple[str, int]], tmp_path: Path
) -> dict[tuple[str, int], Outcome]:
    env = _clean_env(_ROOT)

    def one(scenario: tuple[str, int]) -> Outcome:
        where, culprit = scenario
        out = tmp_path / f"{launcher}-{where}-{culprit}"
        out.mkdir()
        return launch(launcher, where, culprit, out, root=_ROOT, env=env, control_s=_CONTROL_S)

    with ThreadPoolExecutor(_CONCURRENT) as pool:
        return dict(zip(scenarios, pool.map(one, scenarios), strict=True))


def _rank_lines(output: str, rank: int) -> str:
    """Rank ``rank``'s error lines (torch prefixes each line a rank prints to stderr on failure)."""
    return "\n".join(line for line in output.splitlines() if line.startswith(f"[rank{rank}]:"))


# What the failing rank raises (its own error, as the distributed tests check it) for each fault point.
_OWN = {
    "setup": r"ValueError: injected fault on rank {r} at setup",
    "forward": r"ValueError: injected fault on rank {r} in forward\n.*DynMo: raised on rank {r} in layers",
    "backward": r"ValueError: injected fault on rank {r} in backward\n.*DynMo: raised on rank {r}",
    "checkpoint": r"ValueError: injected fault on rank {r} during a checkpoint save",
    "apply_placement": r"CommunicationError: DynMo: rank {r} \(stage {r}\) failed in apply_placement",
}


def _check(launcher: str, outcomes: dict[tuple[str, int], Outcome]) -> list[str]:
    """Every broken promise of every scenario, each named (empty: all kept)."""
    problems = []
    for (where, culprit), outcome in outcomes.items():
        name = f"{launcher}: {where} on rank {culprit}"
        ends = ", ".join(
            f"rank {r} {a:.1f} s" if a is not None else f"rank {r} not ended"
            for r, a in outcome.ended_after.items()
        )
        print(f"{name}: ended after the fault: {ends}")  # the table in the report (pytest -s)
        bound = _BOUND_S + (_CONTROL_S if where == "apply_placement" else 0.0)
        for rank, after in outcome.ended_after.items():
            if after is None or not after < bound:
                problems.append(f"{name}: rank {rank} ended {after} s after the fault (bound {bound} s)")
        peer = 1 - culprit
        own, other = _rank_lines(outcome.output, culprit), _rank_lines(outcome.output, peer)
        if where in _OWN and not re.search(_OWN[where].format(r=culprit), own, re.DOTALL):
            problems.append(f"{name}: its own error is missing:\n{own[-3000:]}")
        # The survivor names the failed rank: its posted error, the call it was in, or that it is gone. The
        # last is all it can say when the store died with rank 0 before the survivor read rank 0's post (a
        # race of a loaded machine); before placement (setup) the gone rank has no stage to name.
        named = (
            rf"CommunicationError: DynMo: (rank {culprit} \(stage \w+\) failed first: ValueError: injected"
            rf"|rank {peer} \(stage \w+\) failed in .* while rank {culprit} \(stage {culprit}\) was waiting "
            rf"in apply_placement|rank {culprit}(?: \(stage \w+\))? is gone)"
        )
        if where == "apply_placement":  # the board names the call the culprit was stuck in, under both stores
            named = (
                rf"rank {peer} \(stage {peer}\) failed in a schedule step while rank {culprit} .*in apply_pl"
            )
        # Under torchrun the agent ends the survivor (SIGTERM) as soon as it sees the killed rank, which can
        # be before the survivor's own error is printed: then the agent's root cause is what names it.
        agent = (
            rf"Root Cause .*:\n\[{culprit}\]:\n(?: .*\n)*? +rank +: {culprit} .*\n +exitcode .*\(SIGKILL\)"
        )
        by_agent = launcher == "torchrun" and where == "sigkill" and re.search(agent, outcome.output)
        if not re.search(named, other) and not by_agent:
            problems.append(f"{name}: rank {peer} does not name rank {culprit}:\n{other[-3000:]}")
        if where == "sigkill" and culprit > 0 and launcher == "lightning":
            line = rf"DynMo: rank {culprit} \(pid \d+\) was killed by SIGKILL \(out of memory\?\)\."
            if not re.search(line, outcome.output):
                problems.append(f"{name}: the launching process did not name the killed rank")
    return problems


_POINTS = ["setup", "forward", "backward", "apply_placement", "checkpoint"]


@pytest.mark.parametrize("culprit", [0, 1], ids=["rank0", "last-rank"])
def test_under_lightnings_launcher_an_error_on_one_rank_ends_every_rank_naming_it(
    culprit: int, tmp_path: Path
) -> None:
    outcomes = _run_all("lightning", [(where, culprit) for where in _POINTS], tmp_path)
    problems = _check("lightning", outcomes)
    assert not problems, "\n\n".join(problems)


def test_under_lightnings_launcher_a_killed_rank_is_named_and_every_rank_ends(tmp_path: Path) -> None:
    outcomes = _run_all("lightning", [("sigkill", 0), ("sigkill", 1)], tmp_path)
    problems = _check("lightning", outcomes)
    assert not problems, "\n\n".join(problems)


def test_under_torchrun_a_failed_or_killed_rank_is_named_and_every_rank_ends(tmp_path: Path) -> None:
    # The agent hosts the store here: it outlives the ranks, and the board names a stuck peer's call.
    scenarios = [("forward", 0), ("apply_placement", 1), ("sigkill", 0)]
    problems = _check("torchrun", _run_all("torchrun", scenarios, tmp_path))
    assert not problems, "\n\n".join(problems)
