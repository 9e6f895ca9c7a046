// report.cpp — metrics files to one HTML page of SVG plots (report.h).
#include "runtime/report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/memory.h"
#include "io/fs.h"

namespace bb {

namespace {

using nlohmann::json;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// Series colours, in the order runs are given (Tableau 10): fixed, so a run keeps its colour
// when the report is regenerated with the same inputs.
constexpr const char* kPalette[] = {"#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f",
                                    "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac"};
constexpr int kPaletteSize = sizeof(kPalette) / sizeof(kPalette[0]);

// The policy metrics the trainer writes under "policy", with their plot titles ("sequences", a
// count of the data, is not plotted).
constexpr const char* kPolicyMetrics[][2] = {
    {"clip_frac", "Policy: clipped token fraction"},  {"dual_clip_frac", "Policy: dual-clipped token fraction"},
    {"approx_kl", "Policy: approximate KL to the rollout policy"}, {"entropy", "Policy: entropy"},
    {"ratio_mean", "Policy: mean importance ratio"}, {"ratio_max", "Policy: max importance ratio"},
    {"ref_kl", "Policy: KL to the reference"}};

// "a string", "an object": a JSON value's type, for messages.
std::string a_type(const json& v) {
  const std::string t = v.type_name();
  return (t == "object" || t == "array" ? "an " : "a ") + t;
}

// A value of the row: absent or null (the trainer writes NaN and Inf as null) is missing; any
// other non-number is an error.
double number_at(const json& j, const char* key, const std::string& where) {
  const auto it = j.find(key);
  if (it == j.end() || it->is_null()) return kNaN;
  BB_CHECK(it->is_number(), where, ": \"", key, "\" is ", a_type(*it), ", expected a number or null");
  return it->get<double>();
}

// An object of numbers ("peak_bytes", "policy"); absent is empty.
std::map<std::string, double> numbers_in(const json& j, const char* key, const std::string& where) {
  std::map<std::string, double> out;
  const auto it = j.find(key);
  if (it == j.end() || it->is_null()) return out;
  BB_CHECK(it->is_object(), where, ": \"", key, "\" is ", a_type(*it), ", expected an object");
  for (const auto& [name, v] : it->items()) {
    BB_CHECK(v.is_number() || v.is_null(), where, ": \"", key, ".", name, "\" is ", a_type(v),
             ", expected a number or null");
    out[name] = v.is_null() ? kNaN : v.get<double>();
  }
  return out;
}

bool is_blank(std::string_view s) {
  return std::all_of(s.begin(), s.end(), [](char c) { return c == ' ' || c == '\t' || c == '\r'; });
}

// Text for HTML and XML alike: markup characters as entities, and control characters (a run id
// may hold any, JSON escapes them) as '?', since XML forbids them even as entities.
std::string escape(std::string_view s) {
  std::string out;
  for (const char c : s) {
    if (static_cast<unsigned char>(c) < 0x20 && c != '\t' && c != '\n') {
      out += '?';
      continue;
    }
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
}

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

// 1, 2 or 5 times a power of ten: about `target` intervals over `range`.
double nice_step(double range, int target) {
  const double raw = range / target;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  const double f = raw / mag;
  return (f <= 1 ? 1 : f <= 2 ? 2 : f <= 5 ? 5 : 10) * mag;
}

// A tick value, rounded to its tick step (no 0.30000000000000004), large ones as 120K / 1.5M.
std::string tick_label(double v, double step, double largest) {
  v = std::round(v / step) * step;
  if (std::fabs(v) < step * 1e-6) return "0";
  const char* suffix = "";
  double scale = 1;
  if (largest >= 1e9) scale = 1e9, suffix = "G";
  else if (largest >= 1e6) scale = 1e6, suffix = "M";
  else if (largest >= 1e4) scale = 1e3, suffix = "K";
  return fmt("%.6g", v / scale) + suffix;
}

double median(std::vector<double> v) {
  if (v.empty()) return kNaN;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

struct Point {
  int64_t step;
  double value;
};

struct Series {
  std::string run;       // data-run: the run's label
  std::string category;  // data-category (memory plots), else empty
  std::string name;      // in the legend
  std::string color;
  bool dashed = false;
  std::vector<Point> points;
};

struct Plot {
  std::string id;     // data-plot
  std::string title;  // inside the plot
  std::string unit;   // the y axis's label
  std::string run;    // a memory plot's run (one per run)
  bool zero_based = false;
  double y_scale = 1;  // values are divided by it (bytes to GiB)
  std::vector<Series> series;
  double y_lo = kNaN, y_hi = kNaN;  // set: the y range, shared by a run's memory plots
};

// One run's points of a quantity; empty when the run has no finite value of it.
template <class Get>
std::vector<Point> points_of(const MetricsRun& run, Get get) {
  std::vector<Point> pts;
  bool any = false;
  for (const MetricsRow& r : run.rows) {
    pts.push_back({r.step, get(r)});
    any = any || std::isfinite(pts.back().value);
  }
  if (!any) pts.clear();
  return pts;
}

// Geometry of a plot, in SVG pixels: the plot area, then the legend to its right.
constexpr double kWidth = 780, kLeft = 72, kRight = 560, kTop = 34, kPlotHeight = 190, kLegendX = 576;
constexpr double kLegendRow = 16;

// The `d` of a series: one subpath per run of consecutive steps with finite values, so a missing
// value or a missing step is a gap in the line. A subpath of one point is drawn as a dot (a
// zero-length segment, with round caps). Within a pixel column only the first, lowest, highest
// and last points are kept: the same line, at most four points per column however long the run.
std::string series_path(const std::vector<Point>& pts, double x0, double xs, double y0, double ys) {
  std::string d;
  std::vector<std::pair<double, double>> seg;  // pixel coordinates of the current subpath
  auto flush = [&] {
    size_t a = 0;
    bool first = true;
    while (a < seg.size()) {
      size_t b = a;
      const double col = std::floor(seg[a].first);
      size_t lo = a, hi = a;
      while (b < seg.size() && std::floor(seg[b].first) == col) {
        if (seg[b].second < seg[lo].second) lo = b;
        if (seg[b].second > seg[hi].second) hi = b;
        ++b;
      }
      size_t keep[4] = {a, lo, hi, b - 1};
      std::sort(keep, keep + 4);
      for (int k = 0; k < 4; ++k) {
        if (k > 0 && keep[k] == keep[k - 1]) continue;
        d += first ? "M" : "L";
        d += fmt("%.1f", seg[keep[k]].first) + "," + fmt("%.1f", seg[keep[k]].second);
        first = false;
      }
      a = b;
    }
    if (seg.size() == 1) d += "h0";
    seg.clear();
  };
  for (size_t i = 0; i < pts.size(); ++i) {
    // (Steps increase within a run, so step - 1 cannot overflow; previous + 1 could.)
    const bool gap = !std::isfinite(pts[i].value) || (i > 0 && pts[i].step - 1 != pts[i - 1].step);
    if (gap) flush();
    if (std::isfinite(pts[i].value))
      seg.emplace_back(x0 + xs * static_cast<double>(pts[i].step), y0 - ys * pts[i].value);
  }
  flush();
  return d;
}

// The finite y range of a plot's series (after y_scale).
std::pair<double, double> value_range(const Plot& p) {
  double lo = std::numeric_limits<double>::infinity(), hi = -lo;
  for (const Series& s : p.series)
    for (const Point& pt : s.points)
      if (std::isfinite(pt.value)) lo = std::min(lo, pt.value / p.y_scale), hi = std::max(hi, pt.value / p.y_scale);
  return {lo, hi};
}

std::string render_plot(const Plot& p) {
  // The step range, in double: a crafted file's steps may span all of int64.
  double s_lo = std::numeric_limits<double>::infinity(), s_hi = -s_lo;
  for (const Series& s : p.series)
    for (const Point& pt : s.points)
      s_lo = std::min(s_lo, static_cast<double>(pt.step)), s_hi = std::max(s_hi, static_cast<double>(pt.step));
  if (s_hi == s_lo) s_hi += 1;
  const double x_step = std::max(1.0, std::round(nice_step(s_hi - s_lo, 8)));

  auto [lo, hi] = std::isfinite(p.y_lo) ? std::make_pair(p.y_lo, p.y_hi) : value_range(p);
  if (p.zero_based) lo = std::min(lo, 0.0);
  if (hi == lo) {
    const double pad = lo == 0 ? 1 : std::fabs(lo) * 0.05;
    lo -= pad, hi += pad;
  }
  const double y_step = nice_step(hi - lo, 5);
  lo = std::floor(lo / y_step) * y_step;
  hi = std::ceil(hi / y_step) * y_step;

  const double xs = (kRight - kLeft) / (s_hi - s_lo), x0 = kLeft - xs * s_lo;
  const double bottom = kTop + kPlotHeight;
  const double ys = kPlotHeight / (hi - lo) / p.y_scale, y0 = bottom + kPlotHeight / (hi - lo) * lo;
  const double height = std::max(bottom + 44, kTop + kLegendRow * static_cast<double>(p.series.size()) + 8);

  std::string o = "<svg xmlns=\"http://www.w3.org/2000/svg\" class=\"plot\" width=\"" + fmt("%.0f", kWidth) +
                  "\" height=\"" + fmt("%.0f", height) + "\" viewBox=\"0 0 " + fmt("%.0f", kWidth) + " " +
                  fmt("%.0f", height) + "\" role=\"img\" data-plot=\"" + p.id + "\"" +
                  (p.run.empty() ? "" : " data-run=\"" + escape(p.run) + "\"") + " data-series=\"" +
                  std::to_string(p.series.size()) + "\">\n";
  o += "<title>" + escape(p.title) + "</title>\n";
  o += "<text class=\"title\" x=\"" + fmt("%.0f", kLeft) + "\" y=\"20\">" + escape(p.title) + "</text>\n";
  // Grid and tick labels. (Counted loops: at 1e17 a step of 1 would not move a running sum. The
  // 1-2-5 steps give at most 11 ticks.)
  for (int k = 0; k <= 11; ++k) {
    const double v = lo + k * y_step;
    if (!(v <= hi + y_step * 1e-6)) break;
    const double y = bottom - (v - lo) / (hi - lo) * kPlotHeight;
    o += "<line class=\"grid\" x1=\"" + fmt("%.1f", kLeft) + "\" x2=\"" + fmt("%.1f", kRight) + "\" y1=\"" +
         fmt("%.1f", y) + "\" y2=\"" + fmt("%.1f", y) + "\"/>";
    o += "<text class=\"tick\" text-anchor=\"end\" x=\"" + fmt("%.1f", kLeft - 6) + "\" y=\"" + fmt("%.1f", y + 4) +
         "\">" + tick_label(v, y_step, std::max(std::fabs(lo), std::fabs(hi))) + "</text>\n";
  }
  const double first_tick = std::ceil(s_lo / x_step) * x_step;
  for (int k = 0; k <= 11; ++k) {
    const double s = first_tick + k * x_step;
    if (!(s <= s_hi)) break;
    const double x = x0 + xs * s;
    o += "<line class=\"tickmark\" x1=\"" + fmt("%.1f", x) + "\" x2=\"" + fmt("%.1f", x) + "\" y1=\"" +
         fmt("%.1f", bottom) + "\" y2=\"" + fmt("%.1f", bottom + 4) + "\"/>";
    o += "<text class=\"tick\" text-anchor=\"middle\" x=\"" + fmt("%.1f", x) + "\" y=\"" + fmt("%.1f", bottom + 16) +
         "\">" + fmt("%.0f", s) + "</text>\n";
  }
  o += "<rect class=\"frame\" x=\"" + fmt("%.1f", kLeft) + "\" y=\"" + fmt("%.1f", kTop) + "\" width=\"" +
       fmt("%.1f", kRight - kLeft) + "\" height=\"" + fmt("%.1f", kPlotHeight) + "\"/>\n";
  o += "<text class=\"axis\" text-anchor=\"middle\" x=\"" + fmt("%.1f", (kLeft + kRight) / 2) + "\" y=\"" +
       fmt("%.1f", bottom + 34) + "\">step</text>\n";
  o += "<text class=\"axis\" text-anchor=\"middle\" transform=\"translate(16 " + fmt("%.1f", kTop + kPlotHeight / 2) +
       ") rotate(-90)\">" + escape(p.unit) + "</text>\n";
  // The series, then the legend.
  for (const Series& s : p.series) {
    o += "<path class=\"series\" data-run=\"" + escape(s.run) + "\"" +
         (s.category.empty() ? "" : " data-category=\"" + escape(s.category) + "\"") + " stroke=\"" + s.color + "\"" +
         (s.dashed ? " stroke-dasharray=\"5 3\"" : "") + " d=\"" + series_path(s.points, x0, xs, y0, ys) +
         "\"><title>" + escape(s.name) + "</title></path>\n";
  }
  double ly = kTop + 6;
  for (const Series& s : p.series) {
    // Long labels are cut in the legend (not inside a UTF-8 character); the full one is the
    // entry's tooltip.
    size_t cut = s.name.size() > 26 ? 25 : s.name.size();
    while (cut > 0 && cut < s.name.size() && (static_cast<unsigned char>(s.name[cut]) & 0xC0) == 0x80) --cut;
    const std::string shown = cut < s.name.size() ? s.name.substr(0, cut) + "..." : s.name;
    o += "<g class=\"legend\"><title>" + escape(s.name) + "</title><line x1=\"" + fmt("%.1f", kLegendX) + "\" x2=\"" +
         fmt("%.1f", kLegendX + 22) + "\" y1=\"" + fmt("%.1f", ly) + "\" y2=\"" + fmt("%.1f", ly) + "\" stroke=\"" +
         s.color + "\"" + (s.dashed ? " stroke-dasharray=\"5 3\"" : "") + "/><text x=\"" + fmt("%.1f", kLegendX + 28) +
         "\" y=\"" + fmt("%.1f", ly + 4) + "\">" + escape(shown) + "</text></g>\n";
    ly += kLegendRow;
  }
  o += "</svg>\n";
  return o;
}

// One plot of a quantity, a series per run that has a finite value of it; none if no run has.
template <class Get>
void add_run_plot(std::vector<Plot>& plots, const std::vector<MetricsRun>& runs, const std::string& id,
                  const std::string& title, const std::string& unit, bool zero_based, Get get) {
  Plot p;
  p.id = id, p.title = title, p.unit = unit, p.zero_based = zero_based;
  for (size_t i = 0; i < runs.size(); ++i) {
    std::vector<Point> pts = points_of(runs[i], get);
    if (!pts.empty()) p.series.push_back({runs[i].label, "", runs[i].label, kPalette[i % kPaletteSize], false, std::move(pts)});
  }
  if (!p.series.empty()) plots.push_back(std::move(p));
}

// Peak memory per category: one plot per run (a line per category would be too many lines on
// one plot once runs overlay), all on the same y range so the runs compare at a glance. A
// category is drawn where it is ever above zero; then the total and the allocator's reserved peak
// (dashed; on the CPU it is the total, on a GPU what the pool held).
void add_memory_plots(std::vector<Plot>& plots, const std::vector<MetricsRun>& runs) {
  std::vector<std::string> names;
  for (int c = 0; c < kNumMemCategories; ++c) names.push_back(category_name(static_cast<MemCategory>(c)));
  for (const MetricsRun& run : runs)  // categories of a later version, after the known ones
    for (const MetricsRow& r : run.rows)
      for (const auto& kv : r.peak_bytes)
        if (kv.first != "total" && std::find(names.begin(), names.end(), kv.first) == names.end()) names.push_back(kv.first);
  names.push_back("total");

  std::vector<Plot> mem;
  double hi = 0;
  for (const MetricsRun& run : runs) {
    Plot p;
    p.id = "memory", p.run = run.label, p.zero_based = true;
    p.title = runs.size() > 1 ? "Peak memory per category: " + run.label : "Peak memory per category";
    for (size_t c = 0; c < names.size(); ++c) {
      const std::string& name = names[c];
      std::vector<Point> pts = points_of(run, [&](const MetricsRow& r) {
        const auto it = r.peak_bytes.find(name);
        return it == r.peak_bytes.end() ? kNaN : it->second;
      });
      const bool nonzero = std::any_of(pts.begin(), pts.end(), [](const Point& q) { return q.value > 0; });
      if (!nonzero) continue;
      const bool total = name == "total";
      p.series.push_back({run.label, name, name, total ? "#222222" : kPalette[c % kPaletteSize], false, std::move(pts)});
    }
    std::vector<Point> reserved = points_of(run, [](const MetricsRow& r) { return r.reserved_peak_bytes; });
    if (std::any_of(reserved.begin(), reserved.end(), [](const Point& q) { return q.value > 0; }))
      p.series.push_back({run.label, "reserved", "reserved (pool)", "#888888", true, std::move(reserved)});
    if (p.series.empty()) continue;
    hi = std::max(hi, value_range(p).second);
    mem.push_back(std::move(p));
  }
  const double gib = double(int64_t{1} << 30), mib = double(int64_t{1} << 20);
  // GiB once anything reaches 1 GiB; a small run's MiB would otherwise be ticks of 0.001.
  const bool in_gib = hi >= gib;
  for (Plot& p : mem) {
    p.y_scale = in_gib ? gib : mib;
    p.unit = in_gib ? "GiB" : "MiB";
    p.y_lo = 0;
    p.y_hi = hi / p.y_scale;
    plots.push_back(std::move(p));
  }
}

constexpr const char* kStyle = R"(body { font: 14px/1.4 sans-serif; margin: 24px; color: #222; }
h1 { font-size: 20px; margin: 0 0 8px; }
p.note { color: #555; margin: 4px 0 12px; }
ul.warnings { color: #8a4b00; background: #fff4e0; padding: 8px 8px 8px 28px; }
table.runs { border-collapse: collapse; margin: 12px 0 20px; }
table.runs th, table.runs td { border: 1px solid #ccc; padding: 3px 8px; text-align: left; }
table.runs td.num { text-align: right; white-space: nowrap; font-variant-numeric: tabular-nums; }
table.runs td:first-child { white-space: nowrap; }
span.swatch { display: inline-block; width: 12px; height: 12px; margin-right: 6px; vertical-align: -1px; }
svg.plot { display: block; margin: 0 0 16px; font: 12px sans-serif; }
svg.plot .title { font-size: 14px; font-weight: bold; }
svg.plot .tick { fill: #555; }
svg.plot .grid { stroke: #e4e4e4; }
svg.plot .tickmark { stroke: #999; }
svg.plot .frame { fill: none; stroke: #999; }
svg.plot path.series { fill: none; stroke-width: 1.6; stroke-linejoin: round; stroke-linecap: round; }
svg.plot .legend line { stroke-width: 2.5; }
)";

std::string run_table(const std::vector<MetricsRun>& runs) {
  std::string o =
      "<table class=\"runs\">\n<tr><th>run</th><th>run id</th><th>file</th><th>steps</th><th>skipped</th>"
      "<th>final loss</th><th>median tokens/s</th><th>median model TFLOP/s</th><th>peak memory</th><th>ranks</th></tr>\n";
  for (size_t i = 0; i < runs.size(); ++i) {
    const MetricsRun& r = runs[i];
    int64_t skipped = 0;
    const MetricsRow* last_loss = nullptr;
    std::vector<double> tps, tflops;
    double peak = kNaN;
    for (size_t k = 0; k < r.rows.size(); ++k) {
      const MetricsRow& row = r.rows[k];
      skipped += !row.skipped.empty();
      if (std::isfinite(row.loss)) last_loss = &row;
      // The first step pays one-time costs (allocator growth, plan builds): left out of the medians.
      if (k > 0 || r.rows.size() == 1) {
        if (std::isfinite(row.tokens_per_s)) tps.push_back(row.tokens_per_s);
        if (std::isfinite(row.tflops)) tflops.push_back(row.tflops);
      }
      const auto t = row.peak_bytes.find("total");
      if (t != row.peak_bytes.end() && std::isfinite(t->second) && !(peak >= t->second)) peak = t->second;
    }
    const double med_tps = median(tps), med_tflops = median(tflops);
    const std::string dash = "&#8212;";
    o += "<tr><td><span class=\"swatch\" style=\"background:" + std::string(kPalette[i % kPaletteSize]) + "\"></span>" +
         escape(r.label) + "</td><td>" + (r.run_id.empty() ? dash : escape(r.run_id)) + "</td><td>" +
         escape(r.source) + "</td><td class=\"num\">" + std::to_string(r.rows.size()) + " (" +
         std::to_string(r.rows.front().step) + "&#8211;" + std::to_string(r.rows.back().step) +
         ")</td><td class=\"num\">" + std::to_string(skipped) + "</td><td class=\"num\">" +
         (last_loss ? fmt("%.4f", last_loss->loss) + " (step " + std::to_string(last_loss->step) + ")" : dash) +
         "</td><td class=\"num\">" + (std::isfinite(med_tps) ? fmt("%.0f", med_tps) : dash) + "</td><td class=\"num\">" +
         (std::isfinite(med_tflops) ? fmt("%.3g", med_tflops) : dash) + "</td><td class=\"num\">" +
         (std::isfinite(peak) ? format_bytes(static_cast<int64_t>(std::clamp(peak, 0.0, 9e18))) : dash) + "</td><td class=\"num\">" +
         (r.rows.back().ranks > 0 ? std::to_string(r.rows.back().ranks) : dash) + "</td></tr>\n";
  }
  return o + "</table>\n";
}

}  // namespace

std::vector<MetricsRun> parse_metrics(std::string_view text, const std::string& source, const std::string& label,
                                      std::vector<std::string>& warnings) {
  std::vector<MetricsRun> runs;
  size_t at = 0;
  for (int64_t lineno = 1; at < text.size(); ++lineno) {
    size_t end = text.find('\n', at);
    const bool terminated = end != std::string_view::npos;
    if (!terminated) end = text.size();
    const std::string_view line = text.substr(at, end - at);
    at = end + 1;
    if (is_blank(line)) continue;
    const std::string where = source + ":" + std::to_string(lineno);
    // (The JSON reader would stop at a NUL byte and take what is before it: not JSON here.)
    json j = line.find('\0') == std::string_view::npos ? json::parse(line, nullptr, false) : json(json::value_t::discarded);
    if (j.is_discarded() && !terminated) {
      // The trainer writes a row and its newline at once: an unterminated tail is a write that
      // was cut short (a run killed mid-write, a disk that filled).
      warnings.push_back(where + ": the last line is cut off (no newline, not JSON: the run stopped while writing it); skipped");
      break;
    }
    BB_CHECK(!j.is_discarded() && j.is_object(), where, ": not a JSON object (a metrics file has one object per line): '",
             std::string(line.substr(0, 60)), line.size() > 60 ? "...'" : "'");
    const auto step = j.find("step");
    BB_CHECK(step != j.end() && step->is_number_integer(), where, ": the row has no integer \"step\"");
    const auto id = j.find("run_id");
    BB_CHECK(id == j.end() || id->is_string(), where, ": \"run_id\" is ", a_type(*id), ", expected a string");
    const auto skipped = j.find("skipped");
    BB_CHECK(skipped == j.end() || skipped->is_string(), where, ": \"skipped\" is ", a_type(*skipped),
             ", expected a string");
    const auto ranks = j.find("ranks");
    BB_CHECK(ranks == j.end() || ranks->is_number_integer(), where, ": \"ranks\" is ", a_type(*ranks),
             ", expected an integer");

    MetricsRow r;
    r.step = step->get<int64_t>();
    if (skipped != j.end()) r.skipped = skipped->get<std::string>();
    if (ranks != j.end()) r.ranks = ranks->get<int64_t>();
    r.loss = number_at(j, "loss", where);
    r.grad_norm = number_at(j, "grad_norm", where);
    r.lr = number_at(j, "lr", where);
    r.tokens_per_s = number_at(j, "tokens_per_s", where);
    r.tflops = number_at(j, "tflops", where);
    r.reserved_peak_bytes = number_at(j, "reserved_peak_bytes", where);
    r.peak_bytes = numbers_in(j, "peak_bytes", where);
    r.policy = numbers_in(j, "policy", where);
    if (!r.skipped.empty()) {
      // A skipped step applied no update: its loss and gradient are not a point of the curve.
      r.loss = r.grad_norm = kNaN;
      for (auto& kv : r.policy) kv.second = kNaN;
    }

    const std::string run_id = id == j.end() ? std::string() : id->get<std::string>();
    auto run = std::find_if(runs.begin(), runs.end(), [&](const MetricsRun& m) { return m.run_id == run_id; });
    if (run == runs.end()) run = runs.insert(runs.end(), MetricsRun{label, run_id, source, {}});
    BB_CHECK(run->rows.empty() || r.step > run->rows.back().step, where, ": step ", r.step, " follows step ",
             run->rows.back().step, " of the same run", run_id.empty() ? "" : " (" + run_id + ")",
             "; a run's rows are in step order (two runs writing one file without run ids?)");
    run->rows.push_back(std::move(r));
  }
  BB_CHECK(!runs.empty(), "'", source, "' has no metrics rows (did the run write any step?)");
  if (runs.size() > 1)
    for (MetricsRun& r : runs) r.label += r.run_id.empty() ? " (no run id)" : " run " + r.run_id;
  return runs;
}

std::string metrics_file_of(const std::string& input) {
  BB_CHECK(path_exists(input), "report: no metrics file or run directory '", input, "'");
  if (!is_directory(input)) return input;
  const std::string f = path_join(input, "metrics.jsonl");
  BB_CHECK(path_exists(f) && !is_directory(f), "report: run directory '", input,
           "' has no metrics.jsonl; pass the file the run's log.metrics names");
  return f;
}

std::string default_label(const std::string& input) {
  std::filesystem::path p = std::filesystem::path(input).lexically_normal();
  if (!p.has_filename()) p = p.parent_path();  // a trailing slash
  if (p.filename() == "metrics.jsonl" && p.has_parent_path()) p = p.parent_path();
  else if (p.extension() == ".jsonl") p = p.stem();
  return p.filename().string();
}

ReportPage render_report(const std::vector<MetricsRun>& runs, const std::vector<std::string>& warnings) {
  std::vector<Plot> plots;
  add_run_plot(plots, runs, "loss", "Loss", "loss", false, [](const MetricsRow& r) { return r.loss; });
  add_run_plot(plots, runs, "grad_norm", "Gradient norm", "grad norm", false,
               [](const MetricsRow& r) { return r.grad_norm; });
  add_run_plot(plots, runs, "lr", "Learning rate", "lr", true, [](const MetricsRow& r) { return r.lr; });
  add_run_plot(plots, runs, "tokens_per_s", "Throughput", "tokens/s", true,
               [](const MetricsRow& r) { return r.tokens_per_s; });
  add_run_plot(plots, runs, "tflops", "Model TFLOP/s per process", "TFLOP/s", true,
               [](const MetricsRow& r) { return r.tflops; });
  add_memory_plots(plots, runs);
  for (const auto& [key, title] : kPolicyMetrics) {
    const std::string k = key;
    add_run_plot(plots, runs, "policy_" + k, title, k, false, [&](const MetricsRow& r) {
      const auto it = r.policy.find(k);
      return it == r.policy.end() ? kNaN : it->second;
    });
  }

  ReportPage page;
  std::string sources;
  for (const MetricsRun& r : runs)
    if (sources.find(escape(r.source)) == std::string::npos) sources += (sources.empty() ? "" : ", ") + escape(r.source);
  std::string& o = page.html;
  // Well-formed XML as well as HTML, so the page also opens as XHTML (a strict parser catches any
  // unclosed tag the HTML parser would mend silently; tests/cli/test_report.sh does that).
  o = "<!DOCTYPE html>\n<html xmlns=\"http://www.w3.org/1999/xhtml\" lang=\"en\">\n<head>\n<meta charset=\"utf-8\"/>\n"
      "<title>bumblebee run report</title>\n<style>\n" + std::string(kStyle) + "</style>\n</head>\n<body>\n"
      "<h1>bumblebee run report</h1>\n";
  o += "<p class=\"note\">" + std::to_string(runs.size()) + (runs.size() == 1 ? " run" : " runs") + " from " + sources +
       ". A gap in a line is a skipped step (no update: non-finite values or no loss targets), a value the file "
       "does not hold, or a step missing from it. Medians leave out each run's first step.</p>\n";
  if (!warnings.empty()) {
    o += "<ul class=\"warnings\">\n";
    for (const std::string& w : warnings) o += "<li>" + escape(w) + "</li>\n";
    o += "</ul>\n";
  }
  o += run_table(runs);
  for (const Plot& p : plots) {
    o += render_plot(p);
    ++page.num_plots;
    page.num_series += static_cast<int64_t>(p.series.size());
  }
  o += "</body>\n</html>\n";
  return page;
}

ReportSummary write_report(const std::vector<std::string>& inputs, const std::vector<std::string>& labels,
                           const std::string& out) {
  BB_CHECK(!inputs.empty(), "report: give at least one metrics file or run directory");
  BB_CHECK(labels.empty() || labels.size() == inputs.size(), "report: ", labels.size(), " --label for ", inputs.size(),
           " inputs; give one per input, in order, or none");
  namespace fs = std::filesystem;
  std::vector<std::string> names = labels;
  if (names.empty()) {
    std::vector<std::string> base;
    for (const std::string& in : inputs) base.push_back(default_label(in));
    // Two inputs of one name (runs/x/metrics.jsonl and old/x/metrics.jsonl): their paths tell them apart.
    for (size_t i = 0; i < inputs.size(); ++i)
      names.push_back(std::count(base.begin(), base.end(), base[i]) > 1 ? inputs[i] : base[i]);
  }
  ReportSummary s;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const std::string file = metrics_file_of(inputs[i]);
    std::error_code ec;
    BB_CHECK(!fs::equivalent(file, out, ec), "report: --out '", out, "' is the input '", file,
             "'; it would overwrite the metrics");
    for (MetricsRun& r : parse_metrics(read_file(file), file, names[i], s.warnings)) s.runs.push_back(std::move(r));
  }
  const ReportPage page = render_report(s.runs, s.warnings);
  const fs::path dir = fs::path(out).parent_path();
  if (!dir.empty()) make_dirs(dir.string());
  atomic_write(out, page.html);
  s.num_plots = page.num_plots;
  s.num_series = page.num_series;
  return s;
}

}  // namespace bb
