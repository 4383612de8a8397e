#include "ferry/status.h"

#include <gtest/gtest.h>

#include <cerrno>

namespace ferry {
namespace {

StatusOr<int> Half(int x) {
  if (x % 2) return InvalidArgumentError("odd: " + std::to_string(x));
  return x / 2;
}

Status Quarter(int x, int* out) {
  ASSIGN_OR_RETURN(int h, Half(x));
  ASSIGN_OR_RETURN(*out, Half(h));
  return Status::Ok();
}

TEST(StatusTest, OkCarriesNothing) {
  Status s;
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kOk);
  EXPECT_EQ(s.ToString(), "OK");
  EXPECT_TRUE(s.WithContext("ctx").ok());
}

TEST(StatusTest, ErrorsCarryCodeMessageAndContext) {
  Status s = OutOfRangeError("offset 9 past 8");
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.ToString(), "OutOfRange: offset 9 past 8");
  Status c = s.WithContext("peer 3");
  EXPECT_EQ(c.code(), StatusCode::kOutOfRange);
  EXPECT_EQ(c.message(), "peer 3: offset 9 past 8");
  Status copy = c;
  EXPECT_EQ(copy, c);
}

TEST(StatusTest, MacrosPropagate) {
  int out = 0;
  EXPECT_TRUE(Quarter(8, &out).ok());
  EXPECT_EQ(out, 2);
  Status s = Quarter(6, &out);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "odd: 3");
}

TEST(StatusTest, StatusOrFromOkStatusIsAnError) {
  StatusOr<int> v(Status::Ok());
  EXPECT_FALSE(v.ok());
  EXPECT_EQ(v.status().code(), StatusCode::kInternal);
}

TEST(StatusTest, ErrnoMapsToNearestCode) {
  EXPECT_EQ(ErrnoError("x", ECONNRESET).code(), StatusCode::kUnavailable);
  EXPECT_EQ(ErrnoError("x", ETIMEDOUT).code(), StatusCode::kDeadlineExceeded);
  EXPECT_EQ(ErrnoError("x", EIO).code(), StatusCode::kInternal);
  EXPECT_NE(ErrnoError("open", ENOENT).message().find("open: "), std::string::npos);
}

}  // namespace
}  // namespace ferry
