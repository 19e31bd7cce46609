"""A TRL script with a published recipe's settings (Dr. GRPO's loss, GSPO's sequence-level ratio, two iterations over
each generation batch of two optimizer steps, a cosine schedule with warm-up, a reference that follows the policy,
truncated completions masked) runs with only its import line changed, and trains as TRL counts: the optimizer steps,
the weight versions, and the learning rate of every optimizer step equal to TRL's own scheduler's
(``tests/trl_oracle.py``)."""

from __future__ import annotations

import difflib
import json
import runpy

import pytest

pytest.importorskip("trl", reason="TRL 1.16 is the oracle (pip install 'rollyard[test]')")

from trl_oracle import tiny_model, tiny_tokenizer, trl_lr_schedule

from rollyard.telemetry import rundir

SETTINGS = dict(learning_rate=1e-4, num_generations=4, per_device_train_batch_size=8, steps_per_generation=2,
                num_iterations=2, max_steps=8, loss_type="dr_grpo", importance_sampling_level="sequence",
                lr_scheduler_type="cosine", warmup_ratio=0.25, mask_truncated_completions=True, beta=0.04,
                sync_ref_model=True, ref_model_sync_steps=4, max_completion_length=8)

TRL_SCRIPT = '''\
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

model_id = "{model}"


def digits(completions, **kwargs):
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]


if __name__ == "__main__":
    dataset = [{{"prompt": f"{{i}} plus {{i + 1}} is"}} for i in range(40)]
    model = AutoModelForCausalLM.from_pretrained(model_id)
    tokenizer = AutoTokenizer.from_pretrained(model_id)
    training_args = GRPOConfig(output_dir="{out}", temperature=1.0, report_to="none", logging_steps=1, **{settings})
    trainer = GRPOTrainer(model=model, reward_funcs=digits, args=training_args, train_dataset=dataset,
                          processing_class=tokenizer)
    trainer.train()
'''


@pytest.mark.slow
def test_a_trl_recipe_script_runs_with_only_its_import_line_changed_and_steps_as_trl(tmp_path):
    tok = tiny_tokenizer()
    model_dir = tmp_path / "model"
    tiny_model(seed=3, tokenizer=tok).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    trl = TRL_SCRIPT.format(model=model_dir, out=tmp_path / "run", settings=repr(SETTINGS))
    ported = trl.replace("from trl import GRPOConfig, GRPOTrainer", "from rollyard import GRPOConfig, GRPOTrainer")
    changed = [d for d in difflib.ndiff(trl.splitlines(), ported.splitlines()) if d[:1] in "+-"]
    assert changed == ["- from trl import GRPOConfig, GRPOTrainer", "+ from rollyard import GRPOConfig, GRPOTrainer"]
    script = tmp_path / "grpo_recipe.py"
    script.write_text(ported)
    runpy.run_path(str(script), run_name="__main__")
    rows = [json.loads(line) for line in (tmp_path / "run" / rundir.METRICS).read_text().splitlines()]
    # 8 optimizer steps = 2 generation batches x 2 iterations x 2 optimizer steps each
    assert [r["step"] for r in rows] == [0, 1] and [r["version"] for r in rows] == [4, 8]
    assert all(r["train/updates"] == 4 for r in rows)
    # the rate of each row's last optimizer step (3 and 7) is TRL's own scheduler's at that step
    lrs = trl_lr_schedule({k: SETTINGS[k] for k in ("learning_rate", "lr_scheduler_type", "warmup_ratio")}, 8)
    assert [r["learning_rate"] for r in rows] == pytest.approx([lrs[3], lrs[7]], rel=1e-6)
    assert [r["reference/syncs"] for r in rows] == [1.0, 2.0]  # the reference mixed in at versions 4 and 8
    cfg = (tmp_path / "run" / rundir.CONFIG).read_text()
    for key in ("loss_agg: seq-mean-token-sum-norm", "ratio_level: sequence", "mask_truncated: true",
                "lr_schedule: cosine", "epochs: 2", "mini_batches: 2", "sync_every: 4"):
        assert key in cfg, key
