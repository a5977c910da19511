// How fast a product tile multiplies on one thread with its operands in the core's caches (probe, plain C++ with
// AVX2 intrinsics, no torch):
//   g++ -O3 -march=native results/bench-static/probes/tile_shapes.cpp -o /tmp/tile_shapes && /tmp/tile_shapes
// 4 rows of x (float32, K = 576) against 64 weight rows (bfloat16: 72 KB, float32: 144 KB, in L2), 20000 calls, three
// times each: vector multiply-adds a second (4 x 64 x 576 / 8 per call). The shapes: one weight row at a time with
// two sets of 4 accumulators (h2o_kv's bfloat16 kernel), 4 x JB tiles (JB weight rows, 4 x JB accumulators; float32's
// kernel is 4 x 4), the row with x packed 4 rows to a block, the row with x held in registers (wrong sums: the bound
// without x's loads), and bare multiply-adds on 10 registers (the machine's rate).
#include <immintrin.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

static inline __m256 widen(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
static inline __m256 widen(const float* p) { return _mm256_loadu_ps(p); }
static inline float hsum(__m256 v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_hadd_ps(a, a);
  return _mm_cvtss_f32(_mm_hadd_ps(a, a));
}

template <typename T, int MODE>  // 0: x from memory, 1: x packed [K/8][4][8], 2: x in registers
__attribute__((noinline)) void row(const float* x, const T* w, int K, int N, float* out) {
  __m256 held[4];
  for (int r = 0; r < 4; ++r) held[r] = _mm256_loadu_ps(x + r * 8);
  for (int j = 0; j < N; ++j) {
    __m256 e[4], o[4];
    for (int r = 0; r < 4; ++r) e[r] = o[r] = _mm256_setzero_ps();
    const T* wj = w + (int64_t)j * K;
    for (int k = 0; k + 16 <= K; k += 16) {
      const __m256 w0 = widen(wj + k), w1 = widen(wj + k + 8);
      for (int r = 0; r < 4; ++r) {
        __m256 x0 = held[r], x1 = held[r];
        if (MODE == 0) x0 = _mm256_loadu_ps(x + r * K + k), x1 = _mm256_loadu_ps(x + r * K + k + 8);
        if (MODE == 1) x0 = _mm256_load_ps(x + k * 4 + r * 8), x1 = _mm256_load_ps(x + k * 4 + 32 + r * 8);
        e[r] = _mm256_fmadd_ps(x0, w0, e[r]);
        o[r] = _mm256_fmadd_ps(x1, w1, o[r]);
      }
    }
    for (int r = 0; r < 4; ++r) out[r * N + j] = hsum(_mm256_add_ps(e[r], o[r]));
  }
}

template <typename T, int JB>
__attribute__((noinline)) void tile(const float* x, const T* w, int K, int N, float* out) {
  for (int j = 0; j + JB <= N; j += JB) {
    __m256 a[4][JB];
    for (int r = 0; r < 4; ++r)
      for (int b = 0; b < JB; ++b) a[r][b] = _mm256_setzero_ps();
    for (int k = 0; k + 8 <= K; k += 8) {
      __m256 wk[JB];
      for (int b = 0; b < JB; ++b) wk[b] = widen(w + (int64_t)(j + b) * K + k);
      for (int r = 0; r < 4; ++r) {
        const __m256 xk = _mm256_loadu_ps(x + r * K + k);
        for (int b = 0; b < JB; ++b) a[r][b] = _mm256_fmadd_ps(xk, wk[b], a[r][b]);
      }
    }
    for (int r = 0; r < 4; ++r)
      for (int b = 0; b < JB; ++b) out[r * N + j + b] = hsum(a[r][b]);
  }
}

__attribute__((noinline)) void bare(float* out, long n) {
  __m256 a[10];
  for (int i = 0; i < 10; ++i) a[i] = _mm256_set1_ps(i);
  const __m256 m = _mm256_set1_ps(0.999f), c = _mm256_set1_ps(0.001f);
  for (long i = 0; i < n; ++i)
    for (int j = 0; j < 10; ++j) a[j] = _mm256_fmadd_ps(a[j], m, c);
  for (int i = 0; i < 10; ++i) out[i] = hsum(a[i]);
}

int main() {
  const int K = 576, N = 64, calls = 20000;
  float* x = (float*)aligned_alloc(64, 4 * K * 4);
  float* packed = (float*)aligned_alloc(64, 4 * K * 4);
  std::vector<float> out(4 * N), wf(N * K);
  std::vector<uint16_t> wb(N * K);
  for (int i = 0; i < 4 * K; ++i) x[i] = rand() / (float)RAND_MAX;
  for (int k = 0; k < K; k += 8)
    for (int r = 0; r < 4; ++r) memcpy(packed + k * 4 + r * 8, x + r * K + k, 32);
  for (int i = 0; i < N * K; ++i) {
    wf[i] = rand() / (float)RAND_MAX;
    uint32_t bits;
    memcpy(&bits, &wf[i], 4);
    wb[i] = bits >> 16;
  }
  auto time = [&](const char* name, int n, auto f) {
    printf("%-28s", name);
    for (int rep = 0; rep < 3; ++rep) {
      const auto start = std::chrono::steady_clock::now();
      for (int i = 0; i < calls; ++i) f();
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      printf(" %5.2f", 4.0 * n * K / 8 * calls / s / 1e9);
    }
    printf("  G vector multiply-adds/s\n");
  };
  time("bfloat16 row", N, [&] { row<uint16_t, 0>(x, wb.data(), K, N, out.data()); });
  time("bfloat16 tile 4x2", N, [&] { tile<uint16_t, 2>(x, wb.data(), K, N, out.data()); });
  time("bfloat16 tile 4x3", 63, [&] { tile<uint16_t, 3>(x, wb.data(), K, 63, out.data()); });
  time("bfloat16 tile 4x4", N, [&] { tile<uint16_t, 4>(x, wb.data(), K, N, out.data()); });
  time("bfloat16 row, x packed", N, [&] { row<uint16_t, 1>(packed, wb.data(), K, N, out.data()); });
  time("bfloat16 row, x in registers", N, [&] { row<uint16_t, 2>(x, wb.data(), K, N, out.data()); });
  time("float32 row", N, [&] { row<float, 0>(x, wf.data(), K, N, out.data()); });
  time("float32 tile 4x4", N, [&] { tile<float, 4>(x, wf.data(), K, N, out.data()); });
  const auto start = std::chrono::steady_clock::now();
  bare(out.data(), 100000000);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  printf("%-28s %5.2f  G vector multiply-adds/s\n", "bare multiply-adds", 1e9 / s / 1e9);
  return out[3] > 1e30f;
}
