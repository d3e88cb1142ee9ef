// A fresh folder per test, removed with everything in it at the end (permissions a test
// took away are given back first).
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <set>
#include <string>

namespace mixprec::test {

class TempDir {
 public:
  // /tmp/mixprec_test_PREFIX_PID_TESTNAME, emptied first.
  explicit TempDir(const std::string& prefix) {
    path_ = std::filesystem::temp_directory_path() /
            ("mixprec_test_" + prefix + "_" + std::to_string(::getpid()) + "_" +
             ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::permissions(path_, std::filesystem::perms::owner_all, ec);
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::filesystem::path& path() const { return path_; }
  // The names of the entries in the folder.
  std::set<std::string> names() const {
    std::set<std::string> s;
    for (const auto& e : std::filesystem::directory_iterator(path_)) s.insert(e.path().filename().string());
    return s;
  }

 private:
  std::filesystem::path path_;
};

}  // namespace mixprec::test
