"""The CPU's compiled kernels: float32 matmuls straight from a GGUF's Q4_1 and Q8_0 blocks, and
paged decode attention.

x [M, K] float32 @ W^T, where W's rows are kept as the file ships them: Q4_1 blocks of 32
inputs (fp16 d, fp16 m, 16 bytes of nibbles: w = code * d + m) or Q8_0 blocks (fp16 d, 32
int8: w = q * d). Each group of 32 is a float32 dot product of the row's codes with x, scaled
by d, and Q4_1 adds m * (the group's sum of x): the weights are exactly the float32 values
gguf's dequantization gives, read at 5 (Q4_1) or 8.5 (Q8_0) bits each, and every product and
sum is float32. So a q4 model's greedy text stays with the float32 model's where torch's
bfloat16 int4 kernel (bf16 activations, scales and outputs) parted from it within 20 tokens.

Each output is computed alone, in one order (a row's groups left to right), whatever the
number of rows M: a row's result does not depend on what else is in the batch.

The C source below is compiled once per machine with the system's C compiler (`-O3
-march=native -fopenmp`, AVX-512 where the CPU has it) into memstep's cache folder, and loaded
with ctypes; it runs on the OpenMP pool torch already loaded (the same libgomp.so.1), so
`torch.set_num_threads` sets its threads too. `available()` says whether that worked.

`decode_attention` is the CPU's counterpart of the CUDA paged decode kernel (one query token per
sequence, read from the cache pages in place, each sequence and head alone) and
`rope_and_write_kv` of its rotary + KV write: in torch they were a gather of the pages and an
attention call, and ~10 small ops, per layer. A SmolLM2 q4 decode step at batch 1 went from 14.1
to 11.4 ms with them, and at 16 streams from 88 to 65 ms (2 cores, 2026-12-01).

Where the OpenMP pool's threads sleep between regions (the executor's passive policy,
executors/threads.py), waking them costs more than a small kernel's work, so a kernel under
PARALLEL_MIN_WHEN_ASLEEP runs on the calling thread alone; each output is computed the same way
either way.
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

from memstep.executors.threads import threads_sleep_when_idle

GROUP = 32
Q4_1_BLOCK = 20  # fp16 d, fp16 m, 16 bytes: inputs j (low nibble) and 16 + j (high)
Q8_0_BLOCK = 34  # fp16 d, 32 int8
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11", "-lm")
# The work (the C source's units, ~30 ps of one core each) below which a kernel runs on the
# calling thread when the pool's threads sleep between regions: waking them took ~0.1-0.3 ms
# here. Decode steps of SmolLM2 q4, 2 threads, passive policy, the settings interleaved step by
# step (2026-12-02): 0 / 3M / 6M / 12M / 24M took 26.2 / 22.2 / 21.8 / 21.9 / 21.1 ms at batch 1,
# 30.5 / 28.0 / 27.6 / 27.2 / 27.2 at 3, 45.9 / 43.8 / 43.8 / 49.4 / 52.8 at 8 and 76.3 / 76.5 /
# 76.8 / 80.3 / 94.5 at 16. With spinning threads 0 is best (17.4 ms at batch 1 against 22.1).
PARALLEL_MIN_WHEN_ASLEEP = 6_000_000

_SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <immintrin.h>
#include <math.h>

#define GROUP 32
#define ROWS 16  /* rows of x per pass over a tile of weight rows: their weights unpacked twice */

static inline float half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

#ifdef __AVX512F__
typedef __m512 vec;
#define LANES 16
static inline vec vload(const float *p) { return _mm512_loadu_ps(p); }
static inline float vsum(vec v) { return _mm512_reduce_add_ps(v); }
#define VZERO _mm512_setzero_ps()
#define VSET1 _mm512_set1_ps
#define VMUL _mm512_mul_ps
#define VSUB _mm512_sub_ps
#define VFMA _mm512_fmadd_ps
static inline void unpack_q4(const uint8_t *q, vec *c) {
    __m128i b = _mm_loadu_si128((const __m128i *)q), mask = _mm_set1_epi8(0x0F);
    c[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b, mask)));
    c[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), mask)));
}
static inline void unpack_q8(const uint8_t *q, vec *c) {
    c[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
    c[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16))));
}
#else
typedef struct { float v[GROUP / 2]; } vec;
#define LANES 16
static inline vec vload(const float *p) { vec r; memcpy(r.v, p, sizeof r.v); return r; }
static inline float vsum(vec a) {
    float s = 0;
    for (int i = 0; i < LANES; i++) s += a.v[i];
    return s;
}
static inline vec VSET1(float x) { vec r; for (int i = 0; i < LANES; i++) r.v[i] = x; return r; }
#define VZERO VSET1(0.0f)
static inline vec VMUL(vec a, vec b) { for (int i = 0; i < LANES; i++) a.v[i] *= b.v[i]; return a; }
static inline vec VSUB(vec a, vec b) { for (int i = 0; i < LANES; i++) a.v[i] -= b.v[i]; return a; }
static inline vec VFMA(vec a, vec b, vec c) {
    for (int i = 0; i < LANES; i++) c.v[i] = a.v[i] * b.v[i] + c.v[i];
    return c;
}
static inline void unpack_q4(const uint8_t *q, vec *c) {
    for (int i = 0; i < 16; i++) { c[0].v[i] = q[i] & 15; c[1].v[i] = q[i] >> 4; }
}
static inline void unpack_q8(const uint8_t *q, vec *c) {
    for (int i = 0; i < 16; i++) { c[0].v[i] = (int8_t)q[i]; c[1].v[i] = (int8_t)q[16 + i]; }
}
#endif

/* unpack one block into its 32 float32 weights, w[0] inputs 0..15, w[1] 16..31: exactly
   gguf's values (d * code is exact in float32: 11 bits times 4 or 8; + m rounds once) */
static inline void weights_q4_1(const uint8_t *b, vec *w) {
    vec c[2];
    unpack_q4(b + 4, c);
    vec d = VSET1(half(b)), m = VSET1(half(b + 2));
    w[0] = VFMA(c[0], d, m);
    w[1] = VFMA(c[1], d, m);
}

static inline void weights_q8_0(const uint8_t *b, vec *w) {
    vec c[2];
    unpack_q8(b + 2, c);
    vec d = VSET1(half(b));
    w[0] = VMUL(c[0], d);
    w[1] = VMUL(c[1], d);
}

/* y[r, n] for rows r0..r0+nr of x and weight rows n..n+nw (G blocks of `bs` bytes each, from
   `w`): each output accumulates its groups left to right, whatever nr and nw, so a row's result
   does not depend on the batch; several weight rows at once give a few rows of x independent
   chains of FMAs to overlap */
static inline __attribute__((always_inline)) void tile_dot(
    const float *x, const uint8_t *w, float *y, int64_t r0, int nr, int64_t n, int nw,
    int64_t N, int64_t K, int64_t G, int bs)
{
    vec acc[4][ROWS];
    for (int j = 0; j < nw; j++)
        for (int r = 0; r < nr; r++) acc[j][r] = VZERO;
    for (int64_t g = 0; g < G; g++) {
        for (int j = 0; j < nw; j++) {
            vec wv[2];
            const uint8_t *b = w + ((n + j) * G + g) * bs;
            if (bs == 20) weights_q4_1(b, wv); else weights_q8_0(b, wv);
            for (int r = 0; r < nr; r++) {
                const float *xr = x + (r0 + r) * K + g * GROUP;
                acc[j][r] = VFMA(wv[0], vload(xr), acc[j][r]);
                acc[j][r] = VFMA(wv[1], vload(xr + LANES), acc[j][r]);
            }
        }
    }
    for (int j = 0; j < nw; j++)
        for (int r = 0; r < nr; r++) y[(r0 + r) * N + n + j] = vsum(acc[j][r]);
}

#define WIDE 4  /* weight rows per tile for 1-3 rows of x, 2 for 4-7, 1 for 8-15 */
#define TAIL(k, nw) case k: \
    for (int64_t j = n0; j + nw <= n1; j += nw) tile_dot(x, w, y, r0, k, j, nw, N, K, G, bs); \
    for (int64_t j = n1 - (n1 - n0) % nw; j < n1; j++) \
        tile_dot(x, w, y, r0, k, j, 1, N, K, G, bs); \
    break;

/* work below which a kernel runs on the calling thread alone (set_parallel_min), in units of
   about one float32 multiply-add at 16 rows of a q4 matmul on one core (~30 ps): a matmul of M
   rows costs (M + 2) N K (unpacking a weight costs about two), an attention 8 positions H D */
static int64_t parallel_min = 0;

void set_parallel_min(int64_t n) { parallel_min = n; }

static inline __attribute__((always_inline)) void blocks_mm(
    const float *x, const uint8_t *w, float *y, int64_t M, int64_t N, int64_t K, int bs)
{
    const int64_t G = K / GROUP;
    #pragma omp parallel for schedule(static) if ((M + 2) * N * K >= parallel_min)
    for (int64_t n0 = 0; n0 < N; n0 += WIDE) {
        int64_t n1 = n0 + WIDE < N ? n0 + WIDE : N, r0 = 0;
        for (; r0 + ROWS <= M; r0 += ROWS)  /* as two halves, two weight rows at a time */
            for (int64_t h = r0; h < r0 + ROWS; h += ROWS / 2) {
                int64_t n = n0;
                for (; n + 2 <= n1; n += 2) tile_dot(x, w, y, h, ROWS / 2, n, 2, N, K, G, bs);
                for (; n < n1; n++) tile_dot(x, w, y, h, ROWS / 2, n, 1, N, K, G, bs);
            }
        switch (M - r0) {  /* constant sizes: the accumulators stay in registers */
        TAIL(15, 1) TAIL(14, 1) TAIL(13, 1) TAIL(12, 1) TAIL(11, 1) TAIL(10, 1) TAIL(9, 1)
        TAIL(8, 1) TAIL(7, 2) TAIL(6, 2) TAIL(5, 2) TAIL(4, 2) TAIL(3, 4) TAIL(2, 4) TAIL(1, 4)
        default: break;
        }
    }
}

void q4_1_mm(const float *x, const uint8_t *w, float *y, int64_t M, int64_t N, int64_t K)
{
    blocks_mm(x, w, y, M, N, K, 20);
}

void q8_0_mm(const float *x, const uint8_t *w, float *y, int64_t M, int64_t N, int64_t K)
{
    blocks_mm(x, w, y, M, N, K, 34);
}

/* the float32 matrix [N, K] of Q4_1 rows, as gguf computes it: d * code + m */
void q4_1_dequant(const uint8_t *w, float *out, int64_t N, int64_t K)
{
    const int64_t G = K / GROUP;
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        for (int64_t g = 0; g < G; g++) {
            const uint8_t *b = w + (n * G + g) * 20;
            vec wv[2];
            weights_q4_1(b, wv);
            memcpy(out + n * K + g * GROUP, &wv, sizeof wv);
        }
    }
}

#define CHUNK 64  /* positions scored at a time */

#ifdef __AVX512F__
/* e^x for x <= 0 (softmax weights), within ~2 ulp: 2^n e^r, n = round(x log2 e), |r| <= ln2/2 */
static inline vec vexp(vec x) {
    x = _mm512_max_ps(x, VSET1(-87.0f));
    vec n = _mm512_roundscale_ps(VMUL(x, VSET1(1.44269504088896341f)), 0);
    vec r = VFMA(n, VSET1(-0.693359375f), x);
    r = VFMA(n, VSET1(2.12194440e-4f), r);
    vec p = VSET1(1.9875691500e-4f);
    p = VFMA(p, r, VSET1(1.3981999507e-3f));
    p = VFMA(p, r, VSET1(8.3334519073e-3f));
    p = VFMA(p, r, VSET1(4.1665795894e-2f));
    p = VFMA(p, r, VSET1(1.6666665459e-1f));
    p = VFMA(p, r, VSET1(5.0000001201e-1f));
    p = VFMA(VMUL(p, r), r, r);
    return _mm512_scalef_ps(_mm512_add_ps(p, VSET1(1.0f)), n);
}
#else
static inline vec vexp(vec x) { for (int i = 0; i < LANES; i++) x.v[i] = expf(x.v[i]); return x; }
#endif

/* one query token per sequence over its cached positions 0..len-1 (paged KV cache, float32),
   softmax in float32 a chunk of positions at a time (rescaled when the running maximum
   grows); query head h reads KV head h / (H / KVH); len 0 gives zeros.
   q, out: [B, H, D] with row strides qs, os (elements); caches [blocks, BS, KVH, D];
   D a multiple of LANES */
void decode_attention(const float *q, int64_t qs, const float *kc, const float *vc,
                      const int32_t *tables, const int32_t *lens, float *out, int64_t os,
                      int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t BS, int64_t NB,
                      float scale)
{
    const int64_t per_kv = H / KVH;
    int64_t positions = 0;
    for (int64_t b = 0; b < B; b++) positions += lens[b];
    #pragma omp parallel for collapse(2) schedule(static) if (8 * positions * H * D >= parallel_min)
    for (int64_t b = 0; b < B; b++) {
        for (int64_t h = 0; h < H; h++) {
            const float *qh = q + b * qs + h * D;
            float *o = out + b * os + h * D;
            float acc[256], score[CHUNK], top = -INFINITY, total = 0.0f;
            for (int64_t i = 0; i < D; i++) acc[i] = 0.0f;
            for (int64_t p0 = 0; p0 < lens[b]; p0 += CHUNK) {
                int64_t n = lens[b] - p0 < CHUNK ? lens[b] - p0 : CHUNK;
                const float *kv[2][CHUNK];
                float most = -INFINITY;
                for (int64_t j = 0; j < n; j++) {
                    int64_t p = p0 + j;
                    int64_t at = (((int64_t)tables[b * NB + p / BS] * BS + p % BS) * KVH
                                  + h / per_kv) * D;
                    kv[0][j] = kc + at;
                    kv[1][j] = vc + at;
                    vec dot = VZERO;
                    for (int64_t i = 0; i < D; i += LANES)
                        dot = VFMA(vload(qh + i), vload(kv[0][j] + i), dot);
                    score[j] = vsum(dot) * scale;
                    most = score[j] > most ? score[j] : most;
                }
                for (int64_t j = n; j < CHUNK; j++) score[j] = -INFINITY;
                if (most > top) {
                    float shrink = expf(top - most);
                    for (int64_t i = 0; i < D; i++) acc[i] *= shrink;
                    total *= shrink;
                    top = most;
                }
                for (int64_t j = 0; j < n; j += LANES) {
                    vec e = vexp(VSUB(vload(score + j), VSET1(top)));
                    memcpy(score + j, &e, sizeof e);
                }
                for (int64_t j = 0; j < n; j++) {
                    total += score[j];
                    for (int64_t i = 0; i < D; i++) acc[i] += score[j] * kv[1][j][i];
                }
            }
            for (int64_t i = 0; i < D; i++) o[i] = total > 0.0f ? acc[i] / total : 0.0f;
        }
    }
}

/* rotate q and k of each token (Hugging Face's halves: x1 cos - x2 sin, x2 cos + x1 sin, the
   same float32 operations as llama.apply_rope), q in place in qkv, k and v into flat slot
   slots[t] of the caches (none where negative); qkv: [T, (H + 2 KVH) * D], row stride qs;
   cos, sin: [P, D / 2]; caches [blocks, BS, KVH, D] float32 */
void rope_write_kv(float *qkv, int64_t qs, const float *cos, const float *sin,
                   const int64_t *pos, const int64_t *slots, float *kc, float *vc,
                   int64_t T, int64_t H, int64_t KVH, int64_t D)
{
    const int64_t half = D / 2;
    #pragma omp parallel for schedule(static) if (T > 8)
    for (int64_t t = 0; t < T; t++) {
        float *row = qkv + t * qs;
        const float *c = cos + pos[t] * half, *s = sin + pos[t] * half;
        for (int64_t hh = 0; hh < H + KVH; hh++) {
            float *x = row + hh * D;
            float *to = hh < H ? x : (slots[t] >= 0 ? kc + (slots[t] * KVH + hh - H) * D : 0);
            if (!to) continue;
            for (int64_t i = 0; i < half; i++) {
                float x1 = x[i], x2 = x[i + half];
                float a = x1 * c[i] - x2 * s[i], b = x2 * c[i] + x1 * s[i];
                to[i] = a;
                to[i + half] = b;
            }
        }
        if (slots[t] >= 0)
            memcpy(vc + slots[t] * KVH * D, row + (H + KVH) * D, KVH * D * sizeof(float));
    }
}
"""


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "memstep" / "kernels"


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The compiled kernels, built on first use; None where no C compiler can build them."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    key = hashlib.sha256((_SOURCE + " ".join(CFLAGS) + compiler).encode()).hexdigest()[:16]
    path = cache_dir() / f"cpu_kernels_{key}.so"
    if not path.exists():
        try:
            _build(compiler, path)
        except (OSError, subprocess.SubprocessError):
            return None
    lib = ctypes.CDLL(str(path))
    p, i, f = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    lib.q4_1_mm.argtypes = [p, p, p, i, i, i]
    lib.q8_0_mm.argtypes = [p, p, p, i, i, i]
    lib.q4_1_dequant.argtypes = [p, p, i, i]
    lib.decode_attention.argtypes = [p, i, p, p, p, p, p, i, i, i, i, i, i, i, f]
    lib.rope_write_kv.argtypes = [p, i, p, p, p, p, p, p, i, i, i, i]
    lib.set_parallel_min.argtypes = [i]
    lib.set_parallel_min(parallel_min())
    return lib


def _build(compiler: str, path: Path) -> None:
    """Compile into a temporary file, then move it into place (other processes may race)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        src = Path(tmp) / "cpu_kernels.c"
        src.write_text(_SOURCE)
        out = Path(tmp) / path.name
        argv = [compiler, *CFLAGS, str(src), "-o", str(out)]
        subprocess.run(argv, check=True, capture_output=True, timeout=300)
        os.replace(out, path)


def available() -> bool:
    """Whether the kernels are built and loaded (a C compiler was found)."""
    return _library() is not None


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


def q4_1_mm(x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 @ W^T -> [M, N] float32; blocks: [N, K / 32 * 20] uint8 (Q4_1 rows)."""
    return _block_mm(_kernels().q4_1_mm, x, blocks)


def q8_0_mm(x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 @ W^T -> [M, N] float32; blocks: [N, K / 32 * 34] uint8 (Q8_0 rows)."""
    return _block_mm(_kernels().q8_0_mm, x, blocks)


def _block_mm(entry, x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """The matmul of a C entry point over rows of quantized blocks."""
    x = x.contiguous()
    m, k = x.shape
    y = torch.empty(m, blocks.shape[0], dtype=torch.float32)
    entry(x.data_ptr(), blocks.data_ptr(), y.data_ptr(), m, blocks.shape[0], k)
    return y


def q4_1_dequant(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_1 rows ([N, K / 32 * 20] uint8) -> float32 [N, K], gguf's values (d * code + m)."""
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
) -> torch.Tensor:
    """The CPU's `paged_decode_attention` (executors/kernels), float32: q [B, H, D] (rows may be
    strided), caches [blocks, block_size, KVH, D], block_tables [B, NB] int32, seq_lens [B]
    int32; writes and returns `out` ([B, H, D], allocated like q when None)."""
    b, h, d = q.shape
    _, block_size, kvh, _ = k_cache.shape
    if out is None:
        out = torch.empty(q.shape, dtype=torch.float32)
    assert q.stride()[1:] == (d, 1) and out.stride()[1:] == (d, 1)
    tables, lens = block_tables.contiguous(), seq_lens.contiguous()
    _kernels().decode_attention(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
        tables.data_ptr(), lens.data_ptr(), out.data_ptr(), out.stride(0),
        b, h, kvh, d, block_size, tables.shape[1], scale,
    )  # fmt: skip
    return out


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
    """The CPU's `rope_and_write_kv` (executors/kernels), float32: qkv [T, (H + 2 KVH) * D],
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
