#include "common/strings.h"

#include <gtest/gtest.h>

namespace ferry {
namespace {

TEST(SplitCommaListTest, DropsEmptyItemsAndKeepsOrder) {
  EXPECT_EQ(SplitCommaList("rdmap79s0-rdm,rdmap80s0-rdm"),
            (std::vector<std::string>{"rdmap79s0-rdm", "rdmap80s0-rdm"}));
  EXPECT_EQ(SplitCommaList(",shm,,tcp;ofi_rxm,"),
            (std::vector<std::string>{"shm", "tcp;ofi_rxm"}));
  EXPECT_TRUE(SplitCommaList("").empty());
  EXPECT_TRUE(SplitCommaList(",,").empty());
  EXPECT_EQ(SplitCommaList("one"), std::vector<std::string>{"one"});
}

}  // namespace
}  // namespace ferry
