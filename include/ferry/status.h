// Status and StatusOr: how every fallible ferry call reports its outcome.
//
// ferry's C++ core throws no exceptions. A Status is OK or carries a code and a message; an OK
// Status owns no memory, so returning it on a hot path costs nothing. Foreign errors (libfabric,
// verbs, CUDA, errno) are converted once, in the wrapper that called them.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <string_view>
#include <utility>

#include "ferry/export.h"

namespace ferry {

enum class StatusCode : uint8_t {
  kOk = 0,
  kCancelled,
  kInvalidArgument,
  kOutOfRange,
  kNotFound,
  kAlreadyExists,
  kDeadlineExceeded,
  kResourceExhausted,  // a bounded queue or pool is full; retry later
  kUnavailable,        // a peer is lost or unreachable
  kUnimplemented,      // the provider or build lacks the capability
  kFailedPrecondition,
  kInternal,           // a provider or system call failed
  kDataLoss,
};

FERRY_API std::string_view StatusCodeName(StatusCode code);

class [[nodiscard]] FERRY_API Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string_view message);

  static Status Ok() { return Status(); }

  bool ok() const { return state_ == nullptr; }
  StatusCode code() const { return state_ ? state_->code : StatusCode::kOk; }
  std::string_view message() const { return state_ ? std::string_view(state_->message) : ""; }
  // "OutOfRange: dst offset 4096 + 8 exceeds region length 4096"
  std::string ToString() const;

  // Prefixes the message with context ("peer 3: ..."); OK stays OK.
  Status WithContext(std::string_view context) const;

  Status(const Status& other);
  Status& operator=(const Status& other);
  Status(Status&&) noexcept = default;
  Status& operator=(Status&&) noexcept = default;

  friend bool operator==(const Status& a, const Status& b) {
    return a.code() == b.code() && a.message() == b.message();
  }

 private:
  struct State {
    StatusCode code;
    std::string message;
  };
  std::unique_ptr<State> state_;
};

inline std::ostream& operator<<(std::ostream& os, const Status& s) { return os << s.ToString(); }

FERRY_API Status CancelledError(std::string_view message);
FERRY_API Status InvalidArgumentError(std::string_view message);
FERRY_API Status OutOfRangeError(std::string_view message);
FERRY_API Status NotFoundError(std::string_view message);
FERRY_API Status AlreadyExistsError(std::string_view message);
FERRY_API Status DeadlineExceededError(std::string_view message);
FERRY_API Status ResourceExhaustedError(std::string_view message);
FERRY_API Status UnavailableError(std::string_view message);
FERRY_API Status UnimplementedError(std::string_view message);
FERRY_API Status FailedPreconditionError(std::string_view message);
FERRY_API Status InternalError(std::string_view message);
FERRY_API Status DataLossError(std::string_view message);

// Converts an errno value: "context: strerror(errno)". Codes map to the nearest StatusCode.
FERRY_API Status ErrnoError(std::string_view context, int errno_value);

template <typename T>
class [[nodiscard]] StatusOr {
 public:
  StatusOr(const Status& status) : status_(status) { Check(); }  // NOLINT: implicit by design
  StatusOr(Status&& status) : status_(std::move(status)) { Check(); }  // NOLINT
  StatusOr(T value) : value_(std::move(value)) {}                      // NOLINT

  bool ok() const { return status_.ok(); }
  const Status& status() const& { return status_; }
  Status status() && { return std::move(status_); }

  // Precondition: ok().
  T& value() & { return *value_; }
  const T& value() const& { return *value_; }
  T&& value() && { return std::move(*value_); }
  T& operator*() & { return *value_; }
  const T& operator*() const& { return *value_; }
  T&& operator*() && { return std::move(*value_); }
  T* operator->() { return &*value_; }
  const T* operator->() const { return &*value_; }

 private:
  void Check() {
    // (void): nvcc's front end warns on discarding operator='s result of a [[nodiscard]] type.
    if (status_.ok()) (void)(status_ = InternalError("StatusOr constructed from an OK status"));
  }
  Status status_;
  std::optional<T> value_;
};

}  // namespace ferry

#define FERRY_CONCAT_INNER_(a, b) a##b
#define FERRY_CONCAT_(a, b) FERRY_CONCAT_INNER_(a, b)

#define RETURN_IF_ERROR(expr)                          \
  do {                                                 \
    ::ferry::Status ferry_status_ = (expr);            \
    if (!ferry_status_.ok()) return ferry_status_;     \
  } while (0)

#define ASSIGN_OR_RETURN(lhs, expr) \
  ASSIGN_OR_RETURN_IMPL_(FERRY_CONCAT_(ferry_statusor_, __LINE__), lhs, expr)
#define ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                           \
  if (!tmp.ok()) return std::move(tmp).status(); \
  lhs = std::move(tmp).value()
