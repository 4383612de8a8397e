// Shared helpers for fabric tests: which providers to run over and how to configure them.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "common/strings.h"
#include "ferry/bootstrap.h"
#include "ferry/fabric.h"

// For code running in a forked rank, where gtest assertions do not reach the parent: returns an
// Internal status naming the line when `cond` is false.
#define CHECK_OR_RETURN(cond, msg)                                                              \
  do {                                                                                          \
    if (!(cond)) {                                                                              \
      return ::ferry::InternalError(std::string("line ") + std::to_string(__LINE__) + ": " +     \
                                    (msg));                                                     \
    }                                                                                           \
  } while (0)

namespace ferry::testing_util {

// How much longer than written a test's short timeouts run: FERRY_TEST_TIME_SCALE (1 unless
// set; make tsan sets it, as ThreadSanitizer runs code several times slower).
// A loopback TCP port nothing listens on now: the kernel's pick for a socket bound to port 0,
// closed again at once. 0 when no socket could be bound.
inline uint16_t FreeLoopbackPort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return 0;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
                  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0;
  close(fd);
  return ok ? ntohs(a.sin_port) : 0;
}

inline int TimeScale() {
  const char* env = std::getenv("FERRY_TEST_TIME_SCALE");
  const int scale = env ? std::atoi(env) : 1;
  return scale >= 1 ? scale : 1;
}

// The software providers every machine has. FERRY_TEST_PROVIDERS="shm" narrows the list.
inline std::vector<std::string> Providers() {
  if (const char* env = std::getenv("FERRY_TEST_PROVIDERS")) return SplitCommaList(env);
  return {"shm", "tcp;ofi_rxm"};
}

inline std::string ProviderTestName(const ::testing::TestParamInfo<std::string>& info) {
  std::string name;
  for (char c : info.param) name += std::isalnum(static_cast<unsigned char>(c)) ? c : '_';
  return name;
}

// Each environment variable set in turn to a value its field cannot take: `parse` (a FromEnv)
// must refuse it with InvalidArgument naming "NAME=value". Unsets each variable after.
template <typename Parse>
void ExpectEnvRefused(Parse parse,
                      std::initializer_list<std::pair<const char*, const char*>> bad) {
  for (const auto& [name, value] : bad) {
    setenv(name, value, 1);
    const auto parsed = parse();
    EXPECT_EQ(parsed.status().code(), StatusCode::kInvalidArgument) << name << "=" << value;
    EXPECT_NE(parsed.status().message().find(std::string(name) + "=" + value), std::string::npos)
        << parsed.status().ToString();
    unsetenv(name);
  }
}

// The address this process's rank was given by RunRanks (Bootstrap::node()); empty outside one.
inline std::string& RankNode() {
  static std::string node;
  return node;
}

// RunLocalRanks, each rank's TestOptions binding the address its bootstrap was given: under
// FERRY_LOCAL_RANK_NODES (tests/netns_test.sh) each rank is a host of its own.
inline std::vector<RankExit> RunRanks(int world_size,
                                      const std::function<Status(Bootstrap&)>& body,
                                      std::chrono::milliseconds timeout) {
  return RunLocalRanks(
      world_size,
      [&](Bootstrap& b) {
        RankNode() = b.node();
        return body(b);
      },
      timeout);
}

// Small pools and gentle idling: tests run many engines on two cores.
inline EngineOptions TestOptions(const std::string& provider) {
  EngineOptions o;
  o.provider = provider;
  if (provider.find("tcp") != std::string::npos) {
    o.node = RankNode().empty() ? "127.0.0.1" : RankNode();  // loopback unless a host of its own
  }
  o.spin_us = 20;
  o.idle_yield_us = 200;
  o.idle_sleep_us = 200;
  o.transfer_timeout_ms = 5000;
  return o;
}

// Two engines of this process over `provider` (TestOptions), A knowing B.
struct EnginePair {
  std::unique_ptr<TransferEngine> a, b;
  PeerId b_on_a = 0;
};
inline StatusOr<EnginePair> MakeEnginePair(const std::string& provider) {
  EnginePair p;
  ASSIGN_OR_RETURN(p.a, TransferEngine::Create(TestOptions(provider)));
  ASSIGN_OR_RETURN(p.b, TransferEngine::Create(TestOptions(provider)));
  ASSIGN_OR_RETURN(p.b_on_a, p.a->AddPeer(p.b->Address()));
  return StatusOr<EnginePair>(std::move(p));
}

}  // namespace ferry::testing_util
