// CUDA graphs: a graph-captured prefill, and a graph of decode steps, equal the same calls run
// eagerly, bitwise (the operator must neither allocate nor synchronize inside a capture).
#include <doctest/doctest.h>

#include <cstring>
#include <vector>

#include "backend_matrix.hpp"
#include "cases.hpp"

#ifdef KDA_HAVE_CUDA
#include <cuda_runtime.h>
#endif

using namespace kda;
using namespace kda::test;

#ifdef KDA_HAVE_CUDA
namespace {

// Captures one forward of `o`'s case in a graph, replays it, and compares with the eager run.
void check_graph_equals_eager(Runner& cuda, const CaseOptions& o) {
  const KdaCase c = make_case(o);
  const PrefillRun eager = cuda.prefill(c);
  REQUIRE(eager.status.ok());

  DeviceCase d(c);
  DeviceBuffer out(static_cast<std::size_t>(c.out_elems()) * 2),
      ht(static_cast<std::size_t>(c.state_elems()) * 4);  // poisoned before each replay (below)
  std::size_t ws_bytes = 0;
  REQUIRE(workspace_size(c.problem, Backend::kCuda, &ws_bytes).ok());
  DeviceBuffer ws(ws_bytes);
  Tensors t = d.tensors();
  // As the eager run (backend_matrix.hpp): with the host copy the launcher plans from the real
  // lengths, without it from the total, and another plan may differ in the last bits.
  t.cu_seqlens_host = c.cu_seqlens_ptr();
  t.out = out.get();
  t.final_state = ht.get();
  REQUIRE(stream_synchronize(nullptr).ok());
  cudaStream_t s;
  REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess);
  cudaGraph_t graph;
  REQUIRE(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
  const Status st = forward_cuda(c.problem, t, {ws.get(), ws.bytes()}, s);
  REQUIRE(cudaStreamEndCapture(s, &graph) == cudaSuccess);
  REQUIRE_MESSAGE(st.ok(), st.to_string());
  cudaGraphExec_t exec;
  REQUIRE(cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess);
  // Two replays, each after the outputs and the workspace were overwritten (0xFF: NaN in bf16 and
  // f32; 0x7F: 3.4e38 in both), as a runtime's arena holds whatever the layer before left: a
  // replay must read no workspace byte it did not write.
  for (const unsigned char poison : {0xFF, 0x7F}) {
    CAPTURE(static_cast<int>(poison));
    out.fill(poison);
    ht.fill(poison);
    ws.fill(poison);
    REQUIRE(cudaGraphLaunch(exec, s) == cudaSuccess);
    REQUIRE(cudaStreamSynchronize(s) == cudaSuccess);
    CHECK(out.download<std::uint16_t>() == eager.out.out);
    const auto state = ht.download<float>();
    // Where they differ, if they do: the count and the first element (for the failure message).
    std::size_t differing = 0, first = 0;
    for (std::size_t i = 0; i < state.size(); ++i) {
      if (std::memcmp(&state[i], &eager.out.final_f32[i], 4) != 0 && differing++ == 0) first = i;
    }
    CHECK_MESSAGE(differing == 0, differing
                                      << " of " << state.size() << " state elements differ; the "
                                      << "first, element " << first << ": graph " << state[first]
                                      << ", eager " << eager.out.final_f32[first]);
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(s);
}

}  // namespace
#endif

KDA_CUDA_CASE("prefill: a graph-captured forward equals the eager one bitwise") {
#ifdef KDA_HAVE_CUDA
  CaseOptions o = cuda_options(16, 700);
  o.lengths = {300, 1, 129};
  o.cu_seqlens_dtype = DType::kI32;
  check_graph_equals_eager(cuda, o);
#endif
}

KDA_CUDA_CASE("prefill: a graph-captured pipelined forward equals the eager one bitwise") {
#ifdef KDA_HAVE_CUDA
  // prefill.cu's pipelined path on 128 SMs or more: its memset, the persistent prepare grid and
  // the recurrence launched as its programmatic dependent, all captured.
  CaseOptions o = cuda_options(32, 701);
  o.seq_len = 1500;
  o.gate = GateMode::kLowerBound;
  check_graph_equals_eager(cuda, o);
#endif
}

KDA_CUDA_CASE("decode: a graph of decode steps equals the same steps run eagerly") {
#ifdef KDA_HAVE_CUDA
  const DecodeCase d = make_decode_case(9, 2, 4, 12, DType::kF32, GateMode::kSoftplus, 3000);
  const DecodeRun eager = cuda.decode(d, 3);
  REQUIRE(eager.status.ok());
  REQUIRE(eager.guards_intact);
  DeviceCase dc(d.tokens);
  DeviceBuffer slots = DeviceBuffer::from(d.slots);
  DeviceBuffer pool = DeviceBuffer::from(pool_bytes(d));
  DeviceBuffer out(static_cast<std::size_t>(d.tokens.out_elems()) * 2);
  out.fill(0xFF);
  REQUIRE(stream_synchronize(nullptr).ok());
  DecodeTensors t = dc.decode_tensors();
  t.slots = static_cast<const std::int32_t*>(slots.get());
  t.state_pool = pool.get();
  t.out = out.get();
  cudaStream_t s;
  REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess);
  cudaGraph_t graph;
  REQUIRE(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
  Status st;
  for (int i = 0; i < 3; ++i) st = decode_cuda(d.problem, t, s);
  REQUIRE(cudaStreamEndCapture(s, &graph) == cudaSuccess);
  REQUIRE(st.ok());
  cudaGraphExec_t exec;
  REQUIRE(cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess);
  REQUIRE(cudaGraphLaunch(exec, s) == cudaSuccess);
  REQUIRE(cudaStreamSynchronize(s) == cudaSuccess);
  CHECK(pool.download<unsigned char>() == eager.pool);
  CHECK(out.download<std::uint16_t>() == eager.out);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(s);
#endif
}
