// The inner loops of tiled (flash-style) attention on the CPU: one tile of query rows against
// one tile of up to kKeys keys, as two small GEMMs with fp32 accumulation and an online softmax
// between them. Scores are kept transposed, st [keys][R] (R = rows rounded up to 16), so the
// queries are transposed once per item rather than each key tile once per tile, and the
// softmax runs down the columns: 16 rows per vector (8 on AVX2), no horizontal reductions.
//
//   scores<A>(qt, R, d, k, keys, st)     st[n][r] = q[r] . k(n) for n < keys: qt = Q transposed
//                                        [d][R], k(n) key n's row of d (Strided: a copy; Blocked:
//                                        the cache's blocks read in place)
//   softmax<kPairs>(st, R, keys, ...)    st scaled, soft-capped (ScoreRule), masked (causal and
//                                        the sliding window), turned into probabilities against
//                                        each row's running reference, which trails its max by
//                                        at most 2^kLag (in place, or as bf16 pairs); alpha[r]
//                                        the factor that rescales row r's earlier output
//   rescale(alpha, R, d, o)              o[r] *= alpha[r] where alpha[r] != 1 (rarely: the
//                                        reference moves only on a tile with a much larger score)
//   soft_cap(x, cap)                     cap * tanh(x / cap) per lane (cap > 0), -inf kept
//   accumulate<A>(p, R, keys, v, d, o)   o[r] += sum_{n < keys} p[n][r] v(n), v(n) a row of d, o [R][d]
// A register block is kRows x up to 64 columns (24 accumulators, 4 operands, a broadcast). The
// GEMMs take A = F32 (fp32 FMAs) or, on CPUs with AVX512_BF16, A = Bf16Pairs (vdpbf16ps).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#if defined(__AVX512F__) || defined(__AVX512BF16__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "vec16.h"

namespace llmc_cpu::tiles {

constexpr int64_t kKeys = 64;  // keys per K/V tile: four cache blocks of 16
constexpr int kRows = 6;       // rows of a register block
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLag = 8.f;    // log2 units a row's softmax reference may trail its max (ScoreRule's softmax)

// A loaded vector held in a register: without this GCC folds the load into each of the MR
// FMAs that use it, and the GEMMs become bound by loads rather than FMAs. Only AVX-512 holds a
// 64-byte vector in one register; elsewhere no hint is given (AVX2's F32 GEMM is gemm_block8).
template <typename V>
inline V in_register(V v) {
#if defined(__AVX512F__)
  asm("" : "+v"(v));
#endif
  return v;
}

// The multiply-add of a GEMM step, per element type. F32: one fp32 FMA per element. Bf16Pairs
// (AVX512_BF16 CPUs): each uint32 holds two bf16 values of consecutive depth, and one
// vdpbf16ps adds both products (exact) to the fp32 accumulator: half the instructions.
struct F32 {
  using Elem = float;
  using Operand = Vec16;
  static Operand load(const float* p) { return load16(p); }
  static Operand broadcast(float a) { return splat(a); }
  static Vec16 step(Vec16 acc, Operand w, Operand x) { return acc + w * x; }
};

#ifdef __AVX512BF16__
struct Bf16Pairs {
  using Elem = uint32_t;
  using Operand = __m512bh;
  static Operand load(const uint32_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static Operand broadcast(uint32_t a) { return (__m512bh)_mm512_set1_epi32(static_cast<int>(a)); }
  static Vec16 step(Vec16 acc, Operand w, Operand x) { return (Vec16)_mm512_dpbf16_ps((__m512)acc, w, x); }
};
#endif

// Where row i of a GEMM operand lies. Strided: `row` elements apart from `base`. Blocked: rows of the
// paged cache read in place, 16 to a block (`row` elements apart) and the blocks at `blocks` [i / 16].
template <typename E>
struct Strided {
  const E* base;
  int64_t row;
  const E* operator()(int64_t i) const { return base + i * row; }
};

template <typename E>
struct Blocked {
  const E* const* blocks;
  int64_t row;
  const E* operator()(int64_t i) const { return blocks[i >> 4] + (i & 15) * row; }
};

// out[m][c] (+)= sum_j a(m0 + m)[j * a_step] * b(j)[c0 + 16c ..]: MR broadcast rows of `a` against NV
// vectors of each row of `b`, j < depth; `out` rows `out_row` apart.
template <typename A, int MR, int NV, bool kAccumulate, typename ARows, typename BRows>
inline void gemm_block(const ARows& a, int64_t m0, int64_t a_step, const BRows& b, int64_t c0, int64_t depth,
                       float* out, int64_t out_row) {
  const typename A::Elem* am[MR];
  for (int m = 0; m < MR; ++m) am[m] = a(m0 + m);
  Vec16 acc[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int c = 0; c < NV; ++c) acc[m][c] = kAccumulate ? load16(out + m * out_row + 16 * c) : Vec16{};
  for (int64_t j = 0; j < depth; ++j) {
    const typename A::Elem* bj = b(j) + c0;
    typename A::Operand x[NV];
    for (int c = 0; c < NV; ++c) x[c] = in_register(A::load(bj + 16 * c));
    for (int m = 0; m < MR; ++m) {
      const typename A::Operand w = A::broadcast(am[m][j * a_step]);
      for (int c = 0; c < NV; ++c) acc[m][c] = A::step(acc[m][c], w, x[c]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int c = 0; c < NV; ++c) store16(out + m * out_row + 16 * c, acc[m][c]);
}

#if defined(__AVX2__) && !defined(__AVX512F__)
// gemm_block's F32 product for AVX2's 16 registers: MR rows x 16 columns in 2 MR 8-lane accumulators
// (gemm_block's Vec16 accumulators, two registers each, spilled at every block shape).
template <int MR, bool kAccumulate, typename ARows, typename BRows>
inline void gemm_block8(const ARows& a, int64_t m0, int64_t a_step, const BRows& b, int64_t c0, int64_t depth,
                        float* out, int64_t out_row) {
  const float* am[MR];
  for (int m = 0; m < MR; ++m) am[m] = a(m0 + m);
  __m256 acc[MR][2];
  for (int m = 0; m < MR; ++m)
    for (int c = 0; c < 2; ++c)
      acc[m][c] = kAccumulate ? _mm256_loadu_ps(out + m * out_row + 8 * c) : _mm256_setzero_ps();
  for (int64_t j = 0; j < depth; ++j) {
    const float* bj = b(j) + c0;
    const __m256 x0 = _mm256_loadu_ps(bj), x1 = _mm256_loadu_ps(bj + 8);
    for (int m = 0; m < MR; ++m) {
      const __m256 w = _mm256_broadcast_ss(am[m] + j * a_step);
      acc[m][0] = _mm256_fmadd_ps(w, x0, acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(w, x1, acc[m][1]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int c = 0; c < 2; ++c) _mm256_storeu_ps(out + m * out_row + 8 * c, acc[m][c]);
}
#endif

// gemm_block over all `cols` (a multiple of 16) of b and out, 64 at a time (AVX2's F32: 16 at a time
// in gemm_block8).
template <typename A, int MR, bool kAccumulate, typename ARows, typename BRows>
inline void gemm_rows(const ARows& a, int64_t m0, int64_t a_step, const BRows& b, int64_t depth, int64_t cols,
                      float* out, int64_t out_row) {
#if defined(__AVX2__) && !defined(__AVX512F__)
  if constexpr (std::is_same_v<A, F32>) {
    for (int64_t c = 0; c < cols; c += 16) gemm_block8<MR, kAccumulate>(a, m0, a_step, b, c, depth, out + c, out_row);
    return;
  }
#endif
  int64_t c = 0;
  for (; c + 64 <= cols; c += 64)
    gemm_block<A, MR, 4, kAccumulate>(a, m0, a_step, b, c, depth, out + c, out_row);
  switch ((cols - c) / 16) {
    case 3: return gemm_block<A, MR, 3, kAccumulate>(a, m0, a_step, b, c, depth, out + c, out_row);
    case 2: return gemm_block<A, MR, 2, kAccumulate>(a, m0, a_step, b, c, depth, out + c, out_row);
    case 1: return gemm_block<A, MR, 1, kAccumulate>(a, m0, a_step, b, c, depth, out + c, out_row);
    default: return;
  }
}

// All `rows` rows of the product, kRows at a time.
template <typename A, bool kAccumulate, typename ARows, typename BRows>
inline void gemm(const ARows& a, int64_t a_step, int64_t rows, const BRows& b, int64_t depth, int64_t cols, float* out,
                 int64_t out_row) {
  int64_t m = 0;
  for (; m + kRows <= rows; m += kRows)
    gemm_rows<A, kRows, kAccumulate>(a, m, a_step, b, depth, cols, out + m * out_row, out_row);
  for (; m + 2 <= rows; m += 2) gemm_rows<A, 2, kAccumulate>(a, m, a_step, b, depth, cols, out + m * out_row, out_row);
  if (m < rows) gemm_rows<A, 1, kAccumulate>(a, m, a_step, b, depth, cols, out + m * out_row, out_row);
}

// `depth` is d for F32 and d / 2 for Bf16Pairs (qt then [d/2][R] pairs of dimensions, k
// [keys][d/2] pairs, i.e. bf16 rows as they are). `k` gives key n's row (Strided or Blocked).
template <typename A, typename KRows>
void scores(const typename A::Elem* qt, int64_t rows, int64_t depth, const KRows& k, int64_t keys, float* st) {
  gemm<A, false>(k, 1, keys, Strided<typename A::Elem>{qt, rows}, depth, rows, st, rows);
}

// `depth` is keys for F32 and keys / 2 for Bf16Pairs (p then [keys/2][R] pairs of keys, v
// [keys/2][d] pairs of keys, as pair_rows makes them). `v` gives row j of the values.
template <typename A, typename VRows>
void accumulate(const typename A::Elem* p, int64_t rows, int64_t depth, const VRows& v, int64_t d, float* o) {
  gemm<A, true>(Strided<typename A::Elem>{p, 1}, rows, rows, v, depth, d, o, d);
}

// out[i] = bf16(lo[i]) | bf16(hi[i]) << 16 for 16 lanes, rounded to nearest even (with AVX512_BF16
// by vcvtne2ps2bf16, which flushes values below 2^-126 to 0: a probability that small adds
// nothing an fp32 sum keeps).
inline void store_pairs(Vec16 lo, Vec16 hi, uint32_t* out) {
#ifdef __AVX512BF16__
  alignas(64) static constexpr uint16_t kInterleave[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                           8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15,
                                                           31};
  const __m512i halves = (__m512i)_mm512_cvtne2ps_pbh((__m512)hi, (__m512)lo);   // lo's 16, then hi's
  _mm512_storeu_si512(out, _mm512_permutexvar_epi16(_mm512_load_si512(kInterleave), halves));
#else
  Uint16 a, b;
  std::memcpy(&a, &lo, sizeof(a));
  std::memcpy(&b, &hi, sizeof(b));
  a = (a + 0x7FFFu + ((a >> 16) & 1u)) >> 16;
  b = (b + 0x7FFFu + ((b >> 16) & 1u)) & 0xFFFF0000u;
  const Uint16 pair = a | b;
  std::memcpy(out, &pair, sizeof(pair));
#endif
}

// Two rows of n floats (a multiple of 16) as one row of bf16 pairs.
inline void pair_rows(const float* lo, const float* hi, int64_t n, uint32_t* out) {
  for (int64_t i = 0; i < n; i += 16) store_pairs(load16(lo + i), load16(hi + i), out + i);
}

// tanh per lane, relative error ~3e-7 everywhere (Eigen's rational approximation; the
// exp form 1 - 2 / (e^2x + 1) loses all relative accuracy near 0).
template <typename V>
inline V tanh_of(V x) {
  const V c = V{} + 7.90531110763549805f;
  x = x > c ? c : (x < -c ? -c : x);
  const V x2 = x * x;
  V p = V{} - 2.76076847742355e-16f;
  for (const float a : {2.00018790482477e-13f, -8.60467152213735e-11f, 5.12229709037114e-08f,
                        1.48572235717979e-05f, 6.37261928875436e-04f, 4.89352455891786e-03f})
    p = p * x2 + a;
  V q = V{} + 1.19825839466702e-06f;
  for (const float b : {1.18534705686654e-04f, 2.26843463243900e-03f, 4.89352518554385e-03f}) q = q * x2 + b;
  return p * x / q;
}

// Attention-logit soft-capping, cap > 0: cap * tanh(x / cap); masked lanes (-inf) stay -inf.
inline Vec16 soft_cap(Vec16 x, float cap) {
  return x == kNegInf ? x : tanh_of(x * (1.f / cap)) * cap;
}

// What turns a q.k product into a score: times `scale`, soft-capped where softcap > 0, and,
// where window > 0, masked for keys at or before pos - window (as well as after pos).
struct ScoreRule {
  float scale, softcap;
  int64_t window;
};

// The softmax's vectors (a column's rows): Vec16, or Vec8 where the build has AVX2 and no AVX-512.
// In Vec16s there GCC took the selects apart into scalar code and moved the joined halves and the
// running sums through the stack (a prompt's attention tiles spent 42% of their time in softmax on
// the AVX2 Zen 3).
#if defined(__AVX2__) && !defined(__AVX512F__)
typedef int32_t Int8 __attribute__((vector_size(32)));
using Lanes = Vec8;
using LaneInts = Int8;
inline Lanes load_lanes(const float* p) { return load8(p); }
inline void store_lanes(float* p, Lanes v) { store8(p, v); }
inline Lanes pow2(Lanes t) { return (Lanes)pow2_of((__m256)t); }
inline Lanes lanes_max(Lanes a, Lanes b) { return (Lanes)_mm256_max_ps((__m256)a, (__m256)b); }
inline Lanes mul_sub(Lanes a, float b, Lanes c) {   // a * b - c, rounded once where the CPU has FMA
#ifdef __FMA__
  return (Lanes)_mm256_fmsub_ps((__m256)a, _mm256_set1_ps(b), (__m256)c);
#else
  return a * b - c;
#endif
}
#else
using Lanes = Vec16;
using LaneInts = Int16;
inline Lanes load_lanes(const float* p) { return load16(p); }
inline void store_lanes(float* p, Lanes v) { store16(p, v); }
inline Lanes lanes_max(Lanes a, Lanes b) { return vmax(a, b); }
#endif
constexpr int64_t kLanes = sizeof(Lanes) / sizeof(float);
inline Lanes splat_lanes(float x) { return Lanes{} + x; }

// The max of st[n * rows + 0..kLanes-1] over n < keys (a multiple of 16), four independent chains of
// vmaxps: one chain waited out vmaxps' latency for every key.
inline Lanes column_max(const float* st, int64_t rows, int64_t keys) {
  Lanes m[4] = {splat_lanes(kNegInf), splat_lanes(kNegInf), splat_lanes(kNegInf), splat_lanes(kNegInf)};
  for (int64_t n = 0; n < keys; n += 4)
    for (int i = 0; i < 4; ++i) m[i] = lanes_max(m[i], load_lanes(st + (n + i) * rows));
  return lanes_max(lanes_max(m[0], m[1]), lanes_max(m[2], m[3]));
}

// Rows r .. r + kLanes - 1 of a tile's scores in log2 units, scaled, soft-capped and masked by
// `rule` (masked lanes -inf), written back into st; returns their max per row.
inline Lanes log2_scores(float* st, int64_t rows, int64_t keys, int64_t first_key, const int32_t* pos, bool masked,
                         const ScoreRule& rule, int64_t r) {
  LaneInts last;
  std::memcpy(&last, pos, sizeof(last));
  const LaneInts edge = last - static_cast<int32_t>(rule.window > 0 ? rule.window : INT32_MAX / 2);  // keys <= edge out
  const float cap = rule.softcap, scale = rule.softcap > 0 ? rule.scale / cap : rule.scale * kLog2e;
  Lanes top = splat_lanes(kNegInf);
  for (int64_t n = 0; n < keys; ++n) {
    Lanes x = load_lanes(st + n * rows + r) * scale;
    if (cap > 0) x = tanh_of(x) * (cap * kLog2e);
    const int32_t key = static_cast<int32_t>(first_key + n);
    if (masked) x = (last < key) | (edge >= key) ? splat_lanes(kNegInf) : x;
    store_lanes(st + n * rows + r, x);
    top = lanes_max(top, x);
  }
  return top;
}

// a * b - c per lane, rounded once where the CPU has FMA.
inline Vec16 mul_sub(Vec16 a, float b, Vec16 c) {
#ifdef __AVX512F__
  return (Vec16)_mm512_fmsub_ps((__m512)a, _mm512_set1_ps(b), (__m512)c);
#else
  return a * b - c;
#endif
}

// 2^t per lane for t <= kLag (the softmax's log2 score - reference), relative error ~2e-7;
// exp_nonpositive's arithmetic without its multiply by log2 e.
inline Vec16 pow2(Vec16 t) {
#if defined(__AVX512F__) || defined(__AVX2__)
  return pow2_lanes(t);
#else
  return exp16(t * 0.6931471805599453f);
#endif
}

// Probabilities p0 and p1 of keys n and n + 1, rows r.. into st, or into pairs as bf16 pairs (kPairs:
// 16 lanes, the AVX512_BF16 tiles only; a template of L, so an AVX2 build compiles no pairs of Vec8s).
template <bool kPairs, typename L>
inline void store_probabilities(L p0, L p1, int64_t n, int64_t rows, int64_t r, float* st, uint32_t* pairs) {
  if constexpr (kPairs) {
    store_pairs(p0, p1, pairs + n / 2 * rows + r);
  } else {
    store_lanes(st + n * rows + r, p0);
    store_lanes(st + (n + 1) * rows + r, p1);
  }
}

// The online-softmax step over a tile of transposed scores st [keys][rows] whose key indices
// start at first_key, made scores by `rule`; pos[r] is row r's position (keys after it, and
// keys outside its window, are masked where `masked`). Scores are taken in log2 units (times
// log2 e) and p = 2^(score - ref[r]), where ref[r] (held in max, log2 units) is a row's running
// reference: raised to the tile's max only where that exceeds it by more than kLag, so it trails
// the row's max by at most kLag (p <= 2^kLag) and most tiles leave it, and alpha, alone (1). sum
// and alpha are [rows]; alpha[r] is the factor that rescales row r's earlier output (1 where the
// reference held or the row had seen no key); a row that has seen no visible key keeps ref -inf
// and sum 0. The probabilities go back into st, or, kPairs, into pairs [keys/2][rows] as bf16
// pairs. A tile needing neither the mask nor the softcap is read once for its max and once for
// its exps, scaled in the exps' multiply-add.
template <bool kPairs>
inline void softmax(float* st, int64_t rows, int64_t keys, int64_t first_key, const int32_t* pos, bool masked,
                    const ScoreRule& rule, float* max, float* sum, float* alpha, uint32_t* pairs) {
  const bool raw = !masked && rule.softcap <= 0;
  const float unit = raw ? rule.scale * kLog2e : 1.f;   // st's values times unit: log2 scores
  for (int64_t r = 0; r < rows; r += kLanes) {
    const Lanes top = raw ? column_max(st + r, rows, keys) * unit   // unit > 0: the products' max, as rounded
                          : log2_scores(st, rows, keys, first_key, pos + r, masked, rule, r);
    const Lanes old = load_lanes(max + r);
    const Lanes ref = top > old + kLag ? top : old;
    const Lanes a = ref == old ? splat_lanes(1.f) : (old == kNegInf ? splat_lanes(1.f) : pow2(old - ref));
    const Lanes shift = ref == kNegInf ? splat_lanes(0.f) : ref;   // no key seen yet: every p below is 0
    Lanes total{};
    for (int64_t n = 0; n < keys; n += 2) {
      const Lanes p0 = pow2(mul_sub(load_lanes(st + n * rows + r), unit, shift));
      const Lanes p1 = pow2(mul_sub(load_lanes(st + (n + 1) * rows + r), unit, shift));
      total += p0 + p1;
      store_probabilities<kPairs>(p0, p1, n, rows, r, st, pairs);
    }
    store_lanes(max + r, ref);
    store_lanes(sum + r, load_lanes(sum + r) * a + total);
    store_lanes(alpha + r, a);
  }
}

// o[r] *= alpha[r] for the rows [rows][d] whose alpha is not 1 (a tile that raised their reference).
inline void rescale(const float* alpha, int64_t rows, int64_t d, float* o) {
  for (int64_t r = 0; r < rows; ++r)
    if (alpha[r] != 1.f)
      for (int64_t j = 0; j < d; j += 16) store16(o + r * d + j, load16(o + r * d + j) * alpha[r]);
}

}  // namespace llmc_cpu::tiles
