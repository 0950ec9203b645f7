// engine/runtime/src/local_communicator.cpp — the in-process communicator (communicator.hpp):
// ranks as threads sharing one rendezvous. A collective is three phases around two barriers:
// every rank posts its buffer; each computes its result from all posted buffers into scratch of
// its own (others may still be reading its buffer); after the second barrier each writes its
// result in place. Scratch grows to the largest collective and is then reused.
#include <cstdint>
#include <cstring>
#include <string>

#include "kda/bf16.hpp"
#include "kda/engine/communicator.hpp"
#include "kda/error.hpp"
#include "rendezvous.hpp"

namespace kda::engine {

namespace {

using HostRendezvous = Rendezvous<const void*>;

class LocalCommunicator final : public Communicator {
 public:
  LocalCommunicator(std::shared_ptr<HostRendezvous> group, int rank)
      : group_(std::move(group)), rank_(rank) {}

  int rank() const noexcept override { return rank_; }
  int size() const noexcept override { return group_->size; }
  Backend backend() const noexcept override { return Backend::kCpu; }
  void abort() noexcept override { group_->abort(); }

  void all_reduce_sum(void* data, std::size_t count, DType dtype, void*) override {
    if (dtype != DType::kBF16 && dtype != DType::kF32) {
      throw Error(StatusCode::kInvalidArgument,
                  std::string("local communicator: all_reduce_sum of ") + to_string(dtype) +
                      " (it sums bf16 and f32)");
    }
    post(data);
    if (scratch_.size() < count) scratch_.resize(count);  // grows once to the largest call
    for (std::size_t i = 0; i < count; ++i) {
      float sum = 0.0f;
      for (int r = 0; r < group_->size; ++r) {
        const void* buffer = group_->posted[static_cast<std::size_t>(r)];
        sum += dtype == DType::kF32 ? static_cast<const float*>(buffer)[i]
                                    : bf16_to_float(static_cast<const bf16_bits*>(buffer)[i]);
      }
      scratch_[i] = sum;
    }
    group_->barrier();  // every rank has read every buffer
    for (std::size_t i = 0; i < count; ++i) {
      if (dtype == DType::kF32) {
        static_cast<float*>(data)[i] = scratch_[i];
      } else {
        static_cast<bf16_bits*>(data)[i] = float_to_bf16(scratch_[i]);
      }
    }
  }

  void all_gather(const void* send, void* recv, std::size_t bytes, void*) override {
    post(send);
    for (int r = 0; r < group_->size; ++r) {
      if (bytes > 0) {
        std::memcpy(static_cast<unsigned char*>(recv) + static_cast<std::size_t>(r) * bytes,
                    group_->posted[static_cast<std::size_t>(r)], bytes);
      }
    }
    group_->barrier();  // every rank has read every send buffer
  }

 private:
  // Every collective ends with a barrier after its last read of the posted buffers, so the slot
  // can be reused at once.
  void post(const void* buffer) { group_->post(rank_, buffer); }

  std::shared_ptr<HostRendezvous> group_;
  int rank_;
  std::vector<float> scratch_;
};

}  // namespace

std::vector<std::unique_ptr<Communicator>> make_local_communicators(int ranks) {
  if (ranks < 1 || ranks > 1024) {
    throw Error(StatusCode::kInvalidArgument, "make_local_communicators: ranks " +
                                                  std::to_string(ranks) + " is not in [1, 1024]");
  }
  auto group = std::make_shared<HostRendezvous>(ranks);
  std::vector<std::unique_ptr<Communicator>> communicators;
  for (int r = 0; r < ranks; ++r)
    communicators.push_back(std::make_unique<LocalCommunicator>(group, r));
  return communicators;
}

}  // namespace kda::engine
