// The embedded default corpus: a fixed lexicon of invented words and a seeded
// probabilistic grammar (docs/data.md, "The default corpus").
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_set>
#include <vector>

#include "mixprec/nn/data.hpp"
#include "nn/data_rng.hpp"

namespace mixprec::nn {
namespace {

using detail::SplitMix;

constexpr std::uint64_t kLexiconSeed = 0x6d69787072656301ull;  // fixed: one language for every corpus seed
constexpr std::size_t kTopics = 8;
constexpr std::size_t kNounStems = 300;
constexpr std::size_t kTransitiveVerbs = 90;
constexpr std::size_t kIntransitiveVerbs = 36;
constexpr std::size_t kAdjectives = 140;
constexpr std::size_t kAdverbs = 45;
constexpr std::size_t kNames = 70;

// Zipf-Mandelbrot weights (rank + 2.7)^-1 in integers, as cumulative sums: portable.
class Zipf {
 public:
  Zipf() = default;
  explicit Zipf(std::size_t n) {
    cum_.reserve(n);
    std::uint64_t total = 0;
    for (std::size_t i = 0; i < n; ++i) {
      total += (std::uint64_t{10} << 40) / (10 * i + 37);
      cum_.push_back(total);
    }
  }
  std::size_t pick(SplitMix& rng) const {
    const std::uint64_t r = rng.below(cum_.back());
    return static_cast<std::size_t>(std::upper_bound(cum_.begin(), cum_.end(), r) - cum_.begin());
  }
  std::size_t size() const { return cum_.size(); }

 private:
  std::vector<std::uint64_t> cum_;
};

// Words drawn from a global Zipf list, or (half the time) from the paragraph topic's
// own Zipf list of the same words.
struct TopicalClass {
  Zipf global;
  std::array<std::vector<std::uint32_t>, kTopics> members;
  std::array<Zipf, kTopics> local;

  void init(std::size_t n, SplitMix& rng) {
    global = Zipf(n);
    for (std::size_t i = 0; i < n; ++i) members[rng.below(kTopics)].push_back(static_cast<std::uint32_t>(i));
    for (std::size_t t = 0; t < kTopics; ++t) {
      if (members[t].empty()) members[t].push_back(0);
      local[t] = Zipf(members[t].size());
    }
  }
  std::size_t pick(SplitMix& rng, std::size_t topic) const {
    if (rng.chance(1, 2)) return members[topic][local[topic].pick(rng)];
    return global.pick(rng);
  }
};

struct FixedList {
  std::vector<std::string> words;
  Zipf zipf;
  FixedList(std::initializer_list<const char*> w) : zipf(w.size()) {
    for (const char* s : w) words.emplace_back(s);
  }
  const std::string& pick(SplitMix& rng) const { return words[zipf.pick(rng)]; }
};

bool ends_with(std::string_view s, std::string_view tail) {
  return s.size() >= tail.size() && s.substr(s.size() - tail.size()) == tail;
}
std::string plural_s(const std::string& stem) {
  if (ends_with(stem, "s") || ends_with(stem, "x") || ends_with(stem, "z") || ends_with(stem, "sh") ||
      ends_with(stem, "ch"))
    return stem + "es";
  return stem + "s";
}
std::string past_ed(const std::string& stem) { return ends_with(stem, "e") ? stem + "d" : stem + "ed"; }
std::string lower(std::string s) {
  for (char& c : s)
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  return s;
}

struct Lexicon {
  // Inflected forms by stem index (index = frequency rank within the class).
  std::vector<std::string> noun_sg, noun_pl;
  std::vector<std::string> verb_base, verb_s, verb_past;      // transitive
  std::vector<std::string> intr_base, intr_s, intr_past;      // intransitive
  std::vector<std::string> adjectives, adverbs, names;
  TopicalClass nouns, verbs, adjs;
  Zipf intr_zipf, adverb_zipf, name_zipf;

  FixedList det_sg{"the", "a", "this", "my", "that", "his", "her", "their", "every", "our", "your", "each", "no"};
  FixedList det_pl{"the", "some", "these", "my", "those", "their", "his", "her", "many", "our", "two", "your",
                   "few", "three", "no"};
  FixedList subj_pron{"he", "they", "she", "it", "we", "I", "you"};
  FixedList obj_pron{"it", "them", "him", "her", "me", "us", "you"};
  FixedList preps{"in", "on", "with", "to", "from", "at", "near", "by", "under", "over", "behind",
                  "across", "through", "after", "before", "around", "without", "into", "beside", "toward"};
  FixedList subord{"when", "because", "if", "while", "although", "before", "after", "until"};
  FixedList modal_present{"will", "can", "must", "may", "should"};
  FixedList modal_past{"would", "could", "might"};
  FixedList cog_base{"think", "know", "say", "hope", "believe"};
  std::vector<std::string> cog_s{"thinks", "knows", "says", "hopes", "believes"};
  std::vector<std::string> cog_past{"thought", "knew", "said", "hoped", "believed"};
  std::vector<std::string> fixed{"that", "and", "but", "not", "do", "does", "did", "an", ".", ",", "?", "!"};

  std::size_t function_words = 0;
  std::size_t surface_forms = 0;

  Lexicon() {
    std::unordered_set<std::string> used;
    auto add_fixed = [&](const std::vector<std::string>& list) {
      for (const auto& w : list) used.insert(lower(w));
    };
    for (const FixedList* l : {&det_sg, &det_pl, &subj_pron, &obj_pron, &preps, &subord, &modal_present,
                               &modal_past, &cog_base})
      add_fixed(l->words);
    add_fixed(cog_s);
    add_fixed(cog_past);
    add_fixed(fixed);
    function_words = used.size();

    SplitMix rng(kLexiconSeed);
    static constexpr std::array<std::string_view, 28> kOnsets = {
        "",  "",  "b", "d", "f", "g",  "h",  "k",  "l",  "m",  "n",  "p",  "r",  "s",
        "t", "v", "w", "z", "b", "d", "l", "m", "n", "r", "s", "t", "st", "tr"};
    static constexpr std::array<std::string_view, 12> kVowels = {"a", "e", "i", "o", "u", "a",
                                                                  "e", "i", "o", "ai", "ee", "oo"};
    static constexpr std::array<std::string_view, 12> kCodas = {"", "", "", "", "", "n", "r", "l", "s", "m", "k", "t"};
    auto make_stem = [&]() {
      const std::uint64_t r = rng.below(10);
      const std::size_t syllables = r < 3 ? 1 : (r < 9 ? 2 : 3);
      std::string s;
      for (std::size_t i = 0; i < syllables; ++i) {
        s += kOnsets[rng.below(kOnsets.size())];
        s += kVowels[rng.below(kVowels.size())];
        s += kCodas[rng.below(kCodas.size())];
      }
      return s;
    };
    // Stems whose every form is new; shorter stems get the frequent ranks (Zipf's law
    // of abbreviation), ties keep generation order.
    auto make_class = [&](std::size_t n, auto forms_of) {
      std::vector<std::string> stems;
      while (stems.size() < n) {
        const std::string s = make_stem();
        if (s.size() < 2) continue;
        const std::vector<std::string> forms = forms_of(s);
        bool fresh = true;
        for (const auto& f : forms) fresh = fresh && !used.contains(lower(f));
        if (!fresh) continue;
        for (const auto& f : forms) used.insert(lower(f));
        stems.push_back(s);
      }
      std::stable_sort(stems.begin(), stems.end(),
                       [](const std::string& a, const std::string& b) { return a.size() < b.size(); });
      return stems;
    };
    for (const auto& s : make_class(kNounStems, [](const std::string& x) {
           return std::vector<std::string>{x, plural_s(x)};
         })) {
      noun_sg.push_back(s);
      noun_pl.push_back(plural_s(s));
    }
    auto verb_forms = [](const std::string& x) { return std::vector<std::string>{x, plural_s(x), past_ed(x)}; };
    for (const auto& s : make_class(kTransitiveVerbs, verb_forms)) {
      verb_base.push_back(s);
      verb_s.push_back(plural_s(s));
      verb_past.push_back(past_ed(s));
    }
    for (const auto& s : make_class(kIntransitiveVerbs, verb_forms)) {
      intr_base.push_back(s);
      intr_s.push_back(plural_s(s));
      intr_past.push_back(past_ed(s));
    }
    // Adjectives; the adverbs are "ly" forms of a random subset of them.
    adjectives = make_class(kAdjectives, [](const std::string& x) { return std::vector<std::string>{x}; });
    std::vector<std::size_t> order(adjectives.size());
    for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
    for (std::size_t i = order.size(); i > 1; --i) std::swap(order[i - 1], order[rng.below(i)]);
    for (std::size_t i = 0; adverbs.size() < kAdverbs && i < order.size(); ++i) {
      std::string adv = adjectives[order[i]] + "ly";
      if (used.insert(adv).second) adverbs.push_back(std::move(adv));
    }
    for (auto s : make_class(kNames, [](const std::string& x) { return std::vector<std::string>{x}; })) {
      s[0] = static_cast<char>(s[0] - 'a' + 'A');
      names.push_back(std::move(s));
    }
    surface_forms = used.size();

    nouns.init(noun_sg.size(), rng);
    verbs.init(verb_base.size(), rng);
    adjs.init(adjectives.size(), rng);
    intr_zipf = Zipf(intr_base.size());
    adverb_zipf = Zipf(adverbs.size());
    name_zipf = Zipf(names.size());
  }
};

const Lexicon& lexicon() {
  static const Lexicon lex;
  return lex;
}

bool starts_with_vowel(std::string_view w) {
  return !w.empty() && (w[0] == 'a' || w[0] == 'e' || w[0] == 'i' || w[0] == 'o' || w[0] == 'u');
}

struct Subject {
  bool plural = false;
  bool third = true;
};

class Generator {
 public:
  Generator(const Lexicon& lex, std::uint64_t seed) : lex_(lex), rng_(seed) {}

  std::string run(std::size_t tokens) {
    std::string out;
    out.reserve(tokens * 6);
    std::size_t emitted = 0;
    std::size_t left_in_paragraph = 0;
    while (emitted < tokens) {
      if (left_in_paragraph == 0) {
        topic_ = rng_.below(kTopics);
        past_ = rng_.chance(1, 3);
        left_in_paragraph = 2 + rng_.below(6);
        if (!out.empty()) out += '\n';
      } else {
        out += ' ';
      }
      --left_in_paragraph;
      words_.clear();
      sentence();
      emitted += words_.size();
      emit(out);
    }
    return out;
  }

 private:
  void emit(std::string& out) const {
    for (std::size_t i = 0; i < words_.size(); ++i) {
      const std::string_view w = words_[i];
      const bool punct = w == "." || w == "," || w == "?" || w == "!";
      if (i > 0 && !punct) out += ' ';
      const std::size_t at = out.size();
      out += w;
      if (i == 0 && out[at] >= 'a' && out[at] <= 'z') out[at] = static_cast<char>(out[at] - 'a' + 'A');
    }
  }
  void word(std::string_view w) { words_.push_back(w); }

  // Present tense: 3rd-person singular subjects take the -s form.
  bool s_form(Subject s) const { return !past_ && s.third && !s.plural; }

  void noun_phrase(bool plural) {
    const FixedList& dets = plural ? lex_.det_pl : lex_.det_sg;
    const std::string& det = dets.pick(rng_);
    const std::size_t at = words_.size();
    word(det);
    if (rng_.chance(30, 100)) word(lex_.adjectives[lex_.adjs.pick(rng_, topic_)]);
    if (rng_.chance(8, 100)) word(lex_.adjectives[lex_.adjs.pick(rng_, topic_)]);
    const std::size_t n = lex_.nouns.pick(rng_, topic_);
    word(plural ? lex_.noun_pl[n] : lex_.noun_sg[n]);
    if (det == "a" && starts_with_vowel(words_[at + 1])) words_[at] = "an";
  }
  Subject subject() {
    const std::uint64_t r = rng_.below(100);
    if (r < 12) {
      const std::string& p = lex_.subj_pron.pick(rng_);
      word(p);
      if (p == "he" || p == "she" || p == "it") return {false, true};
      return {p == "they" || p == "we", p == "they"};
    }
    if (r < 22) {
      word(lex_.names[lex_.name_zipf.pick(rng_)]);
      return {false, true};
    }
    const bool plural = rng_.chance(40, 100);
    noun_phrase(plural);
    return {plural, true};
  }
  void object() {
    const std::uint64_t r = rng_.below(100);
    if (r < 10) {
      word(lex_.obj_pron.pick(rng_));
    } else if (r < 16) {
      word(lex_.names[lex_.name_zipf.pick(rng_)]);
    } else {
      noun_phrase(rng_.chance(40, 100));
    }
  }
  void prep_phrase() {
    word(lex_.preps.pick(rng_));
    noun_phrase(rng_.chance(40, 100));
  }
  void adverb() { word(lex_.adverbs[lex_.adverb_zipf.pick(rng_)]); }
  // Transitive verb phrase agreeing with `s`: [do-support negation] verb object [adverb] [pp].
  void verb_phrase(Subject s) {
    const std::size_t v = lex_.verbs.pick(rng_, topic_);
    if (rng_.chance(8, 100)) {
      word(past_ ? "did" : (s_form(s) ? "does" : "do"));
      word("not");
      word(lex_.verb_base[v]);
    } else {
      word(past_ ? lex_.verb_past[v] : (s_form(s) ? lex_.verb_s[v] : lex_.verb_base[v]));
    }
    object();
    if (rng_.chance(15, 100)) adverb();
    if (rng_.chance(30, 100)) prep_phrase();
  }
  void clause() { verb_phrase(subject()); }

  void sentence() {
    const std::uint64_t r = rng_.below(100);
    std::string_view end = ".";
    if (r < 36) {  // simple clause
      clause();
    } else if (r < 46) {  // coordination: both verbs agree with one subject
      const Subject s = subject();
      verb_phrase(s);
      word(rng_.chance(3, 4) ? "and" : "but");
      verb_phrase(s);
    } else if (r < 56) {  // modal + base form
      subject();
      word(past_ ? lex_.modal_past.pick(rng_) : lex_.modal_present.pick(rng_));
      if (rng_.chance(1, 10)) word("not");
      word(lex_.verb_base[lex_.verbs.pick(rng_, topic_)]);
      object();
      if (rng_.chance(30, 100)) prep_phrase();
    } else if (r < 66) {  // subordinate clause first
      word(lex_.subord.pick(rng_));
      clause();
      word(",");
      clause();
    } else if (r < 76) {  // relative clause: the main verb agrees with the head noun across it
      const bool plural = rng_.chance(40, 100);
      noun_phrase(plural);
      word("that");
      const Subject s{plural, true};
      verb_phrase(s);
      verb_phrase(s);
    } else if (r < 84) {  // yes/no question with do-support
      const std::size_t at = words_.size();
      word("do");
      const Subject s = subject();
      words_[at] = past_ ? "did" : (s_form(s) ? "does" : "do");
      word(lex_.verb_base[lex_.verbs.pick(rng_, topic_)]);
      object();
      end = "?";
    } else if (r < 93) {  // intransitive
      const Subject s = subject();
      const std::size_t v = lex_.intr_zipf.pick(rng_);
      word(past_ ? lex_.intr_past[v] : (s_form(s) ? lex_.intr_s[v] : lex_.intr_base[v]));
      if (rng_.chance(60, 100)) adverb();
      if (rng_.chance(40, 100)) prep_phrase();
      if (rng_.chance(1, 10)) end = "!";
    } else {  // reported clause
      const Subject s = subject();
      const std::size_t c = lex_.cog_base.zipf.pick(rng_);
      word(past_ ? lex_.cog_past[c] : (s_form(s) ? lex_.cog_s[c] : lex_.cog_base.words[c]));
      word("that");
      clause();
    }
    word(end);
  }

  const Lexicon& lex_;
  SplitMix rng_;
  std::size_t topic_ = 0;
  bool past_ = false;
  std::vector<std::string_view> words_;
};

}  // namespace

std::string generate_corpus(const CorpusOptions& options) {
  if (options.tokens < 1 || options.tokens > CorpusOptions::kMaxTokens)
    throw std::invalid_argument("generate_corpus: expected tokens in [1, " +
                                std::to_string(CorpusOptions::kMaxTokens) + "], found " +
                                std::to_string(options.tokens));
  Generator g(lexicon(), options.seed);
  return g.run(options.tokens);
}

LexiconSummary corpus_lexicon_summary() {
  const Lexicon& lex = lexicon();
  LexiconSummary s;
  s.topics = kTopics;
  s.noun_stems = lex.noun_sg.size();
  s.verb_stems = lex.verb_base.size() + lex.intr_base.size();
  s.transitive_verbs = lex.verb_base.size();
  s.adjectives = lex.adjectives.size();
  s.adverbs = lex.adverbs.size();
  s.names = lex.names.size();
  s.function_words = lex.function_words;
  s.surface_forms = lex.surface_forms;
  return s;
}

}  // namespace mixprec::nn
