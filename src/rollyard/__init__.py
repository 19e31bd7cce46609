"""rollyard: RL post-training with an explicit, measured, planned data path.

``rollyard.train(config, *, model=None, tokenizer=None, dataset=None, reward_funcs=None) -> Run``
(see ``rollyard/api.py``); ``GRPOConfig`` / ``GRPOTrainer``: TRL's names over it. Imported lazily, so
``import rollyard`` stays light (reward workers and hook modules may import it without pulling in torch).
"""

__version__ = "0.1.0"
__all__ = ["GRPOConfig", "GRPOTrainer", "Run", "train"]


def __getattr__(name: str):
    if name in __all__:
        from rollyard import api
        return getattr(api, name)
    raise AttributeError(f"module 'rollyard' has no attribute {name!r}")
