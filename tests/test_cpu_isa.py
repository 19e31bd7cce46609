"""One CPU feature set decides every CPU-specific choice (``rollyard.model.cpu``), ``ROLLYARD_CPU_ISA``
narrows it, and the kernel cache is keyed by what a library is built from."""

import ctypes.util
import shutil

import pytest

from rollyard.model import cpu
from rollyard.model import gemm as cpu_gemm
from rollyard.model import kernels as cpu_kernels

AVX512_BF16 = frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"})
AVX2 = frozenset({"avx2", "fma"})


@pytest.fixture
def machine(monkeypatch):
    """Pretend the CPU reports a given feature set (x86-64)."""
    def set_(features: frozenset[str]):
        monkeypatch.setattr(cpu, "reported", lambda: features)
        monkeypatch.setattr(cpu.platform, "machine", lambda: "x86_64")
    return set_


def test_an_avx512_bf16_machine_chooses_by_its_features(machine, monkeypatch):
    machine(AVX512_BF16)
    monkeypatch.delenv("ROLLYARD_CPU_ISA", raising=False)
    assert cpu.avx512() and cpu.native_bf16() and cpu.onednn_bf16()
    assert cpu_gemm.cpu_has_avx512() and cpu_gemm.cpu_has_native_bf16()
    assert cpu.cpu_class() == "avx512-bf16" and cpu.march() == "native"


@pytest.mark.parametrize("isa, cls, march, avx512, bf16", [
    ("avx512", "avx512 (narrowed by ROLLYARD_CPU_ISA=avx512)", "x86-64-v4", True, False),
    ("avx2", "avx2 (narrowed by ROLLYARD_CPU_ISA=avx2)", "x86-64-v3", False, False),
    ("generic", "x86-64 (narrowed by ROLLYARD_CPU_ISA=generic)", "x86-64-v2", False, False),
])
def test_the_setting_narrows_an_avx512_machine(machine, monkeypatch, isa, cls, march, avx512, bf16):
    machine(AVX512_BF16)
    monkeypatch.setenv("ROLLYARD_CPU_ISA", isa)
    assert cpu.avx512() is avx512 and cpu.native_bf16() is bf16 and cpu.onednn_bf16() is avx512
    assert cpu_gemm.cpu_has_avx512() is avx512 and cpu_gemm.cpu_has_native_bf16() is bf16
    assert cpu.cpu_class() == cls and cpu.march() == march
    assert cpu_kernels.choices()["kernels_march"] == march


def test_narrowing_never_adds_a_feature(machine, monkeypatch):
    machine(AVX2)
    monkeypatch.setenv("ROLLYARD_CPU_ISA", "avx512")
    assert not cpu.avx512() and cpu.features() == AVX2
    assert cpu.cpu_class() == "avx2" and cpu.march() == "native"  # nothing removed: built for this CPU


def test_a_cpu_whose_features_cannot_be_read_takes_every_fallback(monkeypatch):
    monkeypatch.setattr(cpu, "reported", lambda: frozenset())
    monkeypatch.setattr(cpu.platform, "machine", lambda: "aarch64")
    monkeypatch.delenv("ROLLYARD_CPU_ISA", raising=False)
    assert not cpu.avx512() and not cpu.native_bf16() and not cpu.onednn_bf16()
    assert cpu.cpu_class() == "aarch64" and cpu.march() == "native"


def test_a_bad_setting_is_one_line_exit_2(monkeypatch, tmp_path, capsys):
    from rollyard.cli import main

    monkeypatch.setenv("ROLLYARD_CPU_ISA", "avx9000")
    with pytest.raises(ValueError, match="ROLLYARD_CPU_ISA must be one of native, avx512, avx2, generic: got 'avx9000'"):
        cpu.features()
    assert main(["train", "steps=1", f"out_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "ROLLYARD_CPU_ISA" in err[0] and "avx9000" in err[0], err
    assert not (tmp_path / "run").exists()


def test_the_build_key_follows_what_the_library_is_built_from(monkeypatch, tmp_path):
    flags = ["-O3", "-march=native", "-fopenmp"]
    base = cpu_kernels.build_key(flags)
    assert cpu_kernels.build_key(list(flags)) == base  # deterministic
    assert cpu_kernels.build_key(["-O3", "-march=x86-64-v3", "-fopenmp"]) != base  # flags
    edited, original = tmp_path / "kernels.cc", cpu_kernels._SOURCE.read_bytes()
    edited.write_bytes(original + b"\n// another version of rollyard\n")
    monkeypatch.setattr(cpu_kernels, "_SOURCE", edited)
    assert cpu_kernels.build_key(flags) != base  # the source
    edited.write_bytes(original)
    assert cpu_kernels.build_key(flags) != base  # the same version in another checkout (its path is on the build's line)
    monkeypatch.undo()
    monkeypatch.setattr(cpu_kernels.torch, "__version__", "0.0.1-other")
    assert cpu_kernels.build_key(flags) != base  # torch's version
    monkeypatch.undo()
    monkeypatch.setattr(cpu_kernels.torch, "__file__", str(tmp_path / "another-venv" / "torch" / "__init__.py"))
    assert cpu_kernels.build_key(flags) != base  # another environment's torch (its headers and libraries)
    monkeypatch.undo()
    monkeypatch.setenv("CXX", "/no/such/compiler")
    assert cpu_kernels.build_key(flags) != base  # the compiler


@pytest.mark.skipif(not ctypes.util.find_library("m"), reason="needs the C math library (libm) as a foreign library")
def test_a_library_missing_a_symbol_is_rebuilt_not_half_loaded(monkeypatch, capsys):
    """The build directory holds a library that is not this source's (here libm: none of the symbols): it is
    rebuilt once and the rebuilt one is used, never the half that loaded."""
    calls = []
    foreign = ctypes.util.find_library("m")

    def compile_(rebuild: bool = False):
        calls.append(rebuild)
        return foreign if not rebuild else real

    if not shutil.which("c++") and not shutil.which("g++"):
        pytest.skip("needs a C++ compiler to build the kernels")
    real = cpu_kernels._compile()
    monkeypatch.setattr(cpu_kernels, "_STATE", {})
    monkeypatch.setattr(cpu_kernels, "_compile", compile_)
    monkeypatch.setenv("ROLLYARD_CPU_KERNELS", "auto")
    lib = cpu_kernels.kernel()
    assert calls == [False, True]
    assert lib is not None and hasattr(lib, "rollyard_decode_attn_f32")
    assert "not used" not in capsys.readouterr().err


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_benches_matmul_limit_runs_on_this_cpu_class(precision, monkeypatch):
    """``bench/real_model.py`` and ``bench/vs_trl.py`` report against ``bench/engine.py:matmul_flops``: it
    runs on every CPU class (on AVX2 oneDNN's bf16 primitive does not exist and is not called), in the
    suite's plain run and again in CI's narrowed leg (``ROLLYARD_CPU_ISA``)."""
    import sys
    from pathlib import Path

    import torch

    bench = Path(__file__).resolve().parents[1] / "bench"
    monkeypatch.syspath_prepend(str(bench))
    sys.modules.pop("engine", None)
    import real_model

    threads = torch.get_num_threads()
    try:
        rate = real_model.matmul_rate(precision, threads, size=96)  # small: emulated bf16 is slow on AVX2
    finally:
        torch.set_num_threads(threads)
    assert rate > 0, rate  # it ran, on kernels this CPU has (oneDNN's bf16 on AVX2 raised before)


def test_the_bench_prices_a_widened_bf16_rollout_at_the_fp32_rate(tmp_path, monkeypatch):
    """A bf16 rollout on a CPU without native bf16 runs the compiled kernels' widening matmul (bf16 weights, fp32
    FMAs): run.json says so, and ``bench/real_model.py`` holds that rollout's compute to the fp32 matmul rate, not to
    torch's emulated bf16 rate (~5x lower here, which priced the roofline above the measured rollout). With native
    bf16 (vdpbf16ps), or no kernel (torch's bf16), the arithmetic is bf16."""
    import json
    from pathlib import Path

    from rollyard.cli import main
    from rollyard.model import cpu
    from rollyard.model import kernels as cpu_kernels

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    import real_model

    run = tmp_path / "run"
    args = ["model.context=48", "data.train_size=16", "data.eval_size=4", "rollout.prompts_per_step=2",
            "rollout.samples_per_prompt=2", "sft.auto=false", "progress=false", "reward.num_workers=1",
            "log.plots=false", "steps=1", "rollout.precision=bf16", f"out_dir={run}"]
    assert main(["train", *args]) == 0
    info = json.loads((run / "run.json").read_text())
    said = info["kernels"]["bf16_matmul"]
    assert info["rollout_precision"] == "bf16"
    if cpu_kernels.bf16_packs(64, 32) and not cpu.native_bf16():
        assert "widened to fp32" in said and real_model.rollout_arithmetic(info) == "fp32"
    else:
        assert "widened" not in said and real_model.rollout_arithmetic(info) == "bf16"
    fp32_run = dict(info, rollout_precision="fp32")
    assert real_model.rollout_arithmetic(fp32_run) == "fp32"
