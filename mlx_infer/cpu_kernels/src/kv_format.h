// How a KV pool stores one (token, KV head) row, and the conversions the KV write and attention use.
//
// float32, float16 and bfloat16 pools are [slots, n_kv, D] of that type. int8 pools are
// [slots, n_kv, D + 4] int8: each head's row is D values quantized symmetrically (x = q * scale,
// scale = max|x| / 127) followed by its float32 scale, so one slot is still one contiguous run and a
// pool is one array (one in-place write per pool, as for the float types). Attention reads these rows
// where they lie: half values through F16C, int8 ones widened, the scale applied to the dot product
// (keys) or to the softmax weight (values), never to a dequantized copy.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>

#include "mlx/array.h"
#include "simd.h"

namespace mlx_infer {

enum class KVType { f32, f16, bf16, i8 };

constexpr int kInt8ScaleBytes = 4;

inline KVType kv_type(const mlx::core::array& pool) {
  switch (pool.dtype()) {
    case mlx::core::float32: return KVType::f32;
    case mlx::core::float16: return KVType::f16;
    case mlx::core::bfloat16: return KVType::bf16;
    case mlx::core::int8: return KVType::i8;
    default: throw std::invalid_argument("KV pools must be float32, float16, bfloat16 or int8");
  }
}

// head_dim of a pool [slots, n_kv, row]: int8 rows end with their scale.
inline int kv_head_dim(const mlx::core::array& pool) {
  return pool.shape(2) - (kv_type(pool) == KVType::i8 ? kInt8ScaleBytes : 0);
}

inline size_t kv_head_bytes(KVType type, int D) {
  switch (type) {
    case KVType::f32: return static_cast<size_t>(D) * 4;
    case KVType::f16:
    case KVType::bf16: return static_cast<size_t>(D) * 2;
    case KVType::i8: return static_cast<size_t>(D) + kInt8ScaleBytes;
  }
  return 0;
}

// Eight values of a head row as floats.
template <KVType K>
inline __m256 load8(const uint8_t* head, int i) {
  if constexpr (K == KVType::f32) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(head) + i);
  } else if constexpr (K == KVType::f16) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(head + 2 * i)));
  } else if constexpr (K == KVType::bf16) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(head + 2 * i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(head + i))));
  }
}

// The factor a row's values are multiplied by: its scale for int8, 1 otherwise.
template <KVType K>
inline float row_scale(const uint8_t* head, int D) {
  if constexpr (K == KVType::i8) {
    float s;
    std::memcpy(&s, head + D, sizeof s);
    return s;
  } else {
    return 1.0f;
  }
}

// float32 -> bfloat16 rounding to nearest even, NaN kept a (quiet) NaN: as MLX's astype.
inline uint16_t to_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  if (std::isnan(x)) return static_cast<uint16_t>((bits >> 16) | 0x40);
  return static_cast<uint16_t>((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

// One head row of D floats stored as the pool's type (D a multiple of 8). int8: scale = max|x| / 127
// and q = round(x / scale), ties to even, as the MLX write (models/base.py) computes them; an all-zero
// row gets scale 0 and zeros.
template <KVType K>
inline void store_row(const float* x, uint8_t* head, int D) {
  if constexpr (K == KVType::f32) {
    std::memcpy(head, x, static_cast<size_t>(D) * 4);
  } else if constexpr (K == KVType::f16) {
    for (int i = 0; i < D; i += 8) {
      const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(head + 2 * i), h);
    }
  } else if constexpr (K == KVType::bf16) {
    for (int i = 0; i < D; ++i) {
      const uint16_t b = to_bf16(x[i]);
      std::memcpy(head + 2 * i, &b, 2);
    }
  } else {
    float amax = 0.0f;
    for (int i = 0; i < D; ++i) amax = std::max(amax, std::fabs(x[i]));
    const float scale = amax / 127.0f;
    for (int i = 0; i < D; ++i) {
      const float q = scale > 0.0f ? std::nearbyint(x[i] / scale) : 0.0f;
      head[i] = static_cast<uint8_t>(static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, q))));
    }
    std::memcpy(head + D, &scale, sizeof scale);
  }
}

}  // namespace mlx_infer
