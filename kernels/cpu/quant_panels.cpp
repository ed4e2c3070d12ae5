// Panel packing (see quant.h): plain byte moves, once per matrix at load and per row where a packed
// matrix is read a row at a time (embedding lookups, dequantization).
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

uint32_t unspread_qh(uint32_t spread) {
  uint32_t qh = 0;
  for (int i = 0; i < 4; ++i)
    for (int v = 0; v < 4; ++v) {
      qh |= ((spread >> (8 * i + v)) & 1u) << (4 * v + i);
      qh |= ((spread >> (8 * i + v + 4)) & 1u) << (16 + 4 * v + i);
    }
  return qh;
}

// Moves row `lane`'s blocks between the row layout (row) and its panel (panel): to the panel when
// `pack`, else back.
void move_row(const QMatrix& w, int lane, uint8_t* row, uint8_t* panel, bool pack) {
  const QFormatInfo info = qformat_info(static_cast<int>(w.format));
  const HeaderFields fields = header_fields(w.format);
  const int64_t units = w.cols / info.block_elems;
  const int run_bytes = packed_quant_bytes(w.format), qh = qh_offset(w.format);
  uint8_t* headers = panel + units * kPackRows * run_bytes;
  for (int64_t u = 0; u < units; ++u) {
    uint8_t* block = row + u * info.block_bytes;
    uint8_t* runs = panel + u * kPackRows * run_bytes;
    uint8_t* fields_at = headers + u * kPackRows * packed_header_bytes(w.format);
    int field = 0, run = 0;
    for (int off = 0; off < info.block_bytes;) {
      if (field < fields.count && off == fields.offset[field]) {
        uint8_t* at = fields_at + field * 2 * kPackRows + lane * 2;
        pack ? std::memcpy(at, block + off, 2) : std::memcpy(block + off, at, 2);
        ++field;
        off += 2;
        continue;
      }
      uint8_t* at = runs + run * 64 + lane * 4;
      if (off == qh) {
        uint32_t bits;
        std::memcpy(&bits, pack ? block + off : at, 4);
        bits = pack ? spread_qh(bits) : unspread_qh(bits);
        std::memcpy(pack ? at : block + off, &bits, 4);
      } else {
        pack ? std::memcpy(at, block + off, 4) : std::memcpy(block + off, at, 4);
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
    move_row(src, static_cast<int>(r % kPackRows), const_cast<uint8_t*>(src.data + r * src.row_bytes),
             out + r / kPackRows * panel_bytes, true);
}

void unpack_panel_row(const QMatrix& w, int64_t row, uint8_t* out) {
  uint8_t* panel = const_cast<uint8_t*>(w.data + row / kPackRows * kPackRows * w.row_bytes);
  move_row(w, static_cast<int>(row % kPackRows), out, panel, false);
}

}  // namespace mindie::kernels::cpu
