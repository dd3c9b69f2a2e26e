// A step plan's collectives (tensor parallelism: runtime/tensor_parallel/): all_reduce (a sum over
// the ranks) and all_gather (every rank's rows side by side, the last dim) through torch's c10d
// functional ops, `_c10d_functional::all_reduce_` / `all_gather_into_tensor` then `wait_tensor`,
// called through the dispatcher on the process group the plan was given by name (torch resolves
// it: gloo on a CPU). The team's first thread calls them while the others wait at the barrier after
// the instruction; a collective that fails (a rank gone, the group's timeout passed) returns its
// message instead of throwing, since nothing may throw out of the team's parallel region: the plan
// stops the team and raises it after the region.
//
// Contract: x and out are [rows, width] and [rows, width * size] (all_gather) or [rows, width]
// (all_reduce) in the plan's dtype, contiguous rows; every rank of the group runs the same plan on
// the same rows, so the collectives pair up in order.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <exception>
#include <string>
#include <utility>

namespace llmc_plan {

// The outputs of a c10d functional op called by its schema name (boxed: the stack holds its args,
// then its results).
inline at::Tensor call_c10d(const char* name, torch::jit::Stack stack) {
  const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
  op.callBoxed(&stack);
  return stack.back().toTensor();
}

inline at::Tensor wait_c10d(const at::Tensor& t) { return call_c10d("_c10d_functional::wait_tensor", {t}); }

// out = the sum over the group's ranks of x (out may be x); "" or the failure's message.
inline std::string plan_all_reduce(const at::Tensor& x, at::Tensor out, const std::string& group) {
  try {
    if (out.data_ptr() != x.data_ptr()) out.copy_(x);
    wait_c10d(call_c10d("_c10d_functional::all_reduce_", {out, std::string("sum"), group}));
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

// out [rows, size * width] = every rank's x [rows, width], in rank order; "" or the failure's message.
inline std::string plan_all_gather(const at::Tensor& x, at::Tensor out, int64_t size, const std::string& group) {
  try {
    const at::Tensor gathered = wait_c10d(call_c10d("_c10d_functional::all_gather_into_tensor", {x, size, group}));
    const int64_t rows = x.size(0), width = x.size(1);
    // [S * rows, W] -> [rows, S, W]: each row's parts side by side, in rank order
    out.view({rows, size, width}).copy_(gathered.view({size, rows, width}).transpose(0, 1));
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

}  // namespace llmc_plan
