// The run report (runtime/report.h): metrics rows as the trainer writes them, the errors and the
// warning for bad files, and the page: plots and series counted, gaps where values are missing,
// the output written atomically. tests/cli/test_report.sh renders a real run's page in Chromium.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <regex>
#include <string>
#include <vector>

#include "common/run.h"
#include "core/error.h"
#include "io/fs.h"
#include "runtime/report.h"

namespace bb {
namespace {

// A row with the trainer's keys (src/runtime/trainer.cpp, Trainer::run); `loss` is written as given
// ("null" is what nlohmann::json writes for NaN).
std::string row(int64_t step, const std::string& loss, const std::string& run_id = "r1", const std::string& extra = "") {
  return "{\"step\":" + std::to_string(step) + ",\"run_id\":\"" + run_id + "\",\"loss\":" + loss +
         ",\"aux_loss\":0.1,\"z_loss\":0,\"grad_norm\":1.5,\"lr\":0.001,\"tokens\":256,\"valid_tokens\":256,"
         "\"step_time_s\":0.02,\"tokens_per_s\":12800.0,\"tflops\":0.02,"
         "\"peak_bytes\":{\"params\":1000,\"grads\":1000,\"optimizer\":2000,\"activations\":4000,\"logits\":0,"
         "\"moe\":500,\"comm\":0,\"workspace\":0,\"other\":10,\"total\":8510},"
         "\"reserved_peak_bytes\":8510,\"ranks\":1,\"host_syncs\":0,\"moe_rows_max\":512,\"moe_rows_mean\":512.0" +
         extra + "}\n";
}

std::string rows(int64_t n, const std::string& run_id = "r1") {
  std::string s;
  for (int64_t i = 1; i <= n; ++i) s += row(i, std::to_string(5.0 - 0.1 * static_cast<double>(i)), run_id);
  return s;
}

std::vector<MetricsRun> parse(const std::string& text, std::vector<std::string>* warnings = nullptr) {
  std::vector<std::string> w;
  auto runs = parse_metrics(text, "m.jsonl", "m", w);
  if (warnings) *warnings = w;
  else EXPECT_TRUE(w.empty()) << w.front();
  return runs;
}

// The message of the bb::Error `f` throws ("" if none).
template <class F>
std::string error_of(F f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// One <svg> of the page: its data attributes, and the d of each series path.
struct SvgPlot {
  std::string plot, run;
  int64_t declared = -1;  // data-series
  std::vector<std::string> series_d, series_run;
};

std::vector<SvgPlot> plots_of(const std::string& html) {
  std::vector<SvgPlot> out;
  const std::regex attr_plot("data-plot=\"([^\"]*)\""), attr_series("data-series=\"([0-9]+)\"");
  const std::regex attr_run("data-run=\"([^\"]*)\""), path("<path class=\"series\" data-run=\"([^\"]*)\"[^>]* d=\"([^\"]*)\"");
  size_t at = 0;
  while ((at = html.find("<svg ", at)) != std::string::npos) {
    const size_t end = html.find("</svg>", at);
    const std::string svg = html.substr(at, end - at);
    const std::string head = svg.substr(0, svg.find('>'));
    SvgPlot p;
    std::smatch m;
    if (std::regex_search(head, m, attr_plot)) p.plot = m[1];
    if (std::regex_search(head, m, attr_series)) p.declared = std::stoll(m[1]);
    if (std::regex_search(head, m, attr_run)) p.run = m[1];
    for (std::sregex_iterator it(svg.begin(), svg.end(), path), e; it != e; ++it) {
      p.series_run.push_back((*it)[1]);
      p.series_d.push_back((*it)[2]);
    }
    out.push_back(p);
    at = end;
  }
  return out;
}

const SvgPlot& plot_named(const std::vector<SvgPlot>& plots, const std::string& name) {
  for (const SvgPlot& p : plots)
    if (p.plot == name) return p;
  ADD_FAILURE() << "no plot " << name;
  static const SvgPlot none;
  return none;
}

int64_t count(const std::string& s, const std::string& what) {
  int64_t n = 0;
  for (size_t at = s.find(what); at != std::string::npos; at = s.find(what, at + 1)) ++n;
  return n;
}

// ---- parsing ------------------------------------------------------------------------------------

TEST(Report, ReadsTheTrainersRows) {
  const auto runs = parse(rows(3) + row(4, "4.5", "r1", ",\"policy\":{\"clip_frac\":0.25,\"approx_kl\":null}"));
  ASSERT_EQ(runs.size(), 1u);
  const MetricsRun& r = runs[0];
  EXPECT_EQ(r.label, "m");
  EXPECT_EQ(r.run_id, "r1");
  EXPECT_EQ(r.source, "m.jsonl");
  ASSERT_EQ(r.rows.size(), 4u);
  EXPECT_EQ(r.rows[0].step, 1);
  EXPECT_DOUBLE_EQ(r.rows[0].loss, 4.9);
  EXPECT_DOUBLE_EQ(r.rows[0].grad_norm, 1.5);
  EXPECT_DOUBLE_EQ(r.rows[0].lr, 0.001);
  EXPECT_DOUBLE_EQ(r.rows[0].tokens_per_s, 12800.0);
  EXPECT_DOUBLE_EQ(r.rows[0].tflops, 0.02);
  EXPECT_DOUBLE_EQ(r.rows[0].reserved_peak_bytes, 8510);
  EXPECT_EQ(r.rows[0].ranks, 1);
  EXPECT_DOUBLE_EQ(r.rows[0].peak_bytes.at("activations"), 4000);
  EXPECT_DOUBLE_EQ(r.rows[0].peak_bytes.at("total"), 8510);
  EXPECT_TRUE(r.rows[0].policy.empty());
  EXPECT_DOUBLE_EQ(r.rows[3].policy.at("clip_frac"), 0.25);
  EXPECT_TRUE(std::isnan(r.rows[3].policy.at("approx_kl")));
}

// null (NaN or Inf at write time) and a skipped step's loss, grad norm and policy metrics are
// missing; the step's throughput and memory are kept.
TEST(Report, NullAndSkippedStepsAreMissingValues) {
  const auto runs = parse(row(1, "null") + row(2, "4.0", "r1", ",\"skipped\":\"no_targets\",\"policy\":{\"entropy\":1.0}") +
                          row(3, "3.0"));
  const auto& rs = runs.at(0).rows;
  EXPECT_TRUE(std::isnan(rs[0].loss));
  EXPECT_EQ(rs[1].skipped, "no_targets");
  EXPECT_TRUE(std::isnan(rs[1].loss));
  EXPECT_TRUE(std::isnan(rs[1].grad_norm));
  EXPECT_TRUE(std::isnan(rs[1].policy.at("entropy")));
  EXPECT_DOUBLE_EQ(rs[1].tokens_per_s, 12800.0);
  EXPECT_DOUBLE_EQ(rs[2].loss, 3.0);
}

// A file holding rows of two run ids (one run's file continued by another) is two runs, labelled
// with their ids; rows without a run id (files from before run ids) are a run of their own.
TEST(Report, SeveralRunIdsSplitIntoRuns) {
  const auto runs = parse(rows(2, "aaa") + row(3, "4.0", "bbb") + row(4, "3.9", "bbb"));
  ASSERT_EQ(runs.size(), 2u);
  EXPECT_EQ(runs[0].label, "m run aaa");
  EXPECT_EQ(runs[0].rows.size(), 2u);
  EXPECT_EQ(runs[1].label, "m run bbb");
  EXPECT_EQ(runs[1].rows.front().step, 3);
  const auto old = parse("{\"step\":1,\"loss\":2.0}\n" + row(1, "1.0", "ccc"));
  ASSERT_EQ(old.size(), 2u);
  EXPECT_EQ(old[0].label, "m (no run id)");
  EXPECT_EQ(old[1].label, "m run ccc");
}

// A run killed while writing leaves its last line without a newline: skipped, with a warning
// naming the line. The same text with its newline is corruption: an error.
TEST(Report, TornLastLineIsAWarning) {
  std::vector<std::string> w;
  const auto runs = parse(rows(2) + "{\"step\":3,\"run_id\":\"r1\",\"lo", &w);
  ASSERT_EQ(runs.at(0).rows.size(), 2u);
  ASSERT_EQ(w.size(), 1u);
  EXPECT_NE(w[0].find("m.jsonl:3: the last line is cut off"), std::string::npos) << w[0];
  // A whole last row without its newline is read.
  EXPECT_EQ(parse(rows(2) + row(3, "1.0").substr(0, row(3, "1.0").size() - 1)).at(0).rows.size(), 3u);
  const std::string e = error_of([&] { parse(rows(2) + "{\"step\":3,\"run_id\":\"r1\",\"lo\n"); });
  EXPECT_NE(e.find("m.jsonl:3: not a JSON object"), std::string::npos) << e;
}

TEST(Report, BadInputIsAnErrorNamingFileAndLine) {
  struct Case {
    std::string text, want;
  };
  const std::vector<Case> cases = {
      {rows(1) + "not json\n" + rows(1), "m.jsonl:2: not a JSON object (a metrics file has one object per line): 'not json'"},
      {rows(1) + "[1, 2]\n", "m.jsonl:2: not a JSON object"},
      {rows(1) + "{\"loss\":1.0}\n", "m.jsonl:2: the row has no integer \"step\""},
      {rows(1) + "{\"step\":2.5}\n", "m.jsonl:2: the row has no integer \"step\""},
      {"\n" + row(1, "\"low\""), "m.jsonl:2: \"loss\" is a string, expected a number or null"},
      {row(1, "1.0", "r1", ",\"policy\":[1]"), "m.jsonl:1: \"policy\" is an array, expected an object"},
      {row(1, "1.0", "r1", ",\"skipped\":true"), "m.jsonl:1: \"skipped\" is a boolean, expected a string"},
      {rows(2) + row(2, "1.0"), "m.jsonl:3: step 2 follows step 2 of the same run (r1)"},
      {"", "'m.jsonl' has no metrics rows"},
      {"\n  \n", "'m.jsonl' has no metrics rows"},
      {std::string("{\"step\":1}\0junk\n", 16), "m.jsonl:1: not a JSON object"},
  };
  for (const Case& c : cases) {
    const std::string e = error_of([&] { parse(c.text); });
    EXPECT_NE(e.find(c.want), std::string::npos) << "input: " << c.text << "\nerror: " << e;
  }
  // Only a torn line: the warning, then no rows.
  std::vector<std::string> w;
  EXPECT_NE(error_of([&] { parse_metrics("{\"st", "m.jsonl", "m", w); }).find("no metrics rows"), std::string::npos);
  EXPECT_EQ(w.size(), 1u);
}

TEST(Report, InputsAndLabels) {
  const std::string dir = make_tmpdir();
  make_dirs(dir + "/run_a");
  make_dirs(dir + "/empty_run");
  atomic_write(dir + "/run_a/metrics.jsonl", rows(2));
  EXPECT_EQ(metrics_file_of(dir + "/run_a"), dir + "/run_a/metrics.jsonl");
  EXPECT_EQ(metrics_file_of(dir + "/run_a/"), dir + "/run_a/metrics.jsonl");
  EXPECT_EQ(metrics_file_of(dir + "/run_a/metrics.jsonl"), dir + "/run_a/metrics.jsonl");
  EXPECT_NE(error_of([&] { metrics_file_of(dir + "/nope.jsonl"); }).find("no metrics file or run directory '" + dir + "/nope.jsonl'"),
            std::string::npos);
  EXPECT_NE(error_of([&] { metrics_file_of(dir + "/empty_run"); }).find("has no metrics.jsonl"), std::string::npos);
  EXPECT_EQ(default_label("runs/demo"), "demo");
  EXPECT_EQ(default_label("runs/demo/"), "demo");
  EXPECT_EQ(default_label("runs/demo/metrics.jsonl"), "demo");
  EXPECT_EQ(default_label("/tmp/x/side_b.jsonl"), "side_b");
  EXPECT_EQ(default_label("log.txt"), "log.txt");
  std::filesystem::remove_all(dir);
}

// ---- the page -----------------------------------------------------------------------------------

// Every plot declares the series it draws; a per-run quantity has one series per run, memory one
// plot per run with a series per category ever above zero (+ total, reserved); policy plots only
// when a run has policy metrics.
TEST(Report, PlotsAndSeriesCounts) {
  auto runs = parse(rows(3, "x"));
  for (MetricsRun& r : parse(rows(3, "y") + row(4, "1.0", "y", ",\"policy\":{\"clip_frac\":0.1,\"entropy\":2.0}"))) {
    r.label = "other";
    runs.push_back(std::move(r));
  }
  const ReportPage page = render_report(runs, {});
  const std::vector<SvgPlot> plots = plots_of(page.html);
  int64_t total = 0;
  for (const SvgPlot& p : plots) {
    EXPECT_EQ(p.declared, static_cast<int64_t>(p.series_d.size())) << p.plot;
    total += p.declared;
  }
  EXPECT_EQ(static_cast<int64_t>(plots.size()), page.num_plots);
  EXPECT_EQ(total, page.num_series);
  EXPECT_EQ(count(page.html, "class=\"series\""), page.num_series);
  for (const char* name : {"loss", "grad_norm", "lr", "tokens_per_s", "tflops"}) {
    const SvgPlot& p = plot_named(plots, name);
    EXPECT_EQ(p.declared, 2) << name;
    EXPECT_EQ(p.series_run, (std::vector<std::string>{"m", "other"})) << name;
  }
  // Memory: params, grads, optimizer, activations, moe, other (above zero), total, reserved.
  std::vector<const SvgPlot*> mem;
  for (const SvgPlot& p : plots)
    if (p.plot == "memory") mem.push_back(&p);
  ASSERT_EQ(mem.size(), 2u);
  EXPECT_EQ(mem[0]->run, "m");
  EXPECT_EQ(mem[0]->declared, 8);
  EXPECT_EQ(mem[1]->run, "other");
  EXPECT_EQ(plot_named(plots, "policy_clip_frac").declared, 1);
  EXPECT_EQ(plot_named(plots, "policy_entropy").series_run, std::vector<std::string>{"other"});
  EXPECT_EQ(page.num_plots, 5 + 2 + 2);
  EXPECT_EQ(page.num_series, 5 * 2 + 2 * 8 + 2);
  // No network: nothing is loaded from anywhere (the xmlns are names, not fetches).
  for (const char* ref : {"src=", "href=", "url(", "@import", "<script", "<link"})
    EXPECT_EQ(page.html.find(ref), std::string::npos) << ref;
}

// Subpaths ("M") of a path's d: the pieces of a line between gaps.
int64_t subpaths(const std::string& d) { return count(d, "M"); }

// A NaN (or skipped) step, and a step missing from the file, break the line; they are never drawn
// as zeros. An isolated point is a dot.
TEST(Report, MissingValuesAreGaps) {
  std::string text = row(1, "5.0") + row(2, "4.0") + row(3, "null") + row(4, "3.0") + row(5, "2.5") +
                     row(6, "2.0", "r1", ",\"skipped\":\"nonfinite\"") + row(7, "1.5") + row(9, "1.0") + row(10, "0.5");
  const ReportPage page = render_report(parse(text), {});
  const std::vector<SvgPlot> plots = plots_of(page.html);
  const std::string loss = plot_named(plots, "loss").series_d.at(0);
  // Steps 1-2 | 4-5 | 7 | 9-10: four pieces; step 7 alone is a dot.
  EXPECT_EQ(subpaths(loss), 4) << loss;
  EXPECT_EQ(count(loss, "h0"), 1) << loss;
  EXPECT_EQ(count(loss, "L"), 3) << loss;
  // The grad norm is finite at every row but the skipped one: 1-5 | 7 | 9-10 (step 8 is missing).
  EXPECT_EQ(subpaths(plot_named(plots, "grad_norm").series_d.at(0)), 3);
  // Throughput is kept at the skipped step: only the missing step 8 breaks it.
  EXPECT_EQ(subpaths(plot_named(plots, "tokens_per_s").series_d.at(0)), 2);
  // A run without any loss value draws no loss series (and says nothing false).
  const ReportPage none = render_report(parse(row(1, "null") + row(2, "null")), {});
  EXPECT_EQ(plots_of(none.html).at(0).plot, "grad_norm");
}

// A long run is drawn with at most four points per pixel column, keeping the extremes: a single
// spike in 20000 steps is still at the top of the plot.
TEST(Report, LongRunsKeepTheirExtremes) {
  std::string text;
  for (int64_t s = 1; s <= 20000; ++s) text += row(s, s == 12345 ? "9.0" : std::to_string(1.0 + 0.5 * std::sin(0.01 * static_cast<double>(s))));
  const ReportPage page = render_report(parse(text), {});
  const std::string d = plot_named(plots_of(page.html), "loss").series_d.at(0);
  const int64_t points = count(d, "L") + 1;
  EXPECT_LE(points, 4 * 500) << "20000 points drawn as " << points;
  EXPECT_GT(points, 400);
  // The y axis runs 0-10 over pixels 224-34: the spike at 9 is y = 53, every other value below 1.5
  // at y >= 195.5.
  double min_y = 1e9;
  const std::regex xy("[ML][0-9.]+,([0-9.]+)");
  for (std::sregex_iterator it(d.begin(), d.end(), xy), e; it != e; ++it) min_y = std::min(min_y, std::stod((*it)[1]));
  EXPECT_NEAR(min_y, 53.0, 0.1);
  EXPECT_LT(page.html.size(), 1000000u);
}

// Steps at the ends of int64 and values far apart still make a page (a crafted file: no overflow,
// no endless tick loop), its ticks few.
TEST(Report, ExtremeStepsAndValues) {
  const std::string text = "{\"step\":-9223372036854775808,\"loss\":1e300,\"peak_bytes\":{\"total\":1e300}}\n"
                           "{\"step\":-1,\"loss\":-1e300}\n{\"step\":9223372036854775807,\"loss\":1e17}\n";
  const ReportPage page = render_report(parse(text), {});
  EXPECT_EQ(page.num_plots, 2);  // loss, memory
  EXPECT_LE(count(page.html, "class=\"tick\""), 24);
  const ReportPage flat = render_report(parse("{\"step\":1,\"loss\":1e17}\n{\"step\":2,\"loss\":1e17}\n"), {});
  EXPECT_LE(count(flat.html, "class=\"tick\""), 24);
}

// Labels, run ids and warnings are text, whatever they hold: markup is escaped, control
// characters (invalid in XML) replaced, and a long label cut in the legend between UTF-8
// characters.
TEST(Report, LabelsAndWarningsAreEscaped) {
  auto runs = parse(rows(2, "id\\u0001"));
  runs[0].label = "<b>&\"x\"";
  ReportPage page = render_report(runs, {"m.jsonl:3: <cut>"});
  EXPECT_EQ(page.html.find("<b>&"), std::string::npos);
  EXPECT_NE(page.html.find("data-run=\"&lt;b&gt;&amp;&quot;x&quot;\""), std::string::npos);
  EXPECT_NE(page.html.find("<li>m.jsonl:3: &lt;cut&gt;</li>"), std::string::npos);
  EXPECT_NE(page.html.find("<td>id?</td>"), std::string::npos);
  EXPECT_EQ(page.html.find('\x01'), std::string::npos);
  runs[0].label = std::string(24, 'x') + "\xc3\xa9\xc3\xa9";  // 24 x, then two 2-byte characters
  page = render_report(runs, {});
  EXPECT_NE(page.html.find(">" + std::string(24, 'x') + "...</text>"), std::string::npos);
}

// The page goes through a temporary and a rename: a failed report leaves the old page as it was,
// and no temporary behind; the output may not be an input.
TEST(Report, WritesAtomically) {
  const std::string dir = make_tmpdir();
  atomic_write(dir + "/a.jsonl", rows(3, "aaa"));
  atomic_write(dir + "/b.jsonl", rows(2, "bbb") + "{\"step\":3,\"ru");
  const std::string out = dir + "/out/r.html";
  const ReportSummary s = write_report({dir + "/a.jsonl", dir + "/b.jsonl"}, {}, out);
  ASSERT_EQ(s.runs.size(), 2u);
  EXPECT_EQ(s.runs[0].label, "a");
  EXPECT_EQ(s.runs[1].label, "b");
  ASSERT_EQ(s.warnings.size(), 1u);
  EXPECT_NE(s.warnings[0].find(dir + "/b.jsonl:3: the last line is cut off"), std::string::npos);
  const std::string page = read_file(out);
  EXPECT_EQ(count(page, "class=\"series\""), s.num_series);
  EXPECT_NE(page.find("the last line is cut off"), std::string::npos);
  EXPECT_FALSE(path_exists(atomic_temp_path(out)));

  atomic_write(dir + "/bad.jsonl", rows(1) + "oops\n");
  const std::string e = error_of([&] { write_report({dir + "/a.jsonl", dir + "/bad.jsonl"}, {}, out); });
  EXPECT_NE(e.find(dir + "/bad.jsonl:2: not a JSON object"), std::string::npos) << e;
  EXPECT_EQ(read_file(out), page);
  EXPECT_FALSE(path_exists(atomic_temp_path(out)));

  EXPECT_NE(error_of([&] { write_report({dir + "/a.jsonl"}, {}, dir + "/a.jsonl"); }).find("would overwrite the metrics"),
            std::string::npos);
  EXPECT_EQ(read_file(dir + "/a.jsonl"), rows(3, "aaa"));
  EXPECT_NE(error_of([&] { write_report({dir + "/a.jsonl"}, {"x", "y"}, out); }).find("2 --label for 1 inputs"),
            std::string::npos);
  // Labels given; the same name twice in defaults falls back to the paths.
  EXPECT_EQ(write_report({dir + "/a.jsonl"}, {"side A"}, out).runs[0].label, "side A");
  make_dirs(dir + "/x/run");
  make_dirs(dir + "/y/run");
  atomic_write(dir + "/x/run/metrics.jsonl", rows(1));
  atomic_write(dir + "/y/run/metrics.jsonl", rows(1));
  const ReportSummary same = write_report({dir + "/x/run", dir + "/y/run"}, {}, out);
  EXPECT_EQ(same.runs[0].label, dir + "/x/run");
  EXPECT_EQ(same.runs[1].label, dir + "/y/run");
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace bb
