#pragma once
// A small, dependency-free SVG line-plot writer for the examples: several named series,
// linear axes with rounded ticks, a legend. Enough to show a loss curve in docs without
// pulling a plotting stack into the build.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace examples {

struct series {
  std::string name;
  std::vector<std::pair<double, double>> points;  // (x, y); non-finite y values are skipped
};

struct plot_options {
  std::string title;
  std::string x_label;
  std::string y_label;
  int width = 760;
  int height = 460;
  bool log_y = false;
  /// Vertical dashed lines at x, each labelled at the top of the frame (none by default).
  std::vector<std::pair<double, std::string>> marks = {};
};

namespace detail {
inline double nice_step(double span, int target) {
  const double raw = span / std::max(1, target);
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 2.5, 5.0, 10.0})
    if (raw <= m * mag) return m * mag;
  return 10 * mag;
}
inline std::string fmt(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%g", v);
  return b;
}
inline std::string escape(const std::string& s) {
  std::string o;
  for (char c : s) o += c == '<' ? "&lt;" : c == '>' ? "&gt;" : c == '&' ? "&amp;" : std::string(1, c);
  return o;
}
}  // namespace detail

/// Writes `all` as an SVG line chart to `path`; throws std::runtime_error on I/O failure.
inline void write_svg(const std::string& path, const std::vector<series>& all, const plot_options& o) {
  static const char* colors[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd",
                                 "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"};
  const auto ty = [&](double y) { return o.log_y ? std::log10(y) : y; };
  double x0 = std::numeric_limits<double>::infinity(), x1 = -x0, y0 = x0, y1 = -x0;
  for (const auto& s : all)
    for (auto [x, y] : s.points) {
      if (!std::isfinite(y) || (o.log_y && y <= 0)) continue;
      x0 = std::min(x0, x), x1 = std::max(x1, x), y0 = std::min(y0, ty(y)), y1 = std::max(y1, ty(y));
    }
  for (const auto& [x, label] : o.marks) x0 = std::min(x0, x), x1 = std::max(x1, x);
  if (!(x1 > x0)) x1 = x0 + 1;
  if (!(y1 > y0)) y1 = y0 + 1;
  const double ml = 70, mr = 170, mt = 40, mb = 55;
  const double pw = o.width - ml - mr, ph = o.height - mt - mb;
  const auto px = [&](double x) { return ml + (x - x0) / (x1 - x0) * pw; };
  const auto py = [&](double y) { return mt + ph - (ty(y) - y0) / (y1 - y0) * ph; };
  std::ostringstream svg;
  svg << "<svg xmlns='http://www.w3.org/2000/svg' width='" << o.width << "' height='" << o.height
      << "' font-family='sans-serif' font-size='12'>\n<rect width='100%' height='100%' fill='white'/>\n";
  svg << "<text x='" << o.width / 2 << "' y='22' text-anchor='middle' font-size='15'>"
      << detail::escape(o.title) << "</text>\n";
  const double xs = detail::nice_step(x1 - x0, 8);
  for (double x = std::ceil(x0 / xs) * xs; x <= x1 + 1e-9 * xs; x += xs)
    svg << "<line x1='" << px(x) << "' y1='" << mt << "' x2='" << px(x) << "' y2='" << mt + ph
        << "' stroke='#eee'/><text x='" << px(x) << "' y='" << mt + ph + 16 << "' text-anchor='middle'>"
        << detail::fmt(x) << "</text>\n";
  const double ys = o.log_y ? 1.0 : detail::nice_step(y1 - y0, 6);
  for (double y = std::ceil(y0 / ys) * ys; y <= y1 + 1e-9 * ys; y += ys) {
    const double yv = o.log_y ? std::pow(10.0, y) : y;
    svg << "<line x1='" << ml << "' y1='" << py(yv) << "' x2='" << ml + pw << "' y2='" << py(yv)
        << "' stroke='#eee'/><text x='" << ml - 6 << "' y='" << py(yv) + 4 << "' text-anchor='end'>"
        << detail::fmt(yv) << "</text>\n";
  }
  svg << "<rect x='" << ml << "' y='" << mt << "' width='" << pw << "' height='" << ph
      << "' fill='none' stroke='#333'/>\n";
  for (std::size_t k = 0; k < o.marks.size(); ++k) {
    const double x = px(o.marks[k].first);
    svg << "<line x1='" << x << "' y1='" << mt << "' x2='" << x << "' y2='" << mt + ph
        << "' stroke='#555' stroke-dasharray='4,3'/><text x='" << x + 3 << "' y='"
        << mt + 12 + 13.0 * double(k % 4) << "' font-size='11' fill='#333'>"
        << detail::escape(o.marks[k].second) << "</text>\n";
  }
  svg << "<text x='" << ml + pw / 2 << "' y='" << o.height - 12 << "' text-anchor='middle'>"
      << detail::escape(o.x_label) << "</text>\n";
  svg << "<text transform='translate(18," << mt + ph / 2 << ") rotate(-90)' text-anchor='middle'>"
      << detail::escape(o.y_label) << "</text>\n";
  for (std::size_t k = 0; k < all.size(); ++k) {
    const char* c = colors[k % 10];
    svg << "<polyline fill='none' stroke='" << c << "' stroke-width='1.6' points='";
    for (auto [x, y] : all[k].points)
      if (std::isfinite(y) && (!o.log_y || y > 0)) svg << px(x) << ',' << py(y) << ' ';
    svg << "'/>\n";
    const double ly = mt + 10 + 18.0 * static_cast<double>(k);
    svg << "<line x1='" << ml + pw + 12 << "' y1='" << ly << "' x2='" << ml + pw + 34 << "' y2='" << ly
        << "' stroke='" << c << "' stroke-width='2.5'/><text x='" << ml + pw + 40 << "' y='" << ly + 4 << "'>"
        << detail::escape(all[k].name) << "</text>\n";
  }
  svg << "</svg>\n";
  std::ofstream f(path);
  if (!(f << svg.str())) throw std::runtime_error("cannot write " + path);
}

}  // namespace examples
