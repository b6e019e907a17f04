// CPU kernels for XLA:CPU behind jax.ffi (see ddd_jax/backends/cpu/kernels.py): small-M float32 matrix products and masked
// GQA attention over a stacked KV cache.
//
// ddd_linear: out[M, N] = x[M, K] @ W, where W is layer `layer` of a stacked weight:
//   trans = false: w [L, K, N]  (x @ w[layer], the decoder's layout)
//   trans = true:  w [L, N, K]  (x @ w[layer].T, output-embedding rows: lm_head, draft vocabulary)
// The layer is read inside the kernel, so no per-layer slice of a stacked weight is ever copied, and the weight
// is streamed from memory once for all M rows.
// ddd_linear_f16: the same with float16 weights (weight-only storage, widened exactly to float32 on load; float32
//   x, arithmetic and output), for weights where half the bytes matter more than their last bits (draft heads).
// ddd_linear_blocks: x @ W.T with W [L, N, K] kept as a GGUF file's Q4_1 / Q8_0 / Q4_0 blocks (weight-only; dequantized
//   exactly, four rows at a time (eight on AVX-512), into an L1 buffer that the float32 trans kernel reads:
//   bitwise that kernel's product of the dequantized weight). A 4-bit target reads ~1/6 of its float32 bytes per
//   forward.
// ddd_linear_qpanels_int8: x @ W over the quantized panels of ddd_linear_qpanels, their quants quad-major, by
//   integer dot products (rows of x
//   quantized per 32 values to int8, llama.cpp's arithmetic; AVX-512 VNNI, AVX-VNNI or AVX2 variants with the same
//   bits; see "int8 blocks" below for its own fixed order). Not the float32 product: the one kernel here whose
//   numerics below do not apply, though a row's result is still independent of the other rows.
// ddd_linear_qpanels_int8_greedy: the same product (bitwise) and each row's greedy token (an output projection).
// ddd_linear_qpanels_int8_group: x @ several such weights of x's K at once (q, k, v; gate, up): x quantized once,
//   one call; each output bitwise its weight's ddd_linear_qpanels_int8.
// ddd_attention: q [B, T, N, H] against layer `layer` of k, v [L, B, Kh, S, H] (head-major caches) under
//   mask [B, T, S].
//
// Numerics: float32 products and sums, each output element reduced in one fixed order that depends only on the
// reduced length (never on M, on how rows are tiled, or on how columns are split between threads):
//   trans = false: acc = fma(x[m,k], W[k,n], acc) for k = 0, 1, ..., K-1, starting from acc = 0;
//   trans = true:  eight lanes, lane j = fma chain over k = j, j+8, ... (k < K8 = K rounded down to 8), the lanes
//                  summed as ((l0+l4)+(l2+l6))+((l1+l5)+(l3+l7)), then fma over the tail k >= K8 in order;
//   attention:     per row and head, only the attended slots, in ascending slot order (see attend_rows).
// So a row gets bit-identical outputs whether it is computed alone (M=1) or among others (a verified tree).
//
// Instruction sets: AVX2 + FMA + F16C throughout; on CPUs with AVX-512 (F/VL/BW/DQ), x @ W of 3 to 85 rows uses
// 16-wide vectors (16 output columns per vector, the same per-element order), so the bits do not depend on the
// instruction set either. GGUF blocks (any number of rows) are dequantized 16 wide and multiplied with two weight
// rows' 8-lane chunks per 16-wide vector (the same lanes, sums and tails as nt_rows). That product measured no
// faster for the float32 lm_head at 5 rows, so float32 x @ W.T stays 8 wide. Attention's scores and p @ V take
// 16-wide vectors too (see attend_rows), again with the AVX2 path's bits.
//
// Threads: work is split into column chunks (attention: rows) handed out through an atomic counter; the calling
// thread works too and then waits only for chunks another thread has started. Helpers are our own threads that
// spin briefly between products and back off to the calling thread alone when they keep arriving late (see
// parallel_chunks).
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

#define DDD_AVX2 __attribute__((target("avx2,fma,f16c")))
#define DDD_UNROLL _Pragma("GCC unroll 16")
#define DDD_ROLLED _Pragma("GCC unroll 1")

namespace {

// Weights are float32 or float16 (`uint16_t` bits; weight-only storage, e.g. a draft head): a float16 weight is
// widened exactly to float32 as it is loaded, so every product is the float32 product of the widened weights, in
// the same summation order.
DDD_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
DDD_AVX2 inline __m256 load8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
DDD_AVX2 inline float load1(const float* p) { return *p; }
DDD_AVX2 inline float load1(const uint16_t* p) { return _cvtsh_ss(*p); }

constexpr int64_t kKBlock = 8;    // K rows of the weight swept per panel pass (8 interleaved streams)
constexpr int64_t kTile = 4096;   // floats of the accumulator tile (16 KiB: half of L1)

// ------------------------------------------------------------------------------------------- x @ W, W [K, N]
// MT rows x NV 8-wide column vectors of out, k in [k0, k1); acc starts from zero (first) or from out.
// pf > 0: also prefetch the panel's row k + pf for each row k (rows < kmax), i.e. a later K block, so the
// weight stream keeps coming from memory while this block computes.
template <int MT, int NV, class W>
DDD_AVX2 inline void nn_tile(const float* x, int64_t ldx, const W* w, int64_t ldw, float* out, int64_t ldo,
                             int64_t k0, int64_t k1, bool first, int64_t pf = 0, int64_t kmax = 0) {
  __m256 acc[MT][NV];
  DDD_UNROLL for (int r = 0; r < MT; ++r)
    DDD_UNROLL for (int v = 0; v < NV; ++v)
      acc[r][v] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(out + r * ldo + 8 * v);
  constexpr int kBytes = NV * 8 * sizeof(W);  // of one panel row
  const W* wk = w + k0 * ldw;
  for (int64_t k = k0; k < k1; ++k, wk += ldw) {
    if (pf && k + pf < kmax) {
      const char* p = reinterpret_cast<const char*>(wk + pf * ldw);
      DDD_UNROLL for (int b = 0; b < kBytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
      _mm_prefetch(p + kBytes - 4, _MM_HINT_T0);
    }
    __m256 wv[NV];
    DDD_UNROLL for (int v = 0; v < NV; ++v) wv[v] = load8(wk + 8 * v);
    DDD_UNROLL for (int r = 0; r < MT; ++r) {
      const __m256 b = _mm256_broadcast_ss(x + r * ldx + k);
      DDD_UNROLL for (int v = 0; v < NV; ++v) acc[r][v] = _mm256_fmadd_ps(b, wv[v], acc[r][v]);
    }
  }
  DDD_UNROLL for (int r = 0; r < MT; ++r)
    DDD_UNROLL for (int v = 0; v < NV; ++v) _mm256_storeu_ps(out + r * ldo + 8 * v, acc[r][v]);
}

// Scalar columns (N not a multiple of 8): the same fma chain, one element at a time.
template <class W>
DDD_AVX2 inline void nn_scalar(const float* x, int64_t ldx, const W* w, int64_t ldw, float* out, int64_t ldo,
                               int64_t rows, int64_t cols, int64_t k0, int64_t k1, bool first) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      float acc = first ? 0.0f : out[r * ldo + c];
      for (int64_t k = k0; k < k1; ++k) acc = __builtin_fmaf(x[r * ldx + k], load1(w + k * ldw + c), acc);
      out[r * ldo + c] = acc;
    }
}

// How many K blocks ahead the first row tile prefetches: at one or two rows (memory-bound) two blocks, so more of
// the weight stream is in flight (cost curve on the 2-core Xeon VM, runs/s11, two alternating runs, 15 repeats:
// t(1) 25.9-26.0 -> 24.6-24.9 ms; 3, 4 and 6 blocks 24.7-25.3 ms); one block otherwise.
inline int64_t nn_prefetch_blocks(int64_t M) { return M <= 2 ? 2 : 1; }

template <int NV, class W>
DDD_AVX2 inline void nn_rows(const float* x, int64_t ldx, const W* w, int64_t ldw, float* out, int64_t ldo,
                             int64_t M, int64_t k0, int64_t k1, bool first, int64_t kmax) {
  // NV=8 (one or two rows): 8 independent fma chains per row; NV=3: 4 x 3 accumulators + 3 weights + 1 broadcast
  constexpr int MT = NV >= 8 ? 1 : 4;
  const int64_t ahead = nn_prefetch_blocks(M) * (k1 - k0);
  int64_t m = 0;
  for (; m + MT <= M; m += MT)  // the first row tile prefetches a later K block of this panel
    nn_tile<MT, NV, W>(x + m * ldx, ldx, w, ldw, out + m * ldo, ldo, k0, k1, first, m == 0 ? ahead : 0, kmax);
  const int64_t pf = m == 0 ? ahead : 0;
  const float* xm = x + m * ldx;
  float* om = out + m * ldo;
  switch (M - m) {
    case 5: nn_tile<5, NV, W>(xm, ldx, w, ldw, om, ldo, k0, k1, first, pf, kmax); break;
    case 4: nn_tile<4, NV, W>(xm, ldx, w, ldw, om, ldo, k0, k1, first, pf, kmax); break;
    case 3: nn_tile<3, NV, W>(xm, ldx, w, ldw, om, ldo, k0, k1, first, pf, kmax); break;
    case 2: nn_tile<2, NV, W>(xm, ldx, w, ldw, om, ldo, k0, k1, first, pf, kmax); break;
    case 1: nn_tile<1, NV, W>(xm, ldx, w, ldw, om, ldo, k0, k1, first, pf, kmax); break;
    default: break;
  }
}


// ------------------------------------------------------------- x @ W on AVX-512 (3+ rows: the arithmetic-bound case)
// At one or two rows the product is bound by memory and the AVX2 panels above keep up with it; from three rows on
// the FMA units bound it (five rows use each weight five times), and 16-wide vectors double what one instruction
// does. Each output element is still acc = fma(x[m,k], W[k,n], acc) over k = 0, 1, ... in order, so the results
// are bit-identical to the AVX2 path (the lanes of a vector are independent output columns).
#define DDD_AVX512 __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,f16c")))

DDD_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
DDD_AVX512 inline __m512 load16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// l2: the prefetches go to L2 (_MM_HINT_T1) instead of L1 (see kL2PrefetchRows).
template <int MT, int NV, class W>
DDD_AVX512 inline void nn_tile512(const float* x, int64_t ldx, const W* w, int64_t ldw, float* out, int64_t ldo,
                                  int64_t k0, int64_t k1, bool first, int64_t pf, int64_t kmax, bool l2) {
  __m512 acc[MT][NV];
  DDD_UNROLL for (int r = 0; r < MT; ++r)
    DDD_UNROLL for (int v = 0; v < NV; ++v)
      acc[r][v] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(out + r * ldo + 16 * v);
  constexpr int kBytes = NV * 16 * sizeof(W);  // of one panel row
  const W* wk = w + k0 * ldw;
  for (int64_t k = k0; k < k1; ++k, wk += ldw) {
    if (pf && k + pf < kmax) {
      const char* p = reinterpret_cast<const char*>(wk + pf * ldw);
      if (l2) {
        DDD_UNROLL for (int b = 0; b < kBytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T1);
        _mm_prefetch(p + kBytes - 4, _MM_HINT_T1);
      } else {
        DDD_UNROLL for (int b = 0; b < kBytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
        _mm_prefetch(p + kBytes - 4, _MM_HINT_T0);
      }
    }
    __m512 wv[NV];
    DDD_UNROLL for (int v = 0; v < NV; ++v) wv[v] = load16(wk + 16 * v);
    DDD_UNROLL for (int r = 0; r < MT; ++r) {
      const __m512 b = _mm512_set1_ps(x[r * ldx + k]);
      DDD_UNROLL for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_fmadd_ps(b, wv[v], acc[r][v]);
    }
  }
  DDD_UNROLL for (int r = 0; r < MT; ++r)
    DDD_UNROLL for (int v = 0; v < NV; ++v) _mm512_storeu_ps(out + r * ldo + 16 * v, acc[r][v]);
}

// From this many rows on, the next K block is prefetched into L2 rather than L1: the rows' compute then covers the
// L2 -> L1 trip, and the prefetched lines do not evict the accumulator tile and the rows of x from L1. Set at load
// (ddd_cpu_supported): 6 on Intel, 1 (always L2) on AMD; DDD_JAX_L2_PREFETCH_ROWS=n overrides (panel-major
// products prefetch at one or two rows only: np_chunk512). Prefetches only:
// the arithmetic, and so the bits, do not depend on it.
// - The 2-core Xeon VM (runs/s11, before panels; target forward at 256 cached tokens, two alternating runs each,
//   L1 -> L2): t(8) 31.9-32.2 -> 30.6-31.1 ms, t(16) 41.5-41.7 -> 39.0-39.5 ms; t(5), t(6) unchanged; t(4)
//   26.1-26.7 -> 27.4-27.8 ms.
// - The 2-core AMD EPYC (Zen 4) VM (runs/s16, panels; 8 interleaved rounds in one process, median ms, threshold
//   6 -> 1): t(1) 23.6 -> 20.1, t(2) 22.3 -> 20.1, t(4) 27.1 -> 21.4; t(6), t(8), t(16) unchanged within noise. At
//   one row the L1 prefetches (16 K rows ahead) lose even when a column block's panels fit L1.
int64_t g_l2_prefetch_rows = 6;

// All M rows of one panel of NV vectors: tiles of up to 8 rows (8 x 3 accumulators + 3 weights + 1 broadcast of
// the 32 registers); the first tile prefetches the panel's next K block.
// ahead: the K rows the first tile prefetches ahead of the one it computes.
template <int NV, class W>
DDD_AVX512 inline void nn_rows512(const float* x, int64_t ldx, const W* w, int64_t ldw, float* out, int64_t ldo,
                                  int64_t M, int64_t k0, int64_t k1, bool first, int64_t kmax, int64_t ahead) {
  const bool l2 = M >= g_l2_prefetch_rows;
  for (int64_t m = 0; m < M; m += 8) {
    const int64_t pf = m == 0 ? ahead : 0;
    const float* xm = x + m * ldx;
    float* om = out + m * ldo;
    switch (std::min<int64_t>(8, M - m)) {
      case 8: nn_tile512<8, NV, W>(xm, ldx, w, ldw, om, ldo, k0, k1, first, pf, kmax, l2); break;
      case 7: nn_tile512<7, NV, W>(xm, ldx, w, ldw, om, ldo, k0, k1, first, pf, kmax, l2); break;
      case 6: nn_tile512<6, NV, W>(xm, ldx, w, ldw, om, ldo, k0, k1, first, pf, kmax, l2); break;
      case 5: nn_tile512<5, NV, W>(xm, ldx, w, ldw, om, ldo, k0, k1, first, pf, kmax, l2); break;
      case 4: nn_tile512<4, NV, W>(xm, ldx, w, ldw, om, ldo, k0, k1, first, pf, kmax, l2); break;
      case 3: nn_tile512<3, NV, W>(xm, ldx, w, ldw, om, ldo, k0, k1, first, pf, kmax, l2); break;
      case 2: nn_tile512<2, NV, W>(xm, ldx, w, ldw, om, ldo, k0, k1, first, pf, kmax, l2); break;
      case 1: nn_tile512<1, NV, W>(xm, ldx, w, ldw, om, ldo, k0, k1, first, pf, kmax, l2); break;
      default: break;
    }
  }
}

bool g_avx512 = false;  // set at load (ddd_cpu_supported); DDD_JAX_NO_AVX512=1 keeps the AVX2 path

// An environment switch: set to anything but "" or "0".
inline bool env_set(const char* name) {
  const char* v = std::getenv(name);
  return v && *v && std::strcmp(v, "0") != 0;
}
constexpr int64_t kPanel512 = 48;  // columns of one AVX-512 panel (3 vectors)

// Whether x @ W of M rows takes the AVX-512 path (column chunks then come in multiples of kPanel512): 3 to 85 rows,
// so that one panel of every row fits the accumulator tile (M x kPanel512 <= kTile).
inline bool nn_wide(int64_t M) { return g_avx512 && M > 2 && M * kPanel512 <= kTile; }

template <class W>
DDD_AVX512 void nn_block512(const float* x, int64_t K, const W* wc, int64_t N, float* tile, int64_t CB, int64_t M,
                            int64_t k0, int64_t k1, bool first, int64_t cw) {
  int64_t n = 0;
  const int64_t ahead = k1 - k0;
  for (; n + kPanel512 <= cw; n += kPanel512)
    nn_rows512<3>(x, K, wc + n, N, tile + n, CB, M, k0, k1, first, K, ahead);
  for (; n + 16 <= cw; n += 16) nn_rows512<1>(x, K, wc + n, N, tile + n, CB, M, k0, k1, first, K, ahead);
  for (; n + 8 <= cw; n += 8) nn_rows<1>(x, K, wc + n, N, tile + n, CB, M, k0, k1, first, K);
  if (n < cw) nn_scalar(x, K, wc + n, N, tile + n, CB, M, cw - n, k0, k1, first);
}

// Columns [n0, n1) of out, all M rows. Column blocks small enough that their M rows of out stay in L1; within one,
// K is walked in blocks of KB rows and each block is swept panel by panel, so the weight is read as KB
// interleaved sequential streams (one per row) -- what the hardware prefetchers follow -- and the accumulators
// are reloaded from L1 once per KB rows.
template <class W>
DDD_AVX2 void nn_chunk_rows(const float* x, const W* w, float* out, int64_t M, int64_t K, int64_t N,
                            int64_t n0, int64_t n1) {  // M <= 128
  const int64_t KB = kKBlock;
  const bool wide = nn_wide(M);
  const int64_t panel = M <= 2 ? 64 : wide ? kPanel512 : 24;
  const int64_t CB = std::max<int64_t>(panel, (kTile / M) / panel * panel);  // M x CB floats <= 16 KiB
  // The accumulators live in a dense local tile (row stride CB, not N): with N a multiple of 1024 bytes' worth,
  // out's rows would all map to the same few L1 sets.
  alignas(64) float tile[kTile];  // M x CB <= kTile for every M <= 128
  for (int64_t c0 = n0; c0 < n1; c0 += CB) {
    const int64_t c1 = std::min(n1, c0 + CB), cw = c1 - c0;
    const W* wc = w + c0;
    for (int64_t k0 = 0; k0 < K; k0 += KB) {
      const int64_t k1 = std::min(K, k0 + KB);
      const bool first = k0 == 0;
      if (wide) {
        nn_block512(x, K, wc, N, tile, CB, M, k0, k1, first, cw);
        continue;
      }
      int64_t n = 0;
      if (M <= 2)  // memory-bound: wide panels, more independent chains
        for (; n + 64 <= cw; n += 64) nn_rows<8>(x, K, wc + n, N, tile + n, CB, M, k0, k1, first, K);
      for (; n + 24 <= cw; n += 24) nn_rows<3>(x, K, wc + n, N, tile + n, CB, M, k0, k1, first, K);
      for (; n + 8 <= cw; n += 8) nn_rows<1>(x, K, wc + n, N, tile + n, CB, M, k0, k1, first, K);
      if (n < cw) nn_scalar(x, K, wc + n, N, tile + n, CB, M, cw - n, k0, k1, first);
    }
    for (int64_t m = 0; m < M; ++m) std::copy(tile + m * CB, tile + m * CB + cw, out + m * N + c0);
  }
}

template <class W>
DDD_AVX2 void nn_chunk(const float* x, const W* w, float* out, int64_t M, int64_t K, int64_t N, int64_t n0,
                       int64_t n1) {
  for (int64_t m0 = 0; m0 < M; m0 += 128)
    nn_chunk_rows(x + m0 * K, w, out + m0 * N, std::min<int64_t>(128, M - m0), K, N, n0, n1);
}

// ------------------------------------------------------------------- x @ W, W panel-major [P, K, 48] (panels)
// Panel p holds columns [48p, 48p + 48) of the logical [K, N] weight row by row (zeros past N in the last panel;
// `ddd_jax.backends.cpu.panels`), so a panel's K block is one contiguous run of memory and a product reads the weight as a few
// sequential streams -- what the hardware prefetchers follow -- instead of KB rows N floats apart. Each output
// element is the same fma chain over k = 0, 1, ... as nn_chunk's, so the product is bitwise the unpacked
// weight's, for every M. The seven products of 30 SmolLM2-sized layers streamed from memory on the 2-core Xeon VM
// (two alternating runs): 1 row 19.5-19.8 -> 13.8-13.9 ms, 5 rows 20.6-20.7 -> 15.5-15.7 ms, 16 rows 26.7-27.0 ->
// 19.6-20.0 ms.
constexpr int64_t kPanelRows = 64;   // rows per pass (prefill in passes; the AVX2 path's tile holds 64 x 48)

// AVX-512: a row tile's accumulators stay in registers over all of K. Tile by tile (8 rows x 48 columns: 24
// accumulators + 3 weights + 1 broadcast of the 32 registers), a panel is swept start to end: the first tile
// streams it from memory, the later ones read it back from L2 (K x 192 bytes: 108 KiB at K = 576, 288 KiB at
// K = 1536; 3 weight loads a k step against 24 FMAs). The blocked sweep this replaces (K blocks of 8 or 16 rows,
// the accumulators stored and reloaded once a block) spent ~25% of a tile on its entry and exit: one core, a
// 576 x 768 weight in L2, 16 rows: 85.6 -> 115.3 GFLOP/s of the 117 this core's FMAs peak at; streamed from
// memory 74 -> 99 (runs/s17). Each output element is the same fma chain over k = 0, 1, ... as before, so the bits
// are unchanged.
// (The blocked sweep was kept on the Xeon VM, where K blocks up to 576 rows were tried inside it: not retried there.)
// Target forward at 256 cached tokens on the Zen 4 VM, processes alternating, medians (runs/s17/ab.py): t(8)
// 22.4 -> 18.6 ms, t(16) 34.9 -> 28.4, t(32) 69.0 -> 52.4; t(1) unchanged within noise.
// At one or two rows (bound by memory) the tile prefetches each weight row g_panel_ahead rows (of 48 floats)
// ahead, on through the chunk's next panels (one contiguous run); from three rows on nothing: the hardware
// prefetchers follow the stream, and the prefetch instructions only take load slots. Target forward, 256 cached
// tokens, processes alternating, 8 rounds each, medians: 0 / 32 rows ahead at every row count, t(1) 17.94 / 17.63
// ms, t(7) 18.85 / 19.12, t(16) 28.58 / 29.07 (each within noise, but 32 won t(1) 5 of 8 rounds and lost t(7) 7 of
// 8); 16 ahead cost t(8) 2.4 ms, 64 gained nothing. One core, 16 rows, a 576 x 768 weight streamed from memory:
// no prefetches 96-97 GFLOP/s, 32 ahead into L2 93-94, into L1 81-85; prefetching the next panel from the second
// tile on (so the first tile of the next finds it in L2) 86-87. Prefetches move no bits.
int64_t g_panel_ahead = 32;

// One K row of an MT x 16 NV tile (48 columns: NV = 3): acc[r][v] = fma(x[r, k], w[v], acc[r][v]) -- the step
// every panel tile takes (float32 / float16 panels of either width, and quantized panels after dequantizing the
// row), so they share one summation order.
template <int MT, int NV = 3>
DDD_AVX512 inline void tile_row512(__m512 (&acc)[MT][NV], const float* x, int64_t ldx, int64_t k,
                                   const __m512 (&wv)[NV]) {
  DDD_UNROLL for (int r = 0; r < MT; ++r) {
    const __m512 b = _mm512_set1_ps(x[r * ldx + k]);
    DDD_UNROLL for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_fmadd_ps(b, wv[v], acc[r][v]);
  }
}

template <int MT>
DDD_AVX512 inline void tile_store512(const __m512 (&acc)[MT][3], float* out, int64_t ldo) {
  DDD_UNROLL for (int r = 0; r < MT; ++r)
    DDD_UNROLL for (int v = 0; v < 3; ++v) _mm512_storeu_ps(out + r * ldo + 16 * v, acc[r][v]);
}

template <int MT, class W>
DDD_AVX512 inline void np_tile512(const float* x, int64_t ldx, const W* w, int64_t K, float* out, int64_t ldo,
                                  const W* pf, int64_t n_pf, bool l2) {
  __m512 acc[MT][3];
  DDD_UNROLL for (int r = 0; r < MT; ++r)
    DDD_UNROLL for (int v = 0; v < 3; ++v) acc[r][v] = _mm512_setzero_ps();
  constexpr int kBytes = kPanel512 * sizeof(W);  // of one panel row
  const W* wk = w;
  for (int64_t k = 0; k < K; ++k, wk += kPanel512, pf += kPanel512) {
    if (k < n_pf) {
      const char* p = reinterpret_cast<const char*>(pf);
      if (l2) {
        DDD_UNROLL for (int b = 0; b < kBytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T1);
      } else {
        DDD_UNROLL for (int b = 0; b < kBytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
      }
    }
    __m512 wv[3];
    DDD_UNROLL for (int v = 0; v < 3; ++v) wv[v] = load16(wk + 16 * v);
    tile_row512<MT>(acc, x, ldx, k, wv);
  }
  tile_store512<MT>(acc, out, ldo);
}

// The 8-row tiles over one 48-column panel, columns [c0, c0 + cw) (cw <= 48) of out [M, N]: tile(mt, m, o, ldo)
// for the tile of rows [m, m + mt) -- mt an std::integral_constant<int, 1..8> (the register tile's rows as a
// template argument) -- writing into out, or into part [8, 48] and then copied when the panel holds fewer than 48
// columns of out (the last panel of a padded product). For the float32 / float16, quantized and screen panels.
template <class Tile>
inline void panel_row_tiles(int64_t M, int64_t N, int64_t c0, int64_t cw, float* out, float* part, Tile&& tile) {
  for (int64_t m = 0; m < M; m += 8) {
    const int64_t rows = std::min<int64_t>(8, M - m);
    float* o = cw < kPanel512 ? part : out + m * N + c0;
    const int64_t ldo = cw < kPanel512 ? kPanel512 : N;
    switch (rows) {
      case 8: tile(std::integral_constant<int, 8>(), m, o, ldo); break;
      case 7: tile(std::integral_constant<int, 7>(), m, o, ldo); break;
      case 6: tile(std::integral_constant<int, 6>(), m, o, ldo); break;
      case 5: tile(std::integral_constant<int, 5>(), m, o, ldo); break;
      case 4: tile(std::integral_constant<int, 4>(), m, o, ldo); break;
      case 3: tile(std::integral_constant<int, 3>(), m, o, ldo); break;
      case 2: tile(std::integral_constant<int, 2>(), m, o, ldo); break;
      default: tile(std::integral_constant<int, 1>(), m, o, ldo); break;
    }
    if (cw < kPanel512)
      for (int64_t r = 0; r < rows; ++r)
        std::copy(part + r * kPanel512, part + r * kPanel512 + cw, out + (m + r) * N + c0);
  }
}

// Columns [n0, n1) of out (n0 a multiple of 48), all M rows, panel by panel.
template <class W>
DDD_AVX512 void np_chunk512(const float* x, const W* w, float* out, int64_t M, int64_t K, int64_t N, int64_t n0,
                            int64_t n1) {
  const bool l2 = M >= g_l2_prefetch_rows;
  const W* end = w + (n1 + kPanel512 - 1) / kPanel512 * kPanel512 * K;  // past this chunk's last panel
  alignas(64) float part[8 * kPanel512];  // the last panel's tiles when it holds fewer than 48 columns of out
  for (int64_t c0 = n0; c0 < n1; c0 += kPanel512) {
    const W* wp = w + c0 * K;
    const int64_t cw = std::min<int64_t>(kPanel512, n1 - c0);
    panel_row_tiles(M, N, c0, cw, out, part, [&](auto mt, int64_t m, float* o, int64_t ldo) {
      // one or two rows: prefetch each row's successor g_panel_ahead rows on, up to the chunk's end
      const W* pf = wp + g_panel_ahead * kPanel512;
      const int64_t n_pf =
          m == 0 && M <= 2 && g_panel_ahead > 0 ? std::clamp<int64_t>((end - pf) / kPanel512, 0, K) : 0;
      np_tile512<decltype(mt)::value, W>(x + m * K, K, wp, K, o, ldo, pf, n_pf, l2);
    });
  }
}

// Which row counts of a 48-column panel product take the AVX-512 tiles (bit M set: M rows, M < 64; from 64 rows
// always): all by default. Both paths give the same bits, so the choice is speed only; `kernels.choose_panel_tiles`
// times them on the host at hand and sets it (on some Intel Xeons the AVX2 tiles win at several rows).
uint64_t g_panel512_rows = ~0ull;
inline bool panel512(int64_t M) { return M >= 64 || ((g_panel512_rows >> M) & 1); }

// W: float, or uint16_t (float16 panels: a draft head's weight-only storage, widened exactly as they are read).
// pw: the panel width, 48 or 16 (kPanel16; on AVX-512 those take p16_chunk instead).
template <class W>
DDD_AVX2 void np_chunk_rows(const float* x, const W* w, float* out, int64_t M, int64_t K, int64_t N,
                            int64_t n0, int64_t n1, int64_t pw = kPanel512) {  // M <= kPanelRows, n0 % 48 == 0
  if (g_avx512 && pw == kPanel512 && panel512(M)) return np_chunk512<W>(x, w, out, M, K, N, n0, n1);
  const int64_t CB = std::max<int64_t>(kPanel512, (kTile / M) / kPanel512 * kPanel512);  // M x CB <= kTile
  const int64_t KB = kKBlock;
  alignas(64) float tile[kTile];
  for (int64_t c0 = n0; c0 < n1; c0 += CB) {
    const int64_t cw = std::min(n1, c0 + CB) - c0;
    const int64_t panels = (cw + pw - 1) / pw;  // the last may hold zero columns past N
    const W* wc = w + c0 * K;
    for (int64_t k0 = 0; k0 < K; k0 += KB) {
      const int64_t k1 = std::min(K, k0 + KB);
      const bool first = k0 == 0;
      for (int64_t p = 0; p < panels; ++p) {
        const W* wp = wc + p * pw * K;
        if (pw == kPanel512) {  // AVX2: two 24-column halves a panel (16 ymm registers)
          nn_rows<3, W>(x, K, wp, kPanel512, tile + p * kPanel512, CB, M, k0, k1, first, K);
          nn_rows<3, W>(x, K, wp + 24, kPanel512, tile + p * kPanel512 + 24, CB, M, k0, k1, first, K);
        } else {
          nn_rows<2, W>(x, K, wp, pw, tile + p * pw, CB, M, k0, k1, first, K);
        }
      }
    }
    for (int64_t m = 0; m < M; ++m) std::copy(tile + m * CB, tile + m * CB + cw, out + m * N + c0);
  }
}

// ------------------------------------------------------------- x @ W, W panel-major [P, K, 16] (AVX-512 hosts)
// The same product over 16-column panels (`ddd_jax.backends.cpu.panels`, on request: panels=16): one panel is one vector
// wide, so a tile can hold 16 rows of it -- 16 FMAs for every weight vector loaded, each weight read from memory
// once for all 16 rows -- where the 48-column tile holds 8 rows and a 16-row product streams each panel from memory
// for its first 8 rows (bound by memory there: 4 FMAs a weight byte) and reads it back from L2 for the next 8.
//   - Fewer than g_p16_tall_rows rows: MT x 48 tiles over three consecutive panels (three streams K x 16 floats
//     apart; the 48-column tile's arithmetic); at one or two rows each stream is prefetched g_p16_ahead K rows
//     ahead into L2.
//   - From g_p16_tall_rows rows: 16-row x 16-column tiles over x packed k-major (xp [ceil(M / 16), K, 16]: one
//     cache line of x per K row), each panel prefetched g_p16_tall_ahead K rows ahead into L2 by its first tile.
// Every output element is the same fma chain over k = 0, 1, ... from zero as np_chunk512's, so the product is
// bitwise the 48-column panels' (and the row-major weight's), for every M and either path.
// Both cores, 40 weights streamed from memory, interleaved rounds (runs/s19/t16c.cc, medians, GFLOP/s, 48 -> 16
// columns): 576 x 1536 at 16 rows 104-134 -> 117-175, 12 rows 79-119 -> 129-159; 1536 x 576 at 16 rows 90-132
// -> 115-178; 576 x 49152 (the lm_head) at 16 rows 151 -> 179; one row 12-18 -> 12-19 (within noise). In the
// target forward (both layouts in one process, calls interleaved, 30 rounds x 3, runs/s19/wab1.py): t(12) -7 to
// -17%, t(16) -9 to -18%, t(1) 0 to -6%, t(3) to t(8) +-0 to +5% (three streams against one: the 3- to 8-row
// tiles read three panels where the 48-column tile reads one); DDD with the tuned CPU tree (<= 8 tokens), 40
// MT-bench turns interleaved in one process: 87.8 -> 83.7 tok/s. So 48 columns stay the default.
constexpr int64_t kPanel16 = 16;
int64_t g_p16_tall_rows = 9;
int64_t g_p16_pf_rows = 2;  // up to this many rows the three-panel tiles prefetch
int64_t g_p16_ahead = 32;
int64_t g_p16_tall_ahead = 64;

// Columns [c0, c0 + cw) of out's MT rows from acc (cw <= 16 NS): the vectors past cw masked off.
template <int MT, int NS>
DDD_AVX512 inline void p16_store(const __m512 (&acc)[MT][NS], float* out, int64_t ldo, int64_t cw) {
  DDD_UNROLL for (int v = 0; v < NS; ++v) {
    const int64_t n = std::clamp<int64_t>(cw - 16 * v, 0, 16);
    if (n == 16) {
      DDD_UNROLL for (int r = 0; r < MT; ++r) _mm512_storeu_ps(out + r * ldo + 16 * v, acc[r][v]);
    } else if (n > 0) {
      const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
      DDD_UNROLL for (int r = 0; r < MT; ++r) _mm512_mask_storeu_ps(out + r * ldo + 16 * v, mask, acc[r][v]);
    }
  }
}

// MT rows x NS panels (streams K x 16 apart); the first n_pf K rows prefetch each stream g_p16_ahead rows ahead.
template <int MT, int NS, class W>
DDD_AVX512 inline void p16_tile(const float* x, int64_t ldx, const W* w, int64_t K, float* out, int64_t ldo,
                                int64_t cw, int64_t n_pf) {
  __m512 acc[MT][NS];
  DDD_UNROLL for (int r = 0; r < MT; ++r)
    DDD_UNROLL for (int v = 0; v < NS; ++v) acc[r][v] = _mm512_setzero_ps();
  const W* ws[NS];
  DDD_UNROLL for (int v = 0; v < NS; ++v) ws[v] = w + v * K * kPanel16;
  const int64_t ahead = g_p16_ahead * kPanel16;
  for (int64_t k = 0; k < K; ++k) {
    if (k < n_pf) {
      DDD_UNROLL for (int v = 0; v < NS; ++v) _mm_prefetch(reinterpret_cast<const char*>(ws[v] + ahead), _MM_HINT_T1);
    }
    __m512 wv[NS];
    DDD_UNROLL for (int v = 0; v < NS; ++v) {
      wv[v] = load16(ws[v]);
      ws[v] += kPanel16;
    }
    tile_row512<MT, NS>(acc, x, ldx, k, wv);
  }
  p16_store<MT, NS>(acc, out, ldo, cw);
}

// MT (<= 16) rows of x packed k-major (xp[k * 16 + r]) x one panel; the first n_pf K rows prefetch the panel
// g_p16_tall_ahead rows ahead.
template <int MT, class W>
DDD_AVX512 inline void p16_tall(const float* xp, const W* w, int64_t K, float* out, int64_t ldo, int64_t cw,
                                int64_t n_pf) {
  __m512 acc[MT][1];
  DDD_UNROLL for (int r = 0; r < MT; ++r) acc[r][0] = _mm512_setzero_ps();
  const int64_t ahead = g_p16_tall_ahead * kPanel16;
  const W* wk = w;
  const float* xk = xp;
  for (int64_t k = 0; k < K; ++k, wk += kPanel16, xk += kPanel16) {
    if (k < n_pf) _mm_prefetch(reinterpret_cast<const char*>(wk + ahead), _MM_HINT_T1);
    const __m512 wv = load16(wk);
    DDD_UNROLL for (int r = 0; r < MT; ++r) acc[r][0] = _mm512_fmadd_ps(_mm512_set1_ps(xk[r]), wv, acc[r][0]);
  }
  p16_store<MT, 1>(acc, out, ldo, cw);
}

DDD_AVX512 inline void transpose_keys16(const float* k, int64_t ldk, int64_t n, int64_t H, float* kt);

// xp [ceil(M / 16), K, 16]: xp[(g K + k) 16 + i] = x[(16 g + i) K + k], zeros for rows past M (16 x 16 transposes;
// K % 16 columns one at a time).
DDD_AVX512 void pack_x16(const float* x, int64_t M, int64_t K, float* xp) {
  const int64_t K16 = K & ~int64_t(15);
  for (int64_t g = 0; g * 16 < M; ++g) {
    const int64_t n = std::min<int64_t>(16, M - 16 * g);
    const float* xg = x + 16 * g * K;
    float* pg = xp + g * K * 16;
    if (K16) transpose_keys16(xg, K, n, K16, pg);
    for (int64_t k = K16; k < K; ++k)
      for (int64_t i = 0; i < 16; ++i) pg[k * 16 + i] = i < n ? xg[i * K + k] : 0.0f;
  }
}

template <int NS, class W>
DDD_AVX512 inline void p16_rows(const float* x, int64_t K, const W* wp, float* out, int64_t N, int64_t M, int64_t cw,
                                int64_t n_pf) {
  for (int64_t m = 0; m < M; m += 8) {
    const float* xm = x + m * K;
    float* o = out + m * N;
    const int64_t pf = m == 0 ? n_pf : 0;
    switch (std::min<int64_t>(8, M - m)) {
      case 8: p16_tile<8, NS, W>(xm, K, wp, K, o, N, cw, pf); break;
      case 7: p16_tile<7, NS, W>(xm, K, wp, K, o, N, cw, pf); break;
      case 6: p16_tile<6, NS, W>(xm, K, wp, K, o, N, cw, pf); break;
      case 5: p16_tile<5, NS, W>(xm, K, wp, K, o, N, cw, pf); break;
      case 4: p16_tile<4, NS, W>(xm, K, wp, K, o, N, cw, pf); break;
      case 3: p16_tile<3, NS, W>(xm, K, wp, K, o, N, cw, pf); break;
      case 2: p16_tile<2, NS, W>(xm, K, wp, K, o, N, cw, pf); break;
      default: p16_tile<1, NS, W>(xm, K, wp, K, o, N, cw, pf); break;
    }
  }
}

// Columns [n0, n1) of out (n0 a multiple of 16), all M rows; xp: x packed by pack_x16 for 16-row tiles (the
// caller packs it from g_p16_tall_rows rows on), or null for three-panel tiles.
template <class W>
DDD_AVX512 void p16_chunk(const float* x, const float* xp, const W* w, float* out, int64_t M, int64_t K, int64_t N,
                          int64_t n0, int64_t n1) {
  const W* end = w + (n1 + kPanel16 - 1) / kPanel16 * kPanel16 * K;  // past this chunk's last panel
  if (xp == nullptr) {
    for (int64_t c0 = n0; c0 < n1; c0 += 3 * kPanel16) {
      const int64_t cw = std::min<int64_t>(3 * kPanel16, n1 - c0);
      const int64_t ns = (cw + kPanel16 - 1) / kPanel16;
      const W* wp = w + c0 * K;
      // up to g_p16_pf_rows rows (two): while the last stream's prefetches stay inside the chunk
      const int64_t n_pf = M <= g_p16_pf_rows && g_p16_ahead > 0
                               ? std::clamp<int64_t>((end - (wp + (ns - 1) * K * kPanel16)) / kPanel16 - g_p16_ahead,
                                                     0, K)
                               : 0;
      float* o = out + c0;
      if (ns == 3) p16_rows<3, W>(x, K, wp, o, N, M, cw, n_pf);
      else if (ns == 2) p16_rows<2, W>(x, K, wp, o, N, M, cw, n_pf);
      else p16_rows<1, W>(x, K, wp, o, N, M, cw, n_pf);
    }
    return;
  }
  for (int64_t c0 = n0; c0 < n1; c0 += kPanel16) {
    const int64_t cw = std::min<int64_t>(kPanel16, n1 - c0);
    const W* wp = w + c0 * K;
    const int64_t n_pf = g_p16_tall_ahead > 0 ? std::clamp<int64_t>((end - wp) / kPanel16 - g_p16_tall_ahead, 0, K) : 0;
    for (int64_t m = 0; m < M; m += 16) {
      const float* xm = xp + (m / 16) * K * kPanel16;
      float* o = out + m * N + c0;
      const int64_t pf = m == 0 ? n_pf : 0;
      switch (std::min<int64_t>(16, M - m)) {
#define DDD_TALL(R) \
  case R: p16_tall<R, W>(xm, wp, K, o, N, cw, pf); break;
        DDD_TALL(16) DDD_TALL(15) DDD_TALL(14) DDD_TALL(13) DDD_TALL(12) DDD_TALL(11) DDD_TALL(10) DDD_TALL(9)
        DDD_TALL(8) DDD_TALL(7) DDD_TALL(6) DDD_TALL(5) DDD_TALL(4) DDD_TALL(3) DDD_TALL(2)
#undef DDD_TALL
        default: p16_tall<1, W>(xm, wp, K, o, N, cw, pf); break;
      }
    }
  }
}

// ------------------------------------------------------------------------------------------- x @ W.T, W [N, K]
DDD_AVX2 inline float hsum8(__m256 a) {
  // ((l0+l4)+(l2+l6))+((l1+l5)+(l3+l7))
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));  // [l0+l4, l1+l5, l2+l6, l3+l7]
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));                                            // [(04)+(26), (15)+(37), ..]
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

template <int MT, int NT, class W>
DDD_AVX2 inline void nt_tile(const float* x, int64_t ldx, const W* w, int64_t ldw, float* out, int64_t ldo,
                             int64_t K) {
  __m256 acc[MT][NT];
  DDD_UNROLL for (int r = 0; r < MT; ++r)
    DDD_UNROLL for (int j = 0; j < NT; ++j) acc[r][j] = _mm256_setzero_ps();
  const int64_t K8 = K & ~int64_t(7);
  for (int64_t k = 0; k < K8; k += 8) {
    __m256 wv[NT];
    DDD_UNROLL for (int j = 0; j < NT; ++j) wv[j] = load8(w + j * ldw + k);
    DDD_UNROLL for (int r = 0; r < MT; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * ldx + k);
      DDD_UNROLL for (int j = 0; j < NT; ++j) acc[r][j] = _mm256_fmadd_ps(xv, wv[j], acc[r][j]);
    }
  }
  DDD_UNROLL for (int r = 0; r < MT; ++r)
    DDD_UNROLL for (int j = 0; j < NT; ++j) {
      float s = hsum8(acc[r][j]);
      for (int64_t k = K8; k < K; ++k) s = __builtin_fmaf(x[r * ldx + k], load1(w + j * ldw + k), s);
      out[r * ldo + j] = s;
    }
}

template <int NT, class W>
DDD_AVX2 inline void nt_rows(const float* x, int64_t K, const W* w, float* out, int64_t N, int64_t M) {
  constexpr int MT = 3;  // 3 x 4 accumulators
  int64_t m = 0;
  for (; m + MT <= M; m += MT) nt_tile<MT, NT, W>(x + m * K, K, w, K, out + m * N, N, K);
  if (M - m == 2) nt_tile<2, NT, W>(x + m * K, K, w, K, out + m * N, N, K);
  if (M - m == 1) nt_tile<1, NT, W>(x + m * K, K, w, K, out + m * N, N, K);
}

// The weight rows are one sequential stream, but at M > 1 each group of four rows takes long enough to compute that
// the hardware prefetchers fall behind: the next group (4K weights, 9 KiB in float32) is prefetched into L1 while
// this one computes (the 2-core EPYC, lm_head 49152 x 576 in float32, four alternating runs each: M=4 3.10-3.29
// -> 2.92-2.96 ms, M=2 2.51-2.61 -> 2.38-2.45 ms, M=1 unchanged at 2.2 ms). Arithmetic unchanged.
template <class W>
DDD_AVX2 inline void prefetch_l1(const W* p, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p);
  const int64_t bytes = n * int64_t(sizeof(W));
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(c + b, _MM_HINT_T0);
}

template <class W>
DDD_AVX2 void nt_chunk(const float* x, const W* w, float* out, int64_t M, int64_t K, int64_t N, int64_t n0,
                       int64_t n1) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) {
    if (n + 8 <= n1) prefetch_l1(w + (n + 4) * K, 4 * K);
    nt_rows<4>(x, K, w + n * K, out + n, N, M);
  }
  for (; n < n1; ++n) nt_rows<1>(x, K, w + n * K, out + n, N, M);
}

// x @ W.T on AVX-512 (GGUF blocks): one 16-wide vector holds two weight rows' 8-lane chunks, so each
// output keeps the AVX2 path's eight lanes (lane j: the fma chain over k = j, j+8, ...) and the same lane sum and
// tail: bit-identical to nt_rows.
DDD_AVX512 inline __m512 load_pair(const float* a, const float* b) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(a)), _mm256_loadu_ps(b), 1);
}

// MT rows of x against NP pairs of weight rows (2 * NP outputs per row).
template <int MT, int NP>
DDD_AVX512 inline void nt_tile512(const float* x, int64_t ldx, const float* w, int64_t ldw, float* out, int64_t ldo,
                                  int64_t K) {
  __m512 acc[MT][NP];
  DDD_UNROLL for (int r = 0; r < MT; ++r)
    DDD_UNROLL for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_setzero_ps();
  const int64_t K8 = K & ~int64_t(7);
  for (int64_t k = 0; k < K8; k += 8) {
    __m512 wv[NP];
    DDD_UNROLL for (int p = 0; p < NP; ++p) wv[p] = load_pair(w + 2 * p * ldw + k, w + (2 * p + 1) * ldw + k);
    DDD_UNROLL for (int r = 0; r < MT; ++r) {
      const __m512 xv = _mm512_broadcast_f32x8(_mm256_loadu_ps(x + r * ldx + k));
      DDD_UNROLL for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_fmadd_ps(xv, wv[p], acc[r][p]);
    }
  }
  DDD_UNROLL for (int r = 0; r < MT; ++r)
    DDD_UNROLL for (int p = 0; p < NP; ++p) {
      const __m256 half[2] = {_mm512_castps512_ps256(acc[r][p]), _mm512_extractf32x8_ps(acc[r][p], 1)};
      DDD_UNROLL for (int h = 0; h < 2; ++h) {
        const float* wj = w + (2 * p + h) * ldw;
        float s = hsum8(half[h]);
        for (int64_t k = K8; k < K; ++k) s = __builtin_fmaf(x[r * ldx + k], wj[k], s);
        out[r * ldo + 2 * p + h] = s;
      }
    }
}

// All M rows against 2 * NP weight rows: row tiles of up to 6 (6 x 4 accumulators + 4 weights + 1 row of x).
template <int NP>
DDD_AVX512 void nt_rows512(const float* x, int64_t K, const float* w, float* out, int64_t N, int64_t M) {
  for (int64_t m = 0; m < M; m += 6) {
    const float* xm = x + m * K;
    float* om = out + m * N;
    switch (std::min<int64_t>(6, M - m)) {
      case 6: nt_tile512<6, NP>(xm, K, w, K, om, N, K); break;
      case 5: nt_tile512<5, NP>(xm, K, w, K, om, N, K); break;
      case 4: nt_tile512<4, NP>(xm, K, w, K, om, N, K); break;
      case 3: nt_tile512<3, NP>(xm, K, w, K, om, N, K); break;
      case 2: nt_tile512<2, NP>(xm, K, w, K, om, N, K); break;
      case 1: nt_tile512<1, NP>(xm, K, w, K, om, N, K); break;
      default: break;
    }
  }
}

// ------------------------------------------------------------------------------ x @ W.T, W [N, K] as GGUF blocks
// Weight-only block quantization kept from a GGUF file (llama.cpp's layouts), one row of K/32 blocks per output:
//   Q4_1 (20 bytes): float16 d, float16 m, 16 bytes of nibbles; element j < 16 is the low nibble of byte j, element
//                    16 + j its high nibble; w = d * q + m
//   Q8_0 (34 bytes): float16 d, 32 int8; w = d * q
//   Q4_0 (18 bytes): float16 d, 16 bytes of nibbles as Q4_1's; w = d * (q - 8)
// In float32 d * q is exact (an 11-bit by 4- or 8-bit product), so fma(d, q, m) and d * q round exactly as
// gguf's dequantizer, (d * qs) + m, qs * d and d * (qs - 8) in float32, does: the weights are the dequantized float32 weights,
// bit for bit. Four rows (eight on AVX-512) are dequantized into an L1 buffer and multiplied by the float32
// transposed kernel (nt_rows, or nt_rows512 with the same bits), so the product is bitwise that kernel's product
// of the dequantized [N, K] weight -- for every M.
constexpr int64_t kQK = 32;
constexpr int64_t kQ4_1 = 0, kQ8_0 = 1, kQ4_0 = 2;  // the `kind` attribute (ddd_jax.backends.cpu.quant.KINDS)
constexpr int64_t kind_bytes(int64_t kind) { return kind == kQ4_1 ? 20 : kind == kQ8_0 ? 34 : 18; }

DDD_AVX2 inline float f16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

DDD_AVX2 inline void dequant_q4_1(const uint8_t* b, int64_t nb, float* dst) {
  const __m128i nib = _mm_set1_epi8(0x0F);
  for (int64_t i = 0; i < nb; ++i, b += 20, dst += kQK) {
    const __m256 d = _mm256_set1_ps(f16_at(b)), m = _mm256_set1_ps(f16_at(b + 2));
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4));
    const __m128i lo = _mm_and_si128(q, nib), hi = _mm_and_si128(_mm_srli_epi16(q, 4), nib);
    const __m128i part[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    DDD_UNROLL for (int j = 0; j < 4; ++j)
      _mm256_storeu_ps(dst + 8 * j, _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(part[j])), m));
  }
}

DDD_AVX2 inline void dequant_q4_0(const uint8_t* b, int64_t nb, float* dst) {
  const __m128i nib = _mm_set1_epi8(0x0F);
  const __m256i eight = _mm256_set1_epi32(8);
  for (int64_t i = 0; i < nb; ++i, b += 18, dst += kQK) {
    const __m256 d = _mm256_set1_ps(f16_at(b));
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2));
    const __m128i lo = _mm_and_si128(q, nib), hi = _mm_and_si128(_mm_srli_epi16(q, 4), nib);
    const __m128i part[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    DDD_UNROLL for (int j = 0; j < 4; ++j) {
      const __m256i qi = _mm256_sub_epi32(_mm256_cvtepu8_epi32(part[j]), eight);
      _mm256_storeu_ps(dst + 8 * j, _mm256_mul_ps(d, _mm256_cvtepi32_ps(qi)));
    }
  }
}

DDD_AVX2 inline void dequant_q8_0(const uint8_t* b, int64_t nb, float* dst) {
  for (int64_t i = 0; i < nb; ++i, b += 34, dst += kQK) {
    const __m256 d = _mm256_set1_ps(f16_at(b));
    DDD_UNROLL for (int j = 0; j < 4; ++j) {
      const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * j));
      _mm256_storeu_ps(dst + 8 * j, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d));
    }
  }
}

// The same dequantization with 16-wide vectors (AVX-512): the same fma(d, q, m) / d * q per element, so the same
// floats.
DDD_AVX512 void dequant_q4_1_512(const uint8_t* b, int64_t nb, float* dst) {
  const __m128i nib = _mm_set1_epi8(0x0F);
  for (int64_t i = 0; i < nb; ++i, b += 20, dst += kQK) {
    const __m512 d = _mm512_set1_ps(f16_at(b)), m = _mm512_set1_ps(f16_at(b + 2));
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4));
    const __m128i lo = _mm_and_si128(q, nib), hi = _mm_and_si128(_mm_srli_epi16(q, 4), nib);
    _mm512_storeu_ps(dst, _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)), m));
    _mm512_storeu_ps(dst + 16, _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)), m));
  }
}

DDD_AVX512 void dequant_q4_0_512(const uint8_t* b, int64_t nb, float* dst) {
  const __m128i nib = _mm_set1_epi8(0x0F);
  const __m512i eight = _mm512_set1_epi32(8);
  for (int64_t i = 0; i < nb; ++i, b += 18, dst += kQK) {
    const __m512 d = _mm512_set1_ps(f16_at(b));
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2));
    const __m128i lo = _mm_and_si128(q, nib), hi = _mm_and_si128(_mm_srli_epi16(q, 4), nib);
    _mm512_storeu_ps(dst, _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(lo), eight))));
    _mm512_storeu_ps(dst + 16,
                     _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(hi), eight))));
  }
}

DDD_AVX512 void dequant_q8_0_512(const uint8_t* b, int64_t nb, float* dst) {
  for (int64_t i = 0; i < nb; ++i, b += 34, dst += kQK) {
    const __m512 d = _mm512_set1_ps(f16_at(b));
    DDD_UNROLL for (int j = 0; j < 2; ++j) {
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2 + 16 * j));
      _mm512_storeu_ps(dst + 16 * j, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), d));
    }
  }
}

template <int64_t KIND>
DDD_AVX2 void nt_chunk_blocks(const float* x, const uint8_t* w, float* out, int64_t M, int64_t K, int64_t N,
                              int64_t n0, int64_t n1) {
  const int64_t nb = K / kQK, rb = nb * kind_bytes(KIND);
  thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < 8 * K) buf.resize(8 * K);
  float* bp = buf.data();
  // AVX-512: 16-wide dequantization and products, eight weight rows a group, at every row count. At one row that
  // is the vanilla decode: over blocks 93.8-95.9 -> 110.7-112.8 tok/s (16 MT-bench turns, two alternating runs per
  // library, the 2-core Xeon VM); an earlier try of 16-wide dequantization with the 8-wide products was slower.
  const bool wide = g_avx512;
  auto dequant = [&](int64_t n, float* dst) DDD_AVX2 {
    if (wide)
      (KIND == kQ4_1 ? dequant_q4_1_512 : KIND == kQ4_0 ? dequant_q4_0_512 : dequant_q8_0_512)(w + n * rb, nb, dst);
    else if (KIND == kQ4_1)
      dequant_q4_1(w + n * rb, nb, dst);
    else if (KIND == kQ4_0)
      dequant_q4_0(w + n * rb, nb, dst);
    else
      dequant_q8_0(w + n * rb, nb, dst);
  };
  int64_t n = n0;
  if (wide) {  // eight rows at a time through 16-wide vectors (the same bits)
    for (; n + 8 <= n1; n += 8) {
      for (int64_t j = 0; j < 8; ++j) dequant(n + j, bp + j * K);
      nt_rows512<4>(x, K, bp, out + n, N, M);
    }
  }
  for (; n + 4 <= n1; n += 4) {
    for (int64_t j = 0; j < 4; ++j) dequant(n + j, bp + j * K);
    nt_rows<4, float>(x, K, bp, out + n, N, M);
  }
  for (; n < n1; ++n) {
    dequant(n, bp);
    nt_rows<1, float>(x, K, bp, out + n, N, M);
  }
}

// ------------------------------------------------------------------------------------------- threads
// Chunks [0, n_chunks) handed out through an atomic counter. The caller works too and then waits only for chunks
// that were started, so a helper that never gets the CPU cannot block the call (it finds no chunk left).
struct Job {
  int64_t n_chunks = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  virtual void chunk(int64_t c) = 0;
  virtual ~Job() = default;
  void run() {
    for (;;) {
      const int64_t c = next.fetch_add(1, std::memory_order_relaxed);
      if (c >= n_chunks) return;
      chunk(c);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

template <class Fn>
struct FnJob final : Job {
  Fn fn;
  FnJob(Fn f, int64_t n) : fn(std::move(f)) { n_chunks = n; }
  void chunk(int64_t c) override { fn(c); }
};

// Helper threads of our own (threads - 1 of them, started on first use). Waking an XLA pool thread per product
// costs tens of microseconds on a busy machine -- a decode step runs ~300 products -- so helpers spin briefly on
// a generation counter after each job (products of one forward follow each other within microseconds) and only
// then sleep on a condition variable.
class Helpers {
 public:
  static Helpers& get() {
    static Helpers* h = new Helpers();  // never destroyed: helpers may outlive static destruction
    return *h;
  }

  void ensure(int64_t n) {
    if (started_.load(std::memory_order_acquire) >= n) return;
    std::lock_guard<std::mutex> lock(mu_);
    for (int64_t i = started_.load(); i < n; ++i) std::thread([this] { loop(); }).detach();
    started_.store(std::max<int64_t>(n, started_.load()), std::memory_order_release);
  }

  void publish(std::shared_ptr<Job> job) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      job_ = std::move(job);
      gen_.fetch_add(1, std::memory_order_release);
    }
    if (sleeping_.load(std::memory_order_acquire) > 0) cv_.notify_all();
  }

  void retire(const std::shared_ptr<Job>& job) {
    std::lock_guard<std::mutex> lock(mu_);
    if (job_ == job) job_.reset();
  }

 private:
  void loop() {
    uint64_t seen = gen_.load(std::memory_order_acquire);
    for (;;) {
      int spins = 0;
      while (gen_.load(std::memory_order_acquire) == seen && spins < kSpins) {
        _mm_pause();
        ++spins;
      }
      if (gen_.load(std::memory_order_acquire) == seen) {
        std::unique_lock<std::mutex> lock(mu_);
        sleeping_.fetch_add(1, std::memory_order_acq_rel);
        cv_.wait(lock, [&] { return gen_.load(std::memory_order_acquire) != seen; });
        sleeping_.fetch_sub(1, std::memory_order_acq_rel);
      }
      std::shared_ptr<Job> job;
      {
        std::lock_guard<std::mutex> lock(mu_);
        seen = gen_.load(std::memory_order_acquire);
        job = job_;
      }
      if (job) job->run();
    }
  }

  static constexpr int kSpins = 2000;  // ~50 us of pause instructions
  std::mutex mu_;
  std::condition_variable cv_;
  std::shared_ptr<Job> job_;
  std::atomic<uint64_t> gen_{0};
  std::atomic<int64_t> sleeping_{0};
  std::atomic<int64_t> started_{0};
};

int64_t g_max_threads = 0;  // 0: the XLA pool's size

int64_t pool_threads(ffi::ThreadPool& pool) {
  int64_t threads = pool.num_threads();
  if (g_max_threads > 0) threads = std::min(threads, g_max_threads);
  return std::max<int64_t>(threads, 1);
}

// On an oversubscribed machine a helper is often preempted in the middle of a chunk and the caller then waits a
// whole time slice for it (and spinning helpers eat the process's share of the CPU). So: when the caller keeps
// waiting for helpers for more than a quarter of a call, products run on the calling thread alone for the next
// kCooldown calls, then helpers are tried again.
std::atomic<int64_t> g_cooldown{0};
std::atomic<int64_t> g_strikes{0};
constexpr int64_t kCooldown = 512;

template <class Fn>
void parallel_chunks(int64_t threads, int64_t n_chunks, Fn fn) {
  if (threads > 1 && n_chunks > 1 && g_cooldown.load(std::memory_order_relaxed) > 0) {
    g_cooldown.fetch_sub(1, std::memory_order_relaxed);
    threads = 1;
  }
  if (threads <= 1 || n_chunks <= 1) {
    for (int64_t c = 0; c < n_chunks; ++c) fn(c);
    return;
  }
  Helpers& helpers = Helpers::get();
  helpers.ensure(threads - 1);
  auto job = std::make_shared<FnJob<Fn>>(std::move(fn), n_chunks);
  const auto t0 = std::chrono::steady_clock::now();
  helpers.publish(job);
  job->run();
  const auto t1 = std::chrono::steady_clock::now();
  while (job->done.load(std::memory_order_acquire) < n_chunks) _mm_pause();
  const auto t2 = std::chrono::steady_clock::now();
  helpers.retire(job);
  if ((t2 - t1) * 4 > (t2 - t0)) {
    if (g_strikes.fetch_add(1, std::memory_order_relaxed) + 1 >= 4) {
      g_strikes.store(0, std::memory_order_relaxed);
      g_cooldown.store(kCooldown, std::memory_order_relaxed);
    }
  } else if (g_strikes.load(std::memory_order_relaxed) > 0) {
    g_strikes.fetch_sub(1, std::memory_order_relaxed);
  }
}

// dynamic_slice semantics for the layer index of a stacked weight [L, ...]
int64_t layer_index(ffi::Buffer<ffi::S32>& layer, int64_t L) {
  const int64_t l = layer.element_count() ? layer.typed_data()[0] : 0;
  return std::clamp<int64_t>(l, 0, std::max<int64_t>(L - 1, 0));
}

// out[M, N] by column chunks [n0, n1) (fn(n0, n1)), each a multiple of `align` columns, handed out in order and
// shrinking: each takes 1 / (2 * threads) of the columns still left (at least `align`), so the thread that finishes
// first waits at most about one small chunk for the others at the end -- guided self-scheduling -- and a preempted
// helper still leaves the rest to the caller. One thread for small products (not worth waking one: ~10 us). Empty
// outputs return at once, K = 0 gives zeros. Chunks only split columns: every output is the same fma chain.
template <class Fn>
void for_column_chunks(ffi::ThreadPool& pool, int64_t M, int64_t K, int64_t N, int64_t align, float* out, Fn fn) {
  if (M == 0 || N == 0) return;
  if (K == 0) {
    std::fill(out, out + M * N, 0.0f);
    return;
  }
  int64_t threads = pool_threads(pool);
  if (M * K * N < (int64_t(1) << 16)) threads = 1;
  const int64_t units = (N + align - 1) / align;
  if (threads == 1 || units == 1) {
    fn(0, N);
    return;
  }
  constexpr int64_t kMaxChunks = 64;
  int64_t starts[kMaxChunks + 1];  // chunk c: columns [starts[c], starts[c + 1]) (in units of align)
  int64_t n_chunks = 0;
  for (int64_t u = 0; u < units; ++n_chunks) {
    starts[n_chunks] = u;
    const int64_t left = units - u;
    u += n_chunks + 1 == kMaxChunks ? left : std::max<int64_t>(1, (left + 2 * threads - 1) / (2 * threads));
  }
  starts[n_chunks] = units;
  parallel_chunks(threads, n_chunks, [=](int64_t c) {
    fn(starts[c] * align, std::min(N, starts[c + 1] * align));
  });
}

template <ffi::DataType WT>
ffi::Error Linear(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<WT> w,
                  ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> out, bool trans) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (wd.size() != 3 || xd.size() < 1) return ffi::Error::InvalidArgument("ddd_linear: w must be [L, ., .]");
  const int64_t K = xd.back();
  const int64_t M = K ? x.element_count() / K : 0;
  const int64_t L = wd[0];
  const int64_t N = trans ? wd[1] : wd[2];
  if ((trans ? wd[2] : wd[1]) != K) return ffi::Error::InvalidArgument("ddd_linear: K mismatch");
  if (out->element_count() != M * N) return ffi::Error::InvalidArgument("ddd_linear: bad output size");
  float* o = out->typed_data();
  const float* xp = x.typed_data();
  const auto* wp = w.typed_data() + layer_index(layer, L) * K * N;
  // columns a multiple of 24 (AVX-512: 48; trans: 4)
  for_column_chunks(pool, M, K, N, trans ? 4 : nn_wide(M) ? kPanel512 : 24, o, [=](int64_t n0, int64_t n1) {
    if (trans)
      nt_chunk(xp, wp, o, M, K, N, n0, n1);
    else
      nn_chunk(xp, wp, o, M, K, N, n0, n1);
  });
  return ffi::Error::Success();
}

// x [..., K] float32, w [L, N, K/32 * bytes] uint8 (GGUF blocks, see nt_chunk_blocks), layer [] -> out [..., N]
ffi::Error LinearBlocks(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                        ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> out, int64_t kind) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (kind != kQ4_1 && kind != kQ8_0 && kind != kQ4_0)
    return ffi::Error::InvalidArgument("ddd_linear_blocks: unknown kind");
  if (wd.size() != 3 || xd.size() < 1) return ffi::Error::InvalidArgument("ddd_linear_blocks: w must be [L, N, B]");
  const int64_t K = xd.back();
  const int64_t M = K ? x.element_count() / K : 0;
  const int64_t L = wd[0], N = wd[1];
  if (K % kQK != 0 || wd[2] != K / kQK * kind_bytes(kind))
    return ffi::Error::InvalidArgument("ddd_linear_blocks: K does not match the weight's blocks");
  if (out->element_count() != M * N) return ffi::Error::InvalidArgument("ddd_linear_blocks: bad output size");
  float* o = out->typed_data();
  const float* xp = x.typed_data();
  const uint8_t* wp = w.typed_data() + layer_index(layer, L) * N * wd[2];
  for_column_chunks(pool, M, K, N, g_avx512 ? 8 : 4, o, [=](int64_t n0, int64_t n1) {
    if (kind == kQ4_1)
      nt_chunk_blocks<kQ4_1>(xp, wp, o, M, K, N, n0, n1);
    else if (kind == kQ4_0)
      nt_chunk_blocks<kQ4_0>(xp, wp, o, M, K, N, n0, n1);
    else
      nt_chunk_blocks<kQ8_0>(xp, wp, o, M, K, N, n0, n1);
  });
  return ffi::Error::Success();
}

// x [..., K] float32 @ w [L, P, K, 48] float32 or float16 (panel-major, see np_chunk_rows) at `layer` -> out
// [..., N], 48 (P - 1) < N <= 48 P. Every M (rows in passes of kPanelRows).
template <class W>
struct PanelProduct {
  int64_t M = 0, K = 0, N = 0, P = 0, pw = kPanel512;  // pw: the panel width, 48 or 16
  const float* x = nullptr;
  const float* xp = nullptr;  // 16-column panels on AVX-512 from g_p16_tall_rows rows: x packed by pack_x16
                              // (null: three-panel tiles)
  const W* w = nullptr;       // the layer's panels
  float* out = nullptr;
  void columns(int64_t n0, int64_t n1) const {  // columns [n0, n1) of every row
    if (pw == kPanel16 && g_avx512) return p16_chunk<W>(x, xp, w, out, M, K, N, n0, n1);
    for (int64_t m0 = 0; m0 < M; m0 += kPanelRows)
      np_chunk_rows<W>(x + m0 * K, w, out + m0 * N, std::min(kPanelRows, M - m0), K, N, n0, n1, pw);
  }
};

// The product's shapes checked and *p filled in for LinearPanels / LinearPanelsGreedy: the layer's panels, their
// width, and (16-column panels, from g_p16_tall_rows rows) x packed for the 16-row tiles, once a call, by the caller.
template <ffi::DataType WT, class W>
ffi::Error panel_product(const std::string& name, ffi::Buffer<ffi::F32>& x, ffi::Buffer<WT>& w,
                         ffi::Buffer<ffi::S32>& layer, ffi::ResultBuffer<ffi::F32>& out, PanelProduct<W>* p) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  const auto od = out->dimensions();
  if (wd.size() != 4 || (wd[3] != kPanel512 && wd[3] != kPanel16) || xd.size() < 1 || od.size() < 1)
    return ffi::Error::InvalidArgument(name + ": w must be [L, P, K, 48] or [L, P, K, 16]");
  p->pw = wd[3];
  p->K = xd.back();
  p->M = p->K ? x.element_count() / p->K : 0;
  p->P = wd[1];
  p->N = od.back();
  if (wd[2] != p->K) return ffi::Error::InvalidArgument(name + ": K mismatch");
  if (p->N > p->P * p->pw || p->N <= (p->P - 1) * p->pw || out->element_count() != p->M * p->N)
    return ffi::Error::InvalidArgument(name + ": the output's columns do not match the panels");
  p->x = x.typed_data();
  p->w = w.typed_data() + layer_index(layer, wd[0]) * p->P * p->K * p->pw;
  p->out = out->typed_data();
  if (p->pw == kPanel16 && g_avx512 && p->M >= g_p16_tall_rows && p->K > 0) {
    thread_local std::vector<float> xp;  // the calling thread's; read by the helpers only during this call
    xp.resize(static_cast<size_t>((p->M + 15) / 16 * 16 * p->K));
    pack_x16(p->x, p->M, p->K, xp.data());
    p->xp = xp.data();
  }
  return ffi::Error::Success();
}

template <ffi::DataType WT>
ffi::Error LinearPanels(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<WT> w,
                        ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> out) {
  PanelProduct<ffi::NativeType<WT>> p;  // float, or uint16_t float16 bits
  if (ffi::Error e = panel_product(WT == ffi::F16 ? "ddd_linear_panels_f16" : "ddd_linear_panels", x, w, layer,
                                   out, &p);
      e.failure())
    return e;
  for_column_chunks(pool, p.M, p.K, p.N, kPanel512, p.out, [p](int64_t n0, int64_t n1) { p.columns(n0, n1); });
  return ffi::Error::Success();
}

// ---------------------------------------------------------- x @ W, W panel-major GGUF blocks ("quantized panels")
// The panels of np_chunk_rows, holding a GGUF file's blocks instead of floats (ddd_jax.backends.cpu.quant.BlockPanels): panel p,
// K block b (32 rows of K) is the 48 GGUF blocks of output columns [48p, 48p + 48) over those K rows, regrouped so
// that one K row of the panel is one contiguous run of bytes:
//   q4_1 (960 bytes): 48 float16 d, 48 float16 m, then qs [16][48] -- byte (j, c) is column c's GGUF byte j: its
//                     low nibble is K row 32b + j, its high nibble K row 32b + 16 + j;
//   q4_0 (864 bytes): 48 float16 d, qs [16][48] as q4_1's;
//   q8_0 (1632 bytes): 48 float16 d, qs [32][48] int8 -- byte (j, c) is column c's K row 32b + j.
// A weight is dequantized exactly as the GGUF row kernels do (fma(d, q, m); d * (q - 8); q * d: exact, see
// dequant_q4_1) and each output element is the same fma chain over k = 0, 1, ... as np_chunk_rows's, so the product
// is bitwise the float32 panels' product of the dequantized weight -- the float32 target's product, for a GGUF
// target -- for every M, while a forward reads ~1/6 of the bytes.
// AVX-512, up to g_qp_tile_rows rows: tiles of 8 rows, each dequantizing the panel in registers as the K rows go by.
// Otherwise (and on AVX2) each panel is dequantized once into a float panel in L2 and np_chunk_rows runs over it.
constexpr int64_t qp_bytes(int64_t kind) { return kPanel512 * kind_bytes(kind); }  // a panel's K block
constexpr int64_t qp_qs(int64_t kind) { return kind == kQ4_1 ? 4 * kPanel512 : 2 * kPanel512; }  // qs offset

// Row tiles up to this many rows dequantize a 4-bit K block's two halves from one widening of its bytes (see
// qp_tile512). One widening for two K rows instead of two saves instructions where the dequantization bounds the
// tile; at more rows the FMAs bound it and the stash in L1 costs. SmolLM2's 576 x 1536 Q4_1 panels streamed from
// memory, one thread (runs/s29/qb.cc, 2026-11-26): one row 17.0 -> 19.3 G multiply-adds a second (two processes at
// once: 16.8-16.9 -> 18.7-19.0 each), two rows 26.3 -> 29.3, four 36-37 -> 37-38, seven 40-43 either way. Vanilla
// decoding over SmolLM2's quantized panels (`ddd-jax bench --op-profile --gguf-blocks`, two runs each): the layer
// products 4.13-4.25 -> 3.89-3.90 ms a token. The target forward (`bench/kernel_ab.py --gguf-blocks`, 12
// alternating rounds, a slow-memory stretch): t(1) 6.76 -> 6.68 ms, faster in 9 of 12 rounds, within the rounds'
// +-0.6 ms spread. (Shared at seven rows too, t(7) read 14.28 -> 14.65 ms over 6 rounds.)
constexpr int kQpSharedRows = 4;

// A 4-bit weight from its nibble's float qf (q for q4_1, q - 8 for q4_0): fma(d, q, m) or d * (q - 8), exactly.
template <int64_t KIND>
DDD_AVX512 inline __m512 q4_weight(__m512 d, __m512 m, __m512 qf) {
  return KIND == kQ4_1 ? _mm512_fmadd_ps(d, qf, m) : _mm512_mul_ps(d, qf);
}

template <int MT, int64_t KIND>
DDD_AVX512 inline void qp_tile512(const float* x, int64_t ldx, const uint8_t* wp, int64_t nb, float* out,
                                  int64_t ldo) {
  __m512 acc[MT][3];
  DDD_UNROLL for (int r = 0; r < MT; ++r)
    DDD_UNROLL for (int v = 0; v < 3; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, wp += qp_bytes(KIND)) {
    __m512 d[3], m[3];
    DDD_UNROLL for (int v = 0; v < 3; ++v) {
      d[v] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + 32 * v)));
      m[v] = KIND == kQ4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + 96 + 32 * v)))
                           : _mm512_setzero_ps();
    }
    const uint8_t* qs = wp + qp_qs(KIND);
    const float* xb = x + b * kQK;
    if (KIND == kQ8_0 || MT > kQpSharedRows) {
      constexpr int kHalves = KIND == kQ8_0 ? 1 : 2, kRows = KIND == kQ8_0 ? 32 : 16;
      const __m512i nib = _mm512_set1_epi32(0x0F), eight = _mm512_set1_epi32(8);
      DDD_UNROLL for (int h = 0; h < kHalves; ++h) {
        for (int j = 0; j < kRows; ++j) {
          __m512 wv[3];
          DDD_UNROLL for (int v = 0; v < 3; ++v) {
            const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + j * kPanel512 + 16 * v));
            if (KIND == kQ8_0) {
              wv[v] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw)), d[v]);
            } else {
              __m512i q = _mm512_cvtepu8_epi32(raw);
              q = h ? _mm512_srli_epi32(q, 4) : _mm512_and_si512(q, nib);
              wv[v] = q4_weight<KIND>(d[v], m[v], _mm512_cvtepi32_ps(KIND == kQ4_0 ? _mm512_sub_epi32(q, eight) : q));
            }
          }
          tile_row512<MT>(acc, xb, ldx, h * 16 + j, wv);
        }
      }
      continue;
    }
    // 4-bit kinds, up to kQpSharedRows rows: byte j of a column holds K rows j (low nibble) and 16 + j (high).
    // Each byte is loaded and widened once: the low row goes into the tile at once, the high row is dequantized
    // beside it into `hi`, which the tile reads after row 15 -- the same K order, the same floats (a nibble's float
    // is exact whether it comes from the table or from a conversion). Larger tiles, and q8_0, take the branch
    // above: each K row's bytes loaded and widened on their own. The low nibble's float is looked up by the low 4
    // bits of each lane (vpermps reads no others, so it needs no mask).
    const __m512 tbl = KIND == kQ4_0 ? _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7)
                                     : _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    alignas(64) float hi[16][kPanel512];  // K rows 16..31 of the block, dequantized with rows 0..15
    for (int j = 0; j < 16; ++j) {
      __m512 wv[3];
      DDD_UNROLL for (int v = 0; v < 3; ++v) {
        const __m512i q =
            _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + j * kPanel512 + 16 * v)));
        __m512i qh = _mm512_srli_epi32(q, 4);
        if (KIND == kQ4_0) qh = _mm512_sub_epi32(qh, _mm512_set1_epi32(8));
        wv[v] = q4_weight<KIND>(d[v], m[v], _mm512_permutexvar_ps(q, tbl));
        _mm512_store_ps(hi[j] + 16 * v, q4_weight<KIND>(d[v], m[v], _mm512_cvtepi32_ps(qh)));
      }
      tile_row512<MT>(acc, xb, ldx, j, wv);
    }
    for (int j = 0; j < 16; ++j) {
      __m512 wv[3];
      DDD_UNROLL for (int v = 0; v < 3; ++v) wv[v] = _mm512_load_ps(hi[j] + 16 * v);
      tile_row512<MT>(acc, xb, ldx, 16 + j, wv);
    }
  }
  tile_store512<MT>(acc, out, ldo);
}

// One panel (nb K blocks) into dst [K][48] float32: the floats the tile above computes in registers.
template <int64_t KIND>
DDD_AVX2 void qp_dequant_panel(const uint8_t* wp, int64_t nb, float* dst) {
  const __m256i nib = _mm256_set1_epi32(0x0F), eight = _mm256_set1_epi32(8);
  for (int64_t b = 0; b < nb; ++b, wp += qp_bytes(KIND)) {
    __m256 d[6], m[6];
    DDD_UNROLL for (int v = 0; v < 6; ++v) {
      d[v] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wp + 16 * v)));
      m[v] = KIND == kQ4_1 ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wp + 96 + 16 * v)))
                           : _mm256_setzero_ps();
    }
    const uint8_t* qs = wp + qp_qs(KIND);
    constexpr int kHalves = KIND == kQ8_0 ? 1 : 2, kRows = KIND == kQ8_0 ? 32 : 16;
    for (int h = 0; h < kHalves; ++h)
      for (int j = 0; j < kRows; ++j, dst += kPanel512)
        DDD_UNROLL for (int v = 0; v < 6; ++v) {
          const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + j * kPanel512 + 8 * v));
          __m256 w;
          if (KIND == kQ8_0) {
            w = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw)), d[v]);
          } else {
            __m256i q = _mm256_cvtepu8_epi32(raw);
            q = h ? _mm256_srli_epi32(q, 4) : _mm256_and_si256(q, nib);
            w = KIND == kQ4_1 ? _mm256_fmadd_ps(d[v], _mm256_cvtepi32_ps(q), m[v])
                              : _mm256_mul_ps(d[v], _mm256_cvtepi32_ps(_mm256_sub_epi32(q, eight)));
          }
          _mm256_storeu_ps(dst + 8 * v, w);
        }
  }
}

// AVX-512: up to this many rows, 8-row tiles dequantize in registers (each tile its own copy); more rows dequantize
// each panel once into L2. SmolLM2 over Q4_1 panels at 256 cached tokens, 6 interleaved rounds in one process,
// medians (runs/s18/qpt.py): in registers up to 8 / 16 rows, t(12) 28.9 / 26.0 ms, t(16) 35.2 / 31.5; up to 16 /
// 32 / 64 rows, t(24) 43.9 / 42.7 / 41.2, t(32) 56.2 / 57.1 / 56.9, t(64) 107 / 110 / 111.
int64_t g_qp_tile_rows = 24;

// Columns [n0, n1) of out (n0 a multiple of 48), all M rows, panel by panel.
template <int64_t KIND>
DDD_AVX2 void qp_chunk(const float* x, const uint8_t* w, float* out, int64_t M, int64_t K, int64_t N, int64_t n0,
                       int64_t n1) {
  const int64_t nb = K / kQK;
  thread_local std::vector<float> panel;
  alignas(64) float part[8 * kPanel512];  // the last panel's tile when it holds fewer than 48 columns of out
  for (int64_t c0 = n0; c0 < n1; c0 += kPanel512) {
    const uint8_t* wp = w + (c0 / kPanel512) * nb * qp_bytes(KIND);
    const int64_t cw = std::min<int64_t>(kPanel512, n1 - c0);
    if (g_avx512 && M <= g_qp_tile_rows) {
      panel_row_tiles(M, N, c0, cw, out, part, [&](auto mt, int64_t m, float* o, int64_t ldo) {
        qp_tile512<decltype(mt)::value, KIND>(x + m * K, K, wp, nb, o, ldo);
      });
      continue;
    }
    if (static_cast<int64_t>(panel.size()) < K * kPanel512) panel.resize(K * kPanel512);
    qp_dequant_panel<KIND>(wp, nb, panel.data());
    for (int64_t m0 = 0; m0 < M; m0 += kPanelRows)  // this one panel: out + c0 as columns [0, cw)
      np_chunk_rows<float>(x + m0 * K, panel.data(), out + m0 * N + c0, std::min(kPanelRows, M - m0), K, N, 0, cw);
  }
}

// x [..., K] float32 @ w [L, P, K / 32, 48 * block bytes] (quantized panels of `kind`) at `layer` -> out [..., N],
// 48 (P - 1) < N <= 48 P. Every M.
ffi::Error LinearQPanels(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                         ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> out, int64_t kind) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  const auto od = out->dimensions();
  if (kind != kQ4_1 && kind != kQ8_0 && kind != kQ4_0)
    return ffi::Error::InvalidArgument("ddd_linear_qpanels: unknown kind");
  if (wd.size() != 4 || wd[3] != qp_bytes(kind) || xd.size() < 1 || od.size() < 1)
    return ffi::Error::InvalidArgument("ddd_linear_qpanels: w must be [L, P, K / 32, 48 * block bytes]");
  const int64_t K = xd.back();
  const int64_t M = K ? x.element_count() / K : 0;
  const int64_t P = wd[1], N = od.back();
  if (K % kQK != 0 || wd[2] != K / kQK) return ffi::Error::InvalidArgument("ddd_linear_qpanels: K mismatch");
  if (N > P * kPanel512 || N <= (P - 1) * kPanel512 || out->element_count() != M * N)
    return ffi::Error::InvalidArgument("ddd_linear_qpanels: the output's columns do not match the panels");
  const float* xp = x.typed_data();
  const uint8_t* wp = w.typed_data() + layer_index(layer, wd[0]) * P * wd[2] * wd[3];
  float* o = out->typed_data();
  for_column_chunks(pool, M, K, N, kPanel512, o, [=](int64_t n0, int64_t n1) {
    if (kind == kQ4_1)
      qp_chunk<kQ4_1>(xp, wp, o, M, K, N, n0, n1);
    else if (kind == kQ4_0)
      qp_chunk<kQ4_0>(xp, wp, o, M, K, N, n0, n1);
    else
      qp_chunk<kQ8_0>(xp, wp, o, M, K, N, n0, n1);
  });
  return ffi::Error::Success();
}

// ---------------------------------------------------- x @ W, W quantized panels, integer products ("int8 blocks")
// The same quantized panels (and the same bytes) as LinearQPanels, multiplied as llama.cpp multiplies GGUF blocks:
// each row of x is quantized per 32 values (one K block) to int8 with a float32 scale, and every weight block meets
// its activation block in an exact integer dot product. Not the float32 product of the dequantized weight: the
// activations lose their low bits (relative error ~1e-2 of the products' magnitude), in exchange for integer
// instructions (`gguf_blocks="int8"`).
//
// Activations (i8_quantize_row, one implementation for every variant), per row and K block b of 32 values x_k:
//   amax = max |x_k|;  d = amax / 127;  id = d != 0 ? 1 / d : 0;  q_k = clamp(rint(x_k * id), -127, 127)
// (float32 operations; rint rounds half to even, as llama.cpp's AVX quantize_row_q8_0 / q8_1 do with
// _mm256_round_ps; its scalar reference rounds half away from zero -- the two differ only at exact halves). The
// quants stay in [-127, 127], so the AVX2 sign trick below never meets -128. Per block also s = sum q_k (int32) and
// ds = d * float(s) (float32, for Q4_1's min term).
// Weights, per output column c and block: integer quants w_k and float16 scale wd (and min wm): Q4_1 w = wd u + wm,
// Q4_0 w = wd (u - 8) (u the nibble, 0..15), Q8_0 w = wd q (q int8). The block's exact integer sum is
//   Q4_1: isum = sum u_k q_k     Q4_0: isum = sum u_k q_k - 8 s     Q8_0: isum = sum w_k q_k
// (|isum| <= 32 * 128 * 127 < 2^24, so float(isum) is exact) and every output element is reduced in one fixed order:
//   acc = 0; for b = 0, 1, ..., K/32 - 1:  acc = acc + float(isum) * (wd * d);  (Q4_1:) acc = acc + wm * ds
// -- float32 multiplies and adds, never fused (-ffp-contract=off; the intrinsics are plain mul / add), lanes being
// output columns. So a row's result depends on nothing but that row and the weight: not on the number of rows, the
// row tiles, the threads' column chunks, or the variant below (integer sums are exact in any order).
// Variants of the integer dot products (g_i8_variant, chosen at load: the best this CPU has; DDD_JAX_INT8_VARIANT
// forces one, kernels.int8_variant() names it):
//   avx512vnni: _mm512_dpbusd_epi32 (u8 x s8, four products per int32 lane); Q8_0 as (w ^ 0x80) = w + 128,
//               minus 128 s;
//   avxvnni:    the same with _mm256_dpbusd_avx_epi32 (compiled where the compiler knows AVX-VNNI);
//   avx2:       _mm256_maddubs_epi16 + _mm256_madd_epi16: a pair of products sums to int16 without saturating
//               (4-bit: 2 * 15 * 127 = 3810, and a block's eight quads of pairs still fit int16 before madd:
//               30480; Q8_0 by the sign trick |w| x (q sign(w)): 2 * 128 * 127 = 32512, widened quad by quad).
// Layout: the quantized panels above, but with each K block's quants quad-major (`BlockPanels.int8`, packed once
// at load): [nq / 4][48 columns][4] bytes, byte rows 4i .. 4i + 3 of one column side by side, so that one 32-bit lane
// holds what dpbusd / maddubs + madd reduce and a vector 16 (or 8) columns. A 4-bit byte row j holds K rows j (low
// nibble) and 16 + j (high), so quad i of bytes gives K rows 4i.. and 16 + 4i.. after a mask and a shift; a Q8_0 quad
// i is K rows 4i... The scales stay float16 (exactly widened in registers). The kernel reads the panels as they
// lie: no copy, no reordering per call.
#if defined(__clang__)
#define DDD_HAVE_AVXVNNI (__clang_major__ >= 12)
#elif defined(__GNUC__)
#define DDD_HAVE_AVXVNNI (__GNUC__ >= 11)
#else
#define DDD_HAVE_AVXVNNI 0
#endif
// (experiments/int8_emulation.cc defines both first: it runs these variants on any AVX2 CPU with emulated intrinsics)
#ifndef DDD_AVX512VNNI
#define DDD_AVX512VNNI __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx512vnni,avx2,fma,f16c")))
#endif
#ifndef DDD_AVXVNNI
#define DDD_AVXVNNI __attribute__((target("avxvnni,avx2,fma,f16c")))
#endif

constexpr int kI8Avx2 = 0, kI8AvxVnni = 1, kI8Avx512Vnni = 2;  // kernels.INT8_VARIANTS, in this order
int g_i8_variant = kI8Avx2;                                     // set at load (ddd_cpu_supported)

bool i8_supported(int v) {
  if (v == kI8Avx2) return true;
#if DDD_HAVE_AVXVNNI
  if (v == kI8AvxVnni) return __builtin_cpu_supports("avxvnni");
#endif
  if (v == kI8Avx512Vnni)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512vnni");
  return false;
}

constexpr int64_t kI8Quad = kPanel512 * 4;  // bytes of one quad of byte rows (48 columns x 4)
constexpr int kI8Rows = 8;                  // rows a tile covers at most
// The first row tile of a panel prefetches the weight g_i8_ahead bytes past the K block it computes (into L1): a
// chunk's panels are one contiguous run, so the stream runs on into the next panel. Hardware prefetchers alone
// left the stream short of memory's pace (SmolLM2 int8 forward, EPYC Zen 3, docs/results.md: t(8) -13 to -17%, t(1)
// -2 to -5% at 2-8 KiB ahead, 0 = none). Prefetches only: the bits do not depend on it.
int64_t g_i8_ahead = 4096;

inline void i8_prefetch(const uint8_t* wp, int64_t bytes) {
  const char* p = reinterpret_cast<const char*>(wp) + g_i8_ahead;
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
}

// One row of x [K] -> q [K] int8, d [K/32] float32, s [K/32] int32, ds [K/32] float32 (see above).
DDD_AVX2 void i8_quantize_row(const float* x, int64_t K, int8_t* q, float* d, int32_t* s, float* ds) {
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256 lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
  for (int64_t b = 0; b < K / kQK; ++b) {
    const float* xb = x + b * kQK;
    __m256 v[4];
    DDD_UNROLL for (int j = 0; j < 4; ++j) v[j] = _mm256_loadu_ps(xb + 8 * j);
    const __m256 m4 = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], absmask), _mm256_and_ps(v[1], absmask)),
                                    _mm256_max_ps(_mm256_and_ps(v[2], absmask), _mm256_and_ps(v[3], absmask)));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, m4);
    float amax = lanes[0];
    for (int j = 1; j < 8; ++j) amax = std::max(amax, lanes[j]);
    const float dd = amax / 127.0f;
    const float id = dd != 0.0f ? 1.0f / dd : 0.0f;
    const __m256 idv = _mm256_set1_ps(id);
    int32_t sum = 0;
    DDD_UNROLL for (int j = 0; j < 4; ++j) {
      __m256 r = _mm256_round_ps(_mm256_mul_ps(v[j], idv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      r = _mm256_min_ps(_mm256_max_ps(r, lo), hi);
      alignas(32) int32_t qi[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(qi), _mm256_cvtps_epi32(r));
      for (int t = 0; t < 8; ++t) {
        q[b * kQK + 8 * j + t] = static_cast<int8_t>(qi[t]);
        sum += qi[t];
      }
    }
    d[b] = dd;
    s[b] = sum;
    ds[b] = dd * static_cast<float>(sum);
  }
}

// The quantized rows of x for one call (filled by the calling thread, read by the helpers during the call).
struct I8Rows {
  const int8_t* q = nullptr;   // [M, K]
  const float* d = nullptr;    // [M, K/32]
  const int32_t* s = nullptr;  // [M, K/32]
  const float* ds = nullptr;   // [M, K/32]
  int64_t K = 0, nb = 0;
};

inline int32_t quad_at(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Keeps a running integer sum where it is: an empty asm that "changes" it, so that the compiler neither
// reassociates the sum over the unrolled quads nor computes every product first (it did both, spilling them).
template <class V>
inline void i8_pin(V& v) {
  asm volatile("" : "+v"(v));
}

// A block's float16 scales of columns [c, c + 8) (or 16) widened to float32 (exact).
DDD_AVX2 inline __m256 i8_scale8(const uint8_t* p, int64_t c) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * c)));
}

// MT rows (from row m) x the 48 columns of a panel (quad-major quants, wp its first K block) -> out [MT][48] (ldo
// floats apart). The integer sums per variant, then the float steps in the order above (8-wide here, 16-wide on
// AVX-512: the same operations per lane).
template <int MT, int64_t KIND>
DDD_AVX2 void i8_tile_avx2(const I8Rows& x, int64_t m, const uint8_t* wp, float* out, int64_t ldo, bool pf) {
  // 16 vector registers: one 8-column vector at a time, its MT integer sums in registers and its float
  // accumulators in `out` (L1; a float32 store and load are exact, so the order of the float steps is the same)
  constexpr int NV = kPanel512 / 8;  // 8-column vectors
  DDD_UNROLL for (int r = 0; r < MT; ++r)
    DDD_UNROLL for (int v = 0; v < NV; ++v) _mm256_storeu_ps(out + r * ldo + 8 * v, _mm256_setzero_ps());
  const __m256i ones = _mm256_set1_epi16(1), nib = _mm256_set1_epi8(0x0F);
  // the rows' fields in locals: the stores into `out` could otherwise alias them, and every access reload them
  const int64_t K = x.K, nb = x.nb;
  const int8_t* const xq0 = x.q + m * K;
  const float *const xd0 = x.d + m * nb, *const xds0 = x.ds + m * nb;
  const int32_t* const xs0 = x.s + m * nb;
  for (int64_t b = 0; b < nb; ++b, wp += qp_bytes(KIND)) {
    if (pf) i8_prefetch(wp, qp_bytes(KIND));
    const uint8_t* qs = wp + qp_qs(KIND);
    const int8_t* xq = xq0 + b * kQK;
    DDD_ROLLED for (int v = 0; v < NV; ++v) {  // rolled: unrolled ran no faster and compiled much longer
      // 4-bit kinds: the maddubs pairs (|.| <= 3810) of all eight quads summed in int16 (|.| <= 30480, exact),
      // widened once a block; Q8_0 pairs (|.| <= 32512) widened quad by quad
      __m256i isum[MT];
      DDD_UNROLL for (int r = 0; r < MT; ++r) isum[r] = _mm256_setzero_si256();
      if (KIND == kQ8_0) {
        DDD_UNROLL for (int i = 0; i < kQK / 4; ++i) {
          const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + i * kI8Quad + 32 * v));
          const __m256i aw = _mm256_sign_epi8(w, w);
          DDD_UNROLL for (int r = 0; r < MT; ++r) {
            const __m256i xb = _mm256_set1_epi32(quad_at(xq + r * K + 4 * i));
            isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(xb, w)),
                                                                  ones));
            i8_pin(isum[r]);
          }
        }
      } else {
        DDD_UNROLL for (int i = 0; i < kQK / 8; ++i) {  // byte quad i: K rows 4i.. (low nibbles), 16 + 4i.. (high)
          const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + i * kI8Quad + 32 * v));
          const __m256i lo = _mm256_and_si256(raw, nib), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nib);
          DDD_UNROLL for (int r = 0; r < MT; ++r) {
            isum[r] = _mm256_add_epi16(
                _mm256_add_epi16(isum[r], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(quad_at(xq + r * K + 4 * i)))),
                _mm256_maddubs_epi16(hi, _mm256_set1_epi32(quad_at(xq + r * K + 16 + 4 * i))));
            i8_pin(isum[r]);
          }
        }
        DDD_UNROLL for (int r = 0; r < MT; ++r) isum[r] = _mm256_madd_epi16(isum[r], ones);
      }
      const __m256 wd = i8_scale8(wp, 8 * v);
      const __m256 wm = KIND == kQ4_1 ? i8_scale8(wp + 2 * kPanel512, 8 * v) : _mm256_setzero_ps();
      DDD_UNROLL for (int r = 0; r < MT; ++r) {
        const int64_t at = r * nb + b;
        __m256i is = isum[r];
        if (KIND == kQ4_0) is = _mm256_sub_epi32(is, _mm256_set1_epi32(8 * xs0[at]));
        const __m256 t = _mm256_mul_ps(wd, _mm256_set1_ps(xd0[at]));
        float* o = out + r * ldo + 8 * v;
        __m256 acc = _mm256_add_ps(_mm256_loadu_ps(o), _mm256_mul_ps(_mm256_cvtepi32_ps(is), t));
        if (KIND == kQ4_1) acc = _mm256_add_ps(acc, _mm256_mul_ps(wm, _mm256_set1_ps(xds0[at])));
        _mm256_storeu_ps(o, acc);
      }
    }
  }
}

#if DDD_HAVE_AVXVNNI
template <int MT, int64_t KIND>
DDD_AVXVNNI void i8_tile_avxvnni(const I8Rows& x, int64_t m, const uint8_t* wp, float* out, int64_t ldo, bool pf) {
  // as i8_tile_avx2: one 8-column vector at a time, the float accumulators in `out`
  constexpr int NV = kPanel512 / 8;
  DDD_UNROLL for (int r = 0; r < MT; ++r)
    DDD_UNROLL for (int v = 0; v < NV; ++v) _mm256_storeu_ps(out + r * ldo + 8 * v, _mm256_setzero_ps());
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80)), nib = _mm256_set1_epi8(0x0F);
  // the rows' fields in locals: the stores into `out` could otherwise alias them, and every access reload them
  const int64_t K = x.K, nb = x.nb;
  const int8_t* const xq0 = x.q + m * K;
  const float *const xd0 = x.d + m * nb, *const xds0 = x.ds + m * nb;
  const int32_t* const xs0 = x.s + m * nb;
  for (int64_t b = 0; b < nb; ++b, wp += qp_bytes(KIND)) {
    if (pf) i8_prefetch(wp, qp_bytes(KIND));
    const uint8_t* qs = wp + qp_qs(KIND);
    const int8_t* xq = xq0 + b * kQK;
    DDD_ROLLED for (int v = 0; v < NV; ++v) {
      __m256i isum[MT];
      DDD_UNROLL for (int r = 0; r < MT; ++r) isum[r] = _mm256_setzero_si256();
      if (KIND == kQ8_0) {
        DDD_UNROLL for (int i = 0; i < kQK / 4; ++i) {  // w + 128, unsigned
          const __m256i w = _mm256_xor_si256(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + i * kI8Quad + 32 * v)), flip);
          DDD_UNROLL for (int r = 0; r < MT; ++r)
            isum[r] = _mm256_dpbusd_avx_epi32(isum[r], w, _mm256_set1_epi32(quad_at(xq + r * K + 4 * i)));
        }
      } else {
        DDD_UNROLL for (int i = 0; i < kQK / 8; ++i) {
          const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + i * kI8Quad + 32 * v));
          const __m256i lo = _mm256_and_si256(raw, nib), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nib);
          DDD_UNROLL for (int r = 0; r < MT; ++r)
            isum[r] = _mm256_dpbusd_avx_epi32(
                _mm256_dpbusd_avx_epi32(isum[r], lo, _mm256_set1_epi32(quad_at(xq + r * K + 4 * i))), hi,
                _mm256_set1_epi32(quad_at(xq + r * K + 16 + 4 * i)));
        }
      }
      const __m256 wd = i8_scale8(wp, 8 * v);
      const __m256 wm = KIND == kQ4_1 ? i8_scale8(wp + 2 * kPanel512, 8 * v) : _mm256_setzero_ps();
      DDD_UNROLL for (int r = 0; r < MT; ++r) {
        const int64_t at = r * nb + b;
        __m256i is = isum[r];
        if (KIND == kQ4_0) is = _mm256_sub_epi32(is, _mm256_set1_epi32(8 * xs0[at]));
        if (KIND == kQ8_0) is = _mm256_sub_epi32(is, _mm256_set1_epi32(128 * xs0[at]));
        const __m256 t = _mm256_mul_ps(wd, _mm256_set1_ps(xd0[at]));
        float* o = out + r * ldo + 8 * v;
        __m256 acc = _mm256_add_ps(_mm256_loadu_ps(o), _mm256_mul_ps(_mm256_cvtepi32_ps(is), t));
        if (KIND == kQ4_1) acc = _mm256_add_ps(acc, _mm256_mul_ps(wm, _mm256_set1_ps(xds0[at])));
        _mm256_storeu_ps(o, acc);
      }
    }
  }
}
#endif

template <int MT, int64_t KIND>
DDD_AVX512VNNI void i8_tile_avx512vnni(const I8Rows& x, int64_t m, const uint8_t* wp, float* out, int64_t ldo, bool pf) {
  // as i8_tile_avx2, 16-column vectors
  constexpr int NV = kPanel512 / 16;
  DDD_UNROLL for (int r = 0; r < MT; ++r)
    DDD_UNROLL for (int v = 0; v < NV; ++v) _mm512_storeu_ps(out + r * ldo + 16 * v, _mm512_setzero_ps());
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80)), nib = _mm512_set1_epi8(0x0F);
  // the rows' fields in locals: the stores into `out` could otherwise alias them, and every access reload them
  const int64_t K = x.K, nb = x.nb;
  const int8_t* const xq0 = x.q + m * K;
  const float *const xd0 = x.d + m * nb, *const xds0 = x.ds + m * nb;
  const int32_t* const xs0 = x.s + m * nb;
  for (int64_t b = 0; b < nb; ++b, wp += qp_bytes(KIND)) {
    if (pf) i8_prefetch(wp, qp_bytes(KIND));
    const uint8_t* qs = wp + qp_qs(KIND);
    const int8_t* xq = xq0 + b * kQK;
    DDD_ROLLED for (int v = 0; v < NV; ++v) {
      __m512i isum[MT];
      DDD_UNROLL for (int r = 0; r < MT; ++r) isum[r] = _mm512_setzero_si512();
      if (KIND == kQ8_0) {
        DDD_UNROLL for (int i = 0; i < kQK / 4; ++i) {  // w + 128, unsigned
          const __m512i w = _mm512_xor_si512(_mm512_loadu_si512(qs + i * kI8Quad + 64 * v), flip);
          DDD_UNROLL for (int r = 0; r < MT; ++r)
            isum[r] = _mm512_dpbusd_epi32(isum[r], w, _mm512_set1_epi32(quad_at(xq + r * K + 4 * i)));
        }
      } else {
        DDD_UNROLL for (int i = 0; i < kQK / 8; ++i) {
          const __m512i raw = _mm512_loadu_si512(qs + i * kI8Quad + 64 * v);
          const __m512i lo = _mm512_and_si512(raw, nib), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nib);
          DDD_UNROLL for (int r = 0; r < MT; ++r)
            isum[r] = _mm512_dpbusd_epi32(
                _mm512_dpbusd_epi32(isum[r], lo, _mm512_set1_epi32(quad_at(xq + r * K + 4 * i))), hi,
                _mm512_set1_epi32(quad_at(xq + r * K + 16 + 4 * i)));
        }
      }
      const __m512 wd = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + 32 * v)));
      const __m512 wm = KIND == kQ4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256(
                                            reinterpret_cast<const __m256i*>(wp + 2 * kPanel512 + 32 * v)))
                                      : _mm512_setzero_ps();
      DDD_UNROLL for (int r = 0; r < MT; ++r) {
        const int64_t at = r * nb + b;
        __m512i is = isum[r];
        if (KIND == kQ4_0) is = _mm512_sub_epi32(is, _mm512_set1_epi32(8 * xs0[at]));
        if (KIND == kQ8_0) is = _mm512_sub_epi32(is, _mm512_set1_epi32(128 * xs0[at]));
        const __m512 t = _mm512_mul_ps(wd, _mm512_set1_ps(xd0[at]));
        float* o = out + r * ldo + 16 * v;
        __m512 acc = _mm512_add_ps(_mm512_loadu_ps(o), _mm512_mul_ps(_mm512_cvtepi32_ps(is), t));
        if (KIND == kQ4_1) acc = _mm512_add_ps(acc, _mm512_mul_ps(wm, _mm512_set1_ps(xds0[at])));
        _mm512_storeu_ps(o, acc);
      }
    }
  }
}

template <int MT, int64_t KIND>
void i8_tile(const I8Rows& x, int64_t m, const uint8_t* wp, float* out, int64_t ldo) {
  const bool pf = m == 0 && g_i8_ahead > 0;
  switch (g_i8_variant) {
    case kI8Avx512Vnni: return i8_tile_avx512vnni<MT, KIND>(x, m, wp, out, ldo, pf);
#if DDD_HAVE_AVXVNNI
    case kI8AvxVnni: return i8_tile_avxvnni<MT, KIND>(x, m, wp, out, ldo, pf);
#endif
    default: return i8_tile_avx2<MT, KIND>(x, m, wp, out, ldo, pf);
  }
}

// Columns [n0, n1) of out (n0 a multiple of 48), all M rows, panel by panel, straight from the panels: row tiles of
// up to kI8Rows rows over the whole panel, each K block's bytes read as one run. (A panel is zero-padded past its
// last column, so a tile covers all 48.)
template <int64_t KIND>
void i8_chunk(const I8Rows& x, const uint8_t* w, float* out, int64_t M, int64_t N, int64_t n0, int64_t n1) {
  const int64_t nb = x.nb;
  alignas(64) float tile[kI8Rows * kPanel512];
  for (int64_t c0 = n0; c0 < n1; c0 += kPanel512) {
    const uint8_t* wp = w + (c0 / kPanel512) * nb * qp_bytes(KIND);
    const int64_t cw = std::min<int64_t>(kPanel512, n1 - c0);
    for (int64_t m = 0; m < M; m += kI8Rows) {
      const int64_t mt = std::min<int64_t>(kI8Rows, M - m);
      switch (mt) {
        case 8: i8_tile<8, KIND>(x, m, wp, tile, kPanel512); break;
        case 7: i8_tile<7, KIND>(x, m, wp, tile, kPanel512); break;
        case 6: i8_tile<6, KIND>(x, m, wp, tile, kPanel512); break;
        case 5: i8_tile<5, KIND>(x, m, wp, tile, kPanel512); break;
        case 4: i8_tile<4, KIND>(x, m, wp, tile, kPanel512); break;
        case 3: i8_tile<3, KIND>(x, m, wp, tile, kPanel512); break;
        case 2: i8_tile<2, KIND>(x, m, wp, tile, kPanel512); break;
        default: i8_tile<1, KIND>(x, m, wp, tile, kPanel512); break;
      }
      for (int64_t r = 0; r < mt; ++r) std::memcpy(out + (m + r) * N + c0, tile + r * kPanel512, cw * sizeof(float));
    }
  }
}

// One weight of an int8 product: the chosen layer's quantized panels, their kind and the output.
struct I8Weight {
  const uint8_t* w = nullptr;  // [P, K / 32, 48 * block bytes]
  int64_t kind = 0, P = 0, N = 0;
  float* out = nullptr;  // [M, N]
};

// Checks weight w [L, P, K / 32, 48 * block bytes] of `kind` and its output [..., N] against x's K and M rows.
ffi::Error i8_weight(const char* name, ffi::Buffer<ffi::U8>& w, ffi::Buffer<ffi::S32>& layer, ffi::Buffer<ffi::F32>& out,
                     int64_t kind, int64_t K, int64_t M, I8Weight* wt) {
  const auto wd = w.dimensions();
  const std::string at = std::string(name) + ": ";
  if (kind != kQ4_1 && kind != kQ8_0 && kind != kQ4_0) return ffi::Error::InvalidArgument(at + "unknown kind");
  if (wd.size() != 4 || wd[3] != qp_bytes(kind) || out.dimensions().size() < 1)
    return ffi::Error::InvalidArgument(at + "w must be [L, P, K / 32, 48 * block bytes]");
  const int64_t P = wd[1], N = out.dimensions().back();
  if (K % kQK != 0 || wd[2] != K / kQK) return ffi::Error::InvalidArgument(at + "K mismatch");
  if (N > P * kPanel512 || N <= (P - 1) * kPanel512 || out.element_count() != M * N)
    return ffi::Error::InvalidArgument(at + "the output's columns do not match the panels");
  wt->w = w.typed_data() + layer_index(layer, wd[0]) * P * wd[2] * wd[3];
  wt->kind = kind;
  wt->P = P;
  wt->N = N;
  wt->out = out.typed_data();
  return ffi::Error::Success();
}

// x [M, K] quantized row by row (i8_quantize_row) into the calling thread's buffers, which the helpers read only
// during this call.
I8Rows i8_rows(const float* x, int64_t M, int64_t K) {
  const int64_t nb = K / kQK;
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> d, ds;
  thread_local std::vector<int32_t> s;
  q.resize(static_cast<size_t>(M * K));
  d.resize(static_cast<size_t>(M * nb));
  ds.resize(static_cast<size_t>(M * nb));
  s.resize(static_cast<size_t>(M * nb));
  for (int64_t m = 0; m < M; ++m)
    i8_quantize_row(x + m * K, K, q.data() + m * K, d.data() + m * nb, s.data() + m * nb, ds.data() + m * nb);
  I8Rows rows;
  rows.q = q.data();
  rows.d = d.data();
  rows.s = s.data();
  rows.ds = ds.data();
  rows.K = K;
  rows.nb = nb;
  return rows;
}

// Columns [a, b) (a a multiple of 48) of weight wt's product, all M rows.
void i8_columns(const I8Rows& rows, const I8Weight& wt, int64_t M, int64_t a, int64_t b) {
  if (wt.kind == kQ4_1)
    i8_chunk<kQ4_1>(rows, wt.w, wt.out, M, wt.N, a, b);
  else if (wt.kind == kQ4_0)
    i8_chunk<kQ4_0>(rows, wt.w, wt.out, M, wt.N, a, b);
  else
    i8_chunk<kQ8_0>(rows, wt.w, wt.out, M, wt.N, a, b);
}

// x [..., K] of an int8 product `name`: *K and its rows *M, or an error (also when this CPU lacks the variant).
ffi::Error i8_input(const char* name, ffi::Buffer<ffi::F32>& x, int64_t* K, int64_t* M) {
  if (x.dimensions().size() < 1) return ffi::Error::InvalidArgument(std::string(name) + ": x must be [..., K]");
  if (!i8_supported(g_i8_variant))
    return ffi::Error::InvalidArgument(std::string(name) + ": this CPU lacks the chosen integer variant");
  *K = x.dimensions().back();
  *M = *K ? x.element_count() / *K : 0;
  return ffi::Error::Success();
}

// x [M, K] @ each weight of ws (all of x's K): x quantized once, then the panels of every weight handed out as one
// run of column chunks (weight after weight), so the threads share all of them. Each output column is computed as
// in a product of its weight alone: the same bits.
ffi::Error i8_products(ffi::ThreadPool& pool, const float* x, int64_t M, int64_t K, const I8Weight* ws, int64_t n) {
  const I8Rows rows = i8_rows(x, M, K);
  int64_t units = 0;  // panels of all the weights
  for (int64_t g = 0; g < n; ++g) units += ws[g].P;
  // columns [n0, n1) of the weights' panels side by side (48 per panel)
  for_column_chunks(pool, M, K, units * kPanel512, kPanel512, nullptr, [=](int64_t n0, int64_t n1) {
    int64_t off = 0;
    for (int64_t g = 0; g < n; off += ws[g].P * kPanel512, ++g) {
      const int64_t a = std::max(n0, off) - off, b = std::min({n1 - off, ws[g].P * kPanel512, ws[g].N});
      if (a < b) i8_columns(rows, ws[g], M, a, b);
    }
  });
  return ffi::Error::Success();
}

// x [..., K] float32 @ w [L, P, K / 32, 48 * block bytes] (quantized panels of `kind`, quants quad-major) at `layer`
// -> out [..., N], 48 (P - 1) < N <= 48 P, by integer products (see above). Every M.
ffi::Error LinearQPanelsInt8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                             ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> out, int64_t kind) {
  const char* name = "ddd_linear_qpanels_int8";
  int64_t K, M;
  if (ffi::Error e = i8_input(name, x, &K, &M); e.failure()) return e;
  I8Weight wt;
  if (ffi::Error e = i8_weight(name, w, layer, *out, kind, K, M, &wt); e.failure()) return e;
  return i8_products(pool, x.typed_data(), M, K, &wt, 1);
}

// x [..., K] float32 @ each of several such weights (w_g [L, P_g, K / 32, .] of kinds[g], all at `layer`) -> out_g
// [..., N_g]: one input shared by q, k and v, or by gate and up. Each output is bitwise its weight's
// LinearQPanelsInt8; x is quantized once and the threads share every weight's panels in one call.
constexpr int64_t kI8MaxGroup = 8;
ffi::Error LinearQPanelsInt8Group(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> layer,
                                  ffi::RemainingArgs ws, ffi::RemainingRets outs, ffi::Span<const int64_t> kinds) {
  const char* name = "ddd_linear_qpanels_int8_group";
  const int64_t n = static_cast<int64_t>(kinds.size());
  if (n < 1 || n > kI8MaxGroup || static_cast<int64_t>(ws.size()) != n || static_cast<int64_t>(outs.size()) != n)
    return ffi::Error::InvalidArgument(std::string(name) + ": 1 to 8 weights, one kind and one output each");
  int64_t K, M;
  if (ffi::Error e = i8_input(name, x, &K, &M); e.failure()) return e;
  I8Weight wt[kI8MaxGroup];
  for (int64_t g = 0; g < n; ++g) {
    auto w = ws.get<ffi::Buffer<ffi::U8>>(g);
    auto o = outs.get<ffi::Buffer<ffi::F32>>(g);
    if (!w.has_value() || !o.has_value())
      return ffi::Error::InvalidArgument(std::string(name) + ": weights must be uint8, outputs float32");
    ffi::Buffer<ffi::F32> ob = **o;
    if (ffi::Error e = i8_weight(name, *w, layer, ob, kinds[g], K, M, &wt[g]); e.failure()) return e;
  }
  return i8_products(pool, x.typed_data(), M, K, wt, n);
}

// The same product (bitwise: the same chunks), plus each row's greedy token: the index of its first maximum, V - 1
// for a row holding a NaN -- what `verify.greedy_token` computes from the logits. Each chunk scans its columns
// while they are still in cache; the chunks' answers are merged in column order (a later chunk wins only when
// strictly greater), so the first maximum wins across chunks too. Saves the three passes over [M, V] logits that
// XLA runs after an lm_head (0.5 ms a 7-row verification on the 2-core Xeon VM).
struct RowBest {
  float v;
  int32_t i;  // -1: this chunk slot is unused
  bool nan;
};

// A greedy lm_head: columns(n0, n1) computes columns [n0, n1) of out [M, N] (K: the reduced length), and each
// row's first maximum goes into id (N - 1 for a row holding a NaN). Chunks (multiples of 48 columns) are handed out
// by for_column_chunks; a chunk's columns are scanned while they are in cache.
template <class Columns>
void greedy_chunks(ffi::ThreadPool& pool, int64_t M, int64_t K, int64_t N, float* out, Columns columns, int32_t* id) {
  const int64_t P = (N + kPanel512 - 1) / kPanel512;
  std::vector<RowBest> best(static_cast<size_t>(P * M), RowBest{0.0f, -1, false});  // [chunk start / 48, M]
  RowBest* bp = best.data();
  for_column_chunks(pool, M, K, N, kPanel512, out, [=](int64_t n0, int64_t n1) {
    columns(n0, n1);
    for (int64_t m = 0; m < M; ++m) {
      const float* r = out + m * N;
      float v = r[n0];
      int64_t at = n0;
      bool nan = std::isnan(v);
      for (int64_t j = n0 + 1; j < n1; ++j) {
        if (r[j] > v) {
          v = r[j];
          at = j;
        }
        nan |= std::isnan(r[j]);
      }
      bp[(n0 / kPanel512) * M + m] = RowBest{v, static_cast<int32_t>(at), nan};
    }
  });
  for (int64_t m = 0; m < M; ++m) {
    float v = 0.0f;
    int32_t at = -1;
    bool nan = false;
    for (int64_t c = 0; c < P; ++c) {
      const RowBest& b = bp[c * M + m];
      if (b.i < 0) continue;
      nan |= b.nan;
      if (at < 0 || b.v > v) {
        v = b.v;
        at = b.i;
      }
    }
    id[m] = nan ? static_cast<int32_t>(N - 1) : std::max<int32_t>(at, 0);  // no chunk ran (K = 0): zeros, index 0
  }
}

// The exact greedy lm_head over p's panels (p.out: the logits).
template <class W>
void greedy_exact(ffi::ThreadPool& pool, const PanelProduct<W>& p, int32_t* id) {
  greedy_chunks(pool, p.M, p.K, p.N, p.out, [p](int64_t n0, int64_t n1) { p.columns(n0, n1); }, id);
}

ffi::Error LinearPanelsGreedy(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                              ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> out,
                              ffi::ResultBuffer<ffi::S32> ids) {
  PanelProduct<float> p;
  if (ffi::Error e = panel_product("ddd_linear_panels_greedy", x, w, layer, out, &p); e.failure()) return e;
  if (p.N == 0 || ids->element_count() != p.M)
    return ffi::Error::InvalidArgument("ddd_linear_panels_greedy: ids must hold one token per row");
  greedy_exact(pool, p, ids->typed_data());
  return ffi::Error::Success();
}

// LinearQPanelsInt8's product (bitwise) and each row's greedy token, as LinearPanelsGreedy: an int8 output
// projection's logits scanned chunk by chunk while they are in cache.
ffi::Error LinearQPanelsInt8Greedy(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                                   ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> out,
                                   ffi::ResultBuffer<ffi::S32> ids, int64_t kind) {
  const char* name = "ddd_linear_qpanels_int8_greedy";
  int64_t K, M;
  if (ffi::Error e = i8_input(name, x, &K, &M); e.failure()) return e;
  I8Weight wt;
  if (ffi::Error e = i8_weight(name, w, layer, *out, kind, K, M, &wt); e.failure()) return e;
  if (wt.N == 0 || ids->element_count() != M)
    return ffi::Error::InvalidArgument(std::string(name) + ": ids must hold one token per row");
  const I8Rows rows = i8_rows(x.typed_data(), M, K);
  greedy_chunks(pool, M, K, wt.N, wt.out, [=](int64_t n0, int64_t n1) { i8_columns(rows, wt, M, n0, n1); },
                ids->typed_data());
  return ffi::Error::Success();
}

// ------------------------------------------------- greedy lm_head screened by an int8 copy ("screen panels")
// Greedy decoding needs each row's argmax, not its logits. A one-row lm_head reads 113 MB of float32 panels for
// SmolLM2 (~3.2 ms of a ~17.7 ms token). An int8 copy (one float scale per output column) is a quarter of the bytes;
// its weights widen exactly to bfloat16 in registers (|q| <= 127), so AVX-512 BF16 dot products (vdpbf16ps) do half
// the instructions of the float32 kernel at many rows. The copy only screens: every column whose exact logit could
// still be the row's maximum is recomputed exactly, so the token is bitwise the exact kernel's (ties to the first
// index, V - 1 for a NaN).
//
// The bound. For a row x and an output column v with float32 weights w and their copy w^ = s_v q (q int8,
// s_v = max |w| / 127), let x~ be x in bfloat16 (round to nearest even, subnormals flushed to zero), a the exact
// kernel's logit (an fma chain over k from zero) and c the screen's, s_v (x~ . q) (a chain of vdpbf16ps: exact
// products, float32 sums; then one product). By Cauchy-Schwarz and the summation errors (gamma = 2 K u /
// (1 - 2 K u), u = 2^-24, taken twice over):
//   |a - c| <= |x| (gamma |w| + |w - w^|) + (|x - x~| + gamma |x~|) |w^| + 2^-20 |c| + tau       (|.|: 2-norms)
//            = alpha A_v + beta B_v + 2^-20 |c| + tau,
// where A_v = gamma |w_v| + |w_v - w^_v| and B_v = |w^_v| are computed once and rounded up (the bound rows,
// `ddd_jax.backends.cpu.panels.screen_of`), alpha = |x| and beta = |x - x~| + gamma |x~| per call (float64, inflated by 2^-20
// to cover the float32 arithmetic below); 2^-20 |c| covers c's own rounding and that of c +- e; tau = 2^-80 the
// sums' flushed subnormals. A column is a candidate when c + e reaches the largest c - e of its row; the true
// maximum always is one. A row whose x is not finite or has |x| > 1e30, and a column whose bound is not finite
// (w_v not finite or |w_v| >= 1e7: A_v = inf), are candidates / fall back to the exact kernel, so no exact logit
// outside the candidates can overflow or be NaN.
// SmolLM2, 520 final hidden states of vanilla decoding (runs/s22/cand.py; runs/s23/cand_x8.py with beta as computed
// here): candidates median 1, max 6 with a bfloat16 copy of the weights; 7 on average, median 4, max 57 with the int8
// copy (over the cost curve's old synthetic inputs 6 to 240 a row: see exact_groups). The lm_head alone, alternating
// processes (runs/s22/scr_ab.py): bfloat16 copy / int8 copy, 1 row 1.9-2.3 / 0.8-1.4 ms, 8 rows 2.2-2.7 / 1.5-2.7,
// 16 rows 3.6-4.3 / 2.8-3.5. (int8 x, vpdpwssd, was faster only up to ~5 rows: half vdpbf16ps's rate here.)
#define DDD_SCREEN __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx512bf16,avx2,fma,f16c")))
bool g_screen = false;                // set at load: g_avx512 and AVX512_BF16 (DDD_JAX_NO_SCREEN=1: off)
constexpr int64_t kScreenCols = kPanel512;  // columns of a screen panel [P, K2, 48 columns x 2 k] (int8)
constexpr int64_t kMaxCandidates = 4096;  // a row with more falls back to the exact kernel
inline bool screen_supported() { return g_avx512 && __builtin_cpu_supports("avx512bf16"); }

// The lanes of 16 columns from j that lie before n1.
inline __mmask16 lanes16(int64_t j, int64_t n1) {
  return j + 16 <= n1 ? __mmask16(0xFFFF) : __mmask16((1u << (n1 - j)) - 1);
}

// x [M, K] float32 -> xp [M, K2] pairs of bfloat16 (k = 2i low, 2i + 1 high; 0 past K), round to nearest even,
// subnormals to zero; alpha, beta [M] as above. False when a row is not finite or too large (the exact kernel then).
inline uint16_t bf16_of(float f) {
  if (std::fabs(f) < 1.17549435e-38f) return std::signbit(f) ? 0x8000 : 0;  // subnormals (and zeros) to zero
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFF + ((u >> 16) & 1);  // finite inputs only (checked by the caller)
  return static_cast<uint16_t>(u >> 16);
}
inline float float_of_bf16(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
bool screen_rows(const float* x, int64_t M, int64_t K, uint32_t* xp, float* alpha, float* beta) {
  const int64_t K2 = (K + 1) / 2;
  const double u = std::ldexp(1.0, -24), gamma = 2.0 * (2.0 * K * u / (1.0 - 2.0 * K * u));
  const double inflate = 1.0 + std::ldexp(1.0, -20);
  for (int64_t m = 0; m < M; ++m) {
    const float* r = x + m * K;
    double nx = 0.0, nd = 0.0, nt = 0.0;
    for (int64_t k = 0; k < K; ++k) {
      if (!std::isfinite(r[k])) return false;
      const uint16_t h = bf16_of(r[k]);
      const double t = float_of_bf16(h), d = static_cast<double>(r[k]) - t;
      nx += static_cast<double>(r[k]) * r[k];
      nd += d * d;
      nt += t * t;
      uint32_t& pair = xp[m * K2 + k / 2];
      pair = k % 2 ? (pair & 0xFFFFu) | (static_cast<uint32_t>(h) << 16) : h;
    }
    nx = std::sqrt(nx);
    if (!(nx <= 1e30)) return false;
    alpha[m] = static_cast<float>(nx * inflate);
    beta[m] = static_cast<float>((std::sqrt(nd) + gamma * std::sqrt(nt)) * inflate);
  }
  return true;
}

// An MT x 48 tile of x~ . q: vdpbf16ps over the K2 pairs, each panel row's int8 pairs widened to bfloat16.
template <int MT>
DDD_SCREEN inline void sp_tile(const uint32_t* xp, int64_t K2, const int8_t* w, float* out, int64_t ldo,
                               bool prefetch) {
  __m512 acc[MT][3];
  DDD_UNROLL for (int r = 0; r < MT; ++r)
    DDD_UNROLL for (int v = 0; v < 3; ++v) acc[r][v] = _mm512_setzero_ps();
  const int8_t* pf = w + g_panel_ahead * 2 * kScreenCols;
  for (int64_t i = 0; i < K2; ++i, w += 2 * kScreenCols, pf += 2 * kScreenCols) {
    if (prefetch) {
      _mm_prefetch(reinterpret_cast<const char*>(pf), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(pf) + 64, _MM_HINT_T0);
    }
    __m512bh wv[3];  // 32 int8 (16 columns x a k pair) -> 32 bfloat16, exactly (|q| <= 127)
    DDD_UNROLL for (int v = 0; v < 3; ++v) {
      const __m128i* q = reinterpret_cast<const __m128i*>(w + 32 * v);
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q)));
      const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1)));
      wv[v] = _mm512_cvtne2ps_pbh(hi, lo);
    }
    DDD_UNROLL for (int r = 0; r < MT; ++r) {
      const __m512bh b = (__m512bh)_mm512_set1_epi32(static_cast<int>(xp[r * K2 + i]));
      DDD_UNROLL for (int v = 0; v < 3; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], b, wv[v]);
    }
  }
  DDD_UNROLL for (int r = 0; r < MT; ++r)
    DDD_UNROLL for (int v = 0; v < 3; ++v) _mm512_storeu_ps(out + r * ldo + 16 * v, acc[r][v]);
}

struct ScreenRange {  // one chunk's columns of one row
  float lo, hi;       // the largest s - e, s + e over its finite columns
  bool bad;           // a column that is not finite (always a candidate)
  bool used;
};

struct ScreenCall {
  int64_t M = 0, K2 = 0, N = 0;
  const uint32_t* xp = nullptr;
  const int8_t* s = nullptr;          // [P, K2, 96]
  const float* A = nullptr;           // [N]
  const float* B = nullptr;           // [N]
  const float* S = nullptr;           // [N]: the columns' scales s_v
  const float* alpha = nullptr;       // [M]
  const float* beta = nullptr;        // [M]
  float tau = 0.0f;
  float* out = nullptr;               // [M, N] x~ . q (times S: the screened logits)
  ScreenRange* ranges = nullptr;      // [chunk start / 48, M]

  // 16 screened logits at j of row m (out times the scales).
  DDD_SCREEN inline __m512 logits16(int64_t m, int64_t j, __mmask16 live) const {
    return _mm512_mul_ps(_mm512_maskz_loadu_ps(live, out + m * N + j), _mm512_maskz_loadu_ps(live, S + j));
  }

  // e' for 16 columns at j of row m (see the bound), and the finite-lanes mask of the logits and e'.
  DDD_SCREEN inline __m512 err16(int64_t m, int64_t j, __m512 sv, __mmask16 live, __mmask16* fin) const {
    const __m512 a = _mm512_maskz_loadu_ps(live, A + j), b = _mm512_maskz_loadu_ps(live, B + j);
    const __m512 absd = _mm512_abs_ps(sv);
    __m512 e = _mm512_fmadd_ps(_mm512_set1_ps(alpha[m]), a, _mm512_mul_ps(_mm512_set1_ps(beta[m]), b));
    e = _mm512_add_ps(_mm512_fmadd_ps(_mm512_set1_ps(std::ldexp(1.0f, -20)), absd, e), _mm512_set1_ps(tau));
    *fin = _mm512_mask_cmp_ps_mask(live, _mm512_add_ps(absd, e), _mm512_set1_ps(3.0e38f), _CMP_LE_OQ);
    return e;
  }

  DDD_SCREEN void columns(int64_t n0, int64_t n1) const {
    alignas(64) float part[8 * kScreenCols];
    const bool prefetch = M <= 2 && g_panel_ahead > 0;
    for (int64_t c0 = n0; c0 < n1; c0 += kScreenCols) {
      const int8_t* wp = s + (c0 / kScreenCols) * K2 * 2 * kScreenCols;
      const int64_t cw = std::min<int64_t>(kScreenCols, n1 - c0);
      panel_row_tiles(M, N, c0, cw, out, part, [&](auto mt, int64_t m, float* o, int64_t ldo) {
        sp_tile<decltype(mt)::value>(xp + m * K2, K2, wp, o, ldo, prefetch);
      });
    }
    for (int64_t m = 0; m < M; ++m) {  // this chunk's bounds, row by row (its columns are still in cache)
      __m512 lo = _mm512_set1_ps(-INFINITY), hi = _mm512_set1_ps(-INFINITY);
      bool bad = false;
      for (int64_t j = n0; j < n1; j += 16) {
        const __mmask16 live = lanes16(j, n1);
        const __m512 sv = logits16(m, j, live);
        __mmask16 fin;
        const __m512 e = err16(m, j, sv, live, &fin);
        bad |= fin != live;
        lo = _mm512_mask_max_ps(lo, fin, lo, _mm512_sub_ps(sv, e));
        hi = _mm512_mask_max_ps(hi, fin, hi, _mm512_add_ps(sv, e));
      }
      ranges[(n0 / kScreenCols) * M + m] = ScreenRange{_mm512_reduce_max_ps(lo), _mm512_reduce_max_ps(hi), bad, true};
    }
  }

  // Row m's candidates in [n0, n1) (s + e' >= L, or not finite), in column order.
  DDD_SCREEN void candidates(int64_t m, int64_t n0, int64_t n1, float L, std::vector<int32_t>& c) const {
    for (int64_t j = n0; j < n1; j += 16) {
      const __mmask16 live = lanes16(j, n1);
      const __m512 sv = logits16(m, j, live);
      __mmask16 fin;
      const __m512 e = err16(m, j, sv, live, &fin);
      __mmask16 keep = _mm512_mask_cmp_ps_mask(fin, _mm512_add_ps(sv, e), _mm512_set1_ps(L), _CMP_GE_OQ);
      keep |= live & ~fin;
      while (keep) {
        const int b = __builtin_ctz(keep);
        c.push_back(static_cast<int32_t>(j + b));
        keep &= keep - 1;
      }
    }
  }
};

// Exact logits of 16 columns of NB (row, group) items at once: per lane the fma chain over k from zero of every
// panel kernel (acc = fma(x[k], w[k, v], acc)), NB independent chains so their latencies overlap, each stream
// prefetched kExactAhead k rows ahead (a group's k rows are pw floats apart: one cache line each).
constexpr int64_t kExactAhead = 16;
template <int NB>
DDD_AVX512 void exact_group_tile(const float* x, const float* w, int64_t K, int64_t pw, int64_t G16,
                                 const int64_t* items, float* out) {
  const float* xr[NB];
  const float* col[NB];
  __m512 acc[NB];
  DDD_UNROLL for (int b = 0; b < NB; ++b) {
    const int64_t m = items[b] / G16, v = (items[b] % G16) * 16;
    xr[b] = x + m * K;
    col[b] = w + (v / pw) * K * pw + v % pw;
    acc[b] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < K; ++k) {
    if (k + kExactAhead < K)
      DDD_UNROLL for (int b = 0; b < NB; ++b)
        _mm_prefetch(reinterpret_cast<const char*>(col[b] + (k + kExactAhead) * pw), _MM_HINT_T0);
    DDD_UNROLL for (int b = 0; b < NB; ++b)
      acc[b] = _mm512_fmadd_ps(_mm512_set1_ps(xr[b][k]), _mm512_loadu_ps(col[b] + k * pw), acc[b]);
  }
  DDD_UNROLL for (int b = 0; b < NB; ++b) _mm512_storeu_ps(out + 16 * b, acc[b]);
}

// out[16 i + j] = the exact logit of row items[i] / G16, column 16 (items[i] % G16) + j, for i < n (x [M, K] and
// the panels w [P, K, pw] of the product; pw a multiple of 16, so a group lies in one panel, padded past N). Four
// items a tile; over the helpers when there are many (a screen too loose for a row yields hundreds).
DDD_AVX512 void exact_groups(ffi::ThreadPool& pool, const float* x, const float* w, int64_t K, int64_t pw,
                             int64_t G16, const int64_t* items, int64_t n, float* out) {
  constexpr int64_t kTile = 4;
  auto tile = [=](int64_t i0) {
    switch (std::min<int64_t>(kTile, n - i0)) {
      case 4: return exact_group_tile<4>(x, w, K, pw, G16, items + i0, out + 16 * i0);
      case 3: return exact_group_tile<3>(x, w, K, pw, G16, items + i0, out + 16 * i0);
      case 2: return exact_group_tile<2>(x, w, K, pw, G16, items + i0, out + 16 * i0);
      default: return exact_group_tile<1>(x, w, K, pw, G16, items + i0, out + 16 * i0);
    }
  };
  const int64_t tiles = (n + kTile - 1) / kTile;
  const int64_t threads = tiles >= 4 ? pool_threads(pool) : 1;
  parallel_chunks(threads, tiles, [&](int64_t t) { tile(t * kTile); });
}

// x [..., K] float32, w [L, P, K, W] float32 (the exact panels) at `layer`, s [P48, K2, 96] int8 (the screen
// panels), bound [3, N] float32 (A, B, the scales) -> ids [...]: each row's greedy token, bitwise
// `LinearPanelsGreedy`'s. scratch [..., N] float32: the kernel's own (screened logits before their scales).
ffi::Error LinearPanelsGreedyScreened(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                                      ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S8> s,
                                      ffi::Buffer<ffi::F32> bound, ffi::ResultBuffer<ffi::S32> ids,
                                      ffi::ResultBuffer<ffi::F32> scratch) {
  const std::string name = "ddd_linear_panels_greedy_screened";
  PanelProduct<float> p;
  if (ffi::Error e = panel_product(name, x, w, layer, scratch, &p); e.failure()) return e;
  const int64_t M = p.M, K = p.K, N = p.N, K2 = (K + 1) / 2;
  const int64_t P48 = (N + kScreenCols - 1) / kScreenCols;
  if (N == 0 || ids->element_count() != M)
    return ffi::Error::InvalidArgument(name + ": ids must hold one token per row");
  const auto sd = s.dimensions();
  if (sd.size() != 3 || sd[0] != P48 || sd[1] != K2 || sd[2] != 2 * kScreenCols)
    return ffi::Error::InvalidArgument(name + ": s must be [ceil(N / 48), ceil(K / 2), 96]");
  const auto bd = bound.dimensions();
  if (bd.size() != 2 || bd[0] != 3 || bd[1] != N) return ffi::Error::InvalidArgument(name + ": bound must be [3, N]");
  int32_t* id = ids->typed_data();
  thread_local std::vector<uint32_t> xp;
  thread_local std::vector<float> coef;
  xp.resize(static_cast<size_t>(M * K2));
  coef.resize(static_cast<size_t>(2 * M));
  if (!g_screen || K == 0 ||
      !screen_rows(p.x, M, K, xp.data(), coef.data(), coef.data() + M)) {
    greedy_exact(pool, p, id);  // no BF16, or a row not finite / too large: the exact kernel
    return ffi::Error::Success();
  }
  std::vector<ScreenRange> ranges(static_cast<size_t>(P48 * M), ScreenRange{0.0f, 0.0f, false, false});
  ScreenCall c;
  c.M = M;
  c.K2 = K2;
  c.N = N;
  c.xp = xp.data();
  c.s = s.typed_data();
  c.A = bound.typed_data();
  c.B = bound.typed_data() + N;
  c.S = bound.typed_data() + 2 * N;
  c.alpha = coef.data();
  c.beta = coef.data() + M;
  c.tau = std::ldexp(1.0f, -80);
  c.out = p.out;
  c.ranges = ranges.data();
  for_column_chunks(pool, M, K, N, kScreenCols, p.out, [&c](int64_t n0, int64_t n1) { c.columns(n0, n1); });
  // Every row's candidates (a row with more than kMaxCandidates: the exact kernel for every row), and the
  // (row, 16-column group) pairs that hold them ...
  const int64_t G16 = (N + 15) / 16;
  thread_local std::vector<int32_t> cand;       // the rows' candidates, row after row, each row's in column order
  thread_local std::vector<int64_t> row_start;  // [M + 1]: row m's candidates are cand[row_start[m]:row_start[m + 1]]
  thread_local std::vector<int64_t> items;      // m * G16 + g: row m's exact logits of columns [16 g, 16 g + 16)
  cand.clear();
  items.clear();
  row_start.assign(static_cast<size_t>(M + 1), 0);
  for (int64_t m = 0; m < M; ++m) {
    const size_t first = cand.size();
    row_start[m] = static_cast<int64_t>(first);
    float L = -INFINITY;
    for (int64_t q = 0; q < P48; ++q)
      if (ranges[q * M + m].used) L = std::max(L, ranges[q * M + m].lo);
    for (int64_t q = 0; q < P48; ++q) {
      const ScreenRange& r = ranges[q * M + m];
      if (!r.used || !(r.bad || r.hi >= L)) continue;
      int64_t q1 = q + 1;  // the chunk's end: the next used slot
      while (q1 < P48 && !ranges[q1 * M + m].used) ++q1;
      c.candidates(m, q * kScreenCols, std::min(N, q1 * kScreenCols), L, cand);
      if (static_cast<int64_t>(cand.size() - first) > kMaxCandidates) break;
    }
    if (static_cast<int64_t>(cand.size() - first) > kMaxCandidates) {  // a bound too loose to pay: the exact kernel
      greedy_exact(pool, p, id);
      return ffi::Error::Success();
    }
    for (size_t i = first; i < cand.size(); ++i) {
      const int64_t it = m * G16 + cand[i] / 16;
      if (items.empty() || items.back() != it) items.push_back(it);
    }
  }
  row_start[M] = static_cast<int64_t>(cand.size());
  // ... their exact logits, 16 columns at a time ...
  thread_local std::vector<float> exact;
  exact.resize(items.size() * 16);
  exact_groups(pool, p.x, p.w, K, p.pw, G16, items.data(), static_cast<int64_t>(items.size()), exact.data());
  // ... and each row's first maximum among its candidates.
  size_t it = 0;
  for (int64_t m = 0; m < M; ++m) {
    float best = 0.0f;
    int32_t at = -1;
    bool nan = false;
    for (int64_t i = row_start[m]; i < row_start[m + 1]; ++i) {
      const int32_t v = cand[i];
      while (items[it] != m * G16 + v / 16) ++it;
      const float a = exact[it * 16 + v % 16];
      nan |= std::isnan(a);
      if (at < 0 || a > best) {
        best = a;
        at = v;
      }
    }
    id[m] = nan ? static_cast<int32_t>(N - 1) : std::max<int32_t>(at, 0);
  }
  return ffi::Error::Success();
}

// ------------------------------------------------------------------------------------------- attention
// exp for the softmax: one vector routine for every element (Cephes' expf polynomial, ~1 ulp), so a score's
// exp never depends on where it sits. exp8 (AVX2) and exp16 (AVX-512) are the same operations on 8 or 16 lanes, with
// these constants (test_avx512_and_avx2_products_are_bitwise_equal compares their attention bit for bit): exp16
// calling exp8 on its two halves measured its softmax share +26% (perf, runs/s20/abh.cc at 16 rows).
constexpr float kExpHi = 88.3762626647949f, kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f,
                kLn2Lo = -2.12194440e-4f;
constexpr float kExpPoly[6] = {1.9875691500E-4f, 1.3981999507E-3f, 8.3334519073E-3f,
                               4.1665795894E-2f, 1.6666665459E-1f, 5.0000001201E-1f};

DDD_AVX2 inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-kExpHi)), _mm256_set1_ps(kExpHi));
  __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(kLog2e), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(kLn2Hi), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(kLn2Lo), x);
  const __m256 z = _mm256_mul_ps(x, x);
  __m256 y = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(kExpPoly[i]));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, z, x), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(0x7f)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

DDD_AVX512 inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-kExpHi)), _mm512_set1_ps(kExpHi));
  __m512 fx = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(kLog2e), _mm512_set1_ps(0.5f)),
                                   _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(kLn2Hi), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(kLn2Lo), x);
  const __m512 z = _mm512_mul_ps(x, x);
  __m512 y = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(kExpPoly[i]));
  y = _mm512_add_ps(_mm512_fmadd_ps(y, z, x), _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(0x7f)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

// The sum of a vector's 8 lanes in the tree ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)) -- the tree `hsum8x8` uses for
// each of its 8 vectors, so a score does not depend on whether its slot was summed alone or among 8.
DDD_AVX2 inline float hsum8_pairs(__m256 a) {
  __m256 x = _mm256_hadd_ps(a, a);  // [01, 23, 01, 23 | 45, 67, 45, 67]
  x = _mm256_hadd_ps(x, x);         // [(01)+(23) .. | (45)+(67) ..]
  return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1)));
}

// Lane i = hsum8_pairs(a[i]).
DDD_AVX2 inline __m256 hsum8x8(const __m256* a) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));  // a0..a3: lo | hi halves
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// Unscaled score of query head q against one key row, in one fixed order (both instruction sets):
//   16 fma chains over h < H16 = H & ~15 (lane l: h = l, l + 16, ...), folded to 8 lanes (lane l + lane l + 8);
//   one more 8-wide fma step over [H16, H16 + 8) when H has it; hsum8_pairs; the tail h >= H8 in order.
// On AVX2 the 16 lanes are two 8-wide chains (even and odd 8-dim chunks); on AVX-512 one 16-wide chain.
DDD_AVX2 inline float score1(const float* q, const float* k, int64_t H) {
  const int64_t H16 = H & ~int64_t(15), H8 = H & ~int64_t(7);
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
  for (int64_t h = 0; h < H16; h += 16) {
    lo = _mm256_fmadd_ps(_mm256_loadu_ps(q + h), _mm256_loadu_ps(k + h), lo);
    hi = _mm256_fmadd_ps(_mm256_loadu_ps(q + h + 8), _mm256_loadu_ps(k + h + 8), hi);
  }
  __m256 a = _mm256_add_ps(lo, hi);
  if (H8 > H16) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + H16), _mm256_loadu_ps(k + H16), a);
  float s = hsum8_pairs(a);
  for (int64_t h = H8; h < H; ++h) s = __builtin_fmaf(q[h], k[h], s);
  return s;
}

// The tail h >= H8 of eight scores (after their lane sums), in order.
DDD_AVX2 inline void score_tails(const float* q, const float* const* kr, int64_t H, float* out) {
  for (int64_t h = H & ~int64_t(7); h < H; ++h)
    for (int j = 0; j < 8; ++j) out[j] = __builtin_fmaf(q[h], kr[j][h], out[j]);
}

// Scores of query head q against the 8 key rows k + idx[j] * ldk, j < 8: exactly score1 for each.
DDD_AVX2 inline void score8(const float* q, const float* k, const int32_t* idx, int64_t ldk, int64_t H, float* out) {
  const int64_t H16 = H & ~int64_t(15), H8 = H & ~int64_t(7);
  const float* kr[8];
  DDD_UNROLL for (int j = 0; j < 8; ++j) kr[j] = k + idx[j] * ldk;
  __m256 a[8], b[8];
  DDD_UNROLL for (int j = 0; j < 8; ++j) a[j] = b[j] = _mm256_setzero_ps();
  for (int64_t h = 0; h < H16; h += 16) {  // the even 8-dim chunks (lanes 0-7 of the 16) ...
    const __m256 qv = _mm256_loadu_ps(q + h);
    DDD_UNROLL for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr[j] + h), a[j]);
  }
  for (int64_t h = 8; h < H16; h += 16) {  // ... and the odd ones (lanes 8-15)
    const __m256 qv = _mm256_loadu_ps(q + h);
    DDD_UNROLL for (int j = 0; j < 8; ++j) b[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr[j] + h), b[j]);
  }
  DDD_UNROLL for (int j = 0; j < 8; ++j) a[j] = _mm256_add_ps(a[j], b[j]);
  if (H8 > H16) {
    const __m256 qv = _mm256_loadu_ps(q + H16);
    DDD_UNROLL for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr[j] + H16), a[j]);
  }
  _mm256_storeu_ps(out, hsum8x8(a));
  score_tails(q, kr, H, out);
}

// out[0:8*NB] += sum_j p_j v_j[0:8*NB] for GT query heads sharing one KV head (p: GT rows of stride ldp, out: GT
// rows of stride H); per element the fma chain continues from out in slot order, so summing a row's slots block by
// block gives exactly the one chain over all of them.
template <int GT, int NB>
DDD_AVX2 inline void pv_group(const float* p, int64_t ldp, const int32_t* idx, int64_t n_att, const float* v,
                              int64_t ldv, float* out, int64_t H) {
  __m256 acc[GT][NB];
  DDD_UNROLL for (int g = 0; g < GT; ++g)
    DDD_UNROLL for (int b = 0; b < NB; ++b) acc[g][b] = _mm256_loadu_ps(out + g * H + 8 * b);
  for (int64_t j = 0; j < n_att; ++j) {
    const float* vj = v + idx[j] * ldv;
    __m256 vv[NB];
    DDD_UNROLL for (int b = 0; b < NB; ++b) vv[b] = _mm256_loadu_ps(vj + 8 * b);
    DDD_UNROLL for (int g = 0; g < GT; ++g) {
      const __m256 pg = _mm256_broadcast_ss(p + g * ldp + j);
      DDD_UNROLL for (int b = 0; b < NB; ++b) acc[g][b] = _mm256_fmadd_ps(pg, vv[b], acc[g][b]);
    }
  }
  DDD_UNROLL for (int g = 0; g < GT; ++g)
    DDD_UNROLL for (int b = 0; b < NB; ++b) _mm256_storeu_ps(out + g * H + 8 * b, acc[g][b]);
}

// Head dims [h0, H) one at a time (the tails of pv_heads and pv_heads512).
template <int GT>
DDD_AVX2 inline void pv_tail(const float* p, int64_t ldp, const int32_t* idx, int64_t n_att, const float* v,
                             int64_t ldv, float* out, int64_t h0, int64_t H) {
  for (int64_t h = h0; h < H; ++h)
    for (int g = 0; g < GT; ++g) {
      float a = out[g * H + h];
      for (int64_t j = 0; j < n_att; ++j) a = __builtin_fmaf(p[g * ldp + j], v[idx[j] * ldv + h], a);
      out[g * H + h] = a;
    }
}

template <int GT>
DDD_AVX2 inline void pv_heads(const float* p, int64_t ldp, const int32_t* idx, int64_t n_att, const float* v,
                              int64_t ldv, float* out, int64_t H) {
  int64_t h = 0;
  for (; h + 16 <= H; h += 16) pv_group<GT, 2>(p, ldp, idx, n_att, v + h, ldv, out + h, H);
  for (; h + 8 <= H; h += 8) pv_group<GT, 1>(p, ldp, idx, n_att, v + h, ldv, out + h, H);
  pv_tail<GT>(p, ldp, idx, n_att, v, ldv, out, h, H);
}

// Slots a row may attend, ascending (all S when none: XLA's softmax then gives uniform weights over every slot).
DDD_AVX2 inline void attended_slots(const bool* mask, int64_t S, std::vector<int32_t>& idx) {
  idx.resize(S);  // at most S slots, written through a pointer (no capacity check per slot)
  int32_t* out = idx.data();
  int64_t s = 0;
  for (; s + 32 <= S; s += 32) {
    uint32_t bits = static_cast<uint32_t>(_mm256_movemask_epi8(
        _mm256_cmpgt_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mask + s)), _mm256_setzero_si256())));
    while (bits) {
      *out++ = static_cast<int32_t>(s + __builtin_ctz(bits));
      bits &= bits - 1;
    }
  }
  for (; s < S; ++s)
    if (mask[s]) *out++ = static_cast<int32_t>(s);
  if (out == idx.data())
    for (s = 0; s < S; ++s) *out++ = static_cast<int32_t>(s);
  idx.resize(out - idx.data());
}

constexpr int64_t kSlotBlock = 64;  // slots whose keys (then values) stay in L1 while every row of a chunk uses them

// std::allocator with every block 64-byte aligned: the attention buffers that vectors of 16 floats load from and
// store to (scores, transposed keys) then never split a cache line. (Their alignment was malloc's 16 bytes: one
// unrelated member added to RowSlots moved the buffers and cost 7 rows' attention ~8%, harness runs/s28.)
template <class T>
struct Aligned64 {
  using value_type = T;
  Aligned64() = default;
  template <class U>
  Aligned64(const Aligned64<U>&) {}
  T* allocate(std::size_t n) {
    void* p = ::operator new(((n * sizeof(T) + 63) & ~std::size_t(63)), std::align_val_t(64));
    return static_cast<T*>(p);
  }
  void deallocate(T* p, std::size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <class U>
  bool operator==(const Aligned64<U>&) const { return true; }
  template <class U>
  bool operator!=(const Aligned64<U>&) const { return false; }
};
using AlignedFloats = std::vector<float, Aligned64<float>>;

// Per-row state of attend_rows.
struct RowSlots {
  std::vector<int32_t> idx;  // attended slots, ascending
  AlignedFloats e;           // [G, padded]: scores, then their exps (unnormalised probabilities)
  std::vector<float> sum;    // [G]: per query head, the sum of its e (p @ V is divided by it)
  bool none = false;         // the row attends nothing
  int64_t padded = 0;
  int64_t cur = 0;           // cursor into idx while sweeping slot blocks (for_slot_blocks)
};

// The row's entries [lo, hi) of idx below slot s1, from its cursor on; moves the cursor to hi (idx ascends).
inline std::pair<int64_t, int64_t> next_slots(RowSlots& rs, int64_t s1) {
  const int64_t lo = rs.cur;
  rs.cur = std::lower_bound(rs.idx.begin() + lo, rs.idx.end(), static_cast<int32_t>(s1)) - rs.idx.begin();
  return {lo, rs.cur};
}

// Calls fn(r, rs, lo, hi) for every slot block [s0, s0 + kSlotBlock) and every row r, with [lo, hi) the row's
// entries of idx inside that block (blocks in ascending order, rows in order within a block).
template <class Fn>
inline void for_slot_blocks(std::vector<RowSlots>& rows, int64_t R, int64_t S, Fn fn) {
  for (int64_t r = 0; r < R; ++r) rows[r].cur = 0;
  for (int64_t s0 = 0; s0 < S; s0 += kSlotBlock) {
    const int64_t s1 = std::min(S, s0 + kSlotBlock);
    for (int64_t r = 0; r < R; ++r) {
      const auto [lo, hi] = next_slots(rows[r], s1);
      fn(r, rows[r], lo, hi);
    }
  }
}

// AVX-512: the same per-element chains (out, then p_j v_j in slot order) over 16 head dims a vector, so bitwise
// pv_heads; a head of 64 dims is four vectors, swept over the slots once instead of twice.
template <int GT, int NB>
DDD_AVX512 inline void pv_group512(const float* p, int64_t ldp, const int32_t* idx, int64_t n_att, const float* v,
                                   int64_t ldv, float* out, int64_t H) {
  __m512 acc[GT][NB];
  DDD_UNROLL for (int g = 0; g < GT; ++g)
    DDD_UNROLL for (int b = 0; b < NB; ++b) acc[g][b] = _mm512_loadu_ps(out + g * H + 16 * b);
  for (int64_t j = 0; j < n_att; ++j) {
    const float* vj = v + idx[j] * ldv;
    __m512 vv[NB];
    DDD_UNROLL for (int b = 0; b < NB; ++b) vv[b] = _mm512_loadu_ps(vj + 16 * b);
    DDD_UNROLL for (int g = 0; g < GT; ++g) {
      const __m512 pg = _mm512_set1_ps(p[g * ldp + j]);
      DDD_UNROLL for (int b = 0; b < NB; ++b) acc[g][b] = _mm512_fmadd_ps(pg, vv[b], acc[g][b]);
    }
  }
  DDD_UNROLL for (int g = 0; g < GT; ++g)
    DDD_UNROLL for (int b = 0; b < NB; ++b) _mm512_storeu_ps(out + g * H + 16 * b, acc[g][b]);
}

template <int GT>
DDD_AVX512 void pv_heads512(const float* p, int64_t ldp, const int32_t* idx, int64_t n_att, const float* v,
                            int64_t ldv, float* out, int64_t H) {
  int64_t h = 0;
  for (; h + 64 <= H; h += 64) pv_group512<GT, 4>(p, ldp, idx, n_att, v + h, ldv, out + h, H);
  for (; h + 16 <= H; h += 16) pv_group512<GT, 1>(p, ldp, idx, n_att, v + h, ldv, out + h, H);
  for (; h + 8 <= H; h += 8) pv_group<GT, 1>(p, ldp, idx, n_att, v + h, ldv, out + h, H);
  pv_tail<GT>(p, ldp, idx, n_att, v, ldv, out, h, H);
}

DDD_AVX2 void pv_rows(const float* p, int64_t ldp, const int32_t* idx, int64_t n, const float* v, int64_t ldv,
                      float* out, int64_t G, int64_t H) {
  int64_t g = 0;
  if (g_avx512) {
    for (; g + 4 <= G; g += 4) pv_heads512<4>(p + g * ldp, ldp, idx, n, v, ldv, out + g * H, H);
    switch (G - g) {
      case 3: pv_heads512<3>(p + g * ldp, ldp, idx, n, v, ldv, out + g * H, H); break;
      case 2: pv_heads512<2>(p + g * ldp, ldp, idx, n, v, ldv, out + g * H, H); break;
      case 1: pv_heads512<1>(p + g * ldp, ldp, idx, n, v, ldv, out + g * H, H); break;
      default: break;
    }
    return;
  }
  for (; g + 4 <= G; g += 4) pv_heads<4>(p + g * ldp, ldp, idx, n, v, ldv, out + g * H, H);
  switch (G - g) {
    case 3: pv_heads<3>(p + g * ldp, ldp, idx, n, v, ldv, out + g * H, H); break;
    case 2: pv_heads<2>(p + g * ldp, ldp, idx, n, v, ldv, out + g * H, H); break;
    case 1: pv_heads<1>(p + g * ldp, ldp, idx, n, v, ldv, out + g * H, H); break;
    default: break;
  }
}

// Scores of GT query heads (q + g * H) against the 8 key rows k + idx[j] * ldk on AVX-512: the 16 chains of each
// are one 16-wide vector, and each key chunk is loaded once for the GT heads. Exactly score1 for every (head, row):
// out + g * ldo holds head g's eight scores.
template <int GT>
DDD_AVX512 inline void score8_heads512(const float* q, const float* k, const int32_t* idx, int64_t ldk, int64_t H,
                                       float* out, int64_t ldo) {
  const int64_t H16 = H & ~int64_t(15), H8 = H & ~int64_t(7);
  const float* kr[8];
  DDD_UNROLL for (int j = 0; j < 8; ++j) kr[j] = k + idx[j] * ldk;
  __m512 acc[GT][8];
  DDD_UNROLL for (int g = 0; g < GT; ++g)
    DDD_UNROLL for (int j = 0; j < 8; ++j) acc[g][j] = _mm512_setzero_ps();
  for (int64_t h = 0; h < H16; h += 16) {
    __m512 qv[GT];
    DDD_UNROLL for (int g = 0; g < GT; ++g) qv[g] = _mm512_loadu_ps(q + g * H + h);
    DDD_UNROLL for (int j = 0; j < 8; ++j) {
      const __m512 kv = _mm512_loadu_ps(kr[j] + h);
      DDD_UNROLL for (int g = 0; g < GT; ++g) acc[g][j] = _mm512_fmadd_ps(qv[g], kv, acc[g][j]);
    }
  }
  DDD_UNROLL for (int g = 0; g < GT; ++g) {
    const float* qg = q + g * H;
    __m256 a[8];
    DDD_UNROLL for (int j = 0; j < 8; ++j)
      a[j] = _mm256_add_ps(_mm512_castps512_ps256(acc[g][j]), _mm512_extractf32x8_ps(acc[g][j], 1));
    if (H8 > H16) {
      const __m256 qv = _mm256_loadu_ps(qg + H16);
      DDD_UNROLL for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr[j] + H16), a[j]);
    }
    _mm256_storeu_ps(out + g * ldo, hsum8x8(a));
    score_tails(qg, kr, H, out + g * ldo);
  }
}

// Scores of query heads [0, G) (q + g * H) against the key rows idx[lo, hi) into e + g * ldo (both instruction sets).
DDD_AVX2 void score_heads(const float* q, const float* k, const int32_t* idx, int64_t lo, int64_t hi, int64_t ldk,
                          int64_t G, int64_t H, float* e, int64_t ldo) {
  const int64_t j8 = lo + ((hi - lo) & ~int64_t(7));  // [lo, j8): groups of 8 rows; [j8, hi): one at a time
  if (g_avx512) {
    for (int64_t j = lo; j < j8; j += 8)
      for (int64_t g = 0; g < G; g += 3) {  // up to 3 heads: 24 accumulators + 3 query chunks + 1 key chunk
        const float* qg = q + g * H;
        float* eg = e + g * ldo + j;
        switch (std::min<int64_t>(3, G - g)) {
          case 3: score8_heads512<3>(qg, k, idx + j, ldk, H, eg, ldo); break;
          case 2: score8_heads512<2>(qg, k, idx + j, ldk, H, eg, ldo); break;
          default: score8_heads512<1>(qg, k, idx + j, ldk, H, eg, ldo); break;
        }
      }
  } else {
    for (int64_t g = 0; g < G; ++g)
      for (int64_t j = lo; j < j8; j += 8) score8(q + g * H, k, idx + j, ldk, H, e + g * ldo + j);
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t j = j8; j < hi; ++j) e[g * ldo + j] = score1(q + g * H, k + idx[j] * ldk, H);
}

// ---- scores with the slots in the lanes (AVX-512; rows >= kLaneRows, H % 16 == 0)
// score8_heads512 keeps each head dim's chain in a lane, so every score ends in a horizontal sum (24 of them per 8
// slots and 3 heads, about as many shuffles and adds as FMAs). Here the 16 lanes are 16 slots instead: the keys of
// a 16-slot group are transposed once per slot block (kt[h][lane]) and shared by every row of the chunk, and the
// same numbers come out of vertical arithmetic only. Per score, exactly score1's chains and sums: chain c (0..15)
// is fma(q[h], k[h], .) over h = c, c + 16, ... from zero; a_c = chain c + chain c + 8 (c < 8); the score is
// ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7)) -- hsum8_pairs. A row's scores are then written where its
// attended slots sit (compress store by its slot mask), so the rows stay independent. The attention of 30
// SmolLM2 layers (256 cached tokens, 9 query and 3 KV heads of 64 dims, one thread, runs/s17/abench.cc), per-row
// scores -> slot lanes: 3 rows 1.74-1.87 -> 1.66-1.83 ms, 4 rows 2.21-2.28 -> 1.93-2.14, 8 rows 3.89 -> 3.09, 16
// rows 6.76 -> 5.26; one row 1.21 -> 1.30-1.36 (the transposes are shared by too few rows), two rows mixed.
constexpr int64_t kLaneRows = 3;

// kt[h * 16 + i] = k[(s0 + i) * ldk + h] for i < n, zero for n <= i < 16; h < H (a multiple of 16).
DDD_AVX512 inline void transpose_keys16(const float* k, int64_t ldk, int64_t n, int64_t H, float* kt) {
  for (int64_t h0 = 0; h0 < H; h0 += 16) {
    __m512 r[16], t[16];
    if (n == 16) {
      DDD_UNROLL for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(k + i * ldk + h0);
    } else {
      for (int i = 0; i < 16; ++i) r[i] = i < n ? _mm512_loadu_ps(k + i * ldk + h0) : _mm512_setzero_ps();
    }
    DDD_UNROLL for (int i = 0; i < 8; ++i) {
      t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
      t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    DDD_UNROLL for (int i = 0; i < 4; ++i) {
      const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
      const __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
      r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
      r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
      r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
      r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    // r[4i + j]: rows 4i..4i+3, in each 128-bit lane L the column 4L + j of those rows
    DDD_UNROLL for (int j = 0; j < 4; ++j) {
      t[j] = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x88);       // lanes 0, 2 of rows 0-3 | lanes 0, 2 of rows 4-7
      t[4 + j] = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xdd);   // lanes 1, 3
      t[8 + j] = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x88);
      t[12 + j] = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xdd);
    }
    DDD_UNROLL for (int j = 0; j < 4; ++j) {
      _mm512_storeu_ps(kt + (h0 + j) * 16, _mm512_shuffle_f32x4(t[j], t[8 + j], 0x88));          // column j
      _mm512_storeu_ps(kt + (h0 + 4 + j) * 16, _mm512_shuffle_f32x4(t[4 + j], t[12 + j], 0x88));  // 4 + j
      _mm512_storeu_ps(kt + (h0 + 8 + j) * 16, _mm512_shuffle_f32x4(t[j], t[8 + j], 0xdd));       // 8 + j
      _mm512_storeu_ps(kt + (h0 + 12 + j) * 16, _mm512_shuffle_f32x4(t[4 + j], t[12 + j], 0xdd)); // 12 + j
    }
  }
}

// The 16 scores of each of GT query heads (q + g * H) against a transposed 16-slot group kt, into s[g].
template <int GT>
DDD_AVX512 inline void score16_lanes(const float* q, int64_t H, const float* kt, __m512* s) {
  __m512 prev[GT], p01[GT], p45[GT];
  DDD_UNROLL for (int c = 0; c < 8; ++c) {
    __m512 lo[GT], hi[GT];
    DDD_UNROLL for (int g = 0; g < GT; ++g) lo[g] = hi[g] = _mm512_setzero_ps();
    for (int64_t h = c; h < H; h += 16) {
      __m512 kl = _mm512_loadu_ps(kt + h * 16), kh = _mm512_loadu_ps(kt + (h + 8) * 16);
      asm("" : "+v"(kl), "+v"(kh));  // loaded once for the GT heads (not folded into each FMA)
      DDD_UNROLL for (int g = 0; g < GT; ++g) {
        lo[g] = _mm512_fmadd_ps(_mm512_set1_ps(q[g * H + h]), kl, lo[g]);
        hi[g] = _mm512_fmadd_ps(_mm512_set1_ps(q[g * H + h + 8]), kh, hi[g]);
      }
    }
    DDD_UNROLL for (int g = 0; g < GT; ++g) {
      const __m512 a = _mm512_add_ps(lo[g], hi[g]);  // a_c
      if (c == 0 || c == 2 || c == 4 || c == 6) prev[g] = a;
      else if (c == 1) p01[g] = _mm512_add_ps(prev[g], a);
      else if (c == 3) p01[g] = _mm512_add_ps(p01[g], _mm512_add_ps(prev[g], a));  // (a0 + a1) + (a2 + a3)
      else if (c == 5) p45[g] = _mm512_add_ps(prev[g], a);
      else s[g] = _mm512_add_ps(p01[g], _mm512_add_ps(p45[g], _mm512_add_ps(prev[g], a)));
    }
  }
}

// Scores of every row of a chunk (see attend_rows) on the slot-lane path, slot block by slot block.
DDD_AVX512 void score_rows_lanes(const float* q, int64_t ldq, const float* k, int64_t ldk, int64_t S, int64_t G,
                                 int64_t H, std::vector<RowSlots>& rows, int64_t R) {
  constexpr int64_t kGroups = kSlotBlock / 16;
  thread_local AlignedFloats kt_buf;
  thread_local std::vector<uint16_t> masks;  // [R, kGroups]: the slots each row attends in each group
  thread_local std::vector<int64_t> pos;     // [R]: scores written so far
  kt_buf.resize(kSlotBlock * H);
  masks.resize(R * kGroups);
  pos.assign(R, 0);
  float* kt = kt_buf.data();
  for (int64_t r = 0; r < R; ++r) rows[r].cur = 0;
  for (int64_t s0 = 0; s0 < S; s0 += kSlotBlock) {
    const int64_t s1 = std::min(S, s0 + kSlotBlock);
    uint16_t any[kGroups] = {};
    for (int64_t r = 0; r < R; ++r) {
      RowSlots& rs = rows[r];
      uint16_t* m = masks.data() + r * kGroups;
      std::fill(m, m + kGroups, 0);
      if (rs.none) continue;
      const auto [lo, hi] = next_slots(rs, s1);
      if (hi - lo == s1 - s0) {  // every slot of the block
        for (int64_t gi = 0; gi < kGroups; ++gi) {
          const int64_t n = std::clamp<int64_t>(s1 - s0 - 16 * gi, 0, 16);
          m[gi] = static_cast<uint16_t>((1u << n) - 1);
        }
      } else {
        for (int64_t j = lo; j < hi; ++j) {
          const int64_t off = rs.idx[j] - s0;
          m[off >> 4] |= static_cast<uint16_t>(1u << (off & 15));
        }
      }
      for (int64_t gi = 0; gi < kGroups; ++gi) any[gi] |= m[gi];
    }
    for (int64_t gi = 0; gi < kGroups; ++gi)
      if (any[gi]) transpose_keys16(k + (s0 + 16 * gi) * ldk, ldk, std::min<int64_t>(16, S - s0 - 16 * gi), H,
                                    kt + gi * H * 16);
    for (int64_t r = 0; r < R; ++r) {
      RowSlots& rs = rows[r];
      if (rs.none) continue;
      for (int64_t gi = 0; gi < kGroups; ++gi) {
        const uint16_t m = masks[r * kGroups + gi];
        if (!m) continue;
        const int n = __builtin_popcount(m);
        for (int64_t g0 = 0; g0 < G; g0 += 3) {
          __m512 s[3];
          const float* qg = q + r * ldq + g0 * H;
          const int64_t gt = std::min<int64_t>(3, G - g0);
          if (gt == 3) score16_lanes<3>(qg, H, kt + gi * H * 16, s);
          else if (gt == 2) score16_lanes<2>(qg, H, kt + gi * H * 16, s);
          else score16_lanes<1>(qg, H, kt + gi * H * 16, s);
          for (int64_t g = 0; g < gt; ++g) {
            float* dst = rs.e.data() + (g0 + g) * rs.padded + pos[r];
            if (m == 0xffff) _mm512_storeu_ps(dst, s[g]);
            else _mm512_mask_storeu_ps(dst, static_cast<__mmask16>((1u << n) - 1), _mm512_maskz_compress_ps(m, s[g]));
          }
        }
        pos[r] += n;
      }
    }
  }
}

// The unnormalised softmax of one row's scaled scores e[0:n_att] in place (e: `padded` floats, a multiple of 8; the
// padding comes back zero): max (exact in any order); e_j = exp8(e_j - max); returns their sum: lane l adds
// j = l mod 8 in order, the lanes then summed by hsum8_pairs. (attend_rows divides p @ V by it: one division per
// output element instead of one per slot.)
DDD_AVX2 inline float softmax8(float* e, int64_t n_att, int64_t padded, float scale) {
  const __m256 sc = _mm256_set1_ps(scale);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const int64_t n8 = n_att & ~int64_t(7);
  for (int64_t j = 0; j < padded; j += 8) _mm256_storeu_ps(e + j, _mm256_mul_ps(_mm256_loadu_ps(e + j), sc));
  __m256 mxv = _mm256_set1_ps(-INFINITY);
  for (int64_t j = 0; j < n8; j += 8) mxv = _mm256_max_ps(mxv, _mm256_loadu_ps(e + j));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mxv);
  float mx = -INFINITY;
  for (float x : lanes) mx = std::max(mx, x);
  for (int64_t j = n8; j < n_att; ++j) mx = std::max(mx, e[j]);
  const __m256 mv = _mm256_set1_ps(mx);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t j = 0; j < padded; j += 8) {
    __m256 x = exp8(_mm256_sub_ps(_mm256_loadu_ps(e + j), mv));
    if (j + 8 > n_att)  // zero the padding
      x = _mm256_and_ps(x, _mm256_castsi256_ps(
                               _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n_att - j)), lane)));
    _mm256_storeu_ps(e + j, x);
    sum = _mm256_add_ps(sum, x);
  }
  return hsum8_pairs(sum);
}

// softmax8's numbers on AVX-512: the same operations per element (scale, max, exp16 = exp8), the sum still eight
// lanes wide with lane l adding j = l mod 8 in order (each 16-wide exp adds its low half, then its high half), one
// pass fewer (scale with max).
DDD_AVX512 inline float softmax16(float* e, int64_t n_att, int64_t padded, float scale) {
  const __m512 sc = _mm512_set1_ps(scale);
  __m512 mxv = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 0; j < padded; j += 16) {
    const int64_t m = std::min<int64_t>(16, padded - j), a = std::clamp<int64_t>(n_att - j, 0, 16);
    const __mmask16 km = static_cast<__mmask16>((1u << m) - 1), ka = static_cast<__mmask16>((1u << a) - 1);
    const __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(km, e + j), sc);
    _mm512_mask_storeu_ps(e + j, km, x);
    mxv = _mm512_mask_max_ps(mxv, ka, mxv, x);
  }
  const __m512 mv = _mm512_set1_ps(_mm512_reduce_max_ps(mxv));
  __m256 sum = _mm256_setzero_ps();
  for (int64_t j = 0; j < padded; j += 16) {
    const int64_t m = std::min<int64_t>(16, padded - j), a = std::clamp<int64_t>(n_att - j, 0, 16);
    const __mmask16 km = static_cast<__mmask16>((1u << m) - 1), ka = static_cast<__mmask16>((1u << a) - 1);
    const __m512 x = _mm512_maskz_mov_ps(ka, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(km, e + j), mv)));
    _mm512_mask_storeu_ps(e + j, km, x);
    sum = _mm256_add_ps(sum, _mm512_castps512_ps256(x));
    if (m == 16) sum = _mm256_add_ps(sum, _mm512_extractf32x8_ps(x, 1));
  }
  return hsum8_pairs(sum);
}

// The G query heads of KV head kh for R rows of one batch element (q, out: row stride ldq floats; the row's G heads
// start at q / out), against keys / values k, v (slot stride ldk). Per row and query head, over the slots the row
// attends in ascending order:
//   score_j = score1(q, k_j) * scale (16-lane chains over the head dims: see score1);
//   e_j = exp(score_j - max), sum = sum_j e_j (lane l adds the slots j = l mod 8 in order, the lanes then summed
//   by hsum8_pairs -- an order fixed by the number of attended slots alone);
//   out = (sum_j e_j v_j) / sum (one fma chain in slot order, then one division per element).
// (Dividing p @ V once instead of every p_j, with the 64-byte aligned buffers, SmolLM2's 30 layers at 256 cached
// tokens, `bench/attention_ab.py 6f6b06a~1 6f6b06a`, medians of us a layer: two threads, keys and values streamed
// from memory (6 rounds) 7 rows 64.4 -> 62.0, 16 rows 105.3 -> 104.3, one row 27.0 -> 26.6; one thread, one layer
// in L2 (4 rounds) 7 rows 62.1 -> 60.2, 16 rows 145.8 -> 131.8. The target forward did not resolve it: t(7) 18.73 /
// 18.71 ms, bench/kernel_ab.py, 6 rounds.)
// Every number depends on the row's own slots only -- not on the other rows, nor on how slots fall into blocks --
// so a tree node gets exactly what a sequential decode of its path gets (the same slots in the same order: its
// ancestors sit at increasing slots, as the committed path will). The slot blocks only make the rows share each
// key and value row while it is in L1.
DDD_AVX2 void attend_rows(const float* q, const float* k, const float* v, const bool* mask, float* out, int64_t R,
                          int64_t ldq, int64_t S, int64_t G, int64_t ldk, int64_t H, float scale,
                          std::vector<RowSlots>& rows) {
  if (static_cast<int64_t>(rows.size()) < R) rows.resize(R);
  for (int64_t r = 0; r < R; ++r) {
    RowSlots& rs = rows[r];
    attended_slots(mask + r * S, S, rs.idx);
    rs.none = static_cast<int64_t>(rs.idx.size()) == S && !std::any_of(mask + r * S, mask + (r + 1) * S,
                                                                        [](bool x) { return x; });
    rs.padded = (static_cast<int64_t>(rs.idx.size()) + 7) & ~int64_t(7);
    rs.e.assign(G * rs.padded, 0.0f);
    rs.sum.resize(G);
  }
  // scores, slot block by slot block
  if (g_avx512 && H % 16 == 0 && R >= kLaneRows)
    score_rows_lanes(q, ldq, k, ldk, S, G, H, rows, R);
  else
    for_slot_blocks(rows, R, S, [&](int64_t r, RowSlots& rs, int64_t lo, int64_t hi) DDD_AVX2 {
      if (rs.none) return;
      score_heads(q + r * ldq, k, rs.idx.data(), lo, hi, ldk, G, H, rs.e.data(), rs.padded);
    });
  // softmax per row and head
  for (int64_t r = 0; r < R; ++r) {
    RowSlots& rs = rows[r];
    const int64_t n_att = static_cast<int64_t>(rs.idx.size());
    for (int64_t g = 0; g < G; ++g) {
      float* eg = rs.e.data() + g * rs.padded;
      rs.sum[g] = g_avx512 ? softmax16(eg, n_att, rs.padded, scale) : softmax8(eg, n_att, rs.padded, scale);
    }
    for (int64_t g = 0; g < G; ++g) std::fill(out + r * ldq + g * H, out + r * ldq + (g + 1) * H, 0.0f);
  }
  // probabilities x values, slot block by slot block (each row's chain continues from out)
  for_slot_blocks(rows, R, S, [&](int64_t r, RowSlots& rs, int64_t lo, int64_t hi) DDD_AVX2 {
    if (hi > lo) pv_rows(rs.e.data() + lo, rs.padded, rs.idx.data() + lo, hi - lo, v, ldk, out + r * ldq, G, H);
  });
  for (int64_t r = 0; r < R; ++r)
    for (int64_t g = 0; g < G; ++g) {
      float* o = out + r * ldq + g * H;
      const float sum = rows[r].sum[g];
      for (int64_t h = 0; h < H; ++h) o[h] = o[h] / sum;
    }
}

// q [B, T, N, H]; k, v [L, B, Kh, S, H] (a KV head's slots are one run of memory, which a chunk reads start to
// end) -- layer `layer` is used; mask [B, T, S]; out [B, T, N*H].
ffi::Error Attention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                     ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::PRED> mask,
                     ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions();
  const auto kd = k.dimensions();
  if (qd.size() != 4 || kd.size() != 5) return ffi::Error::InvalidArgument("ddd_attention: bad ranks");
  const int64_t B = qd[0], T = qd[1], N = qd[2], H = qd[3];
  const int64_t L = kd[0], S = kd[3], Kh = kd[2];
  if (kd[1] != B || kd[4] != H || Kh == 0 || N % Kh != 0 || mask.element_count() != B * T * S)
    return ffi::Error::InvalidArgument("ddd_attention: shape mismatch");
  const int64_t l = layer_index(layer, L);
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(H)));
  const float* qp = q.typed_data();
  const float* kp = k.typed_data() + l * B * S * Kh * H;
  const float* vp = v.typed_data() + l * B * S * Kh * H;
  const bool* mp = mask.typed_data();
  float* op = out->typed_data();
  const int64_t G = N / Kh;
  int64_t threads = pool_threads(pool);
  // one chunk = (batch element, KV head, group of rows): its rows share each key / value row while it is in L1;
  // rows are split into groups only as far as the threads need chunks
  const int64_t per = B * Kh;
  const int64_t groups = std::min<int64_t>(T, std::max<int64_t>(1, (2 * threads + per - 1) / per));
  const int64_t rows_per = (T + groups - 1) / groups;
  const int64_t n_chunks = per * ((T + rows_per - 1) / rows_per);
  if (n_chunks < 2) threads = 1;
  parallel_chunks(threads, n_chunks, [=](int64_t c) {
    thread_local std::vector<RowSlots> rows;
    const int64_t kh = c % Kh, bg = c / Kh;
    const int64_t n_rg = (T + rows_per - 1) / rows_per;
    const int64_t b = bg / n_rg, t0 = (bg % n_rg) * rows_per, t1 = std::min(T, t0 + rows_per);
    const int64_t r0 = b * T + t0, off = (b * Kh + kh) * S * H;
    attend_rows(qp + r0 * N * H + kh * G * H, kp + off, vp + off, mp + r0 * S, op + r0 * N * H + kh * G * H,
                t1 - t0, N * H, S, G, H, H, scale, rows);
  });
  return ffi::Error::Success();
}

// The arguments of a quantized panels' product: x [..., K], w [L, P, K/32, 48 * block bytes], layer [] ->
// out [..., N]; each handler then adds its attribute "kind" (0: Q4_1, 1: Q8_0, 2: Q4_0), after any further result.
auto qpanels_binding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::U8>>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Ret<ffi::Buffer<ffi::F32>>();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(DddLinear, Linear<ffi::F32>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [..., K]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // w [L, K, N] or [L, N, K]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer []
                                  .Ret<ffi::Buffer<ffi::F32>>()   // out [..., N]
                                  .Attr<bool>("trans"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(DddLinearF16, Linear<ffi::F16>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [..., K]
                                  .Arg<ffi::Buffer<ffi::F16>>()   // w [L, K, N] or [L, N, K], float16
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer []
                                  .Ret<ffi::Buffer<ffi::F32>>()   // out [..., N]
                                  .Attr<bool>("trans"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(DddLinearBlocks, LinearBlocks,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [..., K]
                                  .Arg<ffi::Buffer<ffi::U8>>()    // w [L, N, K/32 * block bytes], GGUF blocks
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer []
                                  .Ret<ffi::Buffer<ffi::F32>>()   // out [..., N]
                                  .Attr<int64_t>("kind"));        // 0: Q4_1, 1: Q8_0, 2: Q4_0

XLA_FFI_DEFINE_HANDLER_SYMBOL(DddLinearPanels, LinearPanels<ffi::F32>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [..., K]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // w [L, P, K, 48], panel-major
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer []
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out [..., N]

XLA_FFI_DEFINE_HANDLER_SYMBOL(DddLinearPanelsF16, LinearPanels<ffi::F16>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [..., K]
                                  .Arg<ffi::Buffer<ffi::F16>>()   // w [L, P, K, 48], panel-major float16
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer []
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out [..., N]

XLA_FFI_DEFINE_HANDLER_SYMBOL(DddLinearQPanels, LinearQPanels, qpanels_binding().Attr<int64_t>("kind"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(DddLinearQPanelsInt8, LinearQPanelsInt8, qpanels_binding().Attr<int64_t>("kind"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(DddLinearQPanelsInt8Greedy, LinearQPanelsInt8Greedy,
                              qpanels_binding()
                                  .Ret<ffi::Buffer<ffi::S32>>()   // ids [...]: each row's first maximum
                                  .Attr<int64_t>("kind"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(DddLinearQPanelsInt8Group, LinearQPanelsInt8Group,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [..., K]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer []
                                  .RemainingArgs()                // w_g [L, P_g, K/32, 48 * block bytes]
                                  .RemainingRets()                // out_g [..., N_g] float32
                                  .Attr<ffi::Span<const int64_t>>("kinds"));  // each w_g's kind, as "kind"

XLA_FFI_DEFINE_HANDLER_SYMBOL(DddLinearPanelsGreedy, LinearPanelsGreedy,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [..., K]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // w [L, P, K, 48], panel-major
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer []
                                  .Ret<ffi::Buffer<ffi::F32>>()   // out [..., N]
                                  .Ret<ffi::Buffer<ffi::S32>>());  // ids [...]: each row's first maximum

XLA_FFI_DEFINE_HANDLER_SYMBOL(DddLinearPanelsGreedyScreened, LinearPanelsGreedyScreened,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [..., K]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // w [L, P, K, W], panel-major (exact)
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer []
                                  .Arg<ffi::Buffer<ffi::S8>>()    // s [ceil(N / 48), ceil(K / 2), 96]: the screen
                                  .Arg<ffi::Buffer<ffi::F32>>()   // bound [3, N]: A, B, the scales
                                  .Ret<ffi::Buffer<ffi::S32>>()   // ids [...]: each row's first maximum
                                  .Ret<ffi::Buffer<ffi::F32>>());  // scratch [..., N]: screened logits

XLA_FFI_DEFINE_HANDLER_SYMBOL(DddAttention, Attention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q [B, T, N, H]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // k [L, B, Kh, S, H]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // v, as k
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer []
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // mask [B, T, S]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out [B, T, N*H]

extern "C" {
// 1 when this CPU runs the kernels (AVX2 + FMA + F16C).
__attribute__((visibility("default"))) int ddd_cpu_supported() {
  __builtin_cpu_init();
  g_avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
             __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") && !env_set("DDD_JAX_NO_AVX512");
  g_screen = screen_supported() && !env_set("DDD_JAX_NO_SCREEN");
  g_i8_variant = g_avx512 && i8_supported(kI8Avx512Vnni) ? kI8Avx512Vnni
                 : i8_supported(kI8AvxVnni)               ? kI8AvxVnni
                                                          : kI8Avx2;
  const char* l2 = std::getenv("DDD_JAX_L2_PREFETCH_ROWS");
  g_l2_prefetch_rows = l2 && *l2 ? std::max<int64_t>(1, std::atoll(l2)) : __builtin_cpu_is("amd") ? 1 : 6;
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
// 1 when the AVX-512 paths run (x @ W of 3 to 85 rows, GGUF blocks, attention).
__attribute__((visibility("default"))) int ddd_avx512() { return g_avx512; }
// 1 when the screened greedy lm_head runs (AVX-512 BF16; else its exact fallback).
__attribute__((visibility("default"))) int ddd_screen() { return g_screen; }
// Turn it off (0) or back on where the CPU has it (1). For benchmarks and tests.
__attribute__((visibility("default"))) void ddd_set_screen(int on) {
  g_screen = on && screen_supported();
}
// The row count from which the AVX-512 products prefetch into L2 instead of L1 (see g_l2_prefetch_rows).
__attribute__((visibility("default"))) int64_t ddd_l2_prefetch_rows() { return g_l2_prefetch_rows; }
// Set it (n >= 1). For benchmarks.
__attribute__((visibility("default"))) void ddd_set_l2_prefetch_rows(int64_t n) {
  g_l2_prefetch_rows = std::max<int64_t>(1, n);
}
// The rows ahead the AVX-512 panel products prefetch (g_panel_ahead; 0: none). For benchmarks.
__attribute__((visibility("default"))) void ddd_set_panel_ahead(int64_t n) { g_panel_ahead = std::max<int64_t>(0, n); }
// The row counts whose 48-column panel products take the AVX-512 tiles (bit M: M rows; see g_panel512_rows).
__attribute__((visibility("default"))) uint64_t ddd_panel512_rows() { return g_panel512_rows; }
__attribute__((visibility("default"))) void ddd_set_panel512_rows(uint64_t mask) { g_panel512_rows = mask; }
// Rows up to which quantized panels dequantize in registers, tile by tile (else once into L2). For benchmarks.
__attribute__((visibility("default"))) void ddd_set_qp_tile_rows(int64_t n) { g_qp_tile_rows = n; }
// 16-column panels (p16_chunk): the rows from which 16-row tiles run, and the K rows ahead each path prefetches
// (one or two rows; 16-row tiles). For benchmarks.
__attribute__((visibility("default"))) void ddd_set_p16(int64_t tall_rows, int64_t ahead, int64_t tall_ahead,
                                                        int64_t pf_rows) {
  g_p16_tall_rows = std::max<int64_t>(1, tall_rows);
  g_p16_pf_rows = pf_rows;
  g_p16_ahead = std::max<int64_t>(0, ahead);
  g_p16_tall_ahead = std::max<int64_t>(0, tall_ahead);
}
// The integer variant of int8 block products (0 avx2, 1 avxvnni, 2 avx512vnni; see LinearQPanelsInt8).
__attribute__((visibility("default"))) int ddd_int8_variant() { return g_i8_variant; }
// 1 when this CPU (and this build) has variant v.
__attribute__((visibility("default"))) int ddd_int8_supported(int v) { return i8_supported(v); }
// Choose variant v; 0 (and no change) when this CPU or build lacks it.
__attribute__((visibility("default"))) int ddd_set_int8_variant(int v) {
  if (!i8_supported(v)) return 0;
  g_i8_variant = v;
  return 1;
}
// The bytes ahead the int8 block products prefetch (g_i8_ahead; 0: none). For benchmarks.
__attribute__((visibility("default"))) void ddd_set_int8_ahead(int64_t n) { g_i8_ahead = std::max<int64_t>(0, n); }
// Cap the threads a product uses (0: the XLA pool's size). For benchmarks.
__attribute__((visibility("default"))) void ddd_set_max_threads(int64_t n) { g_max_threads = n; }
}
