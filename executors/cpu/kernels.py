"""The CPU's compiled kernels: float32 matmuls straight from a GGUF's blocks, and paged decode
attention.

x [M, K] float32 @ W^T, W's rows the file's blocks (formats/gguf_blocks.py converts the types it
reads): Q4_1 (d and m, the file's fp16 values widened to float32 at load, 16 bytes of nibbles:
w = code * d + m; Q4_K's sub-blocks too), Q5_0 (the same with a fifth bit a code), Q8_0 as
shipped (fp16 d, 32 int8: w = q * d) or Q8_16 (a float32 scale and offset per 16 inputs, 32
int8: w = q * s + o; Q6_K's). Each weight is exactly gguf's dequantized float32 value, read at
6, 7, 8.5 or 12 bits, and every
product and sum is float32, so a q4 model's greedy text stays with the float32 model's (torch's
bfloat16 int4 kernel parted from it within 20 tokens).

With bfloat16 products (`bf16=True`) x's rows and each group's weights are rounded to bfloat16
(`to_bf16`, as torch rounds) and AVX512-BF16's dot product sums them in float32; a CPU without
it gets the same sums a product at a time (`native_bf16()` says which). Each output is computed
alone, in one order, whatever the number of rows: a row's result does not depend on its batch.

The C source (kernels.c) is compiled once per machine with the system's C compiler (`-O3
-march=native -fopenmp`: AVX-512, else AVX2 + FMA, else plain C) into memstep's cache folder
and loaded with ctypes; it runs on torch's OpenMP pool (the same libgomp.so.1), so
`torch.set_num_threads` sets its threads too. `available()` says whether that worked.

`decode_attention` and `rope_and_write_kv` are the CPU's counterparts of the CUDA paged decode
kernel and rotary + KV write: the pages read in place instead of a gather and ~10 small torch
ops a layer (docs/benchmarks.md has what they saved). Where the pool's threads sleep between
regions (executors/cpu/threads.py), waking them costs more than a small kernel's work, so a
kernel under PARALLEL_MIN_WHEN_ASLEEP runs on the calling thread alone, with the same bits.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from memstep.executors.cpu.features import cpu_flags
from memstep.executors.cpu.threads import threads_sleep_when_idle

SOURCE = Path(__file__).with_name("kernels.c")  # package data, compiled on first use
GROUP = 32
# float32 d, float32 m (gguf's fp16 values, widened at load: quant_linear.q4_1_rows), 16 bytes:
# inputs j (low nibble) and 16 + j (high)
Q4_1_BLOCK = 24
Q5_0_BLOCK = 28  # float32 d, float32 -16 d, 32 fifth bits, 16 bytes of nibbles as Q4_1's
Q8_0_BLOCK = 34  # fp16 d, 32 int8
Q8_16_BLOCK = 48  # float32 (scale, offset) of inputs 0..15, then 16..31; 32 int8
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11", "-lm")
# The work (the C source's units, ~30 ps of one core each) below which a kernel runs on the
# calling thread when the pool's threads sleep between regions: waking them took ~0.1-0.3 ms
# here (decode steps at batch 1 to 16, each setting interleaved: docs/benchmarks.md).
PARALLEL_MIN_WHEN_ASLEEP = 6_000_000


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "memstep" / "kernels"


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The compiled kernels, built on first use; None where no C compiler can build them."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    # -march=native: a library built on another CPU (a shared home folder) may not run here
    build = SOURCE.read_text() + " ".join(CFLAGS) + compiler + " ".join(sorted(cpu_flags()))
    key = hashlib.sha256(build.encode()).hexdigest()[:16]
    path = cache_dir() / f"cpu_kernels_{key}.so"
    if not path.exists():
        try:
            _build(compiler, path)
        except (OSError, subprocess.SubprocessError):
            return None
    lib = ctypes.CDLL(str(path))
    p, i, f = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    for form in ("q4_1", "q5_0", "q8_0", "q8_16"):
        getattr(lib, f"{form}_mm").argtypes = [p, p, p, i, i, i]
        getattr(lib, f"{form}_mm_bf16").argtypes = [p, p, p, i, i, i]
    lib.to_bf16.argtypes = [p, p, i, i]
    lib.q4_1_dequant.argtypes = [p, p, i, i]
    lib.decode_attention.argtypes = [p, i, p, p, p, p, p, i, i, i, i, i, i, i, f, p, p, i]
    lib.rope_write_kv.argtypes = [p, i, p, p, p, p, p, p, i, i, i, i]
    lib.rms_norm.argtypes = [p, p, p, i, i, f]
    lib.silu_mul.argtypes = [p, p, i, i]
    lib.decode_step.argtypes = [p] * 21 + [i] * 9 + [f, f, p, p, i]
    lib.set_parallel_min.argtypes = [i]
    lib.vector_bits.restype = ctypes.c_int
    lib.native_bf16.restype = ctypes.c_int
    lib.set_parallel_min(parallel_min())
    return lib


def _build(compiler: str, path: Path) -> None:
    """Compile into a temporary file, then move it into place (other processes may race)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        out = Path(tmp) / path.name
        argv = [compiler, *CFLAGS, str(SOURCE), "-o", str(out)]
        subprocess.run(argv, check=True, capture_output=True, timeout=300)
        os.replace(out, path)


def available() -> bool:
    """Whether the kernels are built and loaded (a C compiler was found)."""
    return _library() is not None


def vector_bits() -> int:
    """The vector width the kernels were built for: 512 (AVX-512), 256 (AVX2 + FMA), 0 (plain
    C, which a CPU with either never gets: ~10x slower)."""
    return _kernels().vector_bits()


def native_bf16() -> bool:
    """Whether the kernels' bfloat16 products run on the CPU's own dot products (AVX512-BF16);
    elsewhere they give the same sums a product at a time, several times slower than float32."""
    return bool(_kernels().native_bf16())


def set_parallel_min(work: int) -> None:
    """Run kernels of less `work` (the C source's units) on the calling thread alone."""
    _kernels().set_parallel_min(work)


def parallel_min() -> int:
    """The threshold the kernels load with: PARALLEL_MIN_WHEN_ASLEEP under a passive policy."""
    return PARALLEL_MIN_WHEN_ASLEEP if threads_sleep_when_idle() else 0


def _kernels() -> ctypes.CDLL:
    lib = _library()
    if lib is None:
        raise RuntimeError("memstep's CPU kernels are not built: no C compiler could build them")
    return lib


def q4_1_mm(x: torch.Tensor, blocks: torch.Tensor, bf16: bool = False) -> torch.Tensor:
    """x [M, K] float32 @ W^T -> [M, N] float32; blocks: [N, K / 32 * 24] uint8 (Q4_1 rows as
    `quant_linear.q4_1_rows` makes them).
    `bf16`: x's rows and the weights rounded to bfloat16, the products summed in float32."""
    lib = _kernels()
    return _block_mm(lib.q4_1_mm_bf16 if bf16 else lib.q4_1_mm, x, blocks, bf16)


def q8_0_mm(x: torch.Tensor, blocks: torch.Tensor, bf16: bool = False) -> torch.Tensor:
    """x [M, K] float32 @ W^T -> [M, N] float32; blocks: [N, K / 32 * 34] uint8 (Q8_0 rows)."""
    lib = _kernels()
    return _block_mm(lib.q8_0_mm_bf16 if bf16 else lib.q8_0_mm, x, blocks, bf16)


def q5_0_mm(x: torch.Tensor, blocks: torch.Tensor, bf16: bool = False) -> torch.Tensor:
    """x [M, K] float32 @ W^T -> [M, N] float32; blocks: [N, K / 32 * 28] uint8 (Q5_0 rows,
    `gguf_blocks.block_rows`)."""
    lib = _kernels()
    return _block_mm(lib.q5_0_mm_bf16 if bf16 else lib.q5_0_mm, x, blocks, bf16)


def q8_16_mm(x: torch.Tensor, blocks: torch.Tensor, bf16: bool = False) -> torch.Tensor:
    """x [M, K] float32 @ W^T -> [M, N] float32; blocks: [N, K / 32 * 48] uint8 (Q8_16 rows,
    `gguf_blocks.block_rows`)."""
    lib = _kernels()
    return _block_mm(lib.q8_16_mm_bf16 if bf16 else lib.q8_16_mm, x, blocks, bf16)


def _block_mm(entry, x: torch.Tensor, blocks: torch.Tensor, bf16: bool) -> torch.Tensor:
    """The matmul of a C entry point over rows of quantized blocks (bf16: of x's rows rounded by
    `to_bf16`)."""
    x = to_bf16(x) if bf16 else x.contiguous()
    m, k = x.shape
    y = torch.empty(m, blocks.shape[0], dtype=torch.float32)
    entry(x.data_ptr(), blocks.data_ptr(), y.data_ptr(), m, blocks.shape[0], k)
    return y


def to_bf16(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 -> bfloat16, rounded as `decode_step` rounds a matmul's rows."""
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    _kernels().to_bf16(x.data_ptr(), out.data_ptr(), *x.shape)
    return out


def q4_1_dequant(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_1 rows ([N, K / 32 * 24] uint8, `quant_linear.q4_1_rows`) -> float32 [N, K], gguf's
    values (d * code + m)."""
    n, k = blocks.shape[0], blocks.shape[1] // Q4_1_BLOCK * GROUP
    out = torch.empty(n, k, dtype=torch.float32)
    _kernels().q4_1_dequant(blocks.data_ptr(), out.data_ptr(), n, k)
    return out


MAX_HEAD_DIM = 256  # decode_attention's accumulator
HEAD_DIM_STEP = 16  # its vector width


def attends(head_dim: int) -> bool:
    """Whether `decode_attention` takes heads of `head_dim`."""
    return head_dim <= MAX_HEAD_DIM and head_dim % HEAD_DIM_STEP == 0 and available()


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    bases: torch.Tensor | None = None,
    remap: torch.Tensor | None = None,
) -> torch.Tensor:
    """The CPU's `paged_decode_attention` (executors/cuda/kernels), float32: q [B, H, D] (rows
    may be strided), caches [blocks, block_size, KVH, D], block_tables [B, NB] int32, seq_lens [B]
    int32; writes and returns `out` ([B, H, D], allocated like q when None). Draft tree rows:
    `bases` [B] int32 and `remap` [B, R] int32, a row's positions from bases[b] on read at
    remap[b, p - bases[b]] (`AttnGroup.query_remap`)."""
    b, h, d = q.shape
    _, block_size, kvh, _ = k_cache.shape
    if out is None:
        out = torch.empty(q.shape, dtype=torch.float32)
    assert q.stride()[1:] == (d, 1) and out.stride()[1:] == (d, 1)
    tables, lens = block_tables.contiguous(), seq_lens.contiguous()
    _kernels().decode_attention(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
        tables.data_ptr(), lens.data_ptr(), out.data_ptr(), out.stride(0),
        b, h, kvh, d, block_size, tables.shape[1], scale, *tree_args(bases, remap),
    )  # fmt: skip
    return out


def tree_args(bases: torch.Tensor | None, remap: torch.Tensor | None) -> tuple[int, int, int]:
    """A draft tree's rows as the C kernels take them: bases and paths' addresses and width."""
    if bases is None or remap is None:
        return 0, 0, 0
    assert bases.dtype == remap.dtype == torch.int32 and bases.is_contiguous()
    assert remap.is_contiguous()
    return bases.data_ptr(), remap.data_ptr(), remap.shape[1]


def rope_and_write_kv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_heads: int,
) -> torch.Tensor:
    """The CPU's `rope_and_write_kv` (executors/cuda/kernels), float32: qkv [T, (H + 2 KVH) * D],
    cos, sin [P, D / 2], positions and slots [T] int64. Rotates q in place and returns it as a
    [T, H, D] view of qkv; writes rotated k and v into the caches."""
    t = qkv.shape[0]
    _, _, kvh, d = k_cache.shape
    assert qkv.stride(1) == 1 and cos.is_contiguous() and sin.is_contiguous()
    pos, at = positions.contiguous(), slots.contiguous()
    _kernels().rope_write_kv(
        qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), sin.data_ptr(), pos.data_ptr(),
        at.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), t, num_heads, kvh, d,
    )  # fmt: skip
    return qkv[:, : num_heads * d].view(t, num_heads, d)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x's rows ([M, E] float32) by `weight` ([E]), in the order `decode_step` takes:
    a q4 model's norms run here whatever its batch, so that a row's bits do not depend on
    whether its step ran as one `decode_step` call or kernel by kernel."""
    x = x.contiguous()
    out = torch.empty_like(x)
    _kernels().rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), *x.shape, eps)
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for rows [gate | up] ([M, 2 I] float32) -> [M, I], as `decode_step`."""
    gate_up = gate_up.contiguous()
    m, i = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(m, i, dtype=torch.float32)
    _kernels().silu_mul(gate_up.data_ptr(), out.data_ptr(), m, i)
    return out


def decode_step(*args: int | float) -> None:
    """The C `decode_step` (executors/cpu/kernels.c): pointers, then sizes; see cpu_step.py."""
    _kernels().decode_step(*args)
