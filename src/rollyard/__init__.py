"""rollyard: RL post-training with an explicit, measured, planned data path."""

__version__ = "0.1.0"
