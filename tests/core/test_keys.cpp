// The number grammar every config key reads (core/keys.hpp), as a table of texts and what
// each reads as, and the words and checks of a key's description (allowed, text_of,
// parse_text, check). Each config's own keys are tested with it (tests/run/test_config.cpp,
// tests/scaler/test_loss_scale.cpp).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "mixprec/core/keys.hpp"

namespace mixprec::keys {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

TEST(NumberGrammar, EveryFormReadsAsItsValue) {
  struct Case {
    const char* text;
    std::optional<double> value;  // nullopt: refused
    NumberProblem problem = NumberProblem::none;
  };
  const Case cases[] = {
      {"3", 3.0},
      {"-2.5", -2.5},
      {"+2.5", 2.5},
      {".5", 0.5},
      {"5.", 5.0},
      {"2e3", 2000.0},
      {"1.5E-7", 1.5e-7},
      {"1e+2", 100.0},
      {"0x1p-24", 0x1p-24},
      {"0X1.8P3", 12.0},
      {"-0x10", -16.0},
      {"0x.8", 0.5},
      {"inf", kInf},
      {"-Infinity", -kInf},
      {"INF", kInf},
      {"4.9e-324", 4.9e-324},             // the smallest subnormal: still told from 0
      {"1.7976931348623157e308", 1.7976931348623157e308},
      {"1e400", std::nullopt, NumberProblem::out_of_range},
      {"-1e400", std::nullopt, NumberProblem::out_of_range},
      {"1e-400", std::nullopt, NumberProblem::out_of_range},  // not rounded to 0
      {"", std::nullopt, NumberProblem::not_a_number},
      {"+", std::nullopt, NumberProblem::not_a_number},
      {"+-1", std::nullopt, NumberProblem::not_a_number},
      {"--1", std::nullopt, NumberProblem::not_a_number},
      {" 1", std::nullopt, NumberProblem::not_a_number},
      {"1 ", std::nullopt, NumberProblem::not_a_number},
      {"1,000", std::nullopt, NumberProblem::not_a_number},
      {"1_000", std::nullopt, NumberProblem::not_a_number},
      {"1e", std::nullopt, NumberProblem::not_a_number},
      {"e5", std::nullopt, NumberProblem::not_a_number},
      {"0x", std::nullopt, NumberProblem::not_a_number},
      {"0xinf", std::nullopt, NumberProblem::not_a_number},
      {"1p4", std::nullopt, NumberProblem::not_a_number},
      {"3e-3x", std::nullopt, NumberProblem::not_a_number},
      {"one", std::nullopt, NumberProblem::not_a_number},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.text);
    NumberProblem p = NumberProblem::none;
    const auto v = parse_number(c.text, &p);
    EXPECT_EQ(v, c.value);
    EXPECT_EQ(p, c.problem);
  }
  EXPECT_TRUE(std::isnan(*parse_number("nan")));
  EXPECT_TRUE(std::isnan(*parse_number("-NaN")));
  // The grammar keeps the sign of zero (mixprec formats --value -0); a key reads it as 0.
  EXPECT_TRUE(std::signbit(*parse_number("-0")));
  const Spec s{.name = "x", .kind = Kind::number};
  EXPECT_FALSE(std::signbit(std::get<double>(parse_text(s, "-0"))));
  EXPECT_FALSE(std::signbit(std::get<double>(parse_text(s, "-0.0e5"))));
}

TEST(NumberGrammar, IntegersAreWholeNumbers) {
  struct Case {
    const char* text;
    std::optional<Integer> value;
  };
  const Case cases[] = {
      {"0", Integer{}},
      {"-0", Integer{}},  // no negative zero
      {"+7", Integer{false, 7}},
      {"-64", Integer{true, 64}},
      {"20.0", Integer{false, 20}},  // torch.amp's growth_interval=20.0
      {"2e3", Integer{false, 2000}},
      {"-1e2", Integer{true, 100}},
      {"1.5e1", Integer{false, 15}},
      {"9007199254740992", Integer{false, 9007199254740992}},
      {"9007199254740992.0", Integer{false, 9007199254740992}},  // 2^53: a double holds every integer up to here
      {"18446744073709551615", Integer{false, 18446744073709551615ull}},  // digits: exact over 64 bits
      {"-18446744073709551615", Integer{true, 18446744073709551615ull}},
      {"18446744073709551616", std::nullopt},  // past 64 bits
      {"9007199254740994.0", std::nullopt},    // past 2^53 written as a float
      {"1e17", std::nullopt},
      {"2.9", std::nullopt},
      {"0.5", std::nullopt},
      {"1e-1", std::nullopt},
      {"0x10", std::nullopt},  // hex is for numbers
      {"0x1p4", std::nullopt},
      {"inf", std::nullopt},
      {"nan", std::nullopt},
      {"1e400", std::nullopt},
      {"", std::nullopt},
      {"1 ", std::nullopt},
      {"--1", std::nullopt},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.text);
    EXPECT_EQ(parse_integer(c.text), c.value);
  }
  EXPECT_EQ(integer_of(-0.0), Integer{});
  EXPECT_EQ(integer_of(12.0), (Integer{false, 12}));
  EXPECT_EQ(integer_of(0x1p53), (Integer{false, 9007199254740992}));
  EXPECT_EQ(integer_of(0x1p53 + 2), std::nullopt);
  EXPECT_EQ(integer_of(kInf), std::nullopt);
  EXPECT_EQ(Integer::of(std::numeric_limits<std::int64_t>::min()),
            (Integer{true, 9223372036854775808ull}));
  EXPECT_EQ(Integer::of(std::int64_t{-1}).text(), "-1");
}

TEST(NumberGrammar, Booleans) {
  EXPECT_EQ(parse_bool("true"), true);
  EXPECT_EQ(parse_bool("1"), true);
  EXPECT_EQ(parse_bool("false"), false);
  EXPECT_EQ(parse_bool("0"), false);
  for (const char* t : {"", "yes", "True", "on", "2", "0.0"}) EXPECT_EQ(parse_bool(t), std::nullopt) << t;
}

TEST(KeySpec, AllowedWordsFollowTheRange) {
  auto integer = [](std::int64_t lo, std::uint64_t hi) {
    return allowed(Spec{.name = "k", .kind = Kind::integer, .int_min = lo, .int_max = hi});
  };
  constexpr auto kMax = std::numeric_limits<std::uint64_t>::max();
  constexpr auto kMin = std::numeric_limits<std::int64_t>::min();
  EXPECT_EQ(integer(1, 64), "an integer in [1, 64]");
  EXPECT_EQ(integer(-64, 64), "an integer in [-64, 64]");
  EXPECT_EQ(integer(0, kMax), "a non-negative integer");
  EXPECT_EQ(integer(1, kMax), "an integer >= 1");
  EXPECT_EQ(integer(kMin, 5), "an integer <= 5");
  EXPECT_EQ(integer(kMin, kMax), "an integer");
  auto number = [](double lo, bool lo_open, double hi, bool hi_open, bool allow_inf = false,
                   std::optional<double> none = std::nullopt) {
    return allowed(Spec{.name = "k",
                        .kind = Kind::number,
                        .lo = lo,
                        .hi = hi,
                        .lo_open = lo_open,
                        .hi_open = hi_open,
                        .allow_inf = allow_inf,
                        .none = none});
  };
  EXPECT_EQ(number(0, true, kInf, false), "a finite number > 0");
  EXPECT_EQ(number(0, false, kInf, false), "a finite number >= 0");
  EXPECT_EQ(number(0, false, 1, true), "a number in [0, 1)");
  EXPECT_EQ(number(0, true, 0.5, false), "a number in (0, 0.5]");
  EXPECT_EQ(number(-kInf, false, 3, true), "a finite number < 3");
  EXPECT_EQ(number(-kInf, false, kInf, false), "a finite number");
  EXPECT_EQ(number(0, true, kInf, false, true, kInf), "a number > 0, inf or none");
  EXPECT_EQ(number(0, false, kInf, false, false, 0.0), "a finite number >= 0 or none");
  EXPECT_EQ(allowed(Spec{.name = "k", .kind = Kind::choice, .choices = {"a"}}), "a");
  EXPECT_EQ(allowed(Spec{.name = "k", .kind = Kind::choice, .choices = {"a", "b"}}), "a or b");
  EXPECT_EQ(allowed(Spec{.name = "k", .kind = Kind::choice, .choices = {"a", "b", "c"}}), "a, b or c");
  EXPECT_EQ(allowed(Spec{.name = "k", .kind = Kind::boolean}), "true or false");
  EXPECT_EQ(allowed(Spec{.name = "k", .kind = Kind::text}), "a string");
  EXPECT_EQ(allowed(Spec{.name = "k", .kind = Kind::list, .int_min = 1, .int_max = kMax}),
            "integers >= 1 separated by commas (e.g. 5,17)");
  EXPECT_EQ(allowed(Spec{.name = "k", .kind = Kind::number, .expected = "in words"}), "in words");
}

TEST(KeySpec, ParseCheckAndWriteBack) {
  const Spec count{.name = "n", .kind = Kind::integer, .int_min = 1, .int_max = 10};
  EXPECT_EQ(std::get<Integer>(parse_text(count, "1e1")), (Integer{false, 10}));
  EXPECT_EQ(error_of([&] { (void)parse_text(count, "11"); }), "n: expected an integer in [1, 10], found 11");
  EXPECT_EQ(error_of([&] { (void)parse_text(count, "-3"); }), "n: expected an integer in [1, 10], found -3");
  EXPECT_EQ(error_of([&] { (void)parse_text(count, "2.9"); }), "n: expected an integer in [1, 10], found '2.9'");
  EXPECT_EQ(error_of([&] { check(count, Integer{false, 0}); }), "n: expected an integer in [1, 10], found 0");
  EXPECT_EQ(error_of([&] { check(count, Invalid{"enum value 9"}); }),
            "n: expected an integer in [1, 10], found enum value 9");

  const Spec cap{.name = "cap", .kind = Kind::number, .lo = 0, .lo_open = true, .allow_inf = true, .none = kInf};
  EXPECT_EQ(std::get<double>(parse_text(cap, "none")), kInf);
  EXPECT_EQ(std::get<double>(parse_text(cap, "inf")), kInf);
  EXPECT_EQ(text_of(cap, Value(kInf)), "none");
  EXPECT_EQ(text_of(cap, Value(0x1p20)), "1048576");
  EXPECT_EQ(error_of([&] { (void)parse_text(cap, "-inf"); }), "cap: expected a number > 0, inf or none, found -inf");
  EXPECT_EQ(error_of([&] { (void)parse_text(cap, "nan"); }), "cap: expected a number > 0, inf or none, found nan");

  const Spec finite{.name = "lr", .kind = Kind::number, .lo = 0, .lo_open = true};
  EXPECT_EQ(error_of([&] { (void)parse_text(finite, "inf"); }), "lr: expected a finite number > 0, found inf");
  EXPECT_EQ(error_of([&] { (void)parse_text(finite, "none"); }), "lr: expected a finite number > 0, found 'none'");

  const Spec steps{.name = "at", .kind = Kind::list, .int_min = 1, .int_max = 100};
  EXPECT_EQ(std::get<std::vector<Integer>>(parse_text(steps, "5,1.7e1")),
            (std::vector<Integer>{{false, 5}, {false, 17}}));
  EXPECT_EQ(std::get<std::vector<Integer>>(parse_text(steps, "")), std::vector<Integer>{});
  EXPECT_EQ(text_of(steps, parse_text(steps, "5,17")), "5,17");
  EXPECT_EQ(error_of([&] { (void)parse_text(steps, "5,,6"); }),
            "at: expected integers in [1, 100] separated by commas (e.g. 5,17), found '5,,6'");
  EXPECT_EQ(error_of([&] { (void)parse_text(steps, "5,101"); }), "at: expected an integer in [1, 100], found 101");

  const Spec pick{.name = "p", .kind = Kind::choice, .choices = {"max", "most_recent"}};
  EXPECT_EQ(error_of([&] { (void)parse_text(pick, "Max"); }), "p: expected max or most_recent, found 'Max'");
  EXPECT_EQ(std::get<std::string>(parse_text(pick, "max")), "max");
}

}  // namespace
}  // namespace mixprec::keys
