// Optimizer-state memory of AdamW, Adafactor and SM3 on a BERT-base-shaped parameter list
// (12 layers, d = 768, 30522-token vocabulary, 512 positions: 199 tensors, 109.5M parameters),
// read from the states gradapt actually creates (their chain_state element counts), not from
// formulas.
//
// Writes optimizer_memory.csv and optimizer_memory.svg (a bar chart, MB of fp32 state) into
// the output directory and prints the table. Adafactor's state for an n x m matrix is n + m
// elements: the whole model's second moment fits in a few hundred KB.
//
//   optimizer_memory [--out docs/algorithms/img]
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include <gradapt/backend/host.hpp>
#include <gradapt/optim/adafactor.hpp>
#include <gradapt/optim/adamw.hpp>
#include <gradapt/optim/sm3.hpp>

namespace {

struct shape {
  std::string name;
  std::vector<std::int64_t> dims;
};

std::vector<shape> bert_base() {
  constexpr std::int64_t d = 768, ff = 3072, vocab = 30522, pos = 512, layers = 12;
  std::vector<shape> s{{"emb.word", {vocab, d}},
                       {"emb.position", {pos, d}},
                       {"emb.token_type", {2, d}},
                       {"emb.ln.weight", {d}},
                       {"emb.ln.bias", {d}}};
  for (std::int64_t l = 0; l < layers; ++l) {
    const std::string p = "layer" + std::to_string(l) + ".";
    for (const char* w : {"q", "k", "v", "o"}) {
      s.push_back({p + w + ".weight", {d, d}});
      s.push_back({p + w + ".bias", {d}});
    }
    s.push_back({p + "attn_ln.weight", {d}});
    s.push_back({p + "attn_ln.bias", {d}});
    s.push_back({p + "ffn_in.weight", {ff, d}});
    s.push_back({p + "ffn_in.bias", {ff}});
    s.push_back({p + "ffn_out.weight", {d, ff}});
    s.push_back({p + "ffn_out.bias", {d}});
    s.push_back({p + "ffn_ln.weight", {d}});
    s.push_back({p + "ffn_ln.bias", {d}});
  }
  s.push_back({"pooler.weight", {d, d}});
  s.push_back({"pooler.bias", {d}});
  return s;
}

struct bar {
  std::string label;
  double elements;
};

}  // namespace

int main(int argc, char** argv) {
  std::string out = ".";
  for (int i = 1; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], "--out") == 0) out = argv[i + 1];
  const auto shapes = bert_base();
  // init() reads only shapes: every view points into one buffer as large as the largest tensor.
  std::size_t largest = 0, total = 0;
  for (const auto& s : shapes) {
    std::size_t n = 1;
    for (auto d : s.dims) n *= static_cast<std::size_t>(d);
    largest = std::max(largest, n);
    total += n;
  }
  std::vector<float> scratch(largest);
  gradapt::param_list<float> params;
  for (const auto& s : shapes)
    params.add(s.name, gradapt::tensor_view<float>(scratch.data(), s.dims),
               gradapt::tensor_view<float>(scratch.data(), s.dims));
  gradapt::host b{};
  std::vector<bar> bars;
  {
    const auto st = gradapt::adamw().init(b, params);
    double n = 0;
    for (std::size_t j = 0; j < st.buffer_count(); ++j)
      for (const auto& v : st.buffer(j)) n += static_cast<double>(v.size());
    bars.push_back({"AdamW (m, v)", n});
  }
  {
    const auto st = gradapt::adafactor({.momentum = 0.9}).init(b, params);
    bars.push_back({"Adafactor + momentum", static_cast<double>(st.state_elements())});
  }
  {
    const auto st = gradapt::sm3().init(b, params);
    bars.push_back({"SM3 (momentum 0.9)", static_cast<double>(st.state_elements())});
  }
  {
    const auto st = gradapt::adafactor().init(b, params);
    bars.push_back({"Adafactor (default)", static_cast<double>(st.state_elements())});
  }
  {
    const auto st = gradapt::sm3({.momentum = 0.0}).init(b, params);
    bars.push_back({"SM3 (no momentum)", static_cast<double>(st.state_elements())});
  }
  std::printf("BERT-base shape: %zu tensors, %.1fM parameters (%.1f MB fp32)\n", shapes.size(),
              static_cast<double>(total) * 1e-6, static_cast<double>(total) * 4e-6);
  std::printf("%-24s %14s %12s %12s\n", "optimizer", "state elems", "MB (fp32)", "vs params");
  std::ofstream csv(out + "/optimizer_memory.csv");
  csv << "optimizer,state_elements,megabytes,per_parameter\n";
  for (const auto& r : bars) {
    std::printf("%-24s %14.0f %12.3f %12.5f\n", r.label.c_str(), r.elements, r.elements * 4e-6,
                r.elements / static_cast<double>(total));
    csv << r.label << ',' << static_cast<long long>(r.elements) << ',' << r.elements * 4e-6 << ','
        << r.elements / static_cast<double>(total) << '\n';
  }
  // Horizontal bars on a log scale (Adafactor's default state is ~1000x below AdamW's).
  const double W = 760, H = 90 + 46.0 * static_cast<double>(bars.size()), left = 190, right = 175;
  const double lo = 1e-2, hi = 1e4;  // MB
  const auto xof = [&](double mb) {
    const double t = (std::log10(std::max(mb, lo)) - std::log10(lo)) / (std::log10(hi) - std::log10(lo));
    return left + t * (W - left - right);
  };
  std::ofstream svg(out + "/optimizer_memory.svg");
  svg << "<svg xmlns='http://www.w3.org/2000/svg' width='" << W << "' height='" << H
      << "' font-family='sans-serif' font-size='12'>\n<rect width='100%' height='100%' fill='white'/>\n";
  svg << "<text x='" << W / 2
      << "' y='22' text-anchor='middle' font-size='15'>Optimizer state, BERT-base shape ("
      << static_cast<int>(static_cast<double>(total) * 1e-6 + 0.5) << "M fp32 parameters, "
      << static_cast<int>(static_cast<double>(total) * 4e-6 + 0.5) << " MB)</text>\n";
  for (double mb = lo; mb <= hi * 1.0001; mb *= 10) {
    const double x = xof(mb);
    svg << "<line x1='" << x << "' y1='40' x2='" << x << "' y2='" << H - 40 << "' stroke='#ddd'/>";
    char lbl[32];
    std::snprintf(lbl, sizeof lbl, mb < 1 ? "%.2g MB" : "%.0f MB", mb);
    svg << "<text x='" << x << "' y='" << H - 24 << "' text-anchor='middle'>" << lbl << "</text>\n";
  }
  double y = 50;
  for (const auto& r : bars) {
    const double mb = r.elements * 4e-6;
    svg << "<text x='" << left - 8 << "' y='" << y + 19 << "' text-anchor='end'>" << r.label << "</text>";
    svg << "<rect x='" << left << "' y='" << y << "' width='" << std::max(1.0, xof(mb) - left)
        << "' height='28' fill='#4878a8'/>";
    char lbl[64];
    std::snprintf(lbl, sizeof lbl, "%.3g MB (%.3g x params)", mb, r.elements / static_cast<double>(total));
    svg << "<text x='" << xof(mb) + 6 << "' y='" << y + 19 << "'>" << lbl << "</text>\n";
    y += 46;
  }
  svg << "<text x='" << W / 2 << "' y='" << H - 6
      << "' text-anchor='middle' fill='#555'>state elements from gradapt's own states "
         "(examples/optimizer_memory.cpp); "
         "log scale</text>\n</svg>\n";
  std::printf("wrote %s/optimizer_memory.csv and %s/optimizer_memory.svg\n", out.c_str(), out.c_str());
  return 0;
}
