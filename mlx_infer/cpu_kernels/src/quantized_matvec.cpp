// Products of activations with MLX affine 4/8-bit weights on the CPU, for decode and prefill.
//
// With integer activations every product, whatever its row count, goes to the integer kernel of
// qmv_int8.cpp after x is quantized here (QuantizedX): to int16 (the default "int16"; 8-bit weights
// always) or, with "int8", to int8 for 4-bit weights. The same arithmetic for each row of a decode step,
// a batch or a prefill chunk, and no BLAS needed.
//
// With float32 activations (exact to float32 rounding) the kernel reads the packed 4- or 8-bit words
// directly and never writes a dequantized matrix. Per group of `group_size` weights:
//   sum_k x_k (s q_k + b) = s * sum_k x_k q_k + b * sum_k x_k,
// so the inner loop is one FMA per weight and activation row, and the bias term uses per-group
// sums of x computed once per call. Output features are split across the thread pool; up to
// four activation rows share each unpacked weight vector. For more rows (batches, prefill
// chunks; see use_gemm) each thread dequantizes tiles of features into L2 and multiplies them with the
// BLAS instead: no full float32 copy of the matrix is ever written.

#include "quantized_matvec.h"

#include <cpuid.h>
#include <dlfcn.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <typeinfo>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "buffer.h"
#include "qmv_int8.h"
#include "simd.h"
#include "strided.h"
#include "thread_pool.h"

namespace mx = mlx::core;

// The CBLAS entry point libmlx.so itself calls: resolved at load time from the process's global
// symbols, so it is the optimized BLAS mlx_infer.blas binds (MKL, OpenBLAS) or MLX's reference one.
extern "C" {
enum CBLAS_ORDER { CblasRowMajor = 101 };
enum CBLAS_TRANSPOSE { CblasNoTrans = 111, CblasTrans = 112 };
void cblas_sgemm(CBLAS_ORDER order, CBLAS_TRANSPOSE trans_a, CBLAS_TRANSPOSE trans_b, int m, int n, int k,
                 float alpha, const float* a, int lda, const float* b, int ldb, float beta, float* c, int ldc);
}

namespace mlx_infer {

namespace {

// Eight consecutive weights of one 32-bit word (4-bit) or of two words (8-bit) as floats.
template <int BITS>
inline __m256 unpack8(const uint32_t* words, int k) {
  if constexpr (BITS == 4) {
    const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    __m256i v = _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(words[k / 8])), shifts);
    return _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(0xF)));
  } else {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(words + k / 4));
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
  }
}

struct Problem {
  const float* x;
  const uint32_t* w;
  GroupParams scales, biases;
  const float* xsum;  // [M, groups]
  float* out;
  int M, N, K, group, groups;
};

// Output features [n0, n0 + NB) for activation rows [m0, m0 + MB). NB * MB independent FMA chains
// hide the FMA latency; NB rows share each x load, MB rows share each unpacked weight vector.
template <int BITS, int MB, int NB>
inline void tile(const Problem& p, int n0, int m0) {
  constexpr int PER_WORD = 32 / BITS;
  const int words_per_row = p.K / PER_WORD;
  const uint32_t* wr[NB];
  __m256 total[NB][MB];
  float bias_part[NB][MB];
  for (int r = 0; r < NB; ++r) {
    wr[r] = p.w + static_cast<size_t>(n0 + r) * words_per_row;
    for (int m = 0; m < MB; ++m) {
      total[r][m] = _mm256_setzero_ps();
      bias_part[r][m] = 0.0f;
    }
  }
  for (int g = 0; g < p.groups; ++g) {
    __m256 acc[NB][MB];
    for (int r = 0; r < NB; ++r)
      for (int m = 0; m < MB; ++m) acc[r][m] = _mm256_setzero_ps();
    const int k0 = g * p.group;
    for (int k = k0; k < k0 + p.group; k += 8) {
      __m256 xv[MB];
      for (int m = 0; m < MB; ++m) xv[m] = _mm256_loadu_ps(p.x + static_cast<size_t>(m0 + m) * p.K + k);
      for (int r = 0; r < NB; ++r) {
        const __m256 wv = unpack8<BITS>(wr[r], k);
        for (int m = 0; m < MB; ++m) acc[r][m] = _mm256_fmadd_ps(wv, xv[m], acc[r][m]);
      }
    }
    for (int r = 0; r < NB; ++r) {
      const size_t at = static_cast<size_t>(n0 + r) * p.groups + g;
      const __m256 s = _mm256_set1_ps(p.scales.at(at));
      const float bias = p.biases.at(at);
      for (int m = 0; m < MB; ++m) {
        total[r][m] = _mm256_fmadd_ps(acc[r][m], s, total[r][m]);
        bias_part[r][m] += bias * p.xsum[(m0 + m) * p.groups + g];
      }
    }
  }
  for (int r = 0; r < NB; ++r)
    for (int m = 0; m < MB; ++m)
      p.out[static_cast<size_t>(m0 + m) * p.N + n0 + r] = hsum(total[r][m]) + bias_part[r][m];
}

template <int BITS, int MB>
void rows(const Problem& p, int n0, int n1, int m0) {
  constexpr int NB = MB == 1 ? 4 : 2;
  int n = n0;
  for (; n + NB <= n1; n += NB) tile<BITS, MB, NB>(p, n, m0);
  for (; n < n1; ++n) tile<BITS, MB, 1>(p, n, m0);
}

// Features [n0, n1) dequantized to float32 rows of `tile` (row-major, K floats each).
template <int BITS>
void dequantize_rows(const Problem& p, int n0, int n1, float* tile) {
  const int words_per_row = p.K / (32 / BITS);
  for (int n = n0; n < n1; ++n) {
    const uint32_t* wr = p.w + static_cast<size_t>(n) * words_per_row;
    float* row = tile + static_cast<size_t>(n - n0) * p.K;
    for (int g = 0; g < p.groups; ++g) {
      const __m256 s = _mm256_set1_ps(p.scales.at(static_cast<size_t>(n) * p.groups + g));
      const __m256 b = _mm256_set1_ps(p.biases.at(static_cast<size_t>(n) * p.groups + g));
      for (int k = g * p.group; k < (g + 1) * p.group; k += 8) {
        _mm256_storeu_ps(row + k, _mm256_fmadd_ps(unpack8<BITS>(wr, k), s, b));
      }
    }
  }
}

// Activation rows from which a product is a small matrix multiplication rather than several
// matrix-vector products: unpacking each weight once per 4 rows, the matvec kernel spends more on
// unpacking and loading x than on FMAs, while the BLAS blocks for registers and caches.
constexpr int kGemmRows = 8;
// Features dequantized per BLAS call (64 rows of K floats, in L2 for the models' K).
constexpr int kTileFeatures = 64;

// Whether M activation rows of K features go through dequantized tiles and the BLAS. Measured on
// 2 cores (fused matvec vs tiles): K = 576, 8 rows 0.9 vs 0.8 ms, 16 rows 1.8 vs 1.0 ms;
// K = 4096, 8 rows 7.5 vs 11 ms, 16 rows 15 vs 12 ms (the BLAS packs x again for every tile).
bool use_gemm(int M, int K) {
  return M >= 2 * kGemmRows || (M >= kGemmRows && K <= 1024);
}

// Each pool thread runs its own BLAS calls, so the BLAS must not start threads of its own: with
// MKL (whose per-thread setting exists for this) a 512-row product took 33 ms instead of 19. The
// caller's setting is restored afterwards: pool thread 0 is MLX's stream thread, whose own float32
// matmuls should keep MKL's threads.
class SingleThreadedBlas {
 public:
  SingleThreadedBlas() {
    if (set_local() != nullptr) previous_ = set_local()(1);
  }
  ~SingleThreadedBlas() {
    if (set_local() != nullptr) set_local()(previous_);
  }

 private:
  using SetLocal = int (*)(int);  // MKL's C interface (the lowercase name is the Fortran one)
  static SetLocal set_local() {
    static const auto fn = reinterpret_cast<SetLocal>(dlsym(RTLD_DEFAULT, "MKL_Set_Num_Threads_Local"));
    return fn;
  }
  int previous_ = 0;
};

using Int8Features = void (*)(const Int8Problem&, int, int);

// The 256-bit int8 build for this CPU: VNNI where the CPU (and the compiler that built this) has it.
Int8Features best_int8_256() {
#ifdef MLX_INFER_HAVE_VNNI
  if (__builtin_cpu_supports("avxvnni")) return int8_vnni::features;
#endif
  return int8_avx2::features;
}

#ifdef MLX_INFER_HAVE_AMX
// Whether the CPU has AMX-INT8 (CPUID leaf 7: EDX bits 24 and 25, tiles and int8) and Linux lets this
// process use the tile registers: they are off until asked for (arch_prctl ARCH_REQ_XCOMP_PERM for
// XTILEDATA), and a tile instruction without them is SIGILL, as it is in a VM that does not pass them on.
bool amx_usable() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) || !(edx & (1u << 24)) || !(edx & (1u << 25))) {
    return false;
  }
  constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
}
#endif

// The 512-bit build, where the CPU has AVX-512 with VNNI (and the compiler that built this did).
Int8Features best_int8_512() {
#ifdef MLX_INFER_HAVE_AVX512
  if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
    return int8_avx512::features;
  }
#endif
  return nullptr;
}

// The int8 build for this CPU: 512-bit vectors with AMX tiles, or without, else the best 256-bit one.
Int8Features best_int8() {
  const Int8Features wide = best_int8_512();
#ifdef MLX_INFER_HAVE_AMX
  static const bool amx = amx_usable();
  if (wide != nullptr && amx) return int8_avx512::features_amx;
#endif
  return wide != nullptr ? wide : best_int8_256();
}

// nullptr: float32 activations.
std::atomic<Int8Features> g_int8{best_int8()};
// With int8 features: 4-bit weights meet int16 x instead of int8 (the "int16" activations). int16 from the
// start, as the package sets it (cpu_kernels.DEFAULT_ACTIVATIONS): a build loaded on its own, as a
// benchmark comparing two builds in one process does, computes as the package does.
std::atomic<bool> g_x16{true};

// How QuantizedX lays out the quantized x, for the kernel that reads it (see Int8Problem).
enum class XLayout {
  octets,        // int8, for 4-bit weights: each 8 values as their 4 even ones, then their 4 odd ones, the
                 // order of a weight dword's low and high nibbles (a byte holds weights 2j and 2j + 1)
  split_octets,  // int16, for 4-bit weights: as two int8 arrays h and l, x = 256 h + l, each in octets
  split,         // int16, for 8-bit weights: h and l in order (a weight dword holds 4 consecutive weights)
};

// The int16 levels of x: 127 * 257, the largest whose every value v = 256 h + l keeps h within a
// signed byte (l the signed low byte, in [-128, 127]; h = (v - l) / 256, in [-127, 127]: at 32640 h would
// be 128), so w . x is two vpdpbusd sums of u8 weights and signed bytes with no correction term. It
// costs the int16 x 0.4% of its 32767 levels.
constexpr float kSplitLevels = 32639.0f;

// A block of 32 values quantized: q = round-to-nearest-even(x * levels / max|x|) (std::nearbyint's
// rounding, as the NumPy scheme of the tests), the scale d = max|x| / levels and the sum of q.
struct Block32 {
  __m256i q[4];  // values 8i..8i + 7 in q[i]
  float d;
  int32_t sum;
};

inline Block32 quantize_block(const float* xb, float levels) {
  Block32 out;
  __m256 v[4];
  __m256 amax = _mm256_setzero_ps();
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(xb + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  const float a = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
  out.d = a / levels;
  const __m256 inv = _mm256_set1_ps(a > 0.0f ? levels / a : 0.0f);
  __m256i sum = _mm256_setzero_si256();
  for (int i = 0; i < 4; ++i) {
    out.q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));  // the default rounding: to nearest even
    sum = _mm256_add_epi32(sum, out.q[i]);
  }
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
  out.sum = _mm_cvtsi128_si32(s4);
  return out;
}

// 32 int32 values (8 per vector) as int8, in order (packs saturate: the values fit anyway).
inline __m256i pack_int8(const __m256i (&q)[4]) {
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  // The packs interleave 128-bit lanes: 4-byte groups come as values 0, 8, 16, 24, 4, 12, 20, 28 (x4).
  return _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// x [M, K] -> the quantized blocks, scales and sums of Int8Problem in `layout`. Rows are independent:
// a prefill's rows are quantized on the thread pool.
struct QuantizedX {
  Buffer<int8_t> q, low;
  Buffer<float> dx, xsum;

  QuantizedX(const float* x, int M, int K, int group, XLayout layout)
      : q(static_cast<size_t>(M) * K),
        low(layout == XLayout::octets ? 0 : static_cast<size_t>(M) * K),
        dx(static_cast<size_t>(M) * (K / 32)),
        xsum(static_cast<size_t>(M) * (K / group)) {
    pool().for_range(M, kRowsPerQuantizeTask,
                     [&](int m0, int m1) { for (int m = m0; m < m1; ++m) row(x, m, K, group, layout); });
  }

 private:
  // Rows too few to be worth waking the pool for (a decode step's): a row of SmolLM2 takes ~1 us.
  static constexpr int kRowsPerQuantizeTask = 8;

  void row(const float* x, int m, int K, int group, XLayout layout) {
    const int blocks = K / 32, per_group = group / 32;
    const float levels = layout == XLayout::octets ? 127.0f : kSplitLevels;
    const size_t at_row = static_cast<size_t>(m) * K;
    float group_sum = 0.0f;  // the sum of x^ = dx * qx over the current weight group, block by block
    for (int b = 0; b < blocks; ++b) {
      const Block32 block = quantize_block(x + at_row + static_cast<size_t>(b) * 32, levels);
      dx.get()[static_cast<size_t>(m) * blocks + b] = block.d;
      store(block, at_row + static_cast<size_t>(b) * 32, layout);
      group_sum += block.d * static_cast<float>(block.sum);
      if ((b + 1) % per_group == 0) {  // the bias term's sums of x^ per weight group
        xsum.get()[static_cast<size_t>(m) * (K / group) + b / per_group] = group_sum;
        group_sum = 0.0f;
      }
    }
  }

  // Each 8 bytes as their even ones, then their odd ones.
  static __m256i to_octets(__m256i bytes) {
    return _mm256_shuffle_epi8(bytes, _mm256_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15, 0, 2, 4,
                                                       6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15));
  }

  // A block's values where `layout` puts them (k: the index of its first value in the row-major x).
  void store(const Block32& block, size_t k, XLayout layout) {
    if (layout == XLayout::octets) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q.get() + k), to_octets(pack_int8(block.q)));
      return;
    }
    __m256i high[4], low_bytes[4];
    for (int i = 0; i < 4; ++i) {
      low_bytes[i] = _mm256_srai_epi32(_mm256_slli_epi32(block.q[i], 24), 24);  // the low byte, signed
      high[i] = _mm256_srai_epi32(_mm256_sub_epi32(block.q[i], low_bytes[i]), 8);
    }
    __m256i h = pack_int8(high), l = pack_int8(low_bytes);
    if (layout == XLayout::split_octets) h = to_octets(h), l = to_octets(l);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q.get() + k), h);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(low.get() + k), l);
  }
};

// Whether the int8 kernel computes a product of these settings (any number of rows).
bool fits_int8(int K, int group, int bits) {
  return K % 64 == 0 && group % 32 == 0 && (bits == 4 || bits == 8);
}

template <int BITS>
void run_int8(const float* x, const AffineView& w, int M, int K, float* out, Int8Features features, bool x16) {
  const XLayout layout = BITS == 8 ? XLayout::split : x16 ? XLayout::split_octets : XLayout::octets;
  const QuantizedX xq(x, M, K, w.group, layout);
  const Int8Problem ip{xq.q.get(), xq.low.get(), xq.dx.get(), xq.xsum.get(), w.w, w.scales, w.biases, out,
                       M, w.rows, K, w.group, BITS, layout != XLayout::octets};
  // Ranges of whole 16-feature vectors for the 512-bit kernel; a decode step's few rows take one range a
  // thread: a range's first tile waits for memory (TilePrefetch fetches each next one), and with four ranges
  // a thread each product waited four times (batch 4 decode: 0.93-0.96 of the step, batch 1 0.90-1.01).
  // Long products (a head: ~1 ms) keep four, whose first tiles cost little beside the time a worker
  // descheduled while holding half of the product would.
  constexpr size_t kShortBytes = size_t{4} << 20;
  const bool short_product = M <= ThreadPool::kDecodeRows && static_cast<size_t>(w.rows) * K * BITS / 8 <= kShortBytes;
  pool().for_range(w.rows, 16, [&](int n0, int n1) { features(ip, n0, n1); },
                   short_product ? 1 : ThreadPool::kChunksPerThread);
}

// Float32 activations: the fused matvec kernel for a few rows, dequantized tiles through the BLAS for more.
template <int BITS>
void run_float(const Problem& p) {
  pool().for_range(p.N, 8, [&](int n0, int n1) {
    if (use_gemm(p.M, p.K)) {
      const SingleThreadedBlas one_thread;
      std::vector<float> tile(static_cast<size_t>(kTileFeatures) * p.K);
      for (int t0 = n0; t0 < n1; t0 += kTileFeatures) {
        const int t1 = std::min(n1, t0 + kTileFeatures);
        dequantize_rows<BITS>(p, t0, t1, tile.data());
        // out[:, t0:t1] = x @ tile.T
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, p.M, t1 - t0, p.K, 1.0f, p.x, p.K, tile.data(),
                    p.K, 0.0f, p.out + t0, p.N);
      }
      return;
    }
    int m0 = 0;
    for (; m0 + 4 <= p.M; m0 += 4) rows<BITS, 4>(p, n0, n1, m0);
    for (; m0 < p.M; ++m0) rows<BITS, 1>(p, n0, n1, m0);
  });
}

// What the affine ops share: their (group_size, bits), which make two of them equivalent, and no GPU kernel.
class AffineOp : public mx::UnaryPrimitive {
 public:
  AffineOp(mx::Stream stream, int group_size, int bits)
      : mx::UnaryPrimitive(stream), group_size_(group_size), bits_(bits) {}

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error(std::string(name()) + " is a CPU kernel");
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    if (typeid(other) != typeid(*this)) return false;
    const auto& o = static_cast<const AffineOp&>(other);
    return group_size_ == o.group_size_ && bits_ == o.bits_;
  }

 protected:
  // The output allocated and every array recorded with the stream's encoder, which the task goes to.
  mx::cpu::CommandEncoder& prepare(const std::vector<mx::array>& inputs, mx::array& out) {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) encoder.set_input_array(a);
    encoder.set_output_array(out);
    return encoder;
  }

  int group_size_;
  int bits_;
};

class AffineQMV : public AffineOp {
 public:
  using AffineOp::AffineOp;

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    auto& encoder = prepare(inputs, out);
    const int K = inputs[0].shape(-1);
    const int M = static_cast<int>(inputs[0].size() / K);
    encoder.dispatch([x = Input<float>(inputs[0]), w = AffineWeights(inputs[1], inputs[2], inputs[3], group_size_, bits_),
                      op = out.data<float>(), M, K]() {
      std::vector<float> x_scratch;
      AffineWeights::Scratch w_scratch;
      affine_product(x.rows(x_scratch), M, K, w.view(w_scratch), op);
    });
  }

  const char* name() const override { return "AffineQMV"; }
};

// Rows ids[t] of an affine table, dequantized: out[t, k] = float(q) * scale + bias, the product rounded
// before the sum as MLX's dequantize computes it (unpacked values times the widened scales, plus the
// biases), in one op where MLX's CPU backend takes ~30 (gathers, shifts, broadcasts, casts). An id
// outside the table gives a row of zeros.
class EmbedRows : public AffineOp {
 public:
  using AffineOp::AffineOp;

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    auto& encoder = prepare(inputs, out);
    const int D = inputs[1].shape(1) * (32 / bits_);
    encoder.dispatch([ids = Input<int32_t>(inputs[0]),
                      w = AffineWeights(inputs[1], inputs[2], inputs[3], group_size_, bits_), op = out.data<float>(),
                      D]() {
      std::vector<int32_t> id_scratch;
      AffineWeights::Scratch w_scratch;
      const int32_t* at = ids.rows(id_scratch);
      const AffineView v = w.view(w_scratch);
      const int per_word = 32 / v.bits, groups = D / v.group;
      const uint32_t mask = (1u << v.bits) - 1;
      for (size_t t = 0; t < ids.size; ++t) {
        float* o = op + t * D;
        if (at[t] < 0 || at[t] >= v.rows) {  // never read outside the table (the engine rejects such tokens)
          std::fill(o, o + D, 0.0f);
          continue;
        }
        const size_t row = static_cast<size_t>(at[t]);
        const uint32_t* words = v.w + row * (D / per_word);
        for (int k = 0; k < D; ++k) {
          const uint32_t q = (words[k / per_word] >> ((k % per_word) * v.bits)) & mask;
          const size_t g = row * groups + k / v.group;
          const float scaled = static_cast<float>(q) * v.scales.at(g);
          o[k] = scaled + v.biases.at(g);
        }
      }
    });
  }

  const char* name() const override { return "NativeEmbedRows"; }
};

}  // namespace

mx::array embed_rows(const mx::array& ids, const mx::array& w, const mx::array& scales, const mx::array& biases,
                     int group_size, int bits) {
  check_affine(w, scales, biases, w.shape(1) * (32 / bits), group_size, bits);
  if (!mx::issubdtype(ids.dtype(), mx::integer)) throw std::invalid_argument("embed_rows: ids must be integers");
  mx::Shape out_shape = ids.shape();
  out_shape.push_back(w.shape(1) * (32 / bits));
  const mx::Stream s = mx::default_stream(mx::Device::cpu);
  return mx::array(out_shape, mx::float32, std::make_shared<EmbedRows>(s, group_size, bits),
                   {mx::astype(ids, mx::int32, s), w, scales, biases});
}

void set_activations(const std::string& kind) {
  if (kind == "float32") {
    g_int8.store(nullptr);
    g_x16.store(false);
    return;
  }
  const bool x16 = kind.rfind("int16", 0) == 0;
  const std::string build = kind.rfind("int8", 0) == 0 ? kind.substr(4) : x16 ? kind.substr(5) : "?";
  Int8Features features = nullptr;
  if (build.empty()) {
    features = best_int8();
  } else if (build == "-avx512") {
    const Int8Features wide = best_int8_512();
    features = wide != nullptr ? wide : best_int8_256();
  } else if (build == "-256") {
    features = best_int8_256();
  } else if (build == "-avx2") {
    features = int8_avx2::features;
  } else {
    throw std::invalid_argument("activations must be float32 or int8/int16 with -avx512, -256, -avx2 or none, not " +
                                kind);
  }
  g_int8.store(features);
  g_x16.store(x16);
}

std::string activations() {
  const Int8Features features = g_int8.load();
  if (features == nullptr) return "float32";
  if (g_x16.load()) return "int16";
  if (features == int8_avx2::features) return "int8-avx2";
#ifdef MLX_INFER_HAVE_AVX512
  if (features == int8_avx512::features) return "int8-avx512";
#endif
#ifdef MLX_INFER_HAVE_AMX
  if (features == int8_avx512::features_amx) return "int8-amx";
#endif
  return "int8-vnni";
}

AffineWeights::AffineWeights(const mx::array& w, const mx::array& scales, const mx::array& biases, int group_size,
                             int bits)
    : w(w), scales(scales), biases(biases), half(scales.dtype() == mx::float16), rows(w.shape(0)), group(group_size),
      bits(bits) {}

AffineView AffineWeights::view(Scratch& scratch) const {
  return {w.rows(scratch.w), {scales.rows(scratch.s), half}, {biases.rows(scratch.b), half}, rows, group, bits};
}

void affine_product(const float* x, int M, int K, const AffineView& w, float* out) {
  if (const Int8Features features = g_int8.load(std::memory_order_relaxed); features && fits_int8(K, w.group, w.bits)) {
    if (w.bits == 4) {
      run_int8<4>(x, w, M, K, out, features, g_x16.load(std::memory_order_relaxed));
    } else {
      run_int8<8>(x, w, M, K, out, features, true);
    }
    return;
  }
  const int groups = K / w.group;
  std::vector<float> xsum(static_cast<size_t>(M) * groups);
  for (int m = 0; m < M; ++m) {
    for (int g = 0; g < groups; ++g) {
      float sum = 0.0f;
      for (int k = g * w.group; k < (g + 1) * w.group; ++k) sum += x[static_cast<size_t>(m) * K + k];
      xsum[static_cast<size_t>(m) * groups + g] = sum;
    }
  }
  const Problem p{x, w.w, w.scales, w.biases, xsum.data(), out, M, w.rows, K, w.group, groups};
  if (w.bits == 4) {
    run_float<4>(p);
  } else {
    run_float<8>(p);
  }
}

void check_affine(const mx::array& w, const mx::array& scales, const mx::array& biases, int K, int group_size, int bits) {
  if (bits != 4 && bits != 8) throw std::invalid_argument("affine kernels: bits must be 4 or 8");
  if (group_size % 8 != 0) throw std::invalid_argument("affine kernels: group_size must be a multiple of 8");
  if ((scales.dtype() != mx::float32 && scales.dtype() != mx::float16) || biases.dtype() != scales.dtype()) {
    throw std::invalid_argument("affine kernels: scales and biases must be both float32 or both float16");
  }
  if (w.dtype() != mx::uint32 || w.ndim() != 2) throw std::invalid_argument("affine kernels: w must be 2-D uint32");
  if (K % group_size != 0 || w.shape(1) * (32 / bits) != K || scales.shape(0) != w.shape(0) ||
      scales.shape(1) != K / group_size || biases.shape() != scales.shape()) {
    throw std::invalid_argument("affine kernels: shapes of w, scales and biases do not match");
  }
}

mx::array affine_qmv(
    const mx::array& x,
    const mx::array& w,
    const mx::array& scales,
    const mx::array& biases,
    int group_size,
    int bits) {
  if (x.dtype() != mx::float32) throw std::invalid_argument("affine_qmv: x must be float32");
  check_affine(w, scales, biases, x.shape(-1), group_size, bits);
  mx::Shape out_shape = x.shape();
  out_shape.back() = w.shape(0);
  const mx::Stream s = mx::default_stream(mx::Device::cpu);
  return mx::array(out_shape, mx::float32, std::make_shared<AffineQMV>(s, group_size, bits), {x, w, scales, biases});
}

}  // namespace mlx_infer
