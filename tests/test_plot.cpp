// The SVG line-chart writer (apps/plot.hpp): ticks, gaps, escaping, stacked charts and
// atomic writes. Well-formedness of a whole chart is checked by dpbench_test.sh (Python's
// XML parser on dpbench's speedup.svg).
#include <unistd.h>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <dptrain/error.hpp>
#include "apps/plot.hpp"
#include "catch.hpp"
#include "common/atomic_file.hpp"

using namespace dpt::plot;

namespace {

size_t count(const std::string& s, const std::string& what) {
  size_t n = 0;
  for (size_t at = s.find(what); at != std::string::npos; at = s.find(what, at + 1)) ++n;
  return n;
}

std::string read(const std::filesystem::path& p) {
  std::ifstream f(p);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// A fresh folder for one test case, removed at its end.
struct TempDir {
  std::filesystem::path path = std::filesystem::temp_directory_path() / ("dpt_plot_test_" + std::to_string(::getpid()));
  TempDir() { std::filesystem::create_directories(path); }
  ~TempDir() { std::filesystem::remove_all(path); }
};

}  // namespace

TEST_CASE("a line chart has nice ticks, a legend, markers and the reference line", "[plot]") {
  const Series ideal{"ideal", {1, 2, 3}, {1, 2, 3}, true};
  const Series measured{"weak, nccl, fp32", {1, 2, 3}, {1, 1.9, 2.7}};
  const std::string svg = svg_line_charts({{"speed-up", "devices", "speed-up", {ideal, measured}, {}}});
  CHECK(svg.rfind("<?xml", 0) == 0);
  CHECK(count(svg, "<svg ") == 1);
  CHECK(count(svg, "</svg>") == 1);
  CHECK(count(svg, "<polyline") == 2);
  CHECK(count(svg, "stroke-dasharray=\"6 4\"") == 2);  // the reference line and its legend entry
  CHECK(count(svg, "<circle") == 3);                   // markers on the measured series only
  // Tick labels: x ones are centred, y ones end at the axis. Over 1..3 the y axis steps
  // by 0.5; x holds integers (device counts), so it steps by whole numbers.
  for (const char* tick : {"1", "1.5", "2", "2.5", "3"})
    CHECK(count(svg, std::string("text-anchor=\"end\">") + tick + "<") == 1);
  for (const char* tick : {"1", "2", "3"}) CHECK(count(svg, std::string("text-anchor=\"middle\">") + tick + "<") == 1);
  CHECK(count(svg, "text-anchor=\"middle\">1.5<") == 0);
  CHECK(count(svg, ">weak, nccl, fp32<") == 1);
  CHECK(svg.find("nan") == std::string::npos);
  CHECK(svg.find("inf") == std::string::npos);
}

TEST_CASE("gaps, log scales and escaping", "[plot]") {
  // NaN breaks the line; on a log scale y <= 0 does too; a lone point gets a marker.
  const Series loss{"loss <train> & \"eval\"", {1, 2, 3, 4, 5, 6}, {10, 1, NAN, 0.1, -1, 0.01}};
  ChartOptions log;
  log.log_y = true;
  const std::string svg = svg_line_charts({{"a & b", "step", "loss", {loss}, log}});
  CHECK(count(svg, "<polyline") == 1);  // 10 -> 1; then 0.1 and 0.01 stand alone
  CHECK(count(svg, "<circle") == 4);    // 4 usable points, few enough for markers
  CHECK(svg.find("loss &lt;train&gt; &amp; &quot;eval&quot;") != std::string::npos);
  CHECK(svg.find(">a &amp; b<") != std::string::npos);
  for (const char* tick : {"0.01", "0.1", "1", "10"})
    CHECK(count(svg, std::string("text-anchor=\"end\">") + tick + "<") == 1);
  CHECK(count(svg, "text-anchor=\"end\">") == 4);  // whole decades only over three decades
  CHECK(svg.find("nan") == std::string::npos);

  // Many points: no markers; large values get short labels.
  Series rate{"samples/s", {}, {}};
  for (int i = 0; i < 500; ++i) rate.x.push_back(i), rate.y.push_back(1e6 + 1e3 * i);
  const std::string big = svg_line_charts({{"rate", "step", "samples/s", {rate}, {}}});
  CHECK(count(big, "<circle") == 0);
  CHECK(big.find("text-anchor=\"end\">1.5M<") != std::string::npos);

  // No usable data still makes a chart with axes.
  const std::string empty = svg_line_charts({{"nothing", "x", "y", {Series{"none", {1}, {NAN}}}, {}}});
  CHECK(count(empty, "<polyline") == 0);
  CHECK(empty.find(">1<") != std::string::npos);

  CHECK_THROWS_AS(svg_line_charts({{"bad", "x", "y", {Series{"short", {1, 2}, {1}}}, {}}}), dpt::Error);

  // Values a few ulps apart at a large magnitude: the tick loop once never ended there
  // (adding 1 to a double above 2^53 does nothing).
  const std::string flat = svg_line_charts({{"flat", "x", "y", {Series{"s", {1, 2}, {1e17, 1e17 + 64}}}, {}}});
  CHECK(count(flat, "<polyline") == 1);
  CHECK(count(flat, "text-anchor=\"end\">") <= 12);

  // Values near the double's limit made the axis's span inf and every coordinate "nan":
  // beyond 1e300 they are gaps, as NaN is. So are they on a log axis.
  for (const bool log_y : {false, true}) {
    ChartOptions o;
    o.log_y = log_y;
    const Series huge{"s", {1, 2, 3, 4}, {1.7e308, 1, -1.7e308, 1e300}};
    const std::string edge = svg_line_charts({{"edge", "x", "y", {huge, Series{"t", {-1e308, 1e308}, {1, 2}}}, o}});
    CHECK(edge.find("nan") == std::string::npos);
    CHECK(edge.find("inf") == std::string::npos);
    CHECK(count(edge, "<circle") == 2);  // 1 and 1e300 alone (the other series has no usable point)
  }
  ChartOptions tall;
  tall.height = 2000000000;  // two of them overflowed the document's int height
  CHECK_THROWS_WITH(svg_line_charts({{"tall", "x", "y", {}, tall}}),
                    "chart 'tall': 760 x 2000000000 pixels asked, at most 100000 a side");

  // Control characters and bytes that are not UTF-8 made the file no XML: U+FFFD instead.
  const std::string title = std::string("t\x02 \xff a") + '\0' + "b \xC3\xA9";
  const std::string odd = svg_line_charts({{title, "x", "y", {Series{"s", {1, 2}, {1, 2}}}, {}}});
  const std::string fffd = "\xEF\xBF\xBD";
  CHECK(odd.find(">t" + fffd + " " + fffd + " a" + fffd + "b \xC3\xA9<") != std::string::npos);
}

TEST_CASE("charts stack in one document of one width", "[plot]") {
  ChartOptions o;
  o.height = 300;
  const Series a{"loss", {1, 2, 3}, {3, 2, 1}}, b{"samples/s", {1, 2, 3}, {5, 6, 7}};
  const std::string svg = svg_line_charts({{"loss", "step", "loss", {a}, o}, {"speed", "step", "samples/s", {b}, o}});
  CHECK(count(svg, "<g transform=\"translate(0,") == 2);
  CHECK(svg.find("translate(0,300.00)") != std::string::npos);
  CHECK(svg.find("height=\"600\"") != std::string::npos);
}

TEST_CASE("charts are written atomically and failures name the path", "[plot]") {
  TempDir dir;
  const auto path = (dir.path / "chart.svg").string();
  dpt::write_file_atomic(path, "old");
  write_line_chart(path, "t", "x", "y", {Series{"s", {1, 2}, {1, 2}}});
  CHECK(read(path).find("</svg>") != std::string::npos);
  size_t files = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator(dir.path)) ++files;
  CHECK(files == 1);  // no temporary file left behind

  const auto missing = (dir.path / "no" / "such" / "dir" / "chart.svg").string();
  try {
    write_line_chart(missing, "t", "x", "y", {});
    FAIL("writing into a missing folder succeeded");
  } catch (const dpt::Error& e) {
    CHECK(std::string(e.what()).find(missing) != std::string::npos);
  }
  // A folder where the file should go: the rename fails, and the temporary file goes.
  std::filesystem::create_directories(dir.path / "taken.svg");
  CHECK_THROWS_AS(dpt::write_file_atomic((dir.path / "taken.svg").string(), "x"), dpt::Error);
  files = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator(dir.path)) ++files;
  CHECK(files == 2);  // chart.svg and the folder taken.svg
}
