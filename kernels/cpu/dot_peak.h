// The cores' dot-product peak, measured: a register-only loop of the instruction a matmul kernel
// uses, on every thread of the pool. Benchmarks compare a matmul's GFLOP/s (or a prefill's tokens/s)
// with it, since vendor figures say nothing about the clocks and ports a VM actually gets.
#pragma once

#include <cstdint>

namespace mindie::kernels::cpu {

// kVpdpbusd: the int8 form's VNNI product (AVX512-VNNI, or AVX-VNNI in the AVX2 variant);
// kVpmaddubsw: its AVX-512BW / AVX2 form (vpmaddubsw + vpmaddwd + vpaddd, as Int8Panel::dot without
// VNNI); kVpmaddwd: the prompt tiles' int16 product (vpmaddwd + vpaddd); kVpdpwssd: its VNNI form
// (likewise); kVdpbf16ps: the bf16 form's; kTdpbf16ps: the bf16 form's on AMX tiles (vec_amx.h).
enum class DotInstr : int { kVpdpbusd = 0, kVpmaddubsw = 1, kVdpbf16ps = 2, kTdpbf16ps = 3, kVpmaddwd = 4, kVpdpwssd = 5 };

// Runs `iterations` rounds of independent chains of `instr` on each of `threads` pool threads and
// adds the products (multiply-adds) done to *products; 0 when the active variant or the CPU lacks
// the instruction.
struct DotPeakArgs {
  DotInstr instr;
  int64_t iterations;
  int64_t threads;
  int64_t* products;
};

void dot_peak(const DotPeakArgs& args);

#define MINDIE_DOT_PEAK_KERNELS(X) X(dot_peak, DotPeakArgs)

}  // namespace mindie::kernels::cpu
