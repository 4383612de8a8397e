// The two-engine fixture of the TransferEngine tests (transfer_engine_test.cc,
// transfer_engine_peers_test.cc): engines a and b over the provider the test is given, each
// the other's peer, a's 4 MiB source registered and b's destination, whose descriptor crossed
// as bytes.
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "fabric/test_util.h"
#include "ferry/fabric.h"

namespace ferry {

class EnginePairTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    EngineOptions o = testing_util::TestOptions(GetParam());
    auto a = TransferEngine::Create(o);
    ASSERT_TRUE(a.ok()) << a.status();
    auto b = TransferEngine::Create(o);
    ASSERT_TRUE(b.ok()) << b.status();
    a_ = std::move(a).value();
    b_ = std::move(b).value();
    auto pb = a_->AddPeer(b_->Address());
    ASSERT_TRUE(pb.ok()) << pb.status();
    auto pa = b_->AddPeer(a_->Address());
    ASSERT_TRUE(pa.ok()) << pa.status();
    b_on_a_ = *pb;
    a_on_b_ = *pa;
    src_.resize(kBytes);
    dst_.assign(kBytes, 0);
    std::mt19937 rng(42);
    for (auto& c : src_) c = static_cast<uint8_t>(rng());
    auto s = a_->RegisterMemory(src_.data(), src_.size());
    ASSERT_TRUE(s.ok()) << s.status();
    src_reg_ = std::move(s).value();
    auto d = b_->RegisterMemory(dst_.data(), dst_.size());
    ASSERT_TRUE(d.ok()) << d.status();
    dst_reg_ = std::move(d).value();
    // The descriptor crosses "the wire" as bytes.
    auto parsed = RemoteRegion::Parse(dst_reg_.remote().Serialize());
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    dst_remote_ = *parsed;
  }

  void TearDown() override {
    src_reg_ = MemoryRegion();
    dst_reg_ = MemoryRegion();
    a_.reset();
    b_.reset();
  }

  SingleWrite Single(uint64_t src_off, uint64_t dst_off, uint64_t len) {
    SingleWrite w;
    w.src = &src_reg_;
    w.src_offset = src_off;
    w.peer = b_on_a_;
    w.dst = dst_remote_;
    w.dst_offset = dst_off;
    w.length = len;
    return w;
  }

  PagedWrite Paged(std::span<const uint32_t> src_pages, std::span<const uint32_t> dst_pages,
                   uint64_t page_bytes, uint64_t stride) {
    PagedWrite w;
    w.src = &src_reg_;
    w.peer = b_on_a_;
    w.dst = dst_remote_;
    w.page_bytes = page_bytes;
    w.src_stride = stride;
    w.dst_stride = stride;
    w.src_pages = src_pages;
    w.dst_pages = dst_pages;
    return w;
  }

  // A group of b alone and a scatter plan from our source to b's destination.
  void GroupOfB(GroupId* group, ScatterPlanId* plan) {
    std::vector<PeerId> members = {b_on_a_};
    auto g = a_->AddPeerGroup(members);
    ASSERT_TRUE(g.ok()) << g.status();
    std::vector<RemoteRegion> dsts = {dst_remote_};
    auto p = a_->PrepareScatter(*g, src_reg_, dsts);
    ASSERT_TRUE(p.ok()) << p.status();
    *group = *g;
    *plan = *p;
  }

  static constexpr size_t kBytes = 4 << 20;
  std::unique_ptr<TransferEngine> a_, b_;
  PeerId b_on_a_ = 0, a_on_b_ = 0;
  std::vector<uint8_t> src_, dst_;
  MemoryRegion src_reg_, dst_reg_;
  RemoteRegion dst_remote_;
};

}  // namespace ferry
