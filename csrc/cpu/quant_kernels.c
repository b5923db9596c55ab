/* GEMM on GGUF block-quantized weights: y[m, n] = x[m, k] @ W^T (+ bias) (+ residual).

W is [n, k] in GGML's own blocks, each row k / (elements per block) blocks back to back.
32-element blocks (element j < 16 is the low nibble of qs[j], element j + 16 its high nibble;
bit j of the little-endian uint32 qh is element j's fifth bit):
    Q8_0 (type 8)   34 bytes: fp16 d, int8 q[32]                        w = d * q
    Q4_0 (type 2)   18 bytes: fp16 d, uint8 qs[16]                      w = d * (q4 - 8)
    Q4_1 (type 3)   20 bytes: fp16 d, fp16 m, uint8 qs[16]              w = d * q4 + m
    Q5_0 (type 6)   22 bytes: fp16 d, uint32 qh, uint8 qs[16]           w = d * (q5 - 16)
    Q5_1 (type 7)   24 bytes: fp16 d, fp16 m, uint32 qh, uint8 qs[16]   w = d * q5 + m
256-element super-blocks (the K-quants), read here as 8 sub-blocks of 32:
    Q4_K (type 12) 144 bytes: fp16 d, fp16 dmin, uint8 scales[12], uint8 qs[128]
        sub-block j: a 6-bit scale sc_j and min m_j packed in scales (k4_scale_min); its 32
        elements are the low (j even) or high (j odd) nibbles of qs[32 * (j / 2) ..]
        w = (d * sc_j) * q4 - dmin * m_j
    Q6_K (type 14) 210 bytes: uint8 ql[128], uint8 qh[64], int8 scales[16], fp16 d
        element 128 h + 32 g + l (h < 2, g < 4, l < 32): its low 4 bits are a nibble of
        ql[64 h + 32 (g & 1) + l] (the high one when g >= 2), its top 2 bits are bits 2g, 2g + 1
        of qh[32 h + l]; w = d * scales[element / 16] * (q6 - 32)
x is float32; each row is quantized once per call, per 32-element block, to two int8 digits
(one int8 alone, llama.cpp's Q8, costs ~0.5% per GEMM, which flips greedy tokens of a 135M
model; the second digit makes it ~0.002%, for one more u8 x s8 dot product per block):
    dx = max|x| / 127, q = rint(x * (1 / dx)) (round half to even), clamped to +-127,
    r = fma(-dx, q, x), ex = dx / 254, e = rint(r * (1 / ex)), clamped to +-127,
    sx = dx * sum(q) + ex * sum(e)   (for the offsets and mins)
so x ~ dx * q + ex * e, and with dot(w, x) = dx * sum(w * q) + ex * sum(w * e) (two integer dot
products) one 32-element block contributes
    Q8_0        dw * dot(q8, x)
    Q4_0, Q5_0  dw * dot(q, x) - 8 * dw * sx (16 for Q5_0)
    Q4_1, Q5_1  dw * dot(q, x) + mw * sx
    Q4_K        (d * sc_j) * dot(q4, x) - (dmin * m_j) * sx   (both products exact in fp32)
    Q6_K        d * sc_a * dot(q6 - 32, x)[first 16] + d * sc_b * dot(q6 - 32, x)[last 16]
Signed weights (Q8_0, Q6_K) are multiplied as |w| (u8) times x * sign(w) (s8).
OpenMP over the output columns (rows of W); each weight block is decoded once per tile of up
to 4 activation rows, so batched decode streams W once. vq_gemm_parts multiplies x by several
weights of different types at once (a fused Q/K/V whose V is Q6_K while Q and K are Q4_K, as a
Q4_K_M file has), quantizing x once, each weight's columns side by side in y.

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
#define QK_K 256
#define MAX_PARTS 8
enum { T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8, T_Q4_K = 12, T_Q6_K = 14 };

#if defined(VTOK_ISA_AVX512)
static const char *ISA = "avx512";
#elif defined(VTOK_ISA_AVX2)
static const char *ISA = "avx2";
#else
static const char *ISA = "generic";
#endif

const char *vq_isa(void) { return ISA; }

/* bytes of one block of `type`, 0 for a type these kernels do not cover (static: calls to an
   exported function are not inlined in a -fPIC build, and the kernels ask per block) */
static inline int block_bytes(int type) {
    switch (type) {
    case T_Q8_0: return 34;
    case T_Q4_0: return 18;
    case T_Q4_1: return 20;
    case T_Q5_0: return 22;
    case T_Q5_1: return 24;
    case T_Q4_K: return 144;
    case T_Q6_K: return 210;
    default: return 0;
    }
}

/* elements of one block of `type` (0: not covered) */
static inline int block_elems(int type) {
    if (block_bytes(type) == 0) return 0;
    return type == T_Q4_K || type == T_Q6_K ? QK_K : QK;
}

int vq_block_bytes(int type) { return block_bytes(type); }

int vq_block_elems(int type) { return block_elems(type); }

static inline int is_signed(int type) { return type == T_Q8_0 || type == T_Q6_K; }

/* whether a block's product has an activation-sum term (an offset or a min) */
static inline int has_sum_term(int type) { return !is_signed(type); }

/* byte offset in a row of the block holding 32-element block b */
static inline int64_t block_offset(int type, int64_t b) {
    return block_elems(type) == QK_K ? (b >> 3) * block_bytes(type)
                                        : b * block_bytes(type);
}

static inline uint16_t rd16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return h;
}

static inline uint32_t rd32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
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

/* Q4_K sub-block j's 6-bit scale and min from the 12 packed bytes s:
       j < 4:  sc = s[j] & 63,                            m = s[j + 4] & 63
       j >= 4: sc = (s[j + 4] & 15) | (s[j - 4] >> 6) << 4,  m = (s[j + 4] >> 4) | (s[j] >> 6) << 4
   (bytes 0..7 keep the low 6 bits of sub-blocks 0..3; their top 2 bits are the high bits of
   sub-blocks 4..7, whose low 4 bits are the nibbles of bytes 8..11) */
static inline void k4_scale_min(const uint8_t *s, int j, int *sc, int *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 15) | (s[j - 4] >> 6) << 4;
        *m = (s[j + 4] >> 4) | (s[j] >> 6) << 4;
    }
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

/* the tile for a (type, rows) pair known at compile time */
#define CASE_TYPE(TILE, T, ...)                                                                \
    case T * 8 + 1: TILE(T, 1, __VA_ARGS__); break;                                            \
    case T * 8 + 2: TILE(T, 2, __VA_ARGS__); break;                                            \
    case T * 8 + 3: TILE(T, 3, __VA_ARGS__); break;                                            \
    case T * 8 + 4: TILE(T, 4, __VA_ARGS__); break;
#define DISPATCH(TILE, type, mr, ...)                                                          \
    do {                                                                                       \
        switch ((type) * 8 + (mr)) {                                                           \
            CASE_TYPE(TILE, T_Q8_0, __VA_ARGS__)                                               \
            CASE_TYPE(TILE, T_Q4_0, __VA_ARGS__)                                               \
            CASE_TYPE(TILE, T_Q4_1, __VA_ARGS__)                                               \
            CASE_TYPE(TILE, T_Q5_0, __VA_ARGS__)                                               \
            CASE_TYPE(TILE, T_Q5_1, __VA_ARGS__)                                               \
            CASE_TYPE(TILE, T_Q4_K, __VA_ARGS__)                                               \
            CASE_TYPE(TILE, T_Q6_K, __VA_ARGS__)                                               \
        }                                                                                      \
    } while (0)

/* FN(T, ...) for a type known at compile time */
#define TYPE_SWITCH(FN, type, ...)                                                             \
    do {                                                                                       \
        switch (type) {                                                                        \
        case T_Q8_0: FN(T_Q8_0, __VA_ARGS__); break;                                           \
        case T_Q4_0: FN(T_Q4_0, __VA_ARGS__); break;                                           \
        case T_Q4_1: FN(T_Q4_1, __VA_ARGS__); break;                                           \
        case T_Q5_0: FN(T_Q5_0, __VA_ARGS__); break;                                           \
        case T_Q5_1: FN(T_Q5_1, __VA_ARGS__); break;                                           \
        case T_Q4_K: FN(T_Q4_K, __VA_ARGS__); break;                                           \
        case T_Q6_K: FN(T_Q6_K, __VA_ARGS__); break;                                           \
        }                                                                                      \
    } while (0)

/* ---- one weight row against MR activation rows ------------------------------------------- */

#if defined(VTOK_ISA_AVX512) || defined(VTOK_ISA_AVX2)

#define ALWAYS_INLINE static inline __attribute__((always_inline))

static inline __m256i dec_q4_256(const uint8_t *qs) {
    const __m128i m4 = _mm_set1_epi8(0x0f);
    __m128i b = _mm_loadu_si128((const __m128i *)qs);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m4), _mm_and_si128(b, m4));
}

/* byte j = 0x10 where bit j of qh is set: qh's byte j / 8 spread over 8 lanes, each tested
   against its own bit 1 << (j % 8); qh = 0x00000105 -> bytes 0, 2 and 8 are 0x10 */
static inline __m256i bit5_256(uint32_t qh) {
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), spread);
    v = _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
    return _mm256_and_si256(v, _mm256_set1_epi8(0x10));
}

/* 32 bytes p, each shifted right by `shift` bits (the 16-bit shift moves bits across bytes,
   which the mask clears) and masked */
static inline __m256i shr_mask256(__m256i p, int shift, int mask) {
    return _mm256_and_si256(_mm256_srl_epi16(p, _mm_cvtsi32_si128(shift)),
                            _mm256_set1_epi8((char)mask));
}

/* Q6_K sub-block s (0..7) of the super-block at blk as signed bytes q6 - 32 */
static inline __m256i q6k_sub256(const uint8_t *blk, int s) {
    const int h = s >> 2, g = s & 3;
    __m256i lo = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32 * (g & 1)));
    __m256i hi = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
    lo = shr_mask256(lo, 4 * (g >> 1), 0x0f);
    hi = _mm256_slli_epi16(shr_mask256(hi, 2 * g, 0x03), 4);   /* bits 0..1 -> 4..5 */
    return _mm256_sub_epi8(_mm256_or_si256(lo, hi), _mm256_set1_epi8(32));
}

/* A K-quant super-block's scales, once for its 8 sub-blocks: Q4_K dw[j] = d * sc_j and
   cw[j] = -dmin * m_j; Q6_K dw[i] = d * scales[i] for its 16 halves */
ALWAYS_INLINE void kq_scales(const int TYPE, const uint8_t *blk, float *dw, float *cw) {
    if (TYPE == T_Q4_K) {
        const float d = h2f(rd16(blk)), dmin = h2f(rd16(blk + 2));
        for (int j = 0; j < 8; j++) {
            int sc, mn;
            k4_scale_min(blk + 4, j, &sc, &mn);
            dw[j] = d * (float)sc;
            cw[j] = -dmin * (float)mn;
        }
    } else {
        const __m256 d = _mm256_set1_ps(h2f(rd16(blk + 208)));
        for (int i = 0; i < 16; i += 8) {
            __m128i s8 = _mm_loadl_epi64((const __m128i *)(blk + 192 + i));
            __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s8));
            _mm256_storeu_ps(dw + i, _mm256_mul_ps(sc, d));
        }
    }
}

/* 32-element block b of a weight row as unsigned bytes w (|w| for the signed types, whose signs
   are *ws), its scale *dw and activation-sum coefficient *cw (the row's dot product gains
   dw * dot(w, x) + cw * sx); Q6_K's two 16-element scales come as *wsc (the int32 lanes 0..3 of
   a dot product sum its first 16 elements, lanes 4..7 the last 16). K-quants: kdw, kcw hold
   the super-block's kq_scales */
ALWAYS_INLINE __m256i decode256(const int TYPE, const uint8_t *wrow, int64_t b, const float *kdw,
                                const float *kcw, __m256i *ws, float *dw, float *cw,
                                __m256 *wsc) {
    const uint8_t *blk = wrow + block_offset(TYPE, b);
    const int j = (int)(b & 7);                              /* K-quants' sub-block */
    if (TYPE == T_Q8_0) {
        *dw = h2f(rd16(blk));
        *ws = _mm256_loadu_si256((const __m256i *)(blk + 2));
        return _mm256_sign_epi8(*ws, *ws);
    } else if (TYPE == T_Q4_0) {
        *dw = h2f(rd16(blk));
        *cw = -8.0f * *dw;
        return dec_q4_256(blk + 2);
    } else if (TYPE == T_Q4_1) {
        *dw = h2f(rd16(blk));
        *cw = h2f(rd16(blk + 2));
        return dec_q4_256(blk + 4);
    } else if (TYPE == T_Q5_0) {
        *dw = h2f(rd16(blk));
        *cw = -16.0f * *dw;
        return _mm256_or_si256(dec_q4_256(blk + 6), bit5_256(rd32(blk + 2)));
    } else if (TYPE == T_Q5_1) {
        *dw = h2f(rd16(blk));
        *cw = h2f(rd16(blk + 2));
        return _mm256_or_si256(dec_q4_256(blk + 8), bit5_256(rd32(blk + 4)));
    } else if (TYPE == T_Q4_K) {
        *dw = kdw[j];
        *cw = kcw[j];
        __m256i q = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * (j >> 1)));
        return shr_mask256(q, 4 * (j & 1), 0x0f);
    } else { /* T_Q6_K */
        *wsc = _mm256_set_m128(_mm_broadcast_ss(kdw + 2 * j + 1), _mm_broadcast_ss(kdw + 2 * j));
        *ws = q6k_sub256(blk, j);
        return _mm256_sign_epi8(*ws, *ws);
    }
}

static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* sum of u8 x s8 products of 32 bytes, as 8 int32 lanes (lane i: bytes 4i..4i+3) */
static inline __m256i dot256_madd(__m256i u, __m256i s) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

/* block b (decode256) against the MR activation rows, 256-bit. With one or two rows the two
   digits' products go to two accumulators (acc, acce): a row's loop-carried chain is then one
   fma per block, not two; more rows interleave their chains anyway and need the registers */
#define TILE_BLOCK256(DOT, b, kdw, kcw, acc, acce, cor)                                        \
    do {                                                                                       \
        __m256i ws = _mm256_setzero_si256();                                                   \
        __m256 wsc = _mm256_setzero_ps();                                                      \
        float dw = 0.0f, cw = 0.0f;                                                            \
        const __m256i w = decode256(TYPE, wrow, b, kdw, kcw, &ws, &dw, &cw, &wsc);             \
        for (int r = 0; r < MR; r++) {                                                         \
            __m256i xv = _mm256_loadu_si256((const __m256i *)(xq[r] + (b) * QK));              \
            __m256i ev = _mm256_loadu_si256((const __m256i *)(xe[r] + (b) * QK));              \
            if (is_signed(TYPE)) {                                                             \
                xv = _mm256_sign_epi8(xv, ws);                                                 \
                ev = _mm256_sign_epi8(ev, ws);                                                 \
            }                                                                                  \
            __m256 f = _mm256_cvtepi32_ps(DOT(w, xv));                                         \
            __m256 fe = _mm256_cvtepi32_ps(DOT(w, ev));                                        \
            if (TYPE == T_Q6_K) {                                                              \
                f = _mm256_mul_ps(f, _mm256_set1_ps(xd[r][b]));                                \
                fe = _mm256_mul_ps(fe, _mm256_set1_ps(xed[r][b]));                             \
                acc[r] = _mm256_fmadd_ps(f, wsc, acc[r]);                                      \
                if (MR <= 2) acce[r] = _mm256_fmadd_ps(fe, wsc, acce[r]);                      \
                else acc[r] = _mm256_fmadd_ps(fe, wsc, acc[r]);                                \
            } else {                                                                           \
                acc[r] = _mm256_fmadd_ps(f, _mm256_set1_ps(dw * xd[r][b]), acc[r]);            \
                const __m256 se = _mm256_set1_ps(dw * xed[r][b]);                              \
                if (MR <= 2) acce[r] = _mm256_fmadd_ps(fe, se, acce[r]);                       \
                else acc[r] = _mm256_fmadd_ps(fe, se, acc[r]);                                 \
            }                                                                                  \
            if (has_sum_term(TYPE)) cor[r] += cw * xs[r][b];                                   \
        }                                                                                      \
    } while (0)

/* every block of a weight row, STEP(DOT, b, kdw, kcw, acc, acce, cor) per STEPB blocks from b
   on (as far as whole steps go); K-quants by super-block, their scales decoded once and the
   sub-block loop unrolled (constant shifts) */
#define ROW_LOOP(STEPB, STEP, DOT)                                                             \
    do {                                                                                       \
        if (block_elems(TYPE) == QK_K) {                                                    \
            for (int64_t sb = 0; sb < nb / 8; sb++) {                                          \
                float kdw[16], kcw[8];                                                         \
                kq_scales(TYPE, wrow + sb * block_bytes(TYPE), kdw, kcw);                   \
                _Pragma("GCC unroll 8")                                                        \
                for (int j = 0; j < 8; j += STEPB)                                             \
                    STEP(DOT, sb * 8 + j, kdw, kcw, acc, acce, cor);                           \
            }                                                                                  \
        } else {                                                                               \
            for (; b + STEPB <= nb; b += STEPB)                                                \
                STEP(DOT, b, (const float *)0, (const float *)0, acc, acce, cor);              \
        }                                                                                      \
    } while (0)

#if defined(VTOK_ISA_AVX512)

static inline __m512i dec_q4_512(const uint8_t *qs0, const uint8_t *qs1) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(dec_q4_256(qs0)), dec_q4_256(qs1), 1);
}

static inline __m512i load2_256(const uint8_t *p0, const uint8_t *p1) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)p0)),
                              _mm256_loadu_si256((const __m256i *)p1), 1);
}

/* the fifth bits of two Q5 blocks: bytes 0..31 from qh0, 32..63 from qh1 */
static inline __m512i bit5_512(uint32_t qh0, uint32_t qh1) {
    return _mm512_maskz_set1_epi8((__mmask64)qh0 | (__mmask64)qh1 << 32, 0x10);
}

/* Q6_K sub-blocks s, s + 1 (s even) as signed bytes q6 - 32: their low 4 bits are the same
   nibble of 64 consecutive ql bytes, their top 2 bits bits 2g and 2g + 2 of the same 32 qh */
static inline __m512i q6k_pair512(const uint8_t *blk, int s) {
    const int h = s >> 2, g = s & 3;
    __m512i lo = _mm512_loadu_si512((const void *)(blk + 64 * h));
    lo = _mm512_and_si512(_mm512_srl_epi16(lo, _mm_cvtsi32_si128(2 * g)), _mm512_set1_epi8(0x0f));
    __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
    __m512i hi = _mm512_inserti64x4(_mm512_castsi256_si512(shr_mask256(qh, 2 * g, 0x03)),
                                    shr_mask256(qh, 2 * g + 2, 0x03), 1);
    hi = _mm512_slli_epi16(hi, 4);
    return _mm512_sub_epi8(_mm512_or_si512(lo, hi), _mm512_set1_epi8(32));
}

/* blocks b, b + 1 (b even) of a weight row: w (bytes 0..31 block b), as decode256; per block
   scales dw[2] and activation-sum coefficients cw[2]; Q6_K's four 16-element scales as *wsc
   (4 int32 lanes each) */
ALWAYS_INLINE __m512i decode512(const int TYPE, const uint8_t *wrow, int64_t b, const float *kdw,
                                const float *kcw, __m512i *ws, float *dw, float *cw,
                                __m512 *wsc) {
    const int64_t bb = block_bytes(TYPE);
    const uint8_t *blk = wrow + block_offset(TYPE, b), *blk1 = blk + bb;
    const int j = (int)(b & 7);                              /* K-quants' sub-block (even) */
    if (TYPE == T_Q8_0 || TYPE == T_Q4_0 || TYPE == T_Q4_1 || TYPE == T_Q5_0 ||
        TYPE == T_Q5_1) {
        dw[0] = h2f(rd16(blk));
        dw[1] = h2f(rd16(blk1));
    }
    if (TYPE == T_Q8_0) {
        *ws = load2_256(blk + 2, blk1 + 2);
        return _mm512_abs_epi8(*ws);
    } else if (TYPE == T_Q4_0) {
        cw[0] = -8.0f * dw[0];
        cw[1] = -8.0f * dw[1];
        return dec_q4_512(blk + 2, blk1 + 2);
    } else if (TYPE == T_Q4_1) {
        cw[0] = h2f(rd16(blk + 2));
        cw[1] = h2f(rd16(blk1 + 2));
        return dec_q4_512(blk + 4, blk1 + 4);
    } else if (TYPE == T_Q5_0) {
        cw[0] = -16.0f * dw[0];
        cw[1] = -16.0f * dw[1];
        return _mm512_or_si512(dec_q4_512(blk + 6, blk1 + 6),
                               bit5_512(rd32(blk + 2), rd32(blk1 + 2)));
    } else if (TYPE == T_Q5_1) {
        cw[0] = h2f(rd16(blk + 2));
        cw[1] = h2f(rd16(blk1 + 2));
        return _mm512_or_si512(dec_q4_512(blk + 8, blk1 + 8),
                               bit5_512(rd32(blk + 4), rd32(blk1 + 4)));
    } else if (TYPE == T_Q4_K) { /* sub-blocks j, j + 1: low and high nibbles of 32 bytes */
        dw[0] = kdw[j];
        dw[1] = kdw[j + 1];
        cw[0] = kcw[j];
        cw[1] = kcw[j + 1];
        __m256i q = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * (j >> 1)));
        return _mm512_inserti64x4(_mm512_castsi256_si512(shr_mask256(q, 0, 0x0f)),
                                  shr_mask256(q, 4, 0x0f), 1);
    } else { /* T_Q6_K: [a, b, c, d] -> [a a a a b b b b c c c c d d d d] */
        const __m512i four = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
        *wsc = _mm512_permutexvar_ps(four, _mm512_castps128_ps512(_mm_loadu_ps(kdw + 2 * j)));
        *ws = q6k_pair512(blk, j);
        return _mm512_abs_epi8(*ws);
    }
}

static inline __m512i dot512_madd(__m512i u, __m512i s) {
    return _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1));
}

/* two blocks (b, b + 1) per step in 512 bits: lanes 0..7 block b, 8..15 block b + 1; the
   accumulators as in TILE_BLOCK256 */
#define TILE_PAIR512(DOT, b, kdw, kcw, acc, acce, cor)                                         \
    do {                                                                                       \
        __m512i ws = _mm512_setzero_si512();                                                   \
        __m512 wsc = _mm512_setzero_ps();                                                      \
        float dw[2] = {0.0f, 0.0f}, cw[2] = {0.0f, 0.0f};                                      \
        const __m512i w = decode512(TYPE, wrow, b, kdw, kcw, &ws, dw, cw, &wsc);               \
        const __mmask64 neg = is_signed(TYPE) ? _mm512_movepi8_mask(ws) : 0;                   \
        for (int r = 0; r < MR; r++) {                                                         \
            __m512i xv = _mm512_loadu_si512((const void *)(xq[r] + (b) * QK));                 \
            __m512i ev = _mm512_loadu_si512((const void *)(xe[r] + (b) * QK));                 \
            if (is_signed(TYPE)) { /* x * sign(w) (w == 0 contributes |w| = 0 anyway) */       \
                xv = _mm512_mask_sub_epi8(xv, neg, _mm512_setzero_si512(), xv);                \
                ev = _mm512_mask_sub_epi8(ev, neg, _mm512_setzero_si512(), ev);                \
            }                                                                                  \
            __m512 f = _mm512_cvtepi32_ps(DOT(w, xv));                                         \
            __m512 fe = _mm512_cvtepi32_ps(DOT(w, ev));                                        \
            if (TYPE == T_Q6_K) {                                                              \
                __m512 sx = _mm512_insertf32x8(_mm512_set1_ps(xd[r][b]),                       \
                                               _mm256_set1_ps(xd[r][(b) + 1]), 1);             \
                __m512 se = _mm512_insertf32x8(_mm512_set1_ps(xed[r][b]),                      \
                                               _mm256_set1_ps(xed[r][(b) + 1]), 1);            \
                acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(f, sx), wsc, acc[r]);                   \
                if (MR <= 2) acce[r] = _mm512_fmadd_ps(_mm512_mul_ps(fe, se), wsc, acce[r]);   \
                else acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(fe, se), wsc, acc[r]);             \
            } else {                                                                           \
                __m512 sc = _mm512_insertf32x8(_mm512_set1_ps(dw[0] * xd[r][b]),               \
                                               _mm256_set1_ps(dw[1] * xd[r][(b) + 1]), 1);     \
                __m512 sce = _mm512_insertf32x8(_mm512_set1_ps(dw[0] * xed[r][b]),             \
                                                _mm256_set1_ps(dw[1] * xed[r][(b) + 1]), 1);   \
                acc[r] = _mm512_fmadd_ps(f, sc, acc[r]);                                       \
                if (MR <= 2) acce[r] = _mm512_fmadd_ps(fe, sce, acce[r]);                      \
                else acc[r] = _mm512_fmadd_ps(fe, sce, acc[r]);                                \
            }                                                                                  \
            if (has_sum_term(TYPE)) cor[r] += cw[0] * xs[r][b] + cw[1] * xs[r][(b) + 1];       \
        }                                                                                      \
    } while (0)

#define DEFINE_TILE(NAME, DOT512, DOT256)                                                      \
    ALWAYS_INLINE void NAME(const int TYPE, const int MR, const uint8_t *wrow, int64_t nb,     \
                            const int8_t **xq, const int8_t **xe, const float **xd,            \
                            const float **xed, const float **xs, float *out) {                 \
        __m512 acc[4], acce[4];                                                                \
        __m256 acc2[4], acce2[4];                                                              \
        float cor[4];                                                                          \
        for (int r = 0; r < MR; r++) {                                                         \
            acc[r] = acce[r] = _mm512_setzero_ps();                                            \
            acc2[r] = acce2[r] = _mm256_setzero_ps();                                          \
            cor[r] = 0.0f;                                                                     \
        }                                                                                      \
        int64_t b = 0;                                                                         \
        ROW_LOOP(2, TILE_PAIR512, DOT512);                                                     \
        if (b < nb && block_elems(TYPE) == QK) /* an odd count of 32-element blocks */      \
            TILE_BLOCK256(DOT256, b, (const float *)0, (const float *)0, acc2, acce2, cor);    \
        for (int r = 0; r < MR; r++)                                                           \
            out[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r], acce[r])) +                    \
                     hsum256(_mm256_add_ps(acc2[r], acce2[r])) + cor[r];                       \
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

ALWAYS_INLINE void tile_madd(const int TYPE, const int MR, const uint8_t *wrow, int64_t nb,
                             const int8_t **xq, const int8_t **xe, const float **xd,
                             const float **xed, const float **xs, float *out) {
    __m256 acc[4], acce[4];
    float cor[4];
    for (int r = 0; r < MR; r++) {
        acc[r] = acce[r] = _mm256_setzero_ps();
        cor[r] = 0.0f;
    }
    int64_t b = 0;
    ROW_LOOP(1, TILE_BLOCK256, dot256_madd);
    for (int r = 0; r < MR; r++) out[r] = hsum256(_mm256_add_ps(acc[r], acce[r])) + cor[r];
}

#endif /* AVX512 / AVX2 */

/* ---- many activation rows: tiles of 16 weight columns, int16 products --------------------- */

/* From TILE_MIN_ROWS activation rows on, 16 columns of a weight at a time are decoded once per
   TILE_KB blocks into tiles that interleave them, and each row multiplies a tile with vpmaddwd
   against its two digits joined into one int16, X = 254 q + e (|X| <= 32385; x ~ ed * X, as
   dx = 254 ed up to ed's rounding), so one integer product carries both digits:
       tile.w[g][h] int32 lane c = the int16 pair (w_c'[2g], w_c'[2g + 1]), c' = 8 h + c
       madd(tile.w[g][h], broadcast(X[2g], X[2g + 1])) lane c = w_c'[2g] X[2g] + w_c'[2g + 1] X[2g + 1]
   summed over the 16 pairs g: lane c = dot(w_c', X) (|w| <= 128: |dot| < 2^31). The block then
   adds (d_c' * ed) * dot + m_c' * sx to column c' (Q6_K: d for pairs 0..7, d_hi for 8..15; m is
   the offset / min coefficient cw). Columns are lanes: no row sums across lanes, and each
   weight load serves 4 rows, each activation broadcast 16 columns. */
#define TILE_MIN_ROWS 4
#define TILE_COLS 16
#define TILE_KB 16              /* blocks per tile pass: 19 KiB of tiles */
#define TILE_RC 64              /* activation rows per pass (their accumulators stay in L1) */

typedef struct {
    __m256i w[16][2];
    float d[16], d_hi[16], m[16];
} tile_block;

/* 8x8 int32 transpose: r[c] lane p -> r[p] lane c */
static inline void transpose8x8(__m256i *r) {
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {     /* t[i] = [r_i0 r_j0 r_i1 r_j1 | r_i4 r_j4 r_i5 r_j5] */
        t[i] = _mm256_unpacklo_ps(_mm256_castsi256_ps(r[i]), _mm256_castsi256_ps(r[i + 1]));
        t[i + 1] = _mm256_unpackhi_ps(_mm256_castsi256_ps(r[i]), _mm256_castsi256_ps(r[i + 1]));
    }
    for (int i = 0; i < 8; i += 4) {     /* u[i + p] = lane p (low half), p + 4 (high half) */
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int p = 0; p < 4; p++) {
        r[p] = _mm256_castps_si256(_mm256_permute2f128_ps(u[p], u[p + 4], 0x20));
        r[p + 4] = _mm256_castps_si256(_mm256_permute2f128_ps(u[p], u[p + 4], 0x31));
    }
}

/* blocks [b0, b0 + nblk) of ncols (<= 16) weight rows rb bytes apart as tiles (missing columns
   zero); K-quants: b0 and nblk are multiples of 8 */
ALWAYS_INLINE void decode_tiles(const int TYPE, const uint8_t *w, int64_t rb, int ncols,
                                int64_t b0, int nblk, tile_block *t) {
    float kdw[TILE_COLS][16], kcw[TILE_COLS][8];
    for (int i = 0; i < nblk; i++) {
        const int64_t b = b0 + i;
        __m256i pairs[4][8];            /* [pairs 0..7 / 8..15][columns 0..7 / 8..15][column] */
        for (int c = 0; c < TILE_COLS; c++) {
            const uint8_t *wrow = w + c * rb;
            __m256i v = _mm256_setzero_si256(), ws = v;
            __m256 wsc = _mm256_setzero_ps();
            float dw = 0.0f, cw = 0.0f, dh = 0.0f;
            if (c < ncols) {
                if (block_elems(TYPE) == QK_K && (b & 7) == 0)
                    kq_scales(TYPE, wrow + block_offset(TYPE, b), kdw[c], kcw[c]);
                v = decode256(TYPE, wrow, b, kdw[c], kcw[c], &ws, &dw, &cw, &wsc);
                if (TYPE == T_Q6_K) {
                    dw = kdw[c][2 * (b & 7)];
                    dh = kdw[c][2 * (b & 7) + 1];
                }
            }
            const __m256i q = is_signed(TYPE) ? ws : v;
            const __m128i q0 = _mm256_castsi256_si128(q), q1 = _mm256_extracti128_si256(q, 1);
            pairs[c >> 3][c & 7] = is_signed(TYPE) ? _mm256_cvtepi8_epi16(q0)
                                                   : _mm256_cvtepu8_epi16(q0);
            pairs[2 + (c >> 3)][c & 7] = is_signed(TYPE) ? _mm256_cvtepi8_epi16(q1)
                                                         : _mm256_cvtepu8_epi16(q1);
            t[i].d[c] = dw;
            t[i].d_hi[c] = TYPE == T_Q6_K ? dh : dw;
            t[i].m[c] = has_sum_term(TYPE) ? cw : 0.0f;
        }
        for (int j = 0; j < 4; j++) {   /* j: pairs 8 (j >> 1) .., columns 8 (j & 1) .. */
            transpose8x8(pairs[j]);
            for (int p = 0; p < 8; p++) t[i].w[8 * (j >> 1) + p][j & 1] = pairs[j][p];
        }
    }
}

/* MR activation rows against nblk tiles: x[r] the row's X from the tiles' first block on, ed[r]
   and sx[r] its scales and sums from that block on; acc[r] (16 floats, one per column) gains
   the products */
ALWAYS_INLINE void tile_rows(const int TYPE, const int MR, const tile_block *t, int nblk,
                             const int16_t **x, const float **ed, const float **sx,
                             float (*acc)[TILE_COLS]) {
    for (int i = 0; i < nblk; i++) {
        for (int half = 0; half < (TYPE == T_Q6_K ? 2 : 1); half++) {
            const int g0 = TYPE == T_Q6_K ? 8 * half : 0, g1 = TYPE == T_Q6_K ? g0 + 8 : 16;
            __m256i s[4][2];
            for (int r = 0; r < MR; r++) s[r][0] = s[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 1
            for (int g = g0; g < g1; g++) {
                __m256i w0 = _mm256_load_si256(&t[i].w[g][0]);
                __m256i w1 = _mm256_load_si256(&t[i].w[g][1]);
                __asm__("" : "+x"(w0), "+x"(w1));       /* loaded once, not once per row */
                for (int r = 0; r < MR; r++) {
                    int32_t pair;
                    memcpy(&pair, x[r] + i * QK + 2 * g, 4);
                    const __m256i xb = _mm256_set1_epi32(pair);
                    s[r][0] = _mm256_add_epi32(_mm256_madd_epi16(w0, xb), s[r][0]);
                    s[r][1] = _mm256_add_epi32(_mm256_madd_epi16(w1, xb), s[r][1]);
                    __asm__("" : "+x"(s[r][0]), "+x"(s[r][1]));   /* summed in this order */
                }
            }
            const float *dp = half ? t[i].d_hi : t[i].d;
            const __m256 d0 = _mm256_load_ps(dp), d1 = _mm256_load_ps(dp + 8);
            for (int r = 0; r < MR; r++) {
                const __m256 e = _mm256_broadcast_ss(ed[r] + i);
                __m256 f0 = _mm256_loadu_ps(acc[r]), f1 = _mm256_loadu_ps(acc[r] + 8);
                f0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r][0]), _mm256_mul_ps(d0, e), f0);
                f1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r][1]), _mm256_mul_ps(d1, e), f1);
                if (has_sum_term(TYPE)) {
                    const __m256 sb = _mm256_broadcast_ss(sx[r] + i);
                    f0 = _mm256_fmadd_ps(_mm256_load_ps(t[i].m), sb, f0);
                    f1 = _mm256_fmadd_ps(_mm256_load_ps(t[i].m + 8), sb, f1);
                }
                _mm256_storeu_ps(acc[r], f0);
                _mm256_storeu_ps(acc[r] + 8, f1);
            }
        }
    }
}

/* the columns [j0, j0 + 16) (or fewer, to j1) of one weight, all rows, tiled; x16 [m, k],
   ed and sx [m, k / 32]; y, bias and residual as columns_madd */
static void columns_tiled(int type, const uint8_t *w, int64_t j0, int64_t j1, int64_t k,
                          const int16_t *x16, const float *xed, const float *xs, int64_t m,
                          const float *bias, const float *residual, float *y, int64_t ldy) {
    const int64_t nb = k / QK, rb = k / block_elems(type) * block_bytes(type);
    const int ncols = (int)(j1 - j0);
    tile_block t[TILE_KB] __attribute__((aligned(32)));
    float acc[TILE_RC][TILE_COLS];
    for (int64_t r0 = 0; r0 < m; r0 += TILE_RC) {
        const int rc = m - r0 < TILE_RC ? (int)(m - r0) : TILE_RC;
        memset(acc, 0, sizeof(float) * TILE_COLS * (size_t)rc);
        for (int64_t b0 = 0; b0 < nb; b0 += TILE_KB) {
            const int nblk = nb - b0 < TILE_KB ? (int)(nb - b0) : TILE_KB;
            TYPE_SWITCH(decode_tiles, type, w + j0 * rb, rb, ncols, b0, nblk, t);
            for (int rr = 0; rr < rc; rr += 4) {
                const int mr = rc - rr < 4 ? rc - rr : 4;
                const int16_t *xp[4];
                const float *edp[4], *sxp[4];
                for (int r = 0; r < mr; r++) {
                    const int64_t row = r0 + rr + r;
                    xp[r] = x16 + row * k + b0 * QK;
                    edp[r] = xed + row * nb + b0;
                    sxp[r] = xs + row * nb + b0;
                }
                DISPATCH(tile_rows, type, mr, t, nblk, xp, edp, sxp, acc + rr);
            }
        }
        for (int r = 0; r < rc; r++)
            for (int c = 0; c < ncols; c++) {
                float v = acc[r][c];
                if (bias) v += bias[j0 + c];
                if (residual) v += residual[(r0 + r) * ldy + j0 + c];
                y[(r0 + r) * ldy + j0 + c] = v;
            }
    }
}

#else /* generic */

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* 32-element block b of a weight row as int8 w (unsigned nibbles or q5 for the offset / min
   types, signed for Q8_0 and Q6_K), its scale (*dw for all 32, or for Q6_K *dw for the first
   16 and *dw1 for the last 16) and activation-sum coefficient *cw (see decode256) */
ALWAYS_INLINE void decode32(const int TYPE, const uint8_t *wrow, int64_t b, int8_t *w,
                            float *dw, float *dw1, float *cw) {
    const uint8_t *blk = wrow + block_offset(TYPE, b);
    if (TYPE == T_Q8_0) {
        *dw = h2f(rd16(blk));
        memcpy(w, blk + 2, QK);
    } else if (TYPE == T_Q4_K) {
        const int j = (int)(b & 7);
        int sc, mn;
        k4_scale_min(blk + 4, j, &sc, &mn);
        *dw = h2f(rd16(blk)) * (float)sc;
        *cw = -h2f(rd16(blk + 2)) * (float)mn;
        const uint8_t *qs = blk + 16 + 32 * (j >> 1);
        for (int i = 0; i < QK; i++) w[i] = (int8_t)((qs[i] >> (4 * (j & 1))) & 15);
    } else if (TYPE == T_Q6_K) {
        const int s = (int)(b & 7), h = s >> 2, g = s & 3;
        const uint8_t *ql = blk + 64 * h + 32 * (g & 1), *qh = blk + 128 + 32 * h;
        const float d = h2f(rd16(blk + 208));
        *dw = d * (float)(int8_t)blk[192 + 2 * s];
        *dw1 = d * (float)(int8_t)blk[193 + 2 * s];
        for (int i = 0; i < QK; i++) {
            const int lo = (ql[i] >> (4 * (g >> 1))) & 15, hi = (qh[i] >> (2 * g)) & 3;
            w[i] = (int8_t)((lo | hi << 4) - 32);
        }
    } else { /* Q4_0, Q4_1, Q5_0, Q5_1: [d][m][qh] qs */
        const int has_m = TYPE == T_Q4_1 || TYPE == T_Q5_1;
        const int five = TYPE == T_Q5_0 || TYPE == T_Q5_1;
        const uint8_t *qs = blk + 2 + 2 * has_m + 4 * five;
        const uint32_t qh = five ? rd32(blk + 2 + 2 * has_m) : 0;
        *dw = h2f(rd16(blk));
        *cw = has_m ? h2f(rd16(blk + 2)) : (five ? -16.0f : -8.0f) * *dw;
        for (int i = 0; i < QK / 2; i++) {
            w[i] = (int8_t)((qs[i] & 15) | ((qh >> i) & 1) << 4);
            w[i + QK / 2] = (int8_t)((qs[i] >> 4) | ((qh >> (i + QK / 2)) & 1) << 4);
        }
    }
}

ALWAYS_INLINE void tile_madd(const int TYPE, const int MR, const uint8_t *wrow, int64_t nb,
                             const int8_t **xq, const int8_t **xe, const float **xd,
                             const float **xed, const float **xs, float *out) {
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int64_t b = 0; b < nb; b++) {
        int8_t w[QK];
        float dw = 0.0f, dw1 = 0.0f, cw = 0.0f;
        decode32(TYPE, wrow, b, w, &dw, &dw1, &cw);
        for (int r = 0; r < MR; r++) {
            const int8_t *x = xq[r] + b * QK, *ex = xe[r] + b * QK;
            int32_t sum[2] = {0, 0}, esum[2] = {0, 0};       /* per 16-element half */
            for (int j = 0; j < QK; j++) {
                sum[j >> 4] += (int32_t)w[j] * (int32_t)x[j];
                esum[j >> 4] += (int32_t)w[j] * (int32_t)ex[j];
            }
            if (TYPE == T_Q6_K) {
                acc[r] += dw * ((float)sum[0] * xd[r][b] + (float)esum[0] * xed[r][b]);
                acc[r] += dw1 * ((float)sum[1] * xd[r][b] + (float)esum[1] * xed[r][b]);
            } else {
                acc[r] += (float)(sum[0] + sum[1]) * (dw * xd[r][b]);
                acc[r] += (float)(esum[0] + esum[1]) * (dw * xed[r][b]);
            }
            if (has_sum_term(TYPE)) acc[r] += cw * xs[r][b];
        }
    }
    for (int r = 0; r < MR; r++) out[r] = acc[r];
}

#endif


/* the columns [j0, j1) of one weight, all rows; y, bias and residual start at the weight's
   first column, rows ldy apart */
#define COLUMNS_BODY(TILE)                                                                     \
    for (int64_t j = j0; j < j1; j++) {                                                        \
        const uint8_t *wrow = w + j * rb;                                                      \
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
                if (residual) v += residual[(i0 + r) * ldy + j];                               \
                y[(i0 + r) * ldy + j] = v;                                                     \
            }                                                                                  \
        }                                                                                      \
    }

#define COLUMNS_ARGS                                                                           \
    int type, const uint8_t *w, int64_t j0, int64_t j1, int64_t k, const int8_t *xq,           \
        const float *xd, const float *xs, int64_t m, const float *bias, const float *residual, \
        float *y, int64_t ldy

static void columns_madd(COLUMNS_ARGS) {
    const int64_t nb = k / QK, rb = k / block_elems(type) * block_bytes(type);
    COLUMNS_BODY(tile_madd)
}

#if defined(VTOK_ISA_AVX512)
#pragma GCC push_options
#pragma GCC target("avx512vnni")
static void columns_vnni(COLUMNS_ARGS) {
    const int64_t nb = k / QK, rb = k / block_elems(type) * block_bytes(type);
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

/* whether the weights (types[p], ns[p] rows of k) can be multiplied */
static int parts_ok(int nparts, const int *types, const int64_t *ns, int64_t k) {
    if (nparts < 1 || nparts > MAX_PARTS || k < 0) return 0;
    for (int p = 0; p < nparts; p++) {
        const int elems = block_elems(types[p]);
        if (elems == 0 || k % elems || ns[p] < 0) return 0;
    }
    return 1;
}

/* y [m, sum ns] = x @ [W_0; W_1; ...]^T on already quantized activations (vq_quantize_rows):
   xq holds q [m, k] then e [m, k], xd holds d [m, k / 32] then ed [m, k / 32]; x16 [m, k] their
   joined digits for the tiled kernel, or NULL. Every weight's columns in chunks of 8 (whole
   cache lines of y per thread, mostly; 16 tiled), all in one parallel loop */
static void gemm_parts_q(int nparts, const int *types, const uint8_t *const *ws,
                         const int64_t *ns, int64_t k, const int8_t *xq, const float *xd,
                         const float *xs, const int16_t *x16, int64_t m, const float *bias,
                         const float *residual, float *y) {
    int64_t first[MAX_PARTS + 1], col[MAX_PARTS + 1];    /* first chunk, first column */
#if defined(VTOK_ISA_AVX512) || defined(VTOK_ISA_AVX2)
    const int64_t chunk = x16 ? TILE_COLS : 8;
#else
    const int64_t chunk = 8;
#endif
    first[0] = col[0] = 0;
    for (int p = 0; p < nparts; p++) {
        first[p + 1] = first[p] + (ns[p] + chunk - 1) / chunk;
        col[p + 1] = col[p] + ns[p];
    }
    const int64_t ldy = col[nparts];
    const int vnni = vq_uses_vnni();
    (void)x16;                                      /* generic: never built */
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < first[nparts]; c++) {
        int p = 0;
        while (c >= first[p + 1]) p++;
        const int64_t j0 = (c - first[p]) * chunk, j1 = j0 + chunk < ns[p] ? j0 + chunk : ns[p];
        const float *bp = bias ? bias + col[p] : NULL;
        const float *rp = residual ? residual + col[p] : NULL;
#if defined(VTOK_ISA_AVX512) || defined(VTOK_ISA_AVX2)
        if (x16) {
            columns_tiled(types[p], ws[p], j0, j1, k, x16, xd + m * (k / QK), xs, m, bp, rp,
                          y + col[p], ldy);
            continue;
        }
#endif
#if defined(VTOK_ISA_AVX512)
        if (vnni) {
            columns_vnni(types[p], ws[p], j0, j1, k, xq, xd, xs, m, bp, rp, y + col[p], ldy);
            continue;
        }
#endif
        (void)vnni;
        columns_madd(types[p], ws[p], j0, j1, k, xq, xd, xs, m, bp, rp, y + col[p], ldy);
    }
}

/* y [m, N] = x [m, k] @ [W_0; W_1; ...]^T (+ bias [N]) (+ residual [m, N]), N = sum ns: weight
   p is ns[p] rows of k in types[p]'s blocks, its outputs are y's columns after those of the
   weights before it. Returns 0, or -1 on a bad type, more than MAX_PARTS weights, k not a
   multiple of a weight's block or no memory */
int vq_gemm_parts(int nparts, const int *types, const uint8_t *const *ws, const int64_t *ns,
                  int64_t k, const float *x, int64_t m, const float *bias,
                  const float *residual, float *y) {
    if (!parts_ok(nparts, types, ns, k) || m < 0) return -1;
    int64_t n = 0;
    for (int p = 0; p < nparts; p++) n += ns[p];
    if (m == 0 || n == 0) return 0;
    const int64_t nb = k / QK;
    int8_t *xq = (int8_t *)malloc((size_t)(2 * m * k) + 64);
    float *xd = (float *)malloc(sizeof(float) * (size_t)(m * nb) * 3 + 64);
    if (!xq || !xd) {
        free(xq);
        free(xd);
        return -1;
    }
    float *xs = xd + 2 * m * nb;
    vq_quantize_rows(x, m, k, xq, xq + m * k, xd, xd + m * nb, xs);
    int16_t *x16 = NULL;
#if defined(VTOK_ISA_AVX512) || defined(VTOK_ISA_AVX2)
    if (m >= TILE_MIN_ROWS && (x16 = (int16_t *)malloc(sizeof(int16_t) * (size_t)(m * k)))) {
        for (int64_t i = 0; i < m * k; i++)
            x16[i] = (int16_t)(254 * xq[i] + xq[m * k + i]);
    }
#endif
    gemm_parts_q(nparts, types, ws, ns, k, xq, xd, xs, x16, m, bias, residual, y);
    free(x16);
    free(xq);
    free(xd);
    return 0;
}

/* y [m, n] = x [m, k] @ W^T (+ bias [n]) (+ residual [m, n]) for one weight (vq_gemm_parts) */
int vq_gemm(int type, const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t m,
            const float *bias, const float *residual, float *y) {
    return vq_gemm_parts(1, &type, &w, &n, k, x, m, bias, residual, y);
}
