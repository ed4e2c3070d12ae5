#include <string>
#include <vector>

#include <pybind11/stl.h>

#include "bindings.h"
#include "cpu/dispatch.h"
#include "cpu/parallel.h"

namespace kc = mindie::kernels::cpu;

PYBIND11_MODULE(_C, m) {
  m.doc() = "mindie CPU kernels: paged attention, KV-cache writes, sampling, beam search, layers, encoder layers, token masks, "
           "quantized matmuls, the Llama forward step";
  mindie::host::bind_cache(m);
  mindie::host::bind_attention(m);
  mindie::host::bind_sampling(m);
  mindie::host::bind_beam(m);
  mindie::host::bind_layers(m);
  mindie::host::bind_linear(m);
  mindie::host::bind_token_mask(m);
  mindie::host::bind_quant(m);
  mindie::host::bind_forward(m);
  mindie::host::bind_moe(m);
  mindie::host::bind_encoder(m);

  m.def("set_num_threads", [](int n) {
    if (n < 1) throw pybind11::value_error("num_threads must be >= 1");
    kc::set_num_threads(n);
  }, pybind11::arg("num_threads"), "Sets the kernel thread pool size (independent of torch's).");
  m.def("get_num_threads", &kc::get_num_threads, "Threads the kernels run on, the caller included.");
  m.def("available_isas", [] {
    std::vector<std::string> names;
    for (kc::Isa isa : kc::available_isas()) names.emplace_back(kc::isa_name(isa));
    return names;
  }, "Kernel variants this build has and this CPU runs, best last.");
  m.def("cpu_features", [] {
    pybind11::dict d;
    d["avx512_bf16"] = kc::cpu_has_avx512_bf16();
    d["avx512_vnni"] = kc::cpu_has_avx512_vnni();
    d["avx_vnni"] = kc::cpu_has_avx_vnni();
    d["amx_bf16"] = kc::cpu_has_amx_bf16();
    return d;
  }, "Optional instructions the kernels use when the CPU has them (amx_bf16: and the OS grants the tiles).");
  m.def("set_amx", &kc::set_use_amx, pybind11::arg("enabled"),
        "Lets the AVX-512 variant use AMX-BF16 tiles where the CPU has them (the default): for bf16 rows, and "
        "for the exact span sums of int8 rows past the streaming ones; or not: tests compare the tiles with "
        "vdpbf16ps and vpdpbusd.");
  m.def("set_vnni", &kc::set_use_vnni, pybind11::arg("enabled"),
        "Lets the int8 dot products use VNNI where the CPU has it (the default: AVX512-VNNI in the AVX-512 "
        "variant, AVX-VNNI in the AVX2 one), or not: tests run the vpmaddubsw and vpmaddwd forms on such a CPU.");
  m.def("set_burst_prefetch", &kc::set_burst_prefetch, pybind11::arg("enabled"),
        "How the AVX-512 decode GEMV prefetches at one activation row: each block's share in one burst into L1 "
        "(True; the default on AMD CPUs) or spread into L2 (False; the default elsewhere). The outputs are the "
        "same bits either way.");
  m.def("burst_prefetch", &kc::use_burst_prefetch, "Whether the one-row decode GEMV bursts its prefetches (set_burst_prefetch).");
  m.def("get_isa", [] { return std::string(kc::isa_name(kc::active_isa())); }, "The active kernel variant.");
  m.def("set_isa", [](const std::string& name) {
    try {
      kc::set_active_isa(kc::isa_from_name(name));
    } catch (const std::invalid_argument& e) {
      throw pybind11::value_error(e.what());
    }
  }, pybind11::arg("name"), "Forces a kernel variant: 'scalar', 'avx2' or 'avx512'.");
}
