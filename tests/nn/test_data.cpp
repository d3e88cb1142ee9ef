// The data layer: the default corpus (determinism, vocabulary, Zipf, learnable
// structure), tokenisers, vocabulary specs, file errors, the split, the batch sampler
// (save/restore) and validation windows.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "mixprec/nn/data.hpp"
#include "support.hpp"

namespace mixprec::nn {
namespace {

using test::error_of;

namespace fs = std::filesystem;

// The corpus most tests share: 300k tokens keep the suite fast under the sanitizers.
const std::string& corpus_text() {
  static const std::string text = generate_corpus({.seed = 1, .tokens = 300'000});
  return text;
}

class TempDir {
 public:
  TempDir() {
    path_ = fs::temp_directory_path() / ("mixprec_test_data_" + std::to_string(::getpid()));
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::permissions(path_ / "unreadable.txt", fs::perms::owner_all, ec);
    fs::remove_all(path_, ec);
  }
  std::string write(const std::string& name, const std::string& bytes) const {
    const fs::path p = path_ / name;
    std::ofstream(p, std::ios::binary) << bytes;
    return p.string();
  }
  std::string path(const std::string& name) const { return (path_ / name).string(); }

 private:
  fs::path path_;
};

// ---- the default corpus ------------------------------------------------------------

TEST(Corpus, SameSeedSameTextDifferentSeedDifferentText) {
  const std::string a = generate_corpus({.seed = 7, .tokens = 20'000});
  const std::string b = generate_corpus({.seed = 7, .tokens = 20'000});
  const std::string c = generate_corpus({.seed = 8, .tokens = 20'000});
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  EXPECT_NE(a.substr(0, 200), c.substr(0, 200));
}

TEST(Corpus, TokenCountAndPrefixProperty) {
  const std::string small = generate_corpus({.seed = 3, .tokens = 5'000});
  const std::string large = generate_corpus({.seed = 3, .tokens = 50'000});
  EXPECT_TRUE(large.starts_with(small));
  const std::size_t n = split_pieces(small, VocabKind::words).size();
  EXPECT_GE(n, 5'000u);
  EXPECT_LT(n, 5'000u + 100u);  // stops at the end of the sentence that reaches the count
  check_text(large, "corpus");   // valid UTF-8 (ASCII), no NUL
}

TEST(Corpus, RejectsBadTokenCounts) {
  EXPECT_NE(error_of<std::invalid_argument>([] { generate_corpus({.seed = 1, .tokens = 0}); })
                .find("expected tokens in [1, 1000000000], found 0"),
            std::string::npos);
}

TEST(Corpus, LexiconHasOver1024Words) {
  const LexiconSummary s = corpus_lexicon_summary();
  EXPECT_GE(s.surface_forms, 1024u);
  EXPECT_EQ(s.surface_forms, 2 * s.noun_stems + 3 * s.verb_stems + s.adjectives + s.adverbs + s.names +
                                 s.function_words);
}

TEST(Corpus, RealisticVocabularyWithZipfFrequencies) {
  const Dataset all = Dataset::from_text(corpus_text(), {.vocab = {VocabKind::words, 65536}}, "corpus");
  const TokenStats st = token_stats(all.train(), all.vocab().size());
  EXPECT_GE(st.distinct, 1024u) << "distinct word tokens in 270k training tokens";
  EXPECT_GT(st.zipf_exponent, 0.8);
  EXPECT_LT(st.zipf_exponent, 1.5);
  // The 1023 most frequent words cover nearly all tokens, but not all: a real tail.
  EXPECT_GT(st.coverage(1023), 0.95);
  EXPECT_LT(st.coverage(1023), 0.9995);
  EXPECT_LT(st.coverage(10), 0.6);

  const Dataset w = Dataset::from_text(corpus_text(), {}, "corpus");  // word:1024
  EXPECT_EQ(w.vocab().size(), 1024u);
  EXPECT_LT(w.unk_fraction(), 0.05);
  EXPECT_GT(w.unk_fraction(), 0.0);
}

TEST(Corpus, HasStructureBeyondUnigramFrequencies) {
  const Dataset d = Dataset::from_text(corpus_text(), {}, "corpus");
  const HeldOutEntropy h = heldout_entropy(d.train(), d.validation(), d.vocab().size());
  EXPECT_GT(h.unigram_nats, 4.0);
  EXPECT_LT(h.bigram_nats, h.unigram_nats - 0.6) << "unigram " << h.unigram_nats << " bigram " << h.bigram_nats;
}

TEST(Corpus, AgreementIsConsistent) {
  // Every "does"/"do" question or negation agrees with its subject: "he do" and
  // "they does" never occur; "an" is always followed by a vowel-initial word.
  const std::vector<std::string> p = split_pieces(corpus_text(), VocabKind::words);
  const std::set<std::string> before_subject = {".", "?", "!", ",", "that", "when", "because", "if", "while",
                                                "although", "before", "after", "until"};
  std::size_t an = 0;
  for (std::size_t i = 0; i + 1 < p.size(); ++i) {
    // Subject pronouns only: an object may precede a verb ("the cats that see it do not ...").
    const bool subject = i == 0 || before_subject.contains(p[i - 1]);
    if (subject && (p[i] == "he" || p[i] == "she" || p[i] == "it")) {
      EXPECT_NE(p[i + 1], "do") << i;
    }
    if (subject && (p[i] == "they" || p[i] == "we" || p[i] == "i")) {
      EXPECT_NE(p[i + 1], "does") << i;
    }
    if (p[i] == "an") {
      ++an;
      EXPECT_NE(std::string("aeiou").find(p[i + 1][0]), std::string::npos) << p[i + 1];
    }
    if (p[i] == "a") {
      EXPECT_EQ(std::string("aeiou").find(p[i + 1][0]), std::string::npos) << p[i + 1];
    }
  }
  EXPECT_GT(an, 100u);
}

// The full default size in Release; a smaller corpus under the sanitizers.
#if MIXPREC_EXHAUSTIVE
constexpr CorpusOptions kStatsCorpus{};
#else
constexpr CorpusOptions kStatsCorpus{.seed = 1, .tokens = 200'000};
#endif

TEST(Corpus, PrintStatistics) {
  // Figures quoted in docs/data.md (default seed, default size, word:1024 and char).
  const Dataset d = Dataset::from_corpus(kStatsCorpus, {});
  const Dataset all = Dataset::from_corpus(kStatsCorpus, {.vocab = {VocabKind::words, 65536}});
  const Dataset c = Dataset::from_corpus(kStatsCorpus, {.vocab = {VocabKind::characters, 0}});
  const TokenStats st = token_stats(all.train(), all.vocab().size());
  const HeldOutEntropy h = heldout_entropy(d.train(), d.validation(), d.vocab().size());
  const HeldOutEntropy hc = heldout_entropy(c.train(), c.validation(), c.vocab().size());
  const LexiconSummary lex = corpus_lexicon_summary();
  std::printf("lexicon: %zu surface forms (%zu noun stems, %zu verb stems, %zu adjectives, %zu adverbs, %zu names, "
              "%zu function words), %zu topics\n",
              lex.surface_forms, lex.noun_stems, lex.verb_stems, lex.adjectives, lex.adverbs, lex.names,
              lex.function_words, lex.topics);
  std::printf("default corpus: %zu tokens (%zu train, %zu validation), %zu distinct words in train, zipf s=%.3f\n",
              d.token_count(), d.train().size(), d.validation().size(), st.distinct, st.zipf_exponent);
  for (const std::size_t k : {1, 10, 100, 255, 511, 1023, 2047})
    std::printf("  top-%zu coverage %.4f\n", k, st.coverage(k));
  std::printf("word:1024: vocab %zu, unk fraction %.4f, unigram entropy %.3f nats; held-out unigram %.3f, bigram %.3f "
              "nats\n",
              d.vocab().size(), d.unk_fraction(), token_stats(d.train(), d.vocab().size()).entropy_nats,
              h.unigram_nats, h.bigram_nats);
  std::printf("char: vocab %zu, %zu tokens; held-out unigram %.3f, bigram %.3f nats\n", c.vocab().size(),
              c.token_count(), hc.unigram_nats, hc.bigram_nats);
  const std::string text = generate_corpus({.seed = 1, .tokens = 60});
  std::printf("sample:\n%s\n", text.c_str());
  std::printf("fingerprint %016llx\n", static_cast<unsigned long long>(d.fingerprint()));
  EXPECT_EQ(d.token_count(), all.token_count());
}

// ---- vocabulary specs and tokenisers ---------------------------------------------------

TEST(VocabSpecs, ParseAndPrint) {
  EXPECT_EQ(parse_vocab_spec("char"), (VocabSpec{VocabKind::characters, 0}));
  EXPECT_EQ(parse_vocab_spec("word:1024"), (VocabSpec{VocabKind::words, 1024}));
  EXPECT_EQ(parse_vocab_spec("word:16").size, 16u);
  EXPECT_EQ(parse_vocab_spec("word:65536").size, 65536u);
  EXPECT_EQ(to_string(parse_vocab_spec("word:300")), "word:300");
  EXPECT_EQ(to_string(parse_vocab_spec("char")), "char");
  const auto err = [](const char* s) { return error_of<std::invalid_argument>([&] { parse_vocab_spec(s); }); };
  EXPECT_EQ(err("bpe"), "unknown vocabulary 'bpe'; expected 'char' or 'word:N' with N in [16, 65536]");
  EXPECT_NE(err("word:15").find("15 is out of range"), std::string::npos);
  EXPECT_NE(err("word:65537").find("65537 is out of range"), std::string::npos);
  EXPECT_NE(err("word:").find("'' is not a whole number"), std::string::npos);
  EXPECT_NE(err("word:1e3").find("'1e3' is not a whole number"), std::string::npos);
  EXPECT_NE(err("word:-5").find("is not a whole number"), std::string::npos);
  EXPECT_NE(err("word:99999999999999999999").find("99999999999999999999 is out of range"), std::string::npos);
  EXPECT_EQ(parse_vocab_spec("word:0100").size, 100u);
  EXPECT_NE(err("Char").find("unknown vocabulary 'Char'"), std::string::npos);
}

TEST(Tokenise, WordRules) {
  const std::vector<std::string> p =
      split_pieces("Hello, World! It's 42 o'clock -- 'quoted' caf\xC3\xA9 \xE2\x80\x9Cyes\xE2\x80\x9D\xC2\xA0ok\n",
                   VocabKind::words);
  const std::vector<std::string> want = {"hello", ",",  "world", "!", "it's",         "42",           "o'clock",
                                         "-",     "-",  "'",     "quoted", "'",      "caf\xC3\xA9", "\xE2\x80\x9C",
                                         "yes",   "\xE2\x80\x9D", "ok"};
  EXPECT_EQ(p, want);
}

TEST(Tokenise, CharactersAreCodePoints) {
  const std::vector<std::string> p = split_pieces("a\xC3\xA9 \xE2\x82\xAC\xF0\x9F\x98\x80\n", VocabKind::characters);
  const std::vector<std::string> want = {"a", "\xC3\xA9", " ", "\xE2\x82\xAC", "\xF0\x9F\x98\x80", "\n"};
  EXPECT_EQ(p, want);
  // Unchecked text never reads past the end: a cut-off sequence is one byte-piece per byte.
  EXPECT_EQ(split_pieces("a\xE2\x82", VocabKind::characters), (std::vector<std::string>{"a", "\xE2", "\x82"}));
  EXPECT_EQ(split_pieces("ab\xF0", VocabKind::words), (std::vector<std::string>{"ab\xF0"}));
}

TEST(Tokenise, WordVocabularyOrderAndTies) {
  const Vocabulary v = Vocabulary::build("b a c b a d. b", {VocabKind::words, 16});
  ASSERT_EQ(v.size(), 6u);
  EXPECT_EQ(v.token(0), "<unk>");
  EXPECT_EQ(v.token(1), "b");  // 3
  EXPECT_EQ(v.token(2), "a");  // 2
  EXPECT_EQ(v.token(3), ".");  // 1, ties in byte order: "." < "c" < "d"
  EXPECT_EQ(v.token(4), "c");
  EXPECT_EQ(v.token(5), "d");
  std::string many;
  for (int i = 0; i < 40; ++i) {
    many += 'w';
    many += std::to_string(i);
    many += ' ';
  }
  EXPECT_EQ(Vocabulary::build(many, {VocabKind::words, 16}).size(), 16u);
  EXPECT_THROW(v.token(6), std::out_of_range);
}

TEST(Tokenise, RoundTrips) {
  const Dataset c = Dataset::from_text(corpus_text(), {.vocab = {VocabKind::characters, 0}}, "corpus");
  const std::string head = corpus_text().substr(0, 5000);
  const std::vector<TokenId> ids = c.vocab().encode(head);
  EXPECT_EQ(c.vocab().decode(ids), head);
  EXPECT_EQ(std::vector<TokenId>(c.train().begin(), c.train().begin() + 5000), ids);

  const Dataset w = Dataset::from_text(corpus_text(), {}, "corpus");
  std::vector<TokenId> wid(w.train().begin(), w.train().begin() + 3000);
  std::erase(wid, Vocabulary::kUnk);
  const std::string text = w.vocab().decode(wid);
  EXPECT_EQ(w.vocab().encode(text), wid);

  const Vocabulary v(VocabKind::words, {"<unk>", "(", "x", ")", ",", "'", "y", "[", "."});
  const std::vector<TokenId> seq = {1, 2, 3, 4, 6, 5, 2, 7, 6, 8, 8};
  EXPECT_EQ(v.decode(seq), "(x), y ' x [y..");
  EXPECT_EQ(v.encode(v.decode(seq)), seq);
  EXPECT_EQ(v.encode("x zzz y"), (std::vector<TokenId>{2, 0, 6}));
}

TEST(Tokenise, VocabularyValidation) {
  EXPECT_THROW(Vocabulary(VocabKind::words, {}), std::invalid_argument);
  EXPECT_THROW(Vocabulary(VocabKind::words, {"a"}), std::invalid_argument);
  EXPECT_NE(error_of<std::invalid_argument>([] { Vocabulary(VocabKind::words, {"<unk>", "a", "a"}); })
                .find("token 2 'a' is a duplicate"),
            std::string::npos);
}

// ---- files and text errors ---------------------------------------------------------------

TEST(Files, LoadsUtf8AndDropsByteOrderMark) {
  const TempDir dir;
  const std::string long_line(200'000, 'x');
  const std::string p = dir.write("ok.txt", "\xEF\xBB\xBFz\xC3\xA9ro " + long_line + "\n");
  const std::string text = load_text_file(p);
  EXPECT_EQ(text, "z\xC3\xA9ro " + long_line + "\n");
}

TEST(Files, ClearErrors) {
  const TempDir dir;
  const auto err = [](const std::string& path) { return error_of<std::runtime_error>([&] { load_text_file(path); }); };
  const std::string missing = dir.path("missing.txt");
  EXPECT_EQ(err(missing), "data file '" + missing + "' does not exist");
  const std::string empty = dir.write("empty.txt", "");
  EXPECT_EQ(err(empty), "data file '" + empty + "' is empty");
  const std::string bom_only = dir.write("bom.txt", "\xEF\xBB\xBF");
  EXPECT_EQ(err(bom_only), "data file '" + bom_only + "' is empty");
  const std::string nul = dir.write("nul.bin", std::string("abc\0def", 7));
  EXPECT_EQ(err(nul), "data file '" + nul + "' is binary: NUL byte at offset 3");
  const std::string latin1 = dir.write("latin1.txt", "caf\xE9 au lait");
  EXPECT_NE(err(latin1).find("data file '" + latin1 + "' is not valid UTF-8 text: byte 0x20 does not continue the "
                             "character starting with 0xe9 at offset 4"),
            std::string::npos)
      << err(latin1);
  EXPECT_NE(err(dir.write("utf16.txt", std::string("\xFF\xFEh\0i\0", 6))).find("looks like UTF-16"),
            std::string::npos);
  const std::string d = dir.path("adir");
  fs::create_directories(d);
  EXPECT_EQ(err(d), "data file '" + d + "' is a directory; expected a UTF-8 text file");
  if (::geteuid() != 0) {  // root reads any file
    const std::string unreadable = dir.write("unreadable.txt", "text");
    fs::permissions(unreadable, fs::perms::none);
    EXPECT_NE(err(unreadable).find("cannot be opened: Permission denied"), std::string::npos) << err(unreadable);
  }
  // The dataset loader names the file too.
  EXPECT_EQ(error_of<std::runtime_error>([&] { Dataset::from_file(missing, {}); }),
            "data file '" + missing + "' does not exist");
}

TEST(Files, Utf8Validation) {
  const auto err = [](std::string_view s) { return error_of<std::runtime_error>([&] { check_text(s, "t"); }); };
  EXPECT_EQ(err("ok \xC3\xA9 \xE2\x82\xAC \xF0\x9F\x98\x80 \xF4\x8F\xBF\xBF"), "(no exception of the expected type)");
  EXPECT_NE(err("ab\x80").find("continuation byte 0x80 without a lead byte at offset 2"), std::string::npos);
  EXPECT_NE(err("\xC0\xAF").find("byte 0xc0 (overlong encoding) at offset 0"), std::string::npos);
  EXPECT_NE(err("x\xE0\x80\xAF").find("an overlong encoding at offset 2"), std::string::npos);
  EXPECT_NE(err("\xED\xA0\x80").find("a UTF-16 surrogate (0xed 0xa0) at offset 1"), std::string::npos);
  EXPECT_NE(err("\xF4\x90\x80\x80").find("a code point above U+10FFFF at offset 1"), std::string::npos);
  EXPECT_NE(err("\xF5\x80\x80\x80").find("byte 0xf5 (never used in UTF-8) at offset 0"), std::string::npos);
  EXPECT_NE(err("abc\xE2\x82").find("a 3-byte character cut off by the end of the text at offset 3"),
            std::string::npos);
  EXPECT_EQ(err(""), "t is empty");
}

TEST(Files, TooShortSaysFoundAndNeeded) {
  const TempDir dir;
  const std::string p = dir.write("short.txt", "one two three four five six seven eight nine ten\n");
  const std::string e = error_of<std::runtime_error>([&] { Dataset::from_file(p, {.context = 64}); });
  EXPECT_EQ(e, "data file '" + p + "' is too short: found 10 tokens with vocabulary word:1024, need at least 650 "
               "(context 64 + 1 tokens in each split, 10% held out for validation)");
  // Whitespace only: no word tokens at all.
  const std::string blank = dir.write("blank.txt", " \n\t\n");
  EXPECT_NE(error_of<std::runtime_error>([&] { Dataset::from_file(blank, {}); }).find("found 0 tokens"),
            std::string::npos);
  // The same file is long enough as characters with a small context.
  const Dataset c = Dataset::from_file(p, {.vocab = {VocabKind::characters, 0}, .validation_fraction = 0.2,
                                           .context = 4});
  EXPECT_EQ(c.token_count(), 49u);
  EXPECT_EQ(c.validation().size(), 9u);
}

TEST(Dataset, OptionsAreValidated) {
  const auto err = [](DataOptions o) {
    return error_of<std::invalid_argument>([&] { Dataset::from_text("a b c", o); });
  };
  EXPECT_NE(err({.validation_fraction = 0.0}).find("expected a number in (0, 0.5], found 0"), std::string::npos);
  EXPECT_NE(err({.validation_fraction = 0.6}).find("(0, 0.5]"), std::string::npos);
  EXPECT_NE(err({.context = 0}).find("context: expected 1 to 2^30 tokens, found 0"), std::string::npos);
  EXPECT_NE(err({.vocab = {VocabKind::words, 3}}).find("word vocabulary size in [16, 65536], found 3"),
            std::string::npos);
}

// ---- split ----------------------------------------------------------------------------------

TEST(Dataset, SplitSizesAndVocabularyFromTrainingOnly) {
  EXPECT_EQ(min_tokens_for(64, 0.1), 650u);
  EXPECT_EQ(min_tokens_for(1, 0.5), 4u);
  for (const std::size_t c : {1, 7, 64, 255})
    for (const double f : {0.05, 0.1, 0.25, 0.5}) {
      const std::size_t n = min_tokens_for(c, f);
      const auto v = static_cast<std::size_t>(static_cast<double>(n) * f);
      EXPECT_GE(v, c + 1);
      EXPECT_GE(n - v, c + 1);
      const auto v1 = static_cast<std::size_t>(static_cast<double>(n - 1) * f);
      EXPECT_TRUE(v1 < c + 1 || n - 1 - v1 < c + 1) << c << " " << f;
    }
  // "zeta" appears only in the held-out tail: it is <unk> there and not in the vocabulary.
  std::string text;
  for (int i = 0; i < 90; ++i) text += "alpha beta ";
  for (int i = 0; i < 10; ++i) text += "zeta beta ";
  const Dataset d = Dataset::from_text(text, {.vocab = {VocabKind::words, 16}, .validation_fraction = 0.1, .context = 8});
  EXPECT_EQ(d.train().size(), 180u);
  EXPECT_EQ(d.validation().size(), 20u);
  EXPECT_EQ(d.vocab().size(), 3u);
  EXPECT_FALSE(d.vocab().find("zeta").has_value());
  EXPECT_EQ(d.validation()[0], Vocabulary::kUnk);
  EXPECT_DOUBLE_EQ(d.unk_fraction(), 10.0 / 200.0);
  EXPECT_EQ(d.source(), "text");
}

TEST(Dataset, FingerprintAndDeterminism) {
  const Dataset a = Dataset::from_corpus({.seed = 5, .tokens = 20'000}, {});
  const Dataset b = Dataset::from_corpus({.seed = 5, .tokens = 20'000}, {});
  const Dataset c = Dataset::from_corpus({.seed = 6, .tokens = 20'000}, {});
  EXPECT_EQ(a.fingerprint(), b.fingerprint());
  EXPECT_NE(a.fingerprint(), c.fingerprint());
  EXPECT_TRUE(std::equal(a.train().begin(), a.train().end(), b.train().begin(), b.train().end()));
  EXPECT_EQ(a.source(), "default corpus (seed 5, 20000 tokens)");
  for (const TokenId t : a.train()) ASSERT_LT(t, a.vocab().size());
}

// ---- batches ----------------------------------------------------------------------------------

TEST(Sampler, BatchesAreWindowsOfTheSplit) {
  std::vector<TokenId> tokens(1000);
  for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<TokenId>(i);
  BatchSampler s(tokens, 42);
  constexpr std::size_t B = 8, T = 16;
  std::vector<TokenId> in(B * T), tg(B * T);
  std::set<TokenId> starts;
  for (int k = 0; k < 200; ++k) {
    s.next_batch(B, T, in, tg);
    for (std::size_t b = 0; b < B; ++b) {
      const TokenId s0 = in[b * T];
      EXPECT_LE(s0 + T, 999u);
      starts.insert(s0);
      for (std::size_t t = 0; t < T; ++t) {
        ASSERT_EQ(in[b * T + t], s0 + t);
        ASSERT_EQ(tg[b * T + t], s0 + t + 1);
      }
    }
  }
  EXPECT_EQ(s.state().counter, 200u * B);
  EXPECT_GT(starts.size(), 700u);  // 1600 draws over 984 starts: nearly all reached
  EXPECT_TRUE(starts.contains(0));
  EXPECT_TRUE(starts.contains(983));  // the last start: targets end at the last token
  EXPECT_EQ(s.start_of(5, T), BatchSampler(tokens, 42).start_of(5, T));
}

TEST(Sampler, SaveAndRestoreReproducesBatches) {
  const Dataset d = Dataset::from_corpus({.seed = 2, .tokens = 50'000}, {});
  constexpr std::size_t B = 4, T = 32;
  std::vector<TokenId> in(B * T), tg(B * T), in2(B * T), tg2(B * T);
  BatchSampler a(d.train(), 1234);
  for (int k = 0; k < 7; ++k) a.next_batch(B, T, in, tg);
  const SamplerState saved = a.state();
  EXPECT_EQ(saved, (SamplerState{1234, 28}));
  std::vector<std::vector<TokenId>> future;
  for (int k = 0; k < 5; ++k) {
    a.next_batch(B, T, in, tg);
    future.push_back(in);
    future.push_back(tg);
  }
  BatchSampler b(d.train(), 999);  // a fresh sampler, other seed: the state carries the seed
  b.restore(saved);
  for (int k = 0; k < 5; ++k) {
    b.next_batch(B, T, in2, tg2);
    EXPECT_EQ(in2, future[2 * k]);
    EXPECT_EQ(tg2, future[2 * k + 1]);
  }
  EXPECT_EQ(a.state(), b.state());
  // Another seed gives other batches.
  BatchSampler c(d.train(), 1235);
  c.next_batch(B, T, in2, tg2);
  BatchSampler a0(d.train(), 1234);
  a0.next_batch(B, T, in, tg);
  EXPECT_NE(in, in2);
}

TEST(Sampler, RejectsBadArguments) {
  std::vector<TokenId> tokens(10, 1);
  BatchSampler s(tokens, 1);
  std::vector<TokenId> in(8), tg(8);
  EXPECT_NE(error_of<std::invalid_argument>([&] { s.next_batch(2, 4, in, std::span<TokenId>(tg).first(7)); })
                .find("expected inputs and targets of batch * context = 8 tokens, found 8 and 7"),
            std::string::npos);
  EXPECT_NE(error_of<std::invalid_argument>([&] { s.next_batch(1, 10, in, tg); })
                .find("context 10 needs at least 11 tokens, the split has 10"),
            std::string::npos);
  EXPECT_THROW(s.next_batch(0, 4, in, tg), std::invalid_argument);
  EXPECT_EQ(s.state().counter, 0u);  // nothing drawn by failed calls
}

TEST(Validation, WindowsCoverTheSplitInOrder) {
  std::vector<TokenId> tokens(103);
  for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<TokenId>(i);
  ValidationWindows w(tokens, 10);
  EXPECT_EQ(w.window_count(), 10u);  // (103 - 1) / 10
  EXPECT_EQ(w.covered_tokens(), 100u);
  std::vector<TokenId> in(40), tg(40);
  std::vector<std::size_t> rows;
  TokenId expect = 0;
  for (std::size_t r; (r = w.next(4, in, tg)) > 0;) {
    rows.push_back(r);
    for (std::size_t i = 0; i < r * 10; ++i) {
      ASSERT_EQ(in[i], expect);
      ASSERT_EQ(tg[i], expect + 1);
      ++expect;
    }
  }
  EXPECT_EQ(rows, (std::vector<std::size_t>{4, 4, 2}));
  EXPECT_EQ(w.position(), 10u);
  w.reset();
  EXPECT_EQ(w.next(4, in, tg), 4u);
  EXPECT_EQ(in[0], 0u);
  EXPECT_THROW(ValidationWindows(std::span<const TokenId>(tokens).first(10), 10), std::invalid_argument);
  EXPECT_THROW(w.next(5, in, tg), std::invalid_argument);
}

// ---- statistics --------------------------------------------------------------------------------

TEST(Stats, ExactOnSmallInputs) {
  const std::vector<TokenId> t = {1, 1, 2, 1, 3, 3};
  const TokenStats s = token_stats(t, 5);
  EXPECT_EQ(s.distinct, 3u);
  EXPECT_EQ(s.counts_desc, (std::vector<std::uint64_t>{3, 2, 1}));
  EXPECT_DOUBLE_EQ(s.coverage(1), 0.5);
  EXPECT_DOUBLE_EQ(s.coverage(10), 1.0);
  EXPECT_NEAR(s.entropy_nats, -(0.5 * std::log(0.5) + 2.0 / 6 * std::log(2.0 / 6) + 1.0 / 6 * std::log(1.0 / 6)),
              1e-12);
  EXPECT_THROW(token_stats(t, 3), std::invalid_argument);
  // A perfect Zipf law count(r) = 100000 / r has exponent 1.
  std::vector<TokenId> z;
  for (TokenId r = 1; r <= 300; ++r) z.insert(z.end(), 100000 / r, r - 1);
  EXPECT_NEAR(token_stats(z, 300).zipf_exponent, 1.0, 0.01);
}

}  // namespace
}  // namespace mixprec::nn
