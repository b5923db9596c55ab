/* GEMM on GGUF block-quantized weights: y[m, n] = x[m, k] @ W^T (+ bias) (+ residual).

W is [n, k] in GGML's own blocks of 32 elements, each row k / 32 blocks back to back:
    Q8_0 (type 8)  34 bytes: fp16 d, int8 q[32]                 w = d * q
    Q4_0 (type 2)  18 bytes: fp16 d, uint8 qs[16]               w = d * (nibble - 8)
    Q4_1 (type 3)  20 bytes: fp16 d, fp16 m, uint8 qs[16]       w = d * nibble + m
  (element j < 16 is the low nibble of qs[j], element j + 16 its high nibble)
x is float32; each row is quantized once per call, per 32-element block, to two int8 digits
(one int8 alone, llama.cpp's Q8, costs ~0.5% per GEMM, which flips greedy tokens of a 135M
model; the second digit makes it ~0.002%, for one more u8 x s8 dot product per block):
    dx = max|x| / 127, q = rint(x * (1 / dx)) (round half to even), clamped to +-127,
    r = fma(-dx, q, x), ex = dx / 254, e = rint(r * (1 / ex)), clamped to +-127,
    sx = dx * sum(q) + ex * sum(e)   (for Q4_0's -8 offset and Q4_1's min term)
so x ~ dx * q + ex * e and one block's dot product is two integer dot products:
    Q8_0  dw * (dx * sum(qw * q) + ex * sum(qw * e))
    Q4_0  dw * (dx * sum(nibble * q) + ex * sum(nibble * e)) - 8 * dw * sx
    Q4_1  dw * (dx * sum(nibble * q) + ex * sum(nibble * e)) + mw * sx
OpenMP over the output columns (rows of W); each weight block is decoded once per tile of up
to 4 activation rows, so batched decode streams W once.

Built per ISA like decode_kernels.c (vllm/cpu_kernels.py): VTOK_ISA_AVX512 (512-bit, two
blocks per step; avx512_vnni vpdpbusd when the CPU has it, else avx512bw maddubs/madd),
VTOK_ISA_AVX2 (maddubs/madd), neither: portable C. The x86 variants convert fp16 with F16C
(every AVX2 CPU has it).
*/
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(VTOK_ISA_AVX512) || defined(VTOK_ISA_AVX2)
#pragma GCC target("f16c")
#include <immintrin.h>
#endif

#define QK 32
enum { T_Q4_0 = 2, T_Q4_1 = 3, T_Q8_0 = 8 };

#if defined(VTOK_ISA_AVX512)
static const char *ISA = "avx512";
#elif defined(VTOK_ISA_AVX2)
static const char *ISA = "avx2";
#else
static const char *ISA = "generic";
#endif

const char *vq_isa(void) { return ISA; }

int vq_block_bytes(int type) {
    return type == T_Q8_0 ? 34 : type == T_Q4_0 ? 18 : type == T_Q4_1 ? 20 : 0;
}

static inline uint16_t rd16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return h;
}

static inline float h2f(uint16_t h) {
#if defined(VTOK_ISA_AVX512) || defined(VTOK_ISA_AVX2)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else {            /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* x [m, k] -> q, e int8 [m, k], d, ed, s float [m, k / 32] (see the top of the file). */
void vq_quantize_rows(const float *x, int64_t m, int64_t k, int8_t *q, int8_t *e, float *d,
                      float *ed, float *s) {
    const int64_t nb = k / QK;
#pragma omp parallel for schedule(static) if (m * k >= 65536)
    for (int64_t r = 0; r < m; r++) {
        for (int64_t b = 0; b < nb; b++) {
            const float *xb = x + r * k + b * QK;
            float amax = 0.0f;
            for (int i = 0; i < QK; i++) {
                float a = fabsf(xb[i]);
                amax = a > amax ? a : amax;
            }
            const float dd = amax / 127.0f;
            const float id = dd != 0.0f ? 1.0f / dd : 0.0f;
            const float de = dd / 254.0f;
            const float ide = de != 0.0f ? 1.0f / de : 0.0f;
            int sum = 0, esum = 0;
            int8_t *qb = q + r * k + b * QK, *eb = e + r * k + b * QK;
            for (int i = 0; i < QK; i++) {
                float v = nearbyintf(xb[i] * id);
                v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);
                float ev = nearbyintf(fmaf(-dd, v, xb[i]) * ide);
                ev = ev > 127.0f ? 127.0f : (ev < -127.0f ? -127.0f : ev);
                qb[i] = (int8_t)v;
                eb[i] = (int8_t)ev;
                sum += (int)v;
                esum += (int)ev;
            }
            d[r * nb + b] = dd;
            ed[r * nb + b] = de;
            s[r * nb + b] = dd * (float)sum + de * (float)esum;
        }
    }
}

/* ---- one weight row against MR activation rows ------------------------------------------- */

#if defined(VTOK_ISA_AVX512) || defined(VTOK_ISA_AVX2)

static inline __m256i dec_q4_256(const uint8_t *qs) {
    const __m128i m4 = _mm_set1_epi8(0x0f);
    __m128i b = _mm_loadu_si128((const __m128i *)qs);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m4), _mm_and_si128(b, m4));
}

static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* sum of u8 x s8 products of 32 bytes, as 8 int32 lanes */
static inline __m256i dot256_madd(__m256i u, __m256i s) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

/* TILE256(name, DOT): block-by-block, 256-bit, one block per step */
#define TILE_BLOCK256(DOT, b, blk, acc, cor)                                                   \
    do {                                                                                       \
        const float dw = h2f(rd16(blk));                                                       \
        __m256i w, ws = _mm256_setzero_si256();                                                \
        float mw = 0.0f;                                                                       \
        if (TYPE == T_Q8_0) {                                                                  \
            ws = _mm256_loadu_si256((const __m256i *)(blk + 2));                               \
            w = _mm256_sign_epi8(ws, ws); /* |w| */                                            \
        } else if (TYPE == T_Q4_0) {                                                           \
            w = dec_q4_256(blk + 2);                                                           \
        } else {                                                                               \
            mw = h2f(rd16(blk + 2));                                                           \
            w = dec_q4_256(blk + 4);                                                           \
        }                                                                                      \
        for (int r = 0; r < MR; r++) {                                                         \
            __m256i xv = _mm256_loadu_si256((const __m256i *)(xq[r] + (b) * QK));              \
            __m256i ev = _mm256_loadu_si256((const __m256i *)(xe[r] + (b) * QK));              \
            if (TYPE == T_Q8_0) {                                                              \
                xv = _mm256_sign_epi8(xv, ws);                                                 \
                ev = _mm256_sign_epi8(ev, ws);                                                 \
            }                                                                                  \
            __m256 f = _mm256_cvtepi32_ps(DOT(w, xv));                                         \
            __m256 fe = _mm256_cvtepi32_ps(DOT(w, ev));                                        \
            acc[r] = _mm256_fmadd_ps(f, _mm256_set1_ps(dw * xd[r][b]), acc[r]);                \
            acc[r] = _mm256_fmadd_ps(fe, _mm256_set1_ps(dw * xed[r][b]), acc[r]);              \
            if (TYPE == T_Q4_0) cor[r] -= 8.0f * dw * xs[r][b];                                \
            if (TYPE == T_Q4_1) cor[r] += mw * xs[r][b];                                       \
        }                                                                                      \
    } while (0)

#if defined(VTOK_ISA_AVX512)

static inline __m512i dec_q4_512(const uint8_t *qs0, const uint8_t *qs1) {
    const __m128i m4 = _mm_set1_epi8(0x0f);
    __m128i b0 = _mm_loadu_si128((const __m128i *)qs0), b1 = _mm_loadu_si128((const __m128i *)qs1);
    __m256i lo = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b0, 4), m4), _mm_and_si128(b0, m4));
    __m256i hi = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b1, 4), m4), _mm_and_si128(b1, m4));
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

static inline __m512i load2_256(const uint8_t *p0, const uint8_t *p1) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)p0)),
                              _mm256_loadu_si256((const __m256i *)p1), 1);
}

static inline __m512i dot512_madd(__m512i u, __m512i s) {
    return _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1));
}

/* two blocks (b, b + 1) per step in 512 bits: lanes 0..7 block b, 8..15 block b + 1 */
#define TILE_PAIR512(DOT, b, blk, bb, acc, cor)                                                \
    do {                                                                                       \
        const uint8_t *blk1 = blk + bb;                                                        \
        const float dw0 = h2f(rd16(blk)), dw1 = h2f(rd16(blk1));                               \
        __m512i w, ws = _mm512_setzero_si512();                                                \
        float mw0 = 0.0f, mw1 = 0.0f;                                                          \
        if (TYPE == T_Q8_0) {                                                                  \
            ws = load2_256(blk + 2, blk1 + 2);                                                 \
            w = _mm512_abs_epi8(ws);                                                           \
        } else if (TYPE == T_Q4_0) {                                                           \
            w = dec_q4_512(blk + 2, blk1 + 2);                                                 \
        } else {                                                                               \
            mw0 = h2f(rd16(blk + 2));                                                          \
            mw1 = h2f(rd16(blk1 + 2));                                                         \
            w = dec_q4_512(blk + 4, blk1 + 4);                                                 \
        }                                                                                      \
        const __mmask64 neg = TYPE == T_Q8_0 ? _mm512_movepi8_mask(ws) : 0;                    \
        for (int r = 0; r < MR; r++) {                                                         \
            __m512i xv = _mm512_loadu_si512((const void *)(xq[r] + (b) * QK));                 \
            __m512i ev = _mm512_loadu_si512((const void *)(xe[r] + (b) * QK));                 \
            if (TYPE == T_Q8_0) { /* x * sign(w) (w == 0 contributes |w| = 0 anyway) */        \
                xv = _mm512_mask_sub_epi8(xv, neg, _mm512_setzero_si512(), xv);                \
                ev = _mm512_mask_sub_epi8(ev, neg, _mm512_setzero_si512(), ev);                \
            }                                                                                  \
            __m512 f = _mm512_cvtepi32_ps(DOT(w, xv));                                         \
            __m512 fe = _mm512_cvtepi32_ps(DOT(w, ev));                                        \
            __m512 sc = _mm512_insertf32x8(_mm512_set1_ps(dw0 * xd[r][b]),                     \
                                           _mm256_set1_ps(dw1 * xd[r][(b) + 1]), 1);           \
            __m512 sce = _mm512_insertf32x8(_mm512_set1_ps(dw0 * xed[r][b]),                   \
                                            _mm256_set1_ps(dw1 * xed[r][(b) + 1]), 1);         \
            acc[r] = _mm512_fmadd_ps(f, sc, acc[r]);                                           \
            acc[r] = _mm512_fmadd_ps(fe, sce, acc[r]);                                         \
            if (TYPE == T_Q4_0) cor[r] -= 8.0f * (dw0 * xs[r][b] + dw1 * xs[r][(b) + 1]);      \
            if (TYPE == T_Q4_1) cor[r] += mw0 * xs[r][b] + mw1 * xs[r][(b) + 1];               \
        }                                                                                      \
    } while (0)

#define DEFINE_TILE(NAME, DOT512, DOT256)                                                      \
    static inline __attribute__((always_inline)) void NAME(                                    \
        const int TYPE, const int MR, const uint8_t *wrow, int64_t nb, const int8_t **xq,      \
        const int8_t **xe, const float **xd, const float **xed, const float **xs, float *out) {\
        const int64_t bb = vq_block_bytes(TYPE);                                               \
        __m512 acc[4];                                                                         \
        __m256 acc2[4];                                                                        \
        float cor[4];                                                                          \
        for (int r = 0; r < MR; r++) {                                                         \
            acc[r] = _mm512_setzero_ps();                                                      \
            acc2[r] = _mm256_setzero_ps();                                                     \
            cor[r] = 0.0f;                                                                     \
        }                                                                                      \
        int64_t b = 0;                                                                         \
        for (; b + 2 <= nb; b += 2) {                                                          \
            const uint8_t *blk = wrow + b * bb;                                                \
            TILE_PAIR512(DOT512, b, blk, bb, acc, cor);                                        \
        }                                                                                      \
        if (b < nb) {                                                                          \
            const uint8_t *blk = wrow + b * bb;                                                \
            TILE_BLOCK256(DOT256, b, blk, acc2, cor);                                          \
        }                                                                                      \
        for (int r = 0; r < MR; r++)                                                           \
            out[r] = _mm512_reduce_add_ps(acc[r]) + hsum256(acc2[r]) + cor[r];                 \
    }

DEFINE_TILE(tile_madd, dot512_madd, dot256_madd)

#pragma GCC push_options
#pragma GCC target("avx512vnni")
static inline __m512i dot512_vnni(__m512i u, __m512i s) {
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s);
}
static inline __m256i dot256_vnni(__m256i u, __m256i s) {
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
}
DEFINE_TILE(tile_vnni, dot512_vnni, dot256_vnni)
#pragma GCC pop_options

#else /* AVX2 */

static inline __attribute__((always_inline)) void tile_madd(
    const int TYPE, const int MR, const uint8_t *wrow, int64_t nb, const int8_t **xq,
    const int8_t **xe, const float **xd, const float **xed, const float **xs, float *out) {
    const int64_t bb = vq_block_bytes(TYPE);
    __m256 acc[4];
    float cor[4];
    for (int r = 0; r < MR; r++) {
        acc[r] = _mm256_setzero_ps();
        cor[r] = 0.0f;
    }
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = wrow + b * bb;
        TILE_BLOCK256(dot256_madd, b, blk, acc, cor);
    }
    for (int r = 0; r < MR; r++) out[r] = hsum256(acc[r]) + cor[r];
}

#endif /* AVX512 / AVX2 */

#else /* generic */

static inline __attribute__((always_inline)) void tile_madd(
    const int TYPE, const int MR, const uint8_t *wrow, int64_t nb, const int8_t **xq,
    const int8_t **xe, const float **xd, const float **xed, const float **xs, float *out) {
    const int64_t bb = vq_block_bytes(TYPE);
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = wrow + b * bb;
        const float dw = h2f(rd16(blk));
        int8_t w[QK];
        float mw = 0.0f;
        if (TYPE == T_Q8_0) {
            memcpy(w, blk + 2, QK);
        } else {
            const uint8_t *qs = blk + (TYPE == T_Q4_1 ? 4 : 2);
            if (TYPE == T_Q4_1) mw = h2f(rd16(blk + 2));
            for (int j = 0; j < QK / 2; j++) {
                w[j] = (int8_t)(qs[j] & 0x0f);
                w[j + QK / 2] = (int8_t)(qs[j] >> 4);
            }
        }
        for (int r = 0; r < MR; r++) {
            const int8_t *x = xq[r] + b * QK, *ex = xe[r] + b * QK;
            int32_t sum = 0, esum = 0;
            for (int j = 0; j < QK; j++) {
                sum += (int32_t)w[j] * (int32_t)x[j];
                esum += (int32_t)w[j] * (int32_t)ex[j];
            }
            acc[r] += (float)sum * (dw * xd[r][b]);
            acc[r] += (float)esum * (dw * xed[r][b]);
            if (TYPE == T_Q4_0) acc[r] -= 8.0f * dw * xs[r][b];
            if (TYPE == T_Q4_1) acc[r] += mw * xs[r][b];
        }
    }
    for (int r = 0; r < MR; r++) out[r] = acc[r];
}

#endif

/* the tile for a (type, rows) pair known at compile time */
#define DISPATCH(TILE, type, mr, ...)                                                          \
    do {                                                                                       \
        switch ((type) * 8 + (mr)) {                                                           \
        case T_Q8_0 * 8 + 1: TILE(T_Q8_0, 1, __VA_ARGS__); break;                              \
        case T_Q8_0 * 8 + 2: TILE(T_Q8_0, 2, __VA_ARGS__); break;                              \
        case T_Q8_0 * 8 + 3: TILE(T_Q8_0, 3, __VA_ARGS__); break;                              \
        case T_Q8_0 * 8 + 4: TILE(T_Q8_0, 4, __VA_ARGS__); break;                              \
        case T_Q4_0 * 8 + 1: TILE(T_Q4_0, 1, __VA_ARGS__); break;                              \
        case T_Q4_0 * 8 + 2: TILE(T_Q4_0, 2, __VA_ARGS__); break;                              \
        case T_Q4_0 * 8 + 3: TILE(T_Q4_0, 3, __VA_ARGS__); break;                              \
        case T_Q4_0 * 8 + 4: TILE(T_Q4_0, 4, __VA_ARGS__); break;                              \
        case T_Q4_1 * 8 + 1: TILE(T_Q4_1, 1, __VA_ARGS__); break;                              \
        case T_Q4_1 * 8 + 2: TILE(T_Q4_1, 2, __VA_ARGS__); break;                              \
        case T_Q4_1 * 8 + 3: TILE(T_Q4_1, 3, __VA_ARGS__); break;                              \
        case T_Q4_1 * 8 + 4: TILE(T_Q4_1, 4, __VA_ARGS__); break;                              \
        }                                                                                      \
    } while (0)

/* the columns [j0, j1) of y, all rows */
#define COLUMNS_BODY(TILE)                                                                     \
    for (int64_t j = j0; j < j1; j++) {                                                        \
        const uint8_t *wrow = w + j * nb * bb;                                                 \
        for (int64_t i0 = 0; i0 < m; i0 += 4) {                                                \
            const int mr = m - i0 < 4 ? (int)(m - i0) : 4;                                     \
            const int8_t *xqp[4], *xep[4];                                                     \
            const float *xdp[4], *xedp[4], *xsp[4];                                            \
            float out[4] = {0.0f, 0.0f, 0.0f, 0.0f};                                           \
            for (int r = 0; r < mr; r++) {                                                     \
                xqp[r] = xq + (i0 + r) * k;                                                    \
                xep[r] = xq + (m + i0 + r) * k;                                                \
                xdp[r] = xd + (i0 + r) * nb;                                                   \
                xedp[r] = xd + (m + i0 + r) * nb;                                              \
                xsp[r] = xs + (i0 + r) * nb;                                                   \
            }                                                                                  \
            DISPATCH(TILE, type, mr, wrow, nb, xqp, xep, xdp, xedp, xsp, out);                 \
            for (int r = 0; r < mr; r++) {                                                     \
                float v = out[r];                                                              \
                if (bias) v += bias[j];                                                        \
                if (residual) v += residual[(i0 + r) * n + j];                                 \
                y[(i0 + r) * n + j] = v;                                                       \
            }                                                                                  \
        }                                                                                      \
    }

static void columns_madd(int type, const uint8_t *w, int64_t j0, int64_t j1, int64_t n,
                         int64_t k, const int8_t *xq, const float *xd, const float *xs,
                         int64_t m, const float *bias, const float *residual, float *y) {
    const int64_t nb = k / QK, bb = vq_block_bytes(type);
    COLUMNS_BODY(tile_madd)
}

#if defined(VTOK_ISA_AVX512)
#pragma GCC push_options
#pragma GCC target("avx512vnni")
static void columns_vnni(int type, const uint8_t *w, int64_t j0, int64_t j1, int64_t n,
                         int64_t k, const int8_t *xq, const float *xd, const float *xs,
                         int64_t m, const float *bias, const float *residual, float *y) {
    const int64_t nb = k / QK, bb = vq_block_bytes(type);
    COLUMNS_BODY(tile_vnni)
}
#pragma GCC pop_options
#endif

/* 1 when this build uses vpdpbusd on this CPU */
int vq_uses_vnni(void) {
#if defined(VTOK_ISA_AVX512)
    return __builtin_cpu_supports("avx512vnni") ? 1 : 0;
#else
    return 0;
#endif
}

/* GEMM on already quantized activations (vq_quantize_rows): xq holds q [m, k] then e [m, k],
   xd holds d [m, k / 32] then ed [m, k / 32] */
void vq_gemm_q(int type, const uint8_t *w, int64_t n, int64_t k, const int8_t *xq,
               const float *xd, const float *xs, int64_t m, const float *bias,
               const float *residual, float *y) {
    if (vq_block_bytes(type) == 0 || k % QK) return;
    const int vnni = vq_uses_vnni();
    /* columns in chunks of 8 (whole cache lines of y per thread, mostly) */
    const int64_t chunks = (n + 7) / 8;
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t j0 = c * 8, j1 = j0 + 8 < n ? j0 + 8 : n;
#if defined(VTOK_ISA_AVX512)
        if (vnni) {
            columns_vnni(type, w, j0, j1, n, k, xq, xd, xs, m, bias, residual, y);
            continue;
        }
#endif
        (void)vnni;
        columns_madd(type, w, j0, j1, n, k, xq, xd, xs, m, bias, residual, y);
    }
}

/* y [m, n] = x [m, k] @ W^T (+ bias [n]) (+ residual [m, n]); returns 0, or -1 on a bad type,
   k not a multiple of 32 or no memory */
int vq_gemm(int type, const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t m,
            const float *bias, const float *residual, float *y) {
    if (vq_block_bytes(type) == 0 || k % QK || m < 0 || n < 0) return -1;
    if (m == 0 || n == 0) return 0;
    const int64_t nb = k / QK;
    int8_t *xq = (int8_t *)malloc((size_t)(2 * m * k) + 64);
    float *xd = (float *)malloc(sizeof(float) * (size_t)(m * nb) * 3);
    if (!xq || !xd) {
        free(xq);
        free(xd);
        return -1;
    }
    float *xs = xd + 2 * m * nb;
    vq_quantize_rows(x, m, k, xq, xq + m * k, xd, xd + m * nb, xs);
    vq_gemm_q(type, w, n, k, xq, xd, xs, m, bias, residual, y);
    free(xq);
    free(xd);
    return 0;
}
