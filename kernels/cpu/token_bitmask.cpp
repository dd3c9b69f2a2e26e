// Grammar masks on logits: every token a row's bitmask does not allow gets -inf, in place, before
// sampling (structured output; kernels/token_bitmask.py states the contract, its _ref the meaning).
//
// Contract:
//   logits   f32 [R, V], contiguous rows
//   bitmask  i32 [N, W], contiguous, W >= ceil(V / 32): bit t % 32 of word t / 32 set = token t allowed
//   rows     i64 [N]: bitmask row i applies to logits row rows[i] (each in [0, R), distinct)
//   -> logits, with logits[rows[i], t] = -inf wherever bit t of bitmask[i] is clear
//
// How: a word with every bit set (a stretch of 32 allowed tokens) is skipped and one with none set is
// filled whole; in a grammar's mask most words are one or the other, so the work is a scan of V/32
// words, a vector fill per banned stretch and a store per banned token elsewhere.
// Rows are spread over the process's OpenMP team.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>

namespace {

void mask_row(float* row, const int32_t* words, int64_t vocab) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t w = 0; w * 32 < vocab; ++w) {
    const uint32_t allowed = static_cast<uint32_t>(words[w]);
    if (allowed == 0xffffffffu) continue;
    const int64_t base = w * 32, count = std::min<int64_t>(32, vocab - base);
    if (allowed == 0u) {                 // 32 banned tokens: one vector-wide fill
      std::fill_n(row + base, count, neg_inf);
      continue;
    }
    for (int64_t b = 0; b < count; ++b)
      if (!((allowed >> b) & 1u)) row[base + b] = neg_inf;
  }
}

at::Tensor apply_token_bitmask(at::Tensor logits, const at::Tensor& bitmask, const at::Tensor& rows) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.is_contiguous(),
              "logits must be contiguous f32 [R, V]");
  TORCH_CHECK(bitmask.scalar_type() == at::kInt && bitmask.dim() == 2 && bitmask.is_contiguous(),
              "bitmask must be contiguous i32 [N, W]");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.numel() == bitmask.size(0),
              "rows must be i64 [N], one per bitmask row");
  const int64_t vocab = logits.size(1), words = bitmask.size(1), n = rows.numel();
  TORCH_CHECK(words * 32 >= vocab, "a bitmask row of ", words, " words cannot cover ", vocab, " tokens");
  const int64_t* row_ids = rows.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(0 <= row_ids[i] && row_ids[i] < logits.size(0), "row ", row_ids[i], " is outside the logits");
  float* out = logits.data_ptr<float>();
  const int32_t* mask = bitmask.const_data_ptr<int32_t>();
  at::parallel_for(0, n, 1, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) mask_row(out + row_ids[i] * vocab, mask + i * words, vocab);
  });
  return logits;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmc, m) { m.def("apply_token_bitmask(Tensor(a!) logits, Tensor bitmask, Tensor rows) -> Tensor(a!)"); }

TORCH_LIBRARY_IMPL(llmc, CPU, m) { m.impl("apply_token_bitmask", &apply_token_bitmask); }
