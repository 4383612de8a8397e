// What the ranks decide from each other's views before lost ranks come back (moe/membership.h):
// every case that must refuse does, naming the rank on another view, and the views survive
// their bytes.
#include "moe/membership.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace ferry::moe {
namespace {

// Four ranks: 0, 1 and 3 survivors at version 2, epoch 40, rank 2 masked; rank 2 joining.
std::vector<MemberView> Views() {
  const std::vector<uint8_t> masked = {0, 0, 1, 0}, print = {7, 7, 7};
  std::vector<MemberView> v(4, MemberView{false, false, 2, 40, masked, print});
  v[2] = MemberView{true, false, 0, 0, {0, 0, 0, 0}, print};
  return v;
}

void ExpectRefused(const std::vector<MemberView>& views, StatusCode code, const std::string& says) {
  auto d = Decide(views);
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), code) << d.status();
  EXPECT_NE(std::string(d.status().message()).find(says), std::string::npos) << d.status();
}

TEST(MembershipTest, TheMaskedRanksComeBackAtTheSurvivorsEpochOneVersionOn) {
  auto d = Decide(Views());
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->version, 3u);
  EXPECT_EQ(d->epoch, 40u);
  EXPECT_EQ(d->ranks, (std::vector<uint8_t>{0, 0, 1, 0}));
}

// Node-once: each survivor masks only the ranks it waits for (its node's and its rail's), so
// the lost ranks are their masks together; a joiner for a rank nobody masked is still refused.
TEST(MembershipTest, WhereEachMasksItsOwnHopsTheLostRanksAreTheirMasksTogether) {
  auto v = Views();
  for (MemberView& m : v) m.cover = MaskCover::kOwnHops;
  v[0].masked = {0, 0, 0, 0};  // rank 2 is neither in rank 0's node nor on its rail
  auto d = Decide(v);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->ranks, (std::vector<uint8_t>{0, 0, 1, 0}));
  v[1].masked = v[3].masked = {0, 0, 0, 0};  // nobody lost rank 2
  ExpectRefused(v, StatusCode::kFailedPrecondition, "ranks {2} are joining");
  v = Views();  // every survivor reporting the whole world: still one set of masks
  v[0].masked = {0, 0, 0, 0};
  ExpectRefused(v, StatusCode::kFailedPrecondition, "every survivor must have masked");
  // The cover travels with the view.
  MemberView own = Views()[1];
  own.cover = MaskCover::kOwnHops;
  auto parsed = MemberView::Parse(own.Serialize(), 4);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->cover, MaskCover::kOwnHops);
}

TEST(MembershipTest, ARankOnAnotherViewIsNamed) {
  auto v = Views();
  v[3].version = 1;  // missed a readmission
  ExpectRefused(v, StatusCode::kFailedPrecondition, "rank 3 is at membership version 1");
  v = Views();
  v[1].epoch = 41;
  ExpectRefused(v, StatusCode::kFailedPrecondition, "rank 1 is at membership version 2, epoch 41");
  v = Views();
  v[3].masked = {0, 1, 1, 0};
  ExpectRefused(v, StatusCode::kFailedPrecondition, "rank 3 has masked ranks {1, 2}");
  v = Views();
  v[0].fingerprint = {7, 7, 8};
  ExpectRefused(v, StatusCode::kInvalidArgument, "rank 1 has a different configuration");
}

TEST(MembershipTest, OnlyAndEveryMaskedRankIsReplaced) {
  auto v = Views();
  v[3].joining = true;  // a survivor's rank taken by a new process
  ExpectRefused(v, StatusCode::kFailedPrecondition, "ranks {2, 3} are joining");
  v = Views();
  v[2].joining = false;  // nobody comes for rank 2 (it would be a survivor masked by the others)
  v[2].version = 2;
  v[2].epoch = 40;
  v[2].masked = {0, 0, 1, 0};
  ExpectRefused(v, StatusCode::kFailedPrecondition, "ranks {} are joining");
  v = Views();
  for (auto& view : v) view.joining = true;
  ExpectRefused(v, StatusCode::kFailedPrecondition, "every rank is joining");
}

// A resize: the survivors (resizing, the old world's masks not read) and any ranks joining;
// a survivor that readmits while the others resize is named.
TEST(MembershipTest, AResizeTakesAnyJoiningRanksAndEverySurvivorResizes) {
  const std::vector<uint8_t> print = {9};
  std::vector<MemberView> v(6, MemberView{false, true, 0, 12, {0, 0, 0, 0, 0, 0}, print});
  v[4] = v[5] = MemberView{true, false, 0, 0, {0, 0, 0, 0, 0, 0}, print};
  v[1].masked = {0, 0, 1, 0, 0, 0};  // not read: a new world
  auto d = Decide(v);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->ranks, (std::vector<uint8_t>{0, 0, 0, 0, 1, 1}));
  EXPECT_EQ(d->epoch, 12u);
  EXPECT_EQ(d->version, 1u);
  v[3].resizing = false;
  ExpectRefused(v, StatusCode::kFailedPrecondition, "rank 3 readmits, rank 0 resizes");
}

TEST(MembershipTest, AViewSurvivesItsBytesAndBadBytesAreRefused) {
  const MemberView v = Views()[1];
  auto back = MemberView::Parse(v.Serialize(), 4);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->joining, v.joining);
  EXPECT_EQ(back->resizing, v.resizing);
  EXPECT_EQ(back->version, v.version);
  EXPECT_EQ(back->epoch, v.epoch);
  EXPECT_EQ(back->masked, v.masked);
  EXPECT_EQ(back->fingerprint, v.fingerprint);
  std::vector<uint8_t> bytes = v.Serialize();
  EXPECT_EQ(MemberView::Parse(std::span(bytes).first(10), 4).status().code(),
            StatusCode::kDataLoss);
  bytes[0] = 9;
  EXPECT_EQ(MemberView::Parse(bytes, 4).status().code(), StatusCode::kDataLoss);
  bytes[0] = 0;
  bytes[1] = 2;
  EXPECT_EQ(MemberView::Parse(bytes, 4).status().code(), StatusCode::kDataLoss);
}

}  // namespace
}  // namespace ferry::moe
