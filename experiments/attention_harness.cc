// The CPU attention kernel alone, for experiments/attention_ab.py: per-layer microseconds of `Attention`'s body (its
// chunking and attend_rows) over SmolLM2's shapes -- 30 layers, 3 KV heads and 9 query heads of 64 dims,
// head-major caches of 512 slots with the first 256 attended plus T new rows causal among themselves.
//   attention_harness T MODE REPS THREADS
// MODE "stream": every layer's call follows 3.5 MB of other reads on every thread (a 105 MB ring, as the layer's
// products stream their weights), so keys and values come from memory, as in the target forward; "l2": one
// layer's keys and values, hot. Prints the median and the minimum over REPS passes of the 30 layers.
// Built with the kernels' own source (-DKERNEL_CC="path/to/cpu_kernels.cc"), so it reaches their internals.
// The chunking over threads is `Attention`'s, restated below: it sits inside the FFI handler, and the harness
// must build against older revisions of the kernels too (attend_rows, RowSlots and parallel_chunks are in all of them).
#include KERNEL_CC
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: attention_harness T stream|l2 REPS THREADS\n");
    return 2;
  }
  const int64_t T = std::atoi(argv[1]);
  const bool stream = std::strcmp(argv[2], "stream") == 0;
  const int reps = std::atoi(argv[3]);
  const int64_t threads = std::atoi(argv[4]);
  if (T < 1 || T > 256 || reps < 1 || threads < 1 || (!stream && std::strcmp(argv[2], "l2") != 0)) {
    std::fprintf(stderr, "attention_harness: T in [1, 256], MODE stream or l2, REPS and THREADS >= 1\n");
    return 2;
  }
  if (!ddd_cpu_supported()) {
    std::fprintf(stderr, "attention_harness: this CPU lacks AVX2/FMA/F16C\n");
    return 3;
  }
  const int64_t L = 30, Kh = 3, S = 512, H = 64, N = 9, ctx = 256, G = N / Kh;
  const size_t ring_layer = 900 * 1024;  // floats: 3.5 MB
  std::vector<float> k(L * Kh * S * H), v(L * Kh * S * H), q(T * N * H), out(T * N * H);
  std::vector<float> ring(stream ? L * ring_layer : 0, 1.0f);
  std::mt19937 gen(0);
  std::normal_distribution<float> nd;
  for (auto& x : k) x = nd(gen);
  for (auto& x : v) x = nd(gen);
  for (auto& x : q) x = nd(gen);
  std::unique_ptr<bool[]> mask(new bool[T * S]());
  for (int64_t t = 0; t < T; ++t)
    for (int64_t s = 0; s < ctx + t + 1; ++s) mask[t * S + s] = true;
  // Attention's chunking (one batch element)
  const int64_t groups = std::min<int64_t>(T, std::max<int64_t>(1, (2 * threads + Kh - 1) / Kh));
  const int64_t rows_per = (T + groups - 1) / groups;
  const int64_t n_rg = (T + rows_per - 1) / rows_per;
  const int64_t n_chunks = Kh * n_rg;
  std::vector<double> per;
  double sink = 0.0;
  for (int rep = 0; rep < reps; ++rep) {
    double total = 0.0;
    for (int64_t l0 = 0; l0 < L; ++l0) {
      const int64_t l = stream ? l0 : 0;
      if (stream) {
        const float* e = ring.data() + l * ring_layer;
        double part[2] = {0.0, 0.0};
        parallel_chunks(std::min<int64_t>(threads, 2), 2, [&](int64_t c) {
          float s = 0.0f;
          for (size_t i = c * ring_layer / 2; i < (c + 1) * ring_layer / 2; i += 16) s += e[i];
          part[c] = s;
        });
        sink += part[0] + part[1];
      }
      const float* kp = k.data() + l * Kh * S * H;
      const float* vp = v.data() + l * Kh * S * H;
      const auto t0 = std::chrono::steady_clock::now();
      parallel_chunks(n_chunks < 2 ? 1 : threads, n_chunks, [&](int64_t c) {
        thread_local std::vector<RowSlots> rows;
        const int64_t kh = c % Kh, rg = c / Kh;
        const int64_t t_begin = rg * rows_per, t_end = std::min(T, t_begin + rows_per);
        attend_rows(q.data() + t_begin * N * H + kh * G * H, kp + kh * S * H, vp + kh * S * H, mask.get() + t_begin * S,
                    out.data() + t_begin * N * H + kh * G * H, t_end - t_begin, N * H, S, G, H, H, 0.125f, rows);
      });
      total += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    per.push_back(total / L * 1e6);
  }
  std::sort(per.begin(), per.end());
  double checksum = 0.0;
  for (float x : out) checksum += x;
  std::printf("{\"us\": %.3f, \"min_us\": %.3f, \"checksum\": %.9g}\n", per[per.size() / 2], per[0], checksum);
  return sink == -1.0 ? 1 : 0;
}
