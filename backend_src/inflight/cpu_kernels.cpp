// CPU kernels for the engine's hot path, compiled at first use by cpu_kernels.py (g++ -O3
// -march=native -fopenmp) and called through ctypes with raw pointers and element strides.
//
// paged_decode_attention: one query token per sequence against its K/V read in place from the
// paged cache through the block table (no gather copy). A KV head's query heads are handled
// together, so each K/V row is loaded and converted once for the whole group; the softmax is
// online, in float32, a tile of keys at a time. Work items are (sequence, KV head) pairs spread
// over OpenMP threads; each item is computed by one thread in a fixed order, so results do not
// depend on the thread count or the schedule.
//
// On a CPU with AMX-BF16 (Xeon Sapphire Rapids and later), bf16 attention with head dims of whole
// 32s and block sizes of whole 16s runs both products on the AMX tiles: decodes with groups of up
// to 16, padded to a power of two (decode_amx: 1.4x faster on the bench's 64-sequence layer, as fast
// as vLLM-CPU's AMX kernel) and the prefill kernel (1.7-2.3x on fresh prefills of 272 and 512 tokens).
//
// paged_prefill_attention: the sequences with several query tokens (prefill chunks), a tile of
// tokens at a time, so that each K/V row read serves the whole tile (see prefill_tile). Sized for
// AVX-512's 32 registers; without AVX-512 the engine sends prefill chunks to gather + SDPA.
//
// The code is written for 16-lane vectors (GCC vector extensions), which are AVX-512 registers
// with -march=native on such CPUs and register pairs on AVX2 ones; where GCC handles the pairs
// badly, the hot loops have AVX2 versions (splat, hsum, score_four_avx2, accumulate_avx2, and
// float32's silu8 and rms_norm_row_avx2), which compute the same sums in the same order.
//
// Also the layer's small ops, one call each where torch takes several (rms_norm, rotary,
// silu_and_mul, and rotary_write_kv: the rotations and the K/V write in one pass) and the
// sampler's argmax, rounding as the torch expressions do, and the LoRA adapters' terms of a step
// (lora_add).
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <algorithm>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define INFLIGHT_AMX 1
#endif
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// a 16-lane vector is two AVX2 registers, which GCC handles badly in places: those get AVX2 code
#define INFLIGHT_AVX2 1
#endif

namespace {

constexpr int TILE = 64;           // keys per online-softmax step (their K/V rows stay in L1)
constexpr int PREFETCH = 8;        // keys ahead to fetch K into L1
constexpr int PREFETCH_L2 = 32;    // keys ahead to fetch K and V into L2 (see fetch_ahead)
constexpr int MAX_DIM = 256;       // head_dim limit (the loader checks it)
constexpr int MAX_GROUP = 16;      // query heads per KV head limit
constexpr int MAX_LINEAR_ROWS = 32;     // linear_small_rows: two tiles of rows
// elements above which a small op splits its rows over the threads: a decode step's 64 rows of
// silu_and_mul take ~120 µs on one core and ~60 on two, where waking the team costs a few µs
constexpr int64_t PARALLEL_MIN = 16384;

typedef uint16_t bf16;

inline float to_float(float x) { return x; }
inline float to_float(bf16 x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

inline void from_float(float x, float *dst) { *dst = x; }
inline void from_float(float x, bf16 *dst) {      // round to nearest even, as torch does
    uint32_t bits;
    memcpy(&bits, &x, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) { *dst = (bf16)((bits >> 16) | 0x40); return; }
    bits += 0x7fffu + ((bits >> 16) & 1u);
    *dst = (bf16)(bits >> 16);
}

// a head's row as NC vectors of 16 floats, lanes past dim zero (GCC vector extensions: AVX-512
// registers with -march=native where the CPU has them, pairs of AVX2 registers elsewhere)
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));

inline v16f load16(const float *p) { v16f v; memcpy(&v, p, 64); return v; }

#ifdef INFLIGHT_AVX2
inline v16f from_halves(__m256 lo, __m256 hi) {
    v16f v;
    memcpy(&v, &lo, 32);
    memcpy((char *)&v + 32, &hi, 32);
    return v;
}
inline __m256 low_half(v16f v) { __m256 h; memcpy(&h, &v, 32); return h; }
inline __m256 high_half(v16f v) { __m256 h; memcpy(&h, (const char *)&v + 32, 32); return h; }
#endif

// x in every lane. Without AVX-512 GCC builds `x * vector`'s broadcast from 16 scalar stores that
// the two 32-byte loads after them cannot forward from: a stall per multiply-add, which made the
// fp32 decode layer 2x vLLM-CPU's time on a 2-core AVX2 EPYC (as fast with AVX-512)
inline v16f splat(float x) {
#ifdef INFLIGHT_AVX2
    const __m256 half = _mm256_set1_ps(x);
    return from_halves(half, half);
#else
    return (v16f){} + x;
#endif
}
inline v16f load16(const bf16 *p) {
#ifdef __AVX512F__
    // one widening load and a shift (GCC splits the generic conversion into five instructions)
    return (v16f)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
#else
    v16h h;
    memcpy(&h, p, 32);
    const v16u bits = __builtin_convertvector(h, v16u) << 16;
    v16f v;
    memcpy(&v, &bits, 64);
    return v;
#endif
}

// x rounded to bf16, 16 lanes: round to nearest even on the bits, as torch does; NaN stays a
// quiet NaN. With AVX512-BF16 one instruction does the same, except that it flushes subnormal
// inputs (|x| < 2^-126) to zero, where torch keeps them: vectors holding one take the bits' way
// (2,048 rows on 2 cores of the AMX Xeon: rms_norm with its residual 395 -> 287 µs, rotary
// 346 -> 264, silu_and_mul 1,352 -> 1,162)
inline v16h to_bf16(v16f x) {
    v16h h;
#ifdef __AVX512BF16__
    if (!_mm512_fpclass_ps_mask((__m512)x, 0x20)) {      // 0x20: subnormal, either sign
        const __m256bh rounded = _mm512_cvtneps_pbh((__m512)x);
        memcpy(&h, &rounded, 32);
        return h;
    }
#endif
    v16u bits;
    memcpy(&bits, &x, 64);
    const v16u rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    h = __builtin_convertvector((bits & 0x7fffffffu) > 0x7f800000u ? (bits >> 16) | 0x40u : rounded, v16h);
    return h;
}
// round to the dtype and back
inline v16f rounded16(v16f x, const float *) { return x; }
inline v16f rounded16(v16f x, const bf16 *) {
    const v16h h = to_bf16(x);
    return load16((const bf16 *)&h);
}
inline void store16(float *p, v16f x) { memcpy(p, &x, 64); }
inline void store16(bf16 *p, v16f x) {
    const v16h h = to_bf16(x);
    memcpy(p, &h, 32);
}
template <typename T, int NC>
inline void load_row(const T *p, int dim, v16f *row) {
    for (int c = 0; c < NC; ++c) {
        if (16 * (c + 1) <= dim) {
            row[c] = load16(p + 16 * c);
        } else {
            v16f tail = {};
            for (int d = 16 * c; d < dim; ++d) tail[d - 16 * c] = to_float(p[d]);
            row[c] = tail;
        }
    }
}

// exp of x <= 0 lane by lane (softmax arguments): Cephes' expf polynomial after reducing by
// powers of two; exactly 0 below -87 (and for -inf). N vectors at once, their operations
// interleaved, give the core N independent dependency chains: one at a time it waits on each
// multiply-add in turn (silu_and_mul: ~37 cycles a vector on Zen 5)
template <int N>
inline void exp_nonpositive(v16f (&x)[N]) {
    v16f n[N], r[N], p[N];
    for (int i = 0; i < N; ++i) {
        const v16f clamped = x[i] < -87.0f ? (v16f){} - 87.0f : x[i];
        const v16f magic = (v16f){} + 12582912.0f;          // 1.5 * 2^23: adding it rounds to an integer
        n[i] = (clamped * 1.44269504088896341f + magic) - magic;
        r[i] = clamped - n[i] * 0.693359375f + n[i] * 2.12194440e-4f;
    }
    for (int i = 0; i < N; ++i) p[i] = (v16f){} + 1.9875691500e-4f;
    for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
        for (int i = 0; i < N; ++i) p[i] = p[i] * r[i] + c;
    for (int i = 0; i < N; ++i) {
        p[i] = p[i] * r[i] * r[i] + r[i] + 1.0f;
        const v16i bits = (__builtin_convertvector(n[i], v16i) + 127) << 23;
        v16f scale;
        memcpy(&scale, &bits, 64);
        x[i] = x[i] < -87.0f ? (v16f){} : p[i] * scale;
    }
}
inline v16f exp_nonpositive(v16f x) {
    v16f one[1] = {x};
    exp_nonpositive(one);
    return one[0];
}

inline float exp_nonpositive(float x) { return exp_nonpositive((v16f){} + x)[0]; }

inline v16f exp_any(v16f x) {
    const v16f clamped = x > 88.0f ? (v16f){} + 88.0f : x;
    const v16f e = exp_nonpositive(clamped > 0.0f ? (v16f){} : clamped);
    // x > 0: exp(x) = 1 / exp(-x), exact to the polynomial's accuracy; inf past float's range
    const v16f positive = 1.0f / exp_nonpositive(clamped > 0.0f ? -clamped : (v16f){});
    return x > 88.7f ? (v16f){} + INFINITY : (x > 0.0f ? positive : e);
}

// one KV head's K (or V) row at each position of one sequence, read in place through its block-table
// row: caches [blocks, block_size, kv_heads, dim] with strides (block, slot, head). A power-of-two
// block size is split off the position with a shift and a mask: a division per row read cost a
// 64-sequence bf16 decode layer 3%
template <typename T>
struct PagedRows {
    const T *head;
    const int32_t *blocks;
    int64_t block_stride, slot_stride;
    int block_size, shift;      // shift: log2(block_size) where it is a power of two, else -1
    PagedRows(const T *cache, const int64_t *strides, const int32_t *blocks, int kv_head, int block_size)
        : head(cache + kv_head * strides[2]), blocks(blocks), block_stride(strides[0]), slot_stride(strides[1]),
          block_size(block_size), shift((block_size & (block_size - 1)) == 0 ? __builtin_ctz(block_size) : -1) {}
    const T *operator()(int pos) const {
        if (shift >= 0)
            return head + blocks[pos >> shift] * block_stride + (pos & (block_size - 1)) * slot_stride;
        return head + blocks[pos / block_size] * block_stride + (pos % block_size) * slot_stride;
    }
};

template <int LEVEL = 3, typename T>      // LEVEL: __builtin_prefetch's locality, 3 = into L1, 2 = into L2
inline void prefetch_row(const T *p, int dim) {
    for (int offset = 0; offset < dim * (int)sizeof(T); offset += 64)
        __builtin_prefetch((const char *)p + offset, 0, LEVEL);
}

// before a decode tile reads key pos: blocks sit anywhere in the pool, so the hardware prefetchers
// do not run ahead across them. K PREFETCH keys ahead and this key's V (for the pass after the
// softmax) into L1, and both PREFETCH_L2 keys ahead into L2, which has more misses in flight than
// L1: fetching further ahead into L1 alone gained under 2%, the L2 step made a 64-sequence decode
// layer 1.2-1.4x faster in both dtypes (caches flushed between calls). always_inline: GCC counts
// prefetches as no side effect, so a call made of nothing else is deleted unless inlined early.
template <typename KRow, typename VRow>
__attribute__((always_inline)) inline void fetch_ahead(KRow k_row, VRow v_row, int pos, int seq_len, int dim) {
    if (pos + PREFETCH_L2 < seq_len) {
        prefetch_row<2>(k_row(pos + PREFETCH_L2), dim);
        prefetch_row<2>(v_row(pos + PREFETCH_L2), dim);
    }
    if (pos + PREFETCH < seq_len) prefetch_row(k_row(pos + PREFETCH), dim);
    prefetch_row(v_row(pos), dim);
}

// fetch_ahead asks for the keys PREFETCH_L2 ahead of the one being read, so a sequence's first
// PREFETCH_L2 keys are never asked for: without this, decoding began with a run of misses one at a time
template <typename KRow, typename VRow>
__attribute__((always_inline)) inline void fetch_start(KRow k_row, VRow v_row, int seq_len, int dim) {
    for (int pos = 0; pos < (seq_len < PREFETCH_L2 ? seq_len : PREFETCH_L2); ++pos) {
        prefetch_row<2>(k_row(pos), dim);
        prefetch_row<2>(v_row(pos), dim);
    }
}

// lanes 0, 4, 8, 12 = the sums of a, b, c, d
inline v16f hsum4(v16f a, v16f b, v16f c, v16f d) {
    const v16u low = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const v16u high = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    const v16f ab = __builtin_shuffle(a, b, low) + __builtin_shuffle(a, b, high);
    const v16f cd = __builtin_shuffle(c, d, low) + __builtin_shuffle(c, d, high);
    v16f v = __builtin_shuffle(ab, cd, (v16u){0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27}) +
             __builtin_shuffle(ab, cd, (v16u){4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31});
    v += __builtin_shuffle(v, (v16u){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
    v += __builtin_shuffle(v, (v16u){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
    return v;
}

inline float hsum(v16f v) {
#ifdef INFLIGHT_AVX2          // GCC turns the shuffles below into lane-by-lane moves
    const __m256 s = _mm256_add_ps(low_half(v), high_half(v));
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
#else
    v += __builtin_shuffle(v, (v16u){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    v += __builtin_shuffle(v, (v16u){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
    v += __builtin_shuffle(v, (v16u){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
    v += __builtin_shuffle(v, (v16u){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
    return v[0];
#endif
}

#ifdef __AVX512BF16__
// bf16 scores with the CPU's bf16 dot product (vdpbf16ps: 32 products summed into 16 float lanes
// per instruction), reading K as stored: no conversion, half the multiply-adds
template <int NC, typename KRow, typename VRow>
inline void score_tile_bf16(const bf16 *q, int64_t q_head_stride, KRow k_row, int kv_head, int group, int dim,
                            int first, int n, int seq_len, float scale, VRow v_row, float (*scores)[TILE]) {
    constexpr int NP = (NC + 1) / 2;
    __m512i keys[TILE][NP];
    auto mask = [dim](int p) -> __mmask32 {
        const int left = dim - 32 * p;
        return left >= 32 ? 0xffffffffu : left <= 0 ? 0u : (1u << left) - 1u;
    };
    for (int t = 0; t < n; ++t) {
        fetch_ahead(k_row, v_row, first + t, seq_len, dim);
        const bf16 *row = k_row(first + t);
        for (int p = 0; p < NP; ++p) keys[t][p] = _mm512_maskz_loadu_epi16(mask(p), row + 32 * p);
    }
    for (int t = n; t < (n + 3) / 4 * 4; ++t)
        for (int p = 0; p < NP; ++p) keys[t][p] = _mm512_setzero_si512();
    for (int g = 0; g < group; ++g) {
        const bf16 *qg = q + (int64_t)(kv_head * group + g) * q_head_stride;
        __m512bh qv[NP];
        for (int p = 0; p < NP; ++p) qv[p] = (__m512bh)_mm512_maskz_loadu_epi16(mask(p), qg + 32 * p);
        for (int t = 0; t < n; t += 4) {
            v16f s[4];
            for (int i = 0; i < 4; ++i) {
                __m512 acc = _mm512_setzero_ps();
                for (int p = 0; p < NP; ++p) acc = _mm512_dpbf16_ps(acc, qv[p], (__m512bh)keys[t + i][p]);
                s[i] = (v16f)acc;
            }
            const v16f sums = hsum4(s[0], s[1], s[2], s[3]) * scale;
            for (int i = 0; i < 4; ++i) scores[g][t + i] = sums[4 * i];
        }
    }
}

// acc[g] += sum_t p[g][t] V[t] for a tile with the bf16 dot product: the probabilities rounded to
// bf16 (as torch's flash attention rounds them before its second matmul), each pair of keys'
// V rows interleaved dim by dim once per tile in L1. acc's lanes come out permuted: lane 4L+i of
// vector 2p+h holds dim 32p+8L+4h+i (`pv_lane` undoes it).
template <int NC, typename VRow>
inline void accumulate_tile_bf16(VRow v_row, int first, int n, int group, float (*scores)[TILE], v16f (*acc)[NC]) {
    constexpr int NP = NC / 2;
    __m512i pairs[TILE / 2][NC];
    for (int t = 0; t < n; t += 2) {
        const bf16 *r0 = v_row(first + t), *r1 = t + 1 < n ? v_row(first + t + 1) : r0;   // (p = 0 for t + 1)
        for (int p = 0; p < NP; ++p) {
            const __m512i a = _mm512_loadu_si512(r0 + 32 * p), b = _mm512_loadu_si512(r1 + 32 * p);
            pairs[t / 2][2 * p] = _mm512_unpacklo_epi16(a, b);
            pairs[t / 2][2 * p + 1] = _mm512_unpackhi_epi16(a, b);
        }
    }
    alignas(64) int32_t probs[TILE / 2];
    for (int g = 0; g < group; ++g) {
        for (int t = n; t < (n + 31) / 32 * 32; ++t) scores[g][t] = 0.0f;
        for (int c = 0; c < (n + 31) / 32; ++c)
            _mm512_store_si512(probs + 16 * c, (__m512i)_mm512_cvtne2ps_pbh(_mm512_load_ps(scores[g] + 32 * c + 16),
                                                                           _mm512_load_ps(scores[g] + 32 * c)));
        __m512 ag[NC];
        for (int c = 0; c < NC; ++c) ag[c] = (__m512)acc[g][c];
        for (int t = 0; t < (n + 1) / 2; ++t) {
            const __m512bh pair = (__m512bh)_mm512_set1_epi32(probs[t]);
            for (int c = 0; c < NC; ++c) ag[c] = _mm512_dpbf16_ps(ag[c], (__m512bh)pairs[t][c], pair);
        }
        for (int c = 0; c < NC; ++c) acc[g][c] = (v16f)ag[c];
    }
}
#endif

#ifdef INFLIGHT_AVX2
// Without AVX-512, GCC holds the decode loops' 16-lane accumulators as register pairs that it moves
// through general-purpose registers and the stack: these two loops take the same float rows as
// 8-lane AVX2 vectors (a 64-sequence decode layer, 2 cores of an AVX2 EPYC: fp32 6.5 -> 4.1 ms, bf16
// 6.4 -> 3.7 ms, where vLLM-CPU's kernel takes 4.1 and 4.2).
// Four keys' scores against one query head; q and the rows are zero past dim.
inline void score_four_avx2(const float *q, const float *k0, const float *k1, const float *k2, const float *k3,
                            int chunks, float *out) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps(), s2 = _mm256_setzero_ps(), s3 = _mm256_setzero_ps();
    for (int c = 0; c < chunks; ++c) {
        const __m256 x = _mm256_loadu_ps(q + 8 * c);
        s0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k0 + 8 * c), s0);
        s1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k1 + 8 * c), s1);
        s2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k2 + 8 * c), s2);
        s3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k3 + 8 * c), s3);
    }
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(s0, s1), _mm256_hadd_ps(s2, s3));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}

// acc[0, 8M) += sum over t < n of p[t] * rows[t][offset, offset + 8M), the M accumulators in registers
template <int M>
inline void accumulate_block_avx2(float *acc, const float *p, const float *const *rows, int offset, int n) {
    __m256 a[M];
    for (int j = 0; j < M; ++j) a[j] = _mm256_loadu_ps(acc + 8 * j);
    for (int t = 0; t < n; ++t) {
        const __m256 pt = _mm256_broadcast_ss(p + t);
        const float *r = rows[t] + offset;
        for (int j = 0; j < M; ++j) a[j] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(r + 8 * j), a[j]);
    }
    for (int j = 0; j < M; ++j) _mm256_storeu_ps(acc + 8 * j, a[j]);
}

template <int CHUNKS>
inline void accumulate_avx2(float *acc, const float *p, const float *const *rows, int n, int offset = 0) {
    if constexpr (CHUNKS > 8) {
        accumulate_block_avx2<8>(acc, p, rows, offset, n);
        accumulate_avx2<CHUNKS - 8>(acc + 64, p, rows, n, offset + 64);
    } else {
        accumulate_block_avx2<CHUNKS>(acc, p, rows, offset, n);
    }
}

alignas(64) static const float ZERO_ROW[MAX_DIM] = {};     // a tile's padding keys
#endif

inline int pv_lane(int d) {      // dim d's place in accumulate_tile_bf16's permuted accumulators
    const int r = d % 32;
    return (d / 32 * 2 + r % 8 / 4) * 16 + r / 8 * 4 + r % 4;
}

template <typename T, int NC>
void decode_one(const T *q, int64_t q_head_stride, const T *k_cache, const T *v_cache,
                const int64_t *k_strides, const int64_t *v_strides, T *out, int64_t out_head_stride,
                const int32_t *blocks, int seq_len, int kv_head, int group, int dim, int block_size,
                float scale) {
    // a tile's K and V rows in float32, converted once and then read from L1 by every query head
    v16f qf[MAX_GROUP][NC], acc[MAX_GROUP][NC], rows[TILE][NC];
    alignas(64) float scores[MAX_GROUP][TILE];
    float running_max[MAX_GROUP], running_sum[MAX_GROUP];
    for (int g = 0; g < group; ++g) {
        load_row<T, NC>(q + (int64_t)(kv_head * group + g) * q_head_stride, dim, qf[g]);
        for (int c = 0; c < NC; ++c) { qf[g][c] *= scale; acc[g][c] = (v16f){}; }
        running_max[g] = -INFINITY;
        running_sum[g] = 0.0f;
    }
    // bf16 rows of whole 32-dim halves: the probabilities times V with the bf16 dot product
    bool pv_bf16 = false;
#ifdef __AVX512BF16__
    pv_bf16 = std::is_same_v<T, bf16> && dim == 16 * NC && NC % 2 == 0;
#endif
    const PagedRows<T> k_row(k_cache, k_strides, blocks, kv_head, block_size);
    const PagedRows<T> v_row(v_cache, v_strides, blocks, kv_head, block_size);
    fetch_start(k_row, v_row, seq_len, dim);
#ifdef INFLIGHT_AVX2
    // the tile's K (then V) rows: float32 rows of whole 16-lane chunks where they are in the cache,
    // the others converted into `rows` (reading in place took a 64-sequence fp32 decode layer from
    // 6.3 to 5.2 ms)
    const float *row_at[TILE];
    const bool in_place = std::is_same_v<T, float> && dim == 16 * NC;
#endif
    for (int first = 0; first < seq_len; first += TILE) {
        const int n = seq_len - first < TILE ? seq_len - first : TILE;
#ifdef INFLIGHT_AVX2
        auto float_row = [&](const PagedRows<T> &paged, int t) -> const float * {     // the tile's row t
            if (in_place) return (const float *)paged(first + t);
            load_row<T, NC>(paged(first + t), dim, rows[t]);
            return (const float *)rows[t];
        };
#endif
#ifdef __AVX512BF16__
        if constexpr (std::is_same_v<T, bf16>) {
            score_tile_bf16<NC>(q, q_head_stride, k_row, kv_head, group, dim, first, n, seq_len, scale, v_row, scores);
        } else
#endif
        {
        // scores four keys at a time, so one joint reduction yields four sums
#ifdef INFLIGHT_AVX2
        for (int t = 0; t < n; ++t) {
            fetch_ahead(k_row, v_row, first + t, seq_len, dim);
            row_at[t] = float_row(k_row, t);
        }
        for (int t = n; t < (n + 3) / 4 * 4; ++t) row_at[t] = ZERO_ROW;
        for (int g = 0; g < group; ++g) {
            const float *qg = (const float *)qf[g];
            for (int t = 0; t < n; t += 4)
                score_four_avx2(qg, row_at[t], row_at[t + 1], row_at[t + 2], row_at[t + 3], 2 * NC, &scores[g][t]);
        }
#else
        for (int t = 0; t < n; ++t) {
            fetch_ahead(k_row, v_row, first + t, seq_len, dim);
            load_row<T, NC>(k_row(first + t), dim, rows[t]);
        }
        for (int t = n; t < (n + 3) / 4 * 4; ++t)
            for (int c = 0; c < NC; ++c) rows[t][c] = (v16f){};
        for (int g = 0; g < group; ++g) {
            v16f qg[NC];
            for (int c = 0; c < NC; ++c) qg[c] = qf[g][c];
            for (int t = 0; t < n; t += 4) {
                v16f s[4];
                for (int i = 0; i < 4; ++i) {
                    s[i] = qg[0] * rows[t + i][0];
                    for (int c = 1; c < NC; ++c) s[i] += qg[c] * rows[t + i][c];
                }
                const v16f sums = hsum4(s[0], s[1], s[2], s[3]);
                for (int i = 0; i < 4; ++i) scores[g][t + i] = sums[4 * i];
            }
        }
#endif
        }
        const int chunks = (n + 15) / 16;
        for (int g = 0; g < group; ++g) {
            v16f *row_scores = (v16f *)scores[g];
            for (int t = n; t < 16 * chunks; ++t) scores[g][t] = -INFINITY;
            v16f maxes = row_scores[0];
            for (int c = 1; c < chunks; ++c) maxes = row_scores[c] > maxes ? row_scores[c] : maxes;
            float tile_max = maxes[0];
            for (int i = 1; i < 16; ++i) tile_max = maxes[i] > tile_max ? maxes[i] : tile_max;
            const float new_max = tile_max > running_max[g] ? tile_max : running_max[g];
            const float correction = running_max[g] == -INFINITY ? 0.0f : exp_nonpositive(running_max[g] - new_max);
            v16f sums = {};
            for (int c = 0; c < chunks; ++c) {
                row_scores[c] = exp_nonpositive(row_scores[c] - new_max);
                sums += row_scores[c];
            }
            running_sum[g] = running_sum[g] * correction + hsum(sums);
            running_max[g] = new_max;
            if (correction != 1.0f)
                for (int c = 0; c < NC; ++c) acc[g][c] *= splat(correction);
        }
#ifdef __AVX512BF16__
        if constexpr (std::is_same_v<T, bf16> && NC % 2 == 0) {
            if (pv_bf16) {
                accumulate_tile_bf16<NC>(v_row, first, n, group, scores, acc);
                continue;
            }
        }
#endif
#ifdef INFLIGHT_AVX2
        for (int t = 0; t < n; ++t) row_at[t] = float_row(v_row, t);
        for (int g = 0; g < group; ++g) accumulate_avx2<2 * NC>((float *)acc[g], scores[g], row_at, n);
#else
        for (int t = 0; t < n; ++t) load_row<T, NC>(v_row(first + t), dim, rows[t]);
        for (int g = 0; g < group; ++g) {
            v16f ag[NC];
            for (int c = 0; c < NC; ++c) ag[c] = acc[g][c];
            for (int t = 0; t < n; ++t) {
                const v16f p = splat(scores[g][t]);
                for (int c = 0; c < NC; ++c) ag[c] += p * rows[t][c];
            }
            for (int c = 0; c < NC; ++c) acc[g][c] = ag[c];
        }
#endif
    }
    for (int g = 0; g < group; ++g) {
        T *dst = out + (int64_t)(kv_head * group + g) * out_head_stride;
        const float inv = 1.0f / running_sum[g];
        const float *lanes = (const float *)acc[g];
        for (int d = 0; d < dim; ++d) from_float(lanes[pv_bf16 ? pv_lane(d) : d] * inv, dst + d);
    }
}

#ifdef INFLIGHT_AMX
// ---- bf16 decode on the AMX tiles (a CPU with AMX-BF16, e.g. Xeon Sapphire Rapids and later)
// Both products of a sequence's decode run as tile matrix products, in two passes over its keys:
// - scores: K read in place as the A operand (16 keys of one block x 32 dims a tile: hence block
//   sizes of whole 16s), against the KV head's query heads laid out once as B (pairs of dims x
//   heads); each 16 x group tile of scores goes key-major to a per-thread buffer;
// - one softmax over the whole row in float32 (no online rescaling);
// - P V: the probabilities rounded to bf16 (as the vdpbf16ps path and torch's flash attention
//   round them) as A (heads x 32 keys), against V's rows interleaved by pairs of keys in L1 as B
//   (16 pairs x 16 dims, in pv_lane order), into up to four C tiles held across the keys.
// The query group rides in the tiles' N (scores) or M (P V) dimension, so with group 4 a product
// uses a quarter of a tile; it still beats the vector dot products, whose bf16 K/V rows had to be
// reduced (scores) or interleaved and broadcast (P V) row by row.
struct alignas(64) TileConfig {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
    void set(int tile, int rows_, int bytes) { rows[tile] = (uint8_t)rows_; colsb[tile] = (uint16_t)bytes; }
};

bool amx_permitted() {      // Linux hands a process the tiles' state only on request
    static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return ok;
}

bool amx_on = true;         // inflight_amx_tiles(0): the benchmark times the vector code beside the tiles

// both kernels: 32 dims a tile row, 16 keys of one block a tile
inline bool amx_fits(int dim, int block_size) {
    return amx_on && dim % 32 == 0 && block_size % 16 == 0 && amx_permitted();
}

inline bool amx_decode_fits(int group, int dim, int block_size) {
    return group <= 16 && amx_fits(dim, block_size);
}

// each lane of x (lane l holds head l % group) combined with the lanes of its head: max or sum
template <bool MAX>
inline __m512 across_head_lanes(__m512 x, int group) {
    for (int step = group; step < 16; step *= 2) {
        const __m512i rotate = _mm512_and_si512(_mm512_add_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7,
                                                                                  6, 5, 4, 3, 2, 1, 0),
                                                                 _mm512_set1_epi32(step)), _mm512_set1_epi32(15));
        const __m512 other = _mm512_permutexvar_ps(rotate, x);
        x = MAX ? _mm512_max_ps(x, other) : _mm512_add_ps(x, other);
    }
    return x;
}

// the registers d[0, group) hold a chunk's bf16 probabilities key-major (key k's head h at k * group
// + h); they come out head-major, head bitreverse(i) of 32 keys in d[i]: log2(group) rounds of
// splitting each run of registers into its even and its odd elements
inline void split_heads(__m512i *d, int group) {
    const __m512i even = _mm512_set_epi16(62, 60, 58, 56, 54, 52, 50, 48, 46, 44, 42, 40, 38, 36, 34, 32, 30, 28,
                                          26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_add_epi16(even, _mm512_set1_epi16(1));
    __m512i split[MAX_GROUP];
    for (int run = group; run > 1; run /= 2) {
        for (int first = 0; first < group; first += run)
            for (int j = 0; j < run / 2; ++j) {
                const __m512i a = d[first + 2 * j], b = d[first + 2 * j + 1];
                split[first + j] = _mm512_permutex2var_epi16(a, even, b);
                split[first + run / 2 + j] = _mm512_permutex2var_epi16(a, odd, b);
            }
        for (int i = 0; i < group; ++i) d[i] = split[i];
    }
}

inline int bit_reverse(int i, int group) {
    int r = 0;
    for (int bit = 1; bit < group; bit *= 2) r = r * 2 + (i & bit ? 1 : 0);
    return r;
}

// the KV heads [first_head, first_head + heads) of one sequence: the scores pass reads each 16 keys'
// K for all those heads at once, so the rows run through the block's slots in order
void decode_amx(const bf16 *q, int64_t q_head_stride, const bf16 *k_cache, const bf16 *v_cache,
                const int64_t *k_strides, const int64_t *v_strides, bf16 *out, int64_t out_head_stride,
                const int32_t *blocks, int seq_len, int first_head, int heads, int group, int dim, int block_size,
                float scale) {
    const PagedRows<bf16> k_row(k_cache, k_strides, blocks, first_head, block_size);
    const int keys = (seq_len + 31) / 32 * 32;
    // the tiles' and lanes' query heads: the group, padded to a power of two with heads of zero
    // queries (Qwen2.5's 7 and 6 run as 8), whose outputs are never written
    int padded = 1;
    while (padded < group) padded *= 2;
    const int64_t row_scores = (int64_t)keys * padded;         // one KV head's
    thread_local std::vector<float> score_buffer;
    thread_local std::vector<uint32_t> q_buffer;
    if ((int64_t)score_buffer.size() < heads * row_scores) score_buffer.resize(heads * row_scores);
    if ((int)q_buffer.size() < heads * dim / 32 * 256) q_buffer.resize(heads * dim / 32 * 256);
    float *scores = score_buffer.data();       // [head][key][query head]

    // the query heads as B tiles: [head][32 dims][pair of dims][query head]
    uint32_t (*q_pairs)[16][16] = (uint32_t (*)[16][16])q_buffer.data();
    for (int hh = 0; hh < heads; ++hh)
        for (int c = 0; c < dim / 32; ++c)
            for (int r = 0; r < 16; ++r)
                for (int g = 0; g < padded; ++g) {
                    if (g < group)
                        memcpy(&q_pairs[hh * dim / 32 + c][r][g],
                               q + (int64_t)((first_head + hh) * group + g) * q_head_stride + 32 * c + 2 * r, 4);
                    else
                        q_pairs[hh * dim / 32 + c][r][g] = 0;
                }
    // scores: tile 0 the query heads (B), tile 1 16 keys' K (A), tile 2 their scores (C)
    TileConfig config;
    config.set(0, 16, 4 * padded);
    config.set(1, 16, 64);
    config.set(2, 16, 4 * padded);
    _tile_loadconfig(&config);
    const int64_t k_row_bytes = k_row.slot_stride * (int64_t)sizeof(bf16);
    for (int first = 0; first < seq_len; first += 16) {
        for (int hh = 0; hh < heads; ++hh) {
            for (int ahead = first + PREFETCH_L2; ahead < first + PREFETCH_L2 + 16 && ahead < seq_len; ++ahead)
                prefetch_row<2>(k_row(ahead) + hh * k_strides[2], dim);
        }
        for (int hh = 0; hh < heads; ++hh) {
            const bf16 *k = k_row(first) + hh * k_strides[2];
            _tile_zero(2);
            for (int c = 0; c < dim / 32; ++c) {
                _tile_loadd(0, q_pairs[hh * dim / 32 + c], 64);
                _tile_loadd(1, k + 32 * c, k_row_bytes);
                _tile_dpbf16ps(2, 1, 0);
            }
            _tile_stored(2, scores + hh * row_scores + (int64_t)first * padded, 4 * padded);
        }
    }
    // then per KV head the softmax, and P V: tile 0 a chunk's probabilities (A), tiles 1 and 6 V's
    // pairs of keys (B), tiles 2-5 the output's 16-dim columns (C), over 64 dims at a time
    config = TileConfig();
    config.set(0, padded, 64);
    config.set(1, 16, 64);
    config.set(6, 16, 64);
    for (int t = 2; t < 6; ++t) config.set(t, padded, 64);
    _tile_loadconfig(&config);
    alignas(64) float acc[MAX_DIM / 16][16][16];        // [16 dims, pv_lane order][query head][dim]
    // a chunk's operands are built with vector stores and read back by tile loads, which wait for those
    // stores to reach L1: the tiles take chunk i - 1's operands while chunk i's are being built
    alignas(64) bf16 probs[2][MAX_GROUP][32];
    alignas(64) __m512i pairs[2][4][16];                 // [16 dims][pair of keys]
    for (int hh = 0; hh < heads; ++hh) {
        const PagedRows<bf16> v_row(v_cache, v_strides, blocks, first_head + hh, block_size);
        float *s = scores + hh * row_scores;
        // the keys past seq_len (of the last block's slots, or never written) get no weight
        for (int64_t i = (int64_t)seq_len * padded; i < row_scores; ++i) s[i] = -INFINITY;
        // softmax over each query head's keys, lane l of every vector holding query head l % padded
        __m512 high = _mm512_set1_ps(-INFINITY);
        for (int64_t i = 0; i < row_scores; i += 16) high = _mm512_max_ps(high, _mm512_loadu_ps(s + i));
        high = _mm512_mul_ps(across_head_lanes<true>(high, padded), _mm512_set1_ps(scale));
        v16f sums = {};
        for (int64_t i = 0; i < row_scores; i += 32) {
            v16f p[2] = {(v16f)_mm512_fmsub_ps(_mm512_loadu_ps(s + i), _mm512_set1_ps(scale), high),
                         (v16f)_mm512_fmsub_ps(_mm512_loadu_ps(s + i + 16), _mm512_set1_ps(scale), high)};
            exp_nonpositive<2>(p);
            _mm512_storeu_ps(s + i, (__m512)p[0]);
            _mm512_storeu_ps(s + i + 16, (__m512)p[1]);
            sums += p[0] + p[1];
        }
        const v16f totals = (v16f)across_head_lanes<false>((__m512)sums, padded);
        for (int first_dim = 0; first_dim < dim; first_dim += 64) {
            const int tiles = dim - first_dim >= 64 ? 4 : 2;
            auto multiply = [&](int buffer) {
                _tile_loadd(0, probs[buffer], 64);
                _tile_loadd(1, pairs[buffer][0], 64);
                _tile_dpbf16ps(2, 0, 1);
                _tile_loadd(6, pairs[buffer][1], 64);
                _tile_dpbf16ps(3, 0, 6);
                if (tiles == 4) {
                    _tile_loadd(1, pairs[buffer][2], 64);
                    _tile_dpbf16ps(4, 0, 1);
                    _tile_loadd(6, pairs[buffer][3], 64);
                    _tile_dpbf16ps(5, 0, 6);
                }
            };
            _tile_zero(2);
            _tile_zero(3);
            _tile_zero(4);
            _tile_zero(5);
            for (int first = 0; first < keys; first += 32) {
                const int buffer = first / 32 % 2;
                for (int ahead = first + 32; ahead < first + 64 && ahead < seq_len; ++ahead)
                    prefetch_row<2>(v_row(ahead), dim);
                __m512i d[MAX_GROUP];
                const float *p = s + (int64_t)first * padded;
                for (int i = 0; i < padded; ++i)
                    d[i] = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(p + 32 * i + 16), _mm512_loadu_ps(p + 32 * i));
                split_heads(d, padded);
                for (int i = 0; i < padded; ++i) _mm512_store_si512(probs[buffer][bit_reverse(i, padded)], d[i]);
                for (int r = 0; r < 16; ++r) {
                    const int key = first + 2 * r;
                    const bf16 *row0 = key < seq_len ? v_row(key) + first_dim : nullptr;
                    const bf16 *row1 = key + 1 < seq_len ? v_row(key + 1) + first_dim : nullptr;
                    for (int c = 0; c < tiles / 2; ++c) {
                        const __m512i a = row0 ? _mm512_loadu_si512(row0 + 32 * c) : _mm512_setzero_si512();
                        const __m512i b = row1 ? _mm512_loadu_si512(row1 + 32 * c) : _mm512_setzero_si512();
                        pairs[buffer][2 * c][r] = _mm512_unpacklo_epi16(a, b);
                        pairs[buffer][2 * c + 1][r] = _mm512_unpackhi_epi16(a, b);
                    }
                }
                if (first > 0) multiply(1 - buffer);
            }
            multiply((keys / 32 - 1) % 2);
            _tile_stored(2, acc[first_dim / 16], 64);
            _tile_stored(3, acc[first_dim / 16 + 1], 64);
            if (tiles == 4) {
                _tile_stored(4, acc[first_dim / 16 + 2], 64);
                _tile_stored(5, acc[first_dim / 16 + 3], 64);
            }
        }
        for (int g = 0; g < group; ++g) {
            bf16 *dst = out + (int64_t)((first_head + hh) * group + g) * out_head_stride;
            const float inv = 1.0f / totals[g];
            for (int d = 0; d < dim; ++d) {
                const int lane = pv_lane(d);
                from_float(acc[lane / 16][g][lane % 16] * inv, dst + d);
            }
        }
    }
    _tile_release();
}

// ---- bf16 linears of up to 32 rows on the AMX tiles (decode steps of up to 32 sequences)
// y = x W^T (+ bias), W in the layout oneDNN prepacks it in on such a CPU (AB16b32a2b, what
// torch.ops.mkldnn._reorder_linear_weight returns): [N/32][K/32] blocks of 16 pairs of k x 32 n x 2,
// so a block's two 16-column halves are B tiles with rows 128 bytes apart. oneDNN spends ~15 µs more
// a call at these sizes (a [1, 512] x [512, 512] linear: 29 against 14 µs on 2 cores of the AMX
// Xeon). The sums run as oneDNN's do here (K in steps of 32 into a zeroed tile, the bias added in
// float32, one rounding), so the results are its bit for bit, which packed_linear.py checks on each
// layer; from 40 rows on oneDNN sums otherwise.
void linear_small_rows(const bf16 *x, int64_t x_stride, const bf16 *weight, const bf16 *bias, bf16 *y,
                       int64_t y_stride, int rows, int out_features, int in_features, int threads) {
    const int k_blocks = in_features / 32, n_blocks = out_features / 32;
    const int first = std::min(rows, 16), second = rows - first;       // rows of the two row tiles
#pragma omp parallel num_threads(std::min(threads, n_blocks))
    {
        // tiles 0-3 the sums (C): the first row tile's two 16-column halves, then the second's; 4 and
        // 5 the row tiles (A); 6 and 7 W's halves (B)
        TileConfig config;
        config.set(0, first, 64);
        config.set(1, first, 64);
        config.set(4, first, 64);
        if (second) {
            config.set(2, second, 64);
            config.set(3, second, 64);
            config.set(5, second, 64);
        }
        config.set(6, 16, 64);
        config.set(7, 16, 64);
        _tile_loadconfig(&config);
        alignas(64) float sums[4][16][16];
        const int64_t row_bytes = x_stride * (int64_t)sizeof(bf16);
#pragma omp for schedule(static)
        for (int n = 0; n < n_blocks; ++n) {
            const bf16 *w = weight + (int64_t)n * k_blocks * 1024;
            _tile_zero(0);
            _tile_zero(1);
            if (second) {
                _tile_zero(2);
                _tile_zero(3);
            }
            for (int k = 0; k < k_blocks; ++k) {
                _tile_loadd(4, x + 32 * k, row_bytes);
                _tile_loadd(6, w + (int64_t)k * 1024, 128);
                _tile_loadd(7, w + (int64_t)k * 1024 + 32, 128);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                if (second) {
                    _tile_loadd(5, x + 16 * x_stride + 32 * k, row_bytes);
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_dpbf16ps(3, 5, 7);
                }
            }
            _tile_stored(0, sums[0], 64);
            _tile_stored(1, sums[1], 64);
            if (second) {
                _tile_stored(2, sums[2], 64);
                _tile_stored(3, sums[3], 64);
            }
            const __m512 low_bias = bias ? (__m512)load16(bias + 32 * n) : _mm512_setzero_ps();
            const __m512 high_bias = bias ? (__m512)load16(bias + 32 * n + 16) : _mm512_setzero_ps();
            for (int r = 0; r < rows; ++r) {
                const float *low = sums[r / 16 * 2][r % 16], *high = sums[r / 16 * 2 + 1][r % 16];
                _mm512_storeu_si512(y + r * y_stride + 32 * n,
                                    (__m512i)_mm512_cvtne2ps_pbh(_mm512_add_ps(_mm512_load_ps(high), high_bias),
                                                                 _mm512_add_ps(_mm512_load_ps(low), low_bias)));
            }
        }
        _tile_release();
    }
}
#endif

template <typename T>
void decode_dispatch(const T *q, int64_t q_head_stride, const T *k_cache, const T *v_cache,
                     const int64_t *k_strides, const int64_t *v_strides, T *out, int64_t out_head_stride,
                     const int32_t *blocks, int seq_len, int first_head, int heads, int group, int dim,
                     int block_size, float scale) {
#ifdef INFLIGHT_AMX
    if constexpr (std::is_same_v<T, bf16>) {
        if (amx_decode_fits(group, dim, block_size)) {
            decode_amx(q, q_head_stride, k_cache, v_cache, k_strides, v_strides, out, out_head_stride, blocks,
                       seq_len, first_head, heads, group, dim, block_size, scale);
            return;
        }
    }
#endif
#define INFLIGHT_DECODE(NC) for (int kv_head = first_head; kv_head < first_head + heads; ++kv_head) \
    decode_one<T, NC>(q, q_head_stride, k_cache, v_cache, k_strides, v_strides, out, \
                                              out_head_stride, blocks, seq_len, kv_head, group, dim, block_size, scale)
    switch ((dim + 15) / 16) {
        case 1: INFLIGHT_DECODE(1); break;
        case 2: INFLIGHT_DECODE(2); break;
        case 3: INFLIGHT_DECODE(3); break;
        case 4: INFLIGHT_DECODE(4); break;
        case 5: INFLIGHT_DECODE(5); break;
        case 6: INFLIGHT_DECODE(6); break;
        case 7: INFLIGHT_DECODE(7); break;
        case 8: INFLIGHT_DECODE(8); break;
        case 9: case 10: case 11: case 12: INFLIGHT_DECODE(12); break;
        default: INFLIGHT_DECODE(16); break;
    }
#undef INFLIGHT_DECODE
}

// q [tokens, heads, dim] and out alike (strides: token, head; the last dim contiguous);
// caches [blocks, block_size, kv_heads, dim] with strides (block, slot, head);
// cu_seqlens_q [num_seqs + 1], seq_lens [num_seqs], block_table [num_seqs, *] (row stride given).
// Only sequences with exactly one query token and at least one key are computed; the others are left
// to the caller (no key: the tiles' loop would start at block -1).
template <typename T>
void paged_decode_attention(const T *q, const int64_t *q_strides, const T *k_cache, const int64_t *k_strides,
                            const T *v_cache, const int64_t *v_strides, T *out, const int64_t *out_strides,
                            const int32_t *cu_seqlens_q, const int32_t *seq_lens, const int32_t *block_table,
                            int64_t block_table_stride, int num_seqs, int num_heads, int num_kv_heads, int dim,
                            int block_size, float scale, int num_threads) {
    const int group = num_heads / num_kv_heads;
    // A work item is a sequence with all its KV heads, one after the other, where there are enough
    // sequences to share out: a block's slots hold every KV head side by side, so the later heads
    // read what the first brought near (a 64-sequence decode layer, 2 cores of an AVX2 EPYC: fp32
    // 6.3 -> 5.2 ms, bf16 4.3 -> 4.0 ms). With few sequences each KV head is an item, to keep the
    // threads busy.
    const int heads_per_item = num_seqs >= 4 * num_threads ? num_kv_heads : 1;
    const int64_t items = (int64_t)num_seqs * (num_kv_heads / heads_per_item);
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t item = 0; item < items; ++item) {
        const int seq = (int)(item * heads_per_item / num_kv_heads);
        const int first_head = (int)(item * heads_per_item % num_kv_heads);
        const int token = cu_seqlens_q[seq];
        if (cu_seqlens_q[seq + 1] - token != 1 || seq_lens[seq] < 1) continue;
        decode_dispatch(q + token * q_strides[0], q_strides[1], k_cache, v_cache, k_strides, v_strides,
                        out + token * out_strides[0], out_strides[1], block_table + seq * block_table_stride,
                        seq_lens[seq], first_head, heads_per_item, group, dim, block_size, scale);
    }
}

// ---- prefill chunks: many query tokens of one sequence at a time
// A work item is a tile of a chunk's consecutive query tokens with all the query heads of one KV
// head (up to PREFILL_ROWS rows) against the keys up to the tile's last position, vectorised over
// the rows, 16 to a register: Q is transposed once per item, and each K and V element, read in
// place and as stored, is broadcast against 16 rows at once. A context row is loaded once per tile
// instead of once per query token (as the decode layout above would), and the arithmetic runs as
// a small matrix product. bf16 with AVX512-BF16 (PAIRS) takes both products with the bf16 dot
// product: Q as pairs of dims against K pairs; the probabilities, rounded to bf16 as torch's flash
// attention rounds them, as pairs of keys against V pairs.
constexpr int PREFILL_ROWS = 64;   // rows of a work item: tokens x the KV head's query heads
constexpr int PREFILL_KEYS = 32;   // keys per online-softmax step
static_assert(PREFILL_ROWS >= MAX_GROUP, "a work item holds at least one token's query heads");
#ifdef __AVX512F__
constexpr int PREFILL_TILE_ROWS = PREFILL_ROWS;
#else
// without AVX-512 a 16-lane vector is two of the 16 AVX2 registers: the 4 x RV accumulators of more
// than one row vector spill to the stack on every product (a 512-token prefill 5x gather + SDPA's
// time with 64 rows on a 2-core AVX2 EPYC)
constexpr int PREFILL_TILE_ROWS = 16;
#endif
static_assert(PREFILL_TILE_ROWS >= MAX_GROUP, "a work item holds at least one token's query heads");

// keeps a loaded vector in its register: GCC otherwise loads it again from L1 for each of the four
// products that use it, and the loads, not the products, become the limit (without AVX-512 a
// 16-lane vector is two registers, and the hint is left out)
template <typename V>
inline void in_register(V &x) {
#ifdef __AVX512F__
    asm("" : "+v"(x));
#endif
}

#ifdef __AVX512BF16__
// a[i][v] += sum over steps j < count of rows[j] (16 rows' bf16 pairs per vector v) times the pair
// pair(j, i), broadcast: four outer-product columns at once with the bf16 dot product
template <int RV, typename Pair>
inline void dot_four_bf16(__m512 (*a)[RV], const uint32_t (*rows)[PREFILL_ROWS], int count, Pair pair) {
    for (int j = 0; j < count; ++j) {
        __m512bh r[RV];
        for (int v = 0; v < RV; ++v) {
            r[v] = (__m512bh)_mm512_load_si512(&rows[j][16 * v]);
            in_register(r[v]);
        }
        for (int i = 0; i < 4; ++i) {
            const __m512bh b = (__m512bh)_mm512_set1_epi32(pair(j, i));
            for (int v = 0; v < RV; ++v) a[i][v] = _mm512_dpbf16_ps(a[i][v], r[v], b);
        }
    }
}
#endif

#ifdef INFLIGHT_AMX
// the 16 x 16 32-bit elements of rows[i][0, 16) transposed into out[j][i] (4 rounds of shuffles)
inline void transpose16(const uint32_t (*rows)[MAX_DIM], uint32_t (*out)[16]) {
    __m512i r[16], t[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_load_si512(rows[i]);
    for (int i = 0; i < 16; i += 2) {          // in each 128-bit lane, pairs of rows interleaved
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {          // r[i + c]: column 4L + c of rows i..i+3, lane L
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int h = 0; h < 16; h += 8)            // lanes 0, 2 then 1, 3 of row groups i and i + 4
        for (int c = 0; c < 4; ++c) {
            t[h + c] = _mm512_shuffle_i32x4(r[h + c], r[h + 4 + c], 0x88);
            t[h + 4 + c] = _mm512_shuffle_i32x4(r[h + c], r[h + 4 + c], 0xdd);
        }
    for (int c = 0; c < 8; ++c) {              // columns c and 8 + c
        _mm512_store_si512(out[c], _mm512_shuffle_i32x4(t[c], t[8 + c], 0x88));
        _mm512_store_si512(out[8 + c], _mm512_shuffle_i32x4(t[c], t[8 + c], 0xdd));
    }
}

// the prefill tile's P V for one chunk of keys on the AMX tiles: acc (the output transposed, dims
// in pv_lane order x rows) is already C's layout, and p_pairs (pairs of keys x rows) already B's, so
// only V is transposed, 16 dims at a time, into A (dims x pairs of keys); pairs past `pairs` are
// zeroed in both (stale values there could be NaN). The tiles' config is prefill_tile's.
template <int RV>
void prefill_pv_tiles(uint32_t (*v_pairs)[MAX_DIM], uint32_t (*p_pairs)[PREFILL_ROWS], int pairs, int out_dims,
                      const v16f *correction, float (*acc)[PREFILL_ROWS]) {
    for (int u = pairs; u < PREFILL_KEYS / 2; ++u) {
        memset(v_pairs[u], 0, out_dims * sizeof(uint32_t));
        memset(p_pairs[u], 0, sizeof(p_pairs[u]));
    }
    for (int d = 0; d < out_dims; ++d)
        for (int v = 0; v < RV; ++v) _mm512_store_ps(&acc[d][16 * v], _mm512_load_ps(&acc[d][16 * v]) * (__m512)correction[v]);
    alignas(64) uint32_t v_rows[MAX_DIM / 16][16][16];      // [16 dims][dim][pair of keys]
    for (int t = 0; t < out_dims / 16; ++t) {
        uint32_t (*block)[MAX_DIM] = (uint32_t (*)[MAX_DIM])&v_pairs[0][16 * t];
        transpose16(block, v_rows[t]);
    }
    // B: the row vectors' probabilities in tiles 4 to 7; A: tile 0; C: tiles 1 and 2 by turns
    _tile_loadd(4, &p_pairs[0][0], PREFILL_ROWS * 4);
    if (RV > 1) _tile_loadd(5, &p_pairs[0][16], PREFILL_ROWS * 4);
    if (RV > 2) _tile_loadd(6, &p_pairs[0][32], PREFILL_ROWS * 4);
    if (RV > 3) _tile_loadd(7, &p_pairs[0][48], PREFILL_ROWS * 4);
    for (int t = 0; t < out_dims / 16; ++t) {
        _tile_loadd(0, v_rows[t], 64);
        // row vector V's 16 dims t: C tile C += A . B tile B (tile numbers are immediates)
#define INFLIGHT_PV(C, B, V) do {                                                  \
            _tile_loadd(C, &acc[16 * t][16 * (V)], PREFILL_ROWS * 4);              \
            _tile_dpbf16ps(C, 0, B);                                               \
            _tile_stored(C, &acc[16 * t][16 * (V)], PREFILL_ROWS * 4);             \
        } while (0)
        INFLIGHT_PV(1, 4, 0);
        if (RV > 1) INFLIGHT_PV(2, 5, 1);
        if (RV > 2) INFLIGHT_PV(1, 6, 2);
        if (RV > 3) INFLIGHT_PV(2, 7, 3);
#undef INFLIGHT_PV
    }
}
#endif

template <typename T, bool PAIRS, int RV, typename KRow, typename VRow>
void prefill_tile(const T *q, int64_t q_token_stride, int64_t q_head_stride, KRow k_row, VRow v_row, int dim,
                  int group, int kv_head, int tokens, int first_pos, float scale, T *out,
                  int64_t out_token_stride, int64_t out_head_stride) {
    const int rows = tokens * group;
    const int steps = PAIRS ? dim / 2 : dim;               // products that make one score
    const int out_dims = PAIRS ? (dim + 31) / 32 * 32 : dim;   // PAIRS: whole 32-dim chunks, pv_lane order
    alignas(64) uint32_t qt[MAX_DIM][PREFILL_ROWS];        // Q transposed: float bits, or bf16 pairs
    alignas(64) float acc[MAX_DIM][PREFILL_ROWS];          // the output transposed, not yet normalised
    alignas(64) float scores[PREFILL_KEYS][PREFILL_ROWS];
    const T *k_rows[PREFILL_KEYS], *v_rows[PREFILL_KEYS];
    for (int s = 0; s < steps; ++s) memset(qt[s], 0, sizeof(qt[s]));
    for (int r = 0; r < rows; ++r) {
        const T *src = q + (int64_t)(r / group) * q_token_stride + (int64_t)(kv_head * group + r % group) * q_head_stride;
        for (int s = 0; s < steps; ++s) {
            if constexpr (PAIRS) {
                memcpy(&qt[s][r], src + 2 * s, 4);
            } else {
                const float x = to_float(src[s]);
                memcpy(&qt[s][r], &x, 4);
            }
        }
    }
    for (int d = 0; d < out_dims; ++d) std::fill_n(acc[d], 16 * RV, 0.0f);
    v16f running_max[RV], running_sum[RV];
    v16i position[RV];             // each row's token position: its keys end there
    for (int v = 0; v < RV; ++v) {
        running_max[v] = (v16f){} - INFINITY;
        running_sum[v] = (v16f){};
        for (int lane = 0; lane < 16; ++lane) {
            const int r = 16 * v + lane;
            position[v][lane] = first_pos + (r < rows ? r : rows - 1) / group;
        }
    }
    const int last = first_pos + tokens - 1;
#ifdef INFLIGHT_AMX
    // both products on the AMX tiles where they fit. Scores: per 16 keys (of one block), K read in
    // place as A against Q's pairs (qt, already the B layout) for each 16-row vector, the scores
    // key-major as the softmax below reads them; P V: prefill_pv_tiles
    bool on_tiles = false;
    if constexpr (PAIRS) {
        on_tiles = amx_fits(dim, k_row.block_size);
        if (on_tiles) {
            TileConfig config;             // every tile 16 rows of 64 bytes, in both products
            for (int t = 0; t < 8; ++t) config.set(t, 16, 64);
            _tile_loadconfig(&config);
        }
    }
#endif
    for (int first = 0; first <= last; first += PREFILL_KEYS) {
        const int n = last + 1 - first < PREFILL_KEYS ? last + 1 - first : PREFILL_KEYS;
        const int n4 = (n + 3) / 4 * 4;          // keys past n (n < PREFILL_KEYS) lie past `last`: masked below
        for (int t = 0; t < n4; ++t) {
            k_rows[t] = k_row(first + (t < n ? t : n - 1));
            v_rows[t] = v_row(first + (t < n ? t : n - 1));
        }
#ifdef INFLIGHT_AMX
        if (on_tiles) {
            for (int t = 0; t < n; ++t) prefetch_row(v_rows[t], dim);
            const int64_t k_bytes = k_row.slot_stride * (int64_t)sizeof(T);
            for (int sub = 0; sub < n; sub += 16) {
                const T *k = k_rows[sub];
                // tile numbers are immediates: the row vectors' accumulators are tiles 2 to 5
                _tile_zero(2);
                if (RV > 1) _tile_zero(3);
                if (RV > 2) _tile_zero(4);
                if (RV > 3) _tile_zero(5);
                for (int c = 0; c < dim / 32; ++c) {
                    _tile_loadd(1, k + 32 * c, k_bytes);
                    _tile_loadd(0, &qt[16 * c][0], PREFILL_ROWS * 4);
                    _tile_dpbf16ps(2, 1, 0);
                    if (RV > 1) { _tile_loadd(0, &qt[16 * c][16], PREFILL_ROWS * 4); _tile_dpbf16ps(3, 1, 0); }
                    if (RV > 2) { _tile_loadd(0, &qt[16 * c][32], PREFILL_ROWS * 4); _tile_dpbf16ps(4, 1, 0); }
                    if (RV > 3) { _tile_loadd(0, &qt[16 * c][48], PREFILL_ROWS * 4); _tile_dpbf16ps(5, 1, 0); }
                }
                _tile_stored(2, &scores[sub][0], PREFILL_ROWS * 4);
                if (RV > 1) _tile_stored(3, &scores[sub][16], PREFILL_ROWS * 4);
                if (RV > 2) _tile_stored(4, &scores[sub][32], PREFILL_ROWS * 4);
                if (RV > 3) _tile_stored(5, &scores[sub][48], PREFILL_ROWS * 4);
            }
            for (int t = 0; t < n4; ++t)
                for (int v = 0; v < RV; ++v) {
                    v16f x = load16(&scores[t][16 * v]) * scale;
                    if (first + t > first_pos)          // causal (and the slots past `last`, whatever they hold)
                        x = ((v16i){} + (first + t)) > position[v] ? (v16f){} - INFINITY : x;
                    memcpy(&scores[t][16 * v], &x, 64);
                }
        } else
#endif
        // scores, four keys against every row vector at a time
        for (int t = 0; t < n4; t += 4) {
            if (t + 4 < n) {
                for (int i = 0; i < 4 && t + 4 + i < n; ++i) prefetch_row(k_rows[t + 4 + i], dim);
            }
            for (int i = 0; i < 4; ++i) prefetch_row(v_rows[t + i], dim);
            v16f s[4][RV];
#ifdef __AVX512BF16__
            if constexpr (PAIRS) {
                __m512 a[4][RV];
                for (int i = 0; i < 4; ++i)
                    for (int v = 0; v < RV; ++v) a[i][v] = _mm512_setzero_ps();
                dot_four_bf16<RV>(a, qt, steps, [&](int j, int i) {     // Q's dims j against key t + i's
                    int32_t pair;
                    memcpy(&pair, k_rows[t + i] + 2 * j, 4);
                    return pair;
                });
                for (int i = 0; i < 4; ++i)
                    for (int v = 0; v < RV; ++v) s[i][v] = (v16f)a[i][v];
            } else
#endif
            {
                for (int i = 0; i < 4; ++i)
                    for (int v = 0; v < RV; ++v) s[i][v] = (v16f){};
                for (int j = 0; j < steps; ++j) {
                    v16f qv[RV];
                    for (int v = 0; v < RV; ++v) {
                        memcpy(&qv[v], &qt[j][16 * v], 64);
                        in_register(qv[v]);
                    }
                    for (int i = 0; i < 4; ++i) {
                        const v16f kf = splat(to_float(k_rows[t + i][j]));
                        for (int v = 0; v < RV; ++v) s[i][v] += qv[v] * kf;
                    }
                }
            }
            for (int i = 0; i < 4; ++i)
                for (int v = 0; v < RV; ++v) {
                    v16f x = s[i][v] * scale;
                    if (first + t + i > first_pos)          // causal: a key past a row's position
                        x = ((v16i){} + (first + t + i)) > position[v] ? (v16f){} - INFINITY : x;
                    memcpy(&scores[t + i][16 * v], &x, 64);
                }
        }
        // online softmax, row vector by row vector (each row keeps key 0, so its maximum is finite)
        v16f correction[RV];
        for (int v = 0; v < RV; ++v) {
            v16f tile_max = (v16f){} - INFINITY;
            for (int t = 0; t < n4; ++t) {
                const v16f x = load16(&scores[t][16 * v]);
                tile_max = x > tile_max ? x : tile_max;
            }
            const v16f new_max = tile_max > running_max[v] ? tile_max : running_max[v];
            correction[v] = exp_nonpositive(running_max[v] - new_max);
            v16f sum = {};
            for (int t = 0; t < n4; ++t) {
                const v16f p = exp_nonpositive(load16(&scores[t][16 * v]) - new_max);
                memcpy(&scores[t][16 * v], &p, 64);
                sum += p;
            }
            running_sum[v] = running_sum[v] * correction[v] + sum;
            running_max[v] = new_max;
        }
#ifdef __AVX512BF16__
        if constexpr (PAIRS) {
            // V as pairs of keys dim by dim (pv_lane order), the probabilities as pairs of keys
            alignas(64) uint32_t v_pairs[PREFILL_KEYS / 2][MAX_DIM];
            alignas(64) uint32_t p_pairs[PREFILL_KEYS / 2][PREFILL_ROWS];
            const int pairs = (n + 1) / 2;
            const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                                        23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
            for (int u = 0; u < pairs; ++u) {
                const T *r0 = v_rows[2 * u], *r1 = 2 * u + 1 < n ? v_rows[2 * u + 1] : r0;   // (p = 0 for it)
                for (int c = 0; c < out_dims / 32; ++c) {
                    const int left = dim - 32 * c;
                    const __mmask32 m = left >= 32 ? 0xffffffffu : (1u << left) - 1u;
                    const __m512i a = _mm512_maskz_loadu_epi16(m, r0 + 32 * c), b = _mm512_maskz_loadu_epi16(m, r1 + 32 * c);
                    _mm512_store_si512(&v_pairs[u][32 * c], _mm512_unpacklo_epi16(a, b));
                    _mm512_store_si512(&v_pairs[u][32 * c + 16], _mm512_unpackhi_epi16(a, b));
                }
                for (int v = 0; v < RV; ++v) {
                    const __m512bh both = _mm512_cvtne2ps_pbh(_mm512_load_ps(&scores[2 * u + 1][16 * v]),
                                                              _mm512_load_ps(&scores[2 * u][16 * v]));
                    _mm512_store_si512(&p_pairs[u][16 * v], _mm512_permutexvar_epi16(interleave, (__m512i)both));
                }
            }
#ifdef INFLIGHT_AMX
            if (on_tiles) {
                prefill_pv_tiles<RV>(v_pairs, p_pairs, pairs, out_dims, correction, acc);
                continue;
            }
#endif
            for (int d = 0; d < out_dims; d += 4) {
                __m512 o[4][RV];
                for (int i = 0; i < 4; ++i)
                    for (int v = 0; v < RV; ++v) o[i][v] = _mm512_load_ps(&acc[d + i][16 * v]) * (__m512)correction[v];
                // keys u's probabilities against their V at dims d + i
                dot_four_bf16<RV>(o, p_pairs, pairs, [&](int u, int i) { return (int32_t)v_pairs[u][d + i]; });
                for (int i = 0; i < 4; ++i)
                    for (int v = 0; v < RV; ++v) _mm512_store_ps(&acc[d + i][16 * v], o[i][v]);
            }
            continue;
        }
#endif
        for (int d = 0; d < dim; d += 4) {
            const int width = dim - d < 4 ? dim - d : 4;
            v16f o[4][RV];
            for (int i = 0; i < width; ++i)
                for (int v = 0; v < RV; ++v) o[i][v] = load16(&acc[d + i][16 * v]) * correction[v];
            for (int t = 0; t < n; ++t) {
                v16f p[RV];
                for (int v = 0; v < RV; ++v) {
                    p[v] = load16(&scores[t][16 * v]);
                    in_register(p[v]);
                }
                for (int i = 0; i < width; ++i) {
                    const v16f x = splat(to_float(v_rows[t][d + i]));
                    for (int v = 0; v < RV; ++v) o[i][v] += p[v] * x;
                }
            }
            for (int i = 0; i < width; ++i)
                for (int v = 0; v < RV; ++v) memcpy(&acc[d + i][16 * v], &o[i][v], 64);
        }
    }
#ifdef INFLIGHT_AMX
    if (on_tiles) _tile_release();
#endif
    int lane[MAX_DIM];
    for (int d = 0; d < dim; ++d) lane[d] = PAIRS ? pv_lane(d) : d;
    for (int v = 0; v < RV; ++v) {
        T *dst[16];
        const int count = rows - 16 * v < 16 ? rows - 16 * v : 16;
        for (int i = 0; i < count; ++i) {
            const int r = 16 * v + i;
            dst[i] = out + (int64_t)(r / group) * out_token_stride + (int64_t)(kv_head * group + r % group) * out_head_stride;
        }
        const v16f inv = 1.0f / running_sum[v];
        for (int d = 0; d < dim; ++d) {
            T values[16];
            store16(values, load16(&acc[lane[d]][16 * v]) * inv);
            for (int i = 0; i < count; ++i) dst[i][d] = values[i];
        }
    }
}

// the same arguments as paged_decode_attention; computes the sequences with more than one query
// token (prefill chunks: query token i of n sits at position seq_len - n + i), leaves the others
template <typename T>
void paged_prefill_attention(const T *q, const int64_t *q_strides, const T *k_cache, const int64_t *k_strides,
                             const T *v_cache, const int64_t *v_strides, T *out, const int64_t *out_strides,
                             const int32_t *cu_seqlens_q, const int32_t *seq_lens, const int32_t *block_table,
                             int64_t block_table_stride, int num_seqs, int num_heads, int num_kv_heads, int dim,
                             int block_size, float scale, int num_threads) {
    const int group = num_heads / num_kv_heads;
    const int tile_tokens = PREFILL_TILE_ROWS / group;
    struct Tile { int seq, first, tokens, end; };
    std::vector<Tile> tiles;
    for (int seq = 0; seq < num_seqs; ++seq) {
        const int n = cu_seqlens_q[seq + 1] - cu_seqlens_q[seq];
        if (n < 2) continue;
        for (int first = 0; first < n; first += tile_tokens) {
            const int tokens = n - first < tile_tokens ? n - first : tile_tokens;
            tiles.push_back({seq, first, tokens, seq_lens[seq] - n + first + tokens});
        }
    }
    // the longest contexts first, so that the dynamic schedule ends evenly
    std::stable_sort(tiles.begin(), tiles.end(), [](const Tile &a, const Tile &b) { return a.end > b.end; });
#ifdef __AVX512BF16__
    constexpr bool bf16_dot = std::is_same_v<T, bf16>;
#else
    constexpr bool bf16_dot = false;
#endif
    const bool pairs = bf16_dot && dim % 2 == 0;
    const int64_t items = (int64_t)tiles.size() * num_kv_heads;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t item = 0; item < items; ++item) {
        const Tile &tile = tiles[item / num_kv_heads];
        const int kv_head = (int)(item % num_kv_heads);
        const int token = cu_seqlens_q[tile.seq] + tile.first;
        const int first_pos = tile.end - tile.tokens;
        const int32_t *blocks = block_table + tile.seq * block_table_stride;
        const PagedRows<T> k_row(k_cache, k_strides, blocks, kv_head, block_size);
        const PagedRows<T> v_row(v_cache, v_strides, blocks, kv_head, block_size);
        const T *q_tile = q + token * q_strides[0];
        T *out_tile = out + token * out_strides[0];
#define INFLIGHT_PREFILL(P, RV) prefill_tile<T, P, RV>(q_tile, q_strides[0], q_strides[1], k_row, v_row, dim, group, \
                                                     kv_head, tile.tokens, first_pos, scale, out_tile, out_strides[0], \
                                                     out_strides[1])
#define INFLIGHT_PREFILL_RV(P) switch ((tile.tokens * group + 15) / 16) { \
            case 1: INFLIGHT_PREFILL(P, 1); break;                          \
            case 2: INFLIGHT_PREFILL(P, 2); break;                          \
            case 3: INFLIGHT_PREFILL(P, 3); break;                          \
            default: INFLIGHT_PREFILL(P, 4); break;                         \
        }
        if constexpr (bf16_dot) {
            if (pairs) {
                INFLIGHT_PREFILL_RV(true)
                continue;
            }
        }
        {
            INFLIGHT_PREFILL_RV(false)
        }
#undef INFLIGHT_PREFILL_RV
#undef INFLIGHT_PREFILL
    }
}

// ---- the layer's small ops, fused (decode steps are a few dozen rows: one call instead of several
// torch ops, each of which costs more to dispatch than to compute). They round like the torch
// expressions they replace (each product and sum rounded to the tensor's dtype, no contraction).

template <typename T>
inline float rounded(float x) { T r; from_float(x, &r); return to_float(r); }

#ifdef INFLIGHT_AVX2
// rms_norm's float32 row on 8-lane vectors: the same sums in the same order as the 16-lane code
// (its lanes as two halves), without the selects and stack moves GCC makes of it on AVX2
inline void rms_norm_row_avx2(const float *src, float *skip, const float *weight, float *dst, int hidden, float eps) {
    const int vectors = hidden / 16;
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    for (int c = 0; c < vectors; ++c) {
        __m256 a = _mm256_loadu_ps(src + 16 * c), b = _mm256_loadu_ps(src + 16 * c + 8);
        if (skip != nullptr) {
            a = _mm256_add_ps(_mm256_loadu_ps(skip + 16 * c), a);
            b = _mm256_add_ps(_mm256_loadu_ps(skip + 16 * c + 8), b);
            _mm256_storeu_ps(skip + 16 * c, a);
            _mm256_storeu_ps(skip + 16 * c + 8, b);
        }
        lo = _mm256_add_ps(lo, _mm256_mul_ps(a, a));
        hi = _mm256_add_ps(hi, _mm256_mul_ps(b, b));
    }
    if (skip != nullptr) {
        for (int i = 16 * vectors; i < hidden; ++i) skip[i] += src[i];
        src = skip;
    }
    float sum = hsum(from_halves(lo, hi));
    for (int i = 16 * vectors; i < hidden; ++i) sum += src[i] * src[i];
    const __m256 inv = _mm256_set1_ps(1.0f / sqrtf(sum / hidden + eps));
    for (int c = 0; c < 2 * vectors; ++c)
        _mm256_storeu_ps(dst + 8 * c, _mm256_mul_ps(_mm256_loadu_ps(weight + 8 * c),
                                                    _mm256_mul_ps(_mm256_loadu_ps(src + 8 * c), inv)));
    for (int i = 16 * vectors; i < hidden; ++i) dst[i] = weight[i] * (src[i] * _mm256_cvtss_f32(inv));
}
#endif

// weight * (x * rsqrt(mean(x^2) + eps)).to(dtype), the squares summed in float32. With a residual
// (the decoder's skip connection): residual = (residual + x).to(dtype) first, in place, and the
// norm is taken of that sum (one pass instead of an add and a norm)
template <typename T>
__attribute__((optimize("fp-contract=off")))
void rms_norm(const T *x, int64_t x_stride, T *residual, int64_t residual_stride, const T *weight, T *out,
              int64_t out_stride, int64_t rows, int hidden, float eps, int num_threads) {
    const int vectors = hidden / 16;
#pragma omp parallel for num_threads(num_threads) if (rows * hidden > PARALLEL_MIN)
    for (int64_t r = 0; r < rows; ++r) {
        const T *src = x + r * x_stride;
        T *dst = out + r * out_stride;
#ifdef INFLIGHT_AVX2
        if constexpr (std::is_same_v<T, float>) {
            rms_norm_row_avx2(src, residual == nullptr ? nullptr : residual + r * residual_stride, weight, dst,
                              hidden, eps);
            continue;
        }
#endif
        v16f squares = {};
        if (residual != nullptr) {
            T *skip = residual + r * residual_stride;
            for (int c = 0; c < vectors; ++c) {
                const v16f v = rounded16(load16(skip + 16 * c) + load16(src + 16 * c), src);
                store16(skip + 16 * c, v);
                squares += v * v;
            }
            for (int i = 16 * vectors; i < hidden; ++i) from_float(to_float(skip[i]) + to_float(src[i]), skip + i);
            src = skip;
        } else {
            for (int c = 0; c < vectors; ++c) {
                const v16f v = load16(src + 16 * c);
                squares += v * v;
            }
        }
        float sum = hsum(squares);
        for (int i = 16 * vectors; i < hidden; ++i) sum += to_float(src[i]) * to_float(src[i]);
        const float inv = 1.0f / sqrtf(sum / hidden + eps);
        for (int c = 0; c < vectors; ++c) {
            const v16f normed = rounded16(load16(src + 16 * c) * inv, src);
            store16(dst + 16 * c, load16(weight + 16 * c) * normed);
        }
        for (int i = 16 * vectors; i < hidden; ++i)
            from_float(to_float(weight[i]) * rounded<T>(to_float(src[i]) * inv), dst + i);
    }
}

// one head's x * cos + cat(-x2, x1) * sin
template <typename T>
__attribute__((optimize("fp-contract=off")))
inline void rotate_head(const T *src, const T *c, const T *s, T *dst, int dim) {
    const int half = dim / 2;
    if (half % 16 == 0) {
        for (int d = 0; d < half; d += 16) {
            const v16f x1 = load16(src + d), x2 = load16(src + half + d);
            store16(dst + d, rounded16(x1 * load16(c + d), src) + rounded16(-x2 * load16(s + d), src));
            store16(dst + half + d, rounded16(x2 * load16(c + half + d), src) + rounded16(x1 * load16(s + half + d), src));
        }
        return;
    }
    for (int d = 0; d < dim; ++d) {
        const float rotated = d < half ? -to_float(src[d + half]) : to_float(src[d - half]);
        from_float(rounded<T>(to_float(src[d]) * to_float(c[d])) + rounded<T>(rotated * to_float(s[d])), dst + d);
    }
}

// every head rotated: x [rows, heads, dim] (strides row, head), cos/sin [rows, dim]
template <typename T>
__attribute__((optimize("fp-contract=off")))
void rotary(const T *x, int64_t x_row_stride, int64_t x_head_stride, const T *cos, const T *sin,
            int64_t table_stride, T *out, int64_t rows, int heads, int dim, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * heads * dim > PARALLEL_MIN)
    for (int64_t r = 0; r < rows; ++r)
        for (int h = 0; h < heads; ++h)
            rotate_head(x + r * x_row_stride + h * x_head_stride, cos + r * table_stride, sin + r * table_stride,
                        out + (r * heads + h) * dim, dim);
}

// an attention layer's step up to the attention, in one pass over qkv [rows, (heads + 2 kv_heads) x
// dim] (row stride given): the query heads rotated into q_out [rows, heads, dim], the key heads
// rotated straight into k_cache and the value heads copied into v_cache at each row's flat slot
// (block * block_size + offset; rows from num_slots on, or at a slot < 0, are queries only). A row's slot is its own: rows run in parallel
template <typename T>
__attribute__((optimize("fp-contract=off")))
void rotary_write_kv(const T *qkv, int64_t qkv_stride, const T *cos, const T *sin, int64_t table_stride, T *q_out,
                     int64_t rows, int heads, int kv_heads, int dim, T *k_cache, T *v_cache,
                     const int64_t *cache_strides, const int64_t *slots, int64_t num_slots, int block_size,
                     int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * (heads + kv_heads) * dim > PARALLEL_MIN)
    for (int64_t r = 0; r < rows; ++r) {
        const T *row = qkv + r * qkv_stride, *c = cos + r * table_stride, *s = sin + r * table_stride;
        for (int h = 0; h < heads; ++h) rotate_head(row + h * dim, c, s, q_out + (r * heads + h) * dim, dim);
        if (r >= num_slots || slots[r] < 0) continue;
        const int64_t at = (slots[r] / block_size) * cache_strides[0] + (slots[r] % block_size) * cache_strides[1];
        for (int h = 0; h < kv_heads; ++h) {
            rotate_head(row + (heads + h) * dim, c, s, k_cache + at + h * cache_strides[2], dim);
            memcpy(v_cache + at + h * cache_strides[2], row + (heads + kv_heads + h) * dim, dim * sizeof(T));
        }
    }
}

#ifdef INFLIGHT_AVX2
// exp_nonpositive and silu16 on 8 lanes, the same operations in the same order (so the same
// results): GCC turns the 16-lane versions' selects into scalar compares without AVX-512 (a
// [64, 1536] silu_and_mul 386 -> 94 µs on 2 cores of an AVX2 EPYC)
inline __m256 exp_nonpositive8(__m256 x) {
    const __m256 clamped = _mm256_max_ps(_mm256_set1_ps(-87.0f), x);      // NaN stays NaN
    const __m256 magic = _mm256_set1_ps(12582912.0f);
    const __m256 n = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(clamped, _mm256_set1_ps(1.44269504088896341f)), magic),
                                   magic);
    const __m256 r = _mm256_add_ps(_mm256_sub_ps(clamped, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f))),
                                   _mm256_mul_ps(n, _mm256_set1_ps(2.12194440e-4f)));
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
        p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(c));
    p = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(p, r), r), r), _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
    const __m256 below = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
    return _mm256_blendv_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(bits)), _mm256_setzero_ps(), below);
}

inline __m256 silu8(__m256 g) {
    const __m256 negative = _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ);
    const __m256 e = exp_nonpositive8(_mm256_blendv_ps(_mm256_sub_ps(_mm256_setzero_ps(), g), g, negative));
    return _mm256_div_ps(_mm256_blendv_ps(g, _mm256_mul_ps(g, e), negative), _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}
#endif

// silu(g) = g / (1 + exp(-g)), with one exp of -|g| <= 0: g >= 0: g / (1 + e); g < 0: g * e / (1 + e)
template <int N>
inline void silu16(v16f (&g)[N]) {
    v16f e[N];
    for (int i = 0; i < N; ++i) e[i] = g[i] < 0.0f ? g[i] : -g[i];
    exp_nonpositive(e);
    for (int i = 0; i < N; ++i) g[i] = (g[i] < 0.0f ? g[i] * e[i] : g[i]) / (1.0f + e[i]);
}
inline v16f silu16(v16f g) {
    v16f one[1] = {g};
    silu16(one);
    return one[0];
}

// vectors silu_and_mul takes at once: 8 keep AVX-512's 32 registers busy (a [2048, 1536] bf16
// call 1.00 -> 0.57 ms on 2 Zen 5 cores, 4 at once 0.74); a vector is two of AVX2's 16 registers
#ifdef __AVX512F__
constexpr int SILU_VECTORS = 8;
#else
constexpr int SILU_VECTORS = 1;
#endif

// silu(gate) * up for gate_up [rows, 2 * inner] (gate first): silu rounded to dtype, then the product
template <typename T>
__attribute__((optimize("fp-contract=off")))
void silu_and_mul(const T *gate_up, int64_t in_stride, T *out, int64_t out_stride, int64_t rows, int inner,
                  int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * inner > PARALLEL_MIN)
    for (int64_t r = 0; r < rows; ++r) {
        const T *gate = gate_up + r * in_stride, *up = gate + inner;
        T *dst = out + r * out_stride;
        int i = 0;
#ifdef INFLIGHT_AVX2
        if constexpr (std::is_same_v<T, float>)
            for (; i + 8 <= inner; i += 8)
                _mm256_storeu_ps(dst + i, _mm256_mul_ps(silu8(_mm256_loadu_ps(gate + i)), _mm256_loadu_ps(up + i)));
#endif
        for (; i + 16 * SILU_VECTORS <= inner; i += 16 * SILU_VECTORS) {
            v16f g[SILU_VECTORS];
            for (int j = 0; j < SILU_VECTORS; ++j) g[j] = load16(gate + i + 16 * j);
            silu16(g);
            for (int j = 0; j < SILU_VECTORS; ++j)
                store16(dst + i + 16 * j, rounded16(g[j], gate) * load16(up + i + 16 * j));
        }
        for (; i + 16 <= inner; i += 16)
            store16(dst + i, rounded16(silu16(load16(gate + i)), gate) * load16(up + i));
        for (; i < inner; ++i)
            from_float(rounded<T>(silu16((v16f){} + to_float(gate[i]))[0]) * to_float(up[i]), dst + i);
    }
}

// ---- LoRA: y[t, columns] += (x[t] A_s) B_s for the tokens t of each segment (slot s, start, end) ----
// A_s is [in, modules x rank] (each module's A^T side by side, `width` columns), B_s [modules x
// rank, cols]: module m's rank rows feed only its own columns [m_cols[2m], m_cols[2m+1]) (B is
// block-diagonal; the zero blocks are skipped). x A stays in float32 between the two products and
// y is rounded once. rank % 16 == 0 (the loader pads). Each weight vector loaded serves a block of
// LORA_TOKENS tokens; every output element is computed by one thread in a fixed order.
constexpr int LORA_TOKENS = 4;
constexpr int LORA_VECTORS = 4;    // output columns per register block, in 16-float vectors

template <typename T, int TB, int NV>
inline void lora_shrink_block(const T *x, int64_t x_stride, const T *a, int width, int in, float *h, int col) {
    v16f acc[TB][NV] = {};
    for (int k = 0; k < in; ++k) {
        v16f w[NV];
        for (int v = 0; v < NV; ++v) w[v] = load16(a + (int64_t)k * width + col + 16 * v);
        for (int t = 0; t < TB; ++t) {
            const float xk = to_float(x[t * x_stride + k]);
            for (int v = 0; v < NV; ++v) acc[t][v] += xk * w[v];
        }
    }
    for (int t = 0; t < TB; ++t)
        for (int v = 0; v < NV; ++v) memcpy(h + (int64_t)t * width + col + 16 * v, &acc[t][v], 64);
}

// h: the block's first token at the module's first rank column; b: the module's first row
template <typename T, int TB, int NV>
inline void lora_expand_block(const float *h, int width, const T *b, int64_t b_stride, int rank, T *y,
                              int64_t y_stride, int col) {
    v16f acc[TB][NV] = {};
    for (int r = 0; r < rank; ++r) {
        v16f w[NV];
        for (int v = 0; v < NV; ++v) w[v] = load16(b + r * b_stride + col + 16 * v);
        for (int t = 0; t < TB; ++t) {
            const float hr = h[t * width + r];
            for (int v = 0; v < NV; ++v) acc[t][v] += hr * w[v];
        }
    }
    for (int t = 0; t < TB; ++t)
        for (int v = 0; v < NV; ++v) {
            T *p = y + t * y_stride + col + 16 * v;
            store16(p, load16(p) + acc[t][v]);
        }
}

template <typename T>
inline void lora_expand_tail(const float *h, const T *b, int64_t b_stride, int rank, T *y, int col, int end) {
    for (int c = col; c < end; ++c) {
        float sum = 0.0f;
        for (int r = 0; r < rank; ++r) sum += h[r] * to_float(b[r * b_stride + c]);
        from_float(to_float(y[c]) + sum, y + c);
    }
}

#define LORA_SWITCH(TOKENS, VECTORS, CALL)                                                   \
    switch ((TOKENS) == LORA_TOKENS ? (VECTORS) : 4 + (VECTORS)) {                           \
        case 1: CALL(LORA_TOKENS, 1); break;                                                 \
        case 2: CALL(LORA_TOKENS, 2); break;                                                 \
        case 3: CALL(LORA_TOKENS, 3); break;                                                 \
        case 4: CALL(LORA_TOKENS, 4); break;                                                 \
        case 5: CALL(1, 1); break;                                                           \
        case 6: CALL(1, 2); break;                                                           \
        case 7: CALL(1, 3); break;                                                           \
        case 8: CALL(1, 4); break;                                                           \
    }

struct LoraBlock { int slot, token, tokens; };                      // tokens <= LORA_TOKENS
struct LoraChunk { int module, col, vectors, end; };                // vectors == 0: scalar tail [col, end)

template <typename T>
void lora_add(const T *x, int64_t x_stride, const T *a, int64_t a_slot_stride, const T *b, int64_t b_slot_stride,
              int64_t b_stride, T *y, int64_t y_stride, const int32_t *segments, int num_segments, int in,
              int modules, int rank, const int32_t *m_cols, int num_threads) {
    const int width = modules * rank;
    std::vector<LoraBlock> blocks;
    int first = segments[1], last = segments[2];
    for (int s = 0; s < num_segments; ++s) {
        const int slot = segments[3 * s], start = segments[3 * s + 1], end = segments[3 * s + 2];
        for (int t = start; t < end; t += LORA_TOKENS)
            blocks.push_back({slot, t, end - t < LORA_TOKENS ? end - t : LORA_TOKENS});
        first = start < first ? start : first;
        last = end > last ? end : last;
    }
    std::vector<LoraChunk> chunks;
    for (int m = 0; m < modules; ++m) {
        const int begin = m_cols[2 * m], end = m_cols[2 * m + 1], full = begin + (end - begin) / 16 * 16;
        for (int c = begin; c < full; c += 16 * LORA_VECTORS)
            chunks.push_back({m, c, (full - c) / 16 < LORA_VECTORS ? (full - c) / 16 : LORA_VECTORS, 0});
        if (full < end) chunks.push_back({m, full, 0, end});
    }
    const int num_blocks = blocks.size(), num_chunks = chunks.size();
    std::vector<float> h_rows((int64_t)(last - first) * width);
    float *h = h_rows.data();
    const int64_t work = (int64_t)(last - first) * width * (in + 2 * rank);
    const int shrink_chunks = (width / 16 + LORA_VECTORS - 1) / LORA_VECTORS;
#pragma omp parallel num_threads(num_threads) if (work > 65536)
    {
#pragma omp for schedule(static)
        for (int i = 0; i < num_blocks * shrink_chunks; ++i) {      // shrink: (block, rank column chunk)
            const LoraBlock &blk = blocks[i / shrink_chunks];
            const int col = i % shrink_chunks * 16 * LORA_VECTORS;
            const int vectors = (width - col) / 16 < LORA_VECTORS ? (width - col) / 16 : LORA_VECTORS;
            const T *as = a + blk.slot * a_slot_stride;
            const int step = blk.tokens == LORA_TOKENS ? LORA_TOKENS : 1;
            for (int t = blk.token; t < blk.token + blk.tokens; t += step) {
                const T *xt = x + t * x_stride;
                float *ht = h + (int64_t)(t - first) * width;
#define SHRINK(TB, NV) lora_shrink_block<T, TB, NV>(xt, x_stride, as, width, in, ht, col)
                LORA_SWITCH(step, vectors, SHRINK)
#undef SHRINK
            }
        }
#pragma omp for schedule(static)
        for (int i = 0; i < num_blocks * num_chunks; ++i) {         // expand: (block, column chunk)
            const LoraBlock &blk = blocks[i / num_chunks];
            const LoraChunk &chunk = chunks[i % num_chunks];
            const T *bm = b + blk.slot * b_slot_stride + (int64_t)chunk.module * rank * b_stride;
            const int step = blk.tokens == LORA_TOKENS && chunk.vectors ? LORA_TOKENS : 1;
            for (int t = blk.token; t < blk.token + blk.tokens; t += step) {
                const float *ht = h + (int64_t)(t - first) * width + chunk.module * rank;
                T *yt = y + t * y_stride;
                if (chunk.vectors == 0) {
                    lora_expand_tail<T>(ht, bm, b_stride, rank, yt, chunk.col, chunk.end);
                    continue;
                }
#define EXPAND(TB, NV) lora_expand_block<T, TB, NV>(ht, width, bm, b_stride, rank, yt, y_stride, chunk.col)
                LORA_SWITCH(step, chunk.vectors, EXPAND)
#undef EXPAND
            }
        }
    }
}

inline bool any_equal(v16f v, float x) {
    const v16i hit = v == x;
    v16i folded = hit;
    for (int i = 0; i < 16; ++i) folded[0] |= hit[i];
    return folded[0] != 0;
}

// the first index of each row's maximum (a NaN counts as the maximum, as in torch.argmax): the
// maximum with vector compares (four running maxima, so the compares do not wait on each other),
// then the first position that holds it; rows split over the threads
void argmax_rows(const float *x, int64_t row_stride, int64_t *out, int64_t rows, int64_t cols, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * cols > PARALLEL_MIN)
    for (int64_t r = 0; r < rows; ++r) {
        const float *row = x + r * row_stride;
        v16f maxes[4];
        v16i nan = {};
        for (v16f &m : maxes) m = (v16f){} - INFINITY;
        int64_t i = 0;
        for (; i + 64 <= cols; i += 64) {
            for (int u = 0; u < 4; ++u) {
                const v16f v = load16(row + i + 16 * u);
                maxes[u] = v > maxes[u] ? v : maxes[u];
                nan |= v != v;
            }
        }
        for (; i + 16 <= cols; i += 16) {
            const v16f v = load16(row + i);
            maxes[0] = v > maxes[0] ? v : maxes[0];
            nan |= v != v;
        }
        float best = -INFINITY;
        bool any_nan = false;
        for (int j = 0; j < 16; ++j) {
            for (const v16f &m : maxes) best = m[j] > best ? m[j] : best;
            any_nan |= nan[j] != 0;
        }
        for (; i < cols; ++i) {
            best = row[i] > best ? row[i] : best;
            any_nan |= row[i] != row[i];
        }
        int64_t index = 0;
        if (any_nan) {
            while (row[index] == row[index]) ++index;
        } else {
            while (index + 16 <= cols && !any_equal(load16(row + index), best)) index += 16;
            while (row[index] != best) ++index;
        }
        out[r] = index;
    }
}

}  // namespace

extern "C" {

int inflight_kernel_limits(int *max_dim, int *max_group, int *max_linear_rows) {
    *max_dim = MAX_DIM;
    *max_group = MAX_GROUP;
    *max_linear_rows = MAX_LINEAR_ROWS;
    return 0;
}

// y [rows, out_features] = x W^T (+ bias) for bf16 x of 1-MAX_LINEAR_ROWS rows and W as oneDNN prepacks it (see
// linear_small_rows); returns 0, having done nothing, where the tiles or the shapes do not fit
int linear_small_rows_bf16(const bf16 *x, int64_t x_stride, const bf16 *weight, const bf16 *bias, bf16 *y,
                           int64_t y_stride, int rows, int out_features, int in_features, int threads) {
#ifdef INFLIGHT_AMX
    if (rows < 1 || rows > MAX_LINEAR_ROWS || out_features % 32 || in_features % 32 || !amx_permitted()) return 0;
    linear_small_rows(x, x_stride, weight, bias, y, y_stride, rows, out_features, in_features, threads);
    return 1;
#else
    (void)x, (void)x_stride, (void)weight, (void)bias, (void)y, (void)y_stride, (void)rows, (void)out_features,
        (void)in_features, (void)threads;
    return 0;
#endif
}

// whether bf16 attention takes the AMX tiles (decodes of the shapes amx_decode_fits takes, and the
// prefill kernel); setting 0 or 1 turns them off or on first, -1 only asks
int inflight_amx_tiles(int setting) {
#ifdef INFLIGHT_AMX
    if (setting >= 0) amx_on = setting == 1;
    return amx_on && amx_permitted();
#else
    (void)setting;
    return 0;
#endif
}

#define ATTENTION_ENTRY(KERNEL, SUFFIX, T)                                                                        \
    void KERNEL##_##SUFFIX(const T *q, const int64_t *q_strides, const T *k_cache, const int64_t *k_strides,       \
                           const T *v_cache, const int64_t *v_strides, T *out, const int64_t *out_strides,          \
                           const int32_t *cu_seqlens_q, const int32_t *seq_lens, const int32_t *block_table,        \
                           int64_t block_table_stride, int num_seqs, int num_heads, int num_kv_heads, int dim,       \
                           int block_size, float scale, int num_threads) {                                          \
        KERNEL<T>(q, q_strides, k_cache, k_strides, v_cache, v_strides, out, out_strides, cu_seqlens_q, seq_lens,   \
                  block_table, block_table_stride, num_seqs, num_heads, num_kv_heads, dim, block_size, scale,        \
                  num_threads);                                                                                     \
    }

ATTENTION_ENTRY(paged_decode_attention, f32, float)
ATTENTION_ENTRY(paged_decode_attention, bf16, bf16)
ATTENTION_ENTRY(paged_prefill_attention, f32, float)
ATTENTION_ENTRY(paged_prefill_attention, bf16, bf16)

#define ROW_OPS_ENTRY(SUFFIX, T)                                                                              \
    void rms_norm_##SUFFIX(const T *x, int64_t x_stride, T *residual, int64_t residual_stride, const T *weight,   \
                           T *out, int64_t out_stride, int64_t rows, int hidden, float eps, int num_threads) {    \
        rms_norm<T>(x, x_stride, residual, residual_stride, weight, out, out_stride, rows, hidden, eps,         \
                    num_threads);                                                                                \
    }                                                                                                            \
    void rotary_##SUFFIX(const T *x, int64_t x_row_stride, int64_t x_head_stride, const T *cos, const T *sin,   \
                         int64_t table_stride, T *out, int64_t rows, int heads, int dim, int num_threads) {      \
        rotary<T>(x, x_row_stride, x_head_stride, cos, sin, table_stride, out, rows, heads, dim, num_threads);  \
    }                                                                                                            \
    void rotary_write_kv_##SUFFIX(const T *qkv, int64_t qkv_stride, const T *cos, const T *sin,                 \
                                  int64_t table_stride, T *q_out, int64_t rows, int heads, int kv_heads, int dim,  \
                                  T *k_cache, T *v_cache, const int64_t *cache_strides, const int64_t *slots,      \
                                  int64_t num_slots, int block_size, int num_threads) {                            \
        rotary_write_kv<T>(qkv, qkv_stride, cos, sin, table_stride, q_out, rows, heads, kv_heads, dim, k_cache,      \
                           v_cache, cache_strides, slots, num_slots, block_size, num_threads);                     \
    }                                                                                                            \
    void silu_and_mul_##SUFFIX(const T *gate_up, int64_t in_stride, T *out, int64_t out_stride, int64_t rows,    \
                               int inner, int num_threads) {                                                     \
        silu_and_mul<T>(gate_up, in_stride, out, out_stride, rows, inner, num_threads);                          \
    }

ROW_OPS_ENTRY(f32, float)
ROW_OPS_ENTRY(bf16, bf16)

#define LORA_ENTRY(SUFFIX, T)                                                                                  \
    void lora_add_##SUFFIX(const T *x, int64_t x_stride, const T *a, int64_t a_slot_stride, const T *b,         \
                           int64_t b_slot_stride, int64_t b_stride, T *y, int64_t y_stride,                     \
                           const int32_t *segments, int num_segments, int in, int modules, int rank,             \
                           const int32_t *module_cols, int num_threads) {                                        \
        lora_add<T>(x, x_stride, a, a_slot_stride, b, b_slot_stride, b_stride, y, y_stride, segments,            \
                    num_segments, in, modules, rank, module_cols, num_threads);                                 \
    }

LORA_ENTRY(f32, float)
LORA_ENTRY(bf16, bf16)

void argmax_rows_f32(const float *x, int64_t row_stride, int64_t *out, int64_t rows, int64_t cols, int num_threads) {
    argmax_rows(x, row_stride, out, rows, cols, num_threads);
}

}  // extern "C"
