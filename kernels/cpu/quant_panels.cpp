// Panel packing (see quant.h): plain byte moves, once per matrix at load and per row where a packed
// matrix is read a row at a time (embedding lookups, dequantization).
#include <cstring>
#include <stdexcept>

#include "cpu/quant.h"

namespace mindie::kernels::cpu {
namespace {

// Where row `lane` of a panel keeps block b's quants and header fields, given the panel's start.
struct PanelBlock {
  const QMatrix& w;
  int64_t blocks() const { return w.cols / 32; }
  int64_t quant_at(int64_t b, int lane, int run_byte) const {
    const int64_t run = run_byte / 4;
    return b * kPackRows * packed_quant_bytes(w.format) + run * 64 + lane * 4 + run_byte % 4;
  }
  // Field f (0: d, 1: Q4_1's m) of block b's header, 2 bytes.
  int64_t header_at(int64_t b, int lane, int field) const {
    return blocks() * kPackRows * packed_quant_bytes(w.format) + b * kPackRows * packed_header_bytes(w.format) +
           field * 2 * kPackRows + lane * 2;
  }
};

}  // namespace

void pack_panels(const QMatrix& src, uint8_t* out) {
  if (!packs_in_panels(src.format)) throw std::invalid_argument("pack_panels: only Q4_0, Q4_1 and Q8_0 pack in panels");
  const int header = packed_header_bytes(src.format), quants = packed_quant_bytes(src.format);
  const int64_t block_bytes = header + quants, panel_bytes = kPackRows * src.row_bytes;
  const PanelBlock at{src};
  std::memset(out, 0, packed_rows(src.rows) * src.row_bytes);
  for (int64_t r = 0; r < src.rows; ++r) {
    uint8_t* panel = out + r / kPackRows * panel_bytes;
    const int lane = static_cast<int>(r % kPackRows);
    for (int64_t b = 0; b < at.blocks(); ++b) {
      const uint8_t* block = src.data + r * src.row_bytes + b * block_bytes;
      for (int f = 0; f < header / 2; ++f) std::memcpy(panel + at.header_at(b, lane, f), block + 2 * f, 2);
      for (int i = 0; i < quants; i += 4) std::memcpy(panel + at.quant_at(b, lane, i), block + header + i, 4);
    }
  }
}

void unpack_panel_row(const QMatrix& w, int64_t row, uint8_t* out) {
  const int header = packed_header_bytes(w.format), quants = packed_quant_bytes(w.format);
  const int64_t block_bytes = header + quants;
  const uint8_t* panel = w.data + row / kPackRows * kPackRows * w.row_bytes;
  const int lane = static_cast<int>(row % kPackRows);
  const PanelBlock at{w};
  for (int64_t b = 0; b < at.blocks(); ++b) {
    uint8_t* block = out + b * block_bytes;
    for (int f = 0; f < header / 2; ++f) std::memcpy(block + 2 * f, panel + at.header_at(b, lane, f), 2);
    for (int i = 0; i < quants; i += 4) std::memcpy(block + header + i, panel + at.quant_at(b, lane, i), 4);
  }
}

}  // namespace mindie::kernels::cpu
