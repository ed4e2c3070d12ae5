// Dequantization a row at a time (embedding lookups, tests): each row read from its panel through
// the formats' one decoding (quant_decode.h), one row in plain integers (Lanes1).
#include <vector>

#include "cpu/parallel.h"
#include "cpu/quant.h"
#include "cpu/quant_decode.h"

namespace mindie::kernels::cpu {
namespace MINDIE_ISA_NS {
namespace {

template <QFormat F>
void dequantize_format(const DequantizeArgs& a) {
  constexpr int S = packed_unit(F).span_groups;
  const QMatrix& w = a.w;
  const int64_t blocks = w.cols / 32;
  parallel_for(a.num_rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> packed;  // a row of the row layout, packed as its own panel's row 0
    for (int64_t r = begin; r < end; ++r) {
      const int64_t row = a.row_ids != nullptr ? a.row_ids[r] : a.first_row + r;
      const uint8_t* panel = w.data + row / kPackRows * kPackRows * w.row_bytes;
      int lane = static_cast<int>(row % kPackRows);
      if (!w.panels) {
        packed.resize(kPackRows * w.row_bytes);
        pack_panels({w.data + row * w.row_bytes, 1, w.cols, w.row_bytes, F}, packed.data());
        panel = packed.data();
        lane = 0;
      }
      float* out = a.out + r * a.out_stride;
      for (int64_t b = 0; b < blocks; ++b)
        with_decoded_block<Lanes1, F>(panel, blocks, b, lane, [&](const Lanes1::I* u, const float* s, const float* o) {
          for (int v = 0; v < 8; ++v) {
            int8_t q[4];
            Lanes1::store(q, u[v]);
            const int span = S == 2 ? 0 : v / 4;
            // Exact: a scale has at most 18 significant bits and q at most 8 (as gguf computes it).
            for (int i = 0; i < 4; ++i) out[32 * b + 4 * v + i] = s[span] * static_cast<float>(q[i]) + o[span];
          }
        });
    }
  });
}

}  // namespace

void dequantize_rows(const DequantizeArgs& a) {
  with_format(a.w.format, [&](auto format) { dequantize_format<decltype(format)::value>(a); });
}

}  // namespace MINDIE_ISA_NS
}  // namespace mindie::kernels::cpu
