// Small string helpers shared by configuration parsing (environment, command lines).
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace ferry {

// "a,b,,c" -> {"a", "b", "c"}: comma-separated items, empty ones dropped.
inline std::vector<std::string> SplitCommaList(std::string_view list) {
  std::vector<std::string> out;
  for (size_t start = 0; start <= list.size();) {
    size_t end = list.find(',', start);
    if (end == std::string_view::npos) end = list.size();
    if (end > start) out.emplace_back(list.substr(start, end - start));
    start = end + 1;
  }
  return out;
}

}  // namespace ferry
