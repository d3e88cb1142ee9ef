// Text files, tokenisers, vocabularies, datasets, the batch sampler, validation
// windows and statistics (docs/data.md).
#include "mixprec/nn/data.hpp"
#include "mixprec/core/text.hpp"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <system_error>
#include <unordered_map>
#include <utility>

#include "nn/data_rng.hpp"

namespace mixprec::nn {
namespace {

constexpr std::uint64_t kMaxFileBytes = std::uint64_t{4} << 30;

std::string hex_byte(unsigned char b) {
  char buf[8];
  std::snprintf(buf, sizeof buf, "0x%02x", static_cast<unsigned>(b));
  return buf;
}

// Length of the UTF-8 sequence at text[i] and its code point. Meant for checked text
// (check_text); on other input it never reads past the end: a stray or cut-off byte
// is one piece of its own (U+FFFD).
inline std::size_t decode_at(std::string_view text, std::size_t i, char32_t& cp) noexcept {
  const auto b0 = static_cast<unsigned char>(text[i]);
  if (b0 < 0x80) {
    cp = b0;
    return 1;
  }
  const std::size_t len = b0 < 0xC0 ? 0 : (b0 < 0xE0 ? 2 : (b0 < 0xF0 ? 3 : (b0 < 0xF8 ? 4 : 0)));
  if (len == 0 || i + len > text.size()) {
    cp = 0xFFFD;
    return 1;
  }
  const auto cont = [&](std::size_t k) { return static_cast<char32_t>(static_cast<unsigned char>(text[i + k]) & 0x3F); };
  if (b0 < 0xE0) {
    cp = (static_cast<char32_t>(b0 & 0x1F) << 6) | cont(1);
    return 2;
  }
  if (b0 < 0xF0) {
    cp = (static_cast<char32_t>(b0 & 0x0F) << 12) | (cont(1) << 6) | cont(2);
    return 3;
  }
  cp = (static_cast<char32_t>(b0 & 0x07) << 18) | (cont(1) << 12) | (cont(2) << 6) | cont(3);
  return 4;
}

enum class CharClass : std::uint8_t { word, apostrophe, punct, space };

inline CharClass classify(char32_t c) noexcept {
  if (c < 0x80) {
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9')) return CharClass::word;
    if (c == '\'') return CharClass::apostrophe;
    if (c > 0x20 && c < 0x7F) return CharClass::punct;
    return CharClass::space;
  }
  if (c == 0x85 || c == 0xA0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200B) || c == 0x2028 || c == 0x2029 ||
      c == 0x202F || c == 0x205F || c == 0x3000 || c == 0xFEFF)
    return CharClass::space;
  if (c < 0xA0) return CharClass::space;  // C1 controls
  if ((c >= 0xA1 && c <= 0xBF) || (c >= 0x2010 && c <= 0x205E) || (c >= 0x3001 && c <= 0x303F))
    return CharClass::punct;
  return CharClass::word;
}

// Piece -> provisional id in order of first appearance, and the token stream of
// provisional ids.
struct PieceTable {
  struct Hash {
    using is_transparent = void;
    std::size_t operator()(std::string_view s) const noexcept { return std::hash<std::string_view>{}(s); }
  };
  std::unordered_map<std::string, TokenId, Hash, std::equal_to<>> index;
  std::vector<std::string> pieces;
  std::vector<TokenId> tokens;

  void add(std::string_view piece) {
    auto it = index.find(piece);
    if (it == index.end()) {
      if (pieces.size() >= std::numeric_limits<TokenId>::max())
        throw std::runtime_error("tokeniser: more than 2^32 - 1 distinct pieces");
      it = index.emplace(std::string(piece), static_cast<TokenId>(pieces.size())).first;
      pieces.emplace_back(piece);
    }
    tokens.push_back(it->second);
  }
};

PieceTable tokenize(std::string_view text, VocabKind kind) {
  PieceTable t;
  t.tokens.reserve(kind == VocabKind::characters ? text.size() : text.size() / 4 + 16);
  for_each_piece(text, kind, [&](std::string_view p) { t.add(p); });
  return t;
}

// Chooses the vocabulary from provisional pieces with their training counts; returns
// it and the provisional -> final id map (pieces left out -> kUnk).
std::pair<Vocabulary, std::vector<TokenId>> select_vocab(VocabKind kind, const std::vector<std::string>& pieces,
                                                        const std::vector<std::uint64_t>& counts,
                                                        std::size_t word_limit) {
  std::vector<TokenId> order;
  for (std::size_t i = 0; i < pieces.size(); ++i)
    if (counts[i] > 0) order.push_back(static_cast<TokenId>(i));
  if (kind == VocabKind::characters) {
    std::sort(order.begin(), order.end(), [&](TokenId a, TokenId b) { return pieces[a] < pieces[b]; });
  } else {
    const std::size_t keep = std::min(order.size(), word_limit - 1);
    std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(keep), order.end(),
                      [&](TokenId a, TokenId b) {
                        if (counts[a] != counts[b]) return counts[a] > counts[b];
                        return pieces[a] < pieces[b];
                      });
    order.resize(keep);
  }
  std::vector<TokenId> remap(pieces.size(), Vocabulary::kUnk);
  std::vector<std::string> tokens;
  tokens.reserve(order.size() + 1);
  tokens.emplace_back(Vocabulary::kUnkText);
  for (const TokenId p : order) {
    remap[p] = static_cast<TokenId>(tokens.size());
    tokens.push_back(pieces[p]);
  }
  return {Vocabulary(kind, std::move(tokens)), std::move(remap)};
}

std::size_t validation_count(std::size_t n, double fraction) {
  return static_cast<std::size_t>(std::floor(static_cast<double>(n) * fraction));
}

void check_options(const DataOptions& o) {
  if (o.vocab.kind == VocabKind::words && (o.vocab.size < VocabSpec::kMinWords || o.vocab.size > VocabSpec::kMaxWords))
    throw std::invalid_argument("DataOptions: expected a word vocabulary size in [" +
                                std::to_string(VocabSpec::kMinWords) + ", " + std::to_string(VocabSpec::kMaxWords) +
                                "], found " + std::to_string(o.vocab.size));
  (void)min_tokens_for(o.context, o.validation_fraction);  // validates both
}

std::string percent(double f) { return text::num(f * 100.0) + "%"; }

}  // namespace

// ---- vocabulary specification ----------------------------------------------------

VocabSpec parse_vocab_spec(std::string_view spec) {
  const std::string expected = "expected 'char' or 'word:N' with N in [" + std::to_string(VocabSpec::kMinWords) +
                               ", " + std::to_string(VocabSpec::kMaxWords) + "]";
  if (spec == "char") return {VocabKind::characters, 0};
  if (spec.starts_with("word:")) {
    const std::string_view digits = spec.substr(5);
    const bool whole = !digits.empty() && std::all_of(digits.begin(), digits.end(),
                                                      [](char c) { return c >= '0' && c <= '9'; });
    if (!whole)
      throw std::invalid_argument("vocabulary '" + std::string(spec) + "': '" + std::string(digits) +
                                  "' is not a whole number; " + expected);
    std::size_t n = 0;
    for (const char c : digits) n = std::min<std::size_t>(n * 10 + static_cast<std::size_t>(c - '0'), 1'000'000'000);
    if (n < VocabSpec::kMinWords || n > VocabSpec::kMaxWords)
      throw std::invalid_argument("vocabulary '" + std::string(spec) + "': " + std::string(digits) +
                                  " is out of range; " + expected);
    return {VocabKind::words, n};
  }
  throw std::invalid_argument("unknown vocabulary '" + std::string(spec) + "'; " + expected);
}

std::string to_string(const VocabSpec& spec) {
  return spec.kind == VocabKind::characters ? std::string("char") : "word:" + std::to_string(spec.size);
}

// ---- text validation and files ---------------------------------------------------

void check_text(std::string_view text, std::string_view source) {
  const std::string src(source);
  if (text.empty()) throw std::runtime_error(src + " is empty");
  const auto bad = [&](std::size_t at, const std::string& what) {
    return std::runtime_error(src + " is not valid UTF-8 text: " + what + " at offset " + std::to_string(at) +
                              " (binary files and other encodings such as Latin-1 or UTF-16 are not supported)");
  };
  const std::size_t n = text.size();
  const auto byte = [&](std::size_t k) { return static_cast<unsigned char>(text[k]); };
  // UTF-32 first: its little-endian byte-order mark starts like UTF-16's.
  if (n >= 4 && ((byte(0) == 0xFF && byte(1) == 0xFE && byte(2) == 0 && byte(3) == 0) ||
                 (byte(0) == 0 && byte(1) == 0 && byte(2) == 0xFE && byte(3) == 0xFF)))
    throw std::runtime_error(src + " looks like UTF-32 (byte-order mark " + hex_byte(byte(0)) + " " +
                             hex_byte(byte(1)) + " " + hex_byte(byte(2)) + " " + hex_byte(byte(3)) +
                             " at offset 0); convert it to UTF-8");
  if (n >= 2 && ((byte(0) == 0xFF && byte(1) == 0xFE) || (byte(0) == 0xFE && byte(1) == 0xFF)))
    throw std::runtime_error(src + " looks like UTF-16 (byte-order mark " + hex_byte(byte(0)) + " " +
                             hex_byte(byte(1)) + " at offset 0); convert it to UTF-8");
  std::size_t i = 0;
  while (i < n) {
    const unsigned char b = byte(i);
    if (b == 0) throw std::runtime_error(src + " is binary: NUL byte at offset " + std::to_string(i));
    if (b < 0x80) {
      ++i;
      continue;
    }
    std::size_t len = 0;
    unsigned char lo = 0x80, hi = 0xBF;  // allowed range of the second byte
    if (b >= 0xC2 && b <= 0xDF) {
      len = 2;
    } else if (b >= 0xE0 && b <= 0xEF) {
      len = 3;
      if (b == 0xE0) lo = 0xA0;  // overlong
      if (b == 0xED) hi = 0x9F;  // surrogates
    } else if (b >= 0xF0 && b <= 0xF4) {
      len = 4;
      if (b == 0xF0) lo = 0x90;  // overlong
      if (b == 0xF4) hi = 0x8F;  // above U+10FFFF
    } else if (b >= 0x80 && b <= 0xBF) {
      throw bad(i, "continuation byte " + hex_byte(b) + " without a lead byte");
    } else {
      throw bad(i, "byte " + hex_byte(b) + (b >= 0xF5 ? " (never used in UTF-8)" : " (overlong encoding)"));
    }
    if (i + len > n) throw bad(i, "a " + std::to_string(len) + "-byte character cut off by the end of the text");
    for (std::size_t k = 1; k < len; ++k) {
      const unsigned char c = byte(i + k);
      const unsigned char klo = k == 1 ? lo : 0x80, khi = k == 1 ? hi : 0xBF;
      if (c < klo || c > khi) {
        std::string why = "byte " + hex_byte(c) + " does not continue the character starting with " + hex_byte(b);
        if (k == 1 && c >= 0x80 && c <= 0xBF)
          why = b == 0xED ? "a UTF-16 surrogate (" + hex_byte(b) + " " + hex_byte(c) + ")"
                          : (b == 0xF4 ? "a code point above U+10FFFF" : "an overlong encoding");
        throw bad(i + k, why);
      }
    }
    i += len;
  }
}

std::string load_text_file(const std::string& path) {
  namespace fs = std::filesystem;
  const std::string src = "data file '" + path + "'";
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (ec && ec != std::errc::no_such_file_or_directory)
    throw std::runtime_error(src + " cannot be read: " + ec.message());
  if (!fs::exists(st)) throw std::runtime_error(src + " does not exist");
  if (fs::is_directory(st)) throw std::runtime_error(src + " is a directory; expected a UTF-8 text file");
  if (!fs::is_regular_file(st)) throw std::runtime_error(src + " is not a regular file; expected a UTF-8 text file");
  const std::uintmax_t size = fs::file_size(path, ec);
  if (ec) throw std::runtime_error(src + " cannot be read: " + ec.message());
  if (size > kMaxFileBytes)
    throw std::runtime_error(src + " is " + std::to_string(size) + " bytes; at most 4 GiB (" +
                             std::to_string(kMaxFileBytes) + " bytes) are supported");
  errno = 0;
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> f(std::fopen(path.c_str(), "rb"), &std::fclose);
  if (!f) throw std::runtime_error(src + " cannot be opened: " + std::strerror(errno));
  std::string text(static_cast<std::size_t>(size), '\0');
  std::size_t got = 0;
  while (got < text.size()) {
    const std::size_t r = std::fread(text.data() + got, 1, text.size() - got, f.get());
    if (r == 0) break;
    got += r;
  }
  if (std::ferror(f.get())) throw std::runtime_error(src + " cannot be read: " + std::strerror(errno));
  text.resize(got);  // a file that shrank while being read
  if (text.starts_with("\xEF\xBB\xBF")) text.erase(0, 3);
  check_text(text, src);
  return text;
}

// ---- tokenisation ----------------------------------------------------------------

void for_each_piece(std::string_view text, VocabKind kind, const std::function<void(std::string_view)>& piece) {
  const std::size_t n = text.size();
  if (kind == VocabKind::characters) {
    char32_t cp = 0;
    for (std::size_t i = 0; i < n;) {
      const std::size_t len = decode_at(text, i, cp);
      piece(text.substr(i, len));
      i += len;
    }
    return;
  }
  std::string word;
  const auto flush = [&] {
    if (!word.empty()) {
      piece(word);
      word.clear();
    }
  };
  char32_t cp = 0;
  for (std::size_t i = 0; i < n;) {
    const std::size_t len = decode_at(text, i, cp);
    CharClass cls = classify(cp);
    if (cls == CharClass::apostrophe) {
      char32_t next = 0;
      const bool joins = !word.empty() && i + len < n && classify((decode_at(text, i + len, next), next)) == CharClass::word;
      cls = joins ? CharClass::word : CharClass::punct;
    }
    if (cls == CharClass::word) {
      if (len == 1) {
        char c = text[i];
        if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
        word += c;
      } else {
        word.append(text.substr(i, len));
      }
    } else {
      flush();
      if (cls == CharClass::punct) piece(text.substr(i, len));
    }
    i += len;
  }
  flush();
}

std::vector<std::string> split_pieces(std::string_view text, VocabKind kind) {
  std::vector<std::string> out;
  for_each_piece(text, kind, [&](std::string_view p) { out.emplace_back(p); });
  return out;
}

// ---- vocabulary --------------------------------------------------------------------

Vocabulary::Vocabulary(VocabKind kind, std::vector<std::string> tokens) : kind_(kind), tokens_(std::move(tokens)) {
  if (tokens_.empty() || tokens_[0] != kUnkText)
    throw std::invalid_argument("Vocabulary: expected token 0 to be '<unk>'");
  if (tokens_.size() > std::numeric_limits<TokenId>::max())
    throw std::invalid_argument("Vocabulary: more than 2^32 - 1 tokens");
  index_.reserve(tokens_.size());
  for (std::size_t i = 1; i < tokens_.size(); ++i) {
    if (tokens_[i].empty() || tokens_[i] == kUnkText)
      throw std::invalid_argument("Vocabulary: token " + std::to_string(i) + " is empty or '<unk>'");
    if (!index_.emplace(tokens_[i], static_cast<TokenId>(i)).second)
      throw std::invalid_argument("Vocabulary: token " + std::to_string(i) + " '" + tokens_[i] + "' is a duplicate");
  }
}

Vocabulary Vocabulary::build(std::string_view text, const VocabSpec& spec) {
  check_options(DataOptions{spec, 0.1, 1});
  const PieceTable t = tokenize(text, spec.kind);
  std::vector<std::uint64_t> counts(t.pieces.size(), 0);
  for (const TokenId p : t.tokens) ++counts[p];
  return select_vocab(spec.kind, t.pieces, counts, spec.size).first;
}

const std::string& Vocabulary::token(TokenId id) const {
  if (id >= tokens_.size())
    throw std::out_of_range("Vocabulary: token id " + std::to_string(id) + " is not below the size " +
                            std::to_string(tokens_.size()));
  return tokens_[id];
}

std::optional<TokenId> Vocabulary::find(std::string_view piece) const {
  const auto it = index_.find(piece);
  if (it == index_.end()) return std::nullopt;
  return it->second;
}

std::vector<TokenId> Vocabulary::encode(std::string_view text) const {
  std::vector<TokenId> ids;
  for_each_piece(text, kind_, [&](std::string_view p) { ids.push_back(find(p).value_or(kUnk)); });
  return ids;
}

std::string Vocabulary::decode(std::span<const TokenId> ids) const {
  std::string out;
  bool space_after_previous = false;
  for (const TokenId id : ids) {
    const std::string& t = token(id);
    if (kind_ == VocabKind::words) {
      const bool closing = t.size() == 1 && std::string_view(",.;:!?)]}").find(t[0]) != std::string_view::npos;
      if (!out.empty() && space_after_previous && !closing) out += ' ';
      space_after_previous = !(t.size() == 1 && (t[0] == '(' || t[0] == '[' || t[0] == '{'));
    }
    out += t;
  }
  return out;
}

// ---- dataset -------------------------------------------------------------------------

std::size_t min_tokens_for(std::size_t context, double validation_fraction) {
  if (!(validation_fraction > 0.0 && validation_fraction <= 0.5))
    throw std::invalid_argument("validation fraction: expected a number in (0, 0.5], found " +
                                text::num(validation_fraction));
  if (context < 1 || context > (std::size_t{1} << 30))
    throw std::invalid_argument("context: expected 1 to 2^30 tokens, found " + std::to_string(context));
  const double need = static_cast<double>(context + 1);
  auto fits = [&](std::size_t n) {
    const std::size_t v = validation_count(n, validation_fraction);
    return v >= context + 1 && n - v >= context + 1;
  };
  std::size_t n = static_cast<std::size_t>(std::ceil(need / validation_fraction));
  while (!fits(n)) ++n;
  while (n > 1 && fits(n - 1)) --n;
  return n;
}

Dataset Dataset::from_text(std::string_view text, const DataOptions& options, std::string source) {
  check_options(options);
  check_text(text, source);
  PieceTable t = tokenize(text, options.vocab.kind);
  const std::size_t n = t.tokens.size();
  const std::size_t need = min_tokens_for(options.context, options.validation_fraction);
  if (n < need)
    throw std::runtime_error(source + " is too short: found " + std::to_string(n) + " tokens with vocabulary " +
                             to_string(options.vocab) + ", need at least " + std::to_string(need) + " (context " +
                             std::to_string(options.context) + " + 1 tokens in each split, " +
                             percent(options.validation_fraction) + " held out for validation)");
  const std::size_t n_val = validation_count(n, options.validation_fraction);
  const std::size_t n_train = n - n_val;
  std::vector<std::uint64_t> counts(t.pieces.size(), 0);
  for (std::size_t i = 0; i < n_train; ++i) ++counts[t.tokens[i]];
  auto [vocab, remap] = select_vocab(options.vocab.kind, t.pieces, counts, options.vocab.size);

  Dataset d;
  d.vocab_ = std::move(vocab);
  d.train_.resize(n_train);
  d.validation_.resize(n_val);
  for (std::size_t i = 0; i < n_train; ++i) d.train_[i] = remap[t.tokens[i]];
  for (std::size_t i = 0; i < n_val; ++i) d.validation_[i] = remap[t.tokens[n_train + i]];
  d.source_ = std::move(source);
  d.options_ = options;
  return d;
}

Dataset Dataset::from_file(const std::string& path, const DataOptions& options) {
  check_options(options);
  const std::string text = load_text_file(path);
  return from_text(text, options, "data file '" + path + "'");
}

Dataset Dataset::from_corpus(const CorpusOptions& corpus, const DataOptions& options) {
  check_options(options);
  const std::string text = generate_corpus(corpus);
  return from_text(text, options,
                   "default corpus (seed " + std::to_string(corpus.seed) + ", " + std::to_string(corpus.tokens) +
                       " tokens)");
}

double Dataset::unk_fraction() const noexcept {
  const std::size_t n = token_count();
  if (n == 0) return 0.0;
  const auto unk = std::count(train_.begin(), train_.end(), Vocabulary::kUnk) +
                   std::count(validation_.begin(), validation_.end(), Vocabulary::kUnk);
  return static_cast<double>(unk) / static_cast<double>(n);
}

std::uint64_t Dataset::fingerprint() const noexcept {
  std::uint64_t h = detail::mix64(0x64617461ull + static_cast<std::uint64_t>(vocab_.kind()));
  const auto add = [&](std::uint64_t x) { h = detail::mix64(h ^ (x + detail::kGolden)); };
  add(vocab_.size());
  for (std::size_t i = 0; i < vocab_.size(); ++i) {
    const std::string& s = vocab_.token(static_cast<TokenId>(i));
    add(s.size());
    for (const char c : s) add(static_cast<unsigned char>(c));
  }
  add(train_.size());
  for (const TokenId x : train_) add(x);
  add(validation_.size());
  for (const TokenId x : validation_) add(x);
  return h;
}

// ---- batches --------------------------------------------------------------------------

BatchSampler::BatchSampler(std::span<const TokenId> tokens, std::uint64_t seed) noexcept
    : tokens_(tokens), state_{seed, 0} {}

std::size_t BatchSampler::start_of(std::uint64_t counter, std::size_t context) const {
  if (context < 1 || tokens_.size() < context + 1)
    throw std::invalid_argument("BatchSampler: context " + std::to_string(context) + " needs at least " +
                                std::to_string(context + 1) + " tokens, the split has " +
                                std::to_string(tokens_.size()));
  const std::uint64_t range = tokens_.size() - context;
  return static_cast<std::size_t>(detail::splitmix_at(state_.seed, counter) % range);
}

void BatchSampler::next_batch(std::size_t batch, std::size_t context, std::span<TokenId> inputs,
                              std::span<TokenId> targets) {
  if (batch < 1) throw std::invalid_argument("BatchSampler::next_batch: batch must be >= 1");
  (void)start_of(0, context);  // validates context against the split
  if (inputs.size() != batch * context || targets.size() != batch * context)
    throw std::invalid_argument("BatchSampler::next_batch: expected inputs and targets of batch * context = " +
                                std::to_string(batch * context) + " tokens, found " + std::to_string(inputs.size()) +
                                " and " + std::to_string(targets.size()));
  const std::uint64_t range = tokens_.size() - context;
  for (std::size_t b = 0; b < batch; ++b) {
    const std::size_t s = static_cast<std::size_t>(detail::splitmix_at(state_.seed, state_.counter) % range);
    ++state_.counter;
    std::copy_n(tokens_.begin() + static_cast<std::ptrdiff_t>(s), context,
                inputs.begin() + static_cast<std::ptrdiff_t>(b * context));
    std::copy_n(tokens_.begin() + static_cast<std::ptrdiff_t>(s + 1), context,
                targets.begin() + static_cast<std::ptrdiff_t>(b * context));
  }
}

ValidationWindows::ValidationWindows(std::span<const TokenId> tokens, std::size_t context)
    : tokens_(tokens), context_(context), windows_(0) {
  if (context < 1 || tokens.size() < context + 1)
    throw std::invalid_argument("ValidationWindows: context " + std::to_string(context) + " needs at least " +
                                std::to_string(context + 1) + " tokens, the split has " + std::to_string(tokens.size()));
  windows_ = (tokens.size() - 1) / context;
}

std::size_t ValidationWindows::next(std::size_t batch, std::span<TokenId> inputs, std::span<TokenId> targets) {
  if (batch < 1) throw std::invalid_argument("ValidationWindows::next: batch must be >= 1");
  if (inputs.size() < batch * context_ || targets.size() < batch * context_)
    throw std::invalid_argument("ValidationWindows::next: expected inputs and targets of at least batch * context = " +
                                std::to_string(batch * context_) + " tokens, found " + std::to_string(inputs.size()) +
                                " and " + std::to_string(targets.size()));
  const std::size_t rows = std::min(batch, windows_ - next_);
  for (std::size_t r = 0; r < rows; ++r) {
    const std::size_t s = (next_ + r) * context_;
    std::copy_n(tokens_.begin() + static_cast<std::ptrdiff_t>(s), context_,
                inputs.begin() + static_cast<std::ptrdiff_t>(r * context_));
    std::copy_n(tokens_.begin() + static_cast<std::ptrdiff_t>(s + 1), context_,
                targets.begin() + static_cast<std::ptrdiff_t>(r * context_));
  }
  next_ += rows;
  return rows;
}

// ---- statistics -------------------------------------------------------------------------

double TokenStats::coverage(std::size_t k) const noexcept {
  if (tokens == 0) return 0.0;
  std::uint64_t sum = 0;
  for (std::size_t i = 0; i < std::min(k, counts_desc.size()); ++i) sum += counts_desc[i];
  return static_cast<double>(sum) / static_cast<double>(tokens);
}

TokenStats token_stats(std::span<const TokenId> tokens, std::size_t vocab_size) {
  std::vector<std::uint64_t> counts(vocab_size, 0);
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] >= vocab_size)
      throw std::invalid_argument("token_stats: token " + std::to_string(i) + " has id " + std::to_string(tokens[i]) +
                                  ", not below the vocabulary size " + std::to_string(vocab_size));
    ++counts[tokens[i]];
  }
  TokenStats s;
  s.tokens = tokens.size();
  s.vocab_size = vocab_size;
  for (const std::uint64_t c : counts)
    if (c > 0) s.counts_desc.push_back(c);
  std::sort(s.counts_desc.begin(), s.counts_desc.end(), std::greater<>());
  s.distinct = s.counts_desc.size();
  const double n = static_cast<double>(s.tokens);
  for (const std::uint64_t c : s.counts_desc) {
    const double p = static_cast<double>(c) / n;
    s.entropy_nats -= p * std::log(p);
  }
  std::size_t last = 0;  // ranks 1..last have count >= 10
  while (last < s.counts_desc.size() && s.counts_desc[last] >= 10) ++last;
  std::vector<double> xs, ys;
  for (std::size_t r = 1; r <= last; r = std::max(r + 1, static_cast<std::size_t>(static_cast<double>(r) * 1.1))) {
    xs.push_back(std::log(static_cast<double>(r)));
    ys.push_back(std::log(static_cast<double>(s.counts_desc[r - 1])));
  }
  if (xs.size() >= 3) {
    const double m = static_cast<double>(xs.size());
    double sx = 0, sy = 0;
    for (std::size_t i = 0; i < xs.size(); ++i) sx += xs[i], sy += ys[i];
    const double mx = sx / m, my = sy / m;
    double sxy = 0, sxx = 0;
    for (std::size_t i = 0; i < xs.size(); ++i) sxy += (xs[i] - mx) * (ys[i] - my), sxx += (xs[i] - mx) * (xs[i] - mx);
    s.zipf_exponent = -sxy / sxx;
  }
  return s;
}

HeldOutEntropy heldout_entropy(std::span<const TokenId> train, std::span<const TokenId> validation,
                               std::size_t vocab_size) {
  if (train.size() < 2 || validation.empty())
    throw std::invalid_argument("heldout_entropy: expected at least 2 training tokens and 1 validation token");
  (void)token_stats(train, vocab_size);  // range checks
  (void)token_stats(validation, vocab_size);
  std::vector<std::uint64_t> count(vocab_size, 0);
  for (const TokenId t : train) ++count[t];
  const double denom = static_cast<double>(train.size() + vocab_size);
  const auto p_uni = [&](TokenId w) { return static_cast<double>(count[w] + 1) / denom; };

  // Bigram counts: sorted (prev << 32 | next) keys with run lengths.
  std::vector<std::uint64_t> keys(train.size() - 1);
  for (std::size_t i = 0; i + 1 < train.size(); ++i) keys[i] = (std::uint64_t{train[i]} << 32) | train[i + 1];
  std::sort(keys.begin(), keys.end());
  std::vector<std::uint64_t> uniq;
  std::vector<std::uint32_t> pair_count;
  std::vector<std::uint64_t> ctx_count(vocab_size, 0), followers(vocab_size, 0);
  for (std::size_t i = 0; i < keys.size();) {
    std::size_t j = i;
    while (j < keys.size() && keys[j] == keys[i]) ++j;
    uniq.push_back(keys[i]);
    pair_count.push_back(static_cast<std::uint32_t>(j - i));
    const auto v = static_cast<TokenId>(keys[i] >> 32);
    ctx_count[v] += j - i;
    ++followers[v];
    i = j;
  }
  HeldOutEntropy h;
  double uni_sum = 0, bi_sum = 0;
  for (std::size_t i = 0; i < validation.size(); ++i) {
    const TokenId w = validation[i];
    const double pu = p_uni(w);
    uni_sum -= std::log(pu);
    double pb = pu;
    if (i > 0 && ctx_count[validation[i - 1]] > 0) {
      const TokenId v = validation[i - 1];
      const std::uint64_t key = (std::uint64_t{v} << 32) | w;
      const auto it = std::lower_bound(uniq.begin(), uniq.end(), key);
      const double c = (it != uniq.end() && *it == key) ? pair_count[static_cast<std::size_t>(it - uniq.begin())] : 0.0;
      const double t = static_cast<double>(followers[v]);
      pb = (c + t * pu) / (static_cast<double>(ctx_count[v]) + t);
    }
    bi_sum -= std::log(pb);
  }
  h.unigram_nats = uni_sum / static_cast<double>(validation.size());
  h.bigram_nats = bi_sum / static_cast<double>(validation.size());
  return h;
}

}  // namespace mixprec::nn
