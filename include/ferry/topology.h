// ferry topology: which NICs and which CPU core serve each GPU.
//
// Read from sysfs (PCI devices, RDMA devices, NUMA nodes), so the same code runs on a live
// machine and on a copied or synthetic tree. Each GPU gets the RDMA NICs nearest to it in the
// PCIe tree (under its PCIe switch when there are any); NICs equally near several GPUs are dealt
// out among them, so on a machine with two NICs per GPU (AWS p5en) each GPU gets its own two,
// and a storage NIC that sits under no GPU's switch (DGX H100's extra ConnectX) is never picked
// while a nearer one exists. The worker core is a core of the GPU's NUMA node, a different one
// per GPU.
//
//   ferry::Topology topo = ferry::Topology::Discover(ferry::TopologyOptions::FromEnv()).value();
//   const ferry::GpuPlacement& p = topo.gpus()[local_rank];
//   EngineOptions o = EngineOptions::FromEnv().value();
//   topo.Apply(local_rank, "efa", o);  // fills o.nics and o.worker_cpu unless already set
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ferry/export.h"
#include "ferry/fabric.h"
#include "ferry/status.h"

namespace ferry {

struct FERRY_API PciDevice {
  std::string address;   // "0000:53:00.0"
  std::vector<std::string> path;  // PCI addresses from the root port down to the device
  std::string root;      // the host bridge ("pci0000:00")
  uint16_t vendor = 0;
  uint16_t device = 0;
  uint32_t pci_class = 0;
  int numa_node = -1;
};

struct FERRY_API RdmaNic {
  std::string name;  // RDMA device name: "rdmap79s0" (EFA), "mlx5_0" (ConnectX)
  PciDevice pci;
  bool efa = false;
};

struct FERRY_API GpuPlacement {
  int index = 0;  // CUDA ordinal under CUDA_DEVICE_ORDER=PCI_BUS_ID: GPUs sorted by PCI address
  PciDevice pci;
  std::vector<std::string> nics;  // RDMA device names, nearest first
  int pcie_hops = -1;             // PCIe hops from the GPU to its NICs; -1: none found
  bool nics_under_switch = false; // the NICs share a PCIe switch with the GPU
  int cpu = -1;                   // worker core; -1 when the NUMA node's cores are unknown
};

struct FERRY_API TopologyOptions {
  std::string sysfs_root = "/sys";
  // RDMA devices never to pick (a storage or management NIC). Environment: FERRY_TOPO_EXCLUDE.
  std::vector<std::string> exclude_nics;
  // How many NICs each GPU takes at most (the domain group's size).
  uint32_t max_nics_per_gpu = kMaxNics;

  // The defaults with FERRY_TOPO_EXCLUDE (comma-separated) added to exclude_nics; the only place
  // the topology reads the environment.
  static TopologyOptions FromEnv();
};

class FERRY_API Topology {
 public:
  static StatusOr<Topology> Discover(const TopologyOptions& options = {});

  const std::vector<GpuPlacement>& gpus() const { return gpus_; }
  const std::vector<RdmaNic>& nics() const { return nics_; }
  // cpus_of_node()[n]: the cores of NUMA node n.
  const std::vector<std::vector<int>>& cpus_of_node() const { return node_cpus_; }

  // The libfabric domain name of an RDMA device for a provider ("efa": "rdmap79s0-rdm";
  // verbs-style names are used as they are).
  static std::string DomainName(const std::string& provider, const std::string& nic);

  // Fills options.nics and options.worker_cpu for GPU `gpu` where the caller left them unset
  // (an explicit FERRY_NICS or FERRY_WORKER_CPU wins). NotFound for an unknown GPU.
  Status Apply(int gpu, const std::string& provider, EngineOptions& options) const;

  // One line per GPU: index, PCI address, NUMA node, NICs, hops, core.
  std::string Describe() const;

 private:
  std::vector<GpuPlacement> gpus_;
  std::vector<RdmaNic> nics_;
  std::vector<std::vector<int>> node_cpus_;
};

// "0-3,8,10-11" -> {0,1,2,3,8,10,11}; InvalidArgument on malformed input.
FERRY_API StatusOr<std::vector<int>> ParseCpuList(std::string_view list);

}  // namespace ferry
