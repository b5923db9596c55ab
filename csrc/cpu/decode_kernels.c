/* CPU decode kernels (float32, OpenMP), loaded with ctypes by vllm/kernels/cpu_kernels.py.

   Decode steps multiply a few rows by every weight matrix, so they are bound by how fast the
   weights stream from memory. Each weight is packed once into column panels; a pass streams each
   panel once for up to ROWS input rows and prefetches the next panels into L2, so that the
   weight stream, not the arithmetic or a late cache miss, sets the pace.

   Plain C with GCC vector extensions, no torch headers, one translation unit, built once per
   instruction set (vllm/kernels/cpu_kernels.py passes the -m flags and one of these macros):
     VTOK_ISA_AVX512  64-byte vectors, 32 registers: 8 x 1 and 12 x 2 vector GEMM blocks
     VTOK_ISA_AVX2    32-byte vectors, 16 registers: 3 x 1 (split chains) and 6 x 2
                      (accumulators + weights + one broadcast fit in 16 ymm; a larger block
                      spills)
     (neither)        generic: 16-byte vectors the compiler maps to SSE2, NEON or scalar code */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(VTOK_ISA_AVX512) || defined(VTOK_ISA_AVX2)
#include <immintrin.h>        /* F16C: the fp8 cache's widening (fp8_load) */
#endif

#if defined(VTOK_ISA_AVX512)
#define VEC 16                /* floats per vector */
#define ROWS 8                /* at most this many rows: passes over one panel, ROWS accumulators */
#define PAIR_ROWS 12          /* more rows: passes over two panels, 2 x PAIR_ROWS accumulators */
#define AV_HEADS 4            /* attention values: heads x vectors of accumulators at a time */
#define SPLIT_1ROW 1          /* accumulator chains of a one-row pass (see panel_pass_split) */
#define PREFILL_PREFETCH 0    /* prefill passes prefetch the next pair of panels (panel_rows) */
#define ISA_NAME "avx512"
#elif defined(VTOK_ISA_AVX2)
#define VEC 8
#define ROWS 3                /* 1-3 rows: split one-panel passes; from 4 rows, pairs */
#define PAIR_ROWS 6
#define AV_HEADS 2
#define SPLIT_1ROW 4
#define PREFILL_PREFETCH 1
#define ISA_NAME "avx2"
#else
#define VEC 4
#define ROWS 12
#define PAIR_ROWS 6
#define AV_HEADS 2
#define SPLIT_1ROW 4
#define PREFILL_PREFETCH 0
#define ISA_NAME "generic"
#endif
#define PANEL VEC             /* output columns per packed panel: one vector */
#define TILE (ROWS > PAIR_ROWS ? ROWS : PAIR_ROWS)   /* most rows of any pass */
#define AV_VECS 4
#define PREFETCH_KEYS 64      /* attention: keys ahead whose K / V rows are prefetched into L2 */
#define L1_AHEAD_VALUES 16    /* attention values: keys ahead whose V rows are fetched into L1 */
#define PREFETCH_PASSES 8     /* at most this many passes over panels: prefetch the next */

typedef float vec __attribute__((vector_size(4 * VEC)));
typedef int32_t ivec __attribute__((vector_size(4 * VEC)));
typedef uint32_t uvec __attribute__((vector_size(4 * VEC)));
typedef uint16_t hvec __attribute__((vector_size(2 * VEC)));

static inline vec load(const float *p) { vec v; memcpy(&v, p, sizeof v); return v; }
static inline void store(float *p, vec v) { memcpy(p, &v, sizeof v); }
/* s - 0 is s for every s, so this is one broadcast; (vec){0} + s would keep an add per call
   (-0 + 0 is +0, so the compiler may not drop it) */
static inline vec splat(float s) { return s - (vec){0}; }
/* VEC weights from a packed panel at element i: float32, or bf16 (bf16 = 1) widened exactly (a
   bf16 is the top half of a float32: 0x3f80 -> 0x3f800000 = 1.0f); bf16 is a compile-time
   constant at every call site */
static inline __attribute__((always_inline)) vec load_w(const void *panel, int64_t i,
                                                        const int bf16) {
  if (!bf16) return load((const float *)panel + i);
#if defined(VTOK_ISA_AVX2)
  /* GCC compiles the portable form below to a slower sequence on AVX2: widen with vpmovzxwd
     (zero-extend to 32 bits) + vpslld (shift left 16) instead */
  return (vec)_mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)panel + i))), 16));
#elif defined(VTOK_ISA_AVX512)
  /* the same on 16 lanes: the portable form is slower here too */
  return (vec)_mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)panel + i))),
      16));
#else
  hvec h;
  memcpy(&h, (const uint16_t *)panel + i, sizeof h);
  uvec bits = __builtin_convertvector(h, uvec) << 16;
  vec v;
  memcpy(&v, &bits, sizeof v);
  return v;
#endif
}
static inline float hsum(vec v) {
  float s = 0.f;
  for (int i = 0; i < VEC; i++) s += v[i];
  return s;
}

/* what this build is, for vllm/kernels/cpu_kernels.py (pack_weight must use this build's PANEL) */
int vtok_panel_width(void) { return PANEL; }
const char *vtok_isa(void) { return ISA_NAME; }

/* ---- packed GEMM ------------------------------------------------------------------------------
   Packed weight layout (built by vllm/kernels/cpu_kernels.py pack_weight): W [K, N] (y = x @ W) is
   stored as panels[P][K][PANEL] with P = ceil(N / PANEL), columns past N zero. PANEL = 16,
   K = 2, N = 20:
       panel 0 = W[0, 0:16], W[1, 0:16]          panel 1 = W[0, 16:20] 0 0 ..., W[1, 16:20] 0 ...
   One panel row is one vector, so a pass reads the panel front to back exactly once per
   ROWS input rows. */

/* rows x[0:rows] (row stride K) times `width` (1 or 2) adjacent panels -> y[0:rows, 0:cols]
   (row stride N); rows and width are compile-time constants at every call site, so acc[][]
   lives in registers: ROWS x 1 for one pass over the weights (decode: memory-bound),
   PAIR_ROWS x 2 for more rows (each broadcast of x then feeds two FMAs: compute-bound).
   Where one panel stops paying: a one-panel pass issues a broadcast load of x per FMA, so from
   a few rows on the load ports, not the FMAs or the stream, set its pace; a pair halves those
   loads. ROWS is that threshold per build, found by timing a decode step's GEMMs at each row
   count: avx2 takes pairs from 4 rows, avx512 from 9 (a zmm panel row feeds 16 columns per
   broadcast: up to 8 rows one panel is as fast), generic from 13. Other CPUs may prefer other
   thresholds. */
static inline __attribute__((always_inline)) void store_rows(
    vec acc[TILE][2], float *y, int64_t N, int cols, const float *bias, const float *residual,
    const int rows, const int width) {
  float tmp[2 * PANEL] = {0};
  if (bias) memcpy(tmp, bias, cols * sizeof(float));
  vec b[2] = {load(tmp), load(tmp + PANEL)};
  for (int m = 0; m < rows; m++) {
    float out[2 * PANEL], res[2 * PANEL] = {0};
    if (residual) memcpy(res, residual + m * N, cols * sizeof(float));
    for (int v = 0; v < width; v++)
      store(out + v * PANEL, acc[m][v] + b[v] + load(res + v * PANEL));
    memcpy(y + m * N, out, cols * sizeof(float));
  }
}

static inline __attribute__((always_inline)) void panel_pass(
    const float *x, int64_t K, const void *panel, float *y, int64_t N, int cols,
    const float *bias, const float *residual, const char *pf, int64_t pf_step, const int rows,
    const int width, const int bf16) {
  const int es = bf16 ? 2 : 4;    /* bytes per weight */
  vec acc[TILE][2];
  for (int m = 0; m < rows; m++)
    for (int v = 0; v < width; v++) acc[m][v] = splat(0.f);
  /* pf_at: weights into pf, 16.16 fixed point in a general register (a float would take the
     vector register the 6 x 2 AVX2 block has no room for) */
  int64_t pf_at = 0;
  for (int64_t k = 0; k < K; k++, pf_at += pf_step) {
    if (pf)   /* loop-invariant: the compiler unswitches it */
      for (int v = 0; v < width; v++) __builtin_prefetch(pf + (pf_at >> 16) * es + 64 * v, 0, 2);
    vec w[2];
    for (int v = 0; v < width; v++) w[v] = load_w(panel, v * K * PANEL + k * PANEL, bf16);
    for (int m = 0; m < rows; m++) {
      vec b = splat(x[m * K + k]);
      for (int v = 0; v < width; v++) acc[m][v] += b * w[v];
    }
  }
  store_rows(acc, y, N, cols, bias, residual, rows, width);
}

/* One panel for 1-3 rows: a single accumulator per row is one dependent FMA chain (one FMA
   per FMA latency), which cannot keep up with a weight stream of 32-byte panel rows; `split`
   chains over interleaved k (chain s takes k = s, s + split, ...) are summed at the end.
   rows 1, split 4: acc[0][0..3], four independent FMAs per four panel rows. A 64-byte panel row
   carries twice the weights per FMA, so a single chain keeps up with the stream and splitting
   it only slows the stream: SPLIT_1ROW is 1 on avx512. */
static inline __attribute__((always_inline)) void panel_pass_split(
    const float *x, int64_t K, const void *panel, float *y, int64_t N, int cols,
    const float *bias, const float *residual, const char *pf, const int rows,
    const int split, const int bf16) {
  const int es = bf16 ? 2 : 4;
  vec acc[3][4];
  for (int m = 0; m < rows; m++)
    for (int s = 0; s < split; s++) acc[m][s] = splat(0.f);
  int64_t k = 0;
  for (; k + split <= K; k += split) {
    if (pf)   /* loop-invariant: the compiler unswitches it */
      for (int f = 0; f < split * PANEL * es; f += 64)
        __builtin_prefetch(pf + k * PANEL * es + f, 0, 2);
    for (int s = 0; s < split; s++) {
      vec w = load_w(panel, (k + s) * PANEL, bf16);
      for (int m = 0; m < rows; m++) acc[m][s] += splat(x[m * K + k + s]) * w;
    }
  }
  for (; k < K; k++) {
    vec w = load_w(panel, k * PANEL, bf16);
    for (int m = 0; m < rows; m++) acc[m][0] += splat(x[m * K + k]) * w;
  }
  vec sum[TILE][2];
  for (int m = 0; m < rows; m++) {
    sum[m][0] = acc[m][0];
    for (int s = 1; s < split; s++) sum[m][0] += acc[m][s];
  }
  store_rows(sum, y, N, cols, bias, residual, rows, 1);
}

/* a case for every row count up to 16; those past this build's tile are never reached */
#define PASS(r, w) case r: \
  if (r <= (w == 1 ? ROWS : PAIR_ROWS)) panel_pass(xm, K, panel, ym, N, cols, bias_p, res, pf, pf_step, r, w, bf16); \
  break;
#define PASSES(w) PASS(1, w) PASS(2, w) PASS(3, w) PASS(4, w) PASS(5, w) PASS(6, w) PASS(7, w) \
  PASS(8, w) PASS(9, w) PASS(10, w) PASS(11, w) PASS(12, w) PASS(13, w) PASS(14, w) \
  PASS(15, w) PASS(16, w)

/* rows m0 .. m0 + M of a packed GEMM, over panels p .. p + width (see vtok_packed_gemm) */
static inline __attribute__((always_inline)) void panel_rows(
    const float *x, int64_t M, int64_t K, const void *packed, int64_t N, const float *bias,
    const float *residual, float *y, int64_t p, int64_t step, int prefetch, const int bf16) {
  const int64_t panels = (N + PANEL - 1) / PANEL, es = bf16 ? 2 : 4;
  const char *panel = (const char *)packed + p * K * PANEL * es;
  const int width = p + step <= panels ? (int)step : 1;
  const int cols = N - p * PANEL < width * PANEL ? (int)(N - p * PANEL) : width * PANEL;
  const float *bias_p = bias ? bias + p * PANEL : NULL;
  const int64_t tile = width == 2 ? PAIR_ROWS : ROWS, passes = (M + tile - 1) / tile;
  const char *next = panel + width * K * PANEL * es;
#if PREFILL_PREFETCH
  const int64_t spread = passes < PREFETCH_PASSES ? passes : PREFETCH_PASSES;
#else
  const int64_t spread = passes;
#endif
  const int64_t share = (width * K * PANEL + spread - 1) / spread;
  for (int64_t m0 = 0; m0 < M; m0 += tile) {
    const float *xm = x + m0 * K;
    float *ym = y + m0 * N + p * PANEL;
    const float *res = residual ? residual + m0 * N + p * PANEL : NULL;
    const int rows = M - m0 < tile ? (int)(M - m0) : (int)tile;
    /* the output lines this pass stores at its end, fetched for writing now: a prefill's y
       (2,048 x 3,072 floats, 25 MB) misses every cache, and each pass would otherwise wait
       for those lines at its end */
    for (int r = 0; r < rows; r++) {
      __builtin_prefetch(ym + r * N, 1, 3);
      __builtin_prefetch(ym + r * N + cols - 1, 1, 3);
    }
    /* decode (up to PREFETCH_PASSES passes): pass j prefetches the j-th share of the next
       panels into L2, spread over its k loop, so later passes over these panels (from L2)
       overlap the next stream: 2 panels of K = 576 in 3 passes: each prefetches 3,072
       floats, 5.33 per k. More passes (prefill) are compute-bound; the first PREFETCH_PASSES
       of them prefetch the next pair only where PREFILL_PREFETCH (avx2: there it pays; on
       avx512 it does not). The two forms are kept apart: merged into one expression, GCC
       compiles slower avx512 prefill code. */
#if PREFILL_PREFETCH
    const char *pf = (passes > PREFETCH_PASSES || prefetch) && m0 / tile < spread
                     ? next + (m0 / tile) * share * es : NULL;
#else
    const char *pf = prefetch && passes <= PREFETCH_PASSES ? next + (m0 / tile) * share * es
                                                           : NULL;
#endif
    const int64_t pf_step = (share << 16) / K;
    if (width == 1 && rows <= 3) {
      if (rows == 1)
        panel_pass_split(xm, K, panel, ym, N, cols, bias_p, res, pf, 1, SPLIT_1ROW, bf16);
      else if (rows == 2) panel_pass_split(xm, K, panel, ym, N, cols, bias_p, res, pf, 2, 2, bf16);
      else panel_pass_split(xm, K, panel, ym, N, cols, bias_p, res, pf, 3, 2, bf16);
    } else if (width == 1) {
      switch (rows) { PASSES(1) }
    } else {
      switch (rows) { PASSES(2) }
    }
  }
}

/* y [M, N] = x [M, K] @ W (+ bias [N]) (+ residual [M, N]), W packed; bias, residual may be NULL
   and residual may be y itself. prefetch 0 turns the decode passes' next-panel prefetch off:
   from a few rows the prefetch overlaps the next stream with the arithmetic, but at one row the
   weight stream is all a pass does and the prefetch can slow it down; which one wins depends on
   the CPU, so vllm/kernels/cpu_kernel_plan.py times both per band.
   Up to ROWS rows: each thread streams its panels once. More rows:
   pairs of panels, PAIR_ROWS rows at a time (the pair stays in L1 / L2 between those passes).
   Past PREFETCH_PASSES passes (prefill) the rows go in blocks of X_BLOCK_BYTES of x, which stay
   in L2 while every pair of panels passes over them; 2,048 rows of K = 576 (4.7 MB of x) would
   otherwise come from L3 once per pair. Block rows for K = 576: 262144 / 2304 = 113 -> 108
   (a multiple of the tile), at least PREFETCH_PASSES tiles. */
#define X_BLOCK_BYTES (256 * 1024)
static inline __attribute__((always_inline)) void packed_gemm(
    const float *x, int64_t M, int64_t K, const void *packed, int64_t N, const float *bias,
    const float *residual, float *y, int prefetch, const int bf16) {
  const int64_t panels = (N + PANEL - 1) / PANEL, step = M <= ROWS ? 1 : 2;
  const int64_t tile = step == 2 ? PAIR_ROWS : ROWS;
  int64_t block = M;
  if ((M + tile - 1) / tile > PREFETCH_PASSES) {
    block = X_BLOCK_BYTES / (int64_t)(K * sizeof(float)) / tile * tile;
    if (block < PREFETCH_PASSES * tile) block = PREFETCH_PASSES * tile;
  }
#pragma omp parallel
  for (int64_t b0 = 0; b0 < M; b0 += block) {
    const int64_t rows = M - b0 < block ? M - b0 : block;
    /* the same panels go to the same thread in every block: no barrier between blocks */
#pragma omp for schedule(static) nowait
    for (int64_t p = 0; p < panels; p += step)
      panel_rows(x + b0 * K, rows, K, packed, N, bias, residual ? residual + b0 * N : NULL,
                 y + b0 * N, p, step, prefetch, bf16);
  }
}

void vtok_packed_gemm(const float *x, int64_t M, int64_t K, const float *packed, int64_t N,
                      const float *bias, const float *residual, float *y, int prefetch) {
  packed_gemm(x, M, K, packed, N, bias, residual, y, prefetch, 0);
}

/* the same with bf16 weights (the float32 panels' layout, 2-byte elements: half the stream),
   widened exactly in registers; x, the accumulation and y stay float32, so y is x @ W for the
   float32 values of the bf16 weights, summed in the float32 GEMM's order */
void vtok_packed_gemm_bf16(const float *x, int64_t M, int64_t K, const uint16_t *packed,
                           int64_t N, const float *bias, const float *residual, float *y,
                           int prefetch) {
  packed_gemm(x, M, K, packed, N, bias, residual, y, prefetch, 1);
}

/* ---- decode attention -------------------------------------------------------------------------
   exp for softmax, VEC lanes: exp(x) = 2^n * exp(r), n = round(x / ln2), |r| <= ln2 / 2, exp(r)
   by a degree-7 Taylor polynomial (relative error ~1e-7 on that range); x < -87 (incl. -inf) -> 0,
   x > 88 -> exp(88). */
static inline vec as_float(ivec v) { vec f; memcpy(&f, &v, sizeof f); return f; }
static inline ivec as_bits(vec f) { ivec v; memcpy(&v, &f, sizeof v); return v; }

/* ---- fp8 KV cache (--kv-cache-dtype, vllm/attention/kv_quant.py) ------------------------------
   The cache holds float32 (KV_F32) or one byte per value: e4m3fn (bias 7, 3 mantissa bits, max
   448) or e5m2 (bias 15, 2 mantissa bits, max 57344), stored = x * (1 / scale) per layer and K / V.
   No x86 ISA here converts fp8, but each byte is exactly an IEEE half once its bits are moved:
     e5m2   byte << 8 is the half of the same value (sign, 5 exponent bits, 2 of 10 mantissa bits)
     e4m3   (b & 0x80) << 8 | (b & 0x7f) << 7 is the half of the value * 2^-8 (bias 15 vs 7),
            subnormals included; 0x7f / 0xff (NaN) would read 1.875 * 2^-8, but writes saturate
            and never store them
   so fp8_load yields value * 2^-8 (e4m3) or value (e5m2) and FP8_UNIT(fmt) undoes it: the unit
   and the layer's scales never touch the data, they fold into the score scale (K) and the
   output (V). 0x9c (e4m3, -0.25): sign-extended 0xff9c << 7 = 0xce00, & 0xbf80 = 0x8e00 = the
   half -2^-10 = -0.25 * 2^-8. F16C widens VEC halves at once (vcvtph2ps): per VEC bytes a load,
   a widening to 16 bits, one or two bit ops, a conversion. The generic build has no halves: it
   looks each byte up in a table of the same values. Intrinsics, not GCC vector extensions: GCC
   widens such bytes lane by lane (a scalar load and an insert per value). */
#define KV_F32 0
#define KV_E4M3 1
#define KV_E5M2 2
#define KV_BF16 3             /* --kv-cache-dtype bfloat16: the top half of each float32 */
#define FP8_UNIT(fmt) ((fmt) == KV_E4M3 ? 256.f : 1.f)
#define KV_BYTES(fmt) ((fmt) == KV_F32 ? 4 : (fmt) == KV_BF16 ? 2 : 1)   /* per cached value */
#define SPREADS(fmt) ((fmt) == KV_E4M3 || (fmt) == KV_E5M2)  /* keys stored spread, as
                                                              kv_quant.spreads() */
/* Whether attention reads a block's keys where they lie, widening them in registers once per
   query head, or widens them once into an L1 buffer that every head reads. In place wherever
   widening is a few vector instructions (the F16C builds, avx2 and avx512: bf16 and fp8 alike);
   the buffer where widening is a table lookup (generic), for every format but float32. */
#if defined(VTOK_ISA_AVX2) || defined(VTOK_ISA_AVX512)
#define KEYS_IN_PLACE(fmt) 1
#else
#define KEYS_IN_PLACE(fmt) ((fmt) == KV_F32)
#endif

#if defined(VTOK_ISA_AVX512)
static inline vec fp8_load(const uint8_t *p, const int fmt) {
  __m128i b = _mm_loadu_si128((const __m128i *)p);
  __m256i h = fmt == KV_E4M3
      ? _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7),
                         _mm256_set1_epi16((short)0xbf80))
      : _mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 8);
  return (vec)_mm512_cvtph_ps(h);
}
#elif defined(VTOK_ISA_AVX2)
static inline vec fp8_load(const uint8_t *p, const int fmt) {
  __m128i b = _mm_loadl_epi64((const __m128i *)p);
  __m128i h = fmt == KV_E4M3
      ? _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(b), 7), _mm_set1_epi16((short)0xbf80))
      : _mm_slli_epi16(_mm_cvtepu8_epi16(b), 8);
  return (vec)_mm256_cvtph_ps(h);
}
#else
/* generic: a table per format, byte -> its float as the F16C builds widen it, from the formats'
   definitions: e4m3 0x9c: sign 1, exponent 3, mantissa 4 -> -(8 + 4) * 2^(3 - 7 - 3) = -0.25,
   then * 2^-8. Filled when the library loads: one lookup per byte, where the bit moves and
   multiply would stay scalar on SSE2 (GCC). */
static float fp8_table[2][256];

static float fp8_value(unsigned b, int fmt) {
  const int mbits = fmt == KV_E4M3 ? 3 : 2, bias = fmt == KV_E4M3 ? 7 : 15;
  const int e = (b & 0x7f) >> mbits, m = b & ((1 << mbits) - 1);
  float v = e == 0 ? ldexpf((float)m, 1 - bias - mbits)                      /* subnormal */
                   : ldexpf((float)((1 << mbits) | m), e - bias - mbits);
  if (fmt == KV_E5M2 && e == 31) v = m ? NAN : INFINITY;
  v = fmt == KV_E4M3 ? ldexpf(v, -8) : v;
  return b & 0x80 ? -v : v;
}

__attribute__((constructor)) static void fp8_tables(void) {
  for (unsigned b = 0; b < 256; b++) {
    fp8_table[0][b] = fp8_value(b, KV_E4M3);
    fp8_table[1][b] = fp8_value(b, KV_E5M2);
  }
}

static inline vec fp8_load(const uint8_t *p, const int fmt) {
  const float *t = fp8_table[fmt == KV_E4M3 ? 0 : 1];
  vec f;
  for (int i = 0; i < VEC; i++) f[i] = t[p[i]];
  return f;
}
#endif

/* VEC values at element i of a cache row that starts at byte pointer base */
static inline __attribute__((always_inline)) vec kv_load(const char *base, int64_t i,
                                                         const int fmt) {
  if (fmt == KV_F32) return load((const float *)base + i);
  if (fmt == KV_BF16) return load_w(base, i, 1);
  return fp8_load((const uint8_t *)base + i, fmt);
}

/* out[0:n] = the fp8 bytes x[0:n] (fmt KV_E4M3 or KV_E5M2) as floats, widened as attention reads
   them, times FP8_UNIT; n % VEC == 0. For tests: every byte against torch's own conversion. */
void vtok_fp8_to_float(const uint8_t *x, int64_t n, int fmt, float *out) {
  for (int64_t i = 0; i < n; i += VEC)
    store(out + i, fmt == KV_E4M3 ? fp8_load(x + i, KV_E4M3) * FP8_UNIT(KV_E4M3)
                                  : fp8_load(x + i, KV_E5M2) * FP8_UNIT(KV_E5M2));
}

/* one float -> fp8: x * inv, saturated to the largest finite value, rounded to nearest even
   (torch's clamp-then-cast); NaN stays NaN */
static inline uint8_t fp8_store(float x, float inv, const int fmt) {
  const int mbits = fmt == KV_E4M3 ? 3 : 2, bias = fmt == KV_E4M3 ? 7 : 15;
  const float top = fmt == KV_E4M3 ? 448.f : 57344.f;
  x *= inv;
  uint32_t b;
  memcpy(&b, &x, sizeof b);
  const uint8_t sign = (uint8_t)((b >> 24) & 0x80);
  b &= 0x7fffffffu;
  float a;
  memcpy(&a, &b, sizeof a);
  if (a != a) return sign | 0x7f;
  if (a >= top) return sign | (fmt == KV_E4M3 ? 0x7e : 0x7b);
  if (b < ((uint32_t)(128 - bias) << 23))       /* below the smallest normal: subnormal steps */
    return sign | (uint8_t)rintf(a * (fmt == KV_E4M3 ? 512.f : 65536.f));
  b += ((uint32_t)(bias - 127) << 23) + (1u << (22 - mbits)) - 1 + ((b >> (23 - mbits)) & 1);
  return sign | (uint8_t)(b >> (23 - mbits));
}

static void fp8_store_row(const float *x, uint8_t *dst, int64_t n, float inv, const int fmt) {
  for (int64_t i = 0; i < n; i++) dst[i] = fp8_store(x[i], inv, fmt);
}

/* one float -> bf16 rounded to nearest even, NaN -> 0x7fc0 (torch's conversion): 1 + 2^-8
   (0x3f808000, a tie) -> 0x3f80, 1 + 3 * 2^-8 (0x3f818000) -> 0x3f82 */
static inline uint16_t bf16_round(float x) {
  uint32_t b;
  memcpy(&b, &x, sizeof b);
  if (x != x) return 0x7fc0;
  return (uint16_t)((b + 0x7fffu + ((b >> 16) & 1)) >> 16);
}

/* x[0:n] -> a cache row of format fmt at dst (float32: a copy; inv unused but for fp8) */
static void kv_store_row(const float *x, char *dst, int64_t n, float inv, int fmt) {
  if (fmt == KV_F32) memcpy(dst, x, n * sizeof(float));
  else if (fmt == KV_BF16)
    for (int64_t i = 0; i < n; i++) ((uint16_t *)dst)[i] = bf16_round(x[i]);
  else if (fmt == KV_E4M3) fp8_store_row(x, (uint8_t *)dst, n, inv, KV_E4M3);
  else fp8_store_row(x, (uint8_t *)dst, n, inv, KV_E5M2);
}

/* the float32 reciprocal of a scale, as the torch path computes it */
static inline float inverse(float scale) { return (float)(1.0 / (double)scale); }

static inline vec vexp(vec x) {
  const float ln2_hi = 0.693145751953125f, ln2_lo = 1.428606765330187e-06f;
  const float round_magic = 12582912.f;                    /* 1.5 * 2^23: adding it rounds */
  ivec underflow = x < -87.f;                              /* lanes of all ones where true */
  ivec overflow = x > 88.f;                                /* exp(88) ~ 1.7e38, still finite */
  x = as_float((as_bits(x) & ~underflow) | (as_bits(splat(-87.f)) & underflow));
  x = as_float((as_bits(x) & ~overflow) | (as_bits(splat(88.f)) & overflow));
  vec n = (x * 1.4426950408889634f + round_magic) - round_magic;
  vec r = x - n * ln2_hi - n * ln2_lo;
  vec p = splat(1.f / 5040);
  p = p * r + 1.f / 720; p = p * r + 1.f / 120; p = p * r + 1.f / 24; p = p * r + 1.f / 6;
  p = p * r + 0.5f; p = p * r + 1.f; p = p * r + 1.f;
  vec two_n = as_float((__builtin_convertvector(n, ivec) + 127) << 23);
  return as_float(as_bits(p * two_n) & ~underflow);
}

/* x[0..VEC-1] -> one vector whose lane i is the sum of x[i]'s lanes, in halving levels. VEC = 8:
   level 4: keys 0, 1 -> [x0 lanes 0-3 + 4-7 | x1 lanes 0-3 + 4-7], 4 vectors left; level 2:
   2 left; level 1: [sum x0, sum x1, ..., sum x7]. Level s keeps lanes LO(s, i) of the pair
   (index >= VEC: the second vector) and adds the lanes s further on. */
#define LO(s, i) (((i) / (s)) * 2 * (s) + (i) % (s))
#if VEC == 16
#define LO_MASK(s) ((ivec){LO(s, 0), LO(s, 1), LO(s, 2), LO(s, 3), LO(s, 4), LO(s, 5), LO(s, 6), \
  LO(s, 7), LO(s, 8), LO(s, 9), LO(s, 10), LO(s, 11), LO(s, 12), LO(s, 13), LO(s, 14), LO(s, 15)})
#elif VEC == 8
#define LO_MASK(s) ((ivec){LO(s, 0), LO(s, 1), LO(s, 2), LO(s, 3), LO(s, 4), LO(s, 5), LO(s, 6), \
  LO(s, 7)})
#else
#define LO_MASK(s) ((ivec){LO(s, 0), LO(s, 1), LO(s, 2), LO(s, 3)})
#endif
#if defined(__GNUC__) && !defined(__clang__)
#define LEVEL(s) for (int i = 0; i < (s); i++) \
  x[i] = __builtin_shuffle(x[2 * i], x[2 * i + 1], LO_MASK(s)) + \
         __builtin_shuffle(x[2 * i], x[2 * i + 1], LO_MASK(s) + (s));
static inline vec sum_each(vec x[VEC]) {
#if VEC >= 16
  LEVEL(8)
#endif
#if VEC >= 8
  LEVEL(4)
#endif
  LEVEL(2) LEVEL(1)
  return x[0];
}
/* sum_each's levels on half a block, x[0..VEC/2-1]: x[0] ends as sum_each's x[0] (first half) or
   x[1] (second half) before its last level, which join_halves then takes */
#define HALF_LEVEL(s) for (int i = 0; i < (s) / 2; i++) \
  x[i] = __builtin_shuffle(x[2 * i], x[2 * i + 1], LO_MASK(s)) + \
         __builtin_shuffle(x[2 * i], x[2 * i + 1], LO_MASK(s) + (s));
#define HAVE_HALVES 1
static inline vec fold_half(vec x[VEC / 2]) {
#if VEC >= 16
  HALF_LEVEL(8)
#endif
#if VEC >= 8
  HALF_LEVEL(4)
#endif
  HALF_LEVEL(2)
  return x[0];
}

static inline vec join_halves(vec first, vec second) {
  vec x[2] = {first, second};
  LEVEL(1)
  return x[0];
}
#else   /* compilers without __builtin_shuffle: lane by lane */
#define HAVE_HALVES 0
static inline vec sum_each(vec x[VEC]) {
  vec out;
  for (int i = 0; i < VEC; i++) out[i] = hsum(x[i]);
  return out;
}
#endif

/* scores[j] = scale * q . key[j] for a block of VEC keys (D % VEC == 0), all VEC lanes stored:
   scores has room for them (probability rows are padded to 16), lanes past the block's keys are
   overwritten by softmax's -inf padding or the next block (a copy of n lanes was a libc call per
   block and head) */
static inline __attribute__((always_inline)) void score_block(
    const float *q, const char *key[VEC], int64_t D, float scale, float *scores, const int fmt) {
  vec part[VEC];
  for (int j = 0; j < VEC; j++) part[j] = splat(0.f);
  for (int64_t d = 0; d < D; d += VEC) {
    vec qd = load(q + d);
    for (int j = 0; j < VEC; j++) part[j] += qd * kv_load(key[j], d, fmt);
  }
  store(scores, sum_each(part) * scale);
}

/* score_block for `heads` <= SCORE_HEADS query heads q[g * D] of one KV head, scores[g * lmax]:
   each bf16 / fp8 key vector is widened once for all of them, not once per head. Half a block
   at a time (heads x VEC / 2 accumulators: 24 of AVX-512's 32 registers at 3 heads), each half
   folded by sum_each's own levels, so the scores are score_block's to the bit. Keys read as
   float32 (the float32 cache, the generic build's widened buffer) keep a score_block per head:
   there is no widening to share, so halving the block would only add the folds. */
#define SCORE_HEADS 3
static inline __attribute__((always_inline)) void score_heads(
    const float *q, const char *key[VEC], int64_t D, float scale, float *scores, int64_t lmax,
    const int heads, const int fmt) {
#if HAVE_HALVES
  vec first[SCORE_HEADS];
  for (int half = 0; half < 2; half++) {
    vec part[SCORE_HEADS][VEC / 2];
    for (int g = 0; g < heads; g++)
      for (int j = 0; j < VEC / 2; j++) part[g][j] = splat(0.f);
    for (int64_t d = 0; d < D; d += VEC)
      for (int j = 0; j < VEC / 2; j++) {
        vec k = kv_load(key[half * VEC / 2 + j], d, fmt);
        for (int g = 0; g < heads; g++) part[g][j] += load(q + g * D + d) * k;
      }
    for (int g = 0; g < heads; g++)
      if (half == 0) first[g] = fold_half(part[g]);
      else store(scores + g * lmax, join_halves(first[g], fold_half(part[g])) * scale);
  }
#else
  for (int g = 0; g < heads; g++) score_block(q + g * D, key, D, scale, scores + g * lmax, fmt);
#endif
}

static inline vec vmax(vec a, vec b) {
  ivec a_wins = a > b;
  return as_float((as_bits(a) & a_wins) | (as_bits(b) & ~a_wins));
}

static inline int64_t round16(int64_t n) { return (n + 15) & ~(int64_t)15; }

/* In place: p[0:n] = softmax(p[0:n]); entries that are -inf become exactly 0; all -inf -> 0.
   sink: a learned logit with no value (gpt-oss), one more term of the max and the denominator,
   so the n probabilities sum to less than one; -INFINITY: none.
   p has room for round16(n) floats: the tail is padded with -inf and processed as vectors. */
static void softmax(float *p, int64_t n, float sink) {
  const int64_t n16 = round16(n);
  for (int64_t j = n; j < n16; j++) p[j] = -INFINITY;
  vec mv = splat(-INFINITY);
  for (int64_t j = 0; j < n16; j += VEC) mv = vmax(mv, load(p + j));
  float m = -INFINITY;
  for (int i = 0; i < VEC; i++) m = mv[i] > m ? mv[i] : m;
  m = sink > m ? sink : m;
  if (m == -INFINITY) { memset(p, 0, n * sizeof(float)); return; }
  vec total = splat(0.f);
  for (int64_t j = 0; j < n16; j += VEC) {
    vec e = vexp(load(p + j) - m);
    total += e;
    store(p + j, e);
  }
  float sum = hsum(total);
  if (sink != -INFINITY) sum += expf(sink - m);
  vec inv = splat(1.f / sum);
  for (int64_t j = 0; j < n16; j += VEC) store(p + j, load(p + j) * inv);
}

/* Prefetching K / V rows in attention. A key's K or V row is a few lines at a stride of a whole
   slot (K and V of every KV head), which the hardware prefetchers do not follow, and the weights
   stream through the caches between layers, so K / V come from memory every step. Two distances:
   - into L2, PREFETCH_KEYS ahead, in the scores pass: the K rows, and for bf16 / fp8 the V rows
     too (an fp8 row is one line), so that many misses are in flight at once; a short distance
     into L1 alone leaves too few.
   - into L1, the next block's K rows and the V rows L1_AHEAD_VALUES keys ahead: an L2 prefetch
     alone leaves the loads waiting on L2 (some CPUs, Zen 4, fill only L2 on prefetcht1), at a
     block's first key load and at each V row's first load.
     float32 V rows go into L1 only: an L2 prefetch of them in the values pass beside the L1 one
     costs more than it saves. */
static inline __attribute__((always_inline)) void prefetch_row(const char *p, int64_t bytes,
                                                               const int into_l1) {
  for (int64_t i = 0; i < bytes; i += 64)
    if (into_l1) __builtin_prefetch(p + i, 0, 3);
    else __builtin_prefetch(p + i, 0, 2);
}

/* out[g][0:vecs vectors] = sum_j p[g][j] * v_j[0:vecs vectors] for g < heads, heads x vecs <=
   AV_HEADS x AV_VECS, vecs <= AV_VECS; where heads and vecs are constants the accumulators stay
   in registers. */
static inline __attribute__((always_inline)) void weigh_values(
    const char *kv, const int64_t *slot_row, int64_t n, int64_t row, int64_t offset,
    const float *p, int64_t lmax, float *out, int64_t D, const int heads, const int vecs,
    const int fmt, float v_scale) {
  const int64_t es = KV_BYTES(fmt);
  vec acc[2 * AV_HEADS][AV_VECS];                          /* the fp8 passes' shape fits too */
  for (int g = 0; g < heads; g++)
    for (int v = 0; v < vecs; v++) acc[g][v] = splat(0.f);
  for (int64_t j = 0; j < n; j++) {
    if (j + L1_AHEAD_VALUES < n && slot_row[j + L1_AHEAD_VALUES] >= 0)
      prefetch_row(kv + (slot_row[j + L1_AHEAD_VALUES] * row + offset) * es, vecs * VEC * es, 1);
    if (slot_row[j] < 0) continue;
    const char *val = kv + (slot_row[j] * row + offset) * es;
    vec vv[AV_VECS];
    for (int v = 0; v < vecs; v++) vv[v] = kv_load(val, VEC * v, fmt);
    for (int g = 0; g < heads; g++) {
      vec w = splat(p[g * lmax + j]);
      for (int v = 0; v < vecs; v++) acc[g][v] += w * vv[v];
    }
  }
  for (int g = 0; g < heads; g++)
    for (int v = 0; v < vecs; v++) store(out + g * D + VEC * v, acc[g][v] * v_scale);
}

#define WEIGH(h, vecs) case h: \
  if (h * vecs <= AV_HEADS * AV_VECS) weigh_values(kv, slot_row, n, row, values + d0, p, lmax, o, \
                                                   D, h, vecs, fmt, v_scale); \
  break;

/* One request b, one KV head kh: its G query heads against the request's n live keys.
   Scores and probabilities go to probs[g * lmax + j]; D % 16 == 0. fp8 / bf16 (fmt): keys are
   widened in registers once per SCORE_HEADS query heads (KEYS_IN_PLACE), or, in the generic
   build, a block's VEC keys once into kbuf (L1) that all G query heads read; values are widened
   in registers as they are weighed, and a key's K and V lines are prefetched together.
   sinks: the G heads' sink logits, or NULL. */
static inline __attribute__((always_inline)) void attend_group(
    const float *q, const char *kv, const int64_t *slot_row, int64_t n, int64_t KVH, int64_t kh,
    int64_t G, int64_t D, float scale, float *probs, int64_t lmax, float *out, const int fmt,
    float v_scale, const float *sinks) {
  const int64_t row = 2 * KVH * D;                          /* values per slot (K and V) */
  const int64_t es = KV_BYTES(fmt);
  float kbuf[KEYS_IN_PLACE(fmt) ? 1 : VEC * D];
  for (int64_t j0 = 0; j0 < n; j0 += VEC) {
    int block = n - j0 < VEC ? (int)(n - j0) : VEC;
    for (int64_t j = j0 + PREFETCH_KEYS; j < j0 + PREFETCH_KEYS + VEC && j < n; j++)
      if (slot_row[j] >= 0) {
        prefetch_row(kv + (slot_row[j] * row + kh * D) * es, D * es, 0);
        if (fmt != KV_F32) prefetch_row(kv + (slot_row[j] * row + (KVH + kh) * D) * es, D * es, 0);
      }
    for (int64_t j = j0 + VEC; j < j0 + 2 * VEC && j < n; j++)       /* the next block's keys */
      if (slot_row[j] >= 0) prefetch_row(kv + (slot_row[j] * row + kh * D) * es, D * es, 1);
    const char *key[VEC];
    for (int j = 0; j < VEC; j++) {  /* padding and lanes past the block read slot 0: unused */
      int64_t slot = j < block ? slot_row[j0 + j] : 0;
      const char *src = kv + ((slot < 0 ? 0 : slot) * row + kh * D) * es;
      if (KEYS_IN_PLACE(fmt)) {
        key[j] = src;
        continue;
      }
      for (int64_t d = 0; d < D; d += VEC) store(kbuf + j * D + d, kv_load(src, d, fmt));
      key[j] = (const char *)(kbuf + j * D);
    }
    const int kfmt = KEYS_IN_PLACE(fmt) ? fmt : KV_F32;
    if (kfmt == KV_F32)
      for (int64_t g = 0; g < G; g++)
        score_block(q + g * D, key, D, scale, probs + g * lmax + j0, KV_F32);
    else for (int64_t g0 = 0; g0 < G; g0 += SCORE_HEADS) {
      const float *qg = q + g0 * D;
      float *sg = probs + g0 * lmax + j0;
      switch (G - g0 < SCORE_HEADS ? G - g0 : SCORE_HEADS) {
        case 1: score_heads(qg, key, D, scale, sg, lmax, 1, kfmt); break;
        case 2: score_heads(qg, key, D, scale, sg, lmax, 2, kfmt); break;
        default: score_heads(qg, key, D, scale, sg, lmax, 3, kfmt);
      }
    }
  }
  for (int64_t j = 0; j < n; j++)
    if (slot_row[j] < 0)
      for (int64_t g = 0; g < G; g++) probs[g * lmax + j] = -INFINITY;
  for (int64_t g = 0; g < G; g++) softmax(probs + g * lmax, n, sinks ? sinks[g] : -INFINITY);

  /* out[g] = sum_j p[g][j] * v_j, AV_HEADS heads x AV_VECS vectors of dims at a time. fp8
     widens a V vector once per pass that reads it: where G fits in twice AV_HEADS, each pass
     takes all G heads over AV_VECS / 2 vectors, so every value is widened once. G = 3 on avx2
     (AV_HEADS 2): 3 heads x 2 vectors in 4 passes instead of 2 + 1 heads x 4 vectors, which
     would widen each value twice. */
  const int64_t values = (KVH + kh) * D;                   /* offset of V in a slot's row */
  const int tall = fmt != KV_F32 && G > AV_HEADS && G <= 2 * AV_HEADS;
  const int hmax = tall ? 2 * AV_HEADS : AV_HEADS, vmax = tall ? AV_VECS / 2 : AV_VECS;
  const int64_t span = vmax * VEC;                         /* dims per accumulator block */
  for (int64_t g0 = 0; g0 < G; g0 += hmax)
    for (int64_t d0 = 0; d0 < D; d0 += span) {
      const int heads = G - g0 < hmax ? (int)(G - g0) : hmax;
      const int vecs = D - d0 < span ? (int)(D - d0) / VEC : vmax;
      const float *p = probs + g0 * lmax;
      float *o = out + g0 * D + d0;
      if (vecs != vmax) {
        weigh_values(kv, slot_row, n, row, values + d0, p, lmax, o, D, heads, vecs, fmt,
                     v_scale);
        continue;
      }
      if (tall)
        switch (heads) {    /* cases past 2 AV_HEADS are never reached */
          WEIGH(1, AV_VECS / 2) WEIGH(2, AV_VECS / 2) WEIGH(3, AV_VECS / 2)
          WEIGH(4, AV_VECS / 2) WEIGH(5, AV_VECS / 2) WEIGH(6, AV_VECS / 2)
          WEIGH(7, AV_VECS / 2) WEIGH(8, AV_VECS / 2)
        }
      else
        switch (heads) {    /* cases past AV_HEADS are never reached */
          WEIGH(1, AV_VECS) WEIGH(2, AV_VECS) WEIGH(3, AV_VECS) WEIGH(4, AV_VECS)
        }
    }
}

/* q [B, H, D] with D % 16 == 0; kv [S, 2, KVH, D], one layer (K = kv[slot, 0], V = kv[slot, 1]);
   slots [B, ld_slots]: row b's first lens[b] entries are its attention view, negative = padding;
   probs: scratch [B, H, round16(lmax)] with lmax >= every lens[b]; out [B, H, D];
   mass [B, ld_mass] or NULL: += each key's attention probability summed over all H heads.
   fmt: the cache's format (KV_F32, KV_E4M3, KV_E5M2, KV_BF16); k_scale, v_scale: its scales
   (fp8; 1 otherwise). sinks [H] or NULL: each query head's sink logit (softmax above); probs
   and mass are then the real keys' probabilities, which sum to less than one.
   The format is picked inside the parallel loop: OpenMP outlines a parallel region's body before
   inlining, so a format passed into the region stays a run-time value in there. */
void vtok_decode_attention(const float *q, const void *kv, const int64_t *slots,
                           int64_t ld_slots, const int64_t *lens, int64_t B, int64_t H,
                           int64_t KVH, int64_t D, float scale, float *probs, int64_t lmax,
                           float *out, float *mass, int64_t ld_mass, int fmt, float k_scale,
                           float v_scale, const float *sinks) {
  const int64_t G = H / KVH;
  lmax = round16(lmax);
  const float ks = fmt == KV_F32 ? scale : scale * k_scale * FP8_UNIT(fmt);
  const float vs = fmt == KV_F32 ? 1.f : v_scale * FP8_UNIT(fmt);
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < B; b++)
    for (int64_t kh = 0; kh < KVH; kh++) {
      const float *qg = q + (b * H + kh * G) * D;
      float *pg = probs + (b * KVH + kh) * G * lmax, *og = out + (b * H + kh * G) * D;
      const float *sg = sinks ? sinks + kh * G : NULL;
      if (fmt == KV_E4M3)
        attend_group(qg, kv, slots + b * ld_slots, lens[b], KVH, kh, G, D, ks, pg, lmax, og,
                     KV_E4M3, vs, sg);
      else if (fmt == KV_E5M2)
        attend_group(qg, kv, slots + b * ld_slots, lens[b], KVH, kh, G, D, ks, pg, lmax, og,
                     KV_E5M2, vs, sg);
      else if (fmt == KV_BF16)
        attend_group(qg, kv, slots + b * ld_slots, lens[b], KVH, kh, G, D, ks, pg, lmax, og,
                     KV_BF16, vs, sg);
      else
        attend_group(qg, kv, slots + b * ld_slots, lens[b], KVH, kh, G, D, ks, pg, lmax, og,
                     KV_F32, vs, sg);
    }
  if (!mass) return;
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < B; b++)
    for (int64_t h = 0; h < H; h++) {        /* probs of (b, kh, g) = row b * H + h */
      const float *p = probs + (b * H + h) * lmax;
      for (int64_t j = 0; j < lens[b]; j++) mass[b * ld_mass + j] += p[j];
    }
}

/* ---- elementwise layers -----------------------------------------------------------------------
   Small ops that torch runs as several passes with per-op overhead (its CPU rms_norm is seven
   ops); rows are independent, so large inputs (prefill) split rows across threads. */

/* rsqrt(mean(row^2) + eps) of one row of N (N % 16 == 0), in every lane */
static inline vec rms_scale(const float *row, int64_t N, float eps) {
  vec ss = splat(0.f);
  for (int64_t i = 0; i < N; i += VEC) ss += load(row + i) * load(row + i);
  return splat(1.f / sqrtf(hsum(ss) / (float)N + eps));
}

/* out [M, N] = x * rsqrt(mean(x^2) + eps) * w; N % 16 == 0 */
void vtok_rms_norm(const float *x, int64_t M, int64_t N, const float *w, float eps, float *out) {
#pragma omp parallel for schedule(static) if (M > 64)
  for (int64_t m = 0; m < M; m++) {
    const float *row = x + m * N;
    vec r = rms_scale(row, N, eps);
    for (int64_t i = 0; i < N; i += VEC)
      store(out + m * N + i, load(row + i) * r * load(w + i));
  }
}

/* gate_up [M, 2I] = [gate | up] -> out [M, I] = silu(gate) * up = gate / (1 + exp(-gate)) * up;
   I % 16 == 0 */
void vtok_silu_mul(const float *gate_up, int64_t M, int64_t I, float *out) {
#pragma omp parallel for schedule(static) if (M > 64)
  for (int64_t m = 0; m < M; m++) {
    const float *gate = gate_up + m * 2 * I, *up = gate + I;
    for (int64_t i = 0; i < I; i += VEC) {
      vec g = load(gate + i);
      store(out + m * I + i, g / (1.f + vexp(-g)) * load(up + i));
    }
  }
}

/* gate_up [M, 2I] -> out [M, I] = gelu_tanh(gate) * up (GeGLU, Gemma), gelu_tanh(g) =
   0.5 g (1 + tanh(c (g + 0.044715 g^3))), c = sqrt(2 / pi), tanh(y) = 1 - 2 / (exp(2 y) + 1);
   I % 16 == 0 */
void vtok_gelu_tanh_mul(const float *gate_up, int64_t M, int64_t I, float *out) {
#pragma omp parallel for schedule(static) if (M > 64)
  for (int64_t m = 0; m < M; m++) {
    const float *gate = gate_up + m * 2 * I, *up = gate + I;
    for (int64_t i = 0; i < I; i += VEC) {
      vec g = load(gate + i);
      vec y = 0.7978845608028654f * (g + 0.044715f * g * g * g);
      vec t = 1.f - 2.f / (vexp(2.f * y) + 1.f);
      store(out + m * I + i, 0.5f * g * (1.f + t) * load(up + i));
    }
  }
}

/* x [M, N] += h * rsqrt(mean(h^2) + eps) * w (a sublayer's output normed before its residual
   add, Gemma's post-attention / post-feedforward norms); N % 16 == 0 */
static void add_rms_norm(const float *h, int64_t M, int64_t N, const float *w, float eps,
                         float *x) {
  for (int64_t m = 0; m < M; m++) {
    const float *row = h + m * N;
    vec r = rms_scale(row, N, eps);
    for (int64_t i = 0; i < N; i += VEC)
      store(x + m * N + i, load(x + m * N + i) + load(row + i) * r * load(w + i));
  }
}

/* out[m] = the first index of row m's largest value, x [M, N] (greedy sampling, in place of
   torch's max over the vocabulary, which does not stream at memory speed). Lanes keep
   their first maximum (strict >), then the lowest index among lanes that hold the row's
   maximum wins. A NaN anywhere: the first NaN's index, as torch.argmax. */
void vtok_argmax_rows(const float *x, int64_t M, int64_t N, int64_t *out) {
#pragma omp parallel for schedule(static) if (M > 4)
  for (int64_t m = 0; m < M; m++) {
    const float *row = x + m * N;
    const int64_t whole = N / VEC * VEC;
    vec best = splat(-INFINITY);
    ivec at = (ivec){0}, nan = (ivec){0};          /* index 0, no NaN seen */
    ivec lane;
    for (int i = 0; i < VEC; i++) lane[i] = i;
    for (int64_t i = 0; i < whole; i += VEC) {
      vec v = load(row + i);
      ivec wins = v > best;
      nan |= v != v;
      best = as_float((as_bits(v) & wins) | (as_bits(best) & ~wins));
      at = ((lane + (int32_t)i) & wins) | (at & ~wins);
    }
    int any_nan = 0;
    for (int i = 0; i < VEC; i++) any_nan |= nan[i];
    float top = -INFINITY;
    int64_t idx = 0;
    for (int i = 0; i < VEC; i++)
      if (best[i] > top || (best[i] == top && at[i] < idx)) { top = best[i]; idx = at[i]; }
    for (int64_t i = whole; i < N; i++) {
      any_nan |= row[i] != row[i];
      if (row[i] > top) { top = row[i]; idx = i; }
    }
    if (any_nan)
      for (int64_t i = 0; i < N; i++)
        if (row[i] != row[i]) { idx = i; break; }
    out[m] = idx;
  }
}

/* ---- mixture-of-experts routing and combine (vllm/model_executor/layers/fused_moe.py) -------- */

#define MOE_MAX_TOP_K 64

/* The routing of T tokens from their router logits [T, E] (router bias included): each token's
   top_k experts and weights, then the picks grouped by expert, token order within an expert
   (a stable counting sort, as FusedMoE's argsort):
     mode 0 (softmax_topk)  p = softmax(logits) (exp(l - max) / sum), its top_k; renorm:
                            each divided by their sum (in top-k order)
     mode 1 (topk_softmax)  the top_k logits, softmax over them
   The top k: descending, the lower expert first among equal logits. Outputs: tokens[P] and
   weights[P] (P = T top_k) pick p's token and weight, offsets[E + 1] expert e's picks
   offsets[e] .. offsets[e + 1]. Worked example, E 3, top_k 2, renorm, logits [[0, ln 3,
   ln 2]] (p 1/6, 3/6, 2/6): picks experts 1 (0.6), 2 (0.4) -> tokens [0, 0], weights [0.6,
   0.4], offsets [0, 0, 1, 2]. Returns 0, or -1 when top_k is not in 1 .. min(E, 64) or
   there is no memory */
int vtok_moe_route(const float *logits, int64_t T, int64_t E, int top_k, int mode, int renorm,
                   int64_t *tokens, float *weights, int64_t *offsets) {
  if (top_k < 1 || top_k > E || top_k > MOE_MAX_TOP_K) return -1;
  for (int64_t e = 0; e <= E; e++) offsets[e] = 0;
  if (T == 0) return 0;
  const int64_t P = T * top_k;
  int64_t *ids = (int64_t *)malloc(sizeof(int64_t) * (size_t)P);   /* pick q = t k + j */
  float *w = (float *)malloc(sizeof(float) * (size_t)P);
  int64_t *next = (int64_t *)malloc(sizeof(int64_t) * (size_t)E);
  if (!ids || !w || !next) { free(ids); free(w); free(next); return -1; }
  for (int64_t t = 0; t < T; t++) {
    const float *l = logits + t * E;
    int64_t *id = ids + t * top_k;
    float *wt = w + t * top_k, sum = 0.0f;
    for (int j = 0; j < top_k; j++) {        /* selection: k passes (k and E are small) */
      int64_t best = -1;
      for (int64_t e = 0; e < E; e++) {
        int taken = 0;
        for (int i = 0; i < j; i++) taken |= id[i] == e;
        if (!taken && (best < 0 || l[e] > l[best])) best = e;
      }
      id[j] = best;
      offsets[best + 1]++;                    /* expert e's count, at e + 1 */
    }
    if (mode == 0) {
      float mx = l[0], z = 0.0f;
      for (int64_t e = 1; e < E; e++) mx = l[e] > mx ? l[e] : mx;
      for (int64_t e = 0; e < E; e++) z += expf(l[e] - mx);
      for (int j = 0; j < top_k; j++) { wt[j] = expf(l[id[j]] - mx) / z; sum += wt[j]; }
      if (renorm)
        for (int j = 0; j < top_k; j++) wt[j] /= sum;
    } else {
      for (int j = 0; j < top_k; j++) { wt[j] = expf(l[id[j]] - l[id[0]]); sum += wt[j]; }
      for (int j = 0; j < top_k; j++) wt[j] /= sum;
    }
  }
  for (int64_t e = 0; e < E; e++) offsets[e + 1] += offsets[e];
  memcpy(next, offsets, sizeof(int64_t) * (size_t)E);
  for (int64_t q = 0; q < P; q++) {           /* in token order: stable within an expert */
    const int64_t at = next[ids[q]]++;
    tokens[at] = q / top_k;
    weights[at] = w[q];
  }
  free(ids); free(w); free(next);
  return 0;
}

/* out [T, N] = sum over picks p of y[p] * weights[p] added to row tokens[p], in p order (as
   torch's out.zero_().index_add_(0, tokens, y * weights[:, None]): each product rounded, then
   added; the attribute keeps GCC from fusing them) */
__attribute__((optimize("fp-contract=off")))
void vtok_moe_combine(const float *y, const float *weights, const int64_t *tokens, int64_t P,
                      int64_t N, int64_t T, float *out) {
  memset(out, 0, sizeof(float) * (size_t)(T * N));
  for (int64_t p = 0; p < P; p++) {
    float *o = out + tokens[p] * N;
    const float *yp = y + p * N, w = weights[p];
    for (int64_t i = 0; i < N; i++) {
      const float v = yp[i] * w;
      o[i] += v;
    }
  }
}

/* ---- key spreading (an fp8 cache's keys, vllm/attention/kv_quant.py spread()) ----------------
   x <- H S x over each block of B = D & -D values (the largest power of two dividing D): S flips
   the signs of fixed channels, H is the B x B Walsh-Hadamard matrix / sqrt(B) (H S orthogonal).
   Butterflies in the order kv_quant.spread() takes them, so both give the same floats. B = 4,
   x = [1, 2, 3, 4], no flips: len 1 -> [3, -1, 7, -1]; len 2 -> [10, -2, -4, 0]; * 1/2 ->
   [5, -1, -2, 0] (norm 5.48 = |x|). */
static inline int spread_flips(int64_t i) {        /* murmur3's finalizer of i + 1, low bit */
  uint32_t x = (uint32_t)i + 1u;
  x ^= x >> 16; x *= 0x85ebca6bu; x ^= x >> 13; x *= 0xc2b2ae35u; x ^= x >> 16;
  return x & 1u;
}

static void spread_head(float *x, int64_t D, const float *sign) {
  const int64_t B = D & -D;
  const float norm = (float)(1.0 / sqrt((double)B));
  for (int64_t i = 0; i < D; i++) x[i] *= sign[i];
  for (int64_t b = 0; b < D; b += B)
    for (int64_t len = 1; len < B; len <<= 1)
      for (int64_t i = b; i < b + B; i += 2 * len)
        for (int64_t j = i; j < i + len; j++) {
          const float lo = x[j], hi = x[j + len];
          x[j] = lo + hi;
          x[j + len] = lo - hi;
        }
  for (int64_t i = 0; i < D; i++) x[i] *= norm;
}

/* Rotary embedding of this step's q and k, and the K/V cache write, in one pass:
   qkv [T, (H + 2 KVH) D] rows = [q heads | k heads | v heads]; cos, sin [T, D] for each token's
   position; x * cos + rotate_half(x) * sin, rotate_half(x) = [-x[D/2:], x[:D/2]];
   q_out [T, H, D]; kv [S, 2, KVH, D] gets rotated k and v at slot_mapping[t] (negative: none),
   in format fmt (fp8: stored = x * (1 / scale), K and V each with its own scale). spread: q and
   k heads also go through spread_head after the rotary embedding (q.k unchanged). */
void vtok_rope_write_kv(const float *qkv, int64_t T, int64_t H, int64_t KVH, int64_t D,
                        const float *cos, const float *sin, const int64_t *slot_mapping,
                        void *kv, float *q_out, int fmt, float k_scale, float v_scale,
                        int spread) {
  const int64_t half = D / 2, width = (H + 2 * KVH) * D;
  const int64_t es = KV_BYTES(fmt);
  const float inv_k = inverse(k_scale), inv_v = inverse(v_scale);
  float sign[D];
  for (int64_t i = 0; i < D; i++) sign[i] = spread_flips(i) ? -1.f : 1.f;
#pragma omp parallel for schedule(static) if (T > 64)
  for (int64_t t = 0; t < T; t++) {
    const float *row = qkv + t * width, *c = cos + t * D, *s = sin + t * D;
    const int64_t slot = slot_mapping[t];
    char *k_dst = slot >= 0 ? (char *)kv + slot * 2 * KVH * D * es : NULL;
    float rotated[D];
    for (int64_t h = 0; h < H + KVH; h++) {        /* q heads, then k heads */
      const float *x = row + h * D;
      float *dst = h < H ? q_out + (t * H + h) * D : !k_dst ? NULL
                   : fmt == KV_F32 ? (float *)k_dst + (h - H) * D : rotated;
      if (!dst) continue;
      for (int64_t i = 0; i < half; i++) {
        float lo = x[i] * c[i] + (-x[i + half]) * s[i];
        float hi = x[i + half] * c[i + half] + x[i] * s[i + half];
        dst[i] = lo;
        dst[i + half] = hi;
      }
      if (spread) spread_head(dst, D, sign);
      if (dst == rotated) kv_store_row(rotated, k_dst + (h - H) * D * es, D, inv_k, fmt);
    }
    if (k_dst) kv_store_row(row + (H + KVH) * D, k_dst + KVH * D * es, KVH * D, inv_v, fmt);
  }
}

/* ---- a whole decoder layer for a decode batch ---------------------------------------------------
   The kernels above in sequence, with no interpreter between them: at decode batch sizes the
   Python and torch glue of a per-op step is comparable to the attention itself. */

/* A GEMM kept in GGUF blocks: the weights of quant_kernels.c's vq_gemm_parts (nparts weights
   side by side, each types[p] blocks of ns[p] rows), multiplied by `gemm`, that library's
   vq_gemm_parts (this file does not link it: the caller hands over its address). */
typedef int (*vtok_qgemm_fn)(int nparts, const int *types, const void *const *ws,
                             const int64_t *ns, int64_t k, const float *x, int64_t m,
                             const float *bias, const float *residual, float *y);
typedef struct {
  vtok_qgemm_fn gemm;
  int64_t nparts;
  const int *types;
  const void *const *ws;
  const int64_t *ns;
} vtok_qweight;

typedef struct {
  int64_t hidden, heads, kv_heads, head_dim, intermediate;
  float eps, scale;
  const float *ln1, *qkv, *qkv_bias, *o, *o_bias, *ln2, *gate_up, *down;   /* GEMMs packed */
  const vtok_qweight *qkv_q, *o_q, *gate_up_q, *down_q;   /* or, where not NULL, in blocks */
  int64_t bf16;           /* 1: the packed GEMMs hold bf16 (vtok_packed_gemm_bf16) */
  const float *q_norm, *k_norm;   /* per-head RMSNorm of q and k before RoPE (NULL: none) */
  /* Gemma's sandwich (NULL: Llama's): the attention and MLP outputs normed before their
     residual adds, the MLP's input normed by pre_ffn (ln2 unused) */
  const float *post_attn, *pre_ffn, *post_ffn;
  int64_t gelu;           /* 1: GeGLU (tanh GELU), 0: SiLU */
} vtok_layer;

/* y = x @ W (+ bias) (+ residual) with W packed (float32, or bf16 where L->bf16) or, given qw,
   in GGUF blocks; 0, or -1 where the block GEMM failed (no memory for its quantized
   activations) */
static int layer_gemm(const vtok_layer *L, const float *x, int64_t M, int64_t K,
                      const float *packed, const vtok_qweight *qw, int64_t N, const float *bias,
                      const float *residual, float *y, int prefetch) {
  if (qw) return qw->gemm((int)qw->nparts, qw->types, qw->ws, qw->ns, K, x, M, bias, residual, y);
  if (L->bf16)
    vtok_packed_gemm_bf16(x, M, K, (const uint16_t *)packed, N, bias, residual, y, prefetch);
  else
    vtok_packed_gemm(x, M, K, packed, N, bias, residual, y, prefetch);
  return 0;
}

/* floats of scratch vtok_decode_layer needs for M rows and attention views of width lmax */
int64_t vtok_decode_layer_scratch(const vtok_layer *L, int64_t M, int64_t lmax) {
  const int64_t qkv = (L->heads + 2 * L->kv_heads) * L->head_dim, hd = L->heads * L->head_dim;
  return M * (L->hidden + qkv + 2 * hd + 3 * L->intermediate + L->heads * round16(lmax));
}

/* x [M, hidden] <- the layer applied to x (residual stream, in place); this step's K/V written
   at slot_mapping; attention over views/lens as vtok_decode_attention (mass may be NULL; no
   sinks: a layer with sinks runs op by op); the cache in format fmt with scales k_scale,
   v_scale. 0, or -1 where a block GEMM failed. */
int vtok_decode_layer(const vtok_layer *L, float *x, int64_t M, const float *cos,
                       const float *sin, const int64_t *slot_mapping, void *kv,
                       const int64_t *views, int64_t ld_views, const int64_t *lens, int64_t lmax,
                       float *mass, int64_t ld_mass, float *scratch, int prefetch, int fmt,
                       float k_scale, float v_scale) {
  const int64_t E = L->hidden, H = L->heads, KVH = L->kv_heads, D = L->head_dim;
  const int64_t I = L->intermediate, QKV = (H + 2 * KVH) * D, HD = H * D;
  float *h = scratch, *qkv = h + M * E, *q = qkv + M * QKV, *attn = q + M * HD;
  float *gate_up = attn + M * HD, *act = gate_up + M * 2 * I, *probs = act + M * I;
  vtok_rms_norm(x, M, E, L->ln1, L->eps, h);
  if (layer_gemm(L, h, M, E, L->qkv, L->qkv_q, QKV, L->qkv_bias, NULL, qkv, prefetch)) return -1;
  if (L->q_norm)          /* each head a row of D: normed in place (a row is read, then written) */
    for (int64_t m = 0; m < M; m++) {
      vtok_rms_norm(qkv + m * QKV, H, D, L->q_norm, L->eps, qkv + m * QKV);
      vtok_rms_norm(qkv + m * QKV + HD, KVH, D, L->k_norm, L->eps, qkv + m * QKV + HD);
    }
  vtok_rope_write_kv(qkv, M, H, KVH, D, cos, sin, slot_mapping, kv, q, fmt, k_scale, v_scale,
                     SPREADS(fmt));
  vtok_decode_attention(q, kv, views, ld_views, lens, M, H, KVH, D, L->scale, probs, lmax, attn,
                        mass, ld_mass, fmt, k_scale, v_scale, NULL);
  if (L->post_attn) {     /* x += norm(o(attn)); h = pre_ffn(x) */
    if (layer_gemm(L, attn, M, HD, L->o, L->o_q, E, L->o_bias, NULL, h, prefetch)) return -1;
    add_rms_norm(h, M, E, L->post_attn, L->eps, x);
    vtok_rms_norm(x, M, E, L->pre_ffn, L->eps, h);
  } else {
    if (layer_gemm(L, attn, M, HD, L->o, L->o_q, E, L->o_bias, x, x, prefetch)) return -1;
    vtok_rms_norm(x, M, E, L->ln2, L->eps, h);
  }
  if (layer_gemm(L, h, M, E, L->gate_up, L->gate_up_q, 2 * I, NULL, NULL, gate_up, prefetch))
    return -1;
  if (L->gelu) vtok_gelu_tanh_mul(gate_up, M, I, act);
  else vtok_silu_mul(gate_up, M, I, act);
  if (!L->post_ffn) return layer_gemm(L, act, M, I, L->down, L->down_q, E, NULL, x, x, prefetch);
  if (layer_gemm(L, act, M, I, L->down, L->down_q, E, NULL, NULL, h, prefetch)) return -1;
  add_rms_norm(h, M, E, L->post_ffn, L->eps, x);     /* x += norm(down(act)) */
  return 0;
}

/* The whole decoder stack for one decode step: vtok_decode_layer for layers[0 .. n), layer i's
   cache at kv + i * kv_layer_stride values (format fmt; fp8: layer i's K and V scales are
   scales[2 i], scales[2 i + 1]). One call per step, so the cost of a call from Python is paid
   once per step, not once per layer. 0, or -1 where a block GEMM failed. */
int vtok_decode_layers(const vtok_layer *layers, int64_t n, float *x, int64_t M,
                        const float *cos, const float *sin, const int64_t *slot_mapping,
                        void *kv, int64_t kv_layer_stride, const int64_t *views,
                        int64_t ld_views, const int64_t *lens, int64_t lmax, float *mass,
                        int64_t ld_mass, float *scratch, int prefetch, int fmt,
                        const float *scales) {
  const int64_t es = KV_BYTES(fmt);
  for (int64_t i = 0; i < n; i++)
    if (vtok_decode_layer(layers + i, x, M, cos, sin, slot_mapping,
                          (char *)kv + i * kv_layer_stride * es, views, ld_views, lens, lmax,
                          mass, ld_mass, scratch, prefetch, fmt, scales ? scales[2 * i] : 1.f,
                          scales ? scales[2 * i + 1] : 1.f))
      return -1;
  return 0;
}
