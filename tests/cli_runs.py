"""Helpers for tests that drive ``rollyard train`` through the CLI."""

from pathlib import Path

from rollyard.cli import main


def train_interrupted(args: list[str], out_dir: Path, stop_at: int, steps: int) -> None:
    """``rollyard train args`` stopped after ``stop_at`` steps (checkpointed there), then resumed to ``steps``."""
    assert main(["train", *args, f"steps={stop_at}", f"out_dir={out_dir}", f"checkpoint_every={stop_at}"]) == 0
    assert main(["train", "--resume", str(out_dir), f"steps={steps}"]) == 0


def straight_and_resumed(args: list[str], tmp_path: Path, stop_at: int, steps: int) -> tuple[Path, Path]:
    """The same run twice: straight through ``steps`` (checkpoint every ``stop_at``), and interrupted
    at ``stop_at`` then resumed. Returns both run directories."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert main(["train", *args, f"steps={steps}", f"out_dir={straight}", f"checkpoint_every={stop_at}"]) == 0
    train_interrupted(args, split, stop_at, steps)
    return straight, split
