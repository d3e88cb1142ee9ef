// libFuzzer target: the mixprec command line (tools/mixprec/cli_app.cpp), parsing only.
// The input is split into arguments at NUL and newline bytes ("train\0--steps\0003"), after
// argv[0] = "mixprec"; CommandLine::parse registers every command and parses them, with
// the checks that run at parse time (numbers, names, --set key=value, ...). The parsed
// action is never run: no training, no benchmark, no file read or written.
// Every outcome must be an exit code (-1 parsed, 0 help/version, 2 bad command line):
// an exception escaping parse, a crash or a sanitizer report is a bug. See docs/fuzzing.md.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "cli_app.hpp"

namespace {
// More arguments than any real command line; keeps each input fast.
constexpr std::size_t kMaxArgs = 64;
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::vector<std::string> args{"mixprec"};
  std::string current;  // "a\0b" -> a, b; "a\0" -> a; "a\0\0" -> a, "" (an empty argument)
  for (std::size_t i = 0; i < size && args.size() < kMaxArgs; ++i) {
    const char c = static_cast<char>(data[i]);
    if (c == '\0' || c == '\n') {
      args.push_back(current);
      current.clear();
    } else {
      current += c;
    }
  }
  if (!current.empty() && args.size() < kMaxArgs) args.push_back(current);
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);

  mixprec::cli::CommandLine command_line;
  const int code = command_line.parse(static_cast<int>(args.size()), argv.data());
  if (code != -1 && code != 0 && code != 2) std::abort();
  return 0;
}
