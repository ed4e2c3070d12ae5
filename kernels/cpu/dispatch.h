// Run-time choice of the kernel variant. Each kernel header lists its entry points in an X-macro;
// dispatch.cpp declares them once per compiled ISA namespace and forwards every call to the variant
// selected here (the best the running CPU supports, or the one a test forces).
#pragma once

#include <string>
#include <vector>

namespace mindie::kernels::cpu {

enum class Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

// Variants compiled into this build that the running CPU can execute, best last.
std::vector<Isa> available_isas();
Isa active_isa();
// Forces a variant (tests compare them); throws std::invalid_argument if it is not available.
void set_active_isa(Isa isa);
const char* isa_name(Isa isa);
// AVX512-BF16 (vdpbf16ps): the AVX-512 variant uses it for bf16 x bf16 dot products when present.
bool cpu_has_avx512_bf16();
// AVX512-VNNI (vpdpbusd, vpdpwssd): the AVX-512 variant's int8 dot products use it when present.
bool cpu_has_avx512_vnni();
// AVX-VNNI (the same two on 256-bit vectors, VEX-encoded; Intel Alder Lake, Sierra Forest and later
// have it without AVX-512): the AVX2 variant's int8 dot products use it when present.
bool cpu_has_avx_vnni();
// Whether they use them now: present and not turned off (tests and A/B runs take the vpmaddubsw and
// vpmaddwd forms on a CPU with VNNI). One switch for both variants.
bool use_avx512_vnni();
bool use_avx_vnni();
void set_use_vnni(bool enabled);
// AMX-BF16 (tdpbf16ps on tiles) usable: the CPU has it and the kernel granted this process the tile
// state (arch_prctl ARCH_REQ_XCOMP_PERM, asked on the first call). The AVX-512 variant then computes
// bf16 rows on tiles.
bool cpu_has_amx_bf16();
// Whether it does now: usable and not turned off (tests compare the tiles with vdpbf16ps, and the
// int8 rows' tiles with vpdpbusd).
bool use_amx_bf16();
void set_use_amx(bool enabled);
// How the AVX-512 decode GEMV prefetches the panel ahead at one activation row: each block's share
// in one burst into L1 (prefetcht0), or spread between the block's dot products into L2 (prefetcht1,
// as at more rows and in the AVX2 variant). Bursts by default on AMD CPUs: on a Zen 5 guest the one-row
// GEMV reads memory faster that way (600 MB of 8192 x 3072 matrices per format, 2 threads, share of
// torch's 43-48 GB/s read, spread -> burst: Q4_K 81-85% -> 84-95%, Q6_K 73-80% -> 75-91%, Q4_0 79-96%
// -> 89-104%, Q8_0 86-93% -> 93-101%; a 3B Q4_K_M decode step 1.07x, a 1B Q8_0 one 1.14x), where a
// Sapphire Rapids core read slower with both bursts and prefetcht0 (BlockPrefetch). Either way the
// outputs are the same bits; tests and A/B runs set it.
bool use_burst_prefetch();
void set_burst_prefetch(bool enabled);
Isa isa_from_name(const std::string& name);

}  // namespace mindie::kernels::cpu
