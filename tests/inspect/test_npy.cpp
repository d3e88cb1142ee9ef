// .npy reading (every accepted variant, every validation error, every truncation, 20000
// random mutations) and the inspect analysis (hand-computed cases, thresholds, and an
// exact cross-check against convert_counted at every scale).
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <bit>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "mixprec/formats/bulk.hpp"
#include "mixprec/inspect/inspect.hpp"
#include "mixprec/inspect/npy.hpp"

namespace mixprec::monitor {
namespace {

namespace fs = std::filesystem;
using Bytes = std::vector<std::byte>;

constexpr std::string_view kName = "t.npy";

Bytes bytes_of(std::string_view s) {
  Bytes b(s.size());
  if (!s.empty()) std::memcpy(b.data(), s.data(), s.size());
  return b;
}

// The header NumPy writes: dict, spaces, '\n', the preamble plus header a multiple of 64.
Bytes npy_file(std::string_view dict, const Bytes& data, int major = 1, bool pad = true) {
  std::string header(dict);
  const std::size_t pre = major == 1 ? 10 : 12;
  if (pad) header.append((64 - (pre + header.size() + 1) % 64) % 64, ' ');
  header += '\n';
  Bytes out = bytes_of("\x93NUMPY");
  out.push_back(static_cast<std::byte>(major));
  out.push_back(std::byte{0});
  for (std::size_t i = 0; i < pre - 8; ++i) out.push_back(static_cast<std::byte>((header.size() >> (8 * i)) & 0xFF));
  const Bytes h = bytes_of(header);
  out.insert(out.end(), h.begin(), h.end());
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

std::string dict_of(std::string_view descr, std::string_view shape, bool fortran = false) {
  return std::string("{'descr': '").append(descr).append("', 'fortran_order': ").append(fortran ? "True" : "False")
      .append(", 'shape': ").append(shape).append(", }");
}

template <class U>
void put(Bytes& b, U v, bool big) {
  for (std::size_t i = 0; i < sizeof(U); ++i) {
    const std::size_t shift = 8 * (big ? sizeof(U) - 1 - i : i);
    b.push_back(static_cast<std::byte>((static_cast<std::uint64_t>(v) >> shift) & 0xFF));
  }
}
Bytes f4(const std::vector<float>& v, bool big = false) {
  Bytes b;
  for (const float x : v) put(b, std::bit_cast<std::uint32_t>(x), big);
  return b;
}
Bytes f2(const std::vector<std::uint16_t>& v, bool big = false) {
  Bytes b;
  for (const auto x : v) put(b, x, big);
  return b;
}
Bytes f8(const std::vector<double>& v, bool big = false) {
  Bytes b;
  for (const double x : v) put(b, std::bit_cast<std::uint64_t>(x), big);
  return b;
}

std::string error_of(const Bytes& b) {
  try {
    (void)parse_npy(b, kName);
  } catch (const std::runtime_error& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("(wrong exception type: ").append(e.what()).append(")");
  }
  return "(no exception)";
}

void expect_error(const Bytes& b, std::string_view fragment) {
  const std::string m = error_of(b);
  EXPECT_TRUE(m.starts_with("t.npy: ")) << m;
  EXPECT_NE(m.find(fragment), std::string::npos) << "message: " << m << "\nexpected to contain: " << fragment;
}

void expect_same_floats(const std::vector<float>& got, const std::vector<float>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < got.size(); ++i)
    EXPECT_EQ(std::bit_cast<std::uint32_t>(got[i]), std::bit_cast<std::uint32_t>(want[i])) << "value " << i;
}

// ---- accepted files -------------------------------------------------------------------

TEST(Npy, Float32LittleEndian) {
  const std::vector<float> v{1.0f, -2.5f, 0x1p-149f, -0.0f, std::numeric_limits<float>::infinity(), 3e38f};
  const Bytes file = npy_file(dict_of("<f4", "(2, 3)"), f4(v));
  ASSERT_EQ(file.size() % 64, 24u);  // header padded to 64: the data starts at byte 64
  const NpyArray a = parse_npy(file, kName);
  EXPECT_EQ(a.version_major, 1);
  EXPECT_EQ(a.dtype, "<f4");
  EXPECT_FALSE(a.fortran_order);
  EXPECT_EQ(a.shape, (std::vector<std::size_t>{2, 3}));
  expect_same_floats(a.values, v);
  EXPECT_EQ(shape_text(a.shape), "(2, 3)");
}

TEST(Npy, Float32BigEndian) {
  const std::vector<float> v{1.0f, -0x1.234568p-100f, 65504.0f};
  const NpyArray a = parse_npy(npy_file(dict_of(">f4", "(3,)"), f4(v, true)), kName);
  EXPECT_EQ(a.dtype, ">f4");
  expect_same_floats(a.values, v);
  EXPECT_EQ(shape_text(a.shape), "(3,)");
}

TEST(Npy, Float16BothEndians) {
  // 1, -2, 65504, 2^-24 (smallest subnormal), 2^-14 (smallest normal), inf
  const std::vector<std::uint16_t> bits{0x3c00, 0xc000, 0x7bff, 0x0001, 0x0400, 0x7c00};
  const std::vector<float> want{1.0f, -2.0f, 65504.0f, 0x1p-24f, 0x1p-14f, std::numeric_limits<float>::infinity()};
  for (const bool big : {false, true}) {
    const NpyArray a = parse_npy(npy_file(dict_of(big ? ">f2" : "<f2", "(6,)"), f2(bits, big)), kName);
    expect_same_floats(a.values, want);
  }
  const NpyArray n = parse_npy(npy_file(dict_of("<f2", "(1,)"), f2({0x7e00})), kName);
  EXPECT_TRUE(std::isnan(n.values[0]));
}

TEST(Npy, Float64RoundedToFloat32) {
  const double mid = 0x1.ffffffp127;  // midpoint above FLT_MAX: ties to even = inf
  const std::vector<double> v{0.1, -0.0, 1e-50, -1e300, 0x1.fffffefp127, mid, std::nextafter(mid, 0.0),
                              std::numeric_limits<double>::infinity(), 0x1p-149, 0x1p-150, 0x1.8p-150};
  for (const bool big : {false, true}) {
    const NpyArray a = parse_npy(npy_file(dict_of(big ? ">f8" : "<f8", "(11,)"), f8(v, big)), kName);
    const float inf = std::numeric_limits<float>::infinity();
    const float fmax = std::numeric_limits<float>::max();
    // 2^-150 is the midpoint between 0 and 2^-149: ties to even gives 0; 1.5 * 2^-150 rounds up.
    expect_same_floats(a.values, {0.1f, -0.0f, 0.0f, -inf, fmax, inf, fmax, inf, 0x1p-149f, 0.0f, 0x1p-149f});
    EXPECT_EQ(a.narrowed_to_zero, 2u);  // 1e-50 and 2^-150
    EXPECT_EQ(a.narrowed_to_inf, 2u);   // -1e300 and the midpoint
  }
}

TEST(Npy, ScalarAndEmptyShapes) {
  const NpyArray s = parse_npy(npy_file(dict_of("<f4", "()"), f4({42.0f})), kName);
  EXPECT_TRUE(s.shape.empty());
  expect_same_floats(s.values, {42.0f});
  EXPECT_EQ(shape_text(s.shape), "()");
  const NpyArray e = parse_npy(npy_file(dict_of("<f4", "(0,)"), {}), kName);
  EXPECT_EQ(e.shape, (std::vector<std::size_t>{0}));
  EXPECT_TRUE(e.values.empty());
  // A zero dimension makes the array empty however large the others are (NumPy agrees).
  const NpyArray z = parse_npy(npy_file(dict_of("<f2", "(4611686018427387904, 4611686018427387904, 0)"), {}), kName);
  EXPECT_TRUE(z.values.empty());
}

TEST(Npy, Versions2And3) {
  for (const int major : {2, 3}) {
    const Bytes file = npy_file(dict_of("<f4", "(2,)"), f4({1.0f, 2.0f}), major);
    EXPECT_EQ(file.size() % 64, 8u);
    const NpyArray a = parse_npy(file, kName);
    EXPECT_EQ(a.version_major, major);
    expect_same_floats(a.values, {1.0f, 2.0f});
  }
}

TEST(Npy, FortranOrderIsRecorded) {
  const NpyArray a = parse_npy(npy_file(dict_of("<f4", "(2, 2)", true), f4({1, 2, 3, 4})), kName);
  EXPECT_TRUE(a.fortran_order);
  expect_same_floats(a.values, {1, 2, 3, 4});  // file order
}

TEST(Npy, HeaderSpellings) {
  const Bytes data = f4({1.0f, 2.0f, 3.0f, 4.0f, 5.0f, 6.0f});
  for (const char* dict : {
           "{'shape': (2, 3), 'fortran_order': False, 'descr': '<f4'}",      // any key order
           "{\"descr\": \"<f4\", \"fortran_order\": False, \"shape\": (2,3)}",  // double quotes, no spaces
           "{'descr':'<f4','fortran_order':False,'shape':(2,3,),}",         // trailing commas
           "  {\n 'descr' : '<f4' ,\t'fortran_order' : False , 'shape' : ( 2 , 3 ) }",
           "{'descr': '<f4', 'fortran_order': False, 'shape': (2L, 3L), }",  // Python 2 longs
       }) {
    SCOPED_TRACE(dict);
    const NpyArray a = parse_npy(npy_file(dict, data), kName);
    EXPECT_EQ(a.shape, (std::vector<std::size_t>{2, 3}));
    EXPECT_EQ(a.dtype, "<f4");
  }
  // Not padded to 64 (older writers aligned to 16): accepted, only the final '\n' is required.
  const NpyArray u = parse_npy(npy_file(dict_of("<f4", "(6,)"), data, 1, false), kName);
  EXPECT_EQ(u.values.size(), 6u);
}

Bytes from_hex(std::string_view h) {
  Bytes b;
  for (std::size_t i = 0; i + 1 < h.size(); i += 2)
    b.push_back(static_cast<std::byte>(std::stoi(std::string(h.substr(i, 2)), nullptr, 16)));
  return b;
}

// Files written by NumPy 2.4.6's np.save (hex of the whole file): the test's builder makes
// the same bytes, and the reader decodes them.
TEST(Npy, WrittenByNumPy) {
  // np.array([[1.5, -2.0, 3e-8], [0.0, 70000, -1e-6]], dtype=np.float32)
  const Bytes f4_file = from_hex(
      "934e554d5059010076007b276465736372273a20273c6634272c2027666f727472616e5f6f72646572273a2046616c73652c202773686170"
      "65273a2028322c2033292c207d20202020202020202020202020202020202020202020202020202020202020202020202020202020202020"
      "2020202020202020202020202020200a0000c03f000000c059d900330000000000b88847bd3786b5");
  const std::vector<float> v{1.5f, -2.0f, 3e-8f, 0.0f, 70000.0f, -1e-6f};
  EXPECT_EQ(f4_file, npy_file(dict_of("<f4", "(2, 3)"), f4(v)));
  expect_same_floats(parse_npy(f4_file, kName).values, v);
  // np.array([1, -2, 65504, 6e-8], dtype='>f2'): 6e-8 is stored as 2^-24
  const Bytes f2_file = from_hex(
      "934e554d5059010076007b276465736372273a20273e6632272c2027666f727472616e5f6f72646572273a2046616c73652c202773686170"
      "65273a2028342c292c207d202020202020202020202020202020202020202020202020202020202020202020202020202020202020202020"
      "2020202020202020202020202020200a3c00c0007bff0001");
  expect_same_floats(parse_npy(f2_file, kName).values, {1.0f, -2.0f, 65504.0f, 0x1p-24f});
  // np.array([0.1, 1e-50, 1e300], dtype=np.float64)
  const Bytes f8_file = from_hex(
      "934e554d5059010076007b276465736372273a20273c6638272c2027666f727472616e5f6f72646572273a2046616c73652c202773686170"
      "65273a2028332c292c207d202020202020202020202020202020202020202020202020202020202020202020202020202020202020202020"
      "2020202020202020202020202020200a9a9999999999b93f1fb8d44a7aee8d359c7500883ce4377e");
  const NpyArray a = parse_npy(f8_file, kName);
  expect_same_floats(a.values, {0.1f, 0.0f, std::numeric_limits<float>::infinity()});
  EXPECT_EQ(a.narrowed_to_zero, 1u);
  EXPECT_EQ(a.narrowed_to_inf, 1u);
}

// ---- rejected files ------------------------------------------------------------------

Bytes with_header(std::string_view dict, const Bytes& data = f4({1.0f, 2.0f})) { return npy_file(dict, data); }

TEST(Npy, PreambleErrors) {
  expect_error({}, "not an npy file: expected the magic string \\x93NUMPY at byte 0, found an empty file");
  Bytes bad = npy_file(dict_of("<f4", "(2,)"), f4({1, 2}));
  bad[5] = std::byte{'X'};
  expect_error(bad, "not an npy file: expected the magic string \\x93NUMPY at byte 0, found '\\x93NUMPX");
  expect_error(bytes_of("PK\x03\x04"), "not an npy file");  // a zip (.npz) is not an .npy
  Bytes v9 = npy_file(dict_of("<f4", "(2,)"), f4({1, 2}));
  v9[6] = std::byte{9};
  expect_error(v9, "npy preamble: unsupported format version 9.0 at byte 6; expected 1.0, 2.0 or 3.0");
  Bytes v11 = npy_file(dict_of("<f4", "(2,)"), f4({1, 2}));
  v11[7] = std::byte{1};
  expect_error(v11, "unsupported format version 1.1");
  expect_error(bytes_of(std::string_view("\x93NUMPY\x01", 7)), "the file ends at byte 7, before the format version");
  expect_error(bytes_of(std::string_view("\x93NUMPY\x02\x00\x10\x00", 10)), "the file ends at byte 10, inside the header length (bytes 8-11)");
  Bytes big_len = npy_file(dict_of("<f4", "(2,)"), f4({1, 2}));
  big_len[8] = std::byte{0xe8};  // 1000
  big_len[9] = std::byte{0x03};
  expect_error(big_len, "npy header: the header length 1000 (bytes 8-9) runs past the end of the file: expected at most 126, found 1000");
}

TEST(Npy, HeaderErrors) {
  struct Case {
    const char* dict;
    const char* fragment;
  };
  const Case cases[] = {
      {"{'descr': '<f4', 'fortran_order': False}", "npy header: missing key 'shape' (a header has 'descr', 'fortran_order' and 'shape')"},
      {"{'shape': (2,), 'fortran_order': False}", "missing key 'descr'"},
      {"{}", "missing key 'descr'"},
      {"{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': (2,)}", "duplicate key 'descr' at byte 27"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (2,), 'foo': 1}",
       "unknown key 'foo'; expected 'descr', 'fortran_order' and 'shape' at byte"},
      {"{descr: '<f4'}", "expected a quoted key or '}', found 'descr' at byte 11"},
      {"{'descr: '<f4', 'fortran_order': False, 'shape': (2,)}", "unknown key 'descr: '"},
      {"{'descr': '<f4, 'fortran_order': False, 'shape': (2,)}", "unsupported dtype '<f4, '"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (2,), 'x}", "unterminated string at byte"},
      {"{'descr': '\\x3cf4', 'fortran_order': False, 'shape': (2,)}", "expected a string without escape sequences, found '\\\\'"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (-2,)}", "expected a non-negative integer dimension in 'shape', found '-2'"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (2.0,)}", "found '2.0'"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (02,)}", "found '02'"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (1_0,)}", "found '1_0'"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (,)}", "expected a non-negative integer dimension in 'shape', found ','"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (2)}", "(5,) is a tuple, (5) is not), found ')'"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': [2]}", "expected a tuple such as (3, 4), (5,) or () for 'shape', found '['"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (2 3)}", "expected ',' or ')' in 'shape', found '3'"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999999999999,)}",
       "dimension '99999999999999999999' in 'shape' is too large (the limit is 2^63 - 1)"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (1099511627776, 1099511627776)}",
       "npy header: shape (1099511627776, 1099511627776) is too large: its size in bytes does not fit in 64 bits"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (4611686018427387904,)}", "is too large"},  // 2^62 * 4 bytes
      {"{'descr': '<f4', 'fortran_order': false, 'shape': (2,)}", "expected True or False for 'fortran_order', found 'false'"},
      {"{'descr': '<f4', 'fortran_order': 0, 'shape': (2,)}", "expected True or False for 'fortran_order', found '0'"},
      {"{'descr': '<i4', 'fortran_order': False, 'shape': (2,)}",
       "unsupported dtype '<i4' (signed integers); expected one of '<f4', '>f4', '<f2', '>f2', '<f8', '>f8' at byte 20"},
      {"{'descr': '|u1', 'fortran_order': False, 'shape': (2,)}", "unsupported dtype '|u1' (unsigned integers)"},
      {"{'descr': '|O', 'fortran_order': False, 'shape': (2,)}", "unsupported dtype '|O' (Python objects)"},
      {"{'descr': '|b1', 'fortran_order': False, 'shape': (2,)}", "(booleans)"},
      {"{'descr': '<c8', 'fortran_order': False, 'shape': (2,)}", "(complex numbers)"},
      {"{'descr': '<V2', 'fortran_order': False, 'shape': (2,)}", "ml_dtypes' bfloat16"},
      {"{'descr': '|f4', 'fortran_order': False, 'shape': (2,)}", "byte order '|'; expected '<' (little-endian) or '>' (big-endian)"},
      {"{'descr': '<f16', 'fortran_order': False, 'shape': (2,)}", "floats of an unsupported size"},
      {"{'descr': 'float32', 'fortran_order': False, 'shape': (2,)}", "unsupported dtype 'float32' (not a NumPy type string)"},
      {"{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (2,)}", "structured dtype (a list of fields) is not supported"},
      {"{'descr': 4, 'fortran_order': False, 'shape': (2,)}", "expected the dtype as a quoted string, one of '<f4'"},
      {"{'descr' '<f4', 'fortran_order': False, 'shape': (2,)}", "expected ':' after key 'descr', found \"'\" at byte 19"},
      {"{'descr': '<f4' 'fortran_order': False, 'shape': (2,)}", "expected ',' or '}' after the value of 'descr'"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (2,)} x", "expected only spaces and a final newline after '}', found 'x'"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (2,)}}", "found '}'"},
      {"['descr', '<f4']", "expected '{' (the header is a dict literal), found '[' at byte 10"},
      {"", "expected '{' (the header is a dict literal), found the end of the header"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.dict);
    expect_error(with_header(c.dict), c.fragment);
  }
  // 65 dimensions
  std::string dims = "(";
  for (int i = 0; i < 65; ++i) dims += "1, ";
  expect_error(with_header(dict_of("<f4", dims + ")")), "'shape' has more than 64 dimensions");
  // No final newline; a newline that is not last.
  Bytes no_nl = npy_file(dict_of("<f4", "(2,)"), f4({1, 2}));
  no_nl[127] = std::byte{' '};  // the header is bytes 10-127
  expect_error(no_nl, "expected the header to end with a newline, found the end of the header at byte 128");
  Bytes early_nl = npy_file(dict_of("<f4", "(2,)"), f4({1, 2}));
  early_nl[126] = std::byte{'\n'};
  early_nl[127] = std::byte{' '};
  expect_error(early_nl, "expected only spaces and a final newline after '}', found '\\n' at byte 126");
  // Control bytes are shown escaped.
  expect_error(with_header(std::string("{'descr': '<f4', 'fortran_order': False, 'shape': (2,)\x01}")),
               "found '\\x01' at byte");
}

TEST(Npy, DataLengthErrors) {
  expect_error(npy_file(dict_of("<f4", "(2, 3)"), f4({1, 2, 3, 4, 5})),
               "npy data: expected 24 bytes after byte 128 (shape (2, 3), 6 values of 4 bytes, dtype '<f4'), found 20: "
               "the file is truncated");
  expect_error(npy_file(dict_of("<f2", "(2,)"), f4({1, 2})),
               "expected 4 bytes after byte 128 (shape (2,), 2 values of 2 bytes, dtype '<f2'), found 8: 4 extra bytes at the end");
  expect_error(npy_file(dict_of("<f4", "()"), {}), "expected 4 bytes after byte 128 (shape (), 1 values");
  expect_error(npy_file(dict_of("<f4", "(1099511627776,)"), f4({1})), "expected 4398046511104 bytes");
}

TEST(Npy, EveryTruncationIsAnError) {
  for (const Bytes& file : {npy_file(dict_of("<f4", "(2, 2)"), f4({1, 2, 3, 4})),
                            npy_file(dict_of(">f2", "(3,)"), f2({1, 2, 3}, true), 2)}) {
    ASSERT_NO_THROW(parse_npy(file, kName));
    for (std::size_t n = 0; n < file.size(); ++n) {
      SCOPED_TRACE(n);
      const Bytes prefix(file.begin(), file.begin() + static_cast<std::ptrdiff_t>(n));
      const std::string m = error_of(prefix);
      EXPECT_TRUE(m.starts_with("t.npy: ")) << m;
      EXPECT_TRUE(m.find("npy") != std::string::npos) << m;
    }
  }
}

// Random byte changes, truncations, insertions and deletions of valid files, biased to
// the preamble and header: each copy parses or throws std::runtime_error, and a parse
// always has exactly product(shape) values.
TEST(Npy, RandomMutationsParseOrThrow) {
  std::vector<float> many(64);
  for (std::size_t i = 0; i < many.size(); ++i) many[i] = std::ldexp(1.0f, static_cast<int>(i) - 32);
  const std::vector<Bytes> seeds{
      npy_file(dict_of("<f4", "(8, 8)"), f4(many)),
      npy_file(dict_of(">f2", "(4,)", true), f2({1, 2, 3, 4}, true), 2),
      npy_file(dict_of("<f8", "()"), f8({1.5}), 3),
      npy_file("{'shape': (2, 1), \"descr\": '<f2', 'fortran_order': True}", f2({7, 8})),
  };
  const std::string tokens[] = {"'", "\"", ",", "(", ")", "{", "}", ":", " ", "\n", "\\", "-", "L", "True", "False",
                                "99999999999999999999", "0", "'descr'", "'shape'", "(,)", "\x93NUMPY", "\xff"};
  std::mt19937_64 rng(20240611);
  int parsed = 0, rejected = 0;
  for (int iter = 0; iter < 20000; ++iter) {
    Bytes b = seeds[static_cast<std::size_t>(iter) % seeds.size()];
    const int edits = rng() % 2 != 0 ? 1 : 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < edits; ++e) {
      const std::size_t limit = (rng() % 2 != 0 && b.size() > 72) ? 72 : b.size() + 1;
      const std::size_t pos = static_cast<std::size_t>(rng() % limit);
      switch (rng() % 6) {
        case 0:  // random byte
          if (pos < b.size()) b[pos] = static_cast<std::byte>(rng());
          break;
        case 1:  // bit flip
          if (pos < b.size()) b[pos] ^= static_cast<std::byte>(1u << (rng() % 8));
          break;
        case 2:  // truncate
          b.resize(std::min(b.size(), pos));
          break;
        case 3:  // insert a random byte
          b.insert(b.begin() + static_cast<std::ptrdiff_t>(std::min(pos, b.size())), static_cast<std::byte>(rng()));
          break;
        case 4:  // delete a byte
          if (pos < b.size()) b.erase(b.begin() + static_cast<std::ptrdiff_t>(pos));
          break;
        default: {  // insert a token of the grammar
          const std::string& t = tokens[rng() % std::size(tokens)];
          const Bytes tb = bytes_of(t);
          b.insert(b.begin() + static_cast<std::ptrdiff_t>(std::min(pos, b.size())), tb.begin(), tb.end());
        }
      }
    }
    try {
      const NpyArray a = parse_npy(b, kName);
      std::size_t n = 1;
      for (const std::size_t d : a.shape) n *= d;
      ASSERT_EQ(a.values.size(), n) << "iteration " << iter;
      ++parsed;
    } catch (const std::runtime_error& e) {
      ASSERT_TRUE(std::string_view(e.what()).starts_with("t.npy: ")) << e.what();
      ++rejected;
    }
  }
  std::printf("%d parsed, %d rejected\n", parsed, rejected);
  EXPECT_GT(parsed, 300);
  EXPECT_GT(rejected, 10000);
}

// ---- files on disk -------------------------------------------------------------------

class NpyFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("mixprec-npy-" + std::to_string(::getpid()) + "-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path write(const std::string& name, const Bytes& b) {
    const fs::path p = dir_ / name;
    std::ofstream(p, std::ios::binary).write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
    return p;
  }
  fs::path dir_;
};

TEST_F(NpyFiles, ReadsAFile) {
  const fs::path p = write("g.npy", npy_file(dict_of("<f4", "(3,)"), f4({1, 2, 3})));
  expect_same_floats(read_npy(p).values, {1, 2, 3});
}

TEST_F(NpyFiles, ErrorsNameTheFile) {
  auto message = [](const fs::path& p, std::uint64_t limit = kNpyMaxFileBytes) {
    try {
      (void)read_npy(p, limit);
    } catch (const std::runtime_error& e) {
      return std::string(e.what());
    }
    return std::string("(no exception)");
  };
  const fs::path missing = dir_ / "missing.npy";
  EXPECT_EQ(message(missing), missing.string() + ": cannot be opened: No such file or directory");
  EXPECT_EQ(message(dir_), dir_.string() + ": is a folder; expected an .npy file");
  const fs::path p = write("g.npy", npy_file(dict_of("<i8", "(3,)"), f8({1, 2, 3})));
  EXPECT_NE(message(p).find(p.string() + ": npy header: unsupported dtype '<i8'"), std::string::npos) << message(p);
  const fs::path q = write("h.npy", npy_file(dict_of("<f4", "(3,)"), f4({1, 2, 3})));
  EXPECT_EQ(message(q, 50), q.string() + ": the file is 140 bytes; the limit is 50 bytes");
  // A FIFO in place of a sample (the advisor reads samples/step-N/*.npy): refused, not waited
  // on for a writer (the open waited forever before).
  const fs::path fifo = dir_ / "fifo.npy";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_EQ(message(fifo), fifo.string() + ": is not a regular file; expected an .npy file");
}

// ---- the analysis ----------------------------------------------------------------------

const std::vector<FormatId> kFormats{FormatId::f16, FormatId::bf16, FormatId::f8e4m3, FormatId::f8e5m2};

TEST(Inspect, ThresholdsAreTheFormatTables) {
  // nonzero: just above half the smallest subnormal (the midpoint rounds to even = 0).
  // normal: the midpoint between the largest subnormal (odd mantissa) and min normal rounds up.
  // overflow: the midpoint above max finite when max has an odd mantissa (f16, bf16, E5M2),
  // one ulp above it when even (E4M3: 464 -> 448).
  const FormatThresholds h = format_thresholds(FormatId::f16);
  EXPECT_EQ(h.nonzero, std::nextafter(0x1p-25f, 1.0f));
  EXPECT_EQ(h.normal, 0x1p-14f - 0x1p-25f);
  EXPECT_EQ(h.overflow, 65520.0f);
  const FormatThresholds b = format_thresholds(FormatId::bf16);
  EXPECT_EQ(b.nonzero, std::nextafter(0x1p-134f, 1.0f));
  EXPECT_EQ(b.normal, 0x1p-126f - 0x1p-134f);
  EXPECT_EQ(b.overflow, 0x1.ffp127f);
  const FormatThresholds e4 = format_thresholds(FormatId::f8e4m3);
  EXPECT_EQ(e4.nonzero, std::nextafter(0x1p-10f, 1.0f));
  EXPECT_EQ(e4.normal, 0x1p-6f - 0x1p-10f);
  EXPECT_EQ(e4.overflow, std::nextafter(464.0f, 1000.0f));
  const FormatThresholds e5 = format_thresholds(FormatId::f8e5m2);
  EXPECT_EQ(e5.nonzero, std::nextafter(0x1p-17f, 1.0f));
  EXPECT_EQ(e5.normal, 0x1p-14f - 0x1p-17f);
  EXPECT_EQ(e5.overflow, 61440.0f);
  EXPECT_THROW(format_thresholds(FormatId::e8m0), std::invalid_argument);
}

TEST(Inspect, HandComputedFp16) {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  const std::vector<float> v{1e-8f, -1e-6f, 1.0f, 70000.0f, 0.0f, -0.0f, nan, -inf};
  const InspectReport r = inspect(v);
  const TensorStats& s = r.stats;
  EXPECT_EQ(s.count, 8u);
  EXPECT_EQ(s.zeros, 2u);
  EXPECT_EQ(s.nan, 1u);
  EXPECT_EQ(s.inf, 1u);
  EXPECT_EQ(s.finite_nonzero, 4u);
  EXPECT_EQ(s.amax, 70000.0f);
  EXPECT_EQ(s.min_nonzero, 1e-8f);
  // floor(log2): 1e-8 -> -27, 1e-6 -> -20, 1 -> 0, 70000 -> 16; lower median = 2nd smallest.
  EXPECT_EQ(s.exponent_min, -27);
  EXPECT_EQ(s.exponent_median, -20);
  EXPECT_EQ(s.exponent_max, 16);
  EXPECT_EQ(s.exponent_counts[static_cast<std::size_t>(16 - kMinExponent)], 1u);
  ASSERT_EQ(r.formats.size(), 4u);
  const FormatInspection& h = r.formats[0];
  ASSERT_EQ(h.format, FormatId::f16);
  ASSERT_EQ(h.scales.size(), 25u);
  // Scale 1: 1e-8 < 2^-25 = 2.98e-8 becomes 0; 1e-6 < 2^-14 = 6.1e-5 is subnormal;
  // 1 is normal; 70000 >= 65520 overflows.
  const ScaleOutcome& s0 = h.scales[0];
  EXPECT_EQ(s0.underflow, 1u);
  EXPECT_EQ(s0.subnormal, 1u);
  EXPECT_EQ(s0.overflow, 1u);
  EXPECT_EQ(s0.normal, 1u);
  // Scale 2^10: 1e-8 * 1024 = 1.02e-5 is subnormal, 1e-6 * 1024 = 1.02e-3 normal, 1024 normal.
  const ScaleOutcome& s10 = h.scales[10];
  EXPECT_EQ(s10.scale_log2, 10);
  EXPECT_EQ(s10.underflow, 0u);
  EXPECT_EQ(s10.subnormal, 1u);
  EXPECT_EQ(s10.overflow, 1u);
  EXPECT_EQ(s10.normal, 2u);
  // Scale 2^12: 1e-8 * 4096 = 4.1e-5 still subnormal; 2^13: 8.2e-5 normal, 1 * 2^13 fine.
  EXPECT_EQ(h.scales[12].subnormal, 1u);
  EXPECT_EQ(h.scales[13].subnormal, 0u);
  // 70000 overflows at every scale >= 1: 2^-1 would fit (35000 < 65520).
  EXPECT_EQ(h.advice, Advice::overflows_always);
  EXPECT_EQ(h.fitting_log2, -1);
  // bf16: everything is normal at 2^0, so the rule's tie-break picks 2^0.
  const FormatInspection& b = r.formats[1];
  EXPECT_EQ(b.advice, Advice::scale);
  EXPECT_EQ(b.recommended_log2, 0);
  EXPECT_DOUBLE_EQ(b.headroom_binades, std::log2(0x1.fep127 / 70000.0));
  EXPECT_DOUBLE_EQ(fraction_of(b.scales[0].normal, s), 1.0);
  // E4M3: 70000 / 464 needs 2^-8 (273.4 fits, 546.9 does not).
  EXPECT_EQ(r.formats[2].fitting_log2, -8);
}

// Powers of two 2^-30 .. 2^-10 (21 values). In fp16 at scale 2^k the value 2^(e+k) is
// zero for e+k <= -25, subnormal for -24 <= e+k <= -15, normal from -14, and overflows
// from e+k = 16 (65536 >= 65520). With amax 2^-10 no k <= 24 overflows; values lost:
// e < -14-k, i.e. max(0, 16-k). The loss reaches 0 at k = 16, so the rule picks 2^16:
// headroom log2(65504 / 2^6) = log2(1023.5).
TEST(Inspect, RecommendationForASpreadTensor) {
  std::vector<float> v;
  for (int e = -30; e <= -10; ++e) v.push_back(std::ldexp(1.0f, e));
  InspectReport r = inspect(v);
  const FormatInspection& h = r.formats[0];
  for (int k = 0; k <= 24; ++k) {
    const ScaleOutcome& o = h.scales[static_cast<std::size_t>(k)];
    EXPECT_EQ(o.underflow + o.subnormal, static_cast<std::uint64_t>(std::max(0, 16 - k))) << k;
    EXPECT_EQ(o.underflow, static_cast<std::uint64_t>(std::max(0, 6 - k))) << k;  // e + k <= -25
    EXPECT_EQ(o.overflow, 0u) << k;
  }
  EXPECT_EQ(h.advice, Advice::scale);
  EXPECT_EQ(h.recommended_log2, 16);
  EXPECT_DOUBLE_EQ(h.headroom_binades, std::log2(1023.5));
  // E4M3 (normal from 2^-6, overflow above 464): overflow when -10 + k >= 9, so k <= 18;
  // lost at k: e < -6-k, zero only from k = 24, so the largest safe k = 18 wins
  // (6 values lost: 2^-30 .. 2^-25); headroom log2(448 / 2^8).
  const FormatInspection& e4 = r.formats[2];
  EXPECT_EQ(e4.scales[18].overflow, 0u);
  EXPECT_EQ(e4.scales[19].overflow, 1u);
  EXPECT_EQ(e4.recommended_log2, 18);
  EXPECT_EQ(e4.scales[18].normal, 15u);
  EXPECT_DOUBLE_EQ(e4.headroom_binades, std::log2(1.75));
  // Add 2^4: fp16 now overflows from k = 12 (2^16 >= 65520), so k = 11 with 2^-30 .. 2^-26
  // (e < -25) lost.
  v.push_back(16.0f);
  r = inspect(v);
  EXPECT_EQ(r.formats[0].recommended_log2, 11);
  EXPECT_EQ(r.formats[0].scales[11].underflow + r.formats[0].scales[11].subnormal, 5u);
  EXPECT_EQ(r.formats[0].scales[12].overflow, 1u);
}

TEST(Inspect, OptionsAndEmptyInput) {
  InspectOptions o;
  o.formats = {FormatId::f8e5m2};
  o.max_scale_log2 = 3;
  const InspectReport r = inspect(std::vector<float>{0.0f, std::numeric_limits<float>::quiet_NaN()}, o);
  ASSERT_EQ(r.formats.size(), 1u);
  EXPECT_EQ(r.formats[0].scales.size(), 4u);
  EXPECT_EQ(r.formats[0].advice, Advice::no_values);
  EXPECT_EQ(r.stats.finite_nonzero, 0u);
  EXPECT_EQ(r.stats.amax, 0.0f);
  EXPECT_EQ(r.stats.min_nonzero, 0.0f);
  o.max_scale_log2 = 128;
  EXPECT_THROW(inspect(std::vector<float>{1.0f}, o), std::invalid_argument);
  o.max_scale_log2 = -1;
  EXPECT_THROW(inspect(std::vector<float>{1.0f}, o), std::invalid_argument);
  o.max_scale_log2 = 2;
  o.formats = {FormatId::e8m0};
  EXPECT_THROW(inspect(std::vector<float>{1.0f}, o), std::invalid_argument);
  EXPECT_EQ(inspect_format_name(FormatId::f8e4m3), "e4m3");
}

// The counts equal what convert_counted reports for x * 2^k, for every format and scale,
// on random values over the whole fp32 range, every threshold at every scale and its
// neighbours, and the fp32 extremes (over 2^16 values, so the parallel path runs).
template <LowPrecisionFormat T>
void cross_check(const std::vector<float>& v, const InspectReport& r, std::size_t fi) {
  std::vector<T> buf(v.size());
  for (int k = 0; k <= r.max_scale_log2; ++k) {
    ConvertOptions o;
    o.scale = std::ldexp(1.0f, k);
    const ConversionStats st = convert_counted(std::span<const float>(v), std::span<T>(buf), o);
    const ScaleOutcome& got = r.formats[fi].scales[static_cast<std::size_t>(k)];
    EXPECT_EQ(got.underflow, st.underflow) << format_traits<T>::name << " 2^" << k;
    EXPECT_EQ(got.subnormal, st.subnormal) << format_traits<T>::name << " 2^" << k;
    EXPECT_EQ(got.overflow, st.overflow) << format_traits<T>::name << " 2^" << k;
  }
}

TEST(Inspect, EqualsConvertCountedAtEveryScale) {
  std::mt19937 rng(7);
  std::vector<float> v;
  for (int i = 0; i < 150000; ++i) v.push_back(std::bit_cast<float>(static_cast<std::uint32_t>(rng())));
  for (const FormatId f : kFormats) {
    const FormatThresholds t = format_thresholds(f);
    for (int k = 0; k <= 30; ++k) {
      for (const float c : {t.nonzero, t.normal, t.overflow}) {
        const float x = std::ldexp(c, -k);
        v.insert(v.end(), {x, -x, std::nextafter(x, 0.0f), std::nextafter(x, 1e30f)});
      }
    }
  }
  const float fmax = std::numeric_limits<float>::max();
  v.insert(v.end(), {fmax, -fmax, 0x1p-149f, 0x1p104f, 0x1p103f, 1.0f, 0.0f});
  InspectOptions o;
  o.max_scale_log2 = 30;
  const InspectReport r = inspect(v, o);
  cross_check<f16>(v, r, 0);
  cross_check<bf16>(v, r, 1);
  cross_check<f8e4m3>(v, r, 2);
  cross_check<f8e5m2>(v, r, 3);
  std::uint64_t sum = r.stats.zeros + r.stats.nan + r.stats.inf + r.stats.finite_nonzero;
  EXPECT_EQ(sum, v.size());
  for (const FormatInspection& f : r.formats)
    for (const ScaleOutcome& s : f.scales)
      EXPECT_EQ(s.underflow + s.subnormal + s.overflow + s.normal, r.stats.finite_nonzero);
}

}  // namespace
}  // namespace mixprec::monitor
