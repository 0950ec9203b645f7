// The slot copy (copy_slots_cpu / copy_slots_cuda): entry src[i] of every pool copied into entry
// dst[i], bytes for bytes; padding pairs, sources and every other entry untouched; bad pairs
// refused on the CPU before anything is written and skipped (reported) on CUDA; a captured copy
// replays with new pairs.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "backend_matrix.hpp"
#include "cuda_runtime_util.hpp"

using namespace kda;
using namespace kda::test;

namespace {

using Bytes = std::vector<unsigned char>;

// Pools of num_slots entries of entry_bytes[k] random bytes each.
std::vector<Bytes> random_pools(std::int64_t num_slots,
                                const std::vector<std::uint64_t>& entry_bytes, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<Bytes> pools;
  for (const std::uint64_t bytes : entry_bytes) {
    Bytes pool(static_cast<std::size_t>(num_slots * bytes));
    for (unsigned char& b : pool) b = static_cast<unsigned char>(rng());
    pools.push_back(std::move(pool));
  }
  return pools;
}

// What the copy must leave: every pair that is not padding and inside the pools copied, in order.
std::vector<Bytes> expected_pools(std::vector<Bytes> pools,
                                  const std::vector<std::uint64_t>& entry_bytes,
                                  std::int64_t num_slots, std::int32_t padding_slot,
                                  const std::vector<std::int32_t>& src,
                                  const std::vector<std::int32_t>& dst) {
  for (std::size_t i = 0; i < src.size(); ++i) {
    const std::int32_t s = src[i], d = dst[i];
    if (s < 0 || d < 0 || s == padding_slot || d == padding_slot) continue;
    if (s >= num_slots || d >= num_slots) continue;  // CUDA skips it (the CPU refuses the call)
    for (std::size_t k = 0; k < pools.size(); ++k) {
      const std::uint64_t n = entry_bytes[k];
      std::copy_n(pools[k].begin() + static_cast<std::ptrdiff_t>(s * n), n,
                  pools[k].begin() + static_cast<std::ptrdiff_t>(d * n));
    }
  }
  return pools;
}

struct CopyRun {
  Status status;
  std::vector<Bytes> pools;
  std::uint32_t device_status = 0;
  bool guards_intact = true;
};

// A copy of src[i] into dst[i], or with `zero` a zeroing of the entries dst names (src unused).
template <class Buffer>
CopyRun copy_on(Backend backend, const SlotCopyProblem& p, const std::vector<Bytes>& pools,
                const std::vector<std::uint64_t>& entry_bytes, const std::vector<std::int32_t>& src,
                const std::vector<std::int32_t>& dst, bool zero = false) {
  CopyRun r;
  std::vector<Buffer> buffers;
  std::vector<SlotPool> list;
  for (const Bytes& pool : pools) buffers.push_back(Buffer::from(pool));
  for (std::size_t k = 0; k < pools.size(); ++k) list.push_back({buffers[k].get(), entry_bytes[k]});
  Buffer s = Buffer::from(src), d = Buffer::from(dst);
  Buffer status(backend == Backend::kCuda ? 4 : 0);
  if (backend == Backend::kCuda) status.fill(0);
  const auto* ps = static_cast<const std::int32_t*>(s.get());
  const auto* pd = static_cast<const std::int32_t*>(d.get());
  const int n = static_cast<int>(list.size());
  auto* word = static_cast<std::uint32_t*>(status.get());
  if (zero) {
    r.status = backend == Backend::kCpu ? zero_slots_cpu(p, list.data(), n, pd)
                                        : zero_slots_cuda(p, list.data(), n, pd, word, nullptr);
  } else {
    r.status = backend == Backend::kCpu ? copy_slots_cpu(p, list.data(), n, ps, pd)
                                        : copy_slots_cuda(p, list.data(), n, ps, pd, word, nullptr);
  }
  if (r.status.ok()) r.status = Buffer::synchronize();
  for (const Buffer& b : buffers) {
    r.pools.push_back(b.template download<unsigned char>());
    r.guards_intact = r.guards_intact && b.guards_intact();
  }
  if (backend == Backend::kCuda) r.device_status = status.template download<std::uint32_t>()[0];
  return r;
}

CopyRun copy(const Runner& runner, const SlotCopyProblem& p, const std::vector<Bytes>& pools,
             const std::vector<std::uint64_t>& entry_bytes, const std::vector<std::int32_t>& src,
             const std::vector<std::int32_t>& dst, bool zero = false) {
  return runner.backend() == Backend::kCpu
             ? copy_on<HostBuffer>(Backend::kCpu, p, pools, entry_bytes, src, dst, zero)
             : copy_on<DeviceBuffer>(Backend::kCuda, p, pools, entry_bytes, src, dst, zero);
}

CopyRun zero(const Runner& runner, const SlotCopyProblem& p, const std::vector<Bytes>& pools,
             const std::vector<std::uint64_t>& entry_bytes,
             const std::vector<std::int32_t>& slots) {
  return copy(runner, p, pools, entry_bytes, {}, slots, true);
}

// What a zeroing must leave: the entries named (not padding, inside the pools) zero bytes.
std::vector<Bytes> zeroed_pools(std::vector<Bytes> pools,
                                const std::vector<std::uint64_t>& entry_bytes,
                                std::int64_t num_slots, std::int32_t padding_slot,
                                const std::vector<std::int32_t>& slots) {
  for (const std::int32_t s : slots) {
    if (s < 0 || s == padding_slot || s >= num_slots) continue;
    for (std::size_t k = 0; k < pools.size(); ++k) {
      std::fill_n(pools[k].begin() + static_cast<std::ptrdiff_t>(s * entry_bytes[k]),
                  entry_bytes[k], 0);
    }
  }
  return pools;
}

SlotCopyProblem problem(std::int64_t pairs, std::int64_t num_slots,
                        std::int32_t padding_slot = -1) {
  SlotCopyProblem p;
  p.pairs = pairs;
  p.num_slots = num_slots;
  p.padding_slot = padding_slot;
  return p;
}

// Entries of a layer's fp32 state (H = 2), a partial last tile (16 KB + 48 bytes), a conv state's
// few bytes, and exactly one 16 KB tile.
const std::vector<std::uint64_t> kEntryBytes = {2 * 128 * 128 * 4, 16384 + 48, 48, 16384};

}  // namespace

KDA_MATRIX_CASE(
    "slot copy: each pair's entries copied in every pool, forks, padding, the rest untouched") {
  const std::int64_t num_slots = 9;
  const std::int32_t null_slot = 8;
  const std::vector<Bytes> pools = random_pools(num_slots, kEntryBytes, 11);
  // 1 into 4 and 5 (a fork), 7 into 2; padding on either side: negative, or the null slot.
  const std::vector<std::int32_t> src = {1, -1, 1, 7, 6, null_slot, 0};
  const std::vector<std::int32_t> dst = {4, 3, 5, 2, -3, 0, null_slot};
  const SlotCopyProblem p = problem(static_cast<std::int64_t>(src.size()), num_slots, null_slot);
  const CopyRun r = copy(runner, p, pools, kEntryBytes, src, dst);
  REQUIRE(r.status.ok());
  CHECK(r.guards_intact);
  CHECK(r.device_status == 0);
  const std::vector<Bytes> want =
      expected_pools(pools, kEntryBytes, num_slots, null_slot, src, dst);
  for (std::size_t k = 0; k < pools.size(); ++k) {
    CAPTURE(k);
    CHECK(r.pools[k] == want[k]);
    CHECK(r.pools[k] != pools[k]);  // the copies changed something
  }
  // No pairs: nothing to do.
  CHECK(copy(runner, problem(0, num_slots), pools, kEntryBytes, {}, {}).status.ok());
}

KDA_MATRIX_CASE(
    "slot copy: a pair outside the pool is refused (CPU) or skipped and reported (CUDA)") {
  const std::int64_t num_slots = 6;
  const std::vector<Bytes> pools = random_pools(num_slots, kEntryBytes, 12);
  const std::vector<std::int32_t> src = {0, 2, 9};
  const std::vector<std::int32_t> dst = {1, 6, 3};
  const CopyRun r = copy(runner, problem(3, num_slots), pools, kEntryBytes, src, dst);
  CHECK(r.guards_intact);
  if (runner.backend() == Backend::kCpu) {
    CHECK(r.status.code() == StatusCode::kInvalidArgument);
    CHECK(r.status.message().find("dst[1] = 6 is out of range (num_slots 6)") != std::string::npos);
    CHECK(r.pools == pools);  // nothing written
  } else {
    REQUIRE(r.status.ok());
    CHECK(r.device_status == kDeviceStatusSlot);
    CHECK(r.pools == expected_pools(pools, kEntryBytes, num_slots, -1, src, dst));
  }
}

KDA_MATRIX_CASE(
    "slot zeroing: the named entries zeroed in every pool, padding and the rest untouched") {
  const std::int64_t num_slots = 7;
  const std::int32_t null_slot = 6;
  const std::vector<Bytes> pools = random_pools(num_slots, kEntryBytes, 16);
  const std::vector<std::int32_t> slots = {5, -1, 2, null_slot, 5};  // 5 twice: zeros either way
  const CopyRun r = zero(runner, problem(5, num_slots, null_slot), pools, kEntryBytes, slots);
  REQUIRE(r.status.ok());
  CHECK(r.guards_intact);
  CHECK(r.device_status == 0);
  CHECK(r.pools == zeroed_pools(pools, kEntryBytes, num_slots, null_slot, slots));
  // A slot outside the pool: refused before anything is written, or skipped and reported.
  const CopyRun bad = zero(runner, problem(2, num_slots), pools, kEntryBytes, {1, 7});
  if (runner.backend() == Backend::kCpu) {
    CHECK(bad.status.message().find("slots[1] = 7 is out of range (num_slots 7)") !=
          std::string::npos);
    CHECK(bad.pools == pools);
  } else {
    REQUIRE(bad.status.ok());
    CHECK(bad.device_status == kDeviceStatusSlot);
    CHECK(bad.pools == zeroed_pools(pools, kEntryBytes, num_slots, -1, {1}));
  }
}

KDA_CPU_CASE("slot copy: a destination twice or also a source, and bad arguments, are refused") {
  const std::int64_t num_slots = 6;
  std::vector<Bytes> pools = random_pools(num_slots, {64, 32}, 13);
  std::vector<SlotPool> list = {{pools[0].data(), 64}, {pools[1].data(), 32}};
  const std::vector<Bytes> before = pools;
  auto run = [&](std::vector<std::int32_t> src, std::vector<std::int32_t> dst) {
    return copy_slots_cpu(problem(static_cast<std::int64_t>(src.size()), num_slots), list.data(), 2,
                          src.data(), dst.data());
  };
  auto expect = [&](const Status& st, const std::string& text) {
    CAPTURE(text);
    CHECK(st.code() != StatusCode::kOk);
    CHECK(st.message().find(text) != std::string::npos);
    CHECK(pools == before);
  };
  expect(run({0, 1}, {2, 2}), "dst[0] and dst[1] both name slot 2");
  expect(run({0, 2}, {2, 3}), "dst[0] = 2 is also src[1]");
  expect(run({4}, {4}), "dst[0] = 4 is also src[0]");
  const std::int32_t one[1] = {0}, two[1] = {1};
  expect(copy_slots_cpu(problem(-1, num_slots), list.data(), 2, one, two), "pairs must be >= 0");
  expect(copy_slots_cpu(problem(1, num_slots), nullptr, 2, one, two),
         "pools is null but num_pools is 2");
  expect(copy_slots_cpu(problem(1, num_slots), list.data(), kMaxCopyPools + 1, one, two),
         "num_pools must be in [0, 128]");
  expect(copy_slots_cpu(problem(1, num_slots), list.data(), 2, nullptr, two),
         "src is null but pairs is 1");
  expect(copy_slots_cpu(problem(1, num_slots, static_cast<std::int32_t>(num_slots)), list.data(), 2,
                        one, two),
         "padding_slot " + std::to_string(num_slots) + " is outside the pool of num_slots = " +
             std::to_string(num_slots) + " (negative: no padding slot)");
  std::vector<SlotPool> overlapping = {{pools[0].data(), 64}, {pools[0].data() + 64, 32}};
  expect(copy_slots_cpu(problem(1, num_slots), overlapping.data(), 2, one, two),
         "pools[1] overlaps pools[0]");
  const auto* inside = reinterpret_cast<const std::int32_t*>(pools[1].data());
  expect(copy_slots_cpu(problem(1, num_slots), list.data(), 2, inside, two),
         "pools[1] overlaps src");
  SlotPool huge = {pools[0].data(), std::uint64_t{1} << 62};
  expect(copy_slots_cpu(problem(1, num_slots), &huge, 1, one, two), "overflow");
  SlotPool null_base = {nullptr, 64};
  expect(copy_slots_cpu(problem(1, num_slots), &null_base, 1, one, two), "pools[0].base is null");
  expect(zero_slots_cpu(problem(1, num_slots), list.data(), 2, nullptr),
         "slots is null but the entries are 1");
  expect(zero_slots_cpu(problem(-2, num_slots), list.data(), 2, one), "the entries must be >= 0");
  expect(copy_slots_cpu(problem(1, num_slots), list.data(), 2, one, nullptr),
         "dst is null but pairs is 1");
  // A pair that is padding on one side is not checked: 0 is no source here.
  CHECK(run({-7}, {-2}).ok());
  CHECK(run({0, 4}, {-1, 0}).ok());
  CHECK(std::equal(pools[0].begin(), pools[0].begin() + 64, before[0].begin() + 4 * 64));
  // Any negative padding_slot is none, as the steps take it: the pair is copied.
  CHECK(copy_slots_cpu(problem(1, num_slots, -2), list.data(), 2, one, two).ok());
  CHECK(std::equal(pools[0].begin() + 64, pools[0].begin() + 128, pools[0].begin()));
}

#ifdef KDA_HAVE_CUDA
KDA_CUDA_CASE("slot copy: more pairs than a grid's y dimension, and pools the kernel cannot take") {
  // 70,000 pairs copy slot 0 into slots 1..70000 of a pool of 16-byte entries: the blocks stride
  // over the pairs past 65,535.
  const std::int64_t pairs = 70000, num_slots = pairs + 1;
  const std::vector<std::uint64_t> entry = {16, 32};
  const std::vector<Bytes> pools = random_pools(num_slots, entry, 14);
  std::vector<std::int32_t> src(pairs, 0), dst(pairs);
  for (std::int64_t i = 0; i < pairs; ++i)
    dst[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(i + 1);
  const CopyRun r = copy(cuda, problem(pairs, num_slots), pools, entry, src, dst);
  REQUIRE(r.status.ok());
  CHECK(r.guards_intact);
  CHECK(r.device_status == 0);
  CHECK(r.pools == expected_pools(pools, entry, num_slots, -1, src, dst));

  // Entries that are not whole 16-byte pieces.
  DeviceBuffer pool(6 * 24), s = DeviceBuffer::from(std::vector<std::int32_t>{0}),
                             d = DeviceBuffer::from(std::vector<std::int32_t>{1});
  SlotPool odd = {pool.get(), 24};
  const Status st =
      copy_slots_cuda(problem(1, 6), &odd, 1, static_cast<const std::int32_t*>(s.get()),
                      static_cast<const std::int32_t*>(d.get()), nullptr, nullptr);
  CHECK(st.code() == StatusCode::kInvalidArgument);
  CHECK(st.message().find("multiples of 16") != std::string::npos);
  // Host memory where the device's is expected.
  std::vector<unsigned char> host(6 * 32);
  SlotPool on_host = {host.data(), 32};
  CHECK(copy_slots_cuda(problem(1, 6), &on_host, 1, static_cast<const std::int32_t*>(s.get()),
                        static_cast<const std::int32_t*>(d.get()), nullptr, nullptr)
            .code() == StatusCode::kInvalidArgument);
}

KDA_CUDA_CASE("slot copy: a captured copy and zeroing replay with the entries written since") {
  const std::int64_t num_slots = 8;
  const std::vector<Bytes> pools = random_pools(num_slots, kEntryBytes, 15);
  std::vector<DeviceBuffer> buffers;
  std::vector<SlotPool> list;
  for (const Bytes& pool : pools) buffers.push_back(DeviceBuffer::from(pool));
  for (std::size_t k = 0; k < pools.size(); ++k) list.push_back({buffers[k].get(), kEntryBytes[k]});
  const int n = static_cast<int>(list.size());
  DeviceBuffer s(3 * 4), d(3 * 4), z(3 * 4), status(4);
  for (DeviceBuffer* b : {&s, &d, &z}) b->fill(0xFF);  // -1 everywhere: padding
  status.fill(0);
  auto* word = static_cast<std::uint32_t*>(status.get());
  const auto* src = static_cast<const std::int32_t*>(s.get());
  const auto* dst = static_cast<const std::int32_t*>(d.get());
  const auto* zeros = static_cast<const std::int32_t*>(z.get());
  Stream stream;
  REQUIRE(stream.stream != nullptr);
  // One eager launch of a padding pair first (it writes nothing), then the capture: the copy of
  // three pairs, then the zeroing of three entries.
  REQUIRE(
      copy_slots_cuda(problem(1, num_slots), list.data(), n, src, dst, word, stream.stream).ok());
  CUDA_REQUIRE(cudaStreamSynchronize(stream.stream));
  Graph graph;
  CUDA_REQUIRE(cudaStreamBeginCapture(stream.stream, cudaStreamCaptureModeThreadLocal));
  const Status copied =
      copy_slots_cuda(problem(3, num_slots), list.data(), n, src, dst, word, stream.stream);
  const Status zeroed =
      zero_slots_cuda(problem(3, num_slots), list.data(), n, zeros, word, stream.stream);
  CUDA_REQUIRE(cudaStreamEndCapture(stream.stream, &graph.graph));
  REQUIRE(copied.ok());
  REQUIRE(zeroed.ok());
  CUDA_REQUIRE(cudaGraphInstantiate(&graph.exec, graph.graph, 0));

  std::vector<Bytes> want = pools;
  const std::vector<std::vector<std::int32_t>> srcs = {{0, 0, 5}, {3, -1, 6}, {7, 2, 1}};
  const std::vector<std::vector<std::int32_t>> dsts = {{1, 2, 6}, {4, 0, 5}, {3, 4, 0}};
  const std::vector<std::vector<std::int32_t>> zeroings = {{4, -1, 7}, {1, 1, -1}, {-1, 6, 2}};
  for (std::size_t round = 0; round < srcs.size(); ++round) {
    CAPTURE(round);
    // On the graph's stream: a copy from pageable memory may still be in flight when cudaMemcpy
    // returns, and a non-blocking stream does not wait for the null stream.
    for (const auto& [to, from] :
         {std::pair<void*, const std::vector<std::int32_t>*>{s.get(), &srcs[round]},
          std::pair<void*, const std::vector<std::int32_t>*>{d.get(), &dsts[round]},
          std::pair<void*, const std::vector<std::int32_t>*>{z.get(), &zeroings[round]}}) {
      CUDA_REQUIRE(cudaMemcpyAsync(to, from->data(), 12, cudaMemcpyHostToDevice, stream.stream));
    }
    CUDA_REQUIRE(cudaGraphLaunch(graph.exec, stream.stream));
    CUDA_REQUIRE(cudaStreamSynchronize(stream.stream));
    want = expected_pools(want, kEntryBytes, num_slots, -1, srcs[round], dsts[round]);
    want = zeroed_pools(want, kEntryBytes, num_slots, -1, zeroings[round]);
    for (std::size_t k = 0; k < pools.size(); ++k) {
      CHECK(buffers[k].download<unsigned char>() == want[k]);
      CHECK(buffers[k].guards_intact());
    }
  }
  CHECK(status.download<std::uint32_t>()[0] == 0);
}
#endif
