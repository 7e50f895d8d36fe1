"""The executor's worker: owns the model, the KV cache, the arena, the sampler and the kinds.

It applies what the core decided: phase changes (profile, warmup, capture, shutdown), kind
transitions (exit hook of the previous kind, enter hook of the next), and each step plan, and
answers with sampled tokens and a real memory report.
"""

from __future__ import annotations

import attrs
import structlog
import torch

from memstep.core.config import ConfigError, EngineConfig
from memstep.core.growth import StepWork
from memstep.core.host_memory import machine_bytes
from memstep.core.model_config import ModelConfig
from memstep.core.model_source import ModelSource, model_config, resolve
from memstep.core.sampling_params import SamplingParams
from memstep.core.shapes import rank_model_config
from memstep.events.plan import (
    MemoryPlan,
    PhaseFigures,
    PhaseReply,
    SeqPlan,
    SeqResult,
    StepPlan,
    StepResult,
)
from memstep.events.types import LeakSuspected, MemoryReport
from memstep.executors.cpu import kernels as cpu_kernels
from memstep.executors.cpu.features import has_native_bf16
from memstep.executors.model import kv_cache
from memstep.executors.model.llama import LlamaModel
from memstep.executors.model.rank_group import RankGroup
from memstep.executors.model.sharding import Shard
from memstep.executors.model.weights import gguf_converts_exactly, load_weights
from memstep.executors.runtime import memory
from memstep.executors.runtime.allocator import configure_cuda_allocator
from memstep.executors.runtime.guide import GrammarBook
from memstep.executors.runtime.host_allocator import HostTrim, bound_onednn_caches
from memstep.executors.runtime.leak_detector import LeakDetector
from memstep.executors.runtime.memory_plan import plan_memory, with_blocks
from memstep.executors.runtime.parts import ExecutorParts, StepDecoder
from memstep.executors.runtime.prompt_scorer import PromptScorer
from memstep.executors.runtime.runner import EagerRunner, Runner, ScoredForward
from memstep.executors.runtime.running_requests import RunningRequests
from memstep.executors.runtime.sampler import PendingLogprobs, Row, Sampler, to_device
from memstep.states.arena import Arena
from memstep.states.catalog import make_kinds
from memstep.states.kinds import KindEnv, Spec, StepOutputs
from memstep.states.lifecycle import Lifecycle, growth_of
from memstep.states.planted import refusal
from memstep.states.startup import Capture, Warmup

log = structlog.get_logger("memstep.executor")


def pick_device(cfg: EngineConfig) -> torch.device:
    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(cfg.device)


def pick_dtype(cfg: EngineConfig, device: torch.device) -> torch.dtype:
    """With "auto": bfloat16 on CUDA, float32 on the CPU, where q4's kernels multiply in float32
    (int8's take bf16 rows, on the CPU's native bf16 matmuls where it has them); bf16
    activations throughout are --dtype bfloat16."""
    if cfg.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, cfg.dtype)  # config.DTYPES names torch dtypes


def pick_quantization(cfg: EngineConfig, source: ModelSource, device: torch.device) -> str:
    """With "auto": q4 for a GGUF (of any dense family: `family_quantization` keeps it) whose
    decoder matrices all convert exactly into the C kernels' blocks (Q4_1 as the shipped
    SmolLM2, Q2_K to Q6_K, Q4_0, Q5_0, Q5_1, Q8_0: the K-quant mixes, Q4_0 and Q8_0 files;
    `gguf_converts_exactly`), on a CPU where `cpu_kernels` built, on one rank: the file's own
    codes, each weight gguf's float32 value, so the products are float32's up to rounding (the
    shipped file's greedy text equals float32's on the parity test's 8 prompts over 64 tokens,
    first-token log-prob error 2e-5 nats; 7 of 8 in bfloat16 products,
    `pick_matmul_precision`) at 2.4-4x float32's decode speed (benchmarks/bench_llamacpp.py);
    else none (float32 weights, a file's blocks dequantized)."""
    if cfg.quantization == "auto":
        path = source.path if source.kind == "gguf" else None
        exact = path is not None and gguf_converts_exactly(path)
        one_cpu = device.type == "cpu" and cfg.tensor_parallel_size == 1
        return "q4" if one_cpu and exact and cpu_kernels.available() else "none"
    if cfg.quantization != "none" and device.type != "cpu":
        raise ConfigError(f"quantization {cfg.quantization!r} runs on the CPU only, not {device}")
    if cfg.quantization == "q4" and not cpu_kernels.available():
        raise ConfigError("quantization 'q4' needs a C compiler (cc) to build its CPU kernels")
    return cfg.quantization


def family_quantization(cfg: EngineConfig, model: ModelConfig, picked: str, ranks: int) -> str:
    """`picked` for Llama's layers, and under "auto" for any dense family's too: a GGUF whose
    matrices all convert exactly runs them through the CPU backend's block linears, the rest
    of its layers as its backend runs them (the C step for Qwen2's and Qwen3's, torch for
    offset norms, GeGLU, windows). A
    mixture of experts gets "none" under "auto", said once (its experts are [E, rows, columns]
    tensors, which no block kernel multiplies: a GGUF's blocks are dequantized at load), and
    an int8 or q4 asked by name is a ConfigError there; a dense family's matrices take either
    as Llama's do. Tensor parallelism of a family whose layers differ (`unlike_llama`) is a
    ConfigError."""
    if not model.unlike_llama:
        return picked
    if ranks > 1:
        raise ConfigError(
            f"{model.architecture} runs on one rank: its {', '.join(model.unlike_llama)} "
            "have no tensor-parallel shards yet (--tensor-parallel-size 1)"
        )
    if picked != "none" and cfg.quantization != "auto" and model.is_moe:
        raise ConfigError(
            f"{cfg.quantization} quantizes 2-D matrices; {model.architecture}'s experts are "
            "3-D tensors that no block kernel multiplies (--quantization none)"
        )
    if model.is_moe and cfg.quantization == "auto":
        log.info(
            f"quantization auto: none for {model.architecture}, whose experts are 3-D tensors "
            "that no block kernel multiplies (a GGUF's blocks dequantized to float32)",
            family=model.architecture,
        )
        return "none"
    return picked


def pick_matmul_precision(cfg: EngineConfig, quantization: str) -> str:
    """q4's products: "bfloat16" where asked, or with "auto" where the kernels run them on the
    CPU's own bf16 dot products (AVX512-BF16) over a float32 KV cache (an fp8 cache already
    moves log-probs by up to 0.6 nats: with bf16 products too SmolLM2 no longer answered the
    CLI test's "What is the capital of France?" with Paris); else "float32". Only q4 has a
    choice."""
    if quantization != "q4":
        return "float32"
    if cfg.matmul_precision == "auto":
        native = cpu_kernels.native_bf16() and cfg.kv_cache_dtype == "auto"
        return "bfloat16" if native else "float32"
    return cfg.matmul_precision


class Worker:
    """One executor rank's worker. Under tensor parallelism (`ranks`) every rank runs the same
    plans on its shard of the model, in lock-step: the same phases, kinds and collectives, and
    each measures and watches its own memory."""

    def __init__(
        self,
        cfg: EngineConfig,
        max_model_len: int,
        ranks: RankGroup | None = None,
        *,
        parts: ExecutorParts,
    ):
        """`parts`: the device's and the speculative method's (executors/process/assemble.py
        `build_worker` picks them)."""
        self.parts = parts
        # every rank must decide alike whether a plan matches a replay ahead: off under TP
        self.cfg = cfg if ranks is None else cfg.replace(decode_ahead=False)
        self.ranks = ranks
        self.max_model_len = max_model_len
        self.device = pick_device(cfg)
        if why := refusal(cfg.debug_plant_leak, self.device.type):
            raise ConfigError(why)
        # before the first CUDA allocation: serving's changing sizes must not take new segments
        self.alloc_conf = configure_cuda_allocator() if self.device.type == "cuda" else ""
        self.held_before = held_on(self.device)  # another engine's, before this one's weights
        if ranks is not None and self.device.type == "cuda":
            self.device = ranks.gpu()  # cuda:<rank's GPU>, its NCCL group
        self.dtype = pick_dtype(cfg, self.device)
        self.kv_dtype = kv_cache.kv_dtype(cfg.kv_cache_dtype, self.dtype)
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        bound_onednn_caches()  # before the first matmul: their growth was the executor's RSS
        self.host_trim = HostTrim()
        self.meter = memory.LiveTensorMeter()
        if self.device.type == "cpu":
            self.meter.exclude_existing()  # before the weights: everything after is this worker's
        self.source = resolve(cfg.model, cfg.random_weights_seed, cfg.tokenizer)
        whole = model_config(self.source)
        size = 1 if ranks is None else ranks.size
        self.model_cfg = rank_model_config(whole, size)  # this rank's heads and MLP slice
        shard = Shard(whole, 0 if ranks is None else ranks.rank, size)
        self.quantization = family_quantization(
            cfg, whole, pick_quantization(cfg, self.source, self.device), size
        )
        if self.quantization != "none" and ranks is not None:
            raise ConfigError("quantized weights run on one rank: --tensor-parallel-size 1")
        self.matmul_precision = pick_matmul_precision(cfg, self.quantization)
        if self.matmul_precision == "bfloat16" and not cpu_kernels.native_bf16():
            log.warning(
                "bfloat16 products without AVX512-BF16: summed a product at a time, several "
                "times slower than --matmul-precision float32"
            )
        log.info(
            "precision",
            dtype=str(self.dtype).removeprefix("torch."),
            quantization=self.quantization,
            matmul_precision=self.matmul_precision,
            native_bf16=has_native_bf16() if self.device.type == "cpu" else None,
        )
        self.weights = load_weights(
            self.source, whole, self.dtype, self.device, shard, self.quantization
        )
        self.meter.adopt(list(self.weights.values()))
        bf16_products = self.matmul_precision == "bfloat16"
        backend = parts.backend(
            self.device, self.model_cfg, self.weights, self.kv_dtype, ranks is None, bf16_products
        )
        self.model = LlamaModel(self.model_cfg, self.weights, max_model_len + 16, backend, ranks)
        self.eagle = parts.eagle_head(cfg, self.model)
        if self.eagle is not None:
            self.meter.adopt(self.eagle.tensors())
        self.lifecycle = Lifecycle()
        eos = self.model_cfg.eos_token_ids
        self.grammars = GrammarBook(self.source, self.model_cfg.vocab_size, eos)
        self.grammars.prepare()
        self.requests = RunningRequests(self.grammars, eos)
        self.prompts = PromptScorer(self.model, self.requests, cfg.max_num_seqs, self.dtype)
        self.detector = LeakDetector(device_bytes(self.device), cfg.host_leak_tolerance_mib << 20)
        self._holdings: dict | None = None  # the kinds' holdings at the last leak report
        self.memory_plan: MemoryPlan | None = None
        self.spec: StepDecoder | None = None
        self.graphs: Runner | None = None  # CUDA: the decode graphs, built at capture
        self.steps: ScoredForward  # how steps run: eager from profile on, graphs after capture

    # --- phases ----------------------------------------------------------------------------

    def enter_phase(self, phase: str, step: int) -> PhaseReply:
        move = self.lifecycle.move(phase, step)
        figures = PhaseFigures()
        if phase == "profile":
            self.memory_plan = self._profile()
        elif phase == "warmup":
            warmup = self.lifecycle.kinds["warmup"]
            assert isinstance(warmup, Warmup)
            figures = self._warmup(warmup.dummy_hidden)
        elif phase == "capture":
            capture = self.lifecycle.kinds["capture"]
            assert isinstance(capture, Capture)
            captured = self.parts.capture(
                self.cfg,
                self.model,
                self.kv,
                self.sampler,
                self.max_model_len,
                capture,
                self.memory_plan,
            )
            if captured is not None:
                self.graphs, figures = captured
                self.steps.runner = self.graphs
            self.grammars.wait()  # (`GrammarBook.prepare`): built before serving's first step
            self.meter.freeze()  # start-up objects are done; measure only what serving creates
        elif phase == "shutdown":
            self.requests.clear()
            self.prompts.clear()
        memory_plan = self.memory_plan if phase == "profile" else None
        return PhaseReply(
            phase=phase,
            figures=figures,
            exited=move.exited,
            entered=move.entered,
            leaks=move.leaks,
            memory_plan=memory_plan,
        )

    def _profile(self) -> MemoryPlan:
        cfg, mc = self.cfg, self.model_cfg
        head_bytes = 0 if self.eagle is None else self.eagle.nbytes
        memory_plan = plan_memory(
            cfg,
            mc,
            self.max_model_len,
            self.model,
            self.dtype,
            self.kv_dtype,
            self.device,
            self.parts,
            head_bytes,
            self.held_before,
            free_on(self.device, self.held_before),
        )
        if self.ranks is not None:  # every rank holds the same pages: those that fit on each
            fitting = self.ranks.min_int(memory_plan.num_kv_blocks)
            memory_plan = with_blocks(memory_plan, fitting)
        slots = self.parts.draft_context(cfg)
        env = KindEnv(cfg, mc, self.dtype, memory_plan.num_kv_blocks, self.device.type, slots)
        kinds = make_kinds(env)
        self.lifecycle.install(kinds, Arena(memory_plan.arena_bytes, self.device))
        shape = (memory_plan.num_kv_blocks, cfg.block_size, mc.num_kv_heads, mc.head_dim)
        self.kv = kv_cache.allocate(mc.num_layers, shape, self.kv_dtype, self.device)
        self.steps = ScoredForward(EagerRunner(self.model, self.kv, cfg.block_size), self.prompts)
        rows = self.cfg.max_num_seqs * (self.cfg.num_lookahead_slots + 1)
        self.sampler = Sampler(
            rows,
            mc.vocab_size,
            self.device,
            self.model.logits_in_place,
            mask_threads=cfg.grammar_mask_threads,
        )
        if cfg.is_speculative:
            spec = kinds["spec"]
            assert isinstance(spec, Spec)
            self.spec = self.parts.spec_decoder(
                cfg,
                self.model,
                self.steps.forward,
                self.requests,
                self.sampler,
                spec,
                self.eagle,
                self.kv,
                self.weights,
                self.dtype,
                self.max_model_len,
            )
        total = 0
        if self.device.type == "cuda":
            total = torch.cuda.get_device_properties(self.device).total_memory
        memory_plan = attrs.evolve(
            memory_plan,
            allocator_conf=self.alloc_conf,
            device_total_bytes=total,
            grammar_cache_bytes=self.grammars.budget_bytes,
        )
        log.info("memory plan", **attrs.asdict(memory_plan))
        return memory_plan

    def _warmup(self, dummy_hidden: torch.Tensor) -> PhaseFigures:
        """Run the head once at the most rows, and the sampler, every filter on, at the batch
        sizes that meet all its allocations (`Sampler.warm_sizes`), from the warm-up kind's
        dummy batch ([max rows, hidden], seeded noise)."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        noise = torch.Generator(device=self.device).manual_seed(0)
        torch.randn(dummy_hidden.shape, generator=noise, out=dummy_hidden)
        most = self.sampler.max_rows
        dummy_logits = self.model.logits(dummy_hidden, self.sampler.logits_out(most))
        for rows in self.sampler.warm_sizes():
            logits = dummy_logits[:rows]
            sp = SamplingParams(temperature=0.7, top_p=0.9, top_k=50, min_p=0.01, seed=0)
            sample_rows = [Row(sp, 0, [], 0) for _ in range(rows)]
            self.sampler.sample(self.sampler.distribution(logits, sample_rows), sample_rows)
        if self.device.type != "cuda":
            return PhaseFigures()
        torch.cuda.synchronize()
        return PhaseFigures(measured_peak_bytes=torch.cuda.max_memory_allocated(self.device))

    # --- steps -----------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, step_plan: StepPlan) -> StepResult:
        move = self.lifecycle.move(step_plan.kind, step_plan.step)
        for request_id in step_plan.finished:
            self.requests.forget(request_id)
            self.prompts.forget(request_id)
            if self.spec is not None:
                self.spec.forget(request_id)
        admissions = {a.request_id: a for a in step_plan.admitted}
        for seq in step_plan.seqs:
            self.requests.update(seq, admissions.get(seq.request_id))
        if step_plan.kind == "spec" and self.spec is not None:
            results, hidden = self.spec.run(step_plan)
        else:
            results, hidden = self._run_plain(step_plan.seqs)
        failed = self.requests.failures([seq.request_id for seq in step_plan.seqs])
        results = [res for res in results if res.request_id not in failed]
        for res in results:
            self.requests.append(res.request_id, res.token_ids)
        self._masks_ahead(results)
        admitted = len(step_plan.admitted)
        self.lifecycle.kinds[step_plan.kind].after_step(
            StepOutputs(hidden, hidden.shape[0], admitted)
        )
        del hidden
        mem = self._measure()
        fed = sum(len(seq.token_ids) for seq in step_plan.seqs)
        work = StepWork(len(step_plan.seqs), fed, admitted)
        found = self.detector.observe(step_plan.step, step_plan.kind, mem, work)
        leaks = move.leaks + self._named(found)
        return StepResult(
            step=step_plan.step,
            kind=step_plan.kind,
            seqs=results,
            memory=mem,
            exited=move.exited,
            entered=move.entered,
            leaks=leaks,
            prompt_logprobs=self.prompts.take(),
            failed=failed,
        )

    def _masks_ahead(self, results: list[SeqResult]) -> None:
        """The next step's masks of the constrained requests that sampled, begun now: computed
        while the core plans that step (`Sampler.mask_ahead`); nothing where that is off."""
        if not self.sampler.masks_ahead:
            return
        states = [self.requests[res.request_id] for res in results]
        self.sampler.mask_ahead([s.row(0, s.tokens) for s in states if s.guide is not None])

    def _named(self, leaks: list[LeakSuspected]) -> list[LeakSuspected]:
        """Live-growth reports, with what the step kinds (and the prompt scorer's rows) hold
        that grew since the last."""
        if self._holdings is None or any(leak.what == "live_growth" for leak in leaks):
            before, self._holdings = self._holdings or {}, self.holdings()
            grew = growth_of(before, self._holdings)
            leaks = [
                attrs.evolve(leak, detail=f"{leak.detail}; grew: {grew}")
                if leak.what == "live_growth"
                else leak
                for leak in leaks
            ]
        return leaks

    def holdings(self) -> dict[str, tuple[int, int, str]]:
        """What the step kinds keep outside their arena buffers, and the prompt scorer's rows."""
        return self.lifecycle.holdings() | self.prompts.holdings()

    def forward(
        self, feeds: list[tuple[SeqPlan, list[int]]], ahead: bool = False
    ) -> tuple[torch.Tensor, list[int]]:
        """`ScoredForward.forward`: hidden states and each feed's last row."""
        return self.steps.forward(feeds, ahead)

    def sample_rows(self, seqs: list[SeqPlan]) -> list[Row]:
        rows = []
        for seq in seqs:
            req = self.requests[seq.request_id]
            rows.append(req.row(len(req.tokens), req.tokens))
        return rows

    def _run_plain(self, seqs: list[SeqPlan]) -> tuple[list[SeqResult], torch.Tensor]:
        feeds = [(seq, seq.token_ids) for seq in seqs]
        ahead = self.graphs is not None and self.cfg.decode_ahead
        hidden, last_rows = self.forward(feeds, ahead)
        sampled = [seq for seq in seqs if seq.samples]
        picked = [row for seq, row in zip(seqs, last_rows, strict=True) if seq.samples]
        # a decode step picks rows 0..n-1: a slice; other rows through an index the host sends
        # without waiting (a list index would wait for the device)
        if picked == list(range(len(picked))):
            h = hidden[: len(picked)]
        else:
            h = hidden.index_select(0, to_device(picked, hidden.device, torch.int64))
        if not sampled:
            return [], h
        logits = self.model.logits(h, self.sampler.logits_out(len(picked)))
        rows = self.sample_rows(sampled)
        want_logprobs = max(row.params.logprobs for row in rows)
        raw = self.sampler.keep_raw(logits) if want_logprobs else None
        pending = self.sampler.sample_logits(logits, rows)
        figures = PendingLogprobs(raw, pending.device, want_logprobs) if raw is not None else None
        # replay the decode step after this one's sampling sequences while the core records
        if ahead:
            self.steps.runner.run_ahead([(seq, seq.token_ids) for seq in sampled], pending)
        device_tokens = pending.host.values()
        tokens = pending.settle(device_tokens)
        logprobs = figures.rows(tokens, device_tokens) if figures is not None else None
        results = []
        for i, (seq, tok) in enumerate(zip(sampled, tokens, strict=True)):
            lp = [logprobs[i]] if logprobs is not None and rows[i].params.logprobs else []
            results.append(
                SeqResult(
                    request_id=seq.request_id,
                    token_ids=[tok],
                    logprobs=lp,
                    num_proposed=0,
                    num_accepted=0,
                )
            )
        return results, h

    def _measure(self) -> MemoryReport:
        if self.ranks is not None and self.device.type == "cpu":
            self.ranks.settle()
        figures = memory.measure(self.device, self.meter)
        used = 0  # pages in use are the core's knowledge; it fills this in
        return MemoryReport(
            live_bytes=figures["live_bytes"],
            reserved_bytes=figures["reserved_bytes"],
            num_segments=figures["num_segments"],
            num_allocs=figures["num_allocs"],
            arena_claimed_bytes=self.lifecycle.claimed_bytes,
            kv_pages_used=used,
            executor_rss_bytes=self.host_trim.measure(),
            grammar_cache_bytes=self.grammars.num_bytes,
        )


def held_on(device: torch.device) -> int:
    """What this process's tensors already hold on CUDA `device` (another engine's); 0 on the
    CPU.  Allocated, not reserved: blocks an engine freed but the allocator still caches are
    this one's to reuse, and a replay after a recording in one process plans as it did."""
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def free_on(device: torch.device, held_before: int) -> int | None:
    """What this engine may have of the device: its free memory (the caching allocator's unused
    blocks given back first) and what this engine holds already (its weights), for a plan
    beside another engine; None on the CPU."""
    if device.type != "cuda":
        return None
    torch.cuda.empty_cache()
    own = torch.cuda.memory_allocated(device) - held_before
    return torch.cuda.mem_get_info(device)[0] + own


def device_bytes(device: torch.device) -> int:
    """The memory a slope on `device` is projected to: the card's, or the machine's for the CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return machine_bytes()
