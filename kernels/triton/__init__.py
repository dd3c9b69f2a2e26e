"""Hand-written Triton templates, each beside the torch `_ref` it must match; codegen
(compiler/codegen/) instantiates them for a fused group. The kernels run on a GPU, or on CPU
tensors under `TRITON_INTERPRET=1`.

  gemm.py                      GEMM with a fused epilogue (bias, SiLU or gated SiLU*mul, residual)
  qgemm.py                     the same GEMM on int8 / int4 weight codes, scaled once per K tile
  rope_kv_write.py             RoPE of q and k fused with the paged K/V write (float or int8 cache)
  paged_decode_attention.py    one query per sequence, GQA, split-K over the context (flash-decoding)
  paged_prefill_attention.py   variable-length causal attention of a mixed step, K/V via block tables
  paged_kv.py                  the paged-cache contract and tile helpers both attention kernels share
  gather.py                    row gather (embedding, index_select)
  qembedding.py                row gather of a quantized table, dequantized (qembedding)
  aot_compile.py               compiles every template, and an artifact's generated kernels, for sm_90
                               in fp16/bf16/fp32 without a GPU (a CLI; the launchers on meta tensors)
"""
