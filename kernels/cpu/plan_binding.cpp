// A step plan's run as a plain Python function (pybind11), for runtime/step_plan.py's every step.
//
// The plan's TorchScript method (StepPlan.run, step_plan.cpp) boxes its arguments through the JIT's
// schema matching and returns through it: on the 2-core Xeon that cost ~40 us going in and ~37 us
// coming out of a batch-1 decode step, and ~145 and ~60 us once the step's weights had evicted the
// caches (a decode step's usual state: a few hundred cache lines of the JIT's code and data are
// read back from memory), about 6% of an int4 decode step. pybind11's conversion of the same
// tensor list takes ~5 and ~12 us warm, ~23 and ~23 us cold.
//
// run_plan(address, inputs, rows, seqs) runs the plan at `address` (StepPlan.address(): valid while
// that plan object lives; the Python StepPlanProgram holds both) without the GIL, as
// StepPlan.run would.

#include <torch/extension.h>

#include "step_plan_program.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def(
      "run_plan",
      [](int64_t address, std::vector<at::Tensor> inputs, int64_t rows, int64_t seqs) {
        return reinterpret_cast<llmc_plan::StepPlan*>(address)->run(std::move(inputs), rows, seqs);
      },
      pybind11::call_guard<pybind11::gil_scoped_release>());
}
