// GEMV and GEMM over int8 / int4 weights with int8 activations: out = x @ w.T (+ bias), x quantized
// per token per block of 32 inputs, integer dot products, one scale multiply per block.
//
// Contract (the meaning of kernels/quant.py's qlinear_int8act_ref on the weight the panels hold):
//   x       [T, K] f32 or bf16, K a multiple of 32: per block of 32, d = max|x| / 127 (fp32),
//           codes round(x * (1 / d)) in -127..127 (ties to even; 0 where d is 0)
//   codes   uint8 quads: int8 [P, K/4, 32, 4], byte [p, i, j, r] = code of input 4i + r of row
//           32p + j, plus 128; int4 [P, K/8, 32, 4], byte [p, i, j, r] holds input 8i + r of row
//           32p + j in its low nibble and input 8i + 4 + r in its high (kernels/panels.py)
//   scales  f16 [P, K/G, 32]; mins (int4) the same layout; G a multiple of 32 dividing K
//   n       N (32 (P - 1) < N <= 32 P), bias [N] in x's dtype or undefined (added in fp32)
//   vnni    the CPU's integer dot products: AMX-INT8 tiles from llmc_amx_int8::kMinTokens tokens where
//           usable (amx_qgemm.h), else AVX512-VNNI where this build has it; false: the portable
//           integer dots (the same numbers on every path)
//   prompts (with vnni) 0: int8 activations at every token count; 1 (bf16 prompts): from
//           llmc_amx_dq::kMinTokens tokens where AMX-BF16 is usable, x rounded to bf16 times the weight
//           dequantized to bf16 instead (amx_dequant_gemm.h's contract); 2 (f32 prompts): from
//           llmc_f32_dq::kMinTokens tokens x times the weight dequantized to fp32 (f32_dequant_gemm.h's)
//   -> out  [T, N] in x's dtype: per block the exact int32 dot of the codes, times d in fp32,
//           summed over the group's blocks, times the group's scale; int4 adds min x the group's
//           sum of d x (the block's code sum); rounded once.
// qdot_isa() names the integer path `vnni` selects in this build below AMX's token count;
// cpu_qgemm_path() -> ("amx-int8", "") or (qdot_isa(), why AMX-INT8 is not taken);
// amx_qdot_gemm(x, codes, scales, mins, n, bias, bits, group_size) the same contract, always on AMX
// tiles (at every token count; an error where AMX-INT8 is not usable): the AMX kernel's own check;
// amx_bf16_qgemm(x, codes, scales, mins, n, bias, bits, group_size) amx_dequant_gemm.h's contract at
// every token count (an error where AMX-BF16 is not usable); cpu_prompt_qgemm_path() -> ("amx-bf16",
// "") or ("", why a prompt's quads GEMM keeps int8 activations).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <string>
#include <tuple>

#include "amx_dequant_gemm.h"
#include "amx_qgemm.h"
#include "f32_dequant_gemm.h"
#include "qweight_checks.h"

namespace {

using llmc_panels::kPanel;
using llmc_qdot::kBlock;

// kChosen: qdot_range's choice (AMX-INT8 or VNNI); kPrompts: bf16 where use_bf16, else kChosen's;
// kF32Prompts: fp32 where use_f32, else kChosen's
enum class Path { kPortable, kChosen, kAmx, kPrompts, kAmxBf16, kF32Prompts };

template <int Bits, typename Out>
void run_typed(const llmc_qdot::QActs& q, const llmc_qdot::QuadPanels& w, int64_t tokens, int64_t num_panels,
               int64_t n_dim, const at::Tensor& bias, at::Tensor& out, Path path) {
  const Out* b = bias.defined() ? bias.const_data_ptr<Out>() : nullptr;
  Out* o = out.data_ptr<Out>();
  at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
#if defined(__x86_64__)
    if (path == Path::kAmx) return llmc_amx_int8::gemm_range<Bits>(q, w, tokens, b, o, n_dim, begin, end);
#endif
    llmc_amx_int8::qdot_range<Bits>(q, w, tokens, b, o, n_dim, begin, end, path == Path::kChosen);
  });
}

// x rounded to bf16, then each thread's panels dequantized and multiplied (amx_dequant_gemm.h).
template <int Bits, typename Out>
void run_bf16(const at::Tensor& x, const llmc_qdot::QuadPanels& w, int64_t num_panels, int64_t n_dim,
              const at::Tensor& bias, at::Tensor& out) {
  const int64_t tokens = x.size(0), k_dim = x.size(1);
  at::Tensor xb = x.scalar_type() == at::kBFloat16 ? x : at::empty({tokens, k_dim}, x.options().dtype(at::kBFloat16));
  auto* xbp = xb.data_ptr<c10::BFloat16>();
  if (x.scalar_type() == at::kFloat)
    at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
      llmc_amx_dq::round_rows(x.const_data_ptr<float>(), xbp, k_dim, begin, end);
    });
  const Out* b = bias.defined() ? bias.const_data_ptr<Out>() : nullptr;
  Out* o = out.data_ptr<Out>();
#if defined(__x86_64__)
  const int64_t elems = llmc_amx_dq::scratch_elems(k_dim);
  at::Tensor scratch = at::empty({at::get_num_threads() * elems}, x.options().dtype(at::kBFloat16));
  at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
    auto* panels = scratch.data_ptr<c10::BFloat16>() + at::get_thread_num() * elems;
    llmc_amx_dq::gemm_range<Bits>(xbp, w, tokens, b, o, n_dim, begin, end, panels);
  });
#endif
}

// x as fp32, then each thread's panels dequantized to fp32 and multiplied (f32_dequant_gemm.h).
template <int Bits, typename Out>
void run_f32(const at::Tensor& x, const llmc_qdot::QuadPanels& w, int64_t num_panels, int64_t n_dim,
             const at::Tensor& bias, at::Tensor& out) {
  const at::Tensor xf = x.to(at::kFloat);
  const float* xp = xf.const_data_ptr<float>();
  const Out* b = bias.defined() ? bias.const_data_ptr<Out>() : nullptr;
  Out* o = out.data_ptr<Out>();
  const int64_t floats = llmc_f32_dq::scratch_floats(x.size(1));
  at::Tensor scratch = at::empty({at::get_num_threads() * floats}, xf.options());
  at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
    float* panels = scratch.data_ptr<float>() + at::get_thread_num() * floats;
    llmc_f32_dq::gemm_range<Bits>(xp, w, x.size(0), b, o, n_dim, begin, end, panels);
  });
}

template <typename X>
void quantize(const at::Tensor& x, const llmc_qdot::QActs& q) {
  const X* xp = x.const_data_ptr<X>();
  at::parallel_for(0, x.size(0), 16, [&](int64_t begin, int64_t end) { llmc_qdot::quantize_rows(xp, q, begin, end); });
}

void check_inputs(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                  const std::optional<at::Tensor>& mins, int64_t n_dim, const at::Tensor& bias, int64_t bits,
                  int64_t group) {
  TORCH_CHECK(bits == 8 || bits == 4, "bits must be 8 or 4, not ", bits);
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be a [T, K] f32 or bf16 tensor");
  const int64_t k_dim = x.size(1), panels = codes.size(0), per_quad = bits == 8 ? 4 : 8;
  TORCH_CHECK(codes.dim() == 4 && codes.is_contiguous() && codes.scalar_type() == at::kByte &&
                  codes.size(2) == kPanel && codes.size(3) == 4 && codes.size(1) * per_quad == k_dim,
              "codes must be contiguous uint8 [P, K/", per_quad, ", 32, 4] for K=", k_dim, ", not ", codes.sizes());
  TORCH_CHECK(group > 0 && k_dim % group == 0 && group % kBlock == 0, "group size ", group, " must divide K=", k_dim,
              " and be a multiple of 32");
  llmc_qweights::check_panel_params(x, scales, mins, bias, n_dim, panels, k_dim / group, bits);
}

at::Tensor run(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scales,
               const std::optional<at::Tensor>& mins, int64_t n_dim, const std::optional<at::Tensor>& bias_opt,
               int64_t bits, int64_t group, Path path) {
  const at::Tensor bias = bias_opt.value_or(at::Tensor());
  check_inputs(x_in, codes, scales, mins, n_dim, bias, bits, group);
  const at::Tensor x = x_in.contiguous();
  const int64_t tokens = x.size(0), k_dim = x.size(1), panels = codes.size(0);
  const llmc_qdot::QuadPanels w{codes.const_data_ptr<uint8_t>(), scales.const_data_ptr<c10::Half>(),
                                bits == 4 ? mins->const_data_ptr<c10::Half>() : nullptr, k_dim, group,
                                k_dim / group};
  const bool f32 = x.scalar_type() == at::kFloat;
  at::Tensor out = at::empty({tokens, n_dim}, x.options());
  if (path == Path::kAmxBf16 || (path == Path::kPrompts && llmc_amx_dq::use_bf16(tokens, true))) {
    const auto call = bits == 8 ? (f32 ? run_bf16<8, float> : run_bf16<8, c10::BFloat16>)
                                : (f32 ? run_bf16<4, float> : run_bf16<4, c10::BFloat16>);
    call(x, w, panels, n_dim, bias, out);
    return out;
  }
  if (path == Path::kF32Prompts && llmc_f32_dq::use_f32(tokens, true)) {
    const auto call = bits == 8 ? (f32 ? run_f32<8, float> : run_f32<8, c10::BFloat16>)
                                : (f32 ? run_f32<4, float> : run_f32<4, c10::BFloat16>);
    call(x, w, panels, n_dim, bias, out);
    return out;
  }
  if (path == Path::kPrompts || path == Path::kF32Prompts) path = Path::kChosen;
  at::Tensor scratch = at::empty({tokens * llmc_qdot::qacts_bytes_per_row(k_dim)}, x.options().dtype(at::kByte));
  const llmc_qdot::QActs q = llmc_qdot::qacts_in(static_cast<char*>(scratch.data_ptr()), tokens, k_dim);
  f32 ? quantize<float>(x, q) : quantize<c10::BFloat16>(x, q);
  if (bits == 8 && f32)
    run_typed<8, float>(q, w, tokens, panels, n_dim, bias, out, path);
  else if (bits == 8)
    run_typed<8, c10::BFloat16>(q, w, tokens, panels, n_dim, bias, out, path);
  else if (f32)
    run_typed<4, float>(q, w, tokens, panels, n_dim, bias, out, path);
  else
    run_typed<4, c10::BFloat16>(q, w, tokens, panels, n_dim, bias, out, path);
  return out;
}

at::Tensor qdot_gemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                     const std::optional<at::Tensor>& mins, int64_t n_dim, const std::optional<at::Tensor>& bias,
                     int64_t bits, int64_t group, bool vnni, int64_t prompts) {
  TORCH_CHECK(prompts >= 0 && prompts <= 2, "prompts must be 0 (int8), 1 (bf16) or 2 (f32), not ", prompts);
  const Path path = !vnni ? Path::kPortable : prompts == 1 ? Path::kPrompts : prompts == 2 ? Path::kF32Prompts
                                                                                           : Path::kChosen;
  return run(x, codes, scales, mins, n_dim, bias, bits, group, path);
}

at::Tensor amx_qdot_gemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                         const std::optional<at::Tensor>& mins, int64_t n_dim, const std::optional<at::Tensor>& bias,
                         int64_t bits, int64_t group) {
  TORCH_CHECK(llmc_amx::int8_support().usable, "AMX-INT8 is not usable here: ", llmc_amx::int8_support().why);
  return run(x, codes, scales, mins, n_dim, bias, bits, group, Path::kAmx);
}

at::Tensor amx_bf16_qgemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                          const std::optional<at::Tensor>& mins, int64_t n_dim, const std::optional<at::Tensor>& bias,
                          int64_t bits, int64_t group) {
  TORCH_CHECK(llmc_amx::support().usable, "AMX-BF16 is not usable here: ", llmc_amx::support().why);
  return run(x, codes, scales, mins, n_dim, bias, bits, group, Path::kAmxBf16);
}

std::tuple<std::string, std::string> cpu_prompt_qgemm_path() {
  auto [path, why] = llmc_amx_dq::prompt_path();
  return {path, why};
}

std::tuple<std::string, std::string> cpu_qgemm_path() {
  auto [path, why] = llmc_amx_int8::qgemm_path();
  return {path, why};
}

std::string qdot_isa() { return llmc_qdot::kDotIsa; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmc, m) {
  m.def("qdot_gemm(Tensor x, Tensor codes, Tensor scales, Tensor? mins, int n, Tensor? bias, int bits, "
        "int group_size, bool vnni, int prompts=0) -> Tensor");
  m.def("amx_qdot_gemm(Tensor x, Tensor codes, Tensor scales, Tensor? mins, int n, Tensor? bias, int bits, "
        "int group_size) -> Tensor");
  m.def("amx_bf16_qgemm(Tensor x, Tensor codes, Tensor scales, Tensor? mins, int n, Tensor? bias, int bits, "
        "int group_size) -> Tensor");
  m.def("qdot_isa() -> str", &qdot_isa);
  m.def("cpu_prompt_qgemm_path() -> (str, str)", &cpu_prompt_qgemm_path);
  m.def("cpu_qgemm_path() -> (str, str)", &cpu_qgemm_path);
}

TORCH_LIBRARY_IMPL(llmc, CPU, m) {
  m.impl("qdot_gemm", &qdot_gemm);
  m.impl("amx_qdot_gemm", &amx_qdot_gemm);
  m.impl("amx_bf16_qgemm", &amx_bf16_qgemm);
}
