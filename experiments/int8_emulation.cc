// The int8 block products' VNNI variants on any AVX2 CPU, for experiments/int8_emulation.py: the AVX-512 VNNI and
// AVX-VNNI intrinsics the integer tiles use are emulated in scalar code (below), the two variants' target
// attributes lowered to AVX2 (DDD_AVX512VNNI / DDD_AVXVNNI, defined before the kernels' source), and every variant's
// `i8_chunk` compared bitwise with the AVX2 variant's -- which tests/test_int8_blocks.py checks against a numpy
// model of the arithmetic. Over the three kinds, 1..19 rows (tiles of every height and a remainder) and 48, 100 and
// 192 columns (whole and partial panels). Prints {"checks": n, "mismatches": k}; each mismatch on stderr.
// Built with the kernels' own source (-DKERNEL_CC="path/to/cpu_kernels.cc"), so it reaches their internals.
#include <immintrin.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#define DDD_AVX512VNNI __attribute__((target("avx2,fma,f16c")))
#define DDD_AVXVNNI __attribute__((target("avx2,fma,f16c")))

// Each intrinsic as the instruction set defines it, lane by lane (wrapping integer adds, float32 operations).
namespace emu {
#define EMU __attribute__((target("avx2,fma,f16c"), noinline))  // out of line: the unrolled tiles stay small
template <class T, class V>
inline T as(const V& v) {  // the same 64 (or 32) bytes as another type
  static_assert(sizeof(T) == sizeof(V));
  T t;
  std::memcpy(&t, &v, sizeof t);
  return t;
}
struct U8x64 { uint8_t v[64]; };
struct U16x32 { uint16_t v[32]; };
struct I32x16 { int32_t v[16]; };
struct F32x16 { float v[16]; };

EMU __m512 setzero_ps() { return as<__m512>(F32x16{}); }
EMU __m512i setzero_si512() { return as<__m512i>(I32x16{}); }
EMU void storeu_ps(void* p, __m512 v) { std::memcpy(p, &v, 64); }
EMU __m512 loadu_ps(const void* p) { __m512 v; std::memcpy(&v, p, 64); return v; }
EMU __m512i loadu_si512(const void* p) { __m512i v; std::memcpy(&v, p, 64); return v; }
EMU __m512i set1_epi8(char c) { U8x64 a; std::memset(a.v, c, 64); return as<__m512i>(a); }
EMU __m512i set1_epi32(int32_t x) {
  I32x16 a;
  for (auto& v : a.v) v = x;
  return as<__m512i>(a);
}
EMU __m512 set1_ps(float x) {
  F32x16 a;
  for (auto& v : a.v) v = x;
  return as<__m512>(a);
}
EMU __m512i xor_si512(__m512i x, __m512i y) {
  auto a = as<U8x64>(x), b = as<U8x64>(y);
  for (int i = 0; i < 64; ++i) a.v[i] ^= b.v[i];
  return as<__m512i>(a);
}
EMU __m512i and_si512(__m512i x, __m512i y) {
  auto a = as<U8x64>(x), b = as<U8x64>(y);
  for (int i = 0; i < 64; ++i) a.v[i] &= b.v[i];
  return as<__m512i>(a);
}
EMU __m512i srli_epi16(__m512i x, unsigned n) {
  auto a = as<U16x32>(x);
  for (auto& v : a.v) v = n > 15 ? 0 : static_cast<uint16_t>(v >> n);
  return as<__m512i>(a);
}
EMU __m512i sub_epi32(__m512i x, __m512i y) {
  auto a = as<I32x16>(x), b = as<I32x16>(y);
  for (int i = 0; i < 16; ++i) a.v[i] = static_cast<int32_t>(static_cast<uint32_t>(a.v[i]) - b.v[i]);
  return as<__m512i>(a);
}
// vpdpbusd: each int32 lane plus the four products of its unsigned bytes of u and signed bytes of s (wrapping)
template <class V>
inline V dpbusd_lanes(V src, V u, V s) {
  constexpr int kLanes = sizeof(V) / 4;
  int32_t a[kLanes];
  uint8_t ub[4 * kLanes];
  int8_t sb[4 * kLanes];
  std::memcpy(a, &src, sizeof a);
  std::memcpy(ub, &u, sizeof ub);
  std::memcpy(sb, &s, sizeof sb);
  for (int i = 0; i < kLanes; ++i) {
    int32_t t = 0;
    for (int j = 0; j < 4; ++j) t += int32_t(ub[4 * i + j]) * int32_t(sb[4 * i + j]);
    a[i] = static_cast<int32_t>(static_cast<uint32_t>(a[i]) + static_cast<uint32_t>(t));
  }
  std::memcpy(&src, a, sizeof a);
  return src;
}
EMU __m512i dpbusd(__m512i src, __m512i u, __m512i s) { return dpbusd_lanes(src, u, s); }
EMU __m256i dpbusd_avx(__m256i src, __m256i u, __m256i s) { return dpbusd_lanes(src, u, s); }
EMU __m512 mul_ps(__m512 x, __m512 y) {
  auto a = as<F32x16>(x), b = as<F32x16>(y);
  for (int i = 0; i < 16; ++i) a.v[i] = a.v[i] * b.v[i];
  return as<__m512>(a);
}
EMU __m512 add_ps(__m512 x, __m512 y) {
  auto a = as<F32x16>(x), b = as<F32x16>(y);
  for (int i = 0; i < 16; ++i) a.v[i] = a.v[i] + b.v[i];
  return as<__m512>(a);
}
EMU __m512 cvtepi32_ps(__m512i x) {
  const auto a = as<I32x16>(x);
  F32x16 f;
  for (int i = 0; i < 16; ++i) f.v[i] = static_cast<float>(a.v[i]);
  return as<__m512>(f);
}
EMU __m512 cvtph_ps(__m256i h) {  // float16 -> float32 (exact) with F16C, 8 at a time
  F32x16 f;
  _mm256_storeu_ps(f.v, _mm256_cvtph_ps(_mm256_castsi256_si128(h)));
  _mm256_storeu_ps(f.v + 8, _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)));
  return as<__m512>(f);
}
#undef EMU
}  // namespace emu
#define _mm512_setzero_ps emu::setzero_ps
#define _mm512_setzero_si512 emu::setzero_si512
#define _mm512_storeu_ps emu::storeu_ps
#define _mm512_loadu_ps emu::loadu_ps
#define _mm512_loadu_si512 emu::loadu_si512
#define _mm512_set1_epi8 emu::set1_epi8
#define _mm512_set1_epi32 emu::set1_epi32
#define _mm512_set1_ps emu::set1_ps
#define _mm512_xor_si512 emu::xor_si512
#define _mm512_and_si512 emu::and_si512
#define _mm512_srli_epi16 emu::srli_epi16
#define _mm512_sub_epi32 emu::sub_epi32
#define _mm512_dpbusd_epi32 emu::dpbusd
#define _mm512_mul_ps emu::mul_ps
#define _mm512_add_ps emu::add_ps
#define _mm512_cvtepi32_ps emu::cvtepi32_ps
#define _mm512_cvtph_ps emu::cvtph_ps
#define _mm256_dpbusd_avx_epi32 emu::dpbusd_avx
#include KERNEL_CC

template <int64_t KIND>
int check(int64_t M, int64_t K, int64_t N, std::mt19937& rng) {
  const int64_t nb = K / 32, P = (N + 47) / 48;
  std::vector<uint8_t> w(P * nb * qp_bytes(KIND));
  for (auto& b : w) b = rng();
  const int hdr = KIND == kQ4_1 ? 96 : 48;  // float16 scales: exponent kept moderate
  for (int64_t p = 0; p < P * nb; ++p)
    for (int c = 0; c < hdr; ++c) w[p * qp_bytes(KIND) + c * 2 + 1] = 0x20 + rng() % 16;
  std::vector<float> xf(M * K);
  for (auto& v : xf) v = (int(rng() % 20001) - 10000) / 1000.0f;
  const I8Rows rows = i8_rows(xf.data(), M, K);  // the kernel's own quantization of the rows
  std::vector<float> ref(M * N), out(M * N);
  g_i8_variant = kI8Avx2;
  i8_chunk<KIND>(rows, w.data(), ref.data(), M, N, 0, N);
  int bad = 0;
  for (int v : {kI8AvxVnni, kI8Avx512Vnni}) {
    g_i8_variant = v;
    std::fill(out.begin(), out.end(), -1.0f);
    i8_chunk<KIND>(rows, w.data(), out.data(), M, N, 0, N);
    if (std::memcmp(out.data(), ref.data(), out.size() * 4) != 0) {
      ++bad;
      int64_t i = 0;
      while (std::memcmp(&out[i], &ref[i], 4) == 0) ++i;
      std::fprintf(stderr, "mismatch: kind %ld, variant %d, M %ld, N %ld: element %ld is %g, avx2 gives %g\n",
                   (long)KIND, v, (long)M, (long)N, (long)i, out[i], ref[i]);
    }
  }
  return bad;
}

int main() {
  ddd_cpu_supported();
  std::mt19937 rng(1);
  int bad = 0, runs = 0;
  for (int64_t M = 1; M <= 19; ++M)
    for (int64_t N : {48, 100, 192}) {
      bad += check<kQ4_1>(M, 96, N, rng) + check<kQ4_0>(M, 96, N, rng) + check<kQ8_0>(M, 64, N, rng);
      runs += 3;
    }
  std::printf("{\"checks\": %d, \"mismatches\": %d}\n", runs, bad);
  return bad != 0;
}
