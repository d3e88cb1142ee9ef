// The format table's lists (include/mixprec/formats/format_table.hpp).
#include "mixprec/formats/format_table.hpp"

namespace mixprec {
namespace {

template <class Field>
std::string joined(const std::vector<FormatId>& formats, Field field) {
  std::string out;
  for (const FormatId f : formats) out.append(out.empty() ? "" : ", ").append(field(format_row(f)));
  return out;
}

}  // namespace

std::vector<FormatId> convertible_formats() {
  std::vector<FormatId> out;
  for (const FormatRow& r : kFormatTable)
    if (r.converts) out.push_back(r.id);
  return out;
}

std::string format_labels(const std::vector<FormatId>& formats) {
  return joined(formats, [](const FormatRow& r) { return r.label; });
}

std::string format_names(const std::vector<FormatId>& formats) {
  return joined(formats, [](const FormatRow& r) { return r.name; });
}

}  // namespace mixprec
