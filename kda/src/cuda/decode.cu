// kda::decode_cuda: the decode step (decode_kernel.cuh) storing its out.
#include "cuda/decode_kernel.cuh"
#include "kda/nvtx.hpp"

namespace kda {

Status decode_cuda(const DecodeProblem& p, const DecodeTensors& t, void* stream_ptr,
                   const CudaOptions& opt) {
  KDA_NVTX_RANGE("kda.decode");
  return detail::launch_decode(p, t, stream_ptr, opt, detail::StoreOut{});
}

}  // namespace kda
