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

Built per ISA like decode_kernels.c (vllm/kernels/cpu_kernels.py): VTOK_ISA_AVX512 (512-bit, two
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
#define TILE_MIN_ROWS 4         /* activation rows from which x86 builds tile (columns_tiled) */
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

#define VQ_PACKED 0x100         /* type flag: the weight is in vq_repack's layout */

/* 1 when type is repacked and multiplied by these kernels (Q5_0 and the K-quants by the avx2
   build only: the avx512 one has no 512-bit kernel for the K-quants' records, and Q5_0's
   records, Q8_0's, stream 1.55x its blocks' bytes, not timed against them on an AVX-512 CPU) */
static inline int packable(int type) {
#if !defined(VTOK_ISA_AVX512)
    if (type == T_Q5_0 || type == T_Q4_K || type == T_Q6_K) return 1;
#endif
    return type == T_Q4_0 || type == T_Q4_1 || type == T_Q8_0;
}

/* the type whose records a repacked `type` is in: Q5_0's values d * (q5 - 16) are Q8_0's
   with q = q5 - 16, so its records are Q8_0's (and multiplied as Q8_0) */
static inline int packed_kind(int type) { return type == T_Q5_0 ? T_Q8_0 : type; }

/* 1 when a repacked `type`'s records hold column quads (the avx2 build's Q4_0, Q4_1, Q4_K and
   Q6_K: see "column quads"), 0 when column pairs (Q8_0 and Q5_0; the avx512 build's Q4_0 and
   Q4_1) */
static inline int quad_records(int type) {
#if defined(VTOK_ISA_AVX512)
    (void)type;
    return 0;
#else
    return type == T_Q4_0 || type == T_Q4_1 || type == T_Q4_K || type == T_Q6_K;
#endif
}

/* bytes of one repacked record (16 columns x one 32-element block, see "repacked at load") */
static inline int64_t packed_record(int type) {
    type = packed_kind(type);
    return type == T_Q6_K ? 448 : type == T_Q4_K ? 384 : 16 * (int64_t)block_bytes(type);
}

/* where a record's values start (after its scales, and Q4_1's or Q4_K's mins) */
static inline int packed_quants(int type) {
    type = packed_kind(type);
    return type == T_Q4_K ? 128 : type == T_Q4_1 || type == T_Q6_K ? 64 : 32;
}

/* 1 when a record holds one byte per value (int8: Q8_0, Q5_0), 0 when nibbles (Q4_0, Q4_1,
   Q4_K) or 6-bit values (Q6_K) */
static inline int packed_bytes_per_value(int type) { return packed_kind(type) == T_Q8_0; }

#define PACKED_TILE_ROWS 8      /* from this many rows on, records are decoded to tiles once */

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

/* dd * sum + de * esum, each product rounded: the volatiles keep GCC from contracting one of
   them into an fma (-mfma builds would, the generic one not), so every build and numpy agree */
static inline float block_sum(float dd, int sum, float de, int esum) {
    volatile float a = dd * (float)sum, b = de * (float)esum;
    return a + b;
}

/* one 32-element block xb -> its digits qb, eb, scales *d, *ed and sum *s (see the top of the
   file); xw, when not NULL, gets X = 254 q + e as int16 */
static inline void quantize_block(const float *xb, int8_t *qb, int8_t *eb, int16_t *xw,
                                  float *d, float *ed, float *s) {
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
    for (int i = 0; i < QK; i++) {
        float v = nearbyintf(xb[i] * id);
        v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);
        float ev = nearbyintf(fmaf(-dd, v, xb[i]) * ide);
        ev = ev > 127.0f ? 127.0f : (ev < -127.0f ? -127.0f : ev);
        qb[i] = (int8_t)v;
        eb[i] = (int8_t)ev;
        if (xw) xw[i] = (int16_t)(254 * (int)v + (int)ev);
        sum += (int)v;
        esum += (int)ev;
    }
    *d = dd;
    *ed = de;
    *s = block_sum(dd, sum, de, esum);
}

#if defined(VTOK_ISA_AVX512) || defined(VTOK_ISA_AVX2)
/* quantize_block 8 lanes at a time, bit for bit: the same products, rint (round half to even)
   and single-rounding fma */
static inline void quantize_block8(const float *xb, int8_t *qb, int8_t *eb, int16_t *xw,
                                   float *d, float *ed, float *s) {
    const __m256 sign = _mm256_set1_ps(-0.0f), lim = _mm256_set1_ps(127.0f);
    const __m256 nlim = _mm256_set1_ps(-127.0f);
    __m256 v[4], a = _mm256_setzero_ps();
    for (int j = 0; j < 4; j++) {
        v[j] = _mm256_loadu_ps(xb + 8 * j);
        a = _mm256_max_ps(a, _mm256_andnot_ps(sign, v[j]));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float dd = _mm_cvtss_f32(h) / 127.0f;
    const float de = dd / 254.0f;
    const __m256 id = _mm256_set1_ps(dd != 0.0f ? 1.0f / dd : 0.0f);
    const __m256 ide = _mm256_set1_ps(de != 0.0f ? 1.0f / de : 0.0f);
    const __m256 ndd = _mm256_set1_ps(-dd);
    const int rnd = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    __m256i qi[4], ei[4], sq = _mm256_setzero_si256(), se = sq;
    for (int j = 0; j < 4; j++) {
        __m256 q = _mm256_round_ps(_mm256_mul_ps(v[j], id), rnd);
        q = _mm256_min_ps(_mm256_max_ps(q, nlim), lim);
        __m256 e = _mm256_round_ps(_mm256_mul_ps(_mm256_fmadd_ps(ndd, q, v[j]), ide), rnd);
        e = _mm256_min_ps(_mm256_max_ps(e, nlim), lim);
        qi[j] = _mm256_cvtps_epi32(q);
        ei[j] = _mm256_cvtps_epi32(e);
        sq = _mm256_add_epi32(sq, qi[j]);
        se = _mm256_add_epi32(se, ei[j]);
    }
    /* int32 x 4 -> int8 x 32: the in-lane packs leave 4-byte groups in the order
       0 2 4 6 1 3 5 7 (group i = elements 4i..4i+3); the permute puts them back */
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    __m256i q8 = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]),
                                    _mm256_packs_epi32(qi[2], qi[3]));
    __m256i e8 = _mm256_packs_epi16(_mm256_packs_epi32(ei[0], ei[1]),
                                    _mm256_packs_epi32(ei[2], ei[3]));
    _mm256_storeu_si256((__m256i *)qb, _mm256_permutevar8x32_epi32(q8, order));
    _mm256_storeu_si256((__m256i *)eb, _mm256_permutevar8x32_epi32(e8, order));
    if (xw) {   /* X = 254 q + e; the in-lane pack of 16 int32 swaps the middle 8 bytes' halves */
        const __m256i c254 = _mm256_set1_epi32(254);
        for (int j = 0; j < 4; j += 2) {
            __m256i lo = _mm256_add_epi32(_mm256_mullo_epi32(qi[j], c254), ei[j]);
            __m256i hi = _mm256_add_epi32(_mm256_mullo_epi32(qi[j + 1], c254), ei[j + 1]);
            _mm256_storeu_si256((__m256i *)(xw + 8 * j),
                                _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8));
        }
    }
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(sq), _mm256_extracti128_si256(sq, 1));
    __m128i te = _mm_add_epi32(_mm256_castsi256_si128(se), _mm256_extracti128_si256(se, 1));
    t = _mm_hadd_epi32(_mm_hadd_epi32(t, te), _mm_setzero_si128());   /* [sum, esum, 0, 0] */
    *d = dd;
    *ed = de;
    *s = block_sum(dd, _mm_cvtsi128_si32(t), de, _mm_extract_epi32(t, 1));
}
#define QUANTIZE_BLOCK quantize_block8
#else
#define QUANTIZE_BLOCK quantize_block
#endif

/* x [m, k] -> q, e int8 [m, k], d, ed, s float [m, k / 32] (see the top of the file), and
   x16 [m, k] = 254 q + e when x16 is not NULL */
static void quantize_rows(const float *x, int64_t m, int64_t k, int8_t *q, int8_t *e,
                          int16_t *x16, float *d, float *ed, float *s) {
    const int64_t nb = k / QK;
#pragma omp parallel for schedule(static) if (m * k >= 65536)
    for (int64_t r = 0; r < m; r++)
        for (int64_t b = 0; b < nb; b++) {
            const int64_t i = r * k + b * QK, j = r * nb + b;
            QUANTIZE_BLOCK(x + i, q + i, e + i, x16 ? x16 + i : NULL, d + j, ed + j, s + j);
        }
}

/* x [m, k] -> q, e int8 [m, k], d, ed, s float [m, k / 32] (see the top of the file). */
void vq_quantize_rows(const float *x, int64_t m, int64_t k, int8_t *q, int8_t *e, float *d,
                      float *ed, float *s) {
    quantize_rows(x, m, k, q, e, NULL, d, ed, s);
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

/* s[r][h] += sum over np (>= 1) pairs g of madd(w[g][h], broadcast(x_r[2g], x_r[2g + 1])) for
   4 rows. In assembly: GCC, given the intrinsics, reloads w for each row and copies or spills
   the eight accumulators every step (half the speed); here a step is 2 loads, 4 broadcasts,
   8 madd and 8 adds with everything in registers */
static inline void tile_pairs4(const __m256i *w, int np, const int16_t *x0, const int16_t *x1,
                               const int16_t *x2, const int16_t *x3, __m256i (*s)[2]) {
    __m256i s00 = s[0][0], s01 = s[0][1], s10 = s[1][0], s11 = s[1][1];
    __m256i s20 = s[2][0], s21 = s[2][1], s30 = s[3][0], s31 = s[3][1];
    __m256i w0, w1, xb, p;
    int64_t off = 0;                    /* bytes into each row's X: 4 per pair */
    const int64_t end = 4 * (int64_t)np;
    __asm__("1:\n\t"
            "vmovdqa (%[w]), %[w0]\n\t"
            "vmovdqa 32(%[w]), %[w1]\n\t"
            "vpbroadcastd (%[x0],%[off]), %[xb]\n\t"
            "vpmaddwd %[xb], %[w0], %[p]\n\t"
            "vpaddd %[p], %[s00], %[s00]\n\t"
            "vpmaddwd %[xb], %[w1], %[p]\n\t"
            "vpaddd %[p], %[s01], %[s01]\n\t"
            "vpbroadcastd (%[x1],%[off]), %[xb]\n\t"
            "vpmaddwd %[xb], %[w0], %[p]\n\t"
            "vpaddd %[p], %[s10], %[s10]\n\t"
            "vpmaddwd %[xb], %[w1], %[p]\n\t"
            "vpaddd %[p], %[s11], %[s11]\n\t"
            "vpbroadcastd (%[x2],%[off]), %[xb]\n\t"
            "vpmaddwd %[xb], %[w0], %[p]\n\t"
            "vpaddd %[p], %[s20], %[s20]\n\t"
            "vpmaddwd %[xb], %[w1], %[p]\n\t"
            "vpaddd %[p], %[s21], %[s21]\n\t"
            "vpbroadcastd (%[x3],%[off]), %[xb]\n\t"
            "vpmaddwd %[xb], %[w0], %[p]\n\t"
            "vpaddd %[p], %[s30], %[s30]\n\t"
            "vpmaddwd %[xb], %[w1], %[p]\n\t"
            "vpaddd %[p], %[s31], %[s31]\n\t"
            "add $64, %[w]\n\t"
            "add $4, %[off]\n\t"
            "cmp %[end], %[off]\n\t"
            "jne 1b"
            : [s00] "+x"(s00), [s01] "+x"(s01), [s10] "+x"(s10), [s11] "+x"(s11),
              [s20] "+x"(s20), [s21] "+x"(s21), [s30] "+x"(s30), [s31] "+x"(s31),
              [w0] "=&x"(w0), [w1] "=&x"(w1), [xb] "=&x"(xb), [p] "=&x"(p), [w] "+r"(w),
              [off] "+r"(off)
            : [x0] "r"(x0), [x1] "r"(x1), [x2] "r"(x2), [x3] "r"(x3), [end] "r"(end)
            : "memory", "cc");
    s[0][0] = s00, s[0][1] = s01, s[1][0] = s10, s[1][1] = s11;
    s[2][0] = s20, s[2][1] = s21, s[3][0] = s30, s[3][1] = s31;
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
            if (MR == 4) {
                tile_pairs4(t[i].w[g0], g1 - g0, x[0] + i * QK + 2 * g0,
                            x[1] + i * QK + 2 * g0, x[2] + i * QK + 2 * g0,
                            x[3] + i * QK + 2 * g0, s);
            } else {
                for (int g = g0; g < g1; g++) {
                    const __m256i w0 = _mm256_load_si256(&t[i].w[g][0]);
                    const __m256i w1 = _mm256_load_si256(&t[i].w[g][1]);
                    for (int r = 0; r < MR; r++) {
                        int32_t pair;
                        memcpy(&pair, x[r] + i * QK + 2 * g, 4);
                        const __m256i xb = _mm256_set1_epi32(pair);
                        s[r][0] = _mm256_add_epi32(s[r][0], _mm256_madd_epi16(w0, xb));
                        s[r][1] = _mm256_add_epi32(s[r][1], _mm256_madd_epi16(w1, xb));
                    }
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


#if defined(VTOK_ISA_AVX512)
/* vpdpwssd has a latency of several cycles and issues one a cycle: a row's products go to
   NCHAIN(MR) accumulators (pair g to chain g % NCHAIN, which divides 8) so that 4+ chains are in
   flight, then are summed (integers: the same sum in any order). */
#define NCHAIN(MR) ((MR) == 1 ? 4 : 2)
static inline __m512i sum_chains(const __m512i *c, int n) {
    __m512i s = c[0];
    for (int h = 1; h < n; h++) s = _mm512_add_epi32(s, c[h]);
    return s;
}

/* s[r] (r < MR) = the int32 sums over pairs g in [g0, g1) of ACC(WEIGHT(g), row r's pair
   x[r][xoff + 2g], x[r][xoff + 2g + 1] broadcast), each row over NCHAIN(MR) chains; WEIGHT(g)
   is pair g of 16 columns as one int16 vector (a tile's, or a record's decoded) */
#define ROW_PAIRS512(ACC, MR, g0, g1, WEIGHT, x, xoff, s)                                     \
    do {                                                                                       \
        __m512i c_[4][NCHAIN(MR)];                                                             \
        for (int r = 0; r < (MR); r++)                                                         \
            for (int h = 0; h < NCHAIN(MR); h++) c_[r][h] = _mm512_setzero_si512();            \
        for (int gc = (g0); gc < (g1); gc += NCHAIN(MR)) {                                     \
            for (int h = 0; h < NCHAIN(MR); h++) {                                             \
                const __m512i w = WEIGHT(gc + h);                                              \
                _Pragma("GCC unroll 4") for (int r = 0; r < (MR); r++) {                       \
                    int32_t pair;                                                              \
                    memcpy(&pair, (x)[r] + (xoff) + 2 * (gc + h), 4);                          \
                    c_[r][h] = ACC(c_[r][h], w, _mm512_set1_epi32(pair));                      \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        for (int r = 0; r < (MR); r++) (s)[r] = sum_chains(c_[r], NCHAIN(MR));                 \
    } while (0)
#define TILE_W512(g) _mm512_loadu_si512((const void *)&t[i].w[g][0])

/* tile_rows at 512 bits: a tile's pair g (tile_block.w[g][0] and w[g][1], adjacent) is one
   int16 vector whose int32 lane c is column c, so a row and pair is one vpdpwssd (VNNI) or
   vpmaddwd + vpaddd; the float math is tile_rows' lane for lane (bit-identical results) */
#define DEFINE_TILE_ROWS512(NAME, ACC)                                                         \
    ALWAYS_INLINE void NAME(const int TYPE, const int MR, const tile_block *t, int nblk,       \
                            const int16_t **x, const float **ed, const float **sx,             \
                            float (*acc)[TILE_COLS]) {                                         \
        for (int i = 0; i < nblk; i++) {                                                       \
            for (int half = 0; half < (TYPE == T_Q6_K ? 2 : 1); half++) {                      \
                const int g0 = TYPE == T_Q6_K ? 8 * half : 0;                                  \
                const int g1 = TYPE == T_Q6_K ? g0 + 8 : 16;                                   \
                __m512i s[4];                                                                  \
                ROW_PAIRS512(ACC, MR, g0, g1, TILE_W512, x, i * QK, s);                        \
                const __m512 d = _mm512_loadu_ps(half ? t[i].d_hi : t[i].d);                   \
                for (int r = 0; r < MR; r++) {                                                 \
                    const __m512 e = _mm512_set1_ps(ed[r][i]);                                 \
                    __m512 f = _mm512_loadu_ps(acc[r]);                                        \
                    f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r]), _mm512_mul_ps(d, e), f);     \
                    if (has_sum_term(TYPE))                                                    \
                        f = _mm512_fmadd_ps(_mm512_loadu_ps(t[i].m), _mm512_set1_ps(sx[r][i]), \
                                            f);                                                \
                    _mm512_storeu_ps(acc[r], f);                                               \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
    }
#endif

/* ---- Q4_0 / Q4_1 / Q8_0 (and Q5_0, Q4_K, Q6_K on avx2) repacked at load: 16 columns ------- */

/* A weight repacked by vq_repack is records of 16 columns x one 32-element block, a column
   group's blocks in order, then the next group (columns past n are zero):
       Q4_1  fp16 d[16], fp16 m[16], uint8 q[16][16]      320 bytes (16 x 20)
       Q4_0  fp16 d[16], uint8 q[16][16]                  288 bytes (16 x 18)
       Q8_0  fp16 d[16], int8 q[16][2][16]                544 bytes (16 x 34)
       Q4_K  float d[16], float m[16], uint8 q[16][16]      384 bytes (16 x 24)
       Q6_K  fp16 d[16], int8 sc[2][16], uint8 q[4][3][32]  448 bytes (16 x 28)
       Q5_0  as Q8_0, q = q5 - 16                          544 bytes (16 x 34)
   A K-quant record is one 32-element sub-block of its super-blocks, losslessly. Q4_K: the
   nibbles with the scales a tile_block holds (kq_scales, exact in float32), d * sc_j and the
   min coefficient -dmin * m_j. Q6_K: the super-block's d and the sub-block's two 16-element
   scales sc[0] (elements 0..15) and sc[1] (16..31), read as d * sc (exact in float32, as
   kq_scales); its values q6 are column quads (below): 0.875 bytes a weight, the blocks 0.82.
   Column pairs (Q8_0; Q4_0 and Q4_1 in the avx512 build): the values of pair g (elements 2g,
   2g + 1) are, for columns 0..7, the int16 lanes of one madd against the broadcast pair X[2g],
   X[2g + 1] (as tile_block.w[g][0]):
       [c0 e2g, c0 e2g+1, c1 e2g, c1 e2g+1, ..., c7 e2g+1]
   and likewise for columns 8..15; Q4 keeps the two as the low and high nibbles of q[g]'s 16
   bytes, Q8_0 as q[g][0] and q[g][1]. A record decodes with 3 or 2 vector ops per pair and its
   per-column scales with a few vector ops: the block math is the tiles' (see above), for one
   row as for many, with no per-column scalar work.
   Column quads (avx2: Q4_0, Q4_1, Q4_K, Q6_K): the values unsigned (Q6_K's offset 32 comes
   off the integer sums). Quad i (elements 4i .. 4i + 3) of columns 8h .. 8h + 7 is 32 values,
   value (c, e) at byte 4c + e (c < 8, e < 4). The 4-bit types hold quad i in q[i]'s 32 bytes,
   columns 0..7 in the low nibbles and 8..15 in the high ones. Q6_K holds quads 2p and 2p + 1
   of both column halves, four sets j = 2 (i % 2) + h, in the three 32-byte rows q[p]: set
   j < 3 in the low 6 bits of row j, set 3's bits 0-1, 2-3 and 4-5 in the top two bits of rows
   0, 1 and 2. A quad of 8 columns is then one vector of unsigned bytes (one or two ops; 8 for
   Q6_K's set 3), multiplied as bytes at one row (quad_row) and decoded to int16 pairs from two
   rows on (quad_pairs). */

/* Below PACKED_TILE_ROWS rows a thread's columns are one stream of records (a column group's
   records back to back, its groups in order), and the product waits on it: the hardware
   prefetchers stop at each 4 KiB page, so the record packed_prefetch(type) bytes ahead of the
   one being multiplied is prefetched too (past the weight's end too: a prefetch never faults).
   The distance is each type's own, the fastest of 4, 8 and 16 KiB on AVX2 (Q4_0 and Q4_1 lose
   at 8 KiB what Q6_K, Q8_0 and Q4_K gain; Q6_K gains again at 16 KiB) */
static inline int64_t packed_prefetch(int type) {
    type = packed_kind(type);
    return type == T_Q6_K ? 16384 : type == T_Q8_0 || type == T_Q4_K ? 8192 : 4096;
}

ALWAYS_INLINE void prefetch_ahead(const int TYPE, const uint8_t *rec) {
    for (int64_t l = 0; l < packed_record(TYPE); l += 64)
        _mm_prefetch((const char *)rec + packed_prefetch(TYPE) + l, _MM_HINT_T0);
}

/* pair g's values of columns 0..7 (*w0) and 8..15 (*w1) as int16 (pair records) */
ALWAYS_INLINE void packed_pair(const int TYPE, const uint8_t *rec, int g, __m256i *w0,
                               __m256i *w1) {
    if (packed_bytes_per_value(TYPE)) {
        const uint8_t *q = rec + packed_quants(TYPE) + 32 * g;
        *w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)q));
        *w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q + 16)));
    } else {
        const uint8_t *q = rec + packed_quants(TYPE) + 16 * g;
        const __m128i v = _mm_loadu_si128((const __m128i *)q), m4 = _mm_set1_epi8(0x0f);
        *w0 = _mm256_cvtepu8_epi16(_mm_and_si128(v, m4));
        *w1 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(v, 4), m4));
    }
}

#if !defined(VTOK_ISA_AVX512)
/* quad i's values of columns 8h .. 8h + 7 as unsigned bytes (byte 4c + e: column 8h + c's
   element 4i + e): the 4-bit types' q[i] nibbles, Q6_K's one of q[i / 2]'s rows masked, or
   the fourth one's three 2-bit pieces */
ALWAYS_INLINE __m256i quad_values(const int TYPE, const uint8_t *rec, const int i, const int h) {
    if (TYPE != T_Q6_K) {   /* the high nibbles shifted down (16-bit: the mask drops the spill) */
        const __m256i v = _mm256_loadu_si256((const __m256i *)(rec + packed_quants(TYPE) + 32 * i));
        return _mm256_and_si256(h ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(0x0f));
    }
    const uint8_t *q = rec + packed_quants(T_Q6_K) + 96 * (i >> 1);
    const int j = 2 * (i & 1) + h;
    const __m256i m6 = _mm256_set1_epi8(0x3f);
    if (j < 3) return _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(q + 32 * j)), m6);
    /* each row's top two bits alone (the row xor its low 6 bits), shifted down to bits 0-1,
       2-3, 4-5: with nothing else left in a byte, the 16-bit shifts move no bit across bytes */
    __m256i top[3];
    for (int r = 0; r < 3; r++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(q + 32 * r));
        top[r] = _mm256_xor_si256(v, _mm256_and_si256(v, m6));
    }
    return _mm256_or_si256(
        _mm256_or_si256(_mm256_srli_epi16(top[0], 6), _mm256_srli_epi16(top[1], 4)),
        _mm256_srli_epi16(top[2], 2));
}

/* quad g / 2's values as int16 pairs (g even; Q6_K's less 32): w[p][h] = pair g + p of
   columns 8h .. 8h + 7. Within each 128-bit lane (4 columns) the quad's bytes are reordered to
   elements 0, 1 of each column, then 2, 3, so that widening the lane's low (high) 8 bytes gives
   pair g (g + 1) of those 4 columns */
ALWAYS_INLINE void quad_pairs(const int TYPE, const uint8_t *rec, int g, __m256i (*w)[2]) {
    const __m256i off = _mm256_set1_epi16(32), zero = _mm256_setzero_si256();
    const __m256i order = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                           0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    for (int h = 0; h < 2; h++) {
        const __m256i v = _mm256_shuffle_epi8(quad_values(TYPE, rec, g / 2, h), order);
        w[0][h] = _mm256_unpacklo_epi8(v, zero);
        w[1][h] = _mm256_unpackhi_epi8(v, zero);
        if (TYPE == T_Q6_K) {
            w[0][h] = _mm256_sub_epi16(w[0][h], off);
            w[1][h] = _mm256_sub_epi16(w[1][h], off);
        }
    }
}
#endif

/* pairs g and g + 1 (g even): w[p][h] = pair g + p's values of columns 8h .. 8h + 7 as int16
   (Q6_K: q6 - 32) */
ALWAYS_INLINE void packed_pairs(const int TYPE, const uint8_t *rec, int g, __m256i (*w)[2]) {
#if !defined(VTOK_ISA_AVX512)
    if (quad_records(TYPE)) {
        quad_pairs(TYPE, rec, g, w);
        return;
    }
#endif
    packed_pair(TYPE, rec, g, &w[0][0], &w[0][1]);
    packed_pair(TYPE, rec, g + 1, &w[1][0], &w[1][1]);
}

/* a record's scales d and offset / min coefficients mw for columns 0..7 ([0]) and 8..15
   ([1]), as a tile_block holds them: those of the pairs of `half` (Q6_K: pairs 0..7 or 8..15
   have scales of their own; every other type one set for all 16 pairs) */
ALWAYS_INLINE void packed_scales(const int TYPE, const uint8_t *rec, int half, __m256 *d,
                                 __m256 *mw) {
    for (int h = 0; h < 2; h++) {
        if (TYPE == T_Q6_K) {
            const __m128i sc = _mm_loadl_epi64((const __m128i *)(rec + 32 + 16 * half + 8 * h));
            d[h] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)),
                                 _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + 16 * h))));
            mw[h] = _mm256_setzero_ps();
            continue;
        }
        if (TYPE == T_Q4_K) {
            d[h] = _mm256_loadu_ps((const float *)rec + 8 * h);
            mw[h] = _mm256_loadu_ps((const float *)rec + 16 + 8 * h);
            continue;
        }
        d[h] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + 16 * h)));
        mw[h] = _mm256_setzero_ps();
        if (TYPE == T_Q4_1)
            mw[h] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + 32 + 16 * h)));
        else if (TYPE == T_Q4_0)
            mw[h] = _mm256_mul_ps(d[h], _mm256_set1_ps(-8.0f));
    }
}

/* the int32 sums s[r] (columns 0..7, 8..15) over a record's pairs [g0, g1) (g0, g1 even)
   for MR rows */
ALWAYS_INLINE void packed_sums(const int TYPE, const int MR, const uint8_t *rec, int g0, int g1,
                               const int16_t **x, int64_t xoff, __m256i (*s)[2]) {
    for (int r = 0; r < MR; r++) s[r][0] = s[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 1
    for (int g = g0; g < g1; g += 2) {
        __m256i w[2][2];
        packed_pairs(TYPE, rec, g, w);
        for (int p = 0; p < 2; p++)
            for (int r = 0; r < MR; r++) {
                int32_t pair;
                memcpy(&pair, x[r] + xoff + 2 * (g + p), 4);
                const __m256i xb = _mm256_set1_epi32(pair);
                s[r][0] = _mm256_add_epi32(s[r][0], _mm256_madd_epi16(w[p][0], xb));
                s[r][1] = _mm256_add_epi32(s[r][1], _mm256_madd_epi16(w[p][1], xb));
            }
    }
}

/* MR activation rows against one column group's nb records: x[r], ed[r], sx[r] the row's X,
   block scales and sums; out[r] the 16 columns' dot products, summed as tile_rows sums them
   (Q6_K: each half's pairs with their own scales), so bit-identical to the tiles */
ALWAYS_INLINE void packed_rows(const int TYPE, const int MR, const uint8_t *rec, int64_t nb,
                               const int16_t **x, const float **ed, const float **sx,
                               float (*out)[TILE_COLS]) {
    const int64_t rbytes = packed_record(TYPE);
    __m256 f[4][2];
    for (int r = 0; r < MR; r++) f[r][0] = f[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, rec += rbytes) {
        prefetch_ahead(TYPE, rec);
        for (int half = 0; half < (TYPE == T_Q6_K ? 2 : 1); half++) {
            const int g0 = TYPE == T_Q6_K ? 8 * half : 0, g1 = TYPE == T_Q6_K ? g0 + 8 : 16;
            __m256i s[4][2];
            __m256 d[2], mw[2];
            packed_sums(TYPE, MR, rec, g0, g1, x, b * QK, s);
            packed_scales(TYPE, rec, half, d, mw);
            for (int r = 0; r < MR; r++) {
                const __m256 e = _mm256_broadcast_ss(ed[r] + b);
                f[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r][0]), _mm256_mul_ps(d[0], e),
                                          f[r][0]);
                f[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r][1]), _mm256_mul_ps(d[1], e),
                                          f[r][1]);
                if (has_sum_term(TYPE)) {
                    const __m256 sb = _mm256_broadcast_ss(sx[r] + b);
                    f[r][0] = _mm256_fmadd_ps(mw[0], sb, f[r][0]);
                    f[r][1] = _mm256_fmadd_ps(mw[1], sb, f[r][1]);
                }
            }
        }
    }
    for (int r = 0; r < MR; r++) {
        _mm256_storeu_ps(out[r], f[r][0]);
        _mm256_storeu_ps(out[r] + 8, f[r][1]);
    }
}

#if defined(VTOK_ISA_AVX512)
/* The same records at 512 bits: pair g of all 16 columns is one int16 vector (lanes 0..15 as
   packed_pair's w0, 16..31 as its w1), so one multiply-add per row and pair gives lane c =
   column c's two products (vpdpwssd with VNNI, else vpmaddwd + vpaddd); the per-column float
   math is packed_rows' lane for lane, so the results are bit-identical. Q4: the 16 bytes are
   loaded into both halves and widened, then the low half keeps the low nibbles and the high
   half shifts down the high ones: byte 0x3a -> lane 0 = 0xa, lane 16 = 0x3. */
ALWAYS_INLINE __m512i packed_pair512(const int TYPE, const uint8_t *rec, int g) {
    if (TYPE == T_Q8_0)
        return _mm512_cvtepi8_epi16(
            _mm256_loadu_si256((const __m256i *)(rec + packed_quants(TYPE) + 32 * g)));
    const uint8_t *q = rec + packed_quants(TYPE) + 16 * g;
    const __m512i v = _mm512_cvtepu8_epi16(
        _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)q)));
    const __m512i shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
    return _mm512_and_si512(_mm512_srlv_epi16(v, shift), _mm512_set1_epi16(0x0f));
}

#define PACKED_W512(g) packed_pair512(TYPE, rec, g)
#define DEFINE_PACKED_ROWS512(NAME, ACC)                                                       \
    ALWAYS_INLINE void NAME(const int TYPE, const int MR, const uint8_t *rec, int64_t nb,      \
                            const int16_t **x, const float **ed, const float **sx,             \
                            float (*out)[TILE_COLS]) {                                         \
        const int64_t rbytes = packed_record(TYPE);                                            \
        __m512 f[4];                                                                           \
        for (int r = 0; r < MR; r++) f[r] = _mm512_setzero_ps();                               \
        for (int64_t b = 0; b < nb; b++, rec += rbytes) {                                      \
            __m512i s[4];                                                                      \
            ROW_PAIRS512(ACC, MR, 0, 16, PACKED_W512, x, b * QK, s);                           \
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)rec));        \
            __m512 mw = _mm512_setzero_ps();                                                   \
            if (TYPE == T_Q4_1)                                                                \
                mw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + 32)));         \
            else if (TYPE == T_Q4_0)                                                           \
                mw = _mm512_mul_ps(d, _mm512_set1_ps(-8.0f));                                  \
            for (int r = 0; r < MR; r++) {                                                     \
                const __m512 e = _mm512_set1_ps(ed[r][b]);                                     \
                f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r]), _mm512_mul_ps(d, e), f[r]);   \
                if (TYPE != T_Q8_0) f[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(sx[r][b]), f[r]); \
            }                                                                                  \
        }                                                                                      \
        for (int r = 0; r < MR; r++) _mm512_storeu_ps(out[r], f[r]);                           \
    }

static inline __m512i acc_madd512(__m512i s, __m512i w, __m512i x) {
    return _mm512_add_epi32(s, _mm512_madd_epi16(w, x));
}
DEFINE_PACKED_ROWS512(packed_rows512_madd, acc_madd512)

#pragma GCC push_options
#pragma GCC target("avx512vnni")
static inline __m512i acc_vnni512(__m512i s, __m512i w, __m512i x) {
    return _mm512_dpwssd_epi32(s, w, x);
}
DEFINE_PACKED_ROWS512(packed_rows512_vnni, acc_vnni512)
#pragma GCC pop_options
#endif

#if defined(VTOK_ISA_AVX512)
#define PACKED_KQ_CASES(FN, ...)
#else
#define PACKED_KQ_CASES(FN, ...)                                                               \
        case T_Q4_K: FN(T_Q4_K, __VA_ARGS__); break;                                           \
        case T_Q6_K: FN(T_Q6_K, __VA_ARGS__); break;
#endif
#define PACKED_SWITCH(FN, type, ...)                                                           \
    do {                                                                                       \
        switch (type) {                                                                        \
        case T_Q8_0: FN(T_Q8_0, __VA_ARGS__); break;                                           \
        case T_Q4_0: FN(T_Q4_0, __VA_ARGS__); break;                                           \
        case T_Q4_1: FN(T_Q4_1, __VA_ARGS__); break;                                           \
        PACKED_KQ_CASES(FN, __VA_ARGS__)                                                       \
        }                                                                                      \
    } while (0)
#define PACKED_ROWS_FN(FN, T, MR, ...)                                                         \
    do {                                                                                       \
        if ((MR) == 4) FN(T, 4, __VA_ARGS__);                                                  \
        else if ((MR) == 3) FN(T, 3, __VA_ARGS__);                                             \
        else if ((MR) == 2) FN(T, 2, __VA_ARGS__);                                             \
        else FN(T, 1, __VA_ARGS__);                                                            \
    } while (0)
#define PACKED_ROWS(T, MR, ...) PACKED_ROWS_FN(packed_rows, T, MR, __VA_ARGS__)

/* mr (<= 4) rows against one column group's records (packed_group) or nblk tiles
   (tile_group), each ISA's widest kernel */
#define PACKED_GROUP_ARGS                                                                      \
    int type, int mr, const uint8_t *rec, int64_t nb, const int16_t **xp, const float **edp,   \
        const float **sxp, float (*out)[TILE_COLS]
#define TILE_GROUP_ARGS                                                                        \
    int type, int mr, const tile_block *t, int nblk, const int16_t **xp, const float **edp,    \
        const float **sxp, float (*acc)[TILE_COLS]
#if defined(VTOK_ISA_AVX512)
#define PACKED_ROWS512_MADD(T, MR, ...) PACKED_ROWS_FN(packed_rows512_madd, T, MR, __VA_ARGS__)
#define PACKED_ROWS512_VNNI(T, MR, ...) PACKED_ROWS_FN(packed_rows512_vnni, T, MR, __VA_ARGS__)
DEFINE_TILE_ROWS512(tile_rows512_madd, acc_madd512)
static void packed_group(PACKED_GROUP_ARGS) {
    PACKED_SWITCH(PACKED_ROWS512_MADD, type, mr, rec, nb, xp, edp, sxp, out);
}
static void tile_group(TILE_GROUP_ARGS) {
    DISPATCH(tile_rows512_madd, type, mr, t, nblk, xp, edp, sxp, acc);
}
#pragma GCC push_options
#pragma GCC target("avx512vnni")
DEFINE_TILE_ROWS512(tile_rows512_vnni, acc_vnni512)
static void packed_group_vnni(PACKED_GROUP_ARGS) {
    PACKED_SWITCH(PACKED_ROWS512_VNNI, type, mr, rec, nb, xp, edp, sxp, out);
}
static void tile_group_vnni(TILE_GROUP_ARGS) {
    DISPATCH(tile_rows512_vnni, type, mr, t, nblk, xp, edp, sxp, acc);
}
#pragma GCC pop_options
#else
static void packed_group(PACKED_GROUP_ARGS) {
    PACKED_SWITCH(PACKED_ROWS, type, mr, rec, nb, xp, edp, sxp, out);
}
static void tile_group(TILE_GROUP_ARGS) {
    DISPATCH(tile_rows, type, mr, t, nblk, xp, edp, sxp, acc);
}
#endif


#if !defined(VTOK_ISA_AVX512)
/* ---- column quads (avx2) at one row: see "repacked at load" ------------------------------ */

/* one 32-element block of a row's digits: sums[h] = the sum of X = 254 q + e over its
   elements 16h .. 16h + 15, in every lane */
static inline void digit_sums(const int8_t *q, const int8_t *e, __m256i *sums) {
    const __m256i ones = _mm256_set1_epi8(1);
    const __m256i vq = _mm256_loadu_si256((const __m256i *)q);
    const __m256i ve = _mm256_loadu_si256((const __m256i *)e);
    __m256i t = _mm256_add_epi32(
        _mm256_madd_epi16(_mm256_maddubs_epi16(ones, vq), _mm256_set1_epi16(254)),
        _mm256_madd_epi16(_mm256_maddubs_epi16(ones, ve), _mm256_set1_epi16(1)));
    t = _mm256_add_epi32(t, _mm256_shuffle_epi32(t, 0x4E));
    t = _mm256_add_epi32(t, _mm256_shuffle_epi32(t, 0xB1));   /* lanes 0..3: elements 0..15 */
    sums[0] = _mm256_permutevar8x32_epi32(t, _mm256_setzero_si256());
    sums[1] = _mm256_permutevar8x32_epi32(t, _mm256_set1_epi32(4));
}

/* one row against one column group's nb quad records: xq, xe the row's digits, ed and sx its
   block scales and sums, from the group's first block on; out the 16 columns' dot products.
   The values times each digit broadcast 4 at a time (vpmaddubsw: no product saturates, 2 x 63
   x 127 < 2^15), int16 lanes summed over `run` quads (Q6_K 2, the 4-bit types 8: still below
   2^15), then joined into int32 column lanes by madd with 254 (q) and 1 (e): per span (Q6_K:
   a half's 4 quads with its own scale, less 32 times the half's X sum; else the block's 8)
   the integer dot product is the tiles', and the float math is tile_rows', so the results are
   bit-identical to the tiles */
ALWAYS_INLINE void quad_row(const int TYPE, const uint8_t *rec, int64_t nb, const int8_t *xq,
                            const int8_t *xe, const float *ed, const float *sx, float *out) {
    const int span = TYPE == T_Q6_K ? 4 : 8, run = TYPE == T_Q6_K ? 2 : 8;
    const int64_t rbytes = packed_record(TYPE);
    const __m256i c254 = _mm256_set1_epi16(254), c1 = _mm256_set1_epi16(1);
    __m256 f[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t b = 0; b < nb; b++, rec += rbytes) {
        prefetch_ahead(TYPE, rec);
        __m256i sums[2];
        if (TYPE == T_Q6_K) digit_sums(xq + b * QK, xe + b * QK, sums);
#pragma GCC unroll 1
        for (int s0 = 0; s0 < 8; s0 += span) {
            __m256i s[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
#pragma GCC unroll 4
            for (int i0 = s0; i0 < s0 + span; i0 += run) {
                __m256i aq[2], ae[2];
                aq[0] = aq[1] = ae[0] = ae[1] = _mm256_setzero_si256();
#pragma GCC unroll 8
                for (int i = i0; i < i0 + run; i++) {
                    const int64_t at = b * QK + 4 * i;
                    const __m256i qb = _mm256_set1_epi32((int)rd32((const uint8_t *)(xq + at)));
                    const __m256i eb = _mm256_set1_epi32((int)rd32((const uint8_t *)(xe + at)));
                    for (int h = 0; h < 2; h++) {
                        const __m256i u = quad_values(TYPE, rec, i, h);
                        aq[h] = _mm256_add_epi16(aq[h], _mm256_maddubs_epi16(u, qb));
                        ae[h] = _mm256_add_epi16(ae[h], _mm256_maddubs_epi16(u, eb));
                    }
                }
                for (int h = 0; h < 2; h++)
                    s[h] = _mm256_add_epi32(s[h], _mm256_add_epi32(_mm256_madd_epi16(aq[h], c254),
                                                                   _mm256_madd_epi16(ae[h], c1)));
            }
            __m256 d[2], mw[2];
            packed_scales(TYPE, rec, s0 / 4, d, mw);
            if (TYPE == T_Q6_K) {
                const __m256i corr = _mm256_slli_epi32(sums[s0 / 4], 5);
                s[0] = _mm256_sub_epi32(s[0], corr);
                s[1] = _mm256_sub_epi32(s[1], corr);
            }
            const __m256 e = _mm256_broadcast_ss(ed + b);
            for (int h = 0; h < 2; h++) {
                f[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[h]), _mm256_mul_ps(d[h], e), f[h]);
                if (has_sum_term(TYPE))
                    f[h] = _mm256_fmadd_ps(mw[h], _mm256_broadcast_ss(sx + b), f[h]);
            }
        }
    }
    _mm256_storeu_ps(out, f[0]);
    _mm256_storeu_ps(out + 8, f[1]);
}

static void quad_row_any(int type, const uint8_t *rec, int64_t nb, const int8_t *xq,
                         const int8_t *xe, const float *ed, const float *sx, float *out) {
    switch (type) {
    case T_Q4_0: quad_row(T_Q4_0, rec, nb, xq, xe, ed, sx, out); break;
    case T_Q4_1: quad_row(T_Q4_1, rec, nb, xq, xe, ed, sx, out); break;
    case T_Q4_K: quad_row(T_Q4_K, rec, nb, xq, xe, ed, sx, out); break;
    case T_Q6_K: quad_row(T_Q6_K, rec, nb, xq, xe, ed, sx, out); break;
    }
}

#endif

/* nblk records of one column group as tiles (tile_rows multiplies them) */
ALWAYS_INLINE void decode_packed(const int TYPE, const uint8_t *rec, int nblk, tile_block *t) {
    for (int i = 0; i < nblk; i++, rec += packed_record(TYPE)) {
        for (int g = 0; g < 16; g += 2) packed_pairs(TYPE, rec, g, &t[i].w[g]);
        __m256 d[2], mw[2], d_hi[2], unused[2];
        packed_scales(TYPE, rec, 0, d, mw);
        if (TYPE == T_Q6_K) packed_scales(TYPE, rec, 1, d_hi, unused);
        for (int h = 0; h < 2; h++) {
            _mm256_storeu_ps(t[i].d + 8 * h, d[h]);
            _mm256_storeu_ps(t[i].d_hi + 8 * h, TYPE == T_Q6_K ? d_hi[h] : d[h]);
            _mm256_storeu_ps(t[i].m + 8 * h, mw[h]);
        }
    }
}

/* the columns [j0, j0 + 16) (or fewer, to j1) of one weight (packed: repacked by vq_repack,
   j0 % 16 == 0), all rows, tiled; x16 [m, k],
   ed and sx [m, k / 32]; y, bias and residual as columns_madd */
static void columns_tiled(int type, int packed, const uint8_t *w, int64_t j0, int64_t j1,
                          int64_t k, const int16_t *x16, const float *xed, const float *xs,
                          int64_t m, const float *bias, const float *residual, float *y,
                          int64_t ldy, int vnni) {
    (void)vnni;
    const int64_t nb = k / QK, rb = k / block_elems(type) * block_bytes(type);
    const int ncols = (int)(j1 - j0);
    tile_block t[TILE_KB] __attribute__((aligned(32)));
    float acc[TILE_RC][TILE_COLS];
    for (int64_t r0 = 0; r0 < m; r0 += TILE_RC) {
        const int rc = m - r0 < TILE_RC ? (int)(m - r0) : TILE_RC;
        memset(acc, 0, sizeof(float) * TILE_COLS * (size_t)rc);
        for (int64_t b0 = 0; b0 < nb; b0 += TILE_KB) {
            const int nblk = nb - b0 < TILE_KB ? (int)(nb - b0) : TILE_KB;
            if (packed)
                PACKED_SWITCH(decode_packed, type, w + (j0 / 16 * nb + b0) * packed_record(type),
                              nblk, t);
            else
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
#if defined(VTOK_ISA_AVX512)
                if (vnni) tile_group_vnni(type, mr, t, nblk, xp, edp, sxp, acc + rr);
                else
#endif
                    tile_group(type, mr, t, nblk, xp, edp, sxp, acc + rr);
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

#if !defined(VTOK_ISA_AVX512)
/* Q6_K records against m (4 .. PACKED_TILE_ROWS - 1) rows: each record decoded once into a
   tile for all the rows (decode_packed), which tile_rows multiplies 4 rows at a time and the
   rest one at a time (GCC's code for 2 or 3 rows at once is slower); the float math is
   quad_row's, so the results are bit-identical to it and to the tiles */
static void quad_tile_rows(const uint8_t *rec, int64_t nb, int m, const int16_t *x16,
                           int64_t k, const float *xed, const float *xs,
                           float (*out)[TILE_COLS]) {
    tile_block t __attribute__((aligned(32)));
    memset(out, 0, sizeof(float) * TILE_COLS * (size_t)m);
    for (int64_t b = 0; b < nb; b++, rec += packed_record(T_Q6_K)) {
        prefetch_ahead(T_Q6_K, rec);
        decode_packed(T_Q6_K, rec, 1, &t);
        for (int r0 = 0, mr; r0 < m; r0 += mr) {
            mr = r0 + 4 <= m ? 4 : 1;
            const int16_t *x[4];
            const float *ed[4], *sx[4];
            for (int r = 0; r < mr; r++) {
                x[r] = x16 + (r0 + r) * k + b * QK;
                ed[r] = xed + (r0 + r) * nb + b;
                sx[r] = xs + (r0 + r) * nb + b;
            }
            if (mr == 4) tile_rows(T_Q6_K, 4, &t, 1, x, ed, sx, out + r0);
            else tile_rows(T_Q6_K, 1, &t, 1, x, ed, sx, out + r0);
        }
    }
}
#endif

/* columns [j0, j1) (one group: j0 % 16 == 0, j1 - j0 <= 16) of a repacked weight, all rows;
   y, bias and residual as columns_madd */
static void columns_packed(int type, const uint8_t *w, int64_t j0, int64_t j1, int64_t k,
                           const int8_t *xq, const int16_t *x16, const float *xed,
                           const float *xs, int64_t m,
                           const float *bias, const float *residual, float *y, int64_t ldy,
                           int vnni) {
    (void)vnni, (void)xq;
    const int64_t nb = k / QK;
    const uint8_t *rec = w + j0 / 16 * nb * packed_record(type);
    if (m >= PACKED_TILE_ROWS) {
        columns_tiled(type, 1, w, j0, j1, k, x16, xed, xs, m, bias, residual, y, ldy, vnni);
        return;
    }
    for (int64_t r0 = 0, mr; r0 < m; r0 += mr) {
        mr = m - r0 < 4 ? m - r0 : 4;
        const int16_t *xp[4];
        const float *edp[4], *sxp[4];
        float out[PACKED_TILE_ROWS][TILE_COLS];
#if !defined(VTOK_ISA_AVX512)
        if (quad_records(type) && m == 1) {
            quad_row_any(type, rec, nb, xq, xq + k, xed, xs, out[0]);
        } else if (type == T_Q6_K && m >= 4) {      /* every row at once */
            mr = m;
            quad_tile_rows(rec, nb, (int)m, x16, k, xed, xs, out);
        } else
#endif
        {
            for (int r = 0; r < mr; r++) {
                xp[r] = x16 + (r0 + r) * k;
                edp[r] = xed + (r0 + r) * nb;
                sxp[r] = xs + (r0 + r) * nb;
            }
#if defined(VTOK_ISA_AVX512)
            if (vnni) packed_group_vnni(type, (int)mr, rec, nb, xp, edp, sxp, out);
            else
#endif
                packed_group(type, (int)mr, rec, nb, xp, edp, sxp, out);
        }
        for (int r = 0; r < mr; r++)
            for (int64_t j = j0; j < j1; j++) {
                float v = out[r][j - j0];
                if (bias) v += bias[j];
                if (residual) v += residual[(r0 + r) * ldy + j];
                y[(r0 + r) * ldy + j] = v;
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

#if defined(VTOK_ISA_AVX512)
static int vnni_on = -1;        /* -1: not read from the CPU yet */
#endif

/* 1 when this build uses vpdpbusd / vpdpwssd on this CPU */
int vq_uses_vnni(void) {
#if defined(VTOK_ISA_AVX512)
    if (vnni_on < 0) vnni_on = __builtin_cpu_supports("avx512vnni") ? 1 : 0;
    return vnni_on;
#else
    return 0;
#endif
}

/* on = 0 multiplies with maddubs / madd even where the CPU has VNNI (the integer sums and so
   the results are the same; tests run both variants on one CPU); returns vq_uses_vnni() */
int vq_set_vnni(int on) {
#if defined(VTOK_ISA_AVX512)
    vnni_on = on && __builtin_cpu_supports("avx512vnni");
#else
    (void)on;
#endif
    return vq_uses_vnni();
}

/* 1 when this build multiplies `type` repacked by vq_repack (Q4_0, Q4_1, Q8_0 on x86; Q5_0,
   Q4_K and Q6_K on avx2) */
int vq_packs(int type) {
#if defined(VTOK_ISA_AVX512) || defined(VTOK_ISA_AVX2)
    return packable(type);
#else
    (void)type;
    return 0;
#endif
}

/* bytes of a weight [n, k] of `type` repacked (columns padded to a multiple of 16) */
int64_t vq_packed_bytes(int type, int64_t n, int64_t k) {
    return (n + 15) / 16 * (k / QK) * packed_record(type);
}

/* W [n, k] in `type`'s GGML blocks -> dst (vq_packed_bytes) in the layout the packed kernels
   read (see "repacked at load" above). Returns 0, or -1 when this build does not multiply
   `type` repacked or k is not a multiple of 32 */
int vq_repack(int type, const uint8_t *src, int64_t n, int64_t k, uint8_t *dst) {
    if (!vq_packs(type) || k % block_elems(type) || n < 0) return -1;
    const int64_t nb = k / QK, bb = block_bytes(type), rb = k / block_elems(type) * bb;
    const int qoff = packed_quants(type);
    memset(dst, 0, (size_t)vq_packed_bytes(type, n, k));
    for (int64_t j = 0; j < n; j++) {
        const int c = (int)(j % 16), half = c >> 3, lane = 2 * (c & 7);
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = src + j * rb + block_offset(type, b);
            uint8_t *rec = dst + (j / 16 * nb + b) * packed_record(type);
            uint8_t v[QK];             /* the values as the record holds them */
            if (type == T_Q6_K) {      /* sub-block s's values q6, d and its halves' scales */
                const int s = (int)(b & 7), h = s >> 2, g = s & 3;
                const uint8_t *ql = blk + 64 * h + 32 * (g & 1), *qh = blk + 128 + 32 * h;
                memcpy(rec + 2 * c, blk + 208, 2);
                rec[32 + c] = blk[192 + 2 * s];
                rec[48 + c] = blk[193 + 2 * s];
                for (int e = 0; e < QK; e++) {
                    const int lo = (ql[e] >> (4 * (g >> 1))) & 15, hi = (qh[e] >> (2 * g)) & 3;
                    v[e] = (uint8_t)(lo | hi << 4);
                }
            } else if (type == T_Q4_K) {   /* sub-block j's nibbles, d * sc_j and -dmin * m_j */
                const int jj = (int)(b & 7);
                int sc, mn;
                k4_scale_min(blk + 4, jj, &sc, &mn);
                const float dw = h2f(rd16(blk)) * (float)sc, cw = -h2f(rd16(blk + 2)) * (float)mn;
                memcpy(rec + 4 * c, &dw, 4);
                memcpy(rec + 64 + 4 * c, &cw, 4);
                const uint8_t *qs = blk + 16 + 32 * (jj >> 1);
                for (int e = 0; e < QK; e++) v[e] = (qs[e] >> (4 * (jj & 1))) & 15;
            } else {
                memcpy(rec + 2 * c, blk, 2);                                /* d */
                if (type == T_Q4_1) memcpy(rec + 32 + 2 * c, blk + 2, 2);   /* m */
                if (type == T_Q8_0) {
                    memcpy(v, blk + 2, QK);
                } else if (type == T_Q5_0) {                   /* Q8_0's values q5 - 16 */
                    const uint32_t qh = rd32(blk + 2);
                    for (int e = 0; e < QK; e++) {
                        const int lo = e < 16 ? blk[6 + e] & 15 : blk[6 + e - 16] >> 4;
                        v[e] = (uint8_t)(int8_t)((lo | ((qh >> e) & 1) << 4) - 16);
                    }
                } else {                                       /* Q4_0, Q4_1 */
                    const uint8_t *qs = blk + (type == T_Q4_1 ? 4 : 2);
                    for (int e = 0; e < QK; e++) v[e] = e < 16 ? qs[e] & 15 : qs[e - 16] >> 4;
                }
            }
            for (int e = 0; e < QK; e++) {
                const int g = e >> 1, i = lane + (e & 1);
                if (type == T_Q6_K) {           /* quad e / 4, byte 4 (c % 8) + e % 4 */
                    const int qi = e >> 2, j = 2 * (qi & 1) + half;
                    uint8_t *row = rec + qoff + 96 * (qi >> 1) + 4 * (c & 7) + (e & 3);
                    if (j < 3) {
                        row[32 * j] |= v[e];
                    } else {
                        for (int piece = 0; piece < 3; piece++)
                            row[32 * piece] |= (uint8_t)(((v[e] >> (2 * piece)) & 3) << 6);
                    }
                } else if (quad_records(type)) {                  /* quad e / 4 */
                    rec[qoff + 32 * (e >> 2) + 4 * (c & 7) + (e & 3)] |=
                        (uint8_t)((v[e] & 15) << (4 * half));
                } else if (packed_bytes_per_value(type)) {
                    rec[qoff + 32 * g + 16 * half + i] = v[e];
                } else {
                    rec[qoff + 16 * g + i] |= (uint8_t)((v[e] & 15) << (4 * half));
                }
            }
        }
    }
    return 0;
}

/* whether the weights (types[p], ns[p] rows of k) can be multiplied */
static int parts_ok(int nparts, const int *types, const int64_t *ns, int64_t k) {
    if (nparts < 1 || nparts > MAX_PARTS || k < 0) return 0;
    for (int p = 0; p < nparts; p++) {
        const int type = types[p] & ~VQ_PACKED, elems = block_elems(type);
        if (elems == 0 || k % elems || ns[p] < 0) return 0;
        if ((types[p] & VQ_PACKED) && !vq_packs(type)) return 0;
    }
    return 1;
}

/* y [m, sum ns] = x @ [W_0; W_1; ...]^T on already quantized activations (vq_quantize_rows):
   xq holds q [m, k] then e [m, k], xd holds d [m, k / 32] then ed [m, k / 32]; x16 [m, k] their
   joined digits (built when a weight is repacked or m >= TILE_MIN_ROWS, else NULL). Every
   weight's columns in chunks (8, whole cache lines of y per thread, mostly; 16 for the tiled
   and repacked kernels), all in one parallel loop */
/* columns j0 .. j1 of one weight (type | VQ_PACKED) for m quantized activation rows (xq: q [m, k]
   then e [m, k]; xd: d [m, k / 32] then ed; x16 [m, k] or NULL), into y with row stride ldy */
static inline void gemm_columns(int typef, const uint8_t *w, int64_t j0, int64_t j1, int64_t k,
                                const int8_t *xq, const float *xd, const float *xs,
                                const int16_t *x16, int64_t m, const float *bias,
                                const float *residual, float *y, int64_t ldy, int vnni) {
    const int type = typef & ~VQ_PACKED;
    const int64_t nb = k / QK;
#if defined(VTOK_ISA_AVX512) || defined(VTOK_ISA_AVX2)
    if (typef & VQ_PACKED) {
        columns_packed(packed_kind(type), w, j0, j1, k, xq, x16, xd + m * nb, xs, m, bias,
                       residual, y, ldy, vnni);
        return;
    }
    if (x16 && m >= TILE_MIN_ROWS) {
        columns_tiled(type, 0, w, j0, j1, k, x16, xd + m * nb, xs, m, bias, residual, y, ldy,
                      vnni);
        return;
    }
#endif
#if defined(VTOK_ISA_AVX512)
    if (vnni) {
        columns_vnni(type, w, j0, j1, k, xq, xd, xs, m, bias, residual, y, ldy);
        return;
    }
#endif
    (void)vnni, (void)x16, (void)nb;
    columns_madd(type, w, j0, j1, k, xq, xd, xs, m, bias, residual, y, ldy);
}

/* the column chunk a thread takes: 16 for the tiled and repacked kernels, else 8 (whole cache
   lines of y per thread, mostly) */
static inline int64_t column_chunk(int typef, const int16_t *x16, int64_t m) {
    return (typef & VQ_PACKED) || (x16 && m >= TILE_MIN_ROWS) ? 16 : 8;
}

/* y [m, sum ns] = x @ [W_0; W_1; ...]^T on already quantized activations (vq_quantize_rows):
   xq holds q [m, k] then e [m, k], xd holds d [m, k / 32] then ed [m, k / 32]; x16 [m, k] their
   joined digits (built when a weight is repacked or m >= TILE_MIN_ROWS, else NULL). Every
   weight's columns in chunks (column_chunk), all in one parallel loop */
static void gemm_parts_q(int nparts, const int *types, const uint8_t *const *ws,
                         const int64_t *ns, int64_t k, const int8_t *xq, const float *xd,
                         const float *xs, const int16_t *x16, int64_t m, const float *bias,
                         const float *residual, float *y) {
    int64_t first[MAX_PARTS + 1], col[MAX_PARTS + 1], chunk[MAX_PARTS];  /* first chunk, column */
    first[0] = col[0] = 0;
    for (int p = 0; p < nparts; p++) {
        chunk[p] = column_chunk(types[p], x16, m);
        first[p + 1] = first[p] + (ns[p] + chunk[p] - 1) / chunk[p];
        col[p + 1] = col[p] + ns[p];
    }
    const int64_t ldy = col[nparts];
    const int vnni = vq_uses_vnni();
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < first[nparts]; c++) {
        int p = 0;
        while (c >= first[p + 1]) p++;
        const int64_t j0 = (c - first[p]) * chunk[p];
        const int64_t j1 = j0 + chunk[p] < ns[p] ? j0 + chunk[p] : ns[p];
        gemm_columns(types[p], ws[p], j0, j1, k, xq, xd, xs, x16, m,
                     bias ? bias + col[p] : NULL, residual ? residual + col[p] : NULL,
                     y + col[p], ldy, vnni);
    }
}

/* a calling thread's buffer of at least `bytes`, kept from call to call (a fresh one per call
   costs page faults once it passes malloc's mmap threshold); NULL: no memory */
static void *scratch(size_t bytes) {
    static __thread void *buf;
    static __thread size_t cap;
    if (bytes > cap) {
        free(buf);
        cap = bytes + bytes / 4 + 4096;
        buf = malloc(cap);
        if (!buf) cap = 0;
    }
    return buf;
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
    int want16 = 0;         /* x86: the repacked and tiled kernels read X = 254 q + e */
#if defined(VTOK_ISA_AVX512) || defined(VTOK_ISA_AVX2)
    for (int p = 0; p < nparts; p++) want16 |= (types[p] & VQ_PACKED) != 0;
    want16 |= m >= TILE_MIN_ROWS;
#endif
    /* the activations: d, ed, s [m, nb] floats, then q, e [m, k] int8, then X [m, k] int16 */
    const size_t fbytes = sizeof(float) * (size_t)(3 * m * nb);
    uint8_t *buf = (uint8_t *)scratch(fbytes + (size_t)(2 * m * k) * (want16 ? 2 : 1));
    if (!buf) return -1;
    float *xd = (float *)buf, *xs = xd + 2 * m * nb;
    int8_t *xq = (int8_t *)(buf + fbytes);
    int16_t *x16 = want16 ? (int16_t *)(xq + 2 * m * k) : NULL;
    quantize_rows(x, m, k, xq, xq + m * k, x16, xd, xd + m * nb, xs);
    gemm_parts_q(nparts, types, ws, ns, k, xq, xd, xs, x16, m, bias, residual, y);
    return 0;
}

/* y [m, n] = x [m, k] @ W^T (+ bias [n]) (+ residual [m, n]) for one weight (vq_gemm_parts) */
int vq_gemm(int type, const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t m,
            const float *bias, const float *residual, float *y) {
    return vq_gemm_parts(1, &type, &w, &n, k, x, m, bias, residual, y);
}

/* Grouped GEMM, a mixture of experts' expert layer: the rows off[g] .. off[g + 1] of x [P, k]
   (the tokens routed to expert g, grouped by expert) times weight g, n rows of k in types[g]'s
   blocks (| VQ_PACKED: repacked): y [P, n], row p = x[p] @ W_g^T (+ biases[g] [n], when biases
   and biases[g] are not NULL). An empty group costs nothing. Each group's rows are quantized as
   vq_gemm quantizes them, then one parallel loop runs every group's column chunks, so many
   groups of one or two rows share one fork. Returns 0, or -1 on a bad type, k not a multiple
   of a weight's block, unordered offsets or no memory */
int vq_gemm_grouped(int ngroups, const int *types, const uint8_t *const *ws,
                    const float *const *biases, int64_t n, int64_t k, const float *x,
                    const int64_t *off, float *y) {
    if (ngroups < 0 || n < 0 || off[0] != 0) return -1;
    int want16 = 0;
    for (int g = 0; g < ngroups; g++) {
        if (!parts_ok(1, &types[g], &n, k) || off[g + 1] < off[g]) return -1;
#if defined(VTOK_ISA_AVX512) || defined(VTOK_ISA_AVX2)
        want16 |= (types[g] & VQ_PACKED) || off[g + 1] - off[g] >= TILE_MIN_ROWS;
#endif
    }
    const int64_t rows = off[ngroups], nb = k / QK;
    if (rows == 0 || n == 0) return 0;
    /* per row: d, ed, s [nb] floats; q, e [k] int8; X [k] int16; and per group its first chunk */
    const size_t fbytes = sizeof(float) * (size_t)(3 * rows * nb);
    const size_t qbytes = (size_t)(2 * rows * k) * (want16 ? 2 : 1);
    uint8_t *buf = (uint8_t *)scratch(fbytes + qbytes + sizeof(int64_t) * (size_t)(ngroups + 1));
    if (!buf) return -1;
    float *xd = (float *)buf, *xs = xd + 2 * rows * nb;
    int8_t *xq = (int8_t *)(buf + fbytes);
    int16_t *x16 = want16 ? (int16_t *)(xq + 2 * rows * k) : NULL;
    int64_t *first = (int64_t *)(buf + fbytes + qbytes);
    /* group g's activations as vq_gemm lays out m = its rows: q then e at 2 k off[g], d then
       ed at 2 nb off[g], s at nb off[g], X at k off[g] */
    first[0] = 0;
    for (int g = 0; g < ngroups; g++) {
        const int64_t a = off[g], m = off[g + 1] - off[g];
        if (m)
            quantize_rows(x + a * k, m, k, xq + 2 * a * k, xq + 2 * a * k + m * k,
                          x16 ? x16 + a * k : NULL, xd + 2 * a * nb, xd + 2 * a * nb + m * nb,
                          xs + a * nb);
        const int64_t chunk = column_chunk(types[g], x16, m);
        first[g + 1] = first[g] + (m ? (n + chunk - 1) / chunk : 0);
    }
    const int vnni = vq_uses_vnni();
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < first[ngroups]; c++) {
        int lo = 0, hi = ngroups - 1;         /* the group g with first[g] <= c < first[g + 1] */
        while (lo < hi) {
            const int mid = (lo + hi + 1) / 2;
            if (first[mid] <= c) lo = mid; else hi = mid - 1;
        }
        const int g = lo;
        const int64_t a = off[g], m = off[g + 1] - a, chunk = column_chunk(types[g], x16, m);
        const int64_t j0 = (c - first[g]) * chunk, j1 = j0 + chunk < n ? j0 + chunk : n;
        gemm_columns(types[g], ws[g], j0, j1, k, xq + 2 * a * k, xd + 2 * a * nb, xs + a * nb,
                     x16 ? x16 + a * k : NULL, m, biases ? biases[g] : NULL, NULL, y + a * n, n,
                     vnni);
    }
    return 0;
}
