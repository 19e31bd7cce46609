"""Issue 44's probes: nothing a checkpoint holds can run, a full disk is one line, nothing listens beyond
the machine, a tool's output is bounded. Each test plants the attack or the failure for real."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch

from rollyard import checkpoint
from rollyard.cli import main
from rollyard.telemetry import rundir

TINY = ["model.context=48", "data.train_size=32", "data.eval_size=4", "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=2", "rollout.max_new_tokens=4", "sft.auto=false", "progress=false",
        "reward.num_workers=1", "log.plots=false"]


def _one_line_exit_2(capsys, args: list[str]) -> str:
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"rollyard {args[0]}: error:") and "Traceback" not in err[0], err
    return err[0]


class _Planted:
    """What an attacker puts in a checkpoint: unpickling it calls os.system (creates ``marker``)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _plant(ckpt: Path, name: str, marker: Path) -> None:
    """Replace ``ckpt/name`` with a pickle that runs code, keeping the real content beside it, and update
    the manifest's size and SHA-256 the way an attacker would (the manifest has no key)."""
    real = torch.load(ckpt / name, weights_only=True)
    torch.save({**real, "planted": _Planted(marker)} if isinstance(real, dict) else _Planted(marker), ckpt / name)
    manifest = json.loads((ckpt / checkpoint.MANIFEST).read_text())
    manifest[name] = checkpoint._fingerprint(ckpt / name)
    (ckpt / checkpoint.MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize("name", [checkpoint.RNG, checkpoint.OPTIM])
def test_a_planted_checkpoint_file_is_refused_and_nothing_runs(tmp_path, capsys, name):
    run, marker = tmp_path / "run", tmp_path / "pwned"
    assert main(["train", *TINY, "steps=1", "checkpoint_every=1", f"out_dir={run}"]) == 0
    ckpt = checkpoint.latest(run)
    _plant(ckpt, name, marker)
    assert checkpoint.verify(ckpt) is None  # the manifest is no defence: the planted file matches it
    line = _one_line_exit_2(capsys, ["train", "--resume", str(run), "steps=2"])
    assert f"refused to load {ckpt / name}" in line and "posix.system" in line and "nothing from it was run" in line
    assert not marker.exists()
    # the same file under the old loader (weights_only=False) would have run: the probe is live
    torch.load(ckpt / name, weights_only=False)
    assert marker.exists()


def _steps_recorded(run: Path) -> list[int]:
    return [r["step"] for r in rundir.read_jsonl(run / rundir.METRICS) if isinstance(r.get("step"), int)
            and "loss" in r]


def _full_disk_line_then_resume(capsys, run: Path, free_space) -> None:
    """The run stops at step 2's checkpoint with one line; nothing half-written stays; step 1's
    checkpoint is intact; after ``free_space()`` the resume finishes with every step trained once."""
    line = _one_line_exit_2(capsys, ["train", *TINY, "steps=3", "checkpoint_every=1", f"out_dir={run}"])
    root = run / rundir.CHECKPOINTS
    assert "the disk is full: checkpoint step 2 needs about" in line and f"under {root}" in line, line
    assert "is free" in line and f"resume from step_000001 with --resume {run}" in line
    assert sorted(p.name for p in root.iterdir()) == ["step_000001"]  # no step_000002.tmp left behind
    assert checkpoint.verify(root / "step_000001") is None
    free_space()
    assert main(["train", "--resume", str(run)]) == 0
    assert checkpoint.latest(run).name == "step_000003"
    assert _steps_recorded(run) == [0, 1, 2]  # nothing lost, nothing trained twice


def test_a_full_disk_at_a_checkpoint_is_one_line_and_resume_continues(tmp_path, capsys, monkeypatch):
    import faults
    faults.disk_fills_after(monkeypatch, saves=2)  # step 1's checkpoint (optimizer.pt, rng.pt) fits, step 2's not
    _full_disk_line_then_resume(capsys, tmp_path / "run", monkeypatch.undo)


def test_a_full_tmpfs_at_a_checkpoint_is_one_line_and_resume_continues(tmp_path, capsys):
    """The real thing: the run directory on a tmpfs that fills up between two checkpoints."""
    import subprocess
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(mnt)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root (and a kernel that allows it here); the injected full disk "
                    "above covers the same path")
    try:
        run = mnt / "run"
        assert main(["train", *TINY, "steps=1", "checkpoint_every=1", f"out_dir={mnt / 'probe'}"]) == 0
        one = sum(f.stat().st_size for f in (mnt / "probe" / rundir.CHECKPOINTS).rglob("*") if f.is_file())
        subprocess.run(["rm", "-rf", str(mnt / "probe")], check=True)
        # room for the run's records and one checkpoint and a half: the second checkpoint does not fit
        filler = mnt / "filler"
        free = os.statvfs(mnt).f_bavail * os.statvfs(mnt).f_frsize
        filler.write_bytes(b"\0" * (free - int(1.5 * one) - (256 << 10)))
        _full_disk_line_then_resume(capsys, run, filler.unlink)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


# ------------------------------------------------------------------ nothing listens beyond the machine
class _Listening:
    """Every listening TCP socket of this process's tree (itself, its children and theirs), sampled every
    0.25 s from a thread while a run goes on: ``(address, port, process name)``."""

    def __init__(self):
        import threading
        self.seen: set[tuple[str, int, str]] = set()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        import psutil
        me = psutil.Process()
        while not self.done.is_set():
            tree = {me.pid}
            try:
                tree |= {c.pid for c in me.children(recursive=True)}
            except psutil.Error:
                pass
            for c in psutil.net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN and c.pid in tree:
                    try:
                        name = psutil.Process(c.pid).name()
                    except psutil.Error:
                        name = "?"
                    self.seen.add((c.laddr.ip, c.laddr.port, name))
            self.done.wait(0.25)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()


def _beyond_loopback(seen) -> list:
    import ipaddress
    def loopback(ip: str) -> bool:
        ip = ip.removeprefix("::ffff:")
        return ipaddress.ip_address(ip).is_loopback
    return sorted(s for s in seen if not loopback(s[0]))


@pytest.mark.skipif(os.geteuid() != 0 and not Path("/proc/net/tcp").exists(), reason="needs /proc/net/tcp")
def test_a_dp2_run_listens_on_loopback_only(tmp_path):
    with _Listening() as probe:
        assert main(["train", *TINY, "steps=1", "trainer.dp=2", "trainer.micro_batch_tokens=64",
                     f"out_dir={tmp_path / 'run'}"]) == 0
    assert probe.seen, "the probe saw no listening socket at all: it cannot have seen the dp store"
    assert _beyond_loopback(probe.seen) == [], _beyond_loopback(probe.seen)


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.usefixtures("ray_session")
def test_an_async_run_listens_on_loopback_only(tmp_path):
    """The run's own Ray session (GCS, raylet, agents, workers: children of this process), the trainer's
    sync store and gloo: everything the run listens on, sampled while it runs."""
    with _Listening() as probe:
        assert main(["train", *TINY, "steps=1", "placement=async", "sync.transport=dist",
                     f"out_dir={tmp_path / 'run'}"]) == 0
    names = {s[2] for s in probe.seen}
    assert "gcs_server" in names and "raylet" in names, names  # the probe saw Ray's own services
    assert _beyond_loopback(probe.seen) == [], _beyond_loopback(probe.seen)


def _machine_addresses() -> list[str]:
    import ipaddress

    import psutil
    return [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
            if a.family.name == "AF_INET" and not ipaddress.ip_address(a.address).is_loopback]


@pytest.mark.ray
@pytest.mark.usefixtures("ray_session")
def test_the_gcs_refuses_a_wrong_or_missing_token_and_the_network():
    """What the probe did from outside (a client that knows the GCS address) is refused: by the network
    (nothing listens on the machine's addresses) and by Ray's token check (wrong or no token on loopback)."""
    import socket

    import grpc
    import ray
    try:
        from ray._raylet import AuthenticationTokenLoader  # noqa: F401 - only whether this Ray has token auth
    except ImportError:
        pytest.skip(f"Ray {ray.__version__} has no token authentication (the GCS is on loopback only)")
    from ray.core.generated import gcs_service_pb2 as pb
    from ray.core.generated import gcs_service_pb2_grpc as pbg

    gcs = ray.get_runtime_context().gcs_address
    host, port = gcs.rsplit(":", 1)
    assert host == "127.0.0.1", gcs
    for ip in _machine_addresses():
        with pytest.raises(ConnectionRefusedError), socket.create_connection((ip, int(port)), timeout=5):
            pass
    stub = pbg.InternalKVGcsServiceStub(grpc.insecure_channel(gcs))

    def keys(token: str | None):
        md = [("authorization", f"Bearer {token}")] if token is not None else []
        return stub.InternalKVKeys(pb.InternalKVKeysRequest(prefix=b""), metadata=md, timeout=20)

    for token in ("0" * 64, None):
        with pytest.raises(grpc.RpcError) as refused:
            keys(token)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, refused.value
    assert keys(os.environ["RAY_AUTH_TOKEN"]).status.code == 0  # the run's own token: the probe reaches the GCS


# ----------------------------------------------------------------------------- bounded tool output
def test_a_tool_that_prints_and_returns_too_much_is_cut_said_counted_and_kept_off_the_console(capfd):
    from rollyard.env import tools
    from rollyard.env.executor import Job, ToolExecutor
    from rollyard.model.loading import char_tokenizer

    tok = char_tokenizer()
    specs = tools.tool_specs(["tool_loud:loud"])
    with ToolExecutor(specs, num_workers=1, timeout_s=60.0, max_output_bytes=5000, max_output_tokens=300,
                      tokenizer=tok) as ex:
        capfd.readouterr()
        (job,) = ex.run([Job(1, "call", "s", "loud", {"mb": 2})])
        assert job.status == "ok", job.value
        out = job.value
        # cut to 5000 bytes in the worker (a note of ~55 characters), then to 300 tokens here (char tokenizer)
        assert out.startswith("RETURNED rrr") and re.search(r"\[tool output cut: 50\d\d tokens, the first 300 kept\]$", out)
        assert len(tok(out, add_special_tokens=False)["input_ids"]) < 400
        assert ex.stats["cut"] == 1
        assert ex.stats["printed_bytes"] >= 2 << 20  # every byte printed is counted ...
        assert job.printed.startswith("PRINTED ppp") and len(job.printed.encode()) <= 4096  # ... the head kept
        seen = capfd.readouterr()
        assert "PRINTED" not in seen.out + seen.err and "FD-LEVEL" not in seen.out + seen.err  # not on the console
        # the bytes cap alone (no tokenizer): the note names the size before the cut
        (fd,) = ex.run([Job(2, "call", "s", "loud", {"mb": 0})])
        assert fd.printed.startswith("PRINTED") and "FD-LEVEL WRITE" in fd.printed  # fd 1 writes are captured too
    with ToolExecutor(specs, num_workers=1, timeout_s=60.0, max_output_bytes=5000) as ex:
        (job,) = ex.run([Job(1, "call", "s", "loud", {"mb": 1})])
        assert job.value.endswith(f"[tool output cut: {len('RETURNED ') + (10 << 20)} bytes, the first 5000 kept]")
        assert len(job.value.encode()) < 5100 and ex.stats["cut"] == 1


# ------------------------------------------------------------------------------ tidy: one line each
@pytest.mark.parametrize("text,where", [("steps: 3\nmodel:\n  name: [tiny\n", "line 4, column 1"),
                                        ("a: 1\n b: 2\n", "line 2, column 3")])
def test_a_yaml_error_is_one_line_with_its_place(tmp_path, capsys, text, where):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(text)
    line = _one_line_exit_2(capsys, ["train", "--config", str(cfg)])
    assert f"config file {cfg} does not parse:" in line and where in line and line.endswith("fix it there")


def test_a_fifo_is_not_a_regular_file_and_nothing_blocks_on_it(tmp_path, capsys):
    fifo = tmp_path / "data.jsonl"
    os.mkfifo(fifo)
    line = _one_line_exit_2(capsys, ["train", *TINY, f"data.path={fifo}", "steps=1", f"out_dir={tmp_path / 'r'}"])
    assert "not a regular file (a FIFO)" in line and "no such dataset file" not in line
    line = _one_line_exit_2(capsys, ["train", "--config", str(fifo)])
    assert "is not a regular file (a FIFO)" in line


def test_a_killed_gguf_conversions_directory_is_swept_by_the_next_run(tmp_path, monkeypatch):
    import socket
    import subprocess
    import sys

    pytest.importorskip("gguf", reason="the gguf package (rollyard[gguf]) converts GGUF files")
    from gguf_files import bpe_tokenizer, tiny_llama, write_gguf

    from rollyard.model import gguf

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a process that is gone, as one killed mid-conversion is
    cache = tmp_path / "cache"
    monkeypatch.setenv("ROLLYARD_GGUF_CACHE", str(cache))
    host = socket.gethostname()
    stale = [cache / f"0123456789abcdef.tmp{dead.pid}@{host}", cache / f"0123456789abcdef.tmp{dead.pid}"]
    kept = [cache / f"0123456789abcdef.tmp{os.getpid()}@{host}",  # alive: a conversion in progress
            cache / f"0123456789abcdef.tmp{dead.pid}@another-host"]  # a shared cache: not this host's to judge
    for d in stale + kept:
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(b"\0" * 4096)
    tok = bpe_tokenizer()
    out = Path(gguf.resolve(str(write_gguf(tiny_llama(tok), tok, tmp_path / "tiny.gguf"))))
    assert (out / "config.json").exists()
    assert not any(d.exists() for d in stale) and all(d.exists() for d in kept)


def test_a_sigterm_in_the_last_step_still_exports_the_model(tmp_path):
    import subprocess
    import sys

    import faults
    run = tmp_path / "run"
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1",
           "ROLLYARD_FAULT_DIR": str(tmp_path), "ROLLYARD_FAULT_AT": str(4 + 4 * 1 + 2)}  # 4 eval calls, then 4/step
    proc = subprocess.run([sys.executable, "-m", "rollyard.cli", "train", *TINY, "steps=2", "checkpoint_every=10",
                           f"reward.hook={faults.HOOKS}:term_trainer", "reward.correctness=true", f"out_dir={run}"],
                          env=env, capture_output=True, text=True, timeout=300, check=False)
    assert "SIGTERM received" in proc.stderr, proc.stderr[-2000:]  # the signal came, in step 1 (the last)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert (run / rundir.MODEL / "model.safetensors").is_file() and (run / rundir.SUMMARY).is_file()
    assert checkpoint.latest(run).name == "step_000002"


@pytest.mark.parametrize("setting", ["auto", "bf16"])
def test_the_start_up_line_and_run_json_name_the_precision_and_why(tmp_path, capsys, setting):
    from rollyard.model import cpu
    run = tmp_path / "run"
    assert main(["train", *TINY, "steps=1", f"trainer.precision={setting}", f"out_dir={run}"]) == 0
    out = capsys.readouterr().out
    info = json.loads((run / rundir.RUN_INFO).read_text())
    said = [ln for ln in out.splitlines() if ln.startswith("trainer precision ")]
    assert len(said) == 1 and info["precision"] in ("fp32", "bf16") and info["precision_reason"] in said[0]
    emulated = "bf16 is emulated and slower than fp32"
    if setting == "auto":  # the tiny preset: fp32 whatever the CPU, and the reason says which rule
        assert info["precision"] == "fp32" and info["precision_reason"].startswith("auto: fp32")
        assert emulated not in out
    else:
        assert info["precision"] == "bf16"
        assert (emulated in said[0]) == (not cpu.native_bf16())  # once, only where bf16 is not native
        assert out.count(emulated) == (0 if cpu.native_bf16() else 1)


def test_a_tool_worker_gets_no_key_to_the_runs_ray_session(monkeypatch):
    from rollyard.env import tools
    from rollyard.env.executor import Job, ToolExecutor

    monkeypatch.setenv("RAY_AUTH_TOKEN", "f" * 64)  # what cluster.connect puts in the driver's environment
    with ToolExecutor(tools.tool_specs(["tool_loud:ray_token"]), num_workers=1, timeout_s=30.0) as ex:
        (job,) = ex.run([Job(1, "call", "s", "ray_token", {})])
    assert (job.status, job.value) == ("ok", "none")
