#include "ferry/status.h"

#include <cerrno>
#include <cstring>

namespace ferry {

std::string_view StatusCodeName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "OK";
    case StatusCode::kCancelled: return "Cancelled";
    case StatusCode::kInvalidArgument: return "InvalidArgument";
    case StatusCode::kOutOfRange: return "OutOfRange";
    case StatusCode::kNotFound: return "NotFound";
    case StatusCode::kAlreadyExists: return "AlreadyExists";
    case StatusCode::kDeadlineExceeded: return "DeadlineExceeded";
    case StatusCode::kResourceExhausted: return "ResourceExhausted";
    case StatusCode::kUnavailable: return "Unavailable";
    case StatusCode::kUnimplemented: return "Unimplemented";
    case StatusCode::kFailedPrecondition: return "FailedPrecondition";
    case StatusCode::kInternal: return "Internal";
    case StatusCode::kDataLoss: return "DataLoss";
  }
  return "Unknown";
}

Status::Status(StatusCode code, std::string_view message) {
  if (code == StatusCode::kOk) return;
  state_ = std::make_unique<State>(State{code, std::string(message)});
}

Status::Status(const Status& other)
    : state_(other.state_ ? std::make_unique<State>(*other.state_) : nullptr) {}

Status& Status::operator=(const Status& other) {
  if (this != &other) state_ = other.state_ ? std::make_unique<State>(*other.state_) : nullptr;
  return *this;
}

std::string Status::ToString() const {
  if (ok()) return "OK";
  std::string out(StatusCodeName(state_->code));
  out += ": ";
  out += state_->message;
  return out;
}

Status Status::WithContext(std::string_view context) const {
  if (ok()) return Status();
  std::string message(context);
  message += ": ";
  message += state_->message;
  return Status(state_->code, message);
}

Status CancelledError(std::string_view m) { return Status(StatusCode::kCancelled, m); }
Status InvalidArgumentError(std::string_view m) { return Status(StatusCode::kInvalidArgument, m); }
Status OutOfRangeError(std::string_view m) { return Status(StatusCode::kOutOfRange, m); }
Status NotFoundError(std::string_view m) { return Status(StatusCode::kNotFound, m); }
Status AlreadyExistsError(std::string_view m) { return Status(StatusCode::kAlreadyExists, m); }
Status DeadlineExceededError(std::string_view m) {
  return Status(StatusCode::kDeadlineExceeded, m);
}
Status ResourceExhaustedError(std::string_view m) {
  return Status(StatusCode::kResourceExhausted, m);
}
Status UnavailableError(std::string_view m) { return Status(StatusCode::kUnavailable, m); }
Status UnimplementedError(std::string_view m) { return Status(StatusCode::kUnimplemented, m); }
Status FailedPreconditionError(std::string_view m) {
  return Status(StatusCode::kFailedPrecondition, m);
}
Status InternalError(std::string_view m) { return Status(StatusCode::kInternal, m); }
Status DataLossError(std::string_view m) { return Status(StatusCode::kDataLoss, m); }

Status ErrnoError(std::string_view context, int errno_value) {
  std::string message(context);
  message += ": ";
  message += std::strerror(errno_value);
  StatusCode code = StatusCode::kInternal;
  switch (errno_value) {
    case EINVAL: code = StatusCode::kInvalidArgument; break;
    case ENOENT: code = StatusCode::kNotFound; break;
    case EEXIST: code = StatusCode::kAlreadyExists; break;
    case ETIMEDOUT: code = StatusCode::kDeadlineExceeded; break;
    case ENOMEM:
    case EAGAIN: code = StatusCode::kResourceExhausted; break;
    case ECONNREFUSED:
    case ECONNRESET:
    case EPIPE:
    case EHOSTUNREACH: code = StatusCode::kUnavailable; break;
    case ENOSYS:
    case EOPNOTSUPP: code = StatusCode::kUnimplemented; break;
    case ECANCELED: code = StatusCode::kCancelled; break;
    default: break;
  }
  return Status(code, message);
}

}  // namespace ferry
