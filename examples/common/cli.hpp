#pragma once
// The examples' command line: `--name value` pairs, where an unknown option or a missing value
// is an error (a typo must not silently run the defaults) and numbers are checked.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <exception>
#include <initializer_list>
#include <string>
#include <type_traits>
#include <vector>

#include "check.hpp"

namespace examples {

/// The options of one program, checked at construction.
class cli {
 public:
  /// @throws gradapt::error naming the program for an argument that is not one of `options`
  ///         or an option without a value
  template <class Options>
  cli(int argc, char** argv, const char* program, const Options& options) : program_(program) {
    for (int i = 1; i < argc; ++i) args_.emplace_back(argv[i]);
    for (std::size_t i = 0; i < args_.size(); i += 2) {
      const bool known =
          std::any_of(std::begin(options), std::end(options), [&](const char* o) { return args_[i] == o; });
      if (!known) {
        std::string list;
        for (const char* o : options) list += std::string(" ") + o;
        fail(program_, ": unknown argument '", args_[i], "' (options:", list, ", each followed by a value)");
      }
      require(i + 1 < args_.size(), program_, ": option ", args_[i], " needs a value");
    }
  }
  /// The value of `name`, or `def` when it is not given.
  std::string text(const char* name, const std::string& def) const {
    for (std::size_t i = 0; i + 1 < args_.size(); i += 2)
      if (args_[i] == name) return args_[i + 1];
    return def;
  }
  /// A finite number >= 0 (`def` when not given). @throws gradapt::error naming the option
  double number(const char* name, double def) const {
    const std::string v = text(name, "");
    const double x = v.empty() ? def : parse<double>(v, name);
    require(std::isfinite(x) && x >= 0, program_, ": ", name, " is ", x, " (expected finite and >= 0)");
    return x;
  }
  /// An integer >= min (`def` when not given). @throws gradapt::error naming the option
  long count(const char* name, long def, long min) const {
    const std::string v = text(name, "");
    const long x = v.empty() ? def : parse<long>(v, name);
    require(x >= min, program_, ": ", name, " is ", x, " (expected >= ", min, ")");
    return x;
  }

 private:
  template <class T>
  T parse(const std::string& text, const char* name) const {
    std::size_t used = 0;
    T v{};
    try {
      if constexpr (std::is_floating_point_v<T>)
        v = static_cast<T>(std::stod(text, &used));
      else
        v = static_cast<T>(std::stol(text, &used));
    } catch (const std::exception&) {
      used = 0;
    }
    require(used == text.size() && used > 0, program_, ": ", name, " is '", text, "' (expected a number)");
    return v;
  }

  std::string program_;
  std::vector<std::string> args_;
};

}  // namespace examples
