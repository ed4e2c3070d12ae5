// Panel packing (see quant.h): plain byte moves, once per matrix at load (and per panel where a
// matrix in the row layout is read).
#include <cstring>

#include "cpu/quant.h"

namespace mindie::kernels::cpu {
namespace {

// The offsets of a block's 2-byte header fields, in order; count says how many.
struct HeaderFields {
  int offset[2];
  int count;
};
constexpr HeaderFields header_fields(QFormat f) {
  switch (f) {
    case QFormat::kQ4_1: case QFormat::kQ5_1: case QFormat::kQ4_K: case QFormat::kQ5_K: return {{0, 2}, 2};
    case QFormat::kQ6_K: return {{208, 0}, 1};
    default: return {{0, 0}, 1};
  }
}

// Where Q5_0 / Q5_1 keep qh in a block, or -1.
constexpr int qh_offset(QFormat f) { return f == QFormat::kQ5_0 ? 2 : f == QFormat::kQ5_1 ? 4 : -1; }

// Copies row `lane`'s blocks from the row layout (row) into its panel.
void pack_row(const QMatrix& w, int lane, const uint8_t* row, uint8_t* panel) {
  const QFormatInfo info = qformat_info(static_cast<int>(w.format));
  const HeaderFields fields = header_fields(w.format);
  const int64_t units = w.cols / info.block_elems;
  const int run_bytes = packed_quant_bytes(w.format), qh = qh_offset(w.format);
  uint8_t* headers = panel + units * kPackRows * run_bytes;
  for (int64_t u = 0; u < units; ++u) {
    const uint8_t* block = row + u * info.block_bytes;
    uint8_t* runs = panel + u * kPackRows * run_bytes;
    uint8_t* fields_at = headers + u * kPackRows * packed_header_bytes(w.format);
    int field = 0, run = 0;
    for (int off = 0; off < info.block_bytes;) {
      if (field < fields.count && off == fields.offset[field]) {
        std::memcpy(fields_at + field * 2 * kPackRows + lane * 2, block + off, 2);
        ++field;
        off += 2;
        continue;
      }
      uint8_t* at = runs + packed_run(w.format, run) * 64 + lane * 4;
      if (off == qh) {
        uint32_t bits;
        std::memcpy(&bits, block + off, 4);
        bits = spread_qh(bits);
        std::memcpy(at, &bits, 4);
      } else {
        std::memcpy(at, block + off, 4);
      }
      ++run;
      off += 4;
    }
  }
}

}  // namespace

void pack_panels(const QMatrix& src, uint8_t* out) {
  const int64_t panel_bytes = kPackRows * src.row_bytes;
  std::memset(out, 0, packed_rows(src.rows) * src.row_bytes);
  for (int64_t r = 0; r < src.rows; ++r)
    pack_row(src, static_cast<int>(r % kPackRows), src.data + r * src.row_bytes, out + r / kPackRows * panel_bytes);
}

}  // namespace mindie::kernels::cpu
