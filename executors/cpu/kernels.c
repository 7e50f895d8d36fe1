/* The C source of the CPU's compiled kernels (kernels.py builds and loads it).
   
   Q4_1 / Q5_0 / Q8_0 / Q8_16 matmuls, paged decode attention, rotary + KV write, RMSNorm and
   silu * up, each an entry point of its own, and `decode_step`: every decoder layer of a decode
   step in one OpenMP parallel region, built from the same per-output helpers (`mm_tile`,
   `attend_group`, `rope_row`, `rms_norm_rows`, `silu_mul_rows`), so that a row gets the same
   bits either way. */
#define _GNU_SOURCE
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <immintrin.h>
#include <math.h>

int omp_get_num_threads(void);  /* libgomp's, declared here: no omp.h needed */
int omp_get_thread_num(void);

#define GROUP 32

static inline float half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

static inline float single(const uint8_t *p) {
    float f;
    memcpy(&f, p, 4);
    return f;
}

/* a Q4_1 block as the kernels take it (quant_linear.q4_1_rows): gguf's fp16 d and m widened to
   float32 at load (exactly), then 16 bytes of codes. Two fp16 conversions a block were a quarter
   of a one-row matmul's work, which unpacking bounds; a one-row q4 matmul of 33 MB took 2.8-3.5
   ms in bfloat16 products, 2.0-2.8 with the 20% more bytes of these blocks */
#define Q4_BYTES 24
#define Q4_CODES 8  /* where the codes start */
#define Q8_0_BYTES 34  /* fp16 d, 32 int8 codes: w = q * d */
/* a Q5_0 block (formats/gguf_blocks.py): gguf's fp16 d widened to float32 and m = -16 d, the
   codes' fifth bits (bit j: input j), then 16 bytes of their low four as Q4_1's: w = q * d + m,
   exact (q * d has 16 bits) */
#define Q5_BYTES 28
#define Q5_BITS 8  /* where the fifth bits start */
/* a Q8_16 block (formats/gguf_blocks.py): float32 scale and offset of inputs 0..15, then of
   16..31, then 32 int8 codes: w = q * s + o, one rounding (a GGUF's Q6_K, or a fused matrix
   whose parts' blocks differ) */
#define Q8_16_BYTES 48
#define Q8_16_CODES 16

/* ROWS: rows of x per pass over a tile of weight rows, as two halves of HALF_NW weight rows at
   a time; TAILS: the weight rows at a time for fewer rows. A row's bits do not depend on them:
   they are sized to the vector registers (32 of AVX-512, 16 of AVX2) */
#ifdef __AVX512F__
#define ROWS 16
#define HALF_NW 2
#define TAILS TAIL(15, 1) TAIL(14, 1) TAIL(13, 1) TAIL(12, 1) TAIL(11, 1) TAIL(10, 1) \
    TAIL(9, 1) TAIL(8, 1) TAIL(7, 2) TAIL(6, 2) TAIL(5, 2) TAIL(4, 2) TAIL(3, 4) TAIL(2, 4) \
    TAIL(1, 4)
#else
#define ROWS 12
#define HALF_NW 1
#define TAILS TAIL(11, 1) TAIL(10, 1) TAIL(9, 1) TAIL(8, 1) TAIL(7, 1) TAIL(6, 1) TAIL(5, 1) \
    TAIL(4, 1) TAIL(3, 2) TAIL(2, 2) TAIL(1, 4)
#endif

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
#define VADD _mm512_add_ps
#define VMAX _mm512_max_ps
#define VMIN _mm512_min_ps
#define VDIV _mm512_div_ps
static inline vec VROUND(vec x) { return _mm512_roundscale_ps(x, 0); }
#define VSCALE _mm512_scalef_ps  /* a * 2^n */
static inline void unpack_q4(const uint8_t *q, vec *c) {
    __m128i b = _mm_loadu_si128((const __m128i *)q), mask = _mm_set1_epi8(0x0F);
    c[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b, mask)));
    c[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), mask)));
}
static inline void unpack_q5(const uint8_t *q, vec *c) {  /* q: the fifth bits, the nibbles */
    uint32_t bits;
    memcpy(&bits, q, 4);
    unpack_q4(q + 4, c);
    c[0] = _mm512_mask_add_ps(c[0], (__mmask16)(bits & 0xFFFF), c[0], _mm512_set1_ps(16.0f));
    c[1] = _mm512_mask_add_ps(c[1], (__mmask16)(bits >> 16), c[1], _mm512_set1_ps(16.0f));
}
static inline void unpack_q8(const uint8_t *q, vec *c) {
    c[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
    c[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16))));
}
#elif defined(__AVX2__) && defined(__FMA__)
/* 16 lanes as two halves of 8: the same lanes, sums and order of products as AVX-512's, only
   the final sum across the lanes goes another way */
typedef struct { __m256 lo, hi; } vec;
#define LANES 16
static inline vec vload(const float *p) {
    vec r = {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)};
    return r;
}
static inline float vsum(vec v) {
    __m256 s = _mm256_add_ps(v.lo, v.hi);
    __m128 t = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    t = _mm_add_ps(t, _mm_movehl_ps(t, t));
    t = _mm_add_ss(t, _mm_movehdup_ps(t));
    return _mm_cvtss_f32(t);
}
static inline vec VSET1(float x) { __m256 v = _mm256_set1_ps(x); vec r = {v, v}; return r; }
#define VZERO VSET1(0.0f)
static inline vec VFMA(vec a, vec b, vec c) {
    vec r = {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
    return r;
}
static inline __m256 round8(__m256 x) {
    return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
static inline vec VROUND(vec x) { vec r = {round8(x.lo), round8(x.hi)}; return r; }
static inline __m256 scale8(__m256 a, __m256 n) {  /* a * 2^n, n a whole number in -126..127 */
    __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    return _mm256_mul_ps(a, _mm256_castsi256_ps(_mm256_slli_epi32(e, 23)));
}
/* a two-operand op on both halves */
#define HALVES(name, op) \
    static inline vec name(vec a, vec b) { vec r = {op(a.lo, b.lo), op(a.hi, b.hi)}; return r; }
HALVES(VMUL, _mm256_mul_ps)
HALVES(VSUB, _mm256_sub_ps)
HALVES(VADD, _mm256_add_ps)
HALVES(VMAX, _mm256_max_ps)
HALVES(VMIN, _mm256_min_ps)
HALVES(VDIV, _mm256_div_ps)
HALVES(VSCALE, scale8)
static inline vec widen_u8(__m128i b) {  /* bytes 0..15 as 16 floats */
    vec r = {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)),
             _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)))};
    return r;
}
static inline vec widen_i8(__m128i b) {
    vec r = {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)),
             _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)))};
    return r;
}
static inline void unpack_q4(const uint8_t *q, vec *c) {
    __m128i b = _mm_loadu_si128((const __m128i *)q), mask = _mm_set1_epi8(0x0F);
    c[0] = widen_u8(_mm_and_si128(b, mask));
    c[1] = widen_u8(_mm_and_si128(_mm_srli_epi16(b, 4), mask));
}
static inline __m256 fifth8(uint32_t bits) {  /* 16.0f in lane i where bit i is set (of 8) */
    const __m256i lane = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256i set = _mm256_and_si256(_mm256_set1_epi32((int)(bits & 0xFF)), lane);
    return _mm256_and_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(set, lane)), _mm256_set1_ps(16.0f));
}
static inline void unpack_q5(const uint8_t *q, vec *c) {  /* q: the fifth bits, the nibbles */
    uint32_t bits;
    memcpy(&bits, q, 4);
    unpack_q4(q + 4, c);
    c[0].lo = _mm256_add_ps(c[0].lo, fifth8(bits));
    c[0].hi = _mm256_add_ps(c[0].hi, fifth8(bits >> 8));
    c[1].lo = _mm256_add_ps(c[1].lo, fifth8(bits >> 16));
    c[1].hi = _mm256_add_ps(c[1].hi, fifth8(bits >> 24));
}
static inline void unpack_q8(const uint8_t *q, vec *c) {
    c[0] = widen_i8(_mm_loadu_si128((const __m128i *)q));
    c[1] = widen_i8(_mm_loadu_si128((const __m128i *)(q + 16)));
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
static inline void unpack_q5(const uint8_t *q, vec *c) {  /* q: the fifth bits, the nibbles */
    uint32_t bits;
    memcpy(&bits, q, 4);
    unpack_q4(q + 4, c);
    for (int i = 0; i < 16; i++) {
        c[0].v[i] += (bits >> i & 1) * 16;
        c[1].v[i] += (bits >> (16 + i) & 1) * 16;
    }
}
static inline void unpack_q8(const uint8_t *q, vec *c) {
    for (int i = 0; i < 16; i++) { c[0].v[i] = (int8_t)q[i]; c[1].v[i] = (int8_t)q[16 + i]; }
}
#endif

/* the vector width the kernels were built for: 512 (AVX-512), 256 (AVX2 + FMA) or 0 (plain C,
   about ten times slower) */
int vector_bits(void)
{
#if defined(__AVX512F__)
    return 512;
#elif defined(__AVX2__) && defined(__FMA__)
    return 256;
#else
    return 0;
#endif
}

/* work below which a kernel runs on the calling thread alone (set_parallel_min), in units of
   about one float32 multiply-add at 16 rows of a q4 matmul on one core (~30 ps): a matmul of M
   rows costs (M + 2) N K (unpacking a weight costs about two), an attention 8 positions H D */
static int64_t parallel_min = 0;

void set_parallel_min(int64_t n) { parallel_min = n; }

/* --- bfloat16 products (matmul_precision "bfloat16") --------------------------------------
   x's rows and each block's float32 weights rounded to bfloat16 (to nearest, ties to even), the
   products summed in float32: an output lane accumulates inputs 2i + 1 then 2i of each group,
   as AVX512-BF16's dot product does; a CPU without it gets the same sums one product at a
   time (slowly: for tests) */
static inline uint16_t bf16_of(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  /* NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float float_of(uint16_t b)
{
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

#ifdef __AVX512BF16__
typedef __m512bh bvec;  /* a group's 32 bfloat16 values */
static inline bvec bload(const uint16_t *p) { return (bvec)_mm512_loadu_si512(p); }
static inline bvec bround(const vec *w) { return _mm512_cvtne2ps_pbh(w[1], w[0]); }
static inline vec BDOT(vec acc, bvec a, bvec b) { return _mm512_dpbf16_ps(acc, a, b); }
static inline void bf16_row(const float *x, uint16_t *out, int64_t K)
{
    int64_t i = 0;
    for (; i + 16 <= K; i += 16)
        _mm256_storeu_si256((__m256i *)(out + i),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i)));
    for (; i < K; i++) out[i] = bf16_of(x[i]);
}
#else
typedef struct { uint16_t v[GROUP]; } bvec;
static inline bvec bload(const uint16_t *p) { bvec r; memcpy(r.v, p, sizeof r.v); return r; }
static inline bvec bround(const vec *w)
{
    float f[GROUP];
    bvec r;
    memcpy(f, w, sizeof f);
    for (int i = 0; i < GROUP; i++) r.v[i] = bf16_of(f[i]);
    return r;
}
static inline vec BDOT(vec acc, bvec a, bvec b)
{
    float s[LANES];
    memcpy(s, &acc, sizeof s);
    for (int i = 0; i < LANES; i++) {  /* each product is exact in float32: one rounding each */
        s[i] += float_of(a.v[2 * i + 1]) * float_of(b.v[2 * i + 1]);
        s[i] += float_of(a.v[2 * i]) * float_of(b.v[2 * i]);
    }
    memcpy(&acc, s, sizeof s);
    return acc;
}
static inline void bf16_row(const float *x, uint16_t *out, int64_t K)
{
    for (int64_t i = 0; i < K; i++) out[i] = bf16_of(x[i]);
}
#endif

/* 1 where the bfloat16 products run on the CPU's own dot products (AVX512-BF16) */
int native_bf16(void)
{
#ifdef __AVX512BF16__
    return 1;
#else
    return 0;
#endif
}

/* rows of x [M, K] float32 -> bfloat16 (as torch rounds: to nearest, ties to even) */
void to_bf16(const float *x, uint16_t *out, int64_t M, int64_t K)
{
    #pragma omp parallel for schedule(static) if (M * K >= parallel_min && M > 1)
    for (int64_t r = 0; r < M; r++) bf16_row(x + r * K, out + r * K, K);
}

/* unpack one block into its 32 float32 weights, w[0] inputs 0..15, w[1] 16..31: exactly
   gguf's values (d * code is exact in float32: 11 bits times 4 or 8; + m rounds once) */
static inline void weights_q4_1(const uint8_t *b, vec *w) {
    vec c[2];
    unpack_q4(b + Q4_CODES, c);
    vec d = VSET1(single(b)), m = VSET1(single(b + 4));
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

static inline void weights_q5_0(const uint8_t *b, vec *w) {
    vec c[2];
    unpack_q5(b + Q5_BITS, c);
    vec d = VSET1(single(b)), m = VSET1(single(b + 4));
    w[0] = VFMA(c[0], d, m);
    w[1] = VFMA(c[1], d, m);
}

static inline void weights_q8_16(const uint8_t *b, vec *w) {
    vec c[2];
    unpack_q8(b + Q8_16_CODES, c);
    w[0] = VFMA(c[0], VSET1(single(b)), VSET1(single(b + 4)));
    w[1] = VFMA(c[1], VSET1(single(b + 8)), VSET1(single(b + 12)));
}

/* the 32 weights of a block of `bs` bytes (Q4_BYTES, Q5_BYTES, Q8_0_BYTES or Q8_16_BYTES) */
static inline __attribute__((always_inline)) void weights_of(const uint8_t *b, int bs, vec *w) {
    if (bs == Q4_BYTES) weights_q4_1(b, w);
    else if (bs == Q5_BYTES) weights_q5_0(b, w);
    else if (bs == Q8_16_BYTES) weights_q8_16(b, w);
    else weights_q8_0(b, w);
}

/* one block's 32 weights rounded to bfloat16: with AVX512-BF16, a Q4_1 block's 16 values
   d * k + m (k = 0..15, the same float32 operation as weights_q4_1) rounded once and looked
   up by code, the same bits as rounding each weight */
static inline bvec bweights(const uint8_t *b, int bs) {
    vec wv[2];
#ifdef __AVX512BF16__
    if (bs == Q4_BYTES) {
        const __m512 k = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512 values = _mm512_fmadd_ps(k, VSET1(single(b)), VSET1(single(b + 4)));
        const __m512i table = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(values));
        const __m128i q = _mm_loadu_si128((const __m128i *)(b + Q4_CODES));
        const __m128i mask = _mm_set1_epi8(0x0F);
        const __m256i codes = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), mask),
                                               _mm_and_si128(q, mask));
        return (bvec)_mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(codes), table);
    }
#endif
    weights_of(b, bs, wv);
    return bround(wv);
}

/* blocks of a weight row fetched ahead of their use: the hardware's prefetcher alone kept a
   one-row matmul streaming the Q8_0 head at ~10 GB/s of the ~30 two cores read (2.9 -> 1.3 ms
   a call with it) */
#define AHEAD 8

/* a tile's accumulators: zeroed, and their sums stored as y[r0.., n..] */
static inline __attribute__((always_inline)) void tile_zero(vec acc[4][ROWS], int nr, int nw)
{
    for (int j = 0; j < nw; j++)
        for (int r = 0; r < nr; r++) acc[j][r] = VZERO;
}

static inline __attribute__((always_inline)) void tile_store(
    vec acc[4][ROWS], float *y, int64_t r0, int nr, int64_t n, int nw, int64_t N)
{
    for (int j = 0; j < nw; j++)
        for (int r = 0; r < nr; r++) y[(r0 + r) * N + n + j] = vsum(acc[j][r]);
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
    tile_zero(acc, nr, nw);
    for (int64_t g = 0; g < G; g++) {
        for (int j = 0; j < nw; j++) {
            vec wv[2];
            const uint8_t *b = w + ((n + j) * G + g) * bs;
            __builtin_prefetch(b + AHEAD * bs);
            weights_of(b, bs, wv);
            for (int r = 0; r < nr; r++) {
                const float *xr = x + (r0 + r) * K + g * GROUP;
                acc[j][r] = VFMA(wv[0], vload(xr), acc[j][r]);
                acc[j][r] = VFMA(wv[1], vload(xr + LANES), acc[j][r]);
            }
        }
    }
    tile_store(acc, y, r0, nr, n, nw, N);
}

/* tile_dot's outputs in bfloat16 products: xb, x's rows in bfloat16; each weight block rounded
   once for the tile's rows (one function with tile_dot and a branch on the products made
   float32's 16-row tiles ~1.5x slower: the compiler no longer kept them in registers) */
static inline __attribute__((always_inline)) void tile_dot_bf16(
    const uint16_t *xb, const uint8_t *w, float *y, int64_t r0, int nr, int64_t n, int nw,
    int64_t N, int64_t K, int64_t G, int bs)
{
    vec acc[4][ROWS];
    tile_zero(acc, nr, nw);
    for (int64_t g = 0; g < G; g++) {
        for (int j = 0; j < nw; j++) {
            const uint8_t *b = w + ((n + j) * G + g) * bs;
            __builtin_prefetch(b + AHEAD * bs);
            const bvec wb = bweights(b, bs);
            for (int r = 0; r < nr; r++)
                acc[j][r] = BDOT(acc[j][r], wb, bload(xb + (r0 + r) * K + g * GROUP));
        }
    }
    tile_store(acc, y, r0, nr, n, nw, N);
}

/* x's rows in float32 or, with xb, in bfloat16 (then x is not read) */
#define TILE(r0, nr, n, nw) (xb ? tile_dot_bf16(xb, w, y, r0, nr, n, nw, N, K, G, bs) \
                               : tile_dot(x, w, y, r0, nr, n, nw, N, K, G, bs))

#define WIDE 4  /* weight rows per tile: a tile's outputs of every row of x */
#define TAIL(k, nw) case k: \
    for (int64_t j = n0; j + nw <= n1; j += nw) TILE(r0, k, j, nw); \
    for (int64_t j = n1 - (n1 - n0) % nw; j < n1; j++) TILE(r0, k, j, 1); \
    break;

/* the outputs n0..n0+WIDE (short of N) of every row of x (xb: in bfloat16, see TILE): one
   tile of a matmul's columns */
static inline __attribute__((always_inline)) void mm_tile(
    const float *x, const uint16_t *xb, const uint8_t *w, float *y, int64_t M, int64_t N,
    int64_t K, int bs, int64_t n0)
{
    const int64_t G = K / GROUP;
    int64_t n1 = n0 + WIDE < N ? n0 + WIDE : N, r0 = 0;
    for (; xb && r0 + ROWS <= M; r0 += ROWS)  /* a weight row at a time: its rounding, once */
        for (int64_t n = n0; n < n1; n++) TILE(r0, ROWS, n, 1);
    for (; r0 + ROWS <= M; r0 += ROWS)  /* as two halves, HALF_NW weight rows at a time */
        for (int64_t h = r0; h < r0 + ROWS; h += ROWS / 2) {
            int64_t n = n0;
            for (; n + HALF_NW <= n1; n += HALF_NW) TILE(h, ROWS / 2, n, HALF_NW);
            for (; n < n1; n++) TILE(h, ROWS / 2, n, 1);
        }
    switch (M - r0) {  /* constant sizes: the accumulators stay in registers */
    TAILS
    default: break;
    }
}

#define ROW_BLOCK 128  /* rows of x a pass over the weights takes (a prefill's), kept in cache */

static inline __attribute__((always_inline)) void blocks_mm(
    const float *x, const uint16_t *xb, const uint8_t *w, float *y, int64_t M, int64_t N,
    int64_t K, int bs)
{
    for (int64_t m0 = 0; m0 < M; m0 += ROW_BLOCK) {
        const int64_t m = M - m0 < ROW_BLOCK ? M - m0 : ROW_BLOCK;
        const float *xm = x ? x + m0 * K : NULL;
        const uint16_t *xbm = xb ? xb + m0 * K : NULL;
        #pragma omp parallel for schedule(static) if ((m + 2) * N * K >= parallel_min)
        for (int64_t n0 = 0; n0 < N; n0 += WIDE) mm_tile(xm, xbm, w, y + m0 * N, m, N, K, bs, n0);
    }
}

void q4_1_mm(const float *x, const uint8_t *w, float *y, int64_t M, int64_t N, int64_t K)
{
    blocks_mm(x, NULL, w, y, M, N, K, Q4_BYTES);
}

void q8_0_mm(const float *x, const uint8_t *w, float *y, int64_t M, int64_t N, int64_t K)
{
    blocks_mm(x, NULL, w, y, M, N, K, Q8_0_BYTES);
}

void q5_0_mm(const float *x, const uint8_t *w, float *y, int64_t M, int64_t N, int64_t K)
{
    blocks_mm(x, NULL, w, y, M, N, K, Q5_BYTES);
}

void q8_16_mm(const float *x, const uint8_t *w, float *y, int64_t M, int64_t N, int64_t K)
{
    blocks_mm(x, NULL, w, y, M, N, K, Q8_16_BYTES);
}

/* the same in bfloat16 products: xb, x's rows in bfloat16 (to_bf16) */
void q4_1_mm_bf16(const uint16_t *xb, const uint8_t *w, float *y, int64_t M, int64_t N,
                  int64_t K)
{
    blocks_mm(NULL, xb, w, y, M, N, K, Q4_BYTES);
}

void q8_0_mm_bf16(const uint16_t *xb, const uint8_t *w, float *y, int64_t M, int64_t N,
                  int64_t K)
{
    blocks_mm(NULL, xb, w, y, M, N, K, Q8_0_BYTES);
}

void q5_0_mm_bf16(const uint16_t *xb, const uint8_t *w, float *y, int64_t M, int64_t N,
                  int64_t K)
{
    blocks_mm(NULL, xb, w, y, M, N, K, Q5_BYTES);
}

void q8_16_mm_bf16(const uint16_t *xb, const uint8_t *w, float *y, int64_t M, int64_t N,
                   int64_t K)
{
    blocks_mm(NULL, xb, w, y, M, N, K, Q8_16_BYTES);
}

/* the float32 matrix [N, K] of Q4_1 rows (Q4_BYTES blocks), as gguf computes it: d * code + m */
void q4_1_dequant(const uint8_t *w, float *out, int64_t N, int64_t K)
{
    const int64_t G = K / GROUP;
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        for (int64_t g = 0; g < G; g++) {
            const uint8_t *b = w + (n * G + g) * Q4_BYTES;
            vec wv[2];
            weights_q4_1(b, wv);
            memcpy(out + n * K + g * GROUP, &wv, sizeof wv);
        }
    }
}

#define CHUNK 64  /* positions scored at a time */

#if defined(__AVX512F__) || defined(__AVX2__) && defined(__FMA__)
/* e^x for x in -87..88 (clamped to it), within ~2 ulp: 2^n e^r, n = round(x log2 e),
   |r| <= ln2/2 */
static inline vec vexp(vec x) {
    x = VMIN(VMAX(x, VSET1(-87.0f)), VSET1(88.0f));
    vec n = VROUND(VMUL(x, VSET1(1.44269504088896341f)));
    vec r = VFMA(n, VSET1(-0.693359375f), x);
    r = VFMA(n, VSET1(2.12194440e-4f), r);
    vec p = VSET1(1.9875691500e-4f);
    p = VFMA(p, r, VSET1(1.3981999507e-3f));
    p = VFMA(p, r, VSET1(8.3334519073e-3f));
    p = VFMA(p, r, VSET1(4.1665795894e-2f));
    p = VFMA(p, r, VSET1(1.6666665459e-1f));
    p = VFMA(p, r, VSET1(5.0000001201e-1f));
    p = VFMA(VMUL(p, r), r, r);
    return VSCALE(VADD(p, VSET1(1.0f)), n);
}
#else
static inline vec vexp(vec x) { for (int i = 0; i < LANES; i++) x.v[i] = expf(x.v[i]); return x; }
#endif

#define MAX_DV 16  /* vectors of a head's row: D <= 256 */
#define MAX_GROUP 8  /* query heads attended at a time over one KV head's rows */

/* one query token per sequence over its cached positions 0..len-1 (paged KV cache, float32):
   query heads h0..h0+nq of sequence b, all of KV head g, each K and V row read once for them;
   softmax in float32 a chunk of positions at a time (rescaled when the running maximum grows);
   len 0 gives zeros. q, out: [B, H, D] with row strides qs, os (elements); caches [blocks, BS,
   KVH, D]; D = DV * LANES. A head's bits do not depend on nq (each head's sums are its own).
   With `tree` (a draft tree's node), the row's positions from bases[b] on are read where
   remap[b * RA + p - bases[b]] says (its ancestors' rows, then its own): the same sums, chunk
   by chunk, as a plain decode row over those keys at positions 0..len-1 */
typedef struct { const int32_t *bases, *remap; int64_t RA; } tree_keys;

static inline __attribute__((always_inline)) void attend_heads(
    const float *q, int64_t qs, const float *kc, const float *vc, const int32_t *tables,
    const int32_t *lens, float *out, int64_t os, int64_t b, int64_t h0, int nq, int64_t g,
    int64_t KVH, const int DV, int64_t BS, int64_t NB, float scale, const tree_keys *tree)
{
    const int64_t D = (int64_t)DV * LANES;
    vec acc[MAX_GROUP][MAX_DV];
    float score[MAX_GROUP][CHUNK], top[MAX_GROUP], total[MAX_GROUP];
    for (int a = 0; a < nq; a++) {
        top[a] = -INFINITY;
        total[a] = 0.0f;
        for (int c = 0; c < DV; c++) acc[a][c] = VZERO;
    }
    for (int64_t p0 = 0; p0 < lens[b]; p0 += CHUNK) {
        const int64_t n = lens[b] - p0 < CHUNK ? lens[b] - p0 : CHUNK;
        const float *vrow[CHUNK];
        float most[MAX_GROUP];
        for (int a = 0; a < nq; a++) most[a] = -INFINITY;
        for (int64_t j = 0; j < n; j++) {
            int64_t p = p0 + j;
            if (tree && p >= tree->bases[b]) p = tree->remap[b * tree->RA + p - tree->bases[b]];
            const int64_t at = (((int64_t)tables[b * NB + p / BS] * BS + p % BS) * KVH + g) * D;
            vec k[MAX_DV];
            for (int c = 0; c < DV; c++) k[c] = vload(kc + at + c * LANES);
            vrow[j] = vc + at;
            for (int a = 0; a < nq; a++) {
                const float *qh = q + b * qs + (h0 + a) * D;
                vec dot = VZERO;
                for (int c = 0; c < DV; c++) dot = VFMA(vload(qh + c * LANES), k[c], dot);
                const float sc = vsum(dot) * scale;
                score[a][j] = sc;
                most[a] = sc > most[a] ? sc : most[a];
            }
        }
        for (int a = 0; a < nq; a++) {
            for (int64_t j = n; j < CHUNK; j++) score[a][j] = -INFINITY;
            if (most[a] > top[a]) {
                const float shrink = expf(top[a] - most[a]);
                for (int c = 0; c < DV; c++) acc[a][c] = VMUL(acc[a][c], VSET1(shrink));
                total[a] *= shrink;
                top[a] = most[a];
            }
            for (int64_t j = 0; j < n; j += LANES) {
                vec e = vexp(VSUB(vload(score[a] + j), VSET1(top[a])));
                memcpy(score[a] + j, &e, sizeof e);
            }
        }
        for (int64_t j = 0; j < n; j++) {
            vec v[MAX_DV];
            for (int c = 0; c < DV; c++) v[c] = vload(vrow[j] + c * LANES);
            for (int a = 0; a < nq; a++) {
                total[a] += score[a][j];
                const vec w = VSET1(score[a][j]);
                for (int c = 0; c < DV; c++) acc[a][c] = VFMA(w, v[c], acc[a][c]);
            }
        }
    }
    for (int a = 0; a < nq; a++) {
        float *o = out + b * os + (h0 + a) * D;
        const vec inv = VSET1(total[a] > 0.0f ? 1.0f / total[a] : 0.0f);
        for (int c = 0; c < DV; c++) {
            const vec y = VMUL(acc[a][c], inv);
            memcpy(o + c * LANES, &y, sizeof y);
        }
    }
}

/* the query heads of sequence b over KV head g (H / KVH of them, MAX_GROUP at a time), with
   the row's vector count known to the compiler for the common head sizes (64, 128) */
static void attend_group(const float *q, int64_t qs, const float *kc, const float *vc,
                         const int32_t *tables, const int32_t *lens, float *out, int64_t os,
                         int64_t b, int64_t g, int64_t H, int64_t KVH, int64_t D, int64_t BS,
                         int64_t NB, float scale, const tree_keys *tree)
{
    const int64_t per_kv = H / KVH;
    for (int64_t a = 0; a < per_kv; a += MAX_GROUP) {
        const int nq = per_kv - a < MAX_GROUP ? (int)(per_kv - a) : MAX_GROUP;
        const int64_t h0 = g * per_kv + a;
        if (D == 4 * LANES)
            attend_heads(q, qs, kc, vc, tables, lens, out, os, b, h0, nq, g, KVH, 4, BS, NB,
                         scale, tree);
        else if (D == 8 * LANES)
            attend_heads(q, qs, kc, vc, tables, lens, out, os, b, h0, nq, g, KVH, 8, BS, NB,
                         scale, tree);
        else
            attend_heads(q, qs, kc, vc, tables, lens, out, os, b, h0, nq, g, KVH,
                         (int)(D / LANES), BS, NB, scale, tree);
    }
}

static int64_t total_positions(const int32_t *lens, int64_t B)
{
    int64_t positions = 0;
    for (int64_t b = 0; b < B; b++) positions += lens[b];
    return positions;
}

void decode_attention(const float *q, int64_t qs, const float *kc, const float *vc,
                      const int32_t *tables, const int32_t *lens, float *out, int64_t os,
                      int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t BS, int64_t NB,
                      float scale, const int32_t *bases, const int32_t *remap, int64_t RA)
{
    const int64_t positions = total_positions(lens, B);
    const tree_keys keys = {bases, remap, RA}, *tree = remap ? &keys : NULL;
    #pragma omp parallel for collapse(2) schedule(static) if (8 * positions * H * D >= parallel_min)
    for (int64_t b = 0; b < B; b++)
        for (int64_t g = 0; g < KVH; g++)
            attend_group(q, qs, kc, vc, tables, lens, out, os, b, g, H, KVH, D, BS, NB, scale,
                         tree);
}

/* rotate q and k of each token (Hugging Face's halves: x1 cos - x2 sin, x2 cos + x1 sin, the
   same float32 operations as llama.apply_rope), q in place in qkv, k and v into flat slot
   slots[t] of the caches (none where negative); qkv: [T, (H + 2 KVH) * D], row stride qs;
   cos, sin: [P, D / 2]; caches [blocks, BS, KVH, D] float32 */
static void rope_row(float *qkv, int64_t qs, const float *cos, const float *sin,
                     const int64_t *pos, const int64_t *slots, float *kc, float *vc,
                     int64_t t, int64_t H, int64_t KVH, int64_t D)
{
    const int64_t half = D / 2;
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

void rope_write_kv(float *qkv, int64_t qs, const float *cos, const float *sin,
                   const int64_t *pos, const int64_t *slots, float *kc, float *vc,
                   int64_t T, int64_t H, int64_t KVH, int64_t D)
{
    #pragma omp parallel for schedule(static) if (T > 8)
    for (int64_t t = 0; t < T; t++) rope_row(qkv, qs, cos, sin, pos, slots, kc, vc, t, H, KVH, D);
}

/* --- norms and the MLP's activation, for the decode step and its single-call twins ---------- */

/* rows r0..r1 of x [., E] normed into out: x * (1 / sqrt(mean(x^2) + eps)) * w, the squares
   summed in LANES partial sums left to right, then across the lanes: one order for every row */
static void rms_norm_rows(const float *x, const float *w, float *out, int64_t r0, int64_t r1,
                          int64_t E, float eps)
{
    for (int64_t r = r0; r < r1; r++) {
        const float *xr = x + r * E;
        float *o = out + r * E;
        vec ss = VZERO;
        int64_t i = 0;
        for (; i + LANES <= E; i += LANES) {
            vec v = vload(xr + i);
            ss = VFMA(v, v, ss);
        }
        float sum = vsum(ss);
        for (; i < E; i++) sum += xr[i] * xr[i];
        const float inv = 1.0f / sqrtf(sum / (float)E + eps);
        for (int64_t j = 0; j < E; j++) o[j] = xr[j] * inv * w[j];
    }
}

/* rows r0..r1 of out [M, I]: silu(gate) * up, gate and up the halves of gu's rows [M, 2 I]:
   g / (1 + e^-g) * up, LANES at a time (vexp), a row's last I % LANES one by one (expf); an
   element's operations depend only on its column */
static void silu_mul_rows(const float *gu, float *out, int64_t I, int64_t r0, int64_t r1)
{
    for (int64_t r = r0; r < r1; r++) {
        const float *gate = gu + r * 2 * I, *up = gate + I;
        float *o = out + r * I;
        int64_t i = 0;
#if defined(__AVX512F__) || defined(__AVX2__) && defined(__FMA__)
        for (; i + LANES <= I; i += LANES) {
            const vec g = vload(gate + i);
            const vec y = VMUL(VDIV(g, VADD(VSET1(1.0f), vexp(VSUB(VZERO, g)))), vload(up + i));
            memcpy(o + i, &y, sizeof y);
        }
#endif
        for (; i < I; i++) o[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
    }
}

void rms_norm(const float *x, const float *w, float *out, int64_t M, int64_t E, float eps)
{
    #pragma omp parallel for schedule(static) if (4 * M * E >= parallel_min && M > 1)
    for (int64_t r = 0; r < M; r++) rms_norm_rows(x, w, out, r, r + 1, E, eps);
}

void silu_mul(const float *gu, float *out, int64_t M, int64_t I)
{
    #pragma omp parallel for schedule(static) if (16 * M * I >= parallel_min && M > 1)
    for (int64_t r = 0; r < M; r++) silu_mul_rows(gu, out, I, r, r + 1);
}

/* --- a whole decode step in one parallel region --------------------------------------------- */

/* the threads of a region meet here between the step's stages: they spin (a region's stages
   are microseconds apart, and a passive pool's barrier would put them to sleep at each one),
   yielding the core now and then in case a peer lost its own */
typedef struct { atomic_int arrived; atomic_int round; } spin_barrier;

static void barrier_wait(spin_barrier *b, int nt)
{
    if (nt == 1) return;
    const int round = atomic_load_explicit(&b->round, memory_order_acquire);
    if (atomic_fetch_add_explicit(&b->arrived, 1, memory_order_acq_rel) == nt - 1) {
        atomic_store_explicit(&b->arrived, 0, memory_order_relaxed);
        atomic_store_explicit(&b->round, round + 1, memory_order_release);
        return;
    }
    for (int spins = 1; atomic_load_explicit(&b->round, memory_order_acquire) == round; spins++) {
        _mm_pause();
        if (spins % 4096 == 0) sched_yield();
    }
}

#define PTR(type, a, i) ((type)(intptr_t)(a)[i])
#define SHARE(n, a, b) const int64_t a = (n) * tid / nt, b = (n) * (tid + 1) / nt

/* this thread's share of y = x @ W[j]^T (layer matrix j of w, blocks of bs[j] bytes), tiled
   as blocks_mm tiles it; then the threads meet. With xb (bfloat16 products) the tiles read x's
   rows from there: the stage that wrote x wrote them rounded there too */
static void mm_stage(const float *x, const uint16_t *xb, const int64_t *w, const int32_t *bs,
                     int64_t j, float *y, int64_t M, int64_t N, int64_t K, spin_barrier *bar,
                     int tid, int nt)
{
    const uint8_t *blocks = (const uint8_t *)(intptr_t)w[j];
    const int64_t tiles = (N + WIDE - 1) / WIDE;
    for (int64_t t = tiles * tid / nt; t < tiles * (tid + 1) / nt; t++)
        mm_tile(x, xb, blocks, y, M, N, K, bs[j], t * WIDE);
    barrier_wait(bar, nt);
}

/* this thread's rows of the residual stream h += d (d NULL: none), then x = RMSNorm(h) by w
   (and in bfloat16 into xb, unless NULL); then the threads meet */
static void add_norm_stage(float *h, const float *d, const float *w, float *x, uint16_t *xb,
                           int64_t M, int64_t E, float eps, spin_barrier *bar, int tid, int nt)
{
    SHARE(M, r0, r1);
    if (d)
        for (int64_t i = r0 * E; i < r1 * E; i++) h[i] = h[i] + d[i];
    rms_norm_rows(h, w, x, r0, r1, E, eps);
    if (xb) bf16_row(x + r0 * E, xb + r0 * E, (r1 - r0) * E);
    barrier_wait(bar, nt);
}

/* every decoder layer for M decode rows, as the single kernels compute each output (so a row
   gets the same bits here as through rms_norm, the block matmuls (q4_1_mm, ...), rope_write_kv,
   decode_attention and silu_mul, one call each), in one parallel region: a sleeping pool is
   woken once a step instead of once a kernel.  h [M, E]: the embeddings, then the residual
   stream (in place); out [M, E]: the final norm's output.  Layer l: blocks w[4l..4l+3] (qkv,
   wo, gate_up, down) of bs[...] bytes (Q4_BYTES, Q5_BYTES, Q8_0_BYTES, Q8_16_BYTES); norms[2l],
   norms[2l+1] (attention, MLP) and norms[2L] (final) float32 [E]; bias[l]: the qkv matmul's
   bias float32 [(H+2KVH) D] (Qwen2's), added to each row before rotary (bias NULL: none);
   qkn[2l], qkn[2l+1]: the q and k heads' RMSNorm weights float32 [D] (Qwen3's), each q and k
   head normed after the bias, before rotary, as rms_norm norms a row (qkn NULL: none);
   caches kc[l], vc[l].
   Scratch: qkv [M, (H+2KVH) D], att [M, H D], gu [M, 2 I], act [M, I], tmp [M, E]; xb [M,
   max(E, H D, I)] for bfloat16 products, NULL for float32. bases, remap, RA: draft tree rows
   as decode_attention's, or NULL */
void decode_step(float *h, float *out, const int64_t *w, const int32_t *bs, const int64_t *norms,
                 const int64_t *bias, const int64_t *qkn, const int64_t *kc, const int64_t *vc,
                 const float *cos, const float *sin,
                 const int64_t *pos, const int64_t *slots, const int32_t *tables,
                 const int32_t *lens, float *qkv, float *att, float *gu, float *act, float *tmp,
                 uint16_t *xb, int64_t M, int64_t E, int64_t H, int64_t KVH, int64_t D,
                 int64_t I, int64_t L, int64_t BS, int64_t NB, float eps, float scale,
                 const int32_t *bases, const int32_t *remap, int64_t RA)
{
    const int64_t QKV = (H + 2 * KVH) * D, HD = H * D;
    const tree_keys keys = {bases, remap, RA}, *tree = remap ? &keys : NULL;
    const int64_t work = L * ((M + 2) * (QKV * E + E * HD + 3 * I * E)
                              + 8 * total_positions(lens, M) * HD);
    spin_barrier bar = {0, 0};
    #pragma omp parallel if (work >= parallel_min)
    {
        const int nt = omp_get_num_threads(), tid = omp_get_thread_num();
        float *x = out;  /* each stage's normed input, the final norm's output at the end */
        add_norm_stage(h, NULL, PTR(const float *, norms, 0), x, xb, M, E, eps, &bar, tid, nt);
        for (int64_t l = 0; l < L; l++) {
            float *k = PTR(float *, kc, l), *v = PTR(float *, vc, l);
            mm_stage(x, xb, w, bs, 4 * l, qkv, M, QKV, E, &bar, tid, nt);
            {
                SHARE(M, r0, r1);
                const float *b = bias ? PTR(const float *, bias, l) : NULL;
                for (int64_t t = r0; t < r1; t++) {
                    float *row = qkv + t * QKV;
                    if (b)  /* as torch's qkv + bias: one float32 add an element */
                        for (int64_t i = 0; i < QKV; i++) row[i] += b[i];
                    if (qkn) {  /* each head a row of D, normed in place */
                        rms_norm_rows(row, PTR(const float *, qkn, 2 * l), row, 0, H, D, eps);
                        rms_norm_rows(row + HD, PTR(const float *, qkn, 2 * l + 1), row + HD, 0,
                                      KVH, D, eps);
                    }
                    rope_row(qkv, QKV, cos, sin, pos, slots, k, v, t, H, KVH, D);
                }
            }
            barrier_wait(&bar, nt);
            {
                SHARE(M * KVH, p0, p1);  /* (sequence, KV head) pairs */
                for (int64_t p = p0; p < p1; p++)
                    attend_group(qkv, QKV, k, v, tables, lens, att, HD, p / KVH, p % KVH, H, KVH,
                                 D, BS, NB, scale, tree);
                const int64_t from = p0 * (H / KVH) * D, to = p1 * (H / KVH) * D;  /* of att */
                if (xb) bf16_row(att + from, xb + from, to - from);
            }
            barrier_wait(&bar, nt);
            mm_stage(att, xb, w, bs, 4 * l + 1, tmp, M, E, HD, &bar, tid, nt);
            add_norm_stage(h, tmp, PTR(const float *, norms, 2 * l + 1), x, xb, M, E, eps, &bar,
                           tid, nt);
            mm_stage(x, xb, w, bs, 4 * l + 2, gu, M, 2 * I, E, &bar, tid, nt);
            {
                SHARE(M, r0, r1);
                silu_mul_rows(gu, act, I, r0, r1);
                if (xb) bf16_row(act + r0 * I, xb + r0 * I, (r1 - r0) * I);
            }
            barrier_wait(&bar, nt);
            mm_stage(act, xb, w, bs, 4 * l + 3, tmp, M, E, I, &bar, tid, nt);
            add_norm_stage(h, tmp, PTR(const float *, norms, 2 * l + 2), x, xb, M, E, eps, &bar,
                           tid, nt);
        }
    }
}
