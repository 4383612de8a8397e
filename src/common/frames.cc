#include "common/frames.h"

#include <algorithm>
#include <cstring>
#include <string>

namespace ferry {

Status ReadFrame(const ReadExact& read, std::vector<uint8_t>* out) {
  uint32_t len = 0;
  RETURN_IF_ERROR(read(&len, sizeof len));
  if (len > kMaxFrameBytes) {
    return DataLossError("bootstrap: a frame of " + std::to_string(len) + " bytes (at most " +
                         std::to_string(kMaxFrameBytes) + ")");
  }
  // Grown as the bytes come, a step at a time: a peer that claims more than it sends costs a
  // step of memory, not its claim.
  constexpr size_t kStep = size_t{1} << 20;
  out->clear();
  for (size_t left = len; left > 0;) {
    const size_t step = std::min(left, kStep), at = out->size();
    out->resize(at + step);
    RETURN_IF_ERROR(read(out->data() + at, step));
    left -= step;
  }
  return Status::Ok();
}

std::vector<uint8_t> EncodeRound(const std::vector<std::vector<uint8_t>>& frames) {
  std::vector<uint8_t> out;
  const auto put32 = [&](uint32_t v) {
    out.insert(out.end(), reinterpret_cast<uint8_t*>(&v), reinterpret_cast<uint8_t*>(&v) + 4);
  };
  put32(static_cast<uint32_t>(frames.size()));
  for (const auto& f : frames) {
    put32(static_cast<uint32_t>(f.size()));
    out.insert(out.end(), f.begin(), f.end());
  }
  return out;
}

StatusOr<std::vector<std::vector<uint8_t>>> ReadRound(const ReadExact& read, int world_size) {
  uint32_t count = 0;
  RETURN_IF_ERROR(read(&count, sizeof count));
  if (count != static_cast<uint32_t>(world_size)) {
    return DataLossError("bootstrap: a round of " + std::to_string(count) + " entries, not " +
                         std::to_string(world_size));
  }
  std::vector<std::vector<uint8_t>> all(count);
  for (auto& entry : all) RETURN_IF_ERROR(ReadFrame(read, &entry));
  return all;
}

Status ReadAnswer(const ReadExact& read, Status* carried) {
  uint32_t head[2] = {};
  RETURN_IF_ERROR(read(head, sizeof head));
  if (head[0] > static_cast<uint32_t>(StatusCode::kDataLoss) ||
      head[1] > kMaxAnswerBytes) {
    return DataLossError("rendezvous: an answer with code " + std::to_string(head[0]) + " and " +
                         std::to_string(head[1]) + " bytes of message");
  }
  std::string message(head[1], '\0');
  RETURN_IF_ERROR(read(message.data(), message.size()));
  *carried = head[0] == 0 ? Status::Ok() : Status(static_cast<StatusCode>(head[0]), message);
  return Status::Ok();
}

ReadExact SpanReader(std::span<const uint8_t>* bytes) {
  return [bytes](void* p, size_t n) -> Status {
    if (bytes->size() < n) return UnavailableError("bootstrap: connection closed (a rank died)");
    if (n > 0) std::memcpy(p, bytes->data(), n);  // an empty frame's buffer may be null
    *bytes = bytes->subspan(n);
    return Status::Ok();
  };
}

}  // namespace ferry
