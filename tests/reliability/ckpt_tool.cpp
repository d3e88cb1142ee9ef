// ckpt_tool: the helper of the reliability tests (tests/reliability/*.sh).
//
//   ckpt_tool compare A B [--ignore-config KEY]...
//       Two trainer checkpoints hold the same state: the same tensors (names, order,
//       dtypes, shapes, bytes) and the same metadata, except what legitimately differs
//       between an interrupted-and-resumed run and an uninterrupted one:
//       "mixprec.totals".seconds (wall-clock training time) and, in "mixprec.config",
//       "out" and "resume" (the run folder) plus any --ignore-config KEY (settings that
//       do not change the trajectory, e.g. checkpoint-every). Exit 0 equal, 1 different
//       (every difference listed), 2 unreadable.
//   ckpt_tool logs A B
//       Two log.jsonl files have the same lines, byte for byte, once the wall-clock
//       fields "seconds" and "scaler_seconds" are removed from each. Exit 0 / 1 / 2.
//   ckpt_tool set-meta IN OUT KEY VALUE
//       Writes OUT: the checkpoint IN with metadata KEY set to VALUE (checksums are
//       recomputed, the header checksum too when IN has one, so OUT is a valid file
//       that only differs in KEY; "mixprec.version" 1 writes no header checksum, as
//       format version 1 did). Exit 0 / 2.
#include <cstdio>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "mixprec/checkpoint/safetensors.hpp"

namespace {

using mixprec::ckpt::SafetensorsFile;
using mixprec::ckpt::TensorInfo;
using mixprec::ckpt::TensorRef;
using nlohmann::ordered_json;

int differences = 0;

void differ(const std::string& what) {
  std::fprintf(stderr, "DIFF: %s\n", what.c_str());
  ++differences;
}

std::string shape_text(const std::vector<std::uint64_t>& s) {
  std::string out = "[";
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (i != 0) out.push_back(',');
    out.append(std::to_string(s[i]));
  }
  out.push_back(']');
  return out;
}

// The metadata value with the legitimately differing fields removed (JSON re-dumped).
std::string normalized(const std::string& key, const std::string& value, const std::set<std::string>& ignore_config) {
  if (key != "mixprec.totals" && key != "mixprec.config") return value;
  ordered_json j = ordered_json::parse(value);
  if (key == "mixprec.totals") {
    j.erase("seconds");
  } else {
    j.erase("out");
    j.erase("resume");
    for (const std::string& k : ignore_config) j.erase(k);
  }
  return j.dump();
}

int compare(const std::string& a_path, const std::string& b_path, const std::set<std::string>& ignore_config) {
  const SafetensorsFile a = SafetensorsFile::open(a_path);
  const SafetensorsFile b = SafetensorsFile::open(b_path);
  const auto& ta = a.tensors();
  const auto& tb = b.tensors();
  if (ta.size() != tb.size()) differ("tensor count " + std::to_string(ta.size()) + " vs " + std::to_string(tb.size()));
  for (std::size_t i = 0; i < std::min(ta.size(), tb.size()); ++i) {
    const TensorInfo& x = ta[i];
    const TensorInfo& y = tb[i];
    if (x.name != y.name || x.dtype != y.dtype || x.shape != y.shape || x.begin != y.begin || x.end != y.end) {
      differ("tensor #" + std::to_string(i) + ": " + x.name + " " + shape_text(x.shape) + " vs " + y.name + " " +
             shape_text(y.shape));
      continue;
    }
    const auto bx = a.bytes(x.name);
    const auto by = b.bytes(y.name);
    for (std::size_t k = 0; k < bx.size(); ++k) {
      if (bx[k] != by[k]) {
        differ("tensor '" + x.name + "': first differing byte at " + std::to_string(k) + " of " +
               std::to_string(bx.size()));
        break;
      }
    }
  }
  const auto& ma = a.metadata();
  const auto& mb = b.metadata();
  for (const auto& [k, v] : ma) {
    const auto it = mb.find(k);
    if (it == mb.end()) {
      differ("metadata '" + k + "' only in " + a_path);
      continue;
    }
    if (normalized(k, v, ignore_config) != normalized(k, it->second, ignore_config))
      differ("metadata '" + k + "': " + v + "\n   vs " + it->second);
  }
  for (const auto& [k, v] : mb)
    if (ma.find(k) == ma.end()) differ("metadata '" + k + "' only in " + b_path);
  if (differences == 0)
    std::printf("same state: %zu tensors, %zu metadata entries (%s)\n", ta.size(), ma.size(), a_path.c_str());
  return differences == 0 ? 0 : 1;
}

std::vector<std::string> read_lines(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read '" + path + "'");
  std::ostringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();
  if (!text.empty() && text.back() != '\n') throw std::runtime_error("'" + path + "' does not end with a newline");
  std::vector<std::string> lines;
  for (std::size_t pos = 0; pos < text.size();) {
    const std::size_t nl = text.find('\n', pos);
    lines.push_back(text.substr(pos, nl - pos));
    pos = nl + 1;
  }
  return lines;
}

// The line without its wall-clock fields; the rest byte for byte.
std::string without_timing(const std::string& line) {
  if (!ordered_json::accept(line)) throw std::runtime_error("malformed JSON line: " + line.substr(0, 120));
  std::string out = line;
  for (const std::string key : {"\"seconds\":", "\"scaler_seconds\":"}) {
    const std::size_t at = out.find(key);
    if (at == std::string::npos) continue;
    std::size_t end = out.find_first_of(",}", at + key.size());
    if (end != std::string::npos && out[end] == ',') ++end;
    out.erase(at, end - at);
  }
  return out;
}

int logs(const std::string& a_path, const std::string& b_path) {
  const auto a = read_lines(a_path);
  const auto b = read_lines(b_path);
  if (a.size() != b.size()) differ("line count " + std::to_string(a.size()) + " vs " + std::to_string(b.size()));
  for (std::size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    const std::string x = without_timing(a[i]);
    const std::string y = without_timing(b[i]);
    if (x.size() == a[i].size()) differ("line " + std::to_string(i + 1) + " of " + a_path + " has no timing fields");
    if (x != y) differ("line " + std::to_string(i + 1) + ":\n   " + x + "\n   vs " + y);
  }
  if (differences == 0) std::printf("same log: %zu lines (%s)\n", a.size(), a_path.c_str());
  return differences == 0 ? 0 : 1;
}

int set_meta(const std::string& in, const std::string& out, const std::string& key, const std::string& value) {
  const SafetensorsFile f = SafetensorsFile::open(in);
  std::vector<TensorRef> tensors;
  for (const TensorInfo& t : f.tensors()) tensors.push_back({t.name, t.dtype, t.shape, f.bytes(t.name)});
  std::map<std::string, std::string> meta;
  for (const auto& [k, v] : f.metadata())
    if (k.rfind("mixprec.checksum.", 0) != 0) meta[k] = v;
  meta[key] = value;
  mixprec::ckpt::WriteOptions options;
  options.fsync = false;
  // A new one over the changed header; none for version 1 (as version 1 files were written).
  options.header_checksum = f.header_checked() && !(key == "mixprec.version" && value == "1");
  mixprec::ckpt::write_file(out, tensors, meta, options);
  return 0;
}

int usage() {
  std::fprintf(stderr,
               "usage: ckpt_tool compare A B [--ignore-config KEY]... | logs A B | set-meta IN OUT KEY VALUE\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  try {
    if (args.size() >= 3 && args[0] == "compare") {
      std::set<std::string> ignore;
      for (std::size_t i = 3; i < args.size(); i += 2) {
        if (args[i] != "--ignore-config" || i + 1 >= args.size()) return usage();
        ignore.insert(args[i + 1]);
      }
      return compare(args[1], args[2], ignore);
    }
    if (args.size() == 3 && args[0] == "logs") return logs(args[1], args[2]);
    if (args.size() == 5 && args[0] == "set-meta") return set_meta(args[1], args[2], args[3], args[4]);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ckpt_tool: error: %s\n", e.what());
    return 2;
  }
  return usage();
}
