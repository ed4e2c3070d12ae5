// The lane primitives that a packed panel's block decoding (quant_decode.h) is written over: one
// struct per ISA variant, `Lanes`, whose vectors hold kRows of a panel's rows (one row per 32-bit
// lane), and `Lanes1`, one row in plain integers, which every variant has for row-at-a-time reads.
// A panel's runs are 64 bytes a run and its header fields 32 bytes a field (see quant.h): a struct
// of fewer than 16 lanes reads rows 0..kRows-1 of them, and the caller offsets both pointers by
// 4 * kRows and 2 * kRows bytes for the next kRows rows. Every primitive is exact integer work or
// one IEEE operation, so every struct gives a row the same bits.
#pragma once

#include <cstdint>
#include <cstring>

#include "cpu/types.h"
#include "cpu/vec.h"

namespace mindie::kernels::cpu {
namespace MINDIE_ISA_NS {

// One row: its 4-byte group of a run as a uint32 (byte i in bits 8i..8i+7), its header fields as floats.
struct Lanes1 {
  using I = uint32_t;
  using F = float;
  static constexpr int kRows = 1;

  static I run(const uint8_t* runs, int t) {
    I w;
    std::memcpy(&w, runs + 64 * t, 4);
    return w;
  }
  static F halves(const uint8_t* headers, int field) {
    uint16_t h;
    std::memcpy(&h, headers + 32 * field, 2);
    return fp16_to_float(h);
  }
  static I bytes(int v) { return 0x01010101u * static_cast<uint8_t>(v); }
  // Low (shift 0) or high (shift 4) nibbles of each byte.
  static I nibbles(I w, int shift) { return (w >> shift) & bytes(0x0F); }
  // Bit `from` of each byte moved to bit `to`, the byte's bits that `mask` clears dropped.
  static I bit_to(I w, int from, int to, int mask) { return (to >= from ? w << (to - from) : w >> (from - to)) & bytes(mask); }
  // Bits shift..shift+width-1 of each lane.
  static I bits(I w, int shift, int width) { return (w >> shift) & ((1u << width) - 1); }
  // Byte `byte` of each lane, sign-extended.
  static I sbyte(I w, int byte) { return static_cast<I>(static_cast<int32_t>(w << (24 - 8 * byte)) >> 24); }
  static I shl(I w, int n) { return w << n; }
  static I or_(I a, I b) { return a | b; }
  static F to_float(I w) { return static_cast<float>(static_cast<int32_t>(w)); }
  static F mul(F a, F b) { return a * b; }
  static F set1(float v) { return v; }
  static F negate(F v) { return -v; }
  static void store(int8_t* p, I w) { std::memcpy(p, &w, 4); }
  static void store(float* p, F v) { *p = v; }
};

#if defined(MINDIE_ISA_AVX512)

// A panel's 16 rows in one vector.
struct Lanes {
  using I = __m512i;
  using F = __m512;
  static constexpr int kRows = 16;

  static I run(const uint8_t* runs, int t) { return _mm512_loadu_si512(runs + 64 * t); }
  static F halves(const uint8_t* headers, int field) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(headers + 32 * field)));
  }
  static I bytes(int v) { return _mm512_set1_epi8(static_cast<char>(v)); }
  static I nibbles(I w, int shift) { return _mm512_and_si512(shift ? _mm512_srli_epi16(w, 4) : w, bytes(0x0F)); }
  static I bit_to(I w, int from, int to, int mask) {
    const I moved = to >= from ? _mm512_slli_epi32(w, to - from) : _mm512_srli_epi32(w, from - to);
    return _mm512_and_si512(moved, bytes(mask));
  }
  static I bits(I w, int shift, int width) {
    return _mm512_and_si512(_mm512_srli_epi32(w, shift), _mm512_set1_epi32((1 << width) - 1));
  }
  static I sbyte(I w, int byte) { return _mm512_srai_epi32(_mm512_slli_epi32(w, 24 - 8 * byte), 24); }
  static I shl(I w, int n) { return _mm512_slli_epi32(w, n); }
  static I or_(I a, I b) { return _mm512_or_si512(a, b); }
  static F to_float(I w) { return _mm512_cvtepi32_ps(w); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F negate(F v) { return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v), _mm512_set1_epi32(INT32_MIN))); }
  static void store(int8_t* p, I w) { _mm512_storeu_si512(p, w); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
};

#elif defined(MINDIE_ISA_AVX2)

// Eight of a panel's rows in one vector.
struct Lanes {
  using I = __m256i;
  using F = __m256;
  static constexpr int kRows = 8;

  static I run(const uint8_t* runs, int t) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(runs + 64 * t)); }
  static F halves(const uint8_t* headers, int field) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(headers + 32 * field)));
  }
  static I bytes(int v) { return _mm256_set1_epi8(static_cast<char>(v)); }
  static I nibbles(I w, int shift) { return _mm256_and_si256(shift ? _mm256_srli_epi16(w, 4) : w, bytes(0x0F)); }
  static I bit_to(I w, int from, int to, int mask) {
    const I moved = to >= from ? _mm256_slli_epi32(w, to - from) : _mm256_srli_epi32(w, from - to);
    return _mm256_and_si256(moved, bytes(mask));
  }
  static I bits(I w, int shift, int width) {
    return _mm256_and_si256(_mm256_srli_epi32(w, shift), _mm256_set1_epi32((1 << width) - 1));
  }
  static I sbyte(I w, int byte) { return _mm256_srai_epi32(_mm256_slli_epi32(w, 24 - 8 * byte), 24); }
  static I shl(I w, int n) { return _mm256_slli_epi32(w, n); }
  static I or_(I a, I b) { return _mm256_or_si256(a, b); }
  static F to_float(I w) { return _mm256_cvtepi32_ps(w); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F negate(F v) { return _mm256_xor_ps(v, _mm256_set1_ps(-0.f)); }
  static void store(int8_t* p, I w) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), w); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
};

#else

using Lanes = Lanes1;

#endif

}  // namespace MINDIE_ISA_NS
}  // namespace mindie::kernels::cpu
