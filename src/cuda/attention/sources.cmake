# CUDA attention kernels (sparse MLA, dense MHA) and the dense schedule (host), appended to
# DSAKIT_CUDA_ATTENTION_SOURCES, which src/cuda/CMakeLists.txt compiles into dsakit_cuda. One
# explicit instantiation per file.
set(_dsakit_attention_dir ${CMAKE_CURRENT_LIST_DIR}/..)
list(APPEND DSAKIT_CUDA_ATTENTION_SOURCES
  ${_dsakit_attention_dir}/attention/attention_ops.cu
  ${_dsakit_attention_dir}/sm90/prefill/sparse_mla/instantiations/h16_bf16.cu
  ${_dsakit_attention_dir}/sm90/prefill/sparse_mla/instantiations/h16_fp8.cu
  ${_dsakit_attention_dir}/sm90/prefill/sparse_mla/instantiations/h16_fp8raw.cu
  ${_dsakit_attention_dir}/sm90/prefill/sparse_mla/instantiations/h64_bf16.cu
  ${_dsakit_attention_dir}/sm90/prefill/sparse_mla/instantiations/h64_fp8.cu
  ${_dsakit_attention_dir}/sm90/prefill/sparse_mla/instantiations/h64_fp8raw.cu
  ${_dsakit_attention_dir}/sm90/prefill/dense_mha/dense_mha_schedule.cc
  ${_dsakit_attention_dir}/sm90/prefill/dense_mha/instantiations/nope128_rope64_v128.cu
  ${_dsakit_attention_dir}/sm90/prefill/dense_mha/instantiations/nope192_rope64_v128.cu
  ${_dsakit_attention_dir}/sm90/prefill/dense_mha/instantiations/nope192_rope64_v256.cu)
unset(_dsakit_attention_dir)
