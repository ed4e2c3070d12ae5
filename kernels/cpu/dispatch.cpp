#include "cpu/dispatch.h"

#include <atomic>
#include <cstdlib>
#include <stdexcept>

#if defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "cpu/beam_search.h"
#include "cpu/dot_peak.h"
#include "cpu/encoder_layers.h"
#include "cpu/kv_cache.h"
#include "cpu/layers.h"
#include "cpu/linear.h"
#include "cpu/moe.h"
#include "cpu/paged_attention.h"
#include "cpu/quant.h"
#include "cpu/sampling.h"
#include "cpu/token_mask.h"

#ifndef MINDIE_HAVE_AVX2
#define MINDIE_HAVE_AVX2 0
#endif
#ifndef MINDIE_HAVE_AVX512
#define MINDIE_HAVE_AVX512 0
#endif
#ifndef MINDIE_HAVE_AVX512_BF16
#define MINDIE_HAVE_AVX512_BF16 0
#endif
#ifndef MINDIE_HAVE_AMX_BF16
#define MINDIE_HAVE_AMX_BF16 0
#endif

namespace mindie::kernels::cpu {

#define MINDIE_ALL_KERNELS(X)  \
  MINDIE_KV_CACHE_KERNELS(X)   \
  MINDIE_ATTENTION_KERNELS(X)  \
  MINDIE_SAMPLING_KERNELS(X)   \
  MINDIE_BEAM_SEARCH_KERNELS(X) \
  MINDIE_LAYER_KERNELS(X)       \
  MINDIE_ENCODER_KERNELS(X)     \
  MINDIE_MOE_KERNELS(X)         \
  MINDIE_LINEAR_KERNELS(X)       \
  MINDIE_QUANT_KERNELS(X)        \
  MINDIE_TOKEN_MASK_KERNELS(X)   \
  MINDIE_DOT_PEAK_KERNELS(X)

#define MINDIE_DECLARE(name, Args) void name(const Args&);
namespace isa_scalar { MINDIE_ALL_KERNELS(MINDIE_DECLARE) }
#if MINDIE_HAVE_AVX2
namespace isa_avx2 { MINDIE_ALL_KERNELS(MINDIE_DECLARE) }
#endif
#if MINDIE_HAVE_AVX512
namespace isa_avx512 { MINDIE_ALL_KERNELS(MINDIE_DECLARE) }
#endif

namespace {

bool cpu_supports(Isa isa) {
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  switch (isa) {
    case Isa::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
             __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case Isa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c") && __builtin_cpu_supports("bmi2");
    case Isa::kScalar:
      return true;
  }
  return false;
#else
  return isa == Isa::kScalar;
#endif
}

bool compiled(Isa isa) {
  switch (isa) {
    case Isa::kScalar: return true;
    case Isa::kAvx2: return MINDIE_HAVE_AVX2 != 0;
    case Isa::kAvx512: return MINDIE_HAVE_AVX512 != 0;
  }
  return false;
}

Isa detect() {
  Isa best = Isa::kScalar;
  for (Isa isa : available_isas()) best = isa;
  if (const char* forced = std::getenv("MINDIE_ISA"); forced != nullptr && *forced != '\0') {
    Isa want = isa_from_name(forced);  // an unknown name is an error worth seeing at import
    for (Isa isa : available_isas())
      if (isa == want) return want;
  }
  return best;
}

std::atomic<Isa>& active() {
  static std::atomic<Isa> isa{detect()};
  return isa;
}

}  // namespace

std::vector<Isa> available_isas() {
  std::vector<Isa> out;
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512})
    if (compiled(isa) && cpu_supports(isa)) out.push_back(isa);
  return out;
}

bool cpu_has_avx512_bf16() {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") != 0;
  }();
  return has;
#else
  return false;
#endif
}

bool cpu_has_avx512_vnni() {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vnni") != 0;
  }();
  return has;
#else
  return false;
#endif
}

bool cpu_has_avx_vnni() {
#if defined(__x86_64__) && defined(__linux__)
  static const bool has = [] {
    // CPUID.(EAX=7, ECX=1):EAX bit 4, and the OS saving the ymm state (as for AVX2).
    unsigned eax, ebx, ecx, edx;
    __builtin_cpu_init();
    return __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) && (eax & (1u << 4)) != 0 &&
           __builtin_cpu_supports("avx2") != 0;
  }();
  return has;
#else
  return false;
#endif
}

bool cpu_has_amx_bf16() {
#if MINDIE_HAVE_AMX_BF16 && defined(__x86_64__) && defined(__linux__)
  static const bool has = [] {
    unsigned eax, ebx, ecx, edx;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    constexpr unsigned kAmxBf16 = 1u << 22, kAmxTile = 1u << 24;
    if ((edx & (kAmxBf16 | kAmxTile)) != (kAmxBf16 | kAmxTile) || !cpu_has_avx512_bf16()) return false;
    // Linux enables the 8 KiB tile data state per process, on request; a VM or kernel without it
    // refuses, and the tiles would then fault.
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return has;
#else
  return false;
#endif
}

namespace {
std::atomic<bool> g_vnni_enabled{true};
std::atomic<bool> g_amx_enabled{true};
}  // namespace

bool use_avx512_vnni() { return cpu_has_avx512_vnni() && g_vnni_enabled.load(std::memory_order_relaxed); }
bool use_avx_vnni() { return cpu_has_avx_vnni() && g_vnni_enabled.load(std::memory_order_relaxed); }
void set_use_vnni(bool enabled) { g_vnni_enabled.store(enabled, std::memory_order_relaxed); }
bool use_amx_bf16() { return cpu_has_amx_bf16() && g_amx_enabled.load(std::memory_order_relaxed); }
void set_use_amx(bool enabled) { g_amx_enabled.store(enabled, std::memory_order_relaxed); }

namespace {
std::atomic<bool>& burst_prefetch() {
  static std::atomic<bool> enabled{[] {
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    return __builtin_cpu_is("amd") != 0;
#else
    return false;
#endif
  }()};
  return enabled;
}
}  // namespace

bool use_burst_prefetch() { return burst_prefetch().load(std::memory_order_relaxed); }
void set_burst_prefetch(bool enabled) { burst_prefetch().store(enabled, std::memory_order_relaxed); }

Isa active_isa() { return active().load(std::memory_order_relaxed); }

bool qmatmul_bf16_native() {
#if MINDIE_HAVE_AVX512_BF16
  return active_isa() == Isa::kAvx512 && cpu_has_avx512_bf16();
#else
  return false;
#endif
}

void set_active_isa(Isa isa) {
  for (Isa ok : available_isas())
    if (ok == isa) {
      active().store(isa, std::memory_order_relaxed);
      return;
    }
  throw std::invalid_argument(std::string("ISA variant not available on this CPU/build: ") + isa_name(isa));
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kScalar: return "scalar";
    case Isa::kAvx2: return "avx2";
    case Isa::kAvx512: return "avx512";
  }
  return "unknown";
}

Isa isa_from_name(const std::string& name) {
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512})
    if (name == isa_name(isa)) return isa;
  throw std::invalid_argument("unknown ISA variant '" + name + "' (expected scalar, avx2 or avx512)");
}

#if MINDIE_HAVE_AVX512
#define MINDIE_CASE_AVX512(name) case Isa::kAvx512: return isa_avx512::name(args);
#else
#define MINDIE_CASE_AVX512(name)
#endif
#if MINDIE_HAVE_AVX2
#define MINDIE_CASE_AVX2(name) case Isa::kAvx2: return isa_avx2::name(args);
#else
#define MINDIE_CASE_AVX2(name)
#endif

#define MINDIE_DISPATCH(name, Args)    \
  void name(const Args& args) {        \
    switch (active_isa()) {            \
      MINDIE_CASE_AVX512(name)         \
      MINDIE_CASE_AVX2(name)           \
      default: return isa_scalar::name(args); \
    }                                  \
  }
MINDIE_ALL_KERNELS(MINDIE_DISPATCH)

}  // namespace mindie::kernels::cpu
