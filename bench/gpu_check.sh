#!/usr/bin/env bash
# GPU checks on one CUDA device, run from the repository root on a machine with a GPU and a CUDA torch:
#   bash bench/gpu_check.sh [TOKENIZER_DIR SUMS_DIR]
# 1. the tests marked `gpu`; 2. the demo config (colocated, trainer and native engine on CUDA), 30 steps, and (2b)
#    3 steps of it disaggregated (trainer on CUDA, a CPU Ray rollout actor);
# 3. four steps of the real-model example (examples/real_model/smollm2.toml) on a SmolLM2-135M-shaped random-init
#    model built from TOKENIZER_DIR's config.json and tokenizer (the dequantized GGUF's directory without its weights),
#    SUMS_DIR from examples/real_model/sums.py; 4. the suite without Ray on CUDA (pytest-xdist), failures listed.
# Each part has its own time limit and prints its tail; nothing here needs a network.
set -u
OUT=${OUT:-/tmp/rollyard-gpu}
TOK=${1:-.gpu/smollm2}
SUMS=${2:-.gpu/sums}
PY=${PY:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 RAY_AUTH_MODE=disabled PYTHONPATH="src:${PYTHONPATH:-}"
nvidia-smi -L
$PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name(0))"

echo "== 1. tests marked gpu"
timeout 100 $PY -m pytest -q -p no:cacheprovider -m gpu tests/test_trainer.py tests/test_vllm.py tests/test_memory_peaks.py -rs 2>&1 | tail -15

echo "== 2. demo config on CUDA, 30 GRPO steps"
timeout 110 $PY -m rollyard.cli train --config examples/demo.toml out_dir="$OUT/demo" steps=30 progress=false \
    checkpoint_every=10 2>&1 | tail -20
$PY - "$OUT/demo" <<'EOF'
import json, sys, statistics, pathlib
d = pathlib.Path(sys.argv[1]); rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
s = json.loads((d / "summary.json").read_text())
print("demo:", {k: s.get(k) for k in ("eval_before", "eval_after", "device", "steps")},
      "median step s", round(statistics.median(r["time/step"] for r in rows), 3),
      "reward first/last 5", [round(statistics.mean(r["reward"] for r in rows[i]), 3) for i in (slice(0, 5), slice(-5, None))])
EOF

echo "== 2b. disaggregated on CUDA, 3 GRPO steps: the trainer on the GPU, one Ray rollout actor on CPU started with the"
echo "       driver's settings (device, sync plan and dtype resolved once, roles.settings): it must start equal (checksum)"
timeout 150 $PY -m rollyard.cli train --config examples/demo.toml placement=disaggregated trainer.device=cuda \
    rollout.workers=1 sft.auto=false out_dir="$OUT/disaggregated" steps=3 progress=false checkpoint_every=1000 2>&1 | tail -8
$PY - "$OUT/disaggregated" <<'EOF'
import json, sys, pathlib
d = pathlib.Path(sys.argv[1]); s = json.loads((d / "summary.json").read_text()); info = json.loads((d / "run.json").read_text())
rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
print("disaggregated:", {k: s.get(k) for k in ("steps", "version", "placement")},
      {k: info.get(k) for k in ("device", "sync_mode", "sync_transport", "bytes_per_param", "staleness_bound")},
      "staleness/max per step", [r.get("staleness/max") for r in rows])
assert s["steps"] == 3 and info["device"] == "gpu" and info["staleness_bound"] == 1, "disaggregated: not 3 steps on the GPU"
EOF

echo "== 3. SmolLM2-135M-shaped random init, real-model example, 4 steps"
timeout 150 $PY - "$TOK" "$OUT/smollm2-rand" <<'EOF'
import sys, torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
cfg = AutoConfig.from_pretrained(sys.argv[1]); torch.manual_seed(0)
AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(sys.argv[2])
AutoTokenizer.from_pretrained(sys.argv[1]).save_pretrained(sys.argv[2])
print("built", sys.argv[2])
EOF
timeout 150 $PY -m rollyard.cli train --config examples/real_model/smollm2.toml model.name="$OUT/smollm2-rand" \
    data.path="$SUMS/train.jsonl" data.eval_path="$SUMS/eval.jsonl" out_dir="$OUT/smollm2" steps=4 eval_every=0 \
    checkpoint_every=1000 progress=false 2>&1 | tail -20
$PY - "$OUT/smollm2" <<'EOF'
import json, sys, pathlib
d = pathlib.Path(sys.argv[1]); rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
for r in rows:
    print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()
           if k.startswith(("time/", "memory/")) or k in ("step", "reward", "tokens")})
EOF

echo "== 4. the suite without Ray, on CUDA"
timeout 200 $PY -m pytest -q -p no:cacheprovider -m "not ray and not gpu" -n 12 --timeout 90 \
    --continue-on-collection-errors -rf 2>&1 | tee "$OUT/suite.log" | grep -E "^(FAILED|ERROR)|passed|failed" | tail -40
