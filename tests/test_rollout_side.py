"""The rollout side's declared contract (``placement/side.py``): both sides implement every member of it."""

from rollyard.placement.colocated import LocalRollout
from rollyard.placement.pool import RolloutPool
from rollyard.placement.side import RolloutSide


def test_both_rollout_sides_implement_the_declared_contract():
    members = [n for n in vars(RolloutSide) if not n.startswith("_")]
    assert {"take", "trainer_turn", "publish", "check", "canary", "metrics", "checkpoint", "stop"} <= set(members)
    assert {"run", "r", "book", "session"} <= set(RolloutSide.__annotations__)
    for cls in (LocalRollout, RolloutPool):
        assert RolloutSide in cls.__mro__  # declared, not only alike
        assert [n for n in members if getattr(cls, n) is getattr(RolloutSide, n)] == [], cls  # none left to the stub
