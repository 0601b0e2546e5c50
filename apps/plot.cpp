#include "plot.hpp"

#include <unistd.h>
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include <dptrain/error.hpp>

#include "common/atomic_file.hpp"
#include "common/text.hpp"

namespace dpt::plot {
namespace {

// Tableau's categorical colours, distinct in hue and readable on white, less its grey,
// which reference lines use.
constexpr const char* kPalette[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
                                    "#8c564b", "#e377c2", "#bcbd22", "#17becf"};
constexpr size_t kColors = sizeof kPalette / sizeof kPalette[0];
constexpr int kFont = 12;           // px, ticks and legend
constexpr double kCharWidth = 7.0;  // px per character at kFont in a sans-serif face, a safe upper guess
constexpr int kLegendRow = 18;      // px
constexpr size_t kMaxMarkers = 60;  // more points than this: a line alone reads better
constexpr int kMaxPixels = 100000;  // a side of a chart (a document's height sums its charts': no int overflow)

// Text as XML character data: markup escaped; control characters (which XML 1.0 does not
// allow) and bytes that are not UTF-8 written as U+FFFD, so that the file stays XML.
std::string escape(const std::string& s) {
  static const std::string kReplacement = "\xEF\xBF\xBD";
  std::string out;
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c >= 0x80) {  // a UTF-8 sequence, or a byte of none
      const size_t len = utf8_length(reinterpret_cast<const uint8_t*>(s.data()) + i, s.size() - i);
      out += len > 0 ? s.substr(i, len) : kReplacement;
      i += len > 0 ? len : 1;
      continue;
    }
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&apos;";
        break;
      default:
        if (c < 0x20 && c != '\t' && c != '\n') out += kReplacement;
        else out += static_cast<char>(c);
    }
    ++i;
  }
  return out;
}

// Pixel coordinates: two decimals are finer than any screen needs.
std::string px(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f", v);
  return buf;
}

// SVG elements; attributes beyond the geometry come ready-made in `attrs`.
std::string with(const std::string& attrs) { return attrs.empty() ? "" : " " + attrs; }

std::string line(double x1, double y1, double x2, double y2, const std::string& attrs = "") {
  return "<line x1=\"" + px(x1) + "\" y1=\"" + px(y1) + "\" x2=\"" + px(x2) + "\" y2=\"" + px(y2) + "\"" + with(attrs) +
         "/>\n";
}

std::string rect(double x, double y, double w, double h, const std::string& attrs) {
  return "<rect x=\"" + px(x) + "\" y=\"" + px(y) + "\" width=\"" + px(w) + "\" height=\"" + px(h) + "\"" +
         with(attrs) + "/>\n";
}

// `content` is escaped here.
std::string text(double x, double y, const std::string& content, const std::string& attrs = "") {
  return "<text x=\"" + px(x) + "\" y=\"" + px(y) + "\"" + with(attrs) + ">" + escape(content) + "</text>\n";
}

// Tick labels: six significant digits (which also hides float noise such as
// 0.30000000000000004), with k/M/G for large values so labels stay short.
std::string tick_label(double v) {
  if (v == 0.0) return "0";  // not "-0"
  const double a = std::fabs(v);
  const char* suffix = "";
  if (a >= 1e9) v /= 1e9, suffix = "G";
  else if (a >= 1e6) v /= 1e6, suffix = "M";
  else if (a >= 1e4) v /= 1e3, suffix = "k";
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.6g%s", v, suffix);
  return buf;
}

// An axis maps data values to [0, 1] across the plot area, linearly or by log10.
struct Axis {
  bool log = false;
  double lo = 0.0, hi = 1.0;  // in scale units (log10 of the value on a log axis)
  std::vector<double> ticks;  // data values

  double frac(double v) const { return ((log ? std::log10(v) : v) - lo) / (hi - lo); }
};

// The step 1, 2 or 5 times a power of ten that divides `span` into about five parts.
double nice_step(double span) {
  const double raw = span / 5.0;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  const double f = raw / mag;
  return (f < 1.5 ? 1.0 : f < 3.0 ? 2.0 : f < 7.0 ? 5.0 : 10.0) * mag;
}

// A linear axis from tick to tick around [lo, hi]; integer-valued data (device counts,
// steps) gets no fractional ticks.
Axis linear_axis(double lo, double hi, bool integers) {
  if (!(lo <= hi)) lo = 0.0, hi = 1.0;  // no data
  // A span within rounding of the values (1e17 and 1e17 + 64) is drawn as one value: a step
  // that small would not move a tick at that magnitude.
  if (hi - lo <= std::max(std::fabs(lo), std::fabs(hi)) * 1e-12) {
    const double pad = lo == 0.0 ? 1.0 : std::fabs(lo) * 0.1;
    lo -= pad, hi += pad;
  }
  double step = nice_step(hi - lo);
  if (integers) step = std::max(step, 1.0);
  // The tolerance keeps a value that is a tick up to float noise from adding a step.
  const double first = std::floor(lo / step + 1e-9), last = std::ceil(hi / step - 1e-9);
  Axis a;
  a.lo = first * step;
  a.hi = last * step;
  const auto ticks = static_cast<int>(std::min(last - first, 100.0));  // about five; bounded whatever the floats do
  for (int i = 0; i <= ticks; ++i) a.ticks.push_back((first + i) * step);
  return a;
}

// A log axis over whole decades around [lo, hi] (both > 0); 2x and 5x ticks when it
// spans two decades or less, every k-th decade when it spans many.
Axis log_axis(double lo, double hi) {
  if (!(lo <= hi)) lo = 1.0, hi = 10.0;  // no positive data
  Axis a;
  a.log = true;
  a.lo = std::floor(std::log10(lo));
  a.hi = std::ceil(std::log10(hi));
  if (a.hi == a.lo) a.hi += 1.0;
  const double decades = a.hi - a.lo;
  const double stride = std::ceil(decades / 8.0);
  for (double e = a.lo; e <= a.hi + 0.5; e += stride) {
    const double base = std::pow(10.0, e);
    a.ticks.push_back(base);
    if (decades <= 2.0 && e < a.hi)
      for (double m : {2.0, 5.0}) a.ticks.push_back(m * base);
  }
  return a;
}

// Beyond 1e300 an axis's span or its outer ticks would overflow a double into inf and NaN.
constexpr double kLargest = 1e300;
bool usable(double x, double y, bool log_y) {
  return std::fabs(x) <= kLargest && std::fabs(y) <= kLargest && (!log_y || y > 0.0);  // false for NaN
}

// Where one chart's parts go, in px.
struct Layout {
  int width, height;
  double left, right, top, bottom;  // the plot area, in px
  double legend_w;
};

// The legend box's width: a line sample and the longest name; 0 without named series.
double legend_width(const Chart& c) {
  size_t longest = 0;
  bool any = false;
  for (const Series& s : c.series)
    if (!s.name.empty()) any = true, longest = std::max(longest, s.name.size());
  return any ? 46.0 + kCharWidth * static_cast<double>(longest) : 0.0;
}

// `legend_w` is the widest legend of the document, so that stacked plot areas line up.
Layout layout(const Chart& c, double legend_w) {
  size_t rows = 0;
  for (const Series& s : c.series) rows += s.name.empty() ? 0 : 1;
  Layout l{};
  l.legend_w = legend_w;
  const double margin_right = legend_w > 0 ? legend_w + 32.0 : 24.0;
  const double margin_left = 76.0, margin_top = 44.0, margin_bottom = 56.0, min_plot_w = 360.0;
  if (c.options.width > kMaxPixels || c.options.height > kMaxPixels)
    throw Error("chart '" + c.title + "': " + std::to_string(c.options.width) + " x " +
                std::to_string(c.options.height) + " pixels asked, at most " + std::to_string(kMaxPixels) + " a side");
  l.width = std::max(c.options.width, static_cast<int>(std::ceil(margin_left + min_plot_w + margin_right)));
  const double legend_h = static_cast<double>(rows) * kLegendRow + 12.0;
  l.height = std::max(c.options.height, static_cast<int>(std::ceil(margin_top + legend_h + margin_bottom)));
  l.left = margin_left;
  l.right = l.width - margin_right;
  l.top = margin_top;
  l.bottom = l.height - margin_bottom;
  return l;
}

// One chart as an SVG group at vertical offset `top_y` of the document.
std::string render(const Chart& c, const Layout& l, double top_y) {
  double xmin = INFINITY, xmax = -INFINITY, ymin = INFINITY, ymax = -INFINITY;
  bool integer_x = true;
  for (const Series& s : c.series) {
    if (s.x.size() != s.y.size())
      throw Error("chart '" + c.title + "': series '" + s.name + "' has " + std::to_string(s.x.size()) +
                  " x values and " + std::to_string(s.y.size()) + " y values");
    for (size_t i = 0; i < s.x.size(); ++i) {
      if (!usable(s.x[i], s.y[i], c.options.log_y)) continue;
      xmin = std::min(xmin, s.x[i]), xmax = std::max(xmax, s.x[i]);
      ymin = std::min(ymin, s.y[i]), ymax = std::max(ymax, s.y[i]);
      integer_x = integer_x && s.x[i] == std::round(s.x[i]);
    }
  }
  const Axis ax = linear_axis(xmin, xmax, integer_x);
  const Axis ay = c.options.log_y ? log_axis(ymin, ymax) : linear_axis(ymin, ymax, false);
  auto X = [&](double v) { return l.left + ax.frac(v) * (l.right - l.left); };
  auto Y = [&](double v) { return l.bottom - ay.frac(v) * (l.bottom - l.top); };

  std::string o = "<g transform=\"translate(0," + px(top_y) + ")\">\n";
  o += text(l.width / 2.0, 26, c.title, "text-anchor=\"middle\" font-size=\"15\" font-weight=\"bold\"");
  o += "<g stroke=\"#e3e3e3\" stroke-width=\"1\">\n";  // the grid
  for (double t : ax.ticks) o += line(X(t), l.top, X(t), l.bottom);
  for (double t : ay.ticks) o += line(l.left, Y(t), l.right, Y(t));
  o += "</g>\n";
  o += rect(l.left, l.top, l.right - l.left, l.bottom - l.top, "fill=\"none\" stroke=\"#333\" stroke-width=\"1\"");
  o += "<g font-size=\"" + std::to_string(kFont) + "\" fill=\"#222\">\n";
  for (double t : ax.ticks) {
    o += line(X(t), l.bottom, X(t), l.bottom + 5, "stroke=\"#333\"");
    o += text(X(t), l.bottom + 19, tick_label(t), "text-anchor=\"middle\"");
  }
  for (double t : ay.ticks) {
    o += line(l.left - 5, Y(t), l.left, Y(t), "stroke=\"#333\"");
    o += text(l.left - 8, Y(t) + 4, tick_label(t), "text-anchor=\"end\"");
  }
  o += text((l.left + l.right) / 2, l.bottom + 42, c.xlabel, "text-anchor=\"middle\" font-size=\"13\"");
  const double ymid = (l.top + l.bottom) / 2;
  o +=
      text(18, ymid, c.ylabel, "text-anchor=\"middle\" font-size=\"13\" transform=\"rotate(-90 18 " + px(ymid) + ")\"");
  o += "</g>\n";

  // Series: each run of usable points is one polyline (a gap breaks the line).
  size_t colour = 0, row = 0;
  std::string legend;
  for (const Series& s : c.series) {
    std::string style;
    if (s.reference) {
      style = "stroke=\"#888\" stroke-width=\"1.5\" stroke-dasharray=\"6 4\"";
    } else {
      // Past the palette's colours a dash pattern tells series of one colour apart.
      style = std::string("stroke=\"") + kPalette[colour % kColors] + "\" stroke-width=\"2\"" +
              (colour >= kColors ? " stroke-dasharray=\"3 2\"" : "");
    }
    std::vector<std::vector<std::pair<double, double>>> runs(1);
    for (size_t i = 0; i < s.x.size(); ++i) {
      if (usable(s.x[i], s.y[i], c.options.log_y)) runs.back().push_back({X(s.x[i]), Y(s.y[i])});
      else if (!runs.back().empty()) runs.emplace_back();
    }
    size_t points = 0;
    for (const auto& r : runs) points += r.size();
    const bool markers = !s.reference && points <= kMaxMarkers;
    const std::string fill = s.reference ? "#888" : kPalette[colour % kColors];
    for (const auto& r : runs) {
      if (r.size() >= 2) {
        o += "<polyline fill=\"none\" " + style + " stroke-linejoin=\"round\" points=\"";
        for (const auto& [x, y] : r) o += px(x) + "," + px(y) + " ";
        o.back() = '"';
        o += "/>\n";
      }
      // A lone point has no line to show it, so it always gets a marker.
      if (markers || r.size() == 1)
        for (const auto& [x, y] : r)
          o += "<circle cx=\"" + px(x) + "\" cy=\"" + px(y) + "\" r=\"3\" fill=\"" + fill + "\"/>\n";
    }
    if (!s.name.empty()) {
      const double ly = l.top + 6 + kLegendRow * (static_cast<double>(row) + 0.5), lx = l.right + 26;
      legend += line(lx, ly, lx + 24, ly, style);
      legend += text(lx + 30, ly + 4, s.name);
      ++row;
    }
    if (!s.reference) ++colour;
  }
  if (row > 0) {
    o += rect(l.right + 18, l.top, l.legend_w, kLegendRow * static_cast<double>(row) + 12,
              "fill=\"#fff\" stroke=\"#bbb\"");
    o += "<g font-size=\"" + std::to_string(kFont) + "\" fill=\"#222\">\n" + legend + "</g>\n";
  }
  o += "</g>\n";
  return o;
}

}  // namespace

std::string svg_line_charts(const std::vector<Chart>& charts) {
  double legend_w = 0;
  for (const Chart& c : charts) legend_w = std::max(legend_w, legend_width(c));
  std::vector<Layout> layouts;
  int width = 0, height = 0;
  for (const Chart& c : charts) {
    layouts.push_back(layout(c, legend_w));
    width = std::max(width, layouts.back().width);
    height += layouts.back().height;
  }
  std::string o = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n";
  o += "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" + std::to_string(width) + "\" height=\"" +
       std::to_string(height) + "\" viewBox=\"0 0 " + std::to_string(width) + " " + std::to_string(height) +
       "\" font-family=\"DejaVu Sans, Helvetica, Arial, sans-serif\">\n";
  o += "<rect width=\"100%\" height=\"100%\" fill=\"#fff\"/>\n";
  double y = 0;
  for (size_t i = 0; i < charts.size(); ++i) {
    Layout l = layouts[i];
    // Charts of one document share its width, so their plot areas line up.
    const int extra = width - l.width;
    l.width = width;
    l.right += extra;
    o += render(charts[i], l, y);
    y += l.height;
  }
  o += "</svg>\n";
  return o;
}

void write_line_charts(const std::string& path, const std::vector<Chart>& charts) {
  dpt::write_file_atomic(path, svg_line_charts(charts));
}

void write_line_chart(const std::string& path, const std::string& title, const std::string& xlabel,
                      const std::string& ylabel, const std::vector<Series>& series, const ChartOptions& options) {
  write_line_charts(path, {Chart{title, xlabel, ylabel, series, options}});
}

}  // namespace dpt::plot
