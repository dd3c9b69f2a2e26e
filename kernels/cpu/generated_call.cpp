// The op-by-op launcher of generated CPU kernels (compiler/codegen/cpp.py writes them and states
// their ABI; kernels/generated.py builds and loads them).
//
// Contract: run_generated(fn, inputs, in_dtypes, out_widths, out_dtypes) -> outputs
//   fn          the address of a generated function (GeneratedLibrary.address)
//   inputs      the unit's inputs in unit order, CPU tensors of the in_dtypes its code was written
//               for: [rows, C] with contiguous rows (any row stride), every one with the rows of the
//               first; or [C] per-column vectors
//   out_widths, out_dtypes  the unit's outputs in unit order: each a fresh contiguous [rows, W]
//               tensor of that dtype, every row of it written by fn
// Rows are split across ATen's intra-op threads, each calling fn on its own range; fn computes a
// row the same way whatever the split, so a step plan calling the same fn gives the same bits.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

namespace {

using GeneratedFn = void (*)(char* const* ptrs, const int64_t* strides, int64_t first, int64_t last);

int64_t rows_of(const std::vector<at::Tensor>& inputs) {
  for (const at::Tensor& t : inputs)
    if (t.dim() == 2) return t.size(0);
  TORCH_CHECK(false, "a generated kernel needs a [rows, C] input to give it its rows");
}

std::vector<at::Tensor> run_generated(int64_t fn, std::vector<at::Tensor> inputs,
                                      std::vector<c10::ScalarType> in_dtypes, std::vector<int64_t> out_widths,
                                      std::vector<c10::ScalarType> out_dtypes) {
  TORCH_CHECK(fn != 0, "a generated kernel's address is null");
  TORCH_CHECK(inputs.size() == in_dtypes.size(), "a generated kernel takes ", in_dtypes.size(), " inputs, not ",
              inputs.size());
  TORCH_CHECK(out_widths.size() == out_dtypes.size() && !out_widths.empty(), "a generated kernel writes ",
              out_widths.size(), " outputs of ", out_dtypes.size(), " dtypes");
  const int64_t rows = rows_of(inputs);
  std::vector<char*> ptrs;
  std::vector<int64_t> strides;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const at::Tensor& t = inputs[i];
    TORCH_CHECK(t.device().is_cpu() && (t.dim() == 1 || t.dim() == 2), "input ", i,
                " of a generated kernel must be a 1-D or 2-D CPU tensor, not ", t.sizes());
    TORCH_CHECK(t.scalar_type() == in_dtypes[i], "input ", i, " of a generated kernel is ", t.scalar_type(),
                ", its code reads ", in_dtypes[i]);
    TORCH_CHECK(t.stride(-1) == 1 || t.size(-1) <= 1, "input ", i, " of a generated kernel has columns ",
                t.stride(-1), " elements apart; its rows must be contiguous");
    TORCH_CHECK(t.dim() == 1 || t.size(0) == rows, "input ", i, " of a generated kernel has ", t.size(0),
                " rows, not the ", rows, " of its first");
    ptrs.push_back(static_cast<char*>(const_cast<void*>(t.const_data_ptr())));
    strides.push_back(t.dim() == 2 ? t.stride(0) : 0);
  }
  std::vector<at::Tensor> outputs;
  for (size_t i = 0; i < out_widths.size(); ++i) {
    outputs.push_back(at::empty({rows, out_widths[i]}, at::TensorOptions().dtype(out_dtypes[i])));
    ptrs.push_back(static_cast<char*>(outputs.back().data_ptr()));
    strides.push_back(out_widths[i]);
  }
  const auto kernel = reinterpret_cast<GeneratedFn>(static_cast<intptr_t>(fn));
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) { kernel(ptrs.data(), strides.data(), begin, end); });
  return outputs;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmc, m) {
  m.def(
      "run_generated(int fn, Tensor[] inputs, ScalarType[] in_dtypes, int[] out_widths, ScalarType[] out_dtypes) "
      "-> Tensor[]");
}

TORCH_LIBRARY_IMPL(llmc, CPU, m) { m.impl("run_generated", &run_generated); }
