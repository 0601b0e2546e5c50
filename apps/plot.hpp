// Line charts written as SVG text, with no plotting dependency: axes with ticks and
// labels, a grid, a legend, optional log scale on y. dpbench draws its speed-up chart
// with it and dptrain its loss curve. Files are written atomically (a temporary file,
// then a rename), so a reader never sees half a chart.
#pragma once
#include <string>
#include <vector>

namespace dpt::plot {

struct Series {
  std::string name;
  // Same length; points with a coordinate that is not finite, or beyond +-1e300 (whose
  // axis would overflow a double), are gaps.
  std::vector<double> x, y;
  bool reference = false;  // a guide such as the ideal speed-up: dashed grey, no markers
};

struct ChartOptions {
  bool log_y = false;  // points with y <= 0 are gaps on a log scale
  int width = 760;     // pixels, at most 100000; widened when the legend needs room
  int height = 440;    // pixels, at most 100000; made taller when the legend needs room
};

struct Chart {
  std::string title, xlabel, ylabel;
  std::vector<Series> series;
  ChartOptions options;
};

// The SVG document of charts stacked top to bottom (e.g. loss and samples/s against the
// step, one above the other).
std::string svg_line_charts(const std::vector<Chart>& charts);

// Writes charts stacked top to bottom to `path`; throws dpt::Error when it cannot.
void write_line_charts(const std::string& path, const std::vector<Chart>& charts);

// Writes one chart to `path`; throws dpt::Error when it cannot.
void write_line_chart(const std::string& path, const std::string& title, const std::string& xlabel,
                      const std::string& ylabel, const std::vector<Series>& series, const ChartOptions& options = {});

}  // namespace dpt::plot
