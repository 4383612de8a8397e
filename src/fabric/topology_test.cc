// Topology discovery against sysfs trees built from public descriptions of real machines:
// AWS p5en.48xlarge (8 x H200, 16 EFA NICs, two per GPU under its PCIe switch, plus the ENA NIC
// for the VPC) and NVIDIA DGX H100 (8 GPUs, 8 ConnectX-7 each under its GPU's switch, plus
// ConnectX storage NICs on the root ports, which must never be picked).
#include "ferry/topology.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>

namespace ferry {
namespace {

namespace fs = std::filesystem;

class FakeSysfs {
 public:
  FakeSysfs() {
    std::random_device rd;
    root_ = fs::temp_directory_path() / ("ferry-sysfs-" + std::to_string(rd()));
    fs::create_directories(root_ / "bus/pci/devices");
    fs::create_directories(root_ / "class/infiniband");
    fs::create_directories(root_ / "devices/system/node");
  }
  ~FakeSysfs() {
    std::error_code ec;
    fs::remove_all(root_, ec);
  }
  std::string root() const { return root_.string(); }

  // A PCI device at the end of `path` (PCI addresses from the root port down) under host bridge
  // `bridge`; the ports on the way are created as bridges.
  void Device(const std::string& bridge, const std::vector<std::string>& path, uint16_t vendor,
              uint16_t device, uint32_t cls, int numa) {
    fs::path dir = root_ / "devices" / bridge;
    for (size_t i = 0; i < path.size(); ++i) {
      dir /= path[i];
      bool leaf = i + 1 == path.size();
      if (!leaf && fs::exists(dir)) continue;
      fs::create_directories(dir);
      Write(dir / "vendor", Hex(leaf ? vendor : 0x8086, 4));
      Write(dir / "device", Hex(leaf ? device : 0x1234, 4));
      Write(dir / "class", Hex(leaf ? cls : 0x060400, 6));
      Write(dir / "numa_node", std::to_string(numa));
      fs::path link = root_ / "bus/pci/devices" / path[i];
      if (!fs::exists(link)) fs::create_directory_symlink(dir, link);
    }
  }
  void Rdma(const std::string& name, const std::string& pci_address) {
    fs::path dir = root_ / "class/infiniband" / name;
    fs::create_directories(dir);
    fs::create_directory_symlink(root_ / "bus/pci/devices" / pci_address, dir / "device");
  }
  void Node(int n, const std::string& cpulist) {
    fs::path dir = root_ / "devices/system/node" / ("node" + std::to_string(n));
    fs::create_directories(dir);
    Write(dir / "cpulist", cpulist);
  }

 private:
  static std::string Hex(uint32_t v, int digits) {
    char buf[16];
    std::snprintf(buf, sizeof buf, "0x%0*x", digits, v);
    return buf;
  }
  static void Write(const fs::path& p, const std::string& s) { std::ofstream(p) << s << "\n"; }
  fs::path root_;
};

std::string Bdf(int bus, int dev = 0, int fn = 0) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0000:%02x:%02x.%d", bus, dev, fn);
  return buf;
}

std::string Bridge(int bus) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "pci0000:%02x", bus);
  return buf;
}

constexpr uint16_t kNvidia = 0x10de, kAmazon = 0x1d0f, kMellanox = 0x15b3;
constexpr uint16_t kH200 = 0x2335, kH100 = 0x2330, kEfa3 = 0xefa3, kEna = 0xec20;
constexpr uint16_t kCx7 = 0x1021, kCx6 = 0x101b;
constexpr uint32_t k3d = 0x030200, kEth = 0x020000, kIb = 0x020700;

// p5en.48xlarge: two sockets of 48 cores (192 vCPUs), GPUs 0-3 on NUMA node 0. Each GPU sits
// behind its own host bridge and PCIe switch, with two EFA NICs on the same switch.
void BuildP5en(FakeSysfs& s) {
  s.Node(0, "0-47,96-143");
  s.Node(1, "48-95,144-191");
  for (int g = 0; g < 8; ++g) {
    const int b = 0x10 + g * 0x10, numa = g / 4;
    const std::vector<std::string> sw = {Bdf(b, 1), Bdf(b + 1)};
    s.Device(Bridge(b), {sw[0], sw[1], Bdf(b + 2, 0), Bdf(b + 3)}, kNvidia, kH200, k3d, numa);
    for (int e = 0; e < 2; ++e) {
      const std::string nic = Bdf(b + 4 + e);
      s.Device(Bridge(b), {sw[0], sw[1], Bdf(b + 2, 1 + e), nic}, kAmazon, kEfa3, kEth, numa);
      s.Rdma("rdmap" + std::to_string(b + 4 + e) + "s0", nic);
    }
  }
  // The VPC NIC: Ethernet, no RDMA device.
  s.Device(Bridge(0), {Bdf(0, 5)}, kAmazon, kEna, kEth, 0);
}

// DGX H100: two sockets of 56 cores (hyperthreaded), 8 GPUs each sharing a PCIe switch with one
// ConnectX-7 for the compute fabric; ConnectX-6 storage NICs on root ports of each socket.
void BuildDgxH100(FakeSysfs& s) {
  s.Node(0, "0-55,112-167");
  s.Node(1, "56-111,168-223");
  for (int g = 0; g < 8; ++g) {
    const int b = g < 4 ? 0x18 + g * 0x10 : 0x98 + (g - 4) * 0x10, numa = g / 4;
    const std::vector<std::string> sw = {Bdf(b, 1), Bdf(b + 1)};
    s.Device(Bridge(b), {sw[0], sw[1], Bdf(b + 2, 0), Bdf(b + 3)}, kNvidia, kH100, k3d, numa);
    s.Device(Bridge(b), {sw[0], sw[1], Bdf(b + 2, 1), Bdf(b + 4)}, kMellanox, kCx7, kIb, numa);
    s.Rdma("mlx5_" + std::to_string(g), Bdf(b + 4));
  }
  s.Device(Bridge(0x00), {Bdf(0x00, 3), Bdf(0x0a)}, kMellanox, kCx6, kEth, 0);
  s.Rdma("mlx5_8", Bdf(0x0a));
  s.Device(Bridge(0x80), {Bdf(0x80, 3), Bdf(0x8a)}, kMellanox, kCx6, kEth, 1);
  s.Rdma("mlx5_9", Bdf(0x8a));
}

TEST(TopologyTest, P5enGivesEachGpuTheTwoEfaNicsOnItsSwitch) {
  FakeSysfs s;
  BuildP5en(s);
  TopologyOptions o;
  o.sysfs_root = s.root();
  auto topo = Topology::Discover(o);
  ASSERT_TRUE(topo.ok()) << topo.status();
  ASSERT_EQ(topo->gpus().size(), 8u);
  EXPECT_EQ(topo->nics().size(), 16u);  // the ENA NIC is no RDMA device
  for (int g = 0; g < 8; ++g) {
    const GpuPlacement& p = topo->gpus()[g];
    const int b = 0x10 + g * 0x10;
    EXPECT_EQ(p.pci.address, Bdf(b + 3));
    EXPECT_EQ(p.pci.numa_node, g / 4);
    EXPECT_EQ(p.nics, (std::vector<std::string>{"rdmap" + std::to_string(b + 4) + "s0",
                                                "rdmap" + std::to_string(b + 5) + "s0"}))
        << "GPU " << g;
    EXPECT_TRUE(p.nics_under_switch);
    EXPECT_EQ(p.pcie_hops, 4);
    EXPECT_EQ(p.cpu, g < 4 ? 1 + g : 49 + (g - 4));  // distinct physical cores of its node
  }
  EngineOptions e;
  ASSERT_TRUE(topo->Apply(5, "efa", e).ok());
  EXPECT_EQ(e.nics, (std::vector<std::string>{"rdmap100s0-rdm", "rdmap101s0-rdm"}));
  EXPECT_EQ(e.worker_cpu, 50);
  EXPECT_EQ(topo->Apply(8, "efa", e).code(), StatusCode::kNotFound);
  const std::string text = topo->Describe();
  EXPECT_NE(text.find("rdmap100s0,rdmap101s0"), std::string::npos) << text;
  EXPECT_NE(text.find("unused: none"), std::string::npos) << text;
}

TEST(TopologyTest, DgxH100PairsEachGpuWithItsConnectX7AndNeverTheStorageNics) {
  FakeSysfs s;
  BuildDgxH100(s);
  TopologyOptions o;
  o.sysfs_root = s.root();
  auto topo = Topology::Discover(o);
  ASSERT_TRUE(topo.ok()) << topo.status();
  ASSERT_EQ(topo->gpus().size(), 8u);
  EXPECT_EQ(topo->nics().size(), 10u);
  for (int g = 0; g < 8; ++g) {
    const GpuPlacement& p = topo->gpus()[g];
    EXPECT_EQ(p.nics, std::vector<std::string>{"mlx5_" + std::to_string(g)}) << "GPU " << g;
    EXPECT_TRUE(p.nics_under_switch);
    EXPECT_EQ(p.cpu, g < 4 ? 1 + g : 57 + (g - 4));
  }
  const std::string text = topo->Describe();
  EXPECT_NE(text.find("mlx5_8"), std::string::npos) << text;  // listed as unused
  EXPECT_NE(text.find("mlx5_9"), std::string::npos) << text;
  // An explicit choice wins over the topology.
  EngineOptions e;
  e.nics = {"mlx5_3"};
  e.worker_cpu = 7;
  ASSERT_TRUE(topo->Apply(0, "verbs", e).ok());
  EXPECT_EQ(e.nics, std::vector<std::string>{"mlx5_3"});
  EXPECT_EQ(e.worker_cpu, 7);
}

TEST(TopologyTest, GpusSharingASwitchSplitItsNicsAndAnExcludedNicIsNeverPicked) {
  // A DGX A100-like pair: GPUs 0 and 1 and NICs a, b on one switch; GPU 2 alone with NIC c.
  FakeSysfs s;
  s.Node(0, "0-7");
  const std::vector<std::string> sw = {Bdf(0x10, 1), Bdf(0x11)};
  s.Device(Bridge(0x10), {sw[0], sw[1], Bdf(0x12, 0), Bdf(0x13)}, kNvidia, kH100, k3d, 0);
  s.Device(Bridge(0x10), {sw[0], sw[1], Bdf(0x12, 1), Bdf(0x14)}, kNvidia, kH100, k3d, 0);
  s.Device(Bridge(0x10), {sw[0], sw[1], Bdf(0x12, 2), Bdf(0x15)}, kMellanox, kCx7, kIb, 0);
  s.Device(Bridge(0x10), {sw[0], sw[1], Bdf(0x12, 3), Bdf(0x16)}, kMellanox, kCx7, kIb, 0);
  s.Rdma("a", Bdf(0x15));
  s.Rdma("b", Bdf(0x16));
  const std::vector<std::string> sw2 = {Bdf(0x20, 1), Bdf(0x21)};
  s.Device(Bridge(0x20), {sw2[0], sw2[1], Bdf(0x22, 0), Bdf(0x23)}, kNvidia, kH100, k3d, 0);
  s.Device(Bridge(0x20), {sw2[0], sw2[1], Bdf(0x22, 1), Bdf(0x24)}, kMellanox, kCx7, kIb, 0);
  s.Rdma("c", Bdf(0x24));
  TopologyOptions o;
  o.sysfs_root = s.root();
  auto topo = Topology::Discover(o);
  ASSERT_TRUE(topo.ok()) << topo.status();
  ASSERT_EQ(topo->gpus().size(), 3u);
  EXPECT_EQ(topo->gpus()[0].nics, std::vector<std::string>{"a"});
  EXPECT_EQ(topo->gpus()[1].nics, std::vector<std::string>{"b"});
  EXPECT_EQ(topo->gpus()[2].nics, std::vector<std::string>{"c"});
  // Without c, GPU 2 falls back to the nearest others, across host bridges.
  o.exclude_nics = {"c"};
  topo = Topology::Discover(o);
  ASSERT_TRUE(topo.ok());
  for (const GpuPlacement& p : topo->gpus()) {
    for (const std::string& n : p.nics) EXPECT_NE(n, "c");
  }
  EXPECT_FALSE(topo->gpus()[2].nics.empty());
  EXPECT_FALSE(topo->gpus()[2].nics_under_switch);
  // A cap on NICs per GPU.
  o.exclude_nics.clear();
  o.max_nics_per_gpu = 1;
  FakeSysfs p5en;
  BuildP5en(p5en);
  o.sysfs_root = p5en.root();
  topo = Topology::Discover(o);
  ASSERT_TRUE(topo.ok());
  for (const GpuPlacement& p : topo->gpus()) EXPECT_EQ(p.nics.size(), 1u);
}

// FERRY_TOPO_EXCLUDE reaches Discover only through TopologyOptions::FromEnv: the options a caller
// builds are what Discover uses.
TEST(TopologyTest, ExcludedNicsComeFromTheOptionsAlone) {
  unsetenv("FERRY_TOPO_EXCLUDE");
  EXPECT_TRUE(TopologyOptions::FromEnv().exclude_nics.empty());
  setenv("FERRY_TOPO_EXCLUDE", "mlx5_4,mlx5_5", 1);
  EXPECT_EQ(TopologyOptions::FromEnv().exclude_nics,
            (std::vector<std::string>{"mlx5_4", "mlx5_5"}));
  FakeSysfs p5en;
  BuildP5en(p5en);
  TopologyOptions o;
  o.sysfs_root = p5en.root();
  auto all = Topology::Discover(o);
  ASSERT_TRUE(all.ok()) << all.status();
  setenv("FERRY_TOPO_EXCLUDE", all->nics().front().name.c_str(), 1);
  auto again = Topology::Discover(o);  // the variable is not read here
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->nics().size(), all->nics().size());
  TopologyOptions from_env = TopologyOptions::FromEnv();
  from_env.sysfs_root = p5en.root();
  auto fewer = Topology::Discover(from_env);
  ASSERT_TRUE(fewer.ok()) << fewer.status();
  EXPECT_EQ(fewer->nics().size() + 1, all->nics().size());
  unsetenv("FERRY_TOPO_EXCLUDE");
}

TEST(TopologyTest, CpuListsParseAndMalformedOnesAreRefused) {
  EXPECT_EQ(*ParseCpuList("0-3,8,10-11"), (std::vector<int>{0, 1, 2, 3, 8, 10, 11}));
  EXPECT_EQ(*ParseCpuList(""), std::vector<int>{});
  for (const char* bad : {"3-1", "a", "1-", "-2", "1,2x", "0-70000"}) {
    EXPECT_EQ(ParseCpuList(bad).status().code(), StatusCode::kInvalidArgument) << bad;
  }
}

TEST(TopologyTest, ThisMachineAndAMissingTreeAnswerCleanly) {
  auto here = Topology::Discover();
  ASSERT_TRUE(here.ok()) << here.status();  // whatever it has: CI machines have no GPU
  for (const GpuPlacement& p : here->gpus()) EXPECT_FALSE(p.pci.address.empty());
  TopologyOptions o;
  o.sysfs_root = "/nonexistent-ferry-sysfs";
  EXPECT_EQ(Topology::Discover(o).status().code(), StatusCode::kNotFound);
}

}  // namespace
}  // namespace ferry
