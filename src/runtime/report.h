// report.h — `bumblebee report`: one self-contained HTML page (inline SVG and CSS, no script, no
// network) with a run's metrics over steps: loss, grad norm, learning rate, tokens/s, model
// TFLOP/s, peak memory per category and, for policy-loss runs, the policy metrics. Several runs
// are overlaid (skills/run-report.md).
//
// Input: the JSON-lines file the trainer writes (log.metrics, docs/config.md), one object per
// step. A run directory means its metrics.jsonl (configs/demo.toml: runs/demo/metrics.jsonl). A
// file whose rows carry several run ids splits into one run per id. A null or non-finite value
// (the trainer writes NaN and Inf as null) and a skipped step's loss, grad norm and policy
// metrics are missing values: the plots draw gaps there, never zeros. So does a step missing
// between two rows.
//
// For tests, every plot's <svg> carries data-plot (its quantity) and data-series (the number of
// series drawn in it), and every series is a <path class="series" data-run="LABEL">.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace bb {

// One row of a metrics file. NaN where the row has no finite value.
struct MetricsRow {
  int64_t step = 0;
  std::string skipped;  // "nonfinite", "no_targets" or empty
  double loss, grad_norm, lr, tokens_per_s, tflops, reserved_peak_bytes;
  int64_t ranks = 0;  // 0: not recorded
  std::map<std::string, double> peak_bytes;  // per memory category, and "total"
  std::map<std::string, double> policy;      // clip_frac, approx_kl, ... (policy-loss runs)
};

// The rows of one run id in one file, in step order.
struct MetricsRun {
  std::string label;   // in the legend and the table: the input's label, plus the run id when its file holds several
  std::string run_id;  // empty for rows written before run ids were recorded
  std::string source;  // the file read
  std::vector<MetricsRow> rows;
};

// Parses the text of a metrics file. `source` names it in messages and in the runs; `label` is
// the runs' label. A row that is not a JSON object with an integer "step", a known key of the
// wrong type or a step that does not follow the run's previous one throws bb::Error naming
// source:line; so does a file without rows. A last line that is not newline-terminated and does
// not parse (a run killed mid-write) is skipped and described in `warnings` instead.
std::vector<MetricsRun> parse_metrics(std::string_view text, const std::string& source, const std::string& label,
                                      std::vector<std::string>& warnings);

// The metrics file an input names: the input itself, or a run directory's metrics.jsonl.
// Throws bb::Error when there is none.
std::string metrics_file_of(const std::string& input);

// The label of an input in the legend: a file's name without .jsonl, or the run directory's name
// for a run directory or its metrics.jsonl.
std::string default_label(const std::string& input);

struct ReportPage {
  std::string html;
  int64_t num_plots = 0, num_series = 0;  // <svg> plots and <path class="series"> in them
};

// The report page of `runs` (warnings are listed at its top).
ReportPage render_report(const std::vector<MetricsRun>& runs, const std::vector<std::string>& warnings);

struct ReportSummary {
  std::vector<MetricsRun> runs;
  std::vector<std::string> warnings;
  int64_t num_plots = 0, num_series = 0;
};

// Reads every input (labels: one per input, or empty for the default ones), renders the page and
// writes it to `out` atomically (creating its directory). `out` may not be one of the inputs.
ReportSummary write_report(const std::vector<std::string>& inputs, const std::vector<std::string>& labels,
                           const std::string& out);

}  // namespace bb
