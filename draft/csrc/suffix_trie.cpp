// SuffixTrie in C++: the same counts, compression and drafting rule as draft/suffix_trie.py
// (the reference; read its docstring for the invariants), node for node, so both give the same
// drafts (tests/test_suffix_fast.py checks it on random and real token streams). Python spends
// ~150 us per prompt token building a trie (32 dict updates and object allocations); here a
// token costs a few hash lookups per active depth.
//
// Layout. Nodes live in one vector, addressed by index (0 = root); a freed node goes on a free
// list. A child is found through one hash map keyed by (parent index, token); each node also
// keeps its children in a doubly linked sibling list, for the walks that need all of them
// (recomputing the most frequent child, freeing a subtree).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

constexpr int32_t kNone = -1;

struct Node {
  int32_t token = -1;
  int32_t depth = 0;
  int64_t count = 0;
  int64_t total = 0;  // sum of the children's counts
  int32_t best = kNone;  // most frequent child; kNone: recompute when read
  int64_t doc = -1;  // where the latest occurrence ends
  int64_t pos = -1;
  int32_t parent = kNone;
  int32_t first_child = kNone;
  int32_t next = kNone;  // siblings
  int32_t prev = kNone;
  int32_t num_children = 0;
};

struct Doc {
  std::vector<int32_t> tokens;
  int64_t base = 0;  // the first token's stamp (recency order)
  std::vector<int32_t> active;  // growth state; empty once closed
  bool open = true;
};

struct Draft {
  std::vector<int32_t> tokens;
  std::vector<double> probs;
  double score = 0.0;
};

class SuffixTrie {
 public:
  explicit SuffixTrie(int max_depth) : max_depth_(max_depth) {
    if (max_depth < 2) {
      throw std::invalid_argument("max_depth must be >= 2 (got " + std::to_string(max_depth) +
                                  ")");
    }
    nodes_.emplace_back();  // the root
    nodes_[0].depth = 0;
  }

  int max_depth() const { return max_depth_; }
  int64_t num_tokens() const { return num_tokens_; }
  int64_t num_nodes() const { return num_nodes_; }
  int64_t num_docs() const { return static_cast<int64_t>(docs_.size()); }

  int64_t doc_length(int64_t doc) const {
    auto it = docs_.find(doc);
    return it == docs_.end() ? 0 : static_cast<int64_t>(it->second.tokens.size());
  }

  void extend(int64_t doc, const std::vector<int32_t>& tokens) {
    auto it = docs_.find(doc);
    if (it == docs_.end()) {
      it = docs_.emplace(doc, Doc()).first;
      it->second.base = clock_;
      it->second.active.push_back(0);
    }
    if (!it->second.open && !tokens.empty()) {
      throw std::invalid_argument("document " + std::to_string(doc) + " is closed");
    }
    for (int32_t t : tokens) append(doc, it->second, t);
  }

  void close(int64_t doc) {
    auto it = docs_.find(doc);
    if (it != docs_.end()) {
      it->second.open = false;
      it->second.active.clear();
      it->second.active.shrink_to_fit();
    }
  }

  // Forgets document `doc` (must be the oldest one still held: see the Python docstring).
  void remove(int64_t doc) {
    auto it = docs_.find(doc);
    if (it == docs_.end()) throw std::invalid_argument("unknown document " + std::to_string(doc));
    const std::vector<int32_t> text = std::move(it->second.tokens);
    docs_.erase(it);
    const int64_t len = static_cast<int64_t>(text.size());
    for (int64_t s = 0; s < len; ++s) {
      int32_t node = 0;
      const int64_t span = std::min<int64_t>(max_depth_, len - s);
      for (int64_t d = 0; d < span; ++d) {
        const int32_t child = find_child(node, text[s + d]);
        if (child == kNone) break;
        nodes_[child].count -= 1;
        nodes_[node].total -= 1;
        const bool gone = nodes_[child].count == 0;
        if (nodes_[node].best == child) nodes_[node].best = kNone;
        if (gone) {
          unlink(node, child);
          free_subtree(child);
          break;
        }
        node = child;
      }
    }
    num_tokens_ -= len;
  }

  // Count of a substring's real node, or -1 when it has none (tests).
  int64_t count_of(const std::vector<int32_t>& sub) const {
    int32_t node = 0;
    for (int32_t t : sub) {
      node = find_child(node, t);
      if (node == kNone) return -1;
    }
    return nodes_[node].count;
  }

  // The best draft from a growing document's own earlier text: every suffix that occurred
  // before with a next token is a candidate, longest first; see score_candidates.
  py::tuple speculate_own(int64_t doc, int k, double factor, double min_prob) {
    auto it = docs_.find(doc);
    if (it == docs_.end() || !it->second.open) {
      throw std::invalid_argument("document " + std::to_string(doc) + " is not growing");
    }
    const std::vector<int32_t>& active = it->second.active;
    Draft best;
    int32_t best_len = 0;
    const int64_t top = std::min<int64_t>(static_cast<int64_t>(active.size()) - 1,
                                          max_depth_ - 1);
    for (int64_t d = top; d >= 1; --d) {
      const int32_t node = active[d];
      if (nodes_[node].total <= 0) continue;
      const int32_t length = nodes_[node].depth;
      const int budget = budget_for(length, k, factor);
      if (budget <= best.score) break;  // a shorter match cannot score more than its budget
      Draft cand = walk(node, 0, budget, min_prob);
      if (cand.score > best.score) {
        best = std::move(cand);
        best_len = length;
      }
    }
    return py::make_tuple(best.tokens, best.probs, best_len);
  }

  // The best draft for `context` from the held documents: each suffix of the context (at most
  // `longest` and max_depth - 1 tokens) that occurs with a next token is a candidate, longest
  // first. Returns (tokens, probs, winning match length, longest match length).
  py::tuple speculate(const std::vector<int32_t>& context, int longest, int k, double factor,
                      double min_prob) {
    const int64_t n = static_cast<int64_t>(context.size());
    Draft best;
    int32_t best_len = 0;
    int32_t longest_hit = 0;
    const int64_t top = std::min<int64_t>({static_cast<int64_t>(longest), max_depth_ - 1, n});
    for (int64_t length = top; length >= 1; --length) {
      const int budget = budget_for(static_cast<int32_t>(length), k, factor);
      if (budget <= best.score) break;
      int32_t node = kNone;
      int64_t extra = 0;
      if (!descend(context, n - length, &node, &extra)) continue;
      if (longest_hit == 0) longest_hit = static_cast<int32_t>(length);
      Draft cand = walk(node, extra, budget, min_prob);
      if (cand.score > best.score) {
        best = std::move(cand);
        best_len = static_cast<int32_t>(length);
      }
    }
    return py::make_tuple(best.tokens, best.probs, best_len, longest_hit);
  }

 private:
  static uint64_t key(int32_t parent, int32_t token) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(parent)) << 32) |
           static_cast<uint32_t>(token);
  }

  int32_t find_child(int32_t parent, int32_t token) const {
    auto it = child_.find(key(parent, token));
    return it == child_.end() ? kNone : it->second;
  }

  static int budget_for(int32_t length, int k, double factor) {
    const double scaled = std::floor(factor * static_cast<double>(length));
    return std::max(1, static_cast<int>(std::min<double>(k, scaled)));
  }

  int32_t new_node(int32_t parent, int32_t token, int32_t depth, int64_t doc, int64_t pos) {
    int32_t id;
    if (!free_.empty()) {
      id = free_.back();
      free_.pop_back();
      nodes_[id] = Node();
    } else {
      id = static_cast<int32_t>(nodes_.size());
      nodes_.emplace_back();
    }
    Node& c = nodes_[id];
    c.token = token;
    c.depth = depth;
    c.doc = doc;
    c.pos = pos;
    c.parent = parent;
    Node& p = nodes_[parent];
    c.next = p.first_child;
    if (p.first_child != kNone) nodes_[p.first_child].prev = id;
    p.first_child = id;
    p.num_children += 1;
    child_.emplace(key(parent, token), id);
    num_nodes_ += 1;
    return id;
  }

  void unlink(int32_t parent, int32_t child) {
    Node& c = nodes_[child];
    Node& p = nodes_[parent];
    if (c.prev != kNone) nodes_[c.prev].next = c.next;
    else p.first_child = c.next;
    if (c.next != kNone) nodes_[c.next].prev = c.prev;
    p.num_children -= 1;
    child_.erase(key(parent, c.token));
  }

  void free_subtree(int32_t top) {
    std::vector<int32_t> stack{top};
    while (!stack.empty()) {
      const int32_t id = stack.back();
      stack.pop_back();
      for (int32_t c = nodes_[id].first_child; c != kNone; c = nodes_[c].next) {
        child_.erase(key(id, nodes_[c].token));
        stack.push_back(c);
      }
      nodes_[id].first_child = kNone;
      nodes_[id].num_children = 0;
      free_.push_back(id);
      num_nodes_ -= 1;
    }
  }

  int64_t stamp(int32_t node) const { return docs_.at(nodes_[node].doc).base + nodes_[node].pos; }

  void append(int64_t doc, Doc& d, int32_t t) {
    std::vector<int32_t>& text = d.tokens;
    const int64_t i = static_cast<int64_t>(text.size());
    text.push_back(t);
    clock_ += 1;
    num_tokens_ += 1;
    std::vector<int32_t>& active = d.active;
    const int64_t top = max_depth_ - 1;
    for (int64_t k = std::min<int64_t>(static_cast<int64_t>(active.size()) - 1, top); k >= 0;
         --k) {  // deepest first: a deeper level reads a count from before this token
      const int32_t parent = active[k];
      if (k > 0 && nodes_[parent].count < 2) continue;  // its continuation stays virtual
      int32_t child = find_child(parent, t);
      if (child == kNone) {
        child = new_node(parent, t, static_cast<int32_t>(k) + 1, doc, i);
      } else if (nodes_[child].count == 1 && nodes_[child].num_children == 0 &&
                 nodes_[child].depth < max_depth_) {
        materialize(child);
      }
      Node& c = nodes_[child];
      c.count += 1;
      c.doc = doc;
      c.pos = i;
      Node& p = nodes_[parent];
      p.total += 1;
      // The child has the newest stamp, so it wins ties; an unknown best stays unknown.
      if (p.best != kNone && c.count >= nodes_[p.best].count) p.best = child;
      else if (p.best == kNone && p.num_children == 1) p.best = child;
    }
    std::vector<int32_t> next{0};
    const int64_t reach = std::min<int64_t>(static_cast<int64_t>(active.size()), max_depth_);
    for (int64_t k = 0; k < reach; ++k) {
      const int32_t node = find_child(active[k], t);
      if (node == kNone) break;
      next.push_back(node);
    }
    active = std::move(next);
  }

  // `node` is about to get its second occurrence: give its first one a real child.
  void materialize(int32_t node) {
    const int64_t doc = nodes_[node].doc;
    const int64_t pos = nodes_[node].pos;
    const std::vector<int32_t>& text = docs_.at(doc).tokens;
    if (pos + 1 >= static_cast<int64_t>(text.size())) return;  // it ended its document
    const int32_t g = new_node(node, text[pos + 1], nodes_[node].depth + 1, doc, pos + 1);
    nodes_[g].count = 1;
    nodes_[node].total = 1;
    nodes_[node].best = g;
  }

  int32_t best_child(int32_t node) {
    Node& n = nodes_[node];
    if (n.best == kNone) {
      int32_t arg = kNone;
      int64_t arg_count = -1, arg_stamp = -1;
      for (int32_t c = n.first_child; c != kNone; c = nodes_[c].next) {
        const int64_t cnt = nodes_[c].count, st = stamp(c);
        if (cnt > arg_count || (cnt == arg_count && st > arg_stamp)) {
          arg = c;
          arg_count = cnt;
          arg_stamp = st;
        }
      }
      n.best = arg;
    }
    return n.best;
  }

  bool descend(const std::vector<int32_t>& context, int64_t start, int32_t* out_node,
               int64_t* out_extra) const {
    const int64_t n = static_cast<int64_t>(context.size());
    int32_t node = 0;
    int64_t i = start;
    while (i < n) {
      const int32_t child = find_child(node, context[i]);
      if (child == kNone) break;
      node = child;
      ++i;
    }
    const int64_t extra = n - i;
    const Node& nd = nodes_[node];
    if (extra) {  // the rest must follow node's one (virtual) occurrence
      if (node == 0 || nd.count != 1 || nd.num_children) return false;
      const std::vector<int32_t>& text = docs_.at(nd.doc).tokens;
      const int64_t from = nd.pos + 1;
      if (from + extra > static_cast<int64_t>(text.size())) return false;
      for (int64_t j = 0; j < extra; ++j) {
        if (text[from + j] != context[i + j]) return false;
      }
    }
    if (nd.total > 0) {
      *out_node = node;
      *out_extra = 0;
      return true;
    }
    if (nd.count == 1 || extra) {  // one occurrence: does its document go on?
      if (nd.pos + extra + 1 < static_cast<int64_t>(docs_.at(nd.doc).tokens.size())) {
        *out_node = node;
        *out_extra = extra;
        return true;
      }
    }
    return false;
  }

  // Follow the most frequent child while the product of the choices' frequencies stays
  // >= min_prob; where the counts end, copy what followed the latest occurrence.
  Draft walk(int32_t node, int64_t extra, int budget, double min_prob) {
    Draft out;
    double p = 1.0;
    while (static_cast<int>(out.tokens.size()) < budget) {
      if (extra == 0 && nodes_[node].total > 0) {
        const int32_t best = best_child(node);
        p *= static_cast<double>(nodes_[best].count) / static_cast<double>(nodes_[node].total);
        if (p < min_prob) break;
        out.tokens.push_back(nodes_[best].token);
        out.probs.push_back(p);
        out.score += p;
        node = best;
        continue;
      }
      const std::vector<int32_t>& text = docs_.at(nodes_[node].doc).tokens;
      const int64_t start = nodes_[node].pos + extra + 1;
      const int64_t stop = std::min<int64_t>(
          static_cast<int64_t>(text.size()),
          start + budget - static_cast<int64_t>(out.tokens.size()));
      for (int64_t j = start; j < stop; ++j) {
        out.tokens.push_back(text[j]);
        out.probs.push_back(p);
        out.score += p;
      }
      break;
    }
    return out;
  }

  int max_depth_;
  std::vector<Node> nodes_;
  std::vector<int32_t> free_;
  std::unordered_map<uint64_t, int32_t> child_;
  std::unordered_map<int64_t, Doc> docs_;
  int64_t clock_ = 0;
  int64_t num_tokens_ = 0;
  int64_t num_nodes_ = 0;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<SuffixTrie>(m, "SuffixTrie")
      .def(py::init<int>(), py::arg("max_depth") = 32)
      .def_property_readonly("max_depth", &SuffixTrie::max_depth)
      .def_property_readonly("num_tokens", &SuffixTrie::num_tokens)
      .def_property_readonly("num_nodes", &SuffixTrie::num_nodes)
      .def_property_readonly("num_docs", &SuffixTrie::num_docs)
      .def("doc_length", &SuffixTrie::doc_length)
      .def("extend", &SuffixTrie::extend)
      .def("close", &SuffixTrie::close)
      .def("remove", &SuffixTrie::remove)
      .def("count_of", &SuffixTrie::count_of)
      .def("speculate_own", &SuffixTrie::speculate_own)
      .def("speculate", &SuffixTrie::speculate);
}
