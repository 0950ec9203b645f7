// Device helpers of the public API (kda/kda.hpp), so that layers above need no CUDA headers.
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <string>

#include "argument_table.hpp"
#include "cuda/cuda_check.hpp"
#include "kda/kda.hpp"

namespace kda {

using detail::cuda_status;

bool cuda_compiled() noexcept { return true; }

int cuda_device_count() noexcept {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the error: "no device" is an answer, not a failure
    return 0;
  }
  return n;
}

Status device_malloc(void** ptr, std::size_t bytes) {
  if (ptr == nullptr) return Status(StatusCode::kInvalidArgument, "device_malloc: ptr is null");
  *ptr = nullptr;
  if (bytes == 0) return Status::Ok();
  return cuda_status(cudaMalloc(ptr, bytes), "cudaMalloc");
}

Status device_free(void* ptr) {
  if (ptr == nullptr) return Status::Ok();
  return cuda_status(cudaFree(ptr), "cudaFree");
}

Status memcpy_to_device(void* dst, const void* src, std::size_t bytes, void* stream) {
  if (bytes == 0) return Status::Ok();
  return cuda_status(
      cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, static_cast<cudaStream_t>(stream)),
      "cudaMemcpyAsync(host to device)");
}

Status memcpy_to_host(void* dst, const void* src, std::size_t bytes, void* stream) {
  if (bytes == 0) return Status::Ok();
  Status st = cuda_status(
      cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, static_cast<cudaStream_t>(stream)),
      "cudaMemcpyAsync(device to host)");
  if (!st.ok()) return st;
  // The host buffer is only meaningful once the copy is done.
  return cuda_status(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)),
                     "cudaStreamSynchronize");
}

Status memset_device(void* dst, int value, std::size_t bytes, void* stream) {
  if (bytes == 0) return Status::Ok();
  return cuda_status(cudaMemsetAsync(dst, value, bytes, static_cast<cudaStream_t>(stream)),
                     "cudaMemsetAsync");
}

Status stream_synchronize(void* stream) {
  return cuda_status(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)),
                     "cudaStreamSynchronize");
}

std::string device_name(int device) {
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
    cudaGetLastError();
    return "none";
  }
  return prop.name;
}

namespace {

// Compute capability per device ordinal, looked up once (0: not yet known).
constexpr int kMaxCachedDevices = 64;
std::atomic<int> g_capability[kMaxCachedDevices];

int device_capability(int device, cudaError_t* err) {
  *err = cudaSuccess;
  if (device >= 0 && device < kMaxCachedDevices) {
    const int cached = g_capability[device].load(std::memory_order_relaxed);
    if (cached != 0) return cached;
  }
  int major = 0, minor = 0;
  *err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (*err == cudaSuccess)
    *err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  if (*err != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  const int capability = major * 10 + minor;
  if (device >= 0 && device < kMaxCachedDevices)
    g_capability[device].store(capability, std::memory_order_relaxed);
  return capability;
}

}  // namespace

// SM count per device ordinal, looked up once (0: not yet known).
std::atomic<int> g_sm_count[kMaxCachedDevices];

int detail::current_device_sm_count() {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();
    return 1;
  }
  if (device >= 0 && device < kMaxCachedDevices) {
    const int cached = g_sm_count[device].load(std::memory_order_relaxed);
    if (cached != 0) return cached;
  }
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      sms < 1) {
    cudaGetLastError();
    return 1;
  }
  if (device >= 0 && device < kMaxCachedDevices)
    g_sm_count[device].store(sms, std::memory_order_relaxed);
  return sms;
}

namespace {

// cuMemGetAddressRange through the runtime's driver entry point, so that the library needs no
// link against libcuda. Null when the driver does not offer it (the extent check is then skipped).
using MemGetAddressRangeFn = int (*)(unsigned long long* base, std::size_t* size,
                                     unsigned long long ptr);

using PointerGetAttributeFn = int (*)(void* data, int attribute, unsigned long long ptr);
constexpr int kAttributeIsLegacyIpcCapable = 10;  // CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE

void* driver_entry_point(const char* symbol) {
  void* ptr = nullptr;
  cudaDriverEntryPointQueryResult found{};
  if (cudaGetDriverEntryPointByVersion(symbol, &ptr, 12000, cudaEnableDefault, &found) !=
          cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  return ptr;
}

MemGetAddressRangeFn mem_get_address_range() {
  static const auto fn =
      reinterpret_cast<MemGetAddressRangeFn>(driver_entry_point("cuMemGetAddressRange"));
  return fn;
}

PointerGetAttributeFn pointer_get_attribute() {
  static const auto fn =
      reinterpret_cast<PointerGetAttributeFn>(driver_entry_point("cuPointerGetAttribute"));
  return fn;
}

// Whether the driver's address range of `addr` is the whole allocation the caller made. True for
// cudaMalloc memory (legacy-IPC capable). Not for memory mapped with cuMemCreate / cuMemMap
// (PyTorch's expandable segments, custom pools): there the range is one physical chunk, and a
// valid tensor may span several, so a short range proves nothing. Nor for stream-ordered pools or
// managed memory; the extent check trusts the range only when this returns true.
bool range_is_whole_allocation(unsigned long long addr) {
  const PointerGetAttributeFn get = pointer_get_attribute();
  if (get == nullptr) return false;
  int capable = 0;  // the driver writes a bool into the low byte
  return get(&capable, kAttributeIsLegacyIpcCapable, addr) == 0 && capable != 0;
}

const char* memory_type_name(cudaMemoryType type) {
  switch (type) {
    case cudaMemoryTypeUnregistered:
      return "unregistered host memory";
    case cudaMemoryTypeHost:
      return "pinned host memory";
    case cudaMemoryTypeDevice:
      return "device memory";
    case cudaMemoryTypeManaged:
      return "managed memory";
  }
  return "memory of an unknown kind";
}

}  // namespace

Status cuda_device_supported() {
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return cuda_status(err, "cudaGetDevice");
  }
  const int capability = device_capability(device, &err);
  if (err != cudaSuccess) return cuda_status(err, "cudaDeviceGetAttribute(compute capability)");
  if (capability != 90) {
    return Status(StatusCode::kUnsupported,
                  "the CUDA backend is built for sm_90a (Hopper, compute capability 9.0); device " +
                      std::to_string(device) + " (" + device_name(device) +
                      ") has compute capability " + std::to_string(capability / 10) + "." +
                      std::to_string(capability % 10));
  }
  return Status::Ok();
}

Status check_device_pointer(const void* ptr, std::size_t bytes, const char* name) {
  detail::ArgumentTable one;
  one.add(name == nullptr ? "buffer" : name, ptr, bytes, DType::kNone,
          detail::ArgumentRole::kInput);
  return detail::check_device_arguments(one);
}

Status check_device_status(const std::uint32_t* device_status, void* stream) {
  if (device_status == nullptr) {
    return Status(StatusCode::kInvalidArgument, "check_device_status: device_status is null");
  }
  std::uint32_t bits = 0;
  Status st = memcpy_to_host(&bits, device_status, sizeof bits, stream);
  if (!st.ok()) return st;
  return describe_device_status(bits);
}

Status clear_device_status(std::uint32_t* device_status, void* stream) {
  if (device_status == nullptr) {
    return Status(StatusCode::kInvalidArgument, "clear_device_status: device_status is null");
  }
  return memset_device(device_status, 0, sizeof(std::uint32_t), stream);
}

namespace detail {

Status check_device_arguments(const ArgumentTable& table) {
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return cuda_status(err, "cudaGetDevice");
  }
  const MemGetAddressRangeFn range_of = mem_get_address_range();
  for (const Argument& e : table) {
    if (e.space != MemorySpace::kBackend || e.ptr == nullptr || e.bytes == 0) continue;
    cudaPointerAttributes attr{};
    err = cudaPointerGetAttributes(&attr, e.ptr);
    if (err != cudaSuccess) {
      cudaGetLastError();
      return Status(StatusCode::kInvalidArgument, std::string(e.name) +
                                                      " is not a pointer the CUDA runtime knows (" +
                                                      cudaGetErrorName(err) + ")");
    }
    if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged) {
      return Status(StatusCode::kInvalidArgument,
                    std::string(e.name) + " points to " + memory_type_name(attr.type) +
                        "; the CUDA backend needs device or managed memory");
    }
    if (attr.type == cudaMemoryTypeDevice && attr.device != device) {
      return Status(StatusCode::kInvalidArgument,
                    std::string(e.name) + " is memory of device " + std::to_string(attr.device) +
                        ", but the current device is " + std::to_string(device));
    }
    if (range_of != nullptr) {
      unsigned long long base = 0;
      std::size_t size = 0;
      const unsigned long long addr = reinterpret_cast<std::uintptr_t>(e.ptr);
      if (range_of(&base, &size, addr) == 0 && addr >= base) {
        const unsigned long long room = base + size - addr;
        if (room < e.bytes && range_is_whole_allocation(addr)) {
          return Status(StatusCode::kInvalidArgument, std::string(e.name) + " needs " +
                                                          std::to_string(e.bytes) +
                                                          " bytes, but its allocation ends " +
                                                          std::to_string(room) + " bytes after it");
        }
      }
    }
  }
  return Status::Ok();
}

}  // namespace detail
}  // namespace kda
