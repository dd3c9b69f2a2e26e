"""Hand-written Triton templates (GEMM with epilogue, RoPE + paged KV write, paged attention),
each beside the torch `_ref` it must match. Codegen (compiler/codegen/) instantiates them for a
fused group; the kernels run on a GPU, or on CPU tensors under `TRITON_INTERPRET=1`."""
