#include <stdexcept>
#include <string>

#include "cpu/quant.h"

namespace mindie::kernels::cpu {

QFormatInfo qformat_info(int ggml_type) {
  switch (static_cast<QFormat>(ggml_type)) {
    case QFormat::kQ4_0: return {32, 18, false};
    case QFormat::kQ4_1: return {32, 20, false};
    case QFormat::kQ5_0: return {32, 22, false};
    case QFormat::kQ5_1: return {32, 24, false};
    case QFormat::kQ8_0: return {32, 34, true};
    case QFormat::kQ4_K: return {256, 144, false};
    case QFormat::kQ5_K: return {256, 176, false};
    case QFormat::kQ6_K: return {256, 210, false};
  }
  throw std::invalid_argument("ggml type " + std::to_string(ggml_type) +
                              " is not a supported quantized format (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)");
}

}  // namespace mindie::kernels::cpu
