// Training data for the language models: the embedded default corpus (a seeded
// probabilistic grammar, no download), UTF-8 text files, character and word
// tokenisers, a train/validation split, a restorable random batch sampler and a
// sequential validation iterator. See docs/data.md.
//
// Everything here is deterministic and portable: the generator and the sampler use
// their own integer PRNG (splitmix64), never <random>'s distributions, so the same
// seed gives the same corpus and the same batches with every compiler and library.
//
// Errors: std::invalid_argument for bad arguments (a vocabulary spec, a fraction, a
// span of the wrong size), std::runtime_error for bad data (a missing, unreadable,
// empty, binary or too short file or text); messages name the source, what is wrong,
// where (byte offset) and what is allowed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace mixprec::nn {

using TokenId = std::uint32_t;

// ---- vocabulary specification ("char" or "word:N") -----------------------------

enum class VocabKind : std::uint8_t {
  characters,  // one token per Unicode code point seen in the training split, plus <unk>
  words,       // the N-1 most frequent lowercased words/punctuation marks, plus <unk>
};

struct VocabSpec {
  static constexpr std::size_t kMinWords = 16;
  static constexpr std::size_t kMaxWords = 65536;

  VocabKind kind = VocabKind::words;
  // words: the total number of ids, <unk> included (word:1024 -> ids 0..1023 at most);
  // characters: 0 (the size follows from the text).
  std::size_t size = 1024;

  friend bool operator==(const VocabSpec&, const VocabSpec&) = default;
};

// "char" or "word:N" with N in [16, 65536]. Throws std::invalid_argument naming the
// spec and the accepted forms.
VocabSpec parse_vocab_spec(std::string_view spec);
// Inverse of parse_vocab_spec: "char" or "word:N".
std::string to_string(const VocabSpec& spec);

// ---- text validation and files -----------------------------------------------

// Throws std::runtime_error unless `text` is non-empty, valid UTF-8 (no overlong
// forms, surrogates or code points above U+10FFFF, no truncated sequence) and free of
// NUL bytes. Messages start with `source` and give the byte offset of the first bad
// byte, e.g. "data file 'x.bin' is binary: NUL byte at offset 17".
void check_text(std::string_view text, std::string_view source);

// Reads a whole UTF-8 text file (a leading byte-order mark is dropped) and checks it
// with check_text. Throws std::runtime_error naming the file when it does not exist,
// is a directory or not a regular file, cannot be read (with the system's reason), is
// empty, binary (a NUL byte) or not UTF-8 (with the offset), or is over 4 GiB.
// Lines may be of any length.
std::string load_text_file(const std::string& path);

// ---- tokenisation ---------------------------------------------------------------

// The pieces `text` splits into under `kind` (docs/data.md, "Tokenisation"):
//   characters: every code point (as its UTF-8 bytes), whitespace included;
//   words: maximal runs of word characters (ASCII letters and digits, non-ASCII letters,
//     an apostrophe between two word characters), ASCII letters lowercased; every ASCII
//     punctuation mark and every Unicode punctuation mark (U+00A1..U+00BF, U+2010..U+205E,
//     U+3001..U+303F) is a piece of its own; whitespace, control characters and Unicode
//     spaces separate pieces and are dropped.
// `text` should be valid UTF-8 (check_text; otherwise each stray byte is a piece of its
// own). Calls `piece` once per piece, in order; the view is only valid during the call.
void for_each_piece(std::string_view text, VocabKind kind, const std::function<void(std::string_view)>& piece);
std::vector<std::string> split_pieces(std::string_view text, VocabKind kind);

class Vocabulary {
 public:
  static constexpr TokenId kUnk = 0;
  static constexpr std::string_view kUnkText = "<unk>";

  Vocabulary() = default;
  // tokens[0] must be "<unk>"; the others distinct, non-empty and not "<unk>".
  // Throws std::invalid_argument otherwise.
  Vocabulary(VocabKind kind, std::vector<std::string> tokens);

  // The vocabulary of a training text: characters: <unk> then every code point that
  // occurs, in code-point order; words: <unk> then the min(spec.size - 1, distinct)
  // most frequent pieces, by count descending, ties by byte-wise ascending text.
  static Vocabulary build(std::string_view text, const VocabSpec& spec);

  VocabKind kind() const noexcept { return kind_; }
  std::size_t size() const noexcept { return tokens_.size(); }
  const std::string& token(TokenId id) const;  // throws std::out_of_range
  std::optional<TokenId> find(std::string_view piece) const;
  // Pieces of `text` (for_each_piece) to ids; pieces not in the vocabulary -> kUnk.
  std::vector<TokenId> encode(std::string_view text) const;
  // characters: the tokens concatenated; words: joined by single spaces, with no space
  // before , . ; : ! ? ) ] } and none after ( [ {. encode(decode(ids)) == ids for ids
  // without kUnk. Throws std::out_of_range for an id >= size().
  std::string decode(std::span<const TokenId> ids) const;

 private:
  struct Hash {
    using is_transparent = void;
    std::size_t operator()(std::string_view s) const noexcept { return std::hash<std::string_view>{}(s); }
  };
  VocabKind kind_ = VocabKind::words;
  std::vector<std::string> tokens_;
  std::unordered_map<std::string, TokenId, Hash, std::equal_to<>> index_;
};

// ---- the embedded default corpus ------------------------------------------------

struct CorpusOptions {
  static constexpr std::size_t kDefaultTokens = 2'000'000;
  static constexpr std::size_t kMaxTokens = 1'000'000'000;

  std::uint64_t seed = 1;                 // the sentence stream; the lexicon is fixed
  std::size_t tokens = kDefaultTokens;    // word tokens (words + punctuation), >= 1
};

// English-like text from a fixed lexicon of invented words and a probabilistic grammar
// (docs/data.md): paragraphs with a topic and a tense, nine sentence templates, number
// agreement (also across relative clauses), Zipf-Mandelbrot word frequencies. Sentences
// are generated until their word tokenisation holds at least `tokens` tokens; the text
// for n tokens is a prefix of the text for m > n tokens with the same seed.
// Deterministic across platforms; about 0.1 s for the default 2 million tokens. Throws
// std::invalid_argument for tokens outside [1, kMaxTokens].
std::string generate_corpus(const CorpusOptions& options = {});

struct LexiconSummary {
  std::size_t topics = 0;
  std::size_t noun_stems = 0;       // each with a singular and a plural form
  std::size_t verb_stems = 0;       // each with base, 3rd-person -s and past -ed forms
  std::size_t transitive_verbs = 0;
  std::size_t adjectives = 0;
  std::size_t adverbs = 0;          // adjective + "ly"
  std::size_t names = 0;
  std::size_t function_words = 0;   // fixed English words and punctuation
  std::size_t surface_forms = 0;    // distinct lowercased word tokens the grammar can emit
};
LexiconSummary corpus_lexicon_summary();

// ---- dataset ----------------------------------------------------------------------

struct DataOptions {
  VocabSpec vocab{};                 // word:1024
  double validation_fraction = 0.1;  // the last floor(n * f) tokens are held out; 0 < f <= 0.5
  // Each split must hold at least context + 1 tokens (one full window and its target).
  std::size_t context = 64;
};

class Dataset {
 public:
  // Tokenises `text` (check_text first), splits the piece stream (the first n - n_val
  // pieces train, the last n_val = floor(n * validation_fraction) validate), builds the
  // vocabulary from the training pieces only and maps both splits to ids (unseen or
  // rare pieces -> <unk>). Throws std::invalid_argument for bad options and
  // std::runtime_error naming `source` for bad text or too few tokens (how many were
  // found and how many are needed).
  static Dataset from_text(std::string_view text, const DataOptions& options, std::string source = "text");
  // load_text_file then from_text, source "data file 'PATH'".
  static Dataset from_file(const std::string& path, const DataOptions& options);
  // generate_corpus then from_text, source "default corpus (seed S, N tokens)".
  static Dataset from_corpus(const CorpusOptions& corpus, const DataOptions& options);

  const Vocabulary& vocab() const noexcept { return vocab_; }
  std::span<const TokenId> train() const noexcept { return train_; }
  std::span<const TokenId> validation() const noexcept { return validation_; }
  std::size_t token_count() const noexcept { return train_.size() + validation_.size(); }
  const std::string& source() const noexcept { return source_; }
  const DataOptions& options() const noexcept { return options_; }
  // Fraction of all tokens (both splits) that are <unk>.
  double unk_fraction() const noexcept;
  // 64-bit hash of the vocabulary and both token arrays: a checkpoint records it so
  // that resuming on different data is detected.
  std::uint64_t fingerprint() const noexcept;

 private:
  Vocabulary vocab_;
  std::vector<TokenId> train_;
  std::vector<TokenId> validation_;
  std::string source_;
  DataOptions options_;
};

// Smallest token count n whose split gives both sides >= context + 1 tokens.
// Throws std::invalid_argument for a fraction outside (0, 0.5] or context 0.
std::size_t min_tokens_for(std::size_t context, double validation_fraction);

// ---- batches ---------------------------------------------------------------------

// The sampler's whole state: restoring it reproduces every later batch exactly.
struct SamplerState {
  std::uint64_t seed = 0;
  std::uint64_t counter = 0;  // sequences drawn so far
  friend bool operator==(const SamplerState&, const SamplerState&) = default;
};

// Random training windows. Sequence k (k = counter) starts at
// splitmix64_k(seed) mod (tokens.size() - context), where splitmix64_k is the k-th
// output of the splitmix64 generator whose state starts at mix64(seed); so any
// position is reachable in O(1) and the state is two integers. Non-owning: `tokens`
// must outlive the sampler. Nothing is allocated per batch.
class BatchSampler {
 public:
  BatchSampler(std::span<const TokenId> tokens, std::uint64_t seed) noexcept;

  // Fills `batch` rows of `context` tokens: inputs[b*context + t] = tokens[s_b + t],
  // targets[b*context + t] = tokens[s_b + t + 1]. Throws std::invalid_argument when
  // batch or context is 0, a span is not batch*context long, or the tokens are fewer
  // than context + 1.
  void next_batch(std::size_t batch, std::size_t context, std::span<TokenId> inputs, std::span<TokenId> targets);
  // The start of sequence `counter` for `context` (what next_batch uses).
  std::size_t start_of(std::uint64_t counter, std::size_t context) const;

  SamplerState state() const noexcept { return state_; }
  void restore(const SamplerState& state) noexcept { state_ = state; }

 private:
  std::span<const TokenId> tokens_;
  SamplerState state_;
};

// The held-out split in consecutive non-overlapping windows: window w has inputs
// tokens[w*context .. w*context + context) and targets shifted by one. There are
// floor((n - 1) / context) windows; the last (n - 1) mod context targets are not
// covered. Non-owning.
class ValidationWindows {
 public:
  // Throws std::invalid_argument when context is 0 or tokens.size() < context + 1.
  ValidationWindows(std::span<const TokenId> tokens, std::size_t context);

  std::size_t window_count() const noexcept { return windows_; }
  std::size_t covered_tokens() const noexcept { return windows_ * context_; }
  std::size_t context() const noexcept { return context_; }
  std::size_t position() const noexcept { return next_; }  // windows returned so far
  void reset() noexcept { next_ = 0; }
  // Fills up to `batch` rows (the spans must hold batch*context tokens each) with the
  // next windows and returns how many were filled: `batch` until the last call, then
  // the rest, then 0. Throws std::invalid_argument for batch 0 or short spans.
  std::size_t next(std::size_t batch, std::span<TokenId> inputs, std::span<TokenId> targets);

 private:
  std::span<const TokenId> tokens_;
  std::size_t context_;
  std::size_t windows_;
  std::size_t next_ = 0;
};

// ---- statistics -------------------------------------------------------------------

struct TokenStats {
  std::size_t tokens = 0;
  std::size_t vocab_size = 0;
  std::size_t distinct = 0;               // ids that occur
  std::vector<std::uint64_t> counts_desc;  // their counts, descending
  double entropy_nats = 0;                // unigram plug-in entropy
  // s in count(rank) ~ rank^-s: least-squares slope of log count on log rank over
  // log-spaced ranks (1, 2, 3, ... and every ~10% after) up to the last rank whose
  // count is >= 10 (0 when fewer than 3 such ranks).
  double zipf_exponent = 0;
  // Fraction of tokens whose id is among the k most frequent.
  double coverage(std::size_t k) const noexcept;
};
// Throws std::invalid_argument for an id >= vocab_size.
TokenStats token_stats(std::span<const TokenId> tokens, std::size_t vocab_size);

// Cross-entropy (nats per token) of the held-out tokens under models estimated on the
// training tokens: an add-one unigram model and an interpolated bigram model
// (Witten-Bell: P(w|v) = (c(v,w) + T(v) P_uni(w)) / (c(v) + T(v)), T(v) distinct
// followers of v). The gap is structure a model can learn from one token of context.
struct HeldOutEntropy {
  double unigram_nats = 0;
  double bigram_nats = 0;
};
HeldOutEntropy heldout_entropy(std::span<const TokenId> train, std::span<const TokenId> validation,
                               std::size_t vocab_size);

}  // namespace mixprec::nn
