// Reading the peer-reference data files under tests/data (written by tests/data/make_*_refs.py
// through tests/data/peer_refs.py): the files of a case directory, the record reader (one record
// a line: a key word, then its words; blank lines and '#' comments skipped; "end" ends the
// case; "case NAME" and "source TEXT" kept by the reader), numbers as the scripts write them,
// and the records the optimizer cases share (load_peer_optimizer_case reads a whole case file of
// make_optim_refs.py's format):
//
//   opt [NAME] k=v ...
//   tensor NAME RANK DIMS... PSEED GSEED PLOG GLOG [FLAGS [inject STEP INDEX VALUE]...]
//   result STEP TENSOR [stride S] count N [sum X sumsq Y]
//   <N numbers>
//
// A tensor's parameters and per-step gradients come from the counter-based generator
// (counter_random.hpp), reproduced bit for bit.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "counter_random.hpp"

#ifndef GRADAPT_TEST_DATA_DIR
#define GRADAPT_TEST_DATA_DIR "tests/data"
#endif

namespace gradapt_test {

/// A file under tests/data (GRADAPT_TEST_DATA_DIR), e.g. "loss_scaler/torch_clip.txt".
inline std::string test_data_path(const std::string& relative) {
  return std::string(GRADAPT_TEST_DATA_DIR) + "/" + relative;
}

/// The case files (*.txt) of a peer-reference directory, sorted.
inline std::vector<std::filesystem::path> peer_case_files(const std::filesystem::path& dir) {
  std::vector<std::filesystem::path> files;
  for (const auto& e : std::filesystem::directory_iterator(dir))
    if (e.path().extension() == ".txt") files.push_back(e.path());
  std::sort(files.begin(), files.end());
  return files;
}

/// A number as the scripts write it: decimal (all of s), or nan, inf, -inf.
inline double peer_number(const std::string& s) {
  if (s == "nan") return std::nan("");
  if (s == "inf") return INFINITY;
  if (s == "-inf") return -INFINITY;
  std::size_t used = 0;
  const double v = std::stod(s, &used);
  if (used != s.size()) throw std::runtime_error("bad number '" + s + "'");
  return v;
}

/// Whether got matches a stored element that is not finite (NaN: any NaN; an infinity: the
/// same one); nullopt where want is finite (the caller's tolerance decides).
inline std::optional<bool> peer_nonfinite_match(double want, double got) {
  if (std::isnan(want)) return std::isnan(got);
  if (std::isinf(want)) return got == want;
  return std::nullopt;
}

/// Reads a case file record by record.
class peer_reader {
 public:
  explicit peer_reader(const std::filesystem::path& file) : in_(file) {
    if (!in_) throw std::runtime_error("cannot open " + file.string());
  }

  /// Moves to the next record: false at "end" or at the end of the file. The "case NAME" and
  /// "source TEXT" records are kept (case_name(), source()), not returned.
  bool next() {
    while (std::getline(in_, line_)) {
      if (line_.empty() || line_[0] == '#') continue;
      words_ = std::istringstream(line_);
      key_.clear();
      words_ >> key_;
      if (key_ == "case") {
        words_ >> name_;
      } else if (key_ == "source") {
        std::getline(words_, source_);  // with its leading blank
      } else {
        return key_ != "end";
      }
    }
    return false;
  }

  const std::string& case_name() const { return name_; }
  const std::string& source() const { return source_; }
  const std::string& key() const { return key_; }
  const std::string& line() const { return line_; }
  /// The record's words after the key.
  std::istringstream& words() { return words_; }

  /// The line that follows the record: exactly count numbers (peer_number), else throws.
  std::vector<double> value_line(std::size_t count, const std::string& what) {
    std::string values_line, v;
    std::getline(in_, values_line);
    std::istringstream vs(values_line);
    std::vector<double> out;
    while (vs >> v) out.push_back(peer_number(v));
    if (out.size() != count) throw std::runtime_error("short value line for " + what);
    return out;
  }

  [[noreturn]] void unknown() const { throw std::runtime_error("unknown line: " + line_); }

 private:
  std::ifstream in_;
  std::string line_, key_, name_, source_;
  std::istringstream words_;
};

struct peer_case_id {
  std::string name, source;
};

/// Reads a case file: on(key, words, reader) for each record but "case", "source" and "end";
/// returns the case's name and source.
template <class F>
peer_case_id read_peer_records(const std::filesystem::path& file, F&& on) {
  peer_reader in(file);
  while (in.next()) on(in.key(), in.words(), in);
  return {in.case_name(), in.source()};
}

/// The k=v words of an "opt" record, in order.
inline std::vector<std::pair<std::string, std::string>> peer_options(std::istream& words) {
  std::vector<std::pair<std::string, std::string>> out;
  std::string kv;
  while (words >> kv) {
    const auto eq = kv.find('=');
    out.emplace_back(kv.substr(0, eq), kv.substr(eq + 1));
  }
  return out;
}

struct peer_injection {
  int step = 0;
  std::size_t index = 0;
  float value = 0;
};

/// A "tensor" record: its shape, and the generator's seeds and scales for its inputs.
struct peer_tensor {
  std::string name;
  std::vector<std::int64_t> shape;
  std::uint64_t pseed = 0, gseed = 0;
  int plog = 0, glog = 0;
  bool zero_p = false, zero_g = false, no_wd = false, no_tr = false;
  std::vector<peer_injection> inject;

  std::size_t size() const {
    std::size_t n = 1;
    for (auto d : shape) n *= static_cast<std::size_t>(d);
    return n;
  }
  std::vector<float> param0() const {
    return zero_p ? std::vector<float>(size(), 0.0f) : peer_values(pseed, size(), plog);
  }
  /// The gradient of step (1-based), with the injected values of that step.
  std::vector<float> grad(int step) const {
    if (zero_g) return std::vector<float>(size(), 0.0f);
    auto g = peer_values(gseed + 1000 * static_cast<std::uint64_t>(step), size(), glog);
    for (const auto& j : inject)
      if (j.step == step) g[j.index] = j.value;
    return g;
  }
};

/// The words of a "tensor" record (after the key); line for messages.
inline peer_tensor read_peer_tensor(std::istream& ls, const std::string& line) {
  peer_tensor t;
  int rank = 0;
  ls >> t.name >> rank;
  t.shape.resize(static_cast<std::size_t>(rank));
  for (auto& d : t.shape) ls >> d;
  std::string flags;
  ls >> t.pseed >> t.gseed >> t.plog >> t.glog >> flags;  // no flags word: none
  t.zero_p = flags.find("zero_p") != std::string::npos;
  t.zero_g = flags.find("zero_g") != std::string::npos;
  t.no_wd = flags.find("no_wd") != std::string::npos;
  t.no_tr = flags.find("no_tr") != std::string::npos;
  std::string word;
  while (ls >> word) {
    if (word != "inject") throw std::runtime_error("unexpected '" + word + "' in " + line);
    peer_injection j{};
    std::string v;
    ls >> j.step >> j.index >> v;
    j.value = static_cast<float>(peer_number(v));
    t.inject.push_back(j);
  }
  return t;
}

/// A "result" record and its value line: the peer's tensor after a step (every stride-th
/// element), with the float64 sum and sum of squares of the whole tensor where recorded.
struct peer_result {
  int step = 0;
  std::string tensor;
  std::size_t stride = 1;
  double sum = 0, sumsq = 0;
  std::vector<double> sample;
};

inline peer_result read_peer_result(peer_reader& r) {
  peer_result res;
  auto& ls = r.words();
  ls >> res.step >> res.tensor;
  std::size_t count = 0;
  std::string word, v;
  while (ls >> word) {
    if (word == "stride") {
      ls >> res.stride;
    } else if (word == "count") {
      ls >> count;
    } else if (word == "sum" || word == "sumsq") {
      ls >> v;
      (word == "sum" ? res.sum : res.sumsq) = peer_number(v);
    } else {
      throw std::runtime_error("unexpected '" + word + "' in " + r.line());
    }
  }
  res.sample = r.value_line(count, res.tensor);
  return res;
}

/// A case of make_optim_refs.py's format (optimizer cases: tests/data/optim, optim_factored).
struct peer_optimizer_case {
  std::string name, source, optimizer;
  std::map<std::string, double> opt;
  int steps = 0;
  double scale = 0;  ///< largest |p_last - p_0| in the reference: the unit of differences
  std::vector<std::pair<double, std::string>> sensitivity;  ///< distance of a wrong variant, label
  std::vector<peer_tensor> tensors;
  std::vector<peer_result> results;
};

inline peer_optimizer_case load_peer_optimizer_case(const std::filesystem::path& file) {
  peer_optimizer_case c;
  const auto id = read_peer_records(file, [&](const std::string& key, std::istream& ls, auto& in) {
    if (key == "opt") {
      ls >> c.optimizer;
      for (const auto& [k, v] : peer_options(ls)) c.opt[k] = peer_number(v);
    } else if (key == "steps") {
      ls >> c.steps;
    } else if (key == "scale") {
      std::string v;
      ls >> v;
      c.scale = peer_number(v);
    } else if (key == "sensitivity") {
      std::string v, label;
      ls >> v >> label;
      c.sensitivity.emplace_back(peer_number(v), label);
    } else if (key == "tensor") {
      c.tensors.push_back(read_peer_tensor(ls, in.line()));
    } else if (key == "result") {
      c.results.push_back(read_peer_result(in));
    } else {
      in.unknown();
    }
  });
  c.name = id.name;
  c.source = id.source;
  return c;
}

}  // namespace gradapt_test
