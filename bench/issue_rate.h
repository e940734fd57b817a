// Launcher of the issue-rate microbenchmark (bench/issue_rate.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

namespace dsakit::bench {

// The instructions it times, each as its own SASS opcode (the FP8 kernels' widening and the
// integer / floating-point work beside it).
enum class IssueOp : int {
  kCvtE4m3,  // cvt.rn.f16x2.e4m3x2: F2FP.F16.E4M3.UNPACK_B, a pair of e4m3 codes to f16x2
  kFmul,     // mul.rn.f32: FMUL
  kHfma2,    // fma.rn.f16x2: HFMA2
  kPrmt,     // prmt.b32: PRMT
  kLop3,     // lop3.b32: LOP3
  kCvtLop3,  // half the chains kCvtE4m3, half kLop3: whether the two share an issue port
  kImad,     // mad.lo.u32: IMAD (the bit widening's shift compiles to IMAD.SHL.U32)
  kBits,     // a pair of e4m3 codes to f16x2 by bits: PRMT, IMAD.SHL, LOP3 (issue_rate.cu)
  kCvtBits,  // half the chains kCvtE4m3, half kBits: both widenings side by side
};
inline constexpr IssueOp kIssueOps[] = {IssueOp::kCvtE4m3, IssueOp::kFmul, IssueOp::kHfma2,
                                        IssueOp::kPrmt,    IssueOp::kLop3, IssueOp::kCvtLop3,
                                        IssueOp::kImad,    IssueOp::kBits, IssueOp::kCvtBits};
const char* issue_op_name(IssueOp op);
// Instructions a step of op's chains takes on average (kBits 3; kCvtBits 2; the rest 1): its
// rate in steps (pairs widened, for the widenings) is the instruction rate over this.
double issue_op_instructions(IssueOp op);

// Warp instructions one SM issues per clock when every warp runs op alone: one CTA per SM of
// 16 warps, each thread 8 independent chains of the instruction, timed by the SM's clock64.
// One value per CTA (per SM), in launch order; an error leaves the vector empty.
cudaError_t measure_issue_rate(IssueOp op, int num_sms, std::vector<double>& per_sm,
                               cudaStream_t stream);

}  // namespace dsakit::bench
