/* CPU decode kernels (float32, OpenMP), loaded with ctypes by vllm/cpu_kernels.py.

   Decode steps multiply a few rows by every weight matrix, so they are bound by how fast the
   weights stream from memory. MKL's sgemm reaches about 8 GB/s on these shapes on our 2-core
   machine; packing each weight once into column panels, streaming each panel once for up to 16
   rows, and prefetching 16 KB ahead into L2 reaches 14-20 GB/s (benchmarks/benchmark_throughput.py).

   Plain C with GCC vector extensions: no torch headers, one translation unit, built with
   -O3 -march=native so the same source becomes AVX-512, AVX2 or NEON code. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define PANEL 16              /* output columns per packed panel: one 64-byte vector */
#define ROWS 16               /* input rows per pass over a panel: 16 accumulators */
#define PREFETCH_ROWS 256     /* how far ahead (in panel rows of 64 bytes) to prefetch into L2 */

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16 __attribute__((vector_size(64)));

static inline v16 load16(const float *p) { v16 v; memcpy(&v, p, 64); return v; }
static inline void store16(float *p, v16 v) { memcpy(p, &v, 64); }
static inline v16 splat(float s) { return (v16){s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s}; }
static inline float hsum(v16 v) {
  float s = 0.f;
  for (int i = 0; i < 16; i++) s += v[i];
  return s;
}

/* ---- packed GEMM ------------------------------------------------------------------------------
   Packed weight layout (built by vllm/cpu_kernels.py pack_weight): W [K, N] (y = x @ W) is
   stored as panels[P][K][PANEL] with P = ceil(N / PANEL), columns past N zero. K = 2, N = 20:
       panel 0 = W[0, 0:16], W[1, 0:16]          panel 1 = W[0, 16:20] 0 0 ..., W[1, 16:20] 0 ...
   One panel row is one vector, so a pass reads the panel front to back exactly once per
   ROWS input rows. */

/* rows x[0:rows] (row stride K) times `width` (1 or 2) adjacent panels -> y[0:rows, 0:cols]
   (row stride N); rows and width are compile-time constants at every call site, so acc[][]
   lives in registers: 16 x 1 for one pass over the weights (decode: memory-bound), 12 x 2 for
   more rows (each broadcast of x then feeds two FMAs: compute-bound). */
static inline __attribute__((always_inline)) void panel_pass(
    const float *x, int64_t K, const float *panel, float *y, int64_t N, int cols,
    const float *bias, const float *residual, const int rows, const int width) {
  v16 acc[ROWS][2];
  for (int m = 0; m < rows; m++)
    for (int v = 0; v < width; v++) acc[m][v] = splat(0.f);
  for (int64_t k = 0; k < K; k++) {
    v16 w[2];
    for (int v = 0; v < width; v++) {
      const float *pv = panel + v * K * PANEL;
      __builtin_prefetch(pv + (k + PREFETCH_ROWS) * PANEL, 0, 2);
      w[v] = load16(pv + k * PANEL);
    }
    for (int m = 0; m < rows; m++) {
      v16 b = splat(x[m * K + k]);
      for (int v = 0; v < width; v++) acc[m][v] += b * w[v];
    }
  }
  float tmp[2 * PANEL] = {0};
  if (bias) memcpy(tmp, bias, cols * sizeof(float));
  v16 b[2] = {load16(tmp), load16(tmp + PANEL)};
  for (int m = 0; m < rows; m++) {
    float out[2 * PANEL], res[2 * PANEL] = {0};
    if (residual) memcpy(res, residual + m * N, cols * sizeof(float));
    for (int v = 0; v < width; v++)
      store16(out + v * PANEL, acc[m][v] + b[v] + load16(res + v * PANEL));
    memcpy(y + m * N, out, cols * sizeof(float));
  }
}

#define PASS(r, w) case r: panel_pass(xm, K, panel, ym, N, cols, bias_p, res, r, w); break;
#define PAIR_ROWS 12

/* y [M, N] = x [M, K] @ W (+ bias [N]) (+ residual [M, N]), W packed; bias, residual may be NULL
   and residual may be y itself. Up to 16 rows: each thread streams its panels once. More rows:
   pairs of panels, 12 rows at a time (the pair stays in L2 between those passes). */
void vtok_packed_gemm(const float *x, int64_t M, int64_t K, const float *packed, int64_t N,
                      const float *bias, const float *residual, float *y) {
  const int64_t panels = (N + PANEL - 1) / PANEL, step = M <= ROWS ? 1 : 2;
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < panels; p += step) {
    const float *panel = packed + p * K * PANEL;
    const int width = p + step <= panels ? (int)step : 1;
    const int cols = N - p * PANEL < width * PANEL ? (int)(N - p * PANEL) : width * PANEL;
    const float *bias_p = bias ? bias + p * PANEL : NULL;
    const int64_t tile = width == 2 ? PAIR_ROWS : ROWS;
    for (int64_t m0 = 0; m0 < M; m0 += tile) {
      const float *xm = x + m0 * K;
      float *ym = y + m0 * N + p * PANEL;
      const float *res = residual ? residual + m0 * N + p * PANEL : NULL;
      const int rows = M - m0 < tile ? (int)(M - m0) : (int)tile;
      if (width == 1) {
        switch (rows) {
          PASS(1, 1) PASS(2, 1) PASS(3, 1) PASS(4, 1) PASS(5, 1) PASS(6, 1) PASS(7, 1)
          PASS(8, 1) PASS(9, 1) PASS(10, 1) PASS(11, 1) PASS(12, 1) PASS(13, 1) PASS(14, 1)
          PASS(15, 1) PASS(16, 1)
        }
      } else {
        switch (rows) {
          PASS(1, 2) PASS(2, 2) PASS(3, 2) PASS(4, 2) PASS(5, 2) PASS(6, 2) PASS(7, 2)
          PASS(8, 2) PASS(9, 2) PASS(10, 2) PASS(11, 2) PASS(12, 2)
        }
      }
    }
  }
}

/* ---- decode attention -------------------------------------------------------------------------
   exp for softmax, 16 lanes: exp(x) = 2^n * exp(r), n = round(x / ln2), |r| <= ln2 / 2, exp(r)
   by a degree-7 Taylor polynomial (relative error ~1e-7 on that range); x < -87 (incl. -inf) -> 0,
   x > 88 -> exp(88). */
static inline v16 as_float(i16 v) { v16 f; memcpy(&f, &v, 64); return f; }
static inline i16 as_bits(v16 f) { i16 v; memcpy(&v, &f, 64); return v; }

static inline v16 exp16(v16 x) {
  const float ln2_hi = 0.693145751953125f, ln2_lo = 1.428606765330187e-06f;
  const float round_magic = 12582912.f;                    /* 1.5 * 2^23: adding it rounds */
  i16 underflow = x < -87.f;                               /* lanes of all ones where true */
  i16 overflow = x > 88.f;                                 /* exp(88) ~ 1.7e38, still finite */
  x = as_float((as_bits(x) & ~underflow) | (as_bits(splat(-87.f)) & underflow));
  x = as_float((as_bits(x) & ~overflow) | (as_bits(splat(88.f)) & overflow));
  v16 n = (x * 1.4426950408889634f + round_magic) - round_magic;
  v16 r = x - n * ln2_hi - n * ln2_lo;
  v16 p = splat(1.f / 5040);
  p = p * r + 1.f / 720; p = p * r + 1.f / 120; p = p * r + 1.f / 24; p = p * r + 1.f / 6;
  p = p * r + 0.5f; p = p * r + 1.f; p = p * r + 1.f;
  v16 two_n = as_float((__builtin_convertvector(n, i16) + 127) << 23);
  return as_float(as_bits(p * two_n) & ~underflow);
}

/* x[0..15] -> one vector whose lane i is the sum of x[i]'s 16 lanes, in four halving levels:
   keys 0, 1 -> [x0 lanes 0-7 + 8-15 | x1 lanes 0-7 + 8-15] -> ... -> [sum x0, sum x1, ..., sum x15] */
static inline v16 sum_each(v16 x[16]) {
  const i16 lo8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const i16 lo4 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
  const i16 lo2 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
  const i16 lo1 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  for (int i = 0; i < 8; i++)
    x[i] = __builtin_shuffle(x[2 * i], x[2 * i + 1], lo8) +
           __builtin_shuffle(x[2 * i], x[2 * i + 1], lo8 + 8);
  for (int i = 0; i < 4; i++)
    x[i] = __builtin_shuffle(x[2 * i], x[2 * i + 1], lo4) +
           __builtin_shuffle(x[2 * i], x[2 * i + 1], lo4 + 4);
  for (int i = 0; i < 2; i++)
    x[i] = __builtin_shuffle(x[2 * i], x[2 * i + 1], lo2) +
           __builtin_shuffle(x[2 * i], x[2 * i + 1], lo2 + 2);
  return __builtin_shuffle(x[0], x[1], lo1) + __builtin_shuffle(x[0], x[1], lo1 + 1);
}

/* scores[j] = scale * q . key[j] for a block of 16 keys (D % 16 == 0); lanes past n unused */
static inline void score_block(const float *q, const float *key[16], int n, int64_t D,
                               float scale, float *scores) {
  v16 part[16];
  for (int j = 0; j < 16; j++) part[j] = splat(0.f);
  for (int64_t d = 0; d < D; d += 16) {
    v16 qd = load16(q + d);
    for (int j = 0; j < 16; j++) part[j] += qd * load16(key[j] + d);
  }
  float out[16];
  store16(out, sum_each(part) * scale);
  memcpy(scores, out, n * sizeof(float));
}

static inline v16 vmax(v16 a, v16 b) {
  i16 a_wins = a > b;
  return as_float((as_bits(a) & a_wins) | (as_bits(b) & ~a_wins));
}

static inline int64_t round16(int64_t n) { return (n + 15) & ~(int64_t)15; }

/* In place: p[0:n] = softmax(p[0:n]); entries that are -inf become exactly 0; all -inf -> 0.
   p has room for round16(n) floats: the tail is padded with -inf and processed as vectors. */
static void softmax(float *p, int64_t n) {
  const int64_t n16 = round16(n);
  for (int64_t j = n; j < n16; j++) p[j] = -INFINITY;
  v16 mv = splat(-INFINITY);
  for (int64_t j = 0; j < n16; j += 16) mv = vmax(mv, load16(p + j));
  float m = -INFINITY;
  for (int i = 0; i < 16; i++) m = mv[i] > m ? mv[i] : m;
  if (m == -INFINITY) { memset(p, 0, n * sizeof(float)); return; }
  v16 total = splat(0.f);
  for (int64_t j = 0; j < n16; j += 16) {
    v16 e = exp16(load16(p + j) - m);
    total += e;
    store16(p + j, e);
  }
  v16 inv = splat(1.f / hsum(total));
  for (int64_t j = 0; j < n16; j += 16) store16(p + j, load16(p + j) * inv);
}

/* out[g][0:16 vecs] = sum_j p[g][j] * v_j[0:16 vecs] for g < heads (<= 4), vecs <= 4; where
   heads and vecs are constants the accumulators stay in registers. */
static inline __attribute__((always_inline)) void weigh_values(
    const float *kv, const int64_t *slot_row, int64_t n, int64_t row, int64_t offset,
    const float *p, int64_t lmax, float *out, int64_t D, const int heads, const int vecs) {
  v16 acc[4][4];
  for (int g = 0; g < heads; g++)
    for (int v = 0; v < vecs; v++) acc[g][v] = splat(0.f);
  for (int64_t j = 0; j < n; j++) {
    if (slot_row[j] < 0) continue;
    const float *val = kv + slot_row[j] * row + offset;
    v16 vv[4];
    for (int v = 0; v < vecs; v++) vv[v] = load16(val + 16 * v);
    for (int g = 0; g < heads; g++) {
      v16 w = splat(p[g * lmax + j]);
      for (int v = 0; v < vecs; v++) acc[g][v] += w * vv[v];
    }
  }
  for (int g = 0; g < heads; g++)
    for (int v = 0; v < vecs; v++) store16(out + g * D + 16 * v, acc[g][v]);
}

/* One request b, one KV head kh: its G query heads against the request's n live keys.
   Scores and probabilities go to probs[g * lmax + j]; D % 16 == 0. */
static void attend_group(const float *q, const float *kv, const int64_t *slot_row, int64_t n,
                         int64_t KVH, int64_t kh, int64_t G, int64_t D, float scale,
                         float *probs, int64_t lmax, float *out) {
  const int64_t row = 2 * KVH * D;                          /* floats per slot (K and V) */
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    int block = n - j0 < 16 ? (int)(n - j0) : 16;
    const float *key[16];
    for (int j = 0; j < 16; j++) {   /* padding and lanes past the block read slot 0: unused */
      int64_t slot = j < block ? slot_row[j0 + j] : 0;
      key[j] = kv + (slot < 0 ? 0 : slot) * row + kh * D;
    }
    for (int64_t g = 0; g < G; g++)
      score_block(q + g * D, key, block, D, scale, probs + g * lmax + j0);
  }
  for (int64_t j = 0; j < n; j++)
    if (slot_row[j] < 0)
      for (int64_t g = 0; g < G; g++) probs[g * lmax + j] = -INFINITY;
  for (int64_t g = 0; g < G; g++) softmax(probs + g * lmax, n);

  /* out[g] = sum_j p[g][j] * v_j, for up to 4 heads x 64 dims at a time in 16 accumulators */
  const int64_t values = (KVH + kh) * D;                   /* offset of V in a slot's row */
  for (int64_t g0 = 0; g0 < G; g0 += 4)
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
      const int heads = G - g0 < 4 ? (int)(G - g0) : 4;
      const int vecs = D - d0 < 64 ? (int)(D - d0) / 16 : 4;
      const float *p = probs + g0 * lmax;
      float *o = out + g0 * D + d0;
      if (vecs == 4) {
        switch (heads) {
          case 1: weigh_values(kv, slot_row, n, row, values + d0, p, lmax, o, D, 1, 4); break;
          case 2: weigh_values(kv, slot_row, n, row, values + d0, p, lmax, o, D, 2, 4); break;
          case 3: weigh_values(kv, slot_row, n, row, values + d0, p, lmax, o, D, 3, 4); break;
          default: weigh_values(kv, slot_row, n, row, values + d0, p, lmax, o, D, 4, 4);
        }
      } else {
        weigh_values(kv, slot_row, n, row, values + d0, p, lmax, o, D, heads, vecs);
      }
    }
}

/* q [B, H, D] with D % 16 == 0; kv [S, 2, KVH, D], one layer (K = kv[slot, 0], V = kv[slot, 1]);
   slots [B, ld_slots]: row b's first lens[b] entries are its attention view, negative = padding;
   probs: scratch [B, H, round16(lmax)] with lmax >= every lens[b]; out [B, H, D];
   mass [B, ld_mass] or NULL: += each key's attention probability summed over all H heads. */
void vtok_decode_attention(const float *q, const float *kv, const int64_t *slots,
                           int64_t ld_slots, const int64_t *lens, int64_t B, int64_t H,
                           int64_t KVH, int64_t D, float scale, float *probs, int64_t lmax,
                           float *out, float *mass, int64_t ld_mass) {
  const int64_t G = H / KVH;
  lmax = round16(lmax);
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < B; b++)
    for (int64_t kh = 0; kh < KVH; kh++)
      attend_group(q + (b * H + kh * G) * D, kv, slots + b * ld_slots, lens[b], KVH, kh, G, D,
                   scale, probs + (b * KVH + kh) * G * lmax, lmax, out + (b * H + kh * G) * D);
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

/* out [M, N] = x * rsqrt(mean(x^2) + eps) * w; N % 16 == 0 */
void vtok_rms_norm(const float *x, int64_t M, int64_t N, const float *w, float eps, float *out) {
#pragma omp parallel for schedule(static) if (M > 64)
  for (int64_t m = 0; m < M; m++) {
    const float *row = x + m * N;
    v16 ss = splat(0.f);
    for (int64_t i = 0; i < N; i += 16) ss += load16(row + i) * load16(row + i);
    v16 r = splat(1.f / sqrtf(hsum(ss) / (float)N + eps));
    for (int64_t i = 0; i < N; i += 16)
      store16(out + m * N + i, load16(row + i) * r * load16(w + i));
  }
}

/* gate_up [M, 2I] = [gate | up] -> out [M, I] = silu(gate) * up = gate / (1 + exp(-gate)) * up;
   I % 16 == 0 */
void vtok_silu_mul(const float *gate_up, int64_t M, int64_t I, float *out) {
#pragma omp parallel for schedule(static) if (M > 64)
  for (int64_t m = 0; m < M; m++) {
    const float *gate = gate_up + m * 2 * I, *up = gate + I;
    for (int64_t i = 0; i < I; i += 16) {
      v16 g = load16(gate + i);
      store16(out + m * I + i, g / (1.f + exp16(-g)) * load16(up + i));
    }
  }
}

/* Rotary embedding of this step's q and k, and the K/V cache write, in one pass:
   qkv [T, (H + 2 KVH) D] rows = [q heads | k heads | v heads]; cos, sin [T, D] for each token's
   position; x * cos + rotate_half(x) * sin, rotate_half(x) = [-x[D/2:], x[:D/2]];
   q_out [T, H, D]; kv [S, 2, KVH, D] gets rotated k and v at slot_mapping[t] (negative: none). */
void vtok_rope_write_kv(const float *qkv, int64_t T, int64_t H, int64_t KVH, int64_t D,
                        const float *cos, const float *sin, const int64_t *slot_mapping,
                        float *kv, float *q_out) {
  const int64_t half = D / 2, width = (H + 2 * KVH) * D;
#pragma omp parallel for schedule(static) if (T > 64)
  for (int64_t t = 0; t < T; t++) {
    const float *row = qkv + t * width, *c = cos + t * D, *s = sin + t * D;
    const int64_t slot = slot_mapping[t];
    float *k_dst = slot >= 0 ? kv + slot * 2 * KVH * D : NULL;
    for (int64_t h = 0; h < H + KVH; h++) {        /* q heads, then k heads */
      const float *x = row + h * D;
      float *dst = h < H ? q_out + (t * H + h) * D : k_dst ? k_dst + (h - H) * D : NULL;
      if (!dst) continue;
      for (int64_t i = 0; i < half; i++) {
        float lo = x[i] * c[i] + (-x[i + half]) * s[i];
        float hi = x[i + half] * c[i + half] + x[i] * s[i + half];
        dst[i] = lo;
        dst[i + half] = hi;
      }
    }
    if (k_dst) memcpy(k_dst + KVH * D, row + (H + KVH) * D, KVH * D * sizeof(float));
  }
}

/* ---- a whole decoder layer for a decode batch ---------------------------------------------------
   The kernels above in sequence, with no interpreter between them: at batch 16 on our machine
   the Python and torch glue around them cost about as much as the attention itself. */

typedef struct {
  int64_t hidden, heads, kv_heads, head_dim, intermediate;
  float eps, scale;
  const float *ln1, *qkv, *qkv_bias, *o, *o_bias, *ln2, *gate_up, *down;   /* GEMMs packed */
} vtok_layer;

/* floats of scratch vtok_decode_layer needs for M rows and attention views of width lmax */
int64_t vtok_decode_layer_scratch(const vtok_layer *L, int64_t M, int64_t lmax) {
  const int64_t qkv = (L->heads + 2 * L->kv_heads) * L->head_dim, hd = L->heads * L->head_dim;
  return M * (L->hidden + qkv + 2 * hd + 3 * L->intermediate + L->heads * round16(lmax));
}

/* x [M, hidden] <- the layer applied to x (residual stream, in place); this step's K/V written
   at slot_mapping; attention over views/lens as vtok_decode_attention (mass may be NULL). */
void vtok_decode_layer(const vtok_layer *L, float *x, int64_t M, const float *cos,
                       const float *sin, const int64_t *slot_mapping, float *kv,
                       const int64_t *views, int64_t ld_views, const int64_t *lens, int64_t lmax,
                       float *mass, int64_t ld_mass, float *scratch) {
  const int64_t E = L->hidden, H = L->heads, KVH = L->kv_heads, D = L->head_dim;
  const int64_t I = L->intermediate, QKV = (H + 2 * KVH) * D, HD = H * D;
  float *h = scratch, *qkv = h + M * E, *q = qkv + M * QKV, *attn = q + M * HD;
  float *gate_up = attn + M * HD, *act = gate_up + M * 2 * I, *probs = act + M * I;
  vtok_rms_norm(x, M, E, L->ln1, L->eps, h);
  vtok_packed_gemm(h, M, E, L->qkv, QKV, L->qkv_bias, NULL, qkv);
  vtok_rope_write_kv(qkv, M, H, KVH, D, cos, sin, slot_mapping, kv, q);
  vtok_decode_attention(q, kv, views, ld_views, lens, M, H, KVH, D, L->scale, probs, lmax, attn,
                        mass, ld_mass);
  vtok_packed_gemm(attn, M, HD, L->o, E, L->o_bias, x, x);
  vtok_rms_norm(x, M, E, L->ln2, L->eps, h);
  vtok_packed_gemm(h, M, E, L->gate_up, 2 * I, NULL, NULL, gate_up);
  vtok_silu_mul(gate_up, M, I, act);
  vtok_packed_gemm(act, M, I, L->down, E, NULL, x, x);
}
