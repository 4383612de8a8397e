// Topology discovery from sysfs. Layout read (all under options.sysfs_root):
//   bus/pci/devices/<addr>        -> symlink into devices/pciDDDD:BB/<port>/.../<addr>
//   bus/pci/devices/<addr>/{vendor,device,class,numa_node}
//   class/infiniband/<name>/device -> symlink to the NIC's PCI device
//   devices/system/node/node<N>/cpulist
// The PCIe path of a device is the chain of PCI addresses from its root port down; two devices
// under one PCIe switch share at least the root port and the switch's upstream port.
#include "ferry/topology.h"

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "common/strings.h"

namespace ferry {
namespace {

namespace fs = std::filesystem;

constexpr uint16_t kVendorNvidia = 0x10de;
constexpr uint16_t kVendorAmazon = 0x1d0f;

std::string ReadLine(const fs::path& p) {
  std::ifstream in(p);
  std::string line;
  std::getline(in, line);
  while (!line.empty() && (line.back() == '\n' || line.back() == ' ')) line.pop_back();
  return line;
}

uint32_t ReadHex(const fs::path& p) {
  std::string s = ReadLine(p);
  return s.empty() ? 0 : static_cast<uint32_t>(std::strtoul(s.c_str(), nullptr, 16));
}

// Reads one PCI device given its bus/pci/devices entry.
std::optional<PciDevice> ReadPci(const fs::path& entry) {
  std::error_code ec;
  fs::path real = fs::canonical(entry, ec);
  if (ec) return std::nullopt;
  PciDevice d;
  d.address = entry.filename().string();
  bool below_root = false;
  for (const fs::path& part : real) {
    std::string name = part.string();
    if (name.rfind("pci", 0) == 0 && name.find(':') != std::string::npos) {
      d.root = name;
      d.path.clear();
      below_root = true;
    } else if (below_root) {
      d.path.push_back(name);
    }
  }
  if (d.root.empty() || d.path.empty() || d.path.back() != d.address) return std::nullopt;
  d.vendor = static_cast<uint16_t>(ReadHex(entry / "vendor"));
  d.device = static_cast<uint16_t>(ReadHex(entry / "device"));
  d.pci_class = ReadHex(entry / "class");
  std::string numa = ReadLine(entry / "numa_node");
  d.numa_node = numa.empty() ? -1 : std::atoi(numa.c_str());
  return d;
}

bool IsGpu(const PciDevice& d) {
  const uint32_t base = d.pci_class >> 8;  // class and subclass
  return d.vendor == kVendorNvidia && (base == 0x0300 || base == 0x0302);
}

size_t CommonPrefix(const PciDevice& a, const PciDevice& b) {
  if (a.root != b.root) return 0;
  size_t n = 0;
  while (n < a.path.size() && n < b.path.size() && a.path[n] == b.path[n]) ++n;
  return n;
}

// PCIe hops between two devices; across host bridges, a large number that still prefers the
// same NUMA node.
int Hops(const PciDevice& a, const PciDevice& b) {
  if (a.root != b.root) return a.numa_node == b.numa_node ? 1000 : 2000;
  size_t c = CommonPrefix(a, b);
  return static_cast<int>((a.path.size() - c) + (b.path.size() - c));
}

}  // namespace

StatusOr<std::vector<int>> ParseCpuList(std::string_view list) {
  std::vector<int> cpus;
  std::string s(list);
  for (const std::string& item : SplitCommaList(s)) {
    size_t dash = item.find('-');
    char* end = nullptr;
    long lo = std::strtol(item.c_str(), &end, 10);
    long hi = lo;
    if (dash != std::string::npos) {
      if (end != item.c_str() + dash) return InvalidArgumentError("bad cpu list: " + s);
      hi = std::strtol(item.c_str() + dash + 1, &end, 10);
    }
    if (*end != '\0' || lo < 0 || hi < lo || hi > 65535) {
      return InvalidArgumentError("bad cpu list: " + s);
    }
    for (long c = lo; c <= hi; ++c) cpus.push_back(static_cast<int>(c));
  }
  return cpus;
}

TopologyOptions TopologyOptions::FromEnv() {
  TopologyOptions o;
  if (const char* env = std::getenv("FERRY_TOPO_EXCLUDE")) o.exclude_nics = SplitCommaList(env);
  return o;
}

StatusOr<Topology> Topology::Discover(const TopologyOptions& options) {
  const fs::path root(options.sysfs_root);
  std::error_code ec;
  if (!fs::is_directory(root / "bus/pci/devices", ec)) {
    return NotFoundError("no PCI devices under " + (root / "bus/pci/devices").string());
  }
  const std::vector<std::string>& exclude = options.exclude_nics;

  Topology topo;
  std::map<std::string, PciDevice> by_address;
  for (const auto& entry : fs::directory_iterator(root / "bus/pci/devices", ec)) {
    if (auto d = ReadPci(entry.path())) by_address[d->address] = *d;
  }
  std::vector<PciDevice> gpus;
  for (const auto& [address, d] : by_address) {
    if (IsGpu(d)) gpus.push_back(d);  // std::map: sorted by PCI address
  }
  if (fs::is_directory(root / "class/infiniband", ec)) {
    for (const auto& entry : fs::directory_iterator(root / "class/infiniband", ec)) {
      RdmaNic nic;
      nic.name = entry.path().filename().string();
      if (std::find(exclude.begin(), exclude.end(), nic.name) != exclude.end()) continue;
      fs::path dev = fs::canonical(entry.path() / "device", ec);
      if (ec) continue;
      auto it = by_address.find(dev.filename().string());
      if (it == by_address.end()) continue;
      nic.pci = it->second;
      nic.efa = nic.pci.vendor == kVendorAmazon;
      topo.nics_.push_back(std::move(nic));
    }
  }
  std::sort(topo.nics_.begin(), topo.nics_.end(),
            [](const RdmaNic& a, const RdmaNic& b) { return a.pci.address < b.pci.address; });

  for (const auto& entry : fs::directory_iterator(root / "devices/system/node", ec)) {
    std::string name = entry.path().filename().string();
    if (name.rfind("node", 0) != 0) continue;
    int node = std::atoi(name.c_str() + 4);
    if (node < 0 || node > 1023) continue;
    auto cpus = ParseCpuList(ReadLine(entry.path() / "cpulist"));
    if (!cpus.ok()) continue;
    if (topo.node_cpus_.size() <= size_t(node)) topo.node_cpus_.resize(node + 1);
    topo.node_cpus_[node] = *cpus;
  }

  // Nearest NICs of each GPU.
  std::vector<std::vector<size_t>> nearest(gpus.size());
  for (size_t g = 0; g < gpus.size(); ++g) {
    GpuPlacement p;
    p.index = static_cast<int>(g);
    p.pci = gpus[g];
    int best = -1;
    for (size_t n = 0; n < topo.nics_.size(); ++n) {
      int h = Hops(gpus[g], topo.nics_[n].pci);
      if (best < 0 || h < best) {
        best = h;
        nearest[g].clear();
      }
      if (h == best) nearest[g].push_back(n);
    }
    p.pcie_hops = best;
    p.nics_under_switch = !nearest[g].empty() &&
                          CommonPrefix(gpus[g], topo.nics_[nearest[g][0]].pci) >= 2;
    topo.gpus_.push_back(std::move(p));
  }
  // Deal NICs equally near several GPUs among them: GPU j of a group of G sharing a set of C
  // NICs takes NICs j, j + G, ... when C >= G; otherwise GPUs share, NIC j mod C each.
  std::map<std::vector<size_t>, std::vector<size_t>> groups;  // NIC set -> GPUs
  for (size_t g = 0; g < gpus.size(); ++g) groups[nearest[g]].push_back(g);
  for (const auto& [set, members] : groups) {
    const size_t c = set.size(), gcount = members.size();
    for (size_t j = 0; j < gcount; ++j) {
      std::vector<std::string>& out = topo.gpus_[members[j]].nics;
      if (c >= gcount) {
        for (size_t i = j; i < c; i += gcount) out.push_back(topo.nics_[set[i]].name);
      } else if (c > 0) {
        out.push_back(topo.nics_[set[j % c]].name);
      }
      if (out.size() > options.max_nics_per_gpu) out.resize(options.max_nics_per_gpu);
    }
  }
  // Worker cores: the k-th GPU of a NUMA node takes the node's core k + 1 (core 0 of a node is
  // where the kernel tends to put its own work).
  std::map<int, int> taken;
  for (GpuPlacement& p : topo.gpus_) {
    int node = p.pci.numa_node;
    if (node < 0 || size_t(node) >= topo.node_cpus_.size()) continue;
    const std::vector<int>& cpus = topo.node_cpus_[node];
    if (cpus.empty()) continue;
    int k = taken[node]++;
    p.cpu = cpus[std::min<size_t>(size_t(k) + 1, cpus.size() - 1)];
  }
  return topo;
}

std::string Topology::DomainName(const std::string& provider, const std::string& nic) {
  if (provider == "efa") return nic + "-rdm";
  return nic;
}

Status Topology::Apply(int gpu, const std::string& provider, EngineOptions& options) const {
  if (gpu < 0 || size_t(gpu) >= gpus_.size()) {
    return NotFoundError("GPU " + std::to_string(gpu) + ": topology has " +
                         std::to_string(gpus_.size()) + " GPUs");
  }
  const GpuPlacement& p = gpus_[gpu];
  if (options.nics.empty() && !p.nics.empty()) {
    for (const std::string& n : p.nics) options.nics.push_back(DomainName(provider, n));
  }
  if (options.worker_cpu < 0) options.worker_cpu = p.cpu;
  return Status::Ok();
}

std::string Topology::Describe() const {
  std::ostringstream out;
  out << "gpu  pci           numa  cpu  hops  switch  nics\n";
  for (const GpuPlacement& p : gpus_) {
    char line[96];
    std::snprintf(line, sizeof line, "%-4d %-13s %-5d %-4d %-5d %-7s ", p.index,
                  p.pci.address.c_str(), p.pci.numa_node, p.cpu, p.pcie_hops,
                  p.nics_under_switch ? "yes" : "no");
    out << line;
    for (size_t i = 0; i < p.nics.size(); ++i) out << (i ? "," : "") << p.nics[i];
    if (p.nics.empty()) out << "-";
    out << "\n";
  }
  std::vector<std::string> unused;
  for (const RdmaNic& n : nics_) {
    bool used = false;
    for (const GpuPlacement& p : gpus_) {
      used |= std::find(p.nics.begin(), p.nics.end(), n.name) != p.nics.end();
    }
    if (!used) unused.push_back(n.name + " (" + n.pci.address + ")");
  }
  out << "RDMA NICs: " << nics_.size() << ", unused:";
  for (const std::string& u : unused) out << " " << u;
  if (unused.empty()) out << " none";
  out << "\n";
  return out.str();
}

}  // namespace ferry
