// CPU stand-in for the parts of the Metal Shading Language that MLX kernels use.
//
// The emulator compiles MLX's generated kernel text with g++ against this
// header. Every GPU thread of a threadgroup runs as a fiber on one OS thread;
// barriers and simd collectives are the only yield points, so a thread runs
// until its next one (a missing barrier gives stale reads, deterministically).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <type_traits>
#include <ucontext.h>

// Address spaces. The emulator compiles every kernel twice with clang:
// once with OIQ_EMU_ADDRESS_SPACES, where device, constant and threadgroup are
// distinct clang address spaces (types), so that a pointer of one space passed
// where another is declared fails to compile as it does in Metal (only the
// diagnostics of that build are used), and once without, the build that runs.
// `thread` is the default space in both.  `threadgroup` declarations of arrays
// are rewritten to registered statics by the Python side.
#ifdef OIQ_EMU_ADDRESS_SPACES
#define device __attribute__((address_space(1)))
#define constant __attribute__((address_space(2)))
#define threadgroup __attribute__((address_space(3)))
#else
#define device
#define constant
#define threadgroup
#endif
#define thread
#define METAL_FUNC inline
#define METAL_CONST_FUNC inline
#define MAXFLOAT 3.40282347e+38F

typedef uint32_t uint;
typedef uint16_t ushort;
typedef uint8_t uchar;
typedef uint64_t ulong;

namespace oiq {

template <class T>
struct is_num : std::integral_constant<bool, std::is_arithmetic<T>::value> {};

// ---------------------------------------------------------------- 16-bit floats
// half and bfloat16_t are structs holding the bits (clang 14 has no x86
// _Float16): every operation converts to float, computes, and rounds back
// (round to nearest even), which is exactly IEEE half/bfloat16 arithmetic for
// single + - * / (float has more than 2p+2 bits).
inline uint16_t f32_to_bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return uint16_t(u >> 16);
}
inline float bf16_bits_to_f32(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t f32_to_f16_bits(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return uint16_t(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));  // quiet NaN
  if (ax >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // >= 65520 rounds to infinity
  if (ax < 0x38800000u) {  // below 2^-14: a half subnormal (x * 2^24 is exact in float)
    float v;
    std::memcpy(&v, &ax, 4);
    return uint16_t(sign | uint32_t(std::nearbyint(v * 16777216.0f)));
  }
  uint32_t h = (((ax >> 23) - 112u) << 10) | ((ax & 0x7fffffu) >> 13);
  uint32_t rem = ax & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // a carry may reach the exponent
  return uint16_t(sign | h);
}
inline float f16_bits_to_f32(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0) {
    float v = float(m) * 5.9604644775390625e-08f;  // m * 2^-24
    return sign ? -v : v;
  }
  uint32_t x = e == 31 ? (sign | 0x7f800000u | (m << 13)) : (sign | ((e + 112u) << 23) | (m << 13));
  float f;
  std::memcpy(&f, &x, 4);
  return f;
}

}  // namespace oiq

#ifdef OIQ_EMU_ADDRESS_SPACES
// Type-checking build only: clang (unlike Metal) cannot call a member
// function on an object in another address space, so the 16-bit floats are
// distinct builtin floating types there.  That build is never run.
typedef long double half;
typedef __float128 bfloat16_t;
namespace oiq {
template <>
struct is_num<bfloat16_t> : std::true_type {};
}  // namespace oiq
#else
struct half;
struct bfloat16_t;
namespace oiq {
template <>
struct is_num<half> : std::true_type {};
template <>
struct is_num<bfloat16_t> : std::true_type {};
}  // namespace oiq
#define OIQ_F16_TYPE(NAME, TO_BITS, FROM_BITS)                                   \
  struct NAME {                                                                  \
    uint16_t bits_;                                                              \
    NAME() = default;                                                            \
    template <class T, class = std::enable_if_t<oiq::is_num<T>::value>>          \
    NAME(T v) : bits_(oiq::TO_BITS(float(v))) {}                                 \
    operator float() const { return oiq::FROM_BITS(bits_); }                     \
    NAME operator-() const { return NAME(-float(*this)); }                       \
    static NAME from_bits(uint16_t b) {                                          \
      NAME r;                                                                    \
      r.bits_ = b;                                                               \
      return r;                                                                  \
    }                                                                            \
  };
OIQ_F16_TYPE(half, f32_to_f16_bits, f16_bits_to_f32)
OIQ_F16_TYPE(bfloat16_t, f32_to_bf16_bits, bf16_bits_to_f32)
#undef OIQ_F16_TYPE
namespace oiq {
template <class T>
struct is_f16 : std::integral_constant<bool, std::is_same<T, half>::value ||
                                                 std::is_same<T, bfloat16_t>::value> {};
}  // namespace oiq

// Same-type operations stay in the type; with an integer too; with float
// (or double) they give float, as in Metal.
#define OIQ_F16_BINOP(op)                                                              \
  template <class H, class = std::enable_if_t<oiq::is_f16<H>::value>>                  \
  inline H operator op(H a, H b) {                                                     \
    return H(float(a) op float(b));                                                    \
  }                                                                                    \
  template <class H, class T,                                                          \
            class = std::enable_if_t<oiq::is_f16<H>::value && std::is_arithmetic<T>::value>> \
  inline auto operator op(H a, T b) {                                                  \
    return std::conditional_t<std::is_integral<T>::value, H, float>(float(a) op float(b)); \
  }                                                                                    \
  template <class H, class T,                                                          \
            class = std::enable_if_t<oiq::is_f16<H>::value && std::is_arithmetic<T>::value>> \
  inline auto operator op(T a, H b) {                                                  \
    return std::conditional_t<std::is_integral<T>::value, H, float>(float(a) op float(b)); \
  }                                                                                    \
  template <class H, class T, class = std::enable_if_t<oiq::is_f16<H>::value>>         \
  inline H& operator op##=(H& a, T b) {                                                \
    a = H(float(a) op float(b));                                                       \
    return a;                                                                          \
  }
OIQ_F16_BINOP(+)
OIQ_F16_BINOP(-)
OIQ_F16_BINOP(*)
OIQ_F16_BINOP(/)
#undef OIQ_F16_BINOP

#define OIQ_F16_CMP(op)                                                                \
  template <class H, class = std::enable_if_t<oiq::is_f16<H>::value>>                  \
  inline bool operator op(H a, H b) {                                                  \
    return float(a) op float(b);                                                       \
  }                                                                                    \
  template <class H, class T,                                                          \
            class = std::enable_if_t<oiq::is_f16<H>::value && std::is_arithmetic<T>::value>> \
  inline bool operator op(H a, T b) {                                                  \
    return float(a) op float(b);                                                       \
  }                                                                                    \
  template <class H, class T,                                                          \
            class = std::enable_if_t<oiq::is_f16<H>::value && std::is_arithmetic<T>::value>> \
  inline bool operator op(T a, H b) {                                                  \
    return float(a) op float(b);                                                       \
  }
OIQ_F16_CMP(<)
OIQ_F16_CMP(>)
OIQ_F16_CMP(<=)
OIQ_F16_CMP(>=)
OIQ_F16_CMP(==)
OIQ_F16_CMP(!=)
#undef OIQ_F16_CMP
#endif
typedef half float16_t;
typedef bfloat16_t bfloat;

// ---------------------------------------------------------------- vectors
template <class T, int N>
struct vec;

#define OIQ_VEC_COMMON(N)                                                        \
  T& operator[](int i) { return (&x)[i]; }                                       \
  const T& operator[](int i) const { return (&x)[i]; }                           \
  vec() = default;                                                               \
  template <class U, class = std::enable_if_t<oiq::is_num<U>::value>>            \
  vec(U s) {                                                                     \
    for (int i = 0; i < N; ++i) (*this)[i] = T(s);                               \
  }                                                                              \
  template <class U>                                                             \
  explicit vec(const vec<U, N>& o) {                                             \
    for (int i = 0; i < N; ++i) (*this)[i] = T(o[i]);                            \
  }

template <class T>
struct vec<T, 2> {
  T x, y;
  OIQ_VEC_COMMON(2)
  template <class A, class B>
  vec(A a, B b) : x(T(a)), y(T(b)) {}
};
template <class T>
struct vec<T, 3> {
  T x, y, z;
  OIQ_VEC_COMMON(3)
  template <class A, class B, class C>
  vec(A a, B b, C c) : x(T(a)), y(T(b)), z(T(c)) {}
  template <class U, class C>
  vec(const vec<U, 2>& a, C c) : x(T(a.x)), y(T(a.y)), z(T(c)) {}
};
template <class T>
struct vec<T, 4> {
  T x, y, z, w;
  OIQ_VEC_COMMON(4)
  template <class A, class B, class C, class D>
  vec(A a, B b, C c, D d) : x(T(a)), y(T(b)), z(T(c)), w(T(d)) {}
  template <class U, class C, class D>
  vec(const vec<U, 2>& a, C c, D d) : x(T(a.x)), y(T(a.y)), z(T(c)), w(T(d)) {}
  template <class U, class V>
  vec(const vec<U, 2>& a, const vec<V, 2>& b) : x(T(a.x)), y(T(a.y)), z(T(b.x)), w(T(b.y)) {}
  template <class U, class D>
  vec(const vec<U, 3>& a, D d) : x(T(a.x)), y(T(a.y)), z(T(a.z)), w(T(d)) {}
};
#undef OIQ_VEC_COMMON

#define OIQ_VEC_BINOP(op)                                                        \
  template <class T, int N>                                                      \
  inline vec<T, N> operator op(const vec<T, N>& a, const vec<T, N>& b) {         \
    vec<T, N> r;                                                                 \
    for (int i = 0; i < N; ++i) r[i] = T(a[i] op b[i]);                          \
    return r;                                                                    \
  }                                                                              \
  template <class T, int N, class U, class = std::enable_if_t<oiq::is_num<U>::value>> \
  inline vec<T, N> operator op(const vec<T, N>& a, U b) {                        \
    vec<T, N> r;                                                                 \
    for (int i = 0; i < N; ++i) r[i] = T(a[i] op T(b));                          \
    return r;                                                                    \
  }                                                                              \
  template <class T, int N, class U, class = std::enable_if_t<oiq::is_num<U>::value>> \
  inline vec<T, N> operator op(U a, const vec<T, N>& b) {                        \
    vec<T, N> r;                                                                 \
    for (int i = 0; i < N; ++i) r[i] = T(T(a) op b[i]);                          \
    return r;                                                                    \
  }                                                                              \
  template <class T, int N, class U>                                             \
  inline vec<T, N>& operator op##=(vec<T, N>& a, const U& b) {                   \
    a = a op b;                                                                  \
    return a;                                                                    \
  }
OIQ_VEC_BINOP(+)
OIQ_VEC_BINOP(-)
OIQ_VEC_BINOP(*)
OIQ_VEC_BINOP(/)
OIQ_VEC_BINOP(%)
OIQ_VEC_BINOP(&)
OIQ_VEC_BINOP(|)
OIQ_VEC_BINOP(^)
OIQ_VEC_BINOP(<<)
OIQ_VEC_BINOP(>>)
#undef OIQ_VEC_BINOP

template <class T, int N>
inline vec<T, N> operator-(const vec<T, N>& a) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = T(-a[i]);
  return r;
}

#define OIQ_VEC_ALIASES(T, name) \
  typedef vec<T, 2> name##2;     \
  typedef vec<T, 3> name##3;     \
  typedef vec<T, 4> name##4;
OIQ_VEC_ALIASES(float, float)
OIQ_VEC_ALIASES(half, half)
OIQ_VEC_ALIASES(bfloat16_t, bfloat)
OIQ_VEC_ALIASES(int32_t, int)
OIQ_VEC_ALIASES(uint32_t, uint)
OIQ_VEC_ALIASES(int16_t, short)
OIQ_VEC_ALIASES(uint16_t, ushort)
OIQ_VEC_ALIASES(int8_t, char)
OIQ_VEC_ALIASES(uint8_t, uchar)
OIQ_VEC_ALIASES(int64_t, long)
OIQ_VEC_ALIASES(uint64_t, ulong)
OIQ_VEC_ALIASES(bool, bool)
#undef OIQ_VEC_ALIASES

// ---------------------------------------------------------------- fast::exp model
namespace oiq {
// How oiq::fast_exp perturbs exp(x): set per launch from Python (oiq_emu_set_fast_exp).
//   mode 0: exp(x) rounded to float (no perturbation; only for comparisons in tests)
//   mode 1: sign of the error from a hash of x's bits (a fixed function of x, as hardware is)
//   mode 2: always above exp(x); mode 3: always below (systematic, the worst for sums)
// `scale` multiplies the documented bound (1: the bound; > 1: a test that the kernel's
// tests would see a worse exp).
struct FastExpModel {
  int mode = 1;
  double scale = 1.0;
};
inline FastExpModel& fast_exp_model() {
  static FastExpModel m;
  return m;
}
// Metal's documented fast-math bound for exp at x, in ulp of the result.
inline double fast_exp_bound_ulp(float x) { return 3.0 + std::floor(std::fabs(2.0 * double(x))); }
__attribute__((no_sanitize("coverage"))) inline float fast_exp(float x) {
  if (x != x) return x;
  double y = std::exp(double(x));
  const FastExpModel& m = fast_exp_model();
  if (m.mode == 0) return float(y);
  if (y < 1.1754943508222875e-38) return 0.0f;  // below FLT_MIN: flushed (error < 2^-126)
  if (y > 3.4028234663852886e+38) return INFINITY;
  // k ulp of the result (ulp of the binade of y, 2^(e - 23)), away from y in the chosen
  // direction and rounded further away: the error is in [k, k + 1) ulp.
  double k = std::floor(fast_exp_bound_ulp(x) * m.scale);
  int e;
  std::frexp(y, &e);  // y = f * 2^e, f in [0.5, 1): the float binade's ulp is 2^(e - 24)
  double ulp = std::ldexp(1.0, e - 24);
  int sign;
  if (m.mode == 2) {
    sign = 1;
  } else if (m.mode == 3) {
    sign = -1;
  } else {
    uint32_t h;
    std::memcpy(&h, &x, 4);
    h ^= h >> 16;
    h *= 0x7feb352du;
    h ^= h >> 15;
    h *= 0x846ca68bu;
    h ^= h >> 16;
    sign = (h & 1u) ? 1 : -1;
  }
  double target = y + sign * k * ulp;
  if (target <= 0.0) return 0.0f;
  float r = float(target);
  if (sign > 0 && double(r) < target) r = std::nextafter(r, INFINITY);
  if (sign < 0 && double(r) > target) r = std::nextafter(r, 0.0f);
  if (r < 1.1754943508222875e-38f) return 0.0f;
  return r;
}
}  // namespace oiq

// ---------------------------------------------------------------- metal::
namespace metal {

using std::enable_if;
using std::enable_if_t;
using std::integral_constant;
using std::is_floating_point;
using std::is_integral;
using std::is_same;
using std::is_same_v;
using std::is_signed;
using std::is_unsigned;
using std::conditional;
using std::conditional_t;

template <class T>
struct numeric_limits : std::numeric_limits<T> {};
template <>
struct numeric_limits<half> {
  static constexpr bool is_specialized = true;
  static half from_bits(uint16_t b) {
#ifdef OIQ_EMU_ADDRESS_SPACES
    return half(oiq::f16_bits_to_f32(b));
#else
    return half::from_bits(b);
#endif
  }
  static half max() { return from_bits(0x7bff); }
  static half min() { return from_bits(0x0400); }
  static half lowest() { return from_bits(0xfbff); }
  static half epsilon() { return from_bits(0x1400); }
  static half infinity() { return from_bits(0x7c00); }
  static half quiet_NaN() { return from_bits(0x7e00); }
};
template <>
struct numeric_limits<bfloat16_t> {
  static constexpr bool is_specialized = true;
  static bfloat16_t from_bits(uint16_t b) {
#ifdef OIQ_EMU_ADDRESS_SPACES
    return bfloat16_t(oiq::bf16_bits_to_f32(b));
#else
    return bfloat16_t::from_bits(b);
#endif
  }
  static bfloat16_t max() { return from_bits(0x7f7f); }
  static bfloat16_t min() { return from_bits(0x0080); }
  static bfloat16_t lowest() { return from_bits(0xff7f); }
  static bfloat16_t epsilon() { return from_bits(0x3c00); }
  static bfloat16_t infinity() { return from_bits(0x7f80); }
  static bfloat16_t quiet_NaN() { return from_bits(0x7fc0); }
};

// Sizes as in Metal: the type-checking build's stand-ins for half and
// bfloat16_t are wider builtin types.
template <class T>
struct oiq_metal_size : std::integral_constant<size_t, sizeof(T)> {};
#ifdef OIQ_EMU_ADDRESS_SPACES
template <>
struct oiq_metal_size<half> : std::integral_constant<size_t, 2> {};
template <>
struct oiq_metal_size<bfloat16_t> : std::integral_constant<size_t, 2> {};
#endif

template <class To, class From>
inline To as_type(From f) {  // by value: the deduced type drops the address space
  static_assert(oiq_metal_size<To>::value == oiq_metal_size<From>::value, "as_type: sizes differ");
  To t;
#ifndef OIQ_EMU_ADDRESS_SPACES  // the type-checking build is never run
  std::memcpy(&t, &f, sizeof(To));
#endif
  return t;
}

// Float functions: computed in float for half/bfloat, elementwise on vectors.
#define OIQ_UNARY(name, expr)                                                    \
  inline float name(float x) { return expr; }                                    \
  inline half name(half hx) {                                                    \
    float x = float(hx);                                                         \
    return half(expr);                                                           \
  }                                                                              \
  inline bfloat16_t name(bfloat16_t bx) {                                        \
    float x = float(bx);                                                         \
    return bfloat16_t(expr);                                                     \
  }                                                                              \
  template <class T, int N>                                                      \
  inline vec<T, N> name(const vec<T, N>& v) {                                    \
    vec<T, N> r;                                                                 \
    for (int i = 0; i < N; ++i) r[i] = name(v[i]);                               \
    return r;                                                                    \
  }
OIQ_UNARY(exp, std::exp(x))
OIQ_UNARY(exp2, std::exp2(x))
OIQ_UNARY(exp10, std::pow(10.0f, x))
OIQ_UNARY(log, std::log(x))
OIQ_UNARY(log2, std::log2(x))
OIQ_UNARY(log10, std::log10(x))
OIQ_UNARY(sqrt, std::sqrt(x))
OIQ_UNARY(rsqrt, 1.0f / std::sqrt(x))
OIQ_UNARY(sin, std::sin(x))
OIQ_UNARY(cos, std::cos(x))
OIQ_UNARY(tan, std::tan(x))
OIQ_UNARY(tanh, std::tanh(x))
OIQ_UNARY(sinh, std::sinh(x))
OIQ_UNARY(cosh, std::cosh(x))
OIQ_UNARY(asin, std::asin(x))
OIQ_UNARY(acos, std::acos(x))
OIQ_UNARY(atan, std::atan(x))
OIQ_UNARY(erf, std::erf(x))
OIQ_UNARY(floor, std::floor(x))
OIQ_UNARY(ceil, std::ceil(x))
OIQ_UNARY(round, std::round(x))
OIQ_UNARY(rint, std::nearbyint(x))
OIQ_UNARY(trunc, std::trunc(x))
OIQ_UNARY(fabs, std::fabs(x))
OIQ_UNARY(fract, x - std::floor(x))
OIQ_UNARY(saturate, std::fmin(std::fmax(x, 0.0f), 1.0f))
OIQ_UNARY(sign, (x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : 0.0f)))
OIQ_UNARY(log1p, std::log1p(x))
OIQ_UNARY(expm1, std::expm1(x))
#undef OIQ_UNARY

inline float abs(float x) { return std::fabs(x); }
inline half abs(half x) { return half(std::fabs(float(x))); }
inline bfloat16_t abs(bfloat16_t x) { return bfloat16_t(std::fabs(float(x))); }
inline int32_t abs(int32_t x) { return x < 0 ? -x : x; }
inline int64_t abs(int64_t x) { return x < 0 ? -x : x; }
inline int16_t abs(int16_t x) { return int16_t(x < 0 ? -x : x); }
inline int8_t abs(int8_t x) { return int8_t(x < 0 ? -x : x); }
template <class T, int N>
inline vec<T, N> abs(const vec<T, N>& v) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = abs(v[i]);
  return r;
}

#define OIQ_BINARY(name, expr)                                                   \
  template <class T, class = std::enable_if_t<oiq::is_num<T>::value>>            \
  inline T name(T a, T b) {                                                      \
    return expr;                                                                 \
  }                                                                              \
  template <class T, int N>                                                      \
  inline vec<T, N> name(const vec<T, N>& a, const vec<T, N>& b) {                \
    vec<T, N> r;                                                                 \
    for (int i = 0; i < N; ++i) r[i] = name(a[i], b[i]);                         \
    return r;                                                                    \
  }
OIQ_BINARY(max, (a > b || b != b) ? a : b)
OIQ_BINARY(min, (a < b || b != b) ? a : b)
OIQ_BINARY(fmax, (a > b || b != b) ? a : b)
OIQ_BINARY(fmin, (a < b || b != b) ? a : b)
OIQ_BINARY(pow, T(std::pow(float(a), float(b))))
OIQ_BINARY(powr, T(std::pow(float(a), float(b))))
OIQ_BINARY(atan2, T(std::atan2(float(a), float(b))))
OIQ_BINARY(fmod, T(std::fmod(float(a), float(b))))
OIQ_BINARY(copysign, T(std::copysign(float(a), float(b))))
OIQ_BINARY(step, T(float(b) < float(a) ? 0.0f : 1.0f))
#undef OIQ_BINARY

template <class T, class = std::enable_if_t<oiq::is_num<T>::value>>
inline T fma(T a, T b, T c) {
  return T(std::fma(float(a), float(b), float(c)));
}
inline double fma(double a, double b, double c) { return std::fma(a, b, c); }
template <class T, int N>
inline vec<T, N> fma(const vec<T, N>& a, const vec<T, N>& b, const vec<T, N>& c) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = fma(a[i], b[i], c[i]);
  return r;
}
template <class T>
inline T clamp(T x, T lo, T hi) {
  return min(max(x, lo), hi);
}
template <class T>
inline T mix(T x, T y, T a) {
  return x + (y - x) * a;
}
template <class T>
inline T select(T a, T b, bool c) {
  return c ? b : a;
}
template <class T, int N>
inline T dot(const vec<T, N>& a, const vec<T, N>& b) {
  T s = T(0);
  for (int i = 0; i < N; ++i) s += a[i] * b[i];
  return s;
}
template <class T>
inline bool isnan(T x) {
  return std::isnan(float(x));
}
template <class T>
inline bool isinf(T x) {
  return std::isinf(float(x));
}
template <class T>
inline bool isfinite(T x) {
  return std::isfinite(float(x));
}
template <class T>
inline bool signbit(T x) {
  return std::signbit(float(x));
}
inline uint32_t popcount(uint32_t x) { return uint32_t(__builtin_popcount(x)); }
inline uint32_t clz(uint32_t x) { return x ? uint32_t(__builtin_clz(x)) : 32u; }
inline uint32_t ctz(uint32_t x) { return x ? uint32_t(__builtin_ctz(x)) : 32u; }
inline int32_t mulhi(int32_t a, int32_t b) { return int32_t((int64_t(a) * b) >> 32); }
inline uint32_t mulhi(uint32_t a, uint32_t b) { return uint32_t((uint64_t(a) * b) >> 32); }

// fast::exp (float): Metal documents `<= 3 + floor(fabs(2 * x)) ulp` with fast math
// (MSL specification section 8.4, Table 8.2; the precise exp: `<= 4 ulp`, Table 8.1).
// The emulator returns a result at least that far from exp(x) (oiq::fast_exp), so a
// kernel that takes fast::exp is tested against the documented bound, not against a
// libm exp.  A name declared here hides the using-directive's metal::exp for
// `fast::exp`, so the precise overloads are not candidates; only float exists (Metal's
// fast variants are for single precision).
namespace fast {
using namespace ::metal;
__attribute__((no_sanitize("coverage"))) inline float exp(float x) { return ::oiq::fast_exp(x); }
template <int N>
inline vec<float, N> exp(const vec<float, N>& v) {
  vec<float, N> r;
  for (int i = 0; i < N; ++i) r[i] = exp(v[i]);
  return r;
}
}  // namespace fast
namespace precise {
using namespace ::metal;
}

enum mem_flags : unsigned {
  mem_none = 0,
  mem_device = 1,
  mem_threadgroup = 2,
  mem_texture = 4,
  mem_threadgroup_imageblock = 8,
  mem_object_data = 16,
};
inline mem_flags operator|(mem_flags a, mem_flags b) {
  return mem_flags(unsigned(a) | unsigned(b));
}

}  // namespace metal

using namespace metal;

// ------------------------------------------------- MLX utils.h essentials
template <typename U>
struct Limits {
  static const constant U max = metal::numeric_limits<U>::max();
  static const constant U min = metal::numeric_limits<U>::min();
  static const constant U finite_max = metal::numeric_limits<U>::max();
  static const constant U finite_min = metal::numeric_limits<U>::min();
};
#define OIQ_FLOAT_LIMITS(T)                                                      \
  template <>                                                                    \
  struct Limits<T> {                                                             \
    static inline const T max = metal::numeric_limits<T>::infinity();            \
    static inline const T min = -metal::numeric_limits<T>::infinity();           \
    static inline const T finite_max = metal::numeric_limits<T>::max();          \
    static inline const T finite_min = metal::numeric_limits<T>::lowest();       \
  };
OIQ_FLOAT_LIMITS(float)
OIQ_FLOAT_LIMITS(half)
OIQ_FLOAT_LIMITS(bfloat16_t)
#undef OIQ_FLOAT_LIMITS
template <>
struct Limits<bool> {
  static const constant bool max = true;
  static const constant bool min = false;
};

template <typename IdxT = int64_t>
inline IdxT elem_to_loc(IdxT elem, constant const int* shape, constant const int64_t* strides,
                        int ndim) {
  IdxT loc = 0;
  for (int i = ndim - 1; i >= 0 && elem > 0; --i) {
    loc += (elem % shape[i]) * IdxT(strides[i]);
    elem /= shape[i];
  }
  return loc;
}
template <typename IdxT = int64_t>
inline IdxT elem_to_loc(uint3 elem, constant const int* shape, constant const int64_t* strides,
                        int ndim) {
  IdxT loc = IdxT(elem.x) * IdxT(strides[ndim - 1]) + IdxT(elem.y) * IdxT(strides[ndim - 2]);
  for (int d = ndim - 3; d >= 0; --d) {
    loc += (elem.z % shape[d]) * IdxT(strides[d]);
    elem.z /= shape[d];
  }
  return loc;
}
template <typename T, typename U>
inline T ceildiv(T N, U M) {
  return (N + M - 1) / M;
}

// ---------------------------------------------------------------- runtime
namespace oiq {

enum State { RUNNABLE = 0, AT_BARRIER = 1, AT_SIMD = 2, DONE = 3 };
constexpr int SIMD_WIDTH = 32;
constexpr int SLOT_BYTES = 64;

struct ThreadInfo {
  uint dispatch_quadgroups_per_threadgroup, dispatch_simdgroups_per_threadgroup;
  uint3 dispatch_threads_per_threadgroup, grid_origin, grid_size;
  uint quadgroup_index_in_threadgroup, quadgroups_per_threadgroup;
  uint simdgroup_index_in_threadgroup, simdgroups_per_threadgroup;
  uint thread_execution_width, thread_index_in_quadgroup, thread_index_in_simdgroup;
  uint thread_index_in_threadgroup;
  uint3 thread_position_in_grid, thread_position_in_threadgroup;
  uint3 threadgroup_position_in_grid, threadgroups_per_grid, threads_per_grid;
  uint threads_per_simdgroup;
  uint3 threads_per_threadgroup;
};

struct Fiber {
  ucontext_t ctx;
  int state;
  int op;                 // simd op kind while AT_SIMD
  const char* site_file;  // call site of the pending barrier / simd op
  int site_line;
  unsigned seq;                  // number of simd ops completed
  uint32_t mask[2];              // lanes that took part, per seq parity
  alignas(16) unsigned char slot[2][SLOT_BYTES];
  ThreadInfo ti;
  char* stack;
};

struct TgArray {
  void* ptr;
  size_t bytes;
};

struct Group {
  ucontext_t sched;
  Fiber* fibers = nullptr;
  int n = 0;
  int cur = 0;
  bool failed = false;
  char err[1024];
  void (*body)(void*, const ThreadInfo&) = nullptr;
  void* closure = nullptr;
  TgArray tg[64];
  int ntg = 0;
  size_t tg_bytes = 0;  // threadgroup memory declared so far in this group
  int order = 0;        // 0 forward, 1 reverse, else the seed of a shuffle
  uint32_t rng = 1;
};

// Metal's limit on threadgroup memory per threadgroup (Apple GPUs: 32 KiB).
constexpr size_t TG_MEMORY_LIMIT = 32768;

inline Group*& group() {
  static Group* g = nullptr;
  return g;
}

inline void fail(const char* msg) {
  Group* g = group();
  if (!g->failed) {
    g->failed = true;
    std::snprintf(g->err, sizeof(g->err), "%s", msg);
  }
}

inline void yield_to_scheduler() {
  Group* g = group();
  Fiber& f = g->fibers[g->cur];
  swapcontext(&f.ctx, &g->sched);
  if (g->failed) {
    // Park forever: the scheduler abandons this fiber.
    swapcontext(&f.ctx, &g->sched);
  }
}

// Threadgroup memory: statics shared by all fibers of the running group,
// filled with 0xFF bytes (NaN for floats, all-ones for ints) when the first
// thread of each group reaches the declaration.
inline void tg_register(void* p, size_t bytes) {
  Group* g = group();
  for (int i = 0; i < g->ntg; ++i)
    if (g->tg[i].ptr == p) return;
  if (g->ntg < 64) g->tg[g->ntg++] = TgArray{p, bytes};
  g->tg_bytes += bytes;
  if (g->tg_bytes > TG_MEMORY_LIMIT) {
    char msg[160];
    std::snprintf(msg, sizeof(msg),
                  "the kernel declares %zu bytes of threadgroup memory; Metal allows %zu",
                  g->tg_bytes, TG_MEMORY_LIMIT);
    fail(msg);
    yield_to_scheduler();
  }
  std::memset(p, 0xFF, bytes);
}

// Bounds of device memory (the buffers of one launch, laid out by the Python
// side in one arena) and its shadow: one byte per arena byte, 1 where an input
// element lies, 2 where an output element lies, 0 in gaps and guards.  Every
// load and store of the kernel is reported to the hooks below (clang's
// -fsanitize-coverage=trace-loads,trace-stores); one outside the elements of
// the array it was meant for fails the launch.
struct Arena {
  uintptr_t lo = 0;
  uintptr_t size = 0;
  const unsigned char* shadow = nullptr;
  int64_t* fault = nullptr;  // kind (1 read, 2 write), offset, bytes, thread x, y, z
};
inline Arena& arena() {
  static Arena a;
  return a;
}

__attribute__((no_sanitize("coverage"))) inline void check_access(const void* p, int bytes,
                                                                   int kind) {
  Arena& a = arena();
  uintptr_t off = uintptr_t(p) - a.lo;
  if (off >= a.size) return;
  bool ok = off + uintptr_t(bytes) <= a.size;
  for (int i = 0; ok && i < bytes; ++i) {
    unsigned char sh = a.shadow[off + i];
    ok = sh == 2 || (sh == 1 && kind == 1);
  }
  if (ok) return;
  Group* g = group();
  if (g == nullptr || g->failed) return;
  const ThreadInfo& ti = g->fibers[g->cur].ti;
  int64_t rec[6] = {kind, int64_t(off), bytes, ti.thread_position_in_grid.x,
                    ti.thread_position_in_grid.y, ti.thread_position_in_grid.z};
  std::memcpy(a.fault, rec, sizeof(rec));
  fail(kind == 1 ? "out-of-bounds read" : "out-of-bounds write");
  yield_to_scheduler();
}

enum SimdOp {
  OP_SUM, OP_PRODUCT, OP_MAX, OP_MIN, OP_AND, OP_OR, OP_XOR,
  OP_PREFIX_EXCL_SUM, OP_PREFIX_INCL_SUM, OP_PREFIX_EXCL_PRODUCT, OP_PREFIX_INCL_PRODUCT,
  OP_SHUFFLE, OP_SHUFFLE_XOR, OP_SHUFFLE_DOWN, OP_SHUFFLE_UP,
  OP_SHUFFLE_ROTATE_DOWN, OP_SHUFFLE_ROTATE_UP, OP_BROADCAST, OP_BROADCAST_FIRST,
  OP_ALL, OP_ANY, OP_IS_FIRST, OP_SIMD_BARRIER,
};

inline const char* op_name(int op) {
  static const char* names[] = {
      "simd_sum", "simd_product", "simd_max", "simd_min", "simd_and", "simd_or", "simd_xor",
      "simd_prefix_exclusive_sum", "simd_prefix_inclusive_sum",
      "simd_prefix_exclusive_product", "simd_prefix_inclusive_product",
      "simd_shuffle", "simd_shuffle_xor", "simd_shuffle_down", "simd_shuffle_up",
      "simd_shuffle_rotate_down", "simd_shuffle_rotate_up", "simd_broadcast",
      "simd_broadcast_first", "simd_all", "simd_any", "simd_is_first", "simdgroup_barrier"};
  return names[op];
}

template <class T>
inline T elem_max(T a, T b) {
  return metal::max(a, b);
}
template <class T>
inline T elem_min(T a, T b) {
  return metal::min(a, b);
}

// One lane's side of a simd collective: deposit, wait for every live lane of
// the simdgroup, then compute this lane's result from the deposited values.
template <class T>
inline T simd_collective(int op, T v, int arg, const char* file, int line) {
  static_assert(sizeof(T) <= SLOT_BYTES, "simd value too large");
  Group* g = group();
  int me = g->cur;
  Fiber& f = g->fibers[me];
  int par = f.seq & 1;
  std::memcpy(f.slot[par], &v, sizeof(T));
  f.state = AT_SIMD;
  f.op = op;
  f.site_file = file;
  f.site_line = line;
  yield_to_scheduler();
  f.seq++;
  uint32_t mask = f.mask[par];
  int base = (me / SIMD_WIDTH) * SIMD_WIDTH;
  int lane = me - base;
  auto val = [&](int l) {
    T r;
    if (l < 0 || l >= SIMD_WIDTH || !((mask >> l) & 1u)) {
      std::memset(&r, 0xFF, sizeof(T));  // inactive lane: poison
    } else {
      std::memcpy(&r, g->fibers[base + l].slot[par], sizeof(T));
    }
    return r;
  };
  int first = __builtin_ctz(mask);
  switch (op) {
    case OP_SUM:
    case OP_PRODUCT:
    case OP_MAX:
    case OP_MIN:
    case OP_AND:
    case OP_OR:
    case OP_XOR:
    case OP_PREFIX_EXCL_SUM:
    case OP_PREFIX_INCL_SUM:
    case OP_PREFIX_EXCL_PRODUCT:
    case OP_PREFIX_INCL_PRODUCT: {
      bool prefix = op >= OP_PREFIX_EXCL_SUM;
      bool excl = op == OP_PREFIX_EXCL_SUM || op == OP_PREFIX_EXCL_PRODUCT;
      bool prod = op == OP_PRODUCT || op == OP_PREFIX_EXCL_PRODUCT || op == OP_PREFIX_INCL_PRODUCT;
      int last = prefix ? (excl ? lane - 1 : lane) : SIMD_WIDTH - 1;
      T acc = prod ? T(1) : T(0);
      bool have = false;
      for (int l = 0; l <= last; ++l) {
        if (!((mask >> l) & 1u)) continue;
        T x = val(l);
        if (!have && !prefix) {
          acc = x;
          have = true;
          continue;
        }
        have = true;
        if constexpr (std::is_integral<T>::value) {
          if (op == OP_AND) { acc = acc & x; continue; }
          if (op == OP_OR) { acc = acc | x; continue; }
          if (op == OP_XOR) { acc = acc ^ x; continue; }
        }
        if (op == OP_MAX) acc = elem_max(acc, x);
        else if (op == OP_MIN) acc = elem_min(acc, x);
        else if (prod) acc = T(acc * x);
        else acc = T(acc + x);
      }
      return acc;
    }
    case OP_SHUFFLE:
    case OP_BROADCAST: return val(arg);
    case OP_BROADCAST_FIRST: return val(first);
    case OP_SHUFFLE_XOR: return val(lane ^ arg);
    case OP_SHUFFLE_DOWN: return lane + arg < SIMD_WIDTH ? val(lane + arg) : v;
    case OP_SHUFFLE_UP: return lane - arg >= 0 ? val(lane - arg) : v;
    case OP_SHUFFLE_ROTATE_DOWN: return val((lane + arg) % SIMD_WIDTH);
    case OP_SHUFFLE_ROTATE_UP: return val(((lane - arg) % SIMD_WIDTH + SIMD_WIDTH) % SIMD_WIDTH);
    default: return v;
  }
}

template <class T>
inline T simd_reduce_bool(int op, T v, const char* file, int line) {
  return simd_collective<T>(op, v, 0, file, line);
}

// Scheduler: run each runnable fiber until its next yield point, then settle
// simd collectives (per simdgroup) or the threadgroup barrier.
inline void fiber_entry() {
  Group* g = group();
  Fiber& f = g->fibers[g->cur];
  g->body(g->closure, f.ti);
  f.state = DONE;
  swapcontext(&f.ctx, &g->sched);
}

inline bool settle(Group* g) {
  bool any_simd = false;
  for (int base = 0; base < g->n; base += SIMD_WIDTH) {
    int end = base + SIMD_WIDTH < g->n ? base + SIMD_WIDTH : g->n;
    int simd = -1, barrier = -1;
    for (int i = base; i < end; ++i) {
      if (g->fibers[i].state == AT_SIMD && simd < 0) simd = i;
      if (g->fibers[i].state == AT_BARRIER && barrier < 0) barrier = i;
    }
    if (simd < 0) continue;
    Fiber& s = g->fibers[simd];
    char msg[512];
    if (barrier >= 0) {
      std::snprintf(msg, sizeof(msg),
                    "simdgroup %d diverged: thread %d waits at %s (%s:%d) while thread %d "
                    "waits at threadgroup_barrier (%s:%d)",
                    base / SIMD_WIDTH, simd, op_name(s.op), s.site_file, s.site_line, barrier,
                    g->fibers[barrier].site_file, g->fibers[barrier].site_line);
      fail(msg);
      return false;
    }
    uint32_t mask = 0;
    for (int i = base; i < end; ++i) {
      Fiber& o = g->fibers[i];
      if (o.state != AT_SIMD) continue;
      if (o.op != s.op || o.site_line != s.site_line || std::strcmp(o.site_file, s.site_file)) {
        std::snprintf(msg, sizeof(msg),
                      "simdgroup %d diverged: thread %d waits at %s (%s:%d) while thread %d "
                      "waits at %s (%s:%d)",
                      base / SIMD_WIDTH, simd, op_name(s.op), s.site_file, s.site_line, i,
                      op_name(o.op), o.site_file, o.site_line);
        fail(msg);
        return false;
      }
      mask |= 1u << (i - base);
    }
    for (int i = base; i < end; ++i) {
      Fiber& o = g->fibers[i];
      if (o.state != AT_SIMD) continue;
      o.mask[o.seq & 1] = mask;
      o.state = RUNNABLE;
    }
    any_simd = true;
  }
  if (any_simd) return true;
  int waiting = 0, done = 0, first = -1, first_done = -1;
  for (int i = 0; i < g->n; ++i) {
    Fiber& f = g->fibers[i];
    if (f.state == AT_BARRIER) {
      if (first < 0) first = i;
      ++waiting;
    } else if (f.state == DONE) {
      if (first_done < 0) first_done = i;
      ++done;
    }
  }
  if (waiting == 0) return false;
  char msg[512];
  Fiber& b = g->fibers[first];
  if (done > 0) {
    std::snprintf(msg, sizeof(msg),
                  "threadgroup_barrier at %s:%d reached by only part of the threadgroup: "
                  "%d of %d threads wait there, %d threads (first: %d) already returned",
                  b.site_file, b.site_line, waiting, g->n, done, first_done);
    fail(msg);
    return false;
  }
  for (int i = 0; i < g->n; ++i) {
    Fiber& f = g->fibers[i];
    if (f.site_line != b.site_line || std::strcmp(f.site_file, b.site_file)) {
      std::snprintf(msg, sizeof(msg),
                    "threads of one threadgroup wait at different barriers: thread %d at "
                    "%s:%d, thread %d at %s:%d",
                    first, b.site_file, b.site_line, i, f.site_file, f.site_line);
      fail(msg);
      return false;
    }
  }
  for (int i = 0; i < g->n; ++i) g->fibers[i].state = RUNNABLE;
  return true;
}

constexpr size_t STACK_BYTES = 256 * 1024;

// Execution order of the runnable fibers between synchronisation points, and
// of the threadgroups: forward, reverse, or a shuffle (re-drawn every round).
__attribute__((no_sanitize("coverage"))) inline uint32_t next_random(uint32_t& s) {
  s ^= s << 13;
  s ^= s >> 17;
  s ^= s << 5;
  return s;
}
inline uint64_t gcd(uint64_t a, uint64_t b) { return b ? gcd(b, a % b) : a; }
inline void order_indices(int order, uint32_t& rng, int* idx, int n) {
  for (int i = 0; i < n; ++i) idx[i] = order == 1 ? n - 1 - i : i;
  if (order >= 2) {
    for (int i = n - 1; i > 0; --i) {
      int j = int(next_random(rng) % uint32_t(i + 1));
      int t = idx[i];
      idx[i] = idx[j];
      idx[j] = t;
    }
  }
}

// Returns 0 on success, 1 on a detected error (message in err).
template <class F>
inline int run_grid(const uint32_t* grid, const uint32_t* tgsize, int order, int64_t* stats, F& body,
                    char* err, int errlen) {
  static Fiber* fibers = nullptr;
  static int capacity = 0;
  uint32_t tgn = tgsize[0] * tgsize[1] * tgsize[2];
  if (int(tgn) > capacity) {
    fibers = new Fiber[tgn];
    for (uint32_t i = 0; i < tgn; ++i) fibers[i].stack = new char[STACK_BYTES];
    capacity = int(tgn);
  }
  Group g;
  g.fibers = fibers;
  g.body = [](void* c, const ThreadInfo& ti) { (*static_cast<F*>(c))(ti); };
  g.closure = &body;
  group() = &g;
  uint32_t ngroups[3];
  for (int d = 0; d < 3; ++d) ngroups[d] = (grid[d] + tgsize[d] - 1) / tgsize[d];
  uint dispatch_simds = (tgn + SIMD_WIDTH - 1) / SIMD_WIDTH;
  g.order = order;
  g.rng = 0x9E3779B9u ^ uint32_t(order) * 2654435761u;
  uint64_t total_groups = uint64_t(ngroups[0]) * ngroups[1] * ngroups[2];
  int* perm = new int[tgn > 0 ? tgn : 1];
  uint64_t gstride = 1, gstep = 1;
  if (order >= 2) {  // a pseudo-random permutation: step coprime with the count
    gstride = next_random(g.rng) % (total_groups ? total_groups : 1);
    gstep = (next_random(g.rng) | 1u) % (total_groups ? total_groups : 1);
    while (total_groups > 1 && gcd(gstep, total_groups) != 1) ++gstep;
    if (gstep == 0) gstep = 1;
  }
  stats[0] = 0;
  for (uint64_t gi = 0; gi < total_groups; ++gi) {
    uint64_t lin = order == 1 ? total_groups - 1 - gi
                              : order >= 2 ? (gstride + gi * gstep) % total_groups : gi;
    uint32_t gx = uint32_t(lin % ngroups[0]);
    uint32_t gy = uint32_t((lin / ngroups[0]) % ngroups[1]);
    uint32_t gz = uint32_t(lin / (uint64_t(ngroups[0]) * ngroups[1]));
    {
      {
        uint32_t gpos[3] = {gx, gy, gz};
        uint32_t cnt[3];
        for (int d = 0; d < 3; ++d) {
          uint32_t origin = gpos[d] * tgsize[d];
          cnt[d] = grid[d] - origin < tgsize[d] ? grid[d] - origin : tgsize[d];
        }
        int n = int(cnt[0] * cnt[1] * cnt[2]);
        g.n = n;
        g.ntg = 0;
        g.tg_bytes = 0;
        for (int i = 0; i < n; ++i) {
          Fiber& f = fibers[i];
          uint32_t lx = uint32_t(i) % cnt[0], ly = (uint32_t(i) / cnt[0]) % cnt[1],
                   lz = uint32_t(i) / (cnt[0] * cnt[1]);
          ThreadInfo& t = f.ti;
          t.dispatch_threads_per_threadgroup = uint3(tgsize[0], tgsize[1], tgsize[2]);
          t.dispatch_simdgroups_per_threadgroup = dispatch_simds;
          t.dispatch_quadgroups_per_threadgroup = (tgn + 3) / 4;
          t.grid_origin = uint3(0, 0, 0);
          t.grid_size = uint3(grid[0], grid[1], grid[2]);
          t.threads_per_grid = t.grid_size;
          t.threads_per_threadgroup = uint3(cnt[0], cnt[1], cnt[2]);
          t.threadgroups_per_grid = uint3(ngroups[0], ngroups[1], ngroups[2]);
          t.threadgroup_position_in_grid = uint3(gx, gy, gz);
          t.thread_position_in_threadgroup = uint3(lx, ly, lz);
          t.thread_position_in_grid =
              uint3(gx * tgsize[0] + lx, gy * tgsize[1] + ly, gz * tgsize[2] + lz);
          t.thread_index_in_threadgroup = uint(i);
          t.thread_index_in_simdgroup = uint(i % SIMD_WIDTH);
          t.simdgroup_index_in_threadgroup = uint(i / SIMD_WIDTH);
          t.simdgroups_per_threadgroup = uint((n + SIMD_WIDTH - 1) / SIMD_WIDTH);
          t.thread_index_in_quadgroup = uint(i % 4);
          t.quadgroup_index_in_threadgroup = uint(i / 4);
          t.quadgroups_per_threadgroup = uint((n + 3) / 4);
          t.thread_execution_width = SIMD_WIDTH;
          t.threads_per_simdgroup = SIMD_WIDTH;
          f.state = RUNNABLE;
          f.seq = 0;
          f.site_file = "";
          f.site_line = 0;
          getcontext(&f.ctx);
          f.ctx.uc_stack.ss_sp = f.stack;
          f.ctx.uc_stack.ss_size = STACK_BYTES;
          f.ctx.uc_link = &g.sched;
          makecontext(&f.ctx, fiber_entry, 0);
        }
        for (;;) {
          bool ran = false;
          order_indices(order, g.rng, perm, n);
          for (int k = 0; k < n; ++k) {
            int i = perm[k];
            if (fibers[i].state != RUNNABLE) continue;
            ran = true;
            g.cur = i;
            swapcontext(&g.sched, &fibers[i].ctx);
            if (g.failed) break;
          }
          if (!g.failed && !ran) {
            bool all_done = true;
            for (int i = 0; i < n; ++i) all_done = all_done && fibers[i].state == DONE;
            if (all_done) break;
          }
          if (!g.failed && !settle(&g)) {
            bool all_done = true;
            for (int i = 0; i < n; ++i) all_done = all_done && fibers[i].state == DONE;
            if (all_done) break;
            if (!g.failed) fail("scheduler stalled (internal error)");
          }
          if (g.failed) {
            char where[96];
            std::snprintf(where, sizeof(where), " [threadgroup (%u, %u, %u)]", gx, gy, gz);
            std::snprintf(err, errlen, "%s%s", g.err, where);
            group() = nullptr;
            delete[] perm;
            return 1;
          }
        }
        if (int64_t(g.tg_bytes) > stats[0]) stats[0] = int64_t(g.tg_bytes);
      }
    }
  }
  group() = nullptr;
  delete[] perm;
  return 0;
}

}  // namespace oiq

inline void threadgroup_barrier(metal::mem_flags = metal::mem_none,
                                const char* file = __builtin_FILE(),
                                int line = __builtin_LINE()) {
  oiq::Group* g = oiq::group();
  oiq::Fiber& f = g->fibers[g->cur];
  f.state = oiq::AT_BARRIER;
  f.site_file = file;
  f.site_line = line;
  oiq::yield_to_scheduler();
}

inline void simdgroup_barrier(metal::mem_flags = metal::mem_none,
                              const char* file = __builtin_FILE(),
                              int line = __builtin_LINE()) {
  oiq::simd_collective<int>(oiq::OP_SIMD_BARRIER, 0, 0, file, line);
}

#define OIQ_SIMD_REDUCE(name, op)                                                \
  template <class T>                                                             \
  inline T name(T v, const char* file = __builtin_FILE(), int line = __builtin_LINE()) { \
    return oiq::simd_collective<T>(oiq::op, v, 0, file, line);                   \
  }
OIQ_SIMD_REDUCE(simd_sum, OP_SUM)
OIQ_SIMD_REDUCE(simd_product, OP_PRODUCT)
OIQ_SIMD_REDUCE(simd_max, OP_MAX)
OIQ_SIMD_REDUCE(simd_min, OP_MIN)
OIQ_SIMD_REDUCE(simd_and, OP_AND)
OIQ_SIMD_REDUCE(simd_or, OP_OR)
OIQ_SIMD_REDUCE(simd_xor, OP_XOR)
OIQ_SIMD_REDUCE(simd_prefix_exclusive_sum, OP_PREFIX_EXCL_SUM)
OIQ_SIMD_REDUCE(simd_prefix_inclusive_sum, OP_PREFIX_INCL_SUM)
OIQ_SIMD_REDUCE(simd_prefix_exclusive_product, OP_PREFIX_EXCL_PRODUCT)
OIQ_SIMD_REDUCE(simd_prefix_inclusive_product, OP_PREFIX_INCL_PRODUCT)
OIQ_SIMD_REDUCE(simd_broadcast_first, OP_BROADCAST_FIRST)
#undef OIQ_SIMD_REDUCE

#define OIQ_SIMD_SHUFFLE(name, op)                                               \
  template <class T>                                                             \
  inline T name(T v, uint16_t arg, const char* file = __builtin_FILE(),          \
                int line = __builtin_LINE()) {                                   \
    return oiq::simd_collective<T>(oiq::op, v, int(arg), file, line);            \
  }
OIQ_SIMD_SHUFFLE(simd_shuffle, OP_SHUFFLE)
OIQ_SIMD_SHUFFLE(simd_broadcast, OP_BROADCAST)
OIQ_SIMD_SHUFFLE(simd_shuffle_xor, OP_SHUFFLE_XOR)
OIQ_SIMD_SHUFFLE(simd_shuffle_down, OP_SHUFFLE_DOWN)
OIQ_SIMD_SHUFFLE(simd_shuffle_up, OP_SHUFFLE_UP)
OIQ_SIMD_SHUFFLE(simd_shuffle_rotate_down, OP_SHUFFLE_ROTATE_DOWN)
OIQ_SIMD_SHUFFLE(simd_shuffle_rotate_up, OP_SHUFFLE_ROTATE_UP)
#undef OIQ_SIMD_SHUFFLE

inline bool simd_all(bool v, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return oiq::simd_collective<uint8_t>(oiq::OP_AND, uint8_t(v), 0, file, line) != 0;
}
inline bool simd_any(bool v, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return oiq::simd_collective<uint8_t>(oiq::OP_OR, uint8_t(v), 0, file, line) != 0;
}
inline bool simd_is_first(const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  oiq::Group* g = oiq::group();
  int me = g->cur;
  int lane = me % oiq::SIMD_WIDTH;
  uint32_t m = oiq::simd_collective<uint32_t>(oiq::OP_OR, 1u << lane, 0, file, line);
  return __builtin_ctz(m) == lane;
}

// Hooks of clang's -fsanitize-coverage=trace-loads,trace-stores (see oiq::Arena).
extern "C" {
#define OIQ_ACCESS_HOOKS(n)                                                               \
  __attribute__((no_sanitize("coverage"))) void __sanitizer_cov_load##n(void* p) {        \
    oiq::check_access(p, n, 1);                                                           \
  }                                                                                       \
  __attribute__((no_sanitize("coverage"))) void __sanitizer_cov_store##n(void* p) {       \
    oiq::check_access(p, n, 2);                                                           \
  }
OIQ_ACCESS_HOOKS(1)
OIQ_ACCESS_HOOKS(2)
OIQ_ACCESS_HOOKS(4)
OIQ_ACCESS_HOOKS(8)
OIQ_ACCESS_HOOKS(16)
#undef OIQ_ACCESS_HOOKS
// The coverage flags themselves (one per function) are not used.
__attribute__((no_sanitize("coverage"))) void __sanitizer_cov_bool_flag_init(bool*, bool*) {}
// The fast::exp error model of the next launches (emulator.FAST_EXP).
void oiq_emu_set_fast_exp(int mode, double scale) {
  ::oiq::fast_exp_model().mode = mode;
  ::oiq::fast_exp_model().scale = scale;
}
}
