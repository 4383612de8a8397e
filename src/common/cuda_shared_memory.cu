// SharedCudaMemory (see cuda_shared_memory.h).
#include <cuda.h>
#include <cuda_runtime.h>

#include <string>

#include "common/cuda_shared_memory.h"

namespace ferry {
namespace {

// The driver calls, found through the runtime (no link against libcuda).
struct Driver {
  decltype(&::cuMemCreate) MemCreate;
  decltype(&::cuMemRelease) MemRelease;
  decltype(&::cuMemGetAllocationGranularity) MemGetAllocationGranularity;
  decltype(&::cuMemAddressReserve) MemAddressReserve;
  decltype(&::cuMemAddressFree) MemAddressFree;
  decltype(&::cuMemMap) MemMap;
  decltype(&::cuMemUnmap) MemUnmap;
  decltype(&::cuMemSetAccess) MemSetAccess;
  decltype(&::cuMemExportToShareableHandle) MemExportToShareableHandle;
  decltype(&::cuMemImportFromShareableHandle) MemImportFromShareableHandle;

  static StatusOr<const Driver*> Get() {
    static Driver driver;
    static Status loaded = driver.Load();
    if (!loaded.ok()) return loaded;
    return &driver;
  }

 private:
  template <typename F>
  static Status Find(const char* name, F* fn) {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found;
    if (cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess || !p) {
      (void)cudaGetLastError();
      return UnimplementedError(std::string("CUDA shared memory: the driver lacks ") + name);
    }
    *fn = reinterpret_cast<F>(p);
    return Status::Ok();
  }
  Status Load() {
    RETURN_IF_ERROR(Find("cuMemCreate", &MemCreate));
    RETURN_IF_ERROR(Find("cuMemRelease", &MemRelease));
    RETURN_IF_ERROR(Find("cuMemGetAllocationGranularity", &MemGetAllocationGranularity));
    RETURN_IF_ERROR(Find("cuMemAddressReserve", &MemAddressReserve));
    RETURN_IF_ERROR(Find("cuMemAddressFree", &MemAddressFree));
    RETURN_IF_ERROR(Find("cuMemMap", &MemMap));
    RETURN_IF_ERROR(Find("cuMemUnmap", &MemUnmap));
    RETURN_IF_ERROR(Find("cuMemSetAccess", &MemSetAccess));
    RETURN_IF_ERROR(Find("cuMemExportToShareableHandle", &MemExportToShareableHandle));
    RETURN_IF_ERROR(Find("cuMemImportFromShareableHandle", &MemImportFromShareableHandle));
    return Status::Ok();
  }
};

Status DriverError(const char* what, CUresult r) {
  return InternalError(std::string("CUDA shared memory: ") + what + " failed (CUresult " +
                       std::to_string(static_cast<int>(r)) + ")");
}
#define FERRY_CU(what, expr)                          \
  do {                                                \
    const CUresult ferry_r_ = (expr);                 \
    if (ferry_r_ != CUDA_SUCCESS) return DriverError(what, ferry_r_); \
  } while (0)

#define FERRY_CUDART(expr)                                                                \
  do {                                                                                    \
    const cudaError_t ferry_e_ = (expr);                                                  \
    if (ferry_e_ != cudaSuccess) {                                                        \
      return InternalError(std::string("CUDA: ") + #expr + ": " + cudaGetErrorString(ferry_e_)); \
    }                                                                                     \
  } while (0)

}  // namespace

SharedCudaMemory::~SharedCudaMemory() {
  auto driver = Driver::Get();
  if (!driver.ok()) return;
  for (const Mapping& m : maps_) {
    if (m.ptr) {
      (*driver)->MemUnmap(m.ptr, size_);
      (*driver)->MemAddressFree(m.ptr, size_);
    }
    (*driver)->MemRelease(m.handle);
  }
}

Status SharedCudaMemory::Create(int device, int64_t bytes, int* fd) {
  ASSIGN_OR_RETURN(const Driver* driver, Driver::Get());
  if (!maps_.empty()) return FailedPreconditionError("SharedCudaMemory: created twice");
  device_ = device;
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  size_t granularity = 0;
  FERRY_CU("cuMemGetAllocationGranularity",
           driver->MemGetAllocationGranularity(&granularity, &prop,
                                               CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
  size_ = (static_cast<size_t>(bytes) + granularity - 1) / granularity * granularity;
  CUmemGenericAllocationHandle handle;
  FERRY_CU("cuMemCreate", driver->MemCreate(&handle, size_, &prop, 0));
  maps_.push_back({handle, 0});
  ASSIGN_OR_RETURN(maps_.back().ptr, Map(handle));
  FERRY_CUDART(cudaSetDevice(device));
  FERRY_CUDART(cudaMemset(reinterpret_cast<void*>(maps_.back().ptr), 0, size_));
  FERRY_CUDART(cudaDeviceSynchronize());
  FERRY_CU("cuMemExportToShareableHandle",
           driver->MemExportToShareableHandle(fd, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                                              0));
  return Status::Ok();
}

StatusOr<uint8_t*> SharedCudaMemory::Import(int fd) {
  ASSIGN_OR_RETURN(const Driver* driver, Driver::Get());
  if (maps_.empty()) return FailedPreconditionError("SharedCudaMemory: Import before Create");
  CUmemGenericAllocationHandle handle;
  FERRY_CU("cuMemImportFromShareableHandle",
           driver->MemImportFromShareableHandle(
               &handle, reinterpret_cast<void*>(static_cast<uintptr_t>(fd)),
               CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
  maps_.push_back({handle, 0});
  ASSIGN_OR_RETURN(maps_.back().ptr, Map(handle));
  return reinterpret_cast<uint8_t*>(maps_.back().ptr);
}

StatusOr<uint64_t> SharedCudaMemory::Map(uint64_t handle) {
  ASSIGN_OR_RETURN(const Driver* driver, Driver::Get());
  CUdeviceptr ptr;
  FERRY_CU("cuMemAddressReserve", driver->MemAddressReserve(&ptr, size_, 0, 0, 0));
  if (CUresult r = driver->MemMap(ptr, size_, 0, handle, 0); r != CUDA_SUCCESS) {
    driver->MemAddressFree(ptr, size_);
    return DriverError("cuMemMap", r);
  }
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device_;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  if (CUresult r = driver->MemSetAccess(ptr, size_, &access, 1); r != CUDA_SUCCESS) {
    driver->MemUnmap(ptr, size_);
    driver->MemAddressFree(ptr, size_);
    return DriverError("cuMemSetAccess (are the GPUs peers over NVLink or PCIe?)", r);
  }
  return static_cast<uint64_t>(ptr);
}

}  // namespace ferry
