// demo_corpus.cpp — the generated demo corpus (see demo_corpus.h).
//
// Every draw is an integer from Philox keyed by the seed, with the document index in the high
// half of the counter, so documents are independent of each other and of the platform.
#include "runtime/demo_corpus.h"

#include <array>
#include <string_view>

#include "core/error.h"
#include "core/rng.h"
#include "runtime/tokenizer.h"

namespace bb {
namespace {

constexpr int64_t kMinDocBytes = 200;
constexpr int64_t kMaxDocBytes = 3000;

class DocRng {
 public:
  DocRng(uint64_t seed, int64_t doc_index)
      : seed_(seed), counter_(static_cast<uint64_t>(doc_index) << 32) {}

  uint32_t next_u32() {
    if (used_ == 4) {
      block_ = philox4x32_10(seed_, counter_++);
      used_ = 0;
    }
    return block_.v[used_++];
  }
  // Uniform integer in [0, n): multiply-high keeps it unbiased enough and integer-only.
  int64_t below(int64_t n) {
    return static_cast<int64_t>((static_cast<uint64_t>(next_u32()) * static_cast<uint64_t>(n)) >>
                                32);
  }
  int64_t between(int64_t lo, int64_t hi) { return lo + below(hi - lo + 1); }  // inclusive
  bool chance(int percent) { return below(100) < percent; }
  template <size_t N>
  std::string_view pick(const std::array<std::string_view, N>& words) {
    return words[below(static_cast<int64_t>(N))];
  }

 private:
  uint64_t seed_;
  uint64_t counter_;
  Philox4 block_{};
  int used_ = 4;
};

constexpr std::array<std::string_view, 16> kAdjectives = {
    "small",  "big",  "red",  "green", "old",  "young", "happy", "quiet",
    "bright", "dark", "soft", "fast",  "slow", "tall",  "brave", "empty"};
constexpr std::array<std::string_view, 20> kNouns = {
    "cat",  "dog",  "bird", "fox",   "child", "farmer", "teacher", "river", "tree",   "house",
    "ball", "book", "boat", "horse", "apple", "owl",    "island",  "lamp",  "garden", "egg"};
constexpr std::array<std::string_view, 12> kTransitive = {
    "saw",     "found",  "liked", "carried", "painted", "followed",
    "watched", "helped", "built", "lost",    "opened",  "wanted"};
constexpr std::array<std::string_view, 8> kIntransitive = {"slept",  "ran",    "sang",   "laughed",
                                                           "waited", "jumped", "smiled", "walked"};
constexpr std::array<std::string_view, 8> kPlaces = {
    "in the garden", "near the river", "under the tree", "at home",
    "on the hill",   "by the sea",     "in the kitchen", "at the market"};
constexpr std::array<std::string_view, 5> kTimes = {"In the morning", "At night", "After lunch",
                                                    "One day", "Later"};
constexpr std::array<std::string_view, 18> kNames = {
    "Anna", "Ben",  "Clara", "David", "Emma", "Felix", "Grace", "Hugo", "Ivy",
    "Jack", "Lena", "Max",   "Nora",  "Omar", "Paul",  "Rosa",  "Sam",  "Tara"};
constexpr std::array<std::string_view, 12> kGoods = {"bread",  "flour",  "sugar", "rice",
                                                     "apples", "nuts",   "tea",   "coffee",
                                                     "beans",  "onions", "oats",  "salt"};
constexpr std::array<std::string_view, 7> kDays = {"Monday", "Tuesday",  "Wednesday", "Thursday",
                                                   "Friday", "Saturday", "Sunday"};
constexpr std::array<std::string_view, 5> kNumberWords = {"one", "two", "three", "four", "five"};

bool starts_with_vowel(std::string_view w) {
  return !w.empty() && std::string_view("aeiou").find(w[0]) != std::string_view::npos;
}

std::string capitalized(std::string_view w) {
  std::string s(w);
  if (!s.empty() && s[0] >= 'a' && s[0] <= 'z') s[0] = static_cast<char>(s[0] - 'a' + 'A');
  return s;
}

// "the old owl", "an old owl", "my dog": the article agrees with the next word.
std::string noun_phrase(DocRng& r) {
  std::string adj = r.chance(55) ? std::string(r.pick(kAdjectives)) : std::string();
  std::string_view noun = r.pick(kNouns);
  std::string_view next = adj.empty() ? noun : std::string_view(adj);
  std::string det;
  switch (r.below(4)) {
    case 0:
    case 1:
      det = "the";
      break;
    case 2:
      det = starts_with_vowel(next) ? "an" : "a";
      break;
    default:
      det = "my";
      break;
  }
  return det + " " + (adj.empty() ? "" : adj + " ") + std::string(noun);
}

// The draws are named locals, taken in a fixed order (the last word first, the order the corpus
// was pinned with): inside one `+` chain C++ leaves the order of the calls unspecified, and
// compilers differ, which would make the corpus depend on the compiler.
std::string story_sentence(DocRng& r, std::string_view hero) {
  switch (r.below(6)) {
    case 0: {
      const std::string object = noun_phrase(r);
      const std::string_view verb = r.pick(kTransitive);
      const std::string subject = capitalized(noun_phrase(r));
      return subject + " " + std::string(verb) + " " + object + ".";
    }
    case 1: {
      const std::string_view place = r.pick(kPlaces);
      const std::string_view verb = r.pick(kIntransitive);
      return std::string(hero) + " " + std::string(verb) + " " + std::string(place) + ".";
    }
    case 2: {
      const std::string object = noun_phrase(r);
      const std::string_view verb = r.pick(kTransitive);
      const std::string_view when = r.pick(kTimes);
      return std::string(when) + ", " + std::string(hero) + " " + std::string(verb) + " " + object + ".";
    }
    case 3: {
      const std::string_view adj = r.pick(kAdjectives);
      const std::string subject = capitalized(noun_phrase(r));
      return subject + " was " + std::string(adj) + ".";
    }
    case 4:
      return std::string(hero) + " said, \"I like " + noun_phrase(r) + ".\"";
    default: {
      const std::string_view place = r.pick(kPlaces);
      const std::string_view verb = r.pick(kIntransitive);
      const std::string_view friend_name = r.pick(kNames);
      return std::string(hero) + " and " + std::string(friend_name) + " " + std::string(verb) + " " +
             std::string(place) + ".";
    }
  }
}

std::string arithmetic_line(DocRng& r) {
  switch (r.below(3)) {
    case 0: {
      const int64_t a = r.between(0, 20), b = r.between(0, 20);
      return std::to_string(a) + " + " + std::to_string(b) + " = " + std::to_string(a + b) + ".";
    }
    case 1: {
      const int64_t a = r.between(0, 20), b = r.between(0, a);
      return std::to_string(a) + " - " + std::to_string(b) + " = " + std::to_string(a - b) + ".";
    }
    default: {
      const int64_t a = r.between(1, 12), b = r.between(1, 12);
      return std::to_string(a) + " * " + std::to_string(b) + " = " + std::to_string(a * b) + ".";
    }
  }
}

// Appends lines of one section, stopping early once the document reached its target length.
void add_section(DocRng& r, std::string& doc, std::string_view hero, int64_t target) {
  auto full = [&] { return static_cast<int64_t>(doc.size()) >= target; };
  if (!doc.empty()) doc += "\n\n";
  const int64_t kind = r.below(10);
  if (kind < 5) {  // a story paragraph
    const int64_t n = r.between(3, 7);
    for (int64_t i = 0; i < n && !full(); ++i) {
      if (i) doc += " ";
      doc += story_sentence(r, hero);
    }
  } else if (kind < 7) {  // sums
    doc += std::string(hero) + " practices sums:";
    const int64_t n = r.between(3, 6);
    for (int64_t i = 0; i < n && (i == 0 || !full()); ++i) {
      doc += "\n";
      doc += arithmetic_line(r);
    }
  } else if (kind < 8) {  // a shopping list
    doc += std::string(hero) + " needs to buy:";
    const int64_t n = r.between(2, 5);
    for (int64_t i = 0; i < n && (i == 0 || !full()); ++i) {
      const int64_t count = r.below(static_cast<int64_t>(
          kNumberWords.size()));  // "one bag of", "three bags of": agreement to learn
      doc += "\n- ";
      doc += kNumberWords[count];
      doc += count == 0 ? " bag of " : " bags of ";
      doc += r.pick(kGoods);
    }
  } else if (kind < 9) {  // counting
    const int64_t start = r.between(1, 90), n = r.between(5, 10);
    doc += "Count: ";
    for (int64_t i = 0; i < n; ++i) {
      if (i) doc += ", ";
      doc += std::to_string(start + i);
    }
    doc += ".";
  } else {  // weekdays
    const int64_t start = r.below(7), n = r.between(3, 7);
    doc += "The days go ";
    for (int64_t i = 0; i < n; ++i) {
      if (i) doc += ", ";
      doc += kDays[(start + i) % 7];
    }
    doc += ".";
  }
}

}  // namespace

std::string demo_document_text(int64_t doc_index, uint64_t seed) {
  BB_CHECK(doc_index >= 0, "demo_document_text: negative document index ", doc_index);
  DocRng r(seed, doc_index);
  const int64_t target = r.between(kMinDocBytes, kMaxDocBytes - 150);
  const std::string_view hero = r.pick(kNames);
  std::string doc = "The story of " + std::string(hero) + " and " + noun_phrase(r) + ".";
  while (static_cast<int64_t>(doc.size()) < target) add_section(r, doc, hero, target);
  doc += "\nThe end.";
  return doc;
}

std::vector<Document> make_demo_corpus(int64_t num_docs, uint64_t seed) {
  BB_CHECK(num_docs > 0, "make_demo_corpus: num_docs must be positive, got ", num_docs);
  std::vector<Document> docs(static_cast<size_t>(num_docs));
  for (int64_t i = 0; i < num_docs; ++i) {
    docs[i].tokens = byte_tokenize(demo_document_text(i, seed));
    docs[i].tokens.push_back(kEosId);
  }
  return docs;
}

}  // namespace bb
