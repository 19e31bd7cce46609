"""cpu_memory: freed blocks are reused from the heap instead of being faulted in again; every
ROLLYARD_* setting is checked: a bad one is one line and exit 2 from the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# Each round allocates and fills three 12 MiB tensors, then frees them; minor page faults are
# counted over ten rounds after three warm-up rounds. glibc starts with a 128 KiB mmap threshold and
# moves it up as mmap-ed blocks are freed, so whether its defaults fault again depends on the process's
# history; the comparison run pins the starting threshold (MALLOC_MMAP_THRESHOLD_), where every round
# maps and faults the 36 MiB in again. With the thresholds set the heap's blocks are reused (a stray small
# allocation can still make the heap grow now and then, hence a bound rather than zero).
_SCRIPT = """
import json, resource, torch
from rollyard.model.memory import keep_freed_memory
done = keep_freed_memory()
def rnd():
    ts = [torch.empty(3 << 20).fill_(1.0) for _ in range(3)]
    del ts
for _ in range(3):
    rnd()
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    rnd()
print(json.dumps({"done": done, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0}))
"""


def _faults(flag: str) -> dict:
    env = {**os.environ, "ROLLYARD_KEEP_FREED": flag}
    if flag == "0":
        env["MALLOC_MMAP_THRESHOLD_"] = str(128 << 10)  # glibc's starting threshold, held (see above)
    out = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc tuning")
def test_freed_blocks_are_reused_without_page_faults():
    kept, default = _faults("1"), _faults("0")
    assert kept["done"] and not default["done"]
    pages = 10 * 3 * (12 << 20) // 4096  # what faulting every page in again costs
    assert default["faults"] > pages // 2, default
    assert kept["faults"] < pages // 4, kept


# Fragments: 400 one-MiB blocks filled, every other one freed (the kept ones pin the heap, so its top cannot
# shrink); the 200 MiB of holes stay resident until release_freed_memory hands their pages back.
_TRIM = """
import json, re, torch
from rollyard.model.memory import keep_freed_memory, release_freed_memory
def rss():
    return int(re.search(r"VmRSS:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) << 10
keep_freed_memory()
ts = [torch.empty(1 << 18).fill_(1.0) for _ in range(400)]
del ts[::2]
before = rss()
kept_under_bound = not release_freed_memory(above=1 << 30)  # 200 MiB free: under the bound, the pages stay
stayed = before - rss()
done = release_freed_memory(above=100 << 20)  # over this one: trimmed
print(json.dumps({"done": done, "released": before - rss(), "kept": len(ts), "kept_under_bound": kept_under_bound,
                  "stayed": stayed}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc tuning")
def test_release_hands_the_kept_heaps_free_pages_back():
    out = subprocess.run([sys.executable, "-c", _TRIM], env={**os.environ, "ROLLYARD_KEEP_FREED": "1"},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["done"] and got["kept"] == 200
    assert got["released"] > 150 << 20, got  # most of the 200 MiB of holes
    assert got["kept_under_bound"] and got["stayed"] < 20 << 20, got  # a switch under the bound trims nothing


@pytest.mark.parametrize("name, value, rule, reader", [
    ("ROLLYARD_ONEDNN", "yes", "ROLLYARD_ONEDNN must be one of 0, 1, auto: got 'yes'", "rollyard.model.gemm:enabled"),
    ("ROLLYARD_KEEP_FREED", "on", "ROLLYARD_KEEP_FREED must be one of 0, 1: got 'on'",
     "rollyard.model.memory:keep_freed_memory"),
    ("ROLLYARD_HUGE_PAGES", "yes", "ROLLYARD_HUGE_PAGES must be one of 0, 1: got 'yes'",
     "rollyard.model.hugepages:advised"),
    ("ROLLYARD_CPU_KERNELS", "fast", "ROLLYARD_CPU_KERNELS must be one of 0, 1, auto: got 'fast'",
     "rollyard.model.kernels:kernel"),
])
def test_bad_env_setting_is_one_line_exit_2(monkeypatch, capsys, name, value, rule, reader):
    import importlib

    from rollyard.cli import main

    monkeypatch.setenv(name, value)
    assert main(["train", "steps=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and rule in err
    module, fn = reader.split(":")
    with pytest.raises(ValueError, match=name):
        getattr(importlib.import_module(module), fn)()
