"""Frozen engine configuration.

What the user asks for lives here and never changes after start-up.  What the engine measures
(KV pages, arena size) is returned by the profiler as a separate `MemoryPlan`, never written back.
"""

from __future__ import annotations

import warnings
from functools import cached_property
from typing import Any

import attrs

from memstep.core.spec_tree import MAX_TREE_NODES, tree_size

SPECULATIVE_METHODS = (None, "ngram", "draft", "eagle")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
KV_CACHE_DTYPES = ("auto", "fp8")
# weight-only quantized matmuls on the CPU; "auto": q4 for a GGUF (its Q4_1 codes as shipped)
QUANTIZATIONS = ("auto", "none", "int8", "q4")
# q4's products on the CPU: float32, or x's rows and the weights rounded to bfloat16 and summed in
# float32 (the CPU's AVX512-BF16 dot products); "auto": bfloat16 where the CPU has them
MATMUL_PRECISIONS = ("auto", "float32", "bfloat16")
# states/planted.py makes each
PLANTED_LEAKS = (
    "no_spec_hidden_states",
    "spec_holder_hidden_states",
    "sampler_scratch",
    "fragmenting_scratch",
    "executor_host_bytes",
    "executor_host_bytes_slow",
    "executor_python_objects",
    "tensor_every_100_steps",
)


# memstep's former names of settings that vLLM names otherwise: old -> vLLM's
RENAMED = {"memory_utilization": "gpu_memory_utilization"}


class ConfigError(ValueError):
    """A configuration value is out of range or inconsistent."""


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


@attrs.frozen(kw_only=True)
class EngineConfig:
    """Everything the engine is started with; replay rebuilds an engine from `to_dict()`."""

    model: str = "smollm2"
    tokenizer: str | None = None  # a tokenizer.json or .gguf instead of the model's own
    # requests' sampling defaults: "auto", the model's (core/generation_config.py); "vllm",
    # SamplingParams' bare ones; or a folder holding a generation_config.json
    generation_config: str = "auto"
    chat_template: str | None = None  # a Jinja chat template's text instead of the model's
    dtype: str = "auto"
    # KV cache element type: "auto" is the model's dtype; "fp8" stores float8 e4m3 (half the
    # bytes of bf16, no scale, saturating at +-448), converted back for attention
    kv_cache_dtype: str = "auto"
    quantization: str = "auto"  # QUANTIZATIONS; executors/model/quant_linear.py
    matmul_precision: str = "auto"  # MATMUL_PRECISIONS; executors/runtime/worker.py picks
    device: str = "auto"
    # engine-wide: requests without a seed draw theirs from it; None: drawn from OS entropy at
    # start (core/seeding.py), and the engine records the drawn value in its config
    seed: int | None = None
    random_weights_seed: int = 0  # the weights of random: models
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None  # None: min(model context, 2048)
    block_size: int = 16
    # reuse the KV pages of full blocks that an earlier request computed for the same prefix
    enable_prefix_caching: bool = True
    num_kv_blocks: int | None = None  # None: sized by the profiler
    gpu_memory_utilization: float = 0.9  # CUDA: fraction of device memory the engine may use
    cpu_kv_cache_bytes: int = 256 * 1024 * 1024  # CPU: KV budget when num_kv_blocks is None
    speculative_method: str | None = None
    num_speculative_tokens: int = 3
    speculative_disable_by_batch_size: int | None = None
    # without a disable threshold, the core picks one from measured step costs
    # (core/spec_threshold.py) and records each change
    speculative_auto_disable: bool = True
    # per-request K: dropped when a request's drafts keep failing (core/draft_length.py)
    speculative_adaptive_k: bool = True
    draft_layers: int = 4
    # "draft": a model folder or GGUF (None: the target's first layers); "eagle": a head's .npz
    # from `memstep train-draft` (None: the head committed for smollm2)
    draft_model: str | None = None
    # EAGLE-2 style tree drafting (eagle only): the head's top `speculative_tree[d]` candidates
    # after each node at depth d (depths past it: one), verified in one forward; () drafts a chain
    speculative_tree: tuple[int, ...] = attrs.field(default=(), converter=tuple)
    ngram_max: int = 3
    ngram_min: int = 1
    cuda_graphs: bool = True
    # CUDA graphs: while the core records a step, the executor already replays the decode step
    # after it for the sequences that sampled; the next plan's decodes that it ran are taken
    # from it (executors/cuda/decode_ahead.py)
    decode_ahead: bool = True
    # CUDA graphs for the other steps too: each layer's work outside attention captured per
    # token bucket, attention eager between (executors/cuda/piecewise.py)
    piecewise_graphs: bool = True
    # threads computing a constrained step's token masks on a GPU, between steps (they begin
    # while the core plans the next one): 0, row by row on one thread (measured best:
    # docs/benchmarks.md); N, llguidance's pool of N; None, its pool at its default size (80%
    # of the cores)
    grammar_mask_threads: int | None = 0
    num_threads: int | None = None
    # tensor parallelism: the executor is this many ranks in one torch.distributed group
    tensor_parallel_size: int = 1
    # where the ranks meet (tcp://HOST:PORT); None: a free loopback port, every rank local
    distributed_init_method: str | None = None
    # ranks the core starts on this machine (0..n-1); the rest run `memstep executor --rank R`
    num_local_ranks: int | None = None
    debug_plant_leak: str | None = None  # test-only: a deliberate leak from states/planted.py
    # resident host memory's noise: a window's floor must rise more than this to count as a rise
    # of core/growth.py's rule (a leak is told by its shape over the work, not by a tolerance)
    host_leak_tolerance_mib: int = 2
    # executor crash recovery: past this many restarts within the window the engine gives up
    max_executor_restarts: int = 3
    executor_restart_window_s: float = 600.0
    # test-only fault injector: the executor SIGKILLs itself when asked to run each of these
    # steps (once each), and, with the second flag, every restarted executor dies in warmup
    debug_kill_executor_at: tuple[int, ...] = attrs.field(default=(), converter=tuple)
    debug_kill_restarted_executor: bool = False

    def __attrs_post_init__(self) -> None:
        _check(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        _check(
            self.kv_cache_dtype in KV_CACHE_DTYPES,
            f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}",
        )
        _check(
            self.quantization in QUANTIZATIONS,
            f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}",
        )
        _check(
            self.matmul_precision in MATMUL_PRECISIONS,
            f"matmul_precision must be one of {MATMUL_PRECISIONS}, got {self.matmul_precision!r}",
        )
        _check(self.device in DEVICES, f"device must be one of {DEVICES}, got {self.device!r}")
        _check(self.max_num_seqs >= 1, "max_num_seqs must be >= 1")
        _check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens must be >= 1")
        _check(self.block_size >= 1, "block_size must be >= 1")
        _check(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization must be in (0, 1]")
        _check(
            self.speculative_method in SPECULATIVE_METHODS,
            f"speculative_method must be one of {SPECULATIVE_METHODS[1:]} or None",
        )
        _check(1 <= self.num_speculative_tokens <= 16, "num_speculative_tokens must be in [1, 16]")
        _check(self.draft_layers >= 1, "draft_layers must be >= 1")
        _check(
            self.speculative_method != "eagle" or bool(self.draft_model) or self.model == "smollm2",
            "speculative_method 'eagle' needs draft_model, a head trained for this model "
            "(`memstep train-draft --model M --out HEAD.npz`); only smollm2 has one built in",
        )
        self._check_tree()
        _check(1 <= self.ngram_min <= self.ngram_max, "need 1 <= ngram_min <= ngram_max")
        disable = self.speculative_disable_by_batch_size
        _check(disable is None or disable >= 1, "speculative_disable_by_batch_size must be >= 1")
        _check(self.max_model_len is None or self.max_model_len >= 2, "max_model_len must be >= 2")
        _check(
            self.debug_plant_leak in (None, *PLANTED_LEAKS),
            f"debug_plant_leak must be one of {PLANTED_LEAKS} or None",
        )
        _check(self.num_kv_blocks is None or self.num_kv_blocks >= 1, "num_kv_blocks must be >= 1")
        _check(self.seed is None or 0 <= self.seed < 2**63, "seed must be in [0, 2**63)")
        _check(self.num_threads is None or self.num_threads >= 1, "num_threads must be >= 1")
        threads = self.grammar_mask_threads
        _check(threads is None or threads >= 0, "grammar_mask_threads must be >= 0")
        _check_tensor_parallel(self)
        _check(self.max_executor_restarts >= 0, "max_executor_restarts must be >= 0")
        _check(self.host_leak_tolerance_mib >= 1, "host_leak_tolerance_mib must be >= 1")
        _check(self.executor_restart_window_s > 0, "executor_restart_window_s must be > 0")
        _check(
            all(type(s) is int and s >= 0 for s in self.debug_kill_executor_at),
            "debug_kill_executor_at must be step numbers >= 0",
        )

    def _check_tree(self) -> None:
        tree = self.speculative_tree
        if not tree:
            return
        _check(all(type(w) is int and w >= 1 for w in tree), "speculative_tree widths must be >= 1")
        _check(self.speculative_method == "eagle", "speculative_tree needs the eagle method")
        _check(
            len(tree) <= self.num_speculative_tokens,
            "speculative_tree has more widths than num_speculative_tokens (its depth)",
        )
        _check(
            tree_size(tree, self.num_speculative_tokens) <= MAX_TREE_NODES,
            f"speculative_tree has more than {MAX_TREE_NODES} nodes",
        )

    def draft_slots(self, depth: int) -> int:
        """KV slots past a sequence that `depth` draft positions write: a chain's `depth`, or
        the nodes of the tree cut there."""
        return tree_size(self.speculative_tree, depth) if self.speculative_tree else depth

    @cached_property
    def is_speculative(self) -> bool:
        return self.speculative_method is not None

    @cached_property
    def num_lookahead_slots(self) -> int:
        """KV slots a decode step may write beyond the sequence: the drafts it verifies."""
        return self.draft_slots(self.num_speculative_tokens) if self.is_speculative else 0

    def spec_enabled_for(self, batch_size: int) -> bool:
        disable = self.speculative_disable_by_batch_size
        return self.is_speculative and (disable is None or batch_size < disable)

    def to_dict(self) -> dict[str, Any]:
        data = attrs.asdict(self)
        data["debug_kill_executor_at"] = list(self.debug_kill_executor_at)  # as logs give it back
        data["speculative_tree"] = list(self.speculative_tree)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineConfig:
        data = {RENAMED.get(k, k): v for k, v in data.items()}  # an older log's names
        names = {f.name for f in attrs.fields(cls)}
        unknown = set(data) - names
        _check(not unknown, f"unknown config keys: {sorted(unknown)}")
        if "random_weights_seed" not in data:  # an older log: its `seed` seeded random: weights
            data = {**data, "random_weights_seed": data.get("seed") or 0}
        if "quantization" not in data:  # an older log: its weights were never quantized
            data = {**data, "quantization": "none"}
        if "matmul_precision" not in data:  # an older log: q4 multiplied in float32
            data = {**data, "matmul_precision": "float32"}
        for name in ("speculative_auto_disable", "speculative_adaptive_k"):
            data.setdefault(name, False)  # an older log: a fixed threshold and K
        return cls(**data)

    def replace(self, **changes: Any) -> EngineConfig:
        return attrs.evolve(self, **changes)


def with_vllm_names(values: dict[str, Any]) -> dict[str, Any]:
    """`values` with each former name (RENAMED) replaced by vLLM's, warning once per use."""
    out = dict(values)
    for old, new in RENAMED.items():
        if old in out:
            warnings.warn(f"{old} is deprecated; use {new}", DeprecationWarning, stacklevel=3)
            _check(new not in out, f"give {new} or {old} (deprecated), not both")
            out[new] = out.pop(old)
    return out


def _check_tensor_parallel(cfg: EngineConfig) -> None:
    tp, local = cfg.tensor_parallel_size, cfg.num_local_ranks
    _check(tp >= 1, "tensor_parallel_size must be >= 1")
    _check(
        local is None or 1 <= local <= tp, "num_local_ranks must be in [1, tensor_parallel_size]"
    )
    method = cfg.distributed_init_method
    _check(
        method is None or method.startswith("tcp://") and ":" in method[6:],
        f"distributed_init_method must look like tcp://HOST:PORT, got {method!r}",
    )
    _check(
        local in (None, tp) or method is not None,
        "ranks on other machines need --distributed-init-method tcp://HOST:PORT",
    )
    _check(
        tp == 1 or cfg.speculative_method is None,
        "speculative decoding runs only at tensor_parallel_size 1",
    )


def parse_override(text: str) -> tuple[str, Any]:
    """Parse `key=value` as given to `--set`; the value keeps the type of the field."""
    key, sep, raw = text.partition("=")
    _check(bool(sep), f"--set expects key=value, got {text!r}")
    fields = {f.name: f for f in attrs.fields(EngineConfig)}
    _check(key in fields, f"unknown config key {key!r}")
    if raw.lower() in ("none", "null"):
        return key, None
    default = fields[key].default
    kind: type = str
    for candidate in (bool, int, float):
        if isinstance(default, candidate):
            kind = candidate
            break
    else:
        if raw.lstrip("-").isdigit():
            kind = int
    if kind is bool:
        return key, raw.lower() in ("1", "true", "yes", "on")
    try:
        return key, kind(raw)
    except ValueError as exc:
        raise ConfigError(f"--set {key}: {exc}") from exc
