#include "moe/membership.h"

#include <cstring>
#include <string>

namespace ferry::moe {
namespace {

// joining u8, resizing u8, cover u8, version u64, epoch u64, masked [N] u8, then the
// fingerprint.
constexpr size_t kFixedBytes = 1 + 1 + 1 + 8 + 8;

std::string RanksOf(const std::vector<uint8_t>& set) {
  std::string s = "{";
  for (size_t r = 0; r < set.size(); ++r) {
    if (!set[r]) continue;
    if (s.size() > 1) s += ", ";
    s += std::to_string(r);
  }
  return s + "}";
}

}  // namespace

std::vector<uint8_t> MemberView::Serialize() const {
  std::vector<uint8_t> out(kFixedBytes);
  out[0] = joining ? 1 : 0;
  out[1] = resizing ? 1 : 0;
  out[2] = static_cast<uint8_t>(cover);
  std::memcpy(out.data() + 3, &version, 8);
  std::memcpy(out.data() + 11, &epoch, 8);
  out.insert(out.end(), masked.begin(), masked.end());
  out.insert(out.end(), fingerprint.begin(), fingerprint.end());
  return out;
}

StatusOr<MemberView> MemberView::Parse(std::span<const uint8_t> bytes, int world_size) {
  if (world_size <= 0 || bytes.size() < kFixedBytes + size_t(world_size) || bytes[0] > 1 ||
      bytes[1] > 1 || bytes[2] > 1) {
    return DataLossError("membership view of " + std::to_string(bytes.size()) +
                         " bytes for a world of " + std::to_string(world_size));
  }
  MemberView v;
  v.joining = bytes[0] == 1;
  v.resizing = bytes[1] == 1;
  v.cover = static_cast<MaskCover>(bytes[2]);
  std::memcpy(&v.version, bytes.data() + 3, 8);
  std::memcpy(&v.epoch, bytes.data() + 11, 8);
  const auto masks = bytes.begin() + kFixedBytes;
  v.masked.assign(masks, masks + world_size);
  v.fingerprint.assign(masks + world_size, bytes.end());
  return v;
}

StatusOr<Readmission> Decide(const std::vector<MemberView>& views) {
  const int n = static_cast<int>(views.size());
  int first = -1;  // the first survivor, whose view the others' must equal
  for (int r = 0; r < n; ++r) {
    if (views[r].fingerprint != views[0].fingerprint) {
      return InvalidArgumentError("AllToAll membership: rank " + std::to_string(r) +
                                  " has a different configuration than rank 0");
    }
    if (!views[r].joining && first < 0) first = r;
  }
  if (first < 0) {
    return FailedPreconditionError(
        "AllToAll membership: every rank is joining; a world of new processes is a new "
        "AllToAll (AllToAll::Create)");
  }
  const MemberView& ref = views[first];
  Readmission out{ref.version + 1, ref.epoch, std::vector<uint8_t>(size_t(n), 0)};
  // The world's lost ranks: what every survivor masked, or what any did where each masks only
  // the ranks it waits for.
  std::vector<uint8_t> lost = ref.masked;
  if (ref.cover == MaskCover::kOwnHops) {
    for (const MemberView& v : views) {
      if (v.joining) continue;
      for (int r = 0; r < n && size_t(r) < v.masked.size(); ++r) lost[r] |= v.masked[r];
    }
  }
  for (int r = 0; r < n; ++r) {
    const MemberView& v = views[r];
    if (v.joining) {
      out.ranks[r] = 1;
      continue;
    }
    if (v.version != ref.version || v.epoch != ref.epoch) {
      return FailedPreconditionError(
          "AllToAll membership: rank " + std::to_string(r) + " is at membership version " +
          std::to_string(v.version) + ", epoch " + std::to_string(v.epoch) + "; rank " +
          std::to_string(first) + " at version " + std::to_string(ref.version) + ", epoch " +
          std::to_string(ref.epoch) + " (a rank on another view cannot meet the others)");
    }
    if (v.resizing != ref.resizing) {
      return FailedPreconditionError(
          "AllToAll membership: rank " + std::to_string(r) + (v.resizing ? " resizes" : " readmits") +
          ", rank " + std::to_string(first) + (ref.resizing ? " resizes" : " readmits") +
          " (every survivor calls the same one)");
    }
    if (ref.resizing || ref.cover == MaskCover::kOwnHops) continue;  // (see `lost`)
    if (v.masked != ref.masked) {
      return FailedPreconditionError("AllToAll membership: rank " + std::to_string(r) +
                                     " has masked ranks " + RanksOf(v.masked) + ", rank " +
                                     std::to_string(first) + " " + RanksOf(ref.masked) +
                                     " (every survivor must have masked the same ranks)");
    }
  }
  if (!ref.resizing && out.ranks != lost) {
    return FailedPreconditionError(
        "AllToAll membership: ranks " + RanksOf(out.ranks) + " are joining but the survivors " +
        "have masked " + RanksOf(lost) +
        " (every masked rank comes back at once, and only a masked rank is replaced)");
  }
  return out;
}

StatusOr<Readmission> Meet(Bootstrap& group, const MemberView& mine,
                           std::chrono::milliseconds timeout) {
  ASSIGN_OR_RETURN(auto gathered, group.AllGather(mine.Serialize(), timeout));
  std::vector<MemberView> views;
  for (size_t r = 0; r < gathered.size(); ++r) {
    ASSIGN_OR_RETURN(MemberView v, MemberView::Parse(gathered[r], group.world_size()));
    views.push_back(std::move(v));
  }
  return Decide(views);
}

}  // namespace ferry::moe
