// Metal Shading Language as C++ for the emulator: just enough of <metal_stdlib> and MLX's kernel
// utilities for `mx.fast.metal_kernel` bodies to compile with clang and run on the CPU.
//
// No C++ standard library on purpose: the ziglang toolchain would otherwise build libc++ from
// source on first use (minutes). Math goes through clang builtins, which lower to libm.
#pragma once

// Address spaces are no-ops: every buffer lives in ordinary memory. Threadgroup *declarations*
// are rewritten by the Python side into shared per-threadgroup storage before compiling.
#define device
#define constant
#define thread
#define threadgroup
#define ray_data
#define object_data

typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef __INT8_TYPE__ int8_t;
typedef __INT16_TYPE__ int16_t;
typedef __INT32_TYPE__ int32_t;
typedef __INT64_TYPE__ int64_t;
typedef __UINT8_TYPE__ uint8_t;
typedef __UINT16_TYPE__ uint16_t;
typedef __UINT32_TYPE__ uint32_t;
typedef __UINT64_TYPE__ uint64_t;
typedef __SIZE_TYPE__ size_t;
typedef _Float16 half;
typedef half float16_t;
typedef __bf16 bfloat16_t;
typedef __bf16 bfloat;

template <class E, int N>
using __mtl_vec_t = E __attribute__((ext_vector_type(N)));

#define __MTL_VEC(E, name)            \
  typedef __mtl_vec_t<E, 2> name##2; \
  typedef __mtl_vec_t<E, 3> name##3; \
  typedef __mtl_vec_t<E, 4> name##4;
__MTL_VEC(float, float)
__MTL_VEC(half, half)
__MTL_VEC(bfloat16_t, bfloat)
__MTL_VEC(int, int)
__MTL_VEC(uint, uint)
__MTL_VEC(short, short)
__MTL_VEC(ushort, ushort)
__MTL_VEC(char, char)
__MTL_VEC(uchar, uchar)
__MTL_VEC(bool, bool)
#undef __MTL_VEC
typedef float3 packed_float3;

// ---- type traits (no <type_traits>) -------------------------------------------------------------
template <class T>
struct __mtl_vinfo {
  static constexpr bool is_vec = false;
  static constexpr int n = 1;
  typedef T elem;
};
template <class E, int N>
struct __mtl_vinfo<__mtl_vec_t<E, N>> {
  static constexpr bool is_vec = true;
  static constexpr int n = N;
  typedef E elem;
};
template <bool B, class T = void>
struct __mtl_enable_if {};
template <class T>
struct __mtl_enable_if<true, T> {
  typedef T type;
};
#define __MTL_IF_VEC(V) typename __mtl_enable_if<__mtl_vinfo<V>::is_vec, V>::type
#define __MTL_IF_SCALAR(T, R) typename __mtl_enable_if<!__mtl_vinfo<T>::is_vec, R>::type

// ---- vector constructors and conversions ---------------------------------------------------------
// Metal's `float4(a.xy, b, c)` and `float4(half4_value)` have no clang equivalent for ext vectors;
// the Python side rewrites `floatN(`/`static_cast<floatN>(` into `__mtl_make<float, N>(`.
template <class E, int N>
struct __mtl_builder {
  __mtl_vec_t<E, N> v;
  int i = 0;
  template <class A>
  void add(A a) {
    if constexpr (__mtl_vinfo<A>::is_vec) {
      for (int k = 0; k < __mtl_vinfo<A>::n; k++) v[i++] = static_cast<E>(a[k]);
    } else {
      v[i++] = static_cast<E>(a);
    }
  }
};
template <class E, int N, class A>
__mtl_vec_t<E, N> __mtl_make(A a) {
  __mtl_vec_t<E, N> v;
  if constexpr (__mtl_vinfo<A>::is_vec) {
    static_assert(__mtl_vinfo<A>::n == N, "vector conversion between different lengths");
    for (int k = 0; k < N; k++) v[k] = static_cast<E>(a[k]);
  } else {
    for (int k = 0; k < N; k++) v[k] = static_cast<E>(a);
  }
  return v;
}
template <class E, int N, class A, class B, class... R>
__mtl_vec_t<E, N> __mtl_make(A a, B b, R... r) {
  __mtl_builder<E, N> bld;
  bld.add(a);
  bld.add(b);
  (bld.add(r), ...);
  if (bld.i != N) __builtin_trap();  // wrong component count: Metal rejects this at compile time
  return bld.v;
}
template <class E, int N>
__mtl_vec_t<E, N> __mtl_make() {
  return __mtl_vec_t<E, N>(0);
}

template <class T, class F>
T as_type(F x) {
  static_assert(sizeof(T) == sizeof(F), "as_type between different sizes");
  return __builtin_bit_cast(T, x);
}

// ---- math ----------------------------------------------------------------------------------------
namespace metal {

#define __MTL_UNARY(name, fexpr)                                                          \
  inline float name(float x) { return fexpr; }                                           \
  inline half name(half h) {                                                              \
    float x = (float)h;                                                                   \
    return (half)(fexpr);                                                                 \
  }                                                                                       \
  inline bfloat16_t name(bfloat16_t b) {                                                  \
    float x = (float)b;                                                                   \
    return (bfloat16_t)(fexpr);                                                           \
  }                                                                                       \
  template <class V>                                                                      \
  __MTL_IF_VEC(V) name(V v) {                                                             \
    for (int k = 0; k < __mtl_vinfo<V>::n; k++) v[k] = name((typename __mtl_vinfo<V>::elem)v[k]); \
    return v;                                                                             \
  }

__MTL_UNARY(exp, __builtin_expf(x))
__MTL_UNARY(exp2, __builtin_exp2f(x))
__MTL_UNARY(log, __builtin_logf(x))
__MTL_UNARY(log2, __builtin_log2f(x))
__MTL_UNARY(sqrt, __builtin_sqrtf(x))
__MTL_UNARY(rsqrt, 1.0f / __builtin_sqrtf(x))
__MTL_UNARY(fabs, __builtin_fabsf(x))
__MTL_UNARY(tanh, __builtin_tanhf(x))
__MTL_UNARY(sin, __builtin_sinf(x))
__MTL_UNARY(cos, __builtin_cosf(x))
__MTL_UNARY(floor, __builtin_floorf(x))
__MTL_UNARY(ceil, __builtin_ceilf(x))
__MTL_UNARY(round, __builtin_roundf(x))
__MTL_UNARY(rint, __builtin_rintf(x))
__MTL_UNARY(trunc, __builtin_truncf(x))
__MTL_UNARY(erf, __builtin_erff(x))
__MTL_UNARY(log1p, __builtin_log1pf(x))
__MTL_UNARY(expm1, __builtin_expm1f(x))
__MTL_UNARY(precise_exp, __builtin_expf(x))
#undef __MTL_UNARY

inline int abs(int x) { return x < 0 ? -x : x; }
inline float abs(float x) { return __builtin_fabsf(x); }
inline half abs(half x) { return x < (half)0 ? (half)-x : x; }
inline bfloat16_t abs(bfloat16_t x) { return (bfloat16_t)__builtin_fabsf((float)x); }
template <class V>
__MTL_IF_VEC(V) abs(V v) {
  for (int k = 0; k < __mtl_vinfo<V>::n; k++) v[k] = abs((typename __mtl_vinfo<V>::elem)v[k]);
  return v;
}

inline float pow(float a, float b) { return __builtin_powf(a, b); }
inline half pow(half a, half b) { return (half)__builtin_powf((float)a, (float)b); }
inline float powr(float a, float b) { return __builtin_powf(a, b); }
inline float fma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
inline half fma(half a, half b, half c) { return (half)__builtin_fmaf((float)a, (float)b, (float)c); }
inline float fmod(float a, float b) { return __builtin_fmodf(a, b); }
inline float divide(float a, float b) { return a / b; }

// max/min follow Metal: both arguments of the same type; scalars and vectors.
template <class T>
T max(T a, T b) {
  if constexpr (__mtl_vinfo<T>::is_vec) {
    for (int k = 0; k < __mtl_vinfo<T>::n; k++) a[k] = b[k] > a[k] ? b[k] : a[k];
    return a;
  } else {
    return b > a ? b : a;
  }
}
template <class T>
T min(T a, T b) {
  if constexpr (__mtl_vinfo<T>::is_vec) {
    for (int k = 0; k < __mtl_vinfo<T>::n; k++) a[k] = b[k] < a[k] ? b[k] : a[k];
    return a;
  } else {
    return b < a ? b : a;
  }
}
inline float fmax(float a, float b) { return __builtin_fmaxf(a, b); }
inline float fmin(float a, float b) { return __builtin_fminf(a, b); }
template <class T>
T clamp(T x, T lo, T hi) {
  return min(max(x, lo), hi);
}
template <class T>
T mix(T a, T b, T t) {
  return a + (b - a) * t;
}
template <class T>
T select(T a, T b, bool c) {
  return c ? b : a;
}
template <class T>
__MTL_IF_SCALAR(T, bool) isnan(T x) { return x != x; }
template <class T>
__MTL_IF_SCALAR(T, bool) isinf(T x) { return __builtin_isinf((float)x); }
template <class T>
__MTL_IF_SCALAR(T, bool) isfinite(T x) { return __builtin_isfinite((float)x); }
template <class T>
T sign(T x) { return x > T(0) ? T(1) : (x < T(0) ? T(-1) : T(0)); }
template <class E, int N>
E dot(__mtl_vec_t<E, N> a, __mtl_vec_t<E, N> b) {
  E s = E(0);
  for (int k = 0; k < N; k++) s += a[k] * b[k];
  return s;
}
template <int N>
bool all(__mtl_vec_t<bool, N> v) {
  for (int k = 0; k < N; k++)
    if (!v[k]) return false;
  return true;
}
template <int N>
bool any(__mtl_vec_t<bool, N> v) {
  for (int k = 0; k < N; k++)
    if (v[k]) return true;
  return false;
}

namespace precise {
using metal::exp;
using metal::exp2;
using metal::log;
using metal::log2;
using metal::sqrt;
using metal::rsqrt;
using metal::tanh;
using metal::divide;
using metal::pow;
}  // namespace precise
namespace fast {
using metal::exp;
using metal::exp2;
using metal::log;
using metal::log2;
using metal::sqrt;
using metal::rsqrt;
using metal::tanh;
using metal::divide;
using metal::pow;
}  // namespace fast

template <class T>
struct numeric_limits;
template <>
struct numeric_limits<float> {
  static constexpr float infinity() { return __builtin_inff(); }
  static constexpr float max() { return 3.40282347e+38f; }
  static constexpr float lowest() { return -3.40282347e+38f; }
  static constexpr float min() { return 1.17549435e-38f; }
  static constexpr float epsilon() { return 1.19209290e-7f; }
  static float quiet_NaN() { return __builtin_nanf(""); }
};
template <>
struct numeric_limits<half> {
  static half infinity() { return (half)__builtin_inff(); }
  static half max() { return (half)65504.0f; }
  static half lowest() { return (half)-65504.0f; }
  static half quiet_NaN() { return (half)__builtin_nanf(""); }
};
template <>
struct numeric_limits<bfloat16_t> {
  static bfloat16_t infinity() { return (bfloat16_t)__builtin_inff(); }
  static bfloat16_t max() { return (bfloat16_t)3.38953139e38f; }
  static bfloat16_t lowest() { return (bfloat16_t)-3.38953139e38f; }
  static bfloat16_t quiet_NaN() { return (bfloat16_t)__builtin_nanf(""); }
};
template <>
struct numeric_limits<int> {
  static constexpr int max() { return 2147483647; }
  static constexpr int lowest() { return -2147483647 - 1; }
  static constexpr int min() { return -2147483647 - 1; }
};
template <>
struct numeric_limits<uint> {
  static constexpr uint max() { return 4294967295u; }
  static constexpr uint lowest() { return 0u; }
  static constexpr uint min() { return 0u; }
};

// ---- synchronisation and SIMD-group collectives (implemented by the runtime) ---------------------
enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
inline mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags((int)a | (int)b); }

#define MAXFLOAT 3.40282347e+38f
#define HUGE_VALF __builtin_huge_valf()
#define INFINITY __builtin_inff()
#define NAN __builtin_nanf("")
#define M_PI_F 3.14159265358979323846f
#define M_LN2_F 0.693147180559945309417f
#define M_LOG2E_F 1.44269504088896340736f

extern "C" {
// Block until every live thread of the threadgroup reaches a barrier (reports divergence).
void __mtl_threadgroup_barrier(int site);
// Deposit `size` bytes, block until the SIMD-group's live lanes are all blocked, then return the
// snapshot of all 32 lanes' deposits and the mask of lanes that met at this same call site.
const unsigned char* __mtl_simd_exchange(int site, const void* value, unsigned size, unsigned* mask);
unsigned __mtl_lane(void);
void* __mtl_threadgroup_alloc(int id, unsigned size, unsigned align);
void __mtl_fail(const char* kind, const char* message, int site);
}

// A call site: its source line (for reports) and a per-expansion counter, so two barriers written
// on one line are still different barriers.
#define __MTL_SITE (__LINE__ * 4096 + __COUNTER__ % 4096)
#define threadgroup_barrier(flags) __mtl_threadgroup_barrier(__MTL_SITE)
#define simdgroup_barrier(flags) __mtl_simd_barrier(__MTL_SITE)

inline void __mtl_simd_barrier(int site) {
  unsigned mask;
  char unused = 0;
  __mtl_simd_exchange(site, &unused, 1, &mask);
}

template <class T>
inline const T* __mtl_simd_values(int site, T x, unsigned* mask) {
  static_assert(sizeof(T) <= 16, "SIMD collectives on values over 16 bytes");
  const unsigned char* snap = __mtl_simd_exchange(site, &x, sizeof(T), mask);
  return reinterpret_cast<const T*>(snap);  // the runtime stores lane k at snap + 16 * k
}
#define __MTL_LANE_VALUE(snap, k, T) (*reinterpret_cast<const T*>(reinterpret_cast<const unsigned char*>(snap) + 16 * (k)))

template <class T, class Op>
inline T __mtl_simd_reduce(int site, T x, Op op) {
  unsigned mask;
  const T* snap = __mtl_simd_values(site, x, &mask);
  bool first = true;
  T acc = x;
  for (unsigned k = 0; k < 32; k++) {
    if (!(mask >> k & 1u)) continue;
    T v = __MTL_LANE_VALUE(snap, k, T);
    acc = first ? v : op(acc, v);
    first = false;
  }
  return acc;
}
template <class T>
inline T __mtl_simd_prefix(int site, T x, bool inclusive, bool product) {
  unsigned mask;
  const T* snap = __mtl_simd_values(site, x, &mask);
  unsigned me = __mtl_lane();
  T acc = product ? T(1) : T(0);
  for (unsigned k = 0; k < me + (inclusive ? 1u : 0u); k++)
    if (mask >> k & 1u) acc = product ? acc * __MTL_LANE_VALUE(snap, k, T) : acc + __MTL_LANE_VALUE(snap, k, T);
  return acc;
}
template <class T>
inline T __mtl_simd_read_lane(int site, T x, int lane, bool keep_own_when_outside) {
  unsigned mask;
  const T* snap = __mtl_simd_values(site, x, &mask);
  if (lane < 0 || lane > 31) {
    if (keep_own_when_outside) return x;
    __mtl_fail("simd", "shuffle from a lane index outside 0..31", site);
  }
  if (!(mask >> lane & 1u)) {
    if (keep_own_when_outside) return x;
    __mtl_fail("simd", "shuffle reads a lane that is not active at this call", site);
  }
  return __MTL_LANE_VALUE(snap, lane, T);
}

#define simd_sum(x) __mtl_simd_reduce(__MTL_SITE, (x), [](auto a, auto b) { return a + b; })
#define simd_product(x) __mtl_simd_reduce(__MTL_SITE, (x), [](auto a, auto b) { return a * b; })
#define simd_max(x) __mtl_simd_reduce(__MTL_SITE, (x), [](auto a, auto b) { return metal::max(a, b); })
#define simd_min(x) __mtl_simd_reduce(__MTL_SITE, (x), [](auto a, auto b) { return metal::min(a, b); })
#define simd_and(x) __mtl_simd_reduce(__MTL_SITE, (x), [](auto a, auto b) { return a & b; })
#define simd_or(x) __mtl_simd_reduce(__MTL_SITE, (x), [](auto a, auto b) { return a | b; })
#define simd_xor(x) __mtl_simd_reduce(__MTL_SITE, (x), [](auto a, auto b) { return a ^ b; })
#define simd_all(x) __mtl_simd_reduce(__MTL_SITE, (bool)(x), [](bool a, bool b) { return a && b; })
#define simd_any(x) __mtl_simd_reduce(__MTL_SITE, (bool)(x), [](bool a, bool b) { return a || b; })
#define simd_prefix_inclusive_sum(x) __mtl_simd_prefix(__MTL_SITE, (x), true, false)
#define simd_prefix_exclusive_sum(x) __mtl_simd_prefix(__MTL_SITE, (x), false, false)
#define simd_prefix_inclusive_product(x) __mtl_simd_prefix(__MTL_SITE, (x), true, true)
#define simd_prefix_exclusive_product(x) __mtl_simd_prefix(__MTL_SITE, (x), false, true)
#define simd_shuffle(x, lane) __mtl_simd_read_lane(__MTL_SITE, (x), (int)(lane), false)
#define simd_broadcast(x, lane) __mtl_simd_read_lane(__MTL_SITE, (x), (int)(lane), false)
#define simd_shuffle_xor(x, m) __mtl_simd_read_lane(__MTL_SITE, (x), (int)(__mtl_lane() ^ (m)), false)
#define simd_shuffle_down(x, d) __mtl_simd_read_lane(__MTL_SITE, (x), (int)(__mtl_lane() + (d)), true)
#define simd_shuffle_up(x, d) __mtl_simd_read_lane(__MTL_SITE, (x), (int)__mtl_lane() - (int)(d), true)
#define simd_broadcast_first(x) __mtl_simd_broadcast_first(__MTL_SITE, (x))
#define simd_is_first() (__mtl_simd_is_first(__MTL_SITE))

template <class T>
inline T __mtl_simd_broadcast_first(int site, T x) {
  unsigned mask;
  const T* snap = __mtl_simd_values(site, x, &mask);
  return __MTL_LANE_VALUE(snap, __builtin_ctz(mask), T);
}
inline bool __mtl_simd_is_first(int site) {
  unsigned mask;
  char unused = 0;
  __mtl_simd_exchange(site, &unused, 1, &mask);
  return __builtin_ctz(mask) == __mtl_lane();
}

// ---- atomics (device and threadgroup) ------------------------------------------------------------
enum memory_order { memory_order_relaxed = __ATOMIC_RELAXED, memory_order_seq_cst = __ATOMIC_SEQ_CST };
template <class T>
struct atomic {
  T value;
};
typedef atomic<int> atomic_int;
typedef atomic<uint> atomic_uint;
typedef atomic<float> atomic_float;

template <class T>
inline void atomic_store_explicit(atomic<T>* a, T v, memory_order) {
  __atomic_store(&a->value, &v, __ATOMIC_SEQ_CST);
}
template <class T>
inline T atomic_load_explicit(const atomic<T>* a, memory_order) {
  T v;
  __atomic_load(&a->value, &v, __ATOMIC_SEQ_CST);
  return v;
}
template <class T>
inline T atomic_exchange_explicit(atomic<T>* a, T v, memory_order) {
  T old;
  __atomic_exchange(&a->value, &v, &old, __ATOMIC_SEQ_CST);
  return old;
}
template <class T>
inline bool atomic_compare_exchange_weak_explicit(atomic<T>* a, T* expected, T desired, memory_order,
                                                  memory_order) {
  return __atomic_compare_exchange(&a->value, expected, &desired, true, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
}
template <class T, class Op>
inline T __mtl_atomic_update(atomic<T>* a, Op op) {
  T old = atomic_load_explicit(a, memory_order_relaxed);
  while (!atomic_compare_exchange_weak_explicit(a, &old, op(old), memory_order_relaxed, memory_order_relaxed)) {
  }
  return old;
}
template <class T, class U>
inline T atomic_fetch_add_explicit(atomic<T>* a, U v, memory_order) {
  return __mtl_atomic_update(a, [&](T o) { return T(o + v); });
}
template <class T, class U>
inline T atomic_fetch_sub_explicit(atomic<T>* a, U v, memory_order) {
  return __mtl_atomic_update(a, [&](T o) { return T(o - v); });
}
template <class T, class U>
inline T atomic_fetch_max_explicit(atomic<T>* a, U v, memory_order) {
  return __mtl_atomic_update(a, [&](T o) { return o > T(v) ? o : T(v); });
}
template <class T, class U>
inline T atomic_fetch_min_explicit(atomic<T>* a, U v, memory_order) {
  return __mtl_atomic_update(a, [&](T o) { return o < T(v) ? o : T(v); });
}
template <class T, class U>
inline T atomic_fetch_or_explicit(atomic<T>* a, U v, memory_order) {
  return __mtl_atomic_update(a, [&](T o) { return T(o | v); });
}
template <class T, class U>
inline T atomic_fetch_and_explicit(atomic<T>* a, U v, memory_order) {
  return __mtl_atomic_update(a, [&](T o) { return T(o & v); });
}

// ---- MLX kernel utilities that bodies commonly use -----------------------------------------------
template <typename T>
struct Limits;
template <>
struct Limits<float> {
  static constexpr float max = 3.40282347e+38f;
  static constexpr float min = -3.40282347e+38f;
  static constexpr float finite_max = 3.40282347e+38f;
  static constexpr float finite_min = -3.40282347e+38f;
};
template <>
struct Limits<int> {
  static constexpr int max = 2147483647;
  static constexpr int min = -2147483647 - 1;
};
template <>
struct Limits<uint> {
  static constexpr uint max = 4294967295u;
  static constexpr uint min = 0u;
};

}  // namespace metal
using namespace metal;
