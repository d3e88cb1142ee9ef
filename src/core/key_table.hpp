// The key-table mechanism of every config struct (include/mixprec/core/keys.hpp): a table
// of keys, each a Spec (name, kind, range, doc) bound to a member, gives parsing from text
// and JSON, the range checks, the JSON echo and the text of each value. Private: the JSON
// types stay out of the public headers.
#pragma once

#include <nlohmann/json.hpp>

#include <algorithm>
#include <functional>
#include <limits>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "mixprec/core/keys.hpp"
#include "mixprec/core/text.hpp"

namespace mixprec::keys {

// ---- JSON values -----------------------------------------------------------------------

// A JSON value in a message: its type, then its text (cut short): string "abc", array [1],
// boolean true; numbers and null as they are.
template <class Json>
std::string describe(const Json& v) {
  std::string t = v.dump(-1, ' ', false, Json::error_handler_t::replace);
  if (t.size() > 60) t = t.substr(0, 57) + "...";
  if (v.is_number() || v.is_null()) return t;
  return std::string(v.type_name()) + " " + t;
}

// The integer a JSON number holds (2, -3, 2.0, 2e5; not 2.5 or 1e300).
template <class Json>
std::optional<Integer> json_integer(const Json& v) {
  if (v.is_number_unsigned()) return Integer::of(v.template get<std::uint64_t>());
  if (v.is_number_integer()) return Integer::of(v.template get<std::int64_t>());
  if (v.is_number_float()) return integer_of(v.template get<double>());
  return std::nullopt;
}

// A JSON value to a value of the key's kind within its range (std::invalid_argument
// "KEY: expected ALLOWED, found VALUE" otherwise). A number key with a none word takes
// null for it.
template <class Json>
Value from_json(const Spec& s, const Json& v) {
  const auto wrong = [&](const std::string& expected) { fail(s.name, expected, describe(v)); };
  Value out;
  switch (s.kind) {
    case Kind::integer: {
      const auto i = json_integer(v);
      if (!i) wrong(allowed(s));
      out = *i;
      break;
    }
    case Kind::number:
      if (v.is_null() && s.none) {
        out = *s.none;
      } else {
        if (!v.is_number()) wrong(allowed(s) + (s.none ? " (none is null)" : ""));
        const double d = v.template get<double>();
        out = d == 0 ? 0.0 : d;  // -0 reads as 0
      }
      break;
    case Kind::boolean:
      if (!v.is_boolean()) wrong(allowed(s));
      out = v.template get<bool>();
      break;
    case Kind::choice:
    case Kind::text:
      if (!v.is_string()) wrong(allowed(s));
      out = v.template get<std::string>();
      break;
    case Kind::list: {
      Spec one = s;
      one.kind = Kind::integer;
      one.expected.clear();
      if (!v.is_array()) wrong("an array of " + allowed_items(s));
      std::vector<Integer> items;
      for (const Json& e : v) {
        const auto i = json_integer(e);
        if (!i) fail(s.name, allowed(one), describe(e));
        items.push_back(*i);
      }
      out = std::move(items);
      break;
    }
  }
  check(s, out);
  return out;
}

template <class Json>
Json to_json(const Spec& s, const Value& v) {
  if (const auto* i = std::get_if<Integer>(&v)) {
    if (!i->negative) return Json(i->magnitude);
    return Json(-static_cast<std::int64_t>(i->magnitude - 1) - 1);
  }
  if (const auto* d = std::get_if<double>(&v)) return s.none && *d == *s.none ? Json(nullptr) : Json(*d);
  if (const auto* b = std::get_if<bool>(&v)) return Json(*b);
  if (const auto* t = std::get_if<std::string>(&v)) return Json(*t);
  if (const auto* l = std::get_if<std::vector<Integer>>(&v)) {
    Json a = Json::array();
    for (const Integer& e : *l) a.push_back(to_json<Json>(Spec{.kind = Kind::integer}, Value(e)));
    return a;
  }
  return Json(std::get<Invalid>(v).what);
}

// ---- a key bound to a member -------------------------------------------------------------

struct NoExtra {};

template <class C, class Extra = NoExtra>
struct Key {
  Spec spec;
  std::function<Value(const C&)> get;
  std::function<void(C&, const Value&)> set;  // the value is of the spec's kind and within its range
  std::function<void(const C&)> check;        // a rule of its own beyond the range (may be empty)
  Extra extra{};                              // what one config adds (the CLI's flags, ...)
};

// `ref` returns a reference to the member for a const or non-const config: a generic lambda
// [](auto& c) -> auto& { return c.model.layers; }.

// An integral member; the spec's range is narrowed to what the member's type holds.
template <class C, class Extra = NoExtra, class Ref>
Key<C, Extra> integer_key(Spec s, Ref ref, std::function<void(const C&)> check = {}, Extra extra = {}) {
  using T = std::remove_cvref_t<decltype(ref(std::declval<C&>()))>;
  static_assert(std::is_integral_v<T> && !std::is_same_v<T, bool>);
  s.kind = Kind::integer;
  if constexpr (std::is_signed_v<T>) {
    s.int_min = std::max<std::int64_t>(s.int_min, std::numeric_limits<T>::min());
    s.int_max = std::min<std::uint64_t>(s.int_max, static_cast<std::uint64_t>(std::numeric_limits<T>::max()));
  } else {
    s.int_min = std::max<std::int64_t>(s.int_min, 0);
    s.int_max = std::min<std::uint64_t>(s.int_max, std::numeric_limits<T>::max());
  }
  return {std::move(s),
          [ref](const C& c) -> Value {
            const T v = ref(c);
            if constexpr (std::is_signed_v<T>) return Integer::of(static_cast<std::int64_t>(v));
            else return Integer::of(static_cast<std::uint64_t>(v));
          },
          [ref](C& c, const Value& v) {
            const Integer& i = std::get<Integer>(v);
            ref(c) = i.negative ? static_cast<T>(-static_cast<std::int64_t>(i.magnitude - 1) - 1)
                                : static_cast<T>(i.magnitude);
          },
          std::move(check), std::move(extra)};
}

template <class C, class Extra = NoExtra, class Ref>
Key<C, Extra> number_key(Spec s, Ref ref, std::function<void(const C&)> check = {}, Extra extra = {}) {
  s.kind = Kind::number;
  return {std::move(s), [ref](const C& c) -> Value { return static_cast<double>(ref(c)); },
          [ref](C& c, const Value& v) { ref(c) = std::get<double>(v); }, std::move(check), std::move(extra)};
}

template <class C, class Extra = NoExtra, class Ref>
Key<C, Extra> bool_key(Spec s, Ref ref, std::function<void(const C&)> check = {}, Extra extra = {}) {
  s.kind = Kind::boolean;
  return {std::move(s), [ref](const C& c) -> Value { return static_cast<bool>(ref(c)); },
          [ref](C& c, const Value& v) { ref(c) = std::get<bool>(v); }, std::move(check), std::move(extra)};
}

// A std::string member: free text (Kind::text) or one of spec.choices (Kind::choice).
template <class C, class Extra = NoExtra, class Ref>
Key<C, Extra> string_key(Spec s, Ref ref, std::function<void(const C&)> check = {}, Extra extra = {}) {
  if (s.kind != Kind::choice) s.kind = Kind::text;
  return {std::move(s), [ref](const C& c) -> Value { return std::string(ref(c)); },
          [ref](C& c, const Value& v) { ref(c) = std::get<std::string>(v); }, std::move(check), std::move(extra)};
}

// An enum member named by its own table: spec.choices are the names, `parse` maps a name
// to its enumerator. A value no name stands for is Invalid ("enum value 9").
template <class C, class Extra = NoExtra, class Ref, class Parse>
Key<C, Extra> enum_key(Spec s, Ref ref, Parse parse, std::function<void(const C&)> check = {}, Extra extra = {}) {
  s.kind = Kind::choice;
  const std::vector<std::string> names = s.choices;
  return {std::move(s),
          [ref, parse, names](const C& c) -> Value {
            const auto e = ref(c);
            for (const std::string& n : names)
              if (const auto p = parse(n); p && *p == e) return n;
            return Invalid{"enum value " + std::to_string(static_cast<long long>(e))};
          },
          [ref, parse](C& c, const Value& v) { ref(c) = *parse(std::get<std::string>(v)); }, std::move(check),
          std::move(extra)};
}

// A std::vector of integers.
template <class C, class Extra = NoExtra, class Ref>
Key<C, Extra> list_key(Spec s, Ref ref, std::function<void(const C&)> check = {}, Extra extra = {}) {
  using T = typename std::remove_cvref_t<decltype(ref(std::declval<C&>()))>::value_type;
  static_assert(std::is_unsigned_v<T>);
  s.kind = Kind::list;
  s.int_min = std::max<std::int64_t>(s.int_min, 0);
  s.int_max = std::min<std::uint64_t>(s.int_max, std::numeric_limits<T>::max());
  return {std::move(s),
          [ref](const C& c) -> Value {
            std::vector<Integer> out;
            for (const T e : ref(c)) out.push_back(Integer::of(static_cast<std::uint64_t>(e)));
            return out;
          },
          [ref](C& c, const Value& v) {
            auto& m = ref(c);
            m.clear();
            for (const Integer& e : std::get<std::vector<Integer>>(v)) m.push_back(static_cast<T>(e.magnitude));
          },
          std::move(check), std::move(extra)};
}

// ---- the table -------------------------------------------------------------------------

template <class C, class Extra = NoExtra>
class KeyTable {
 public:
  using KeyType = Key<C, Extra>;

  explicit KeyTable(std::vector<KeyType> keys) : keys_(std::move(keys)) {
    for (std::size_t i = 0; i < keys_.size(); ++i)
      for (std::size_t j = 0; j < i; ++j)
        if (keys_[i].spec.name == keys_[j].spec.name)
          throw std::logic_error("key table: '" + keys_[i].spec.name + "' is listed twice");
  }

  const std::vector<KeyType>& keys() const noexcept { return keys_; }

  const KeyType* find(std::string_view name) const noexcept {
    for (const KeyType& k : keys_)
      if (k.spec.name == name) return &k;
    return nullptr;
  }

  std::vector<std::string> names() const {
    std::vector<std::string> n;
    for (const KeyType& k : keys_) n.push_back(k.spec.name);
    return n;
  }

  // "unknown key 'x'; known keys: a, b, c".
  [[noreturn]] void unknown(std::string_view name) const {
    throw std::invalid_argument("unknown key " + mixprec::text::squote(name) + "; known keys: " + join(names(), ", "));
  }

  const KeyType& at(std::string_view name) const {
    const KeyType* k = find(name);
    if (k == nullptr) unknown(name);
    return *k;
  }

  // Sets one key from its text; on an error c is unchanged.
  void set_text(C& c, std::string_view name, std::string_view text) const {
    const KeyType& k = at(name);
    assign(c, k, parse_text(k.spec, text));
  }

  // Sets one key from a JSON value; on an error c is unchanged.
  template <class Json>
  void set_json(C& c, const KeyType& k, const Json& v) const {
    assign(c, k, from_json(k.spec, v));
  }

  // Every key's range and own rule, in table order.
  void check(const C& c) const {
    for (const KeyType& k : keys_) {
      keys::check(k.spec, k.get(c));
      if (k.check) k.check(c);
    }
  }

  // One JSON object, the keys in table order (Json = ordered_json) or sorted (json).
  template <class Json>
  Json to_json(const C& c) const {
    Json j = Json::object();
    for (const KeyType& k : keys_) j[k.spec.name] = keys::to_json<Json>(k.spec, k.get(c));
    return j;
  }

  std::string text(const C& c, std::string_view name) const {
    const KeyType& k = at(name);
    return text_of(k.spec, k.get(c));
  }

 private:
  static void assign(C& c, const KeyType& k, const Value& v) {
    C copy = c;
    k.set(copy, v);
    if (k.check) k.check(copy);
    c = std::move(copy);
  }

  std::vector<KeyType> keys_;
};

}  // namespace mixprec::keys
