// The fit check of a GPU run (plan/estimate.h, runtime/trainer.cpp): a run whose predicted peak
// exceeds what the device has free is refused before anything is allocated, with the breakdown
// and a setting that fits; train.memory_check = "warn" starts it anyway; a run that fits starts.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>

#include "common/gpu.h"
#include "common/run.h"
#include "common/testing.h"
#include "common/tiny_models.h"
#include "plan/estimate.h"
#include "runtime/run_config.h"
#include "runtime/trainer.h"

namespace bb {
namespace {

RunConfig config(const std::string& model, int64_t tokens, const std::vector<std::string>& extra = {}) {
  std::vector<std::string> set = {"parallel.device=\"cuda\"", "train.micro_batch_tokens=" + std::to_string(tokens)};
  set.insert(set.end(), extra.begin(), extra.end());
  return parse_run_config("[model]\nconfig = \"" + model +
                              "\"\n[train]\nsteps = 1\n[data]\npath = \"demo\"\ndemo_documents = 40\n"
                              "[checkpoint]\nevery = 0\nsave_final = false\n",
                          "test", set);
}

TEST(PlanGpu, ARunPredictedNotToFitIsRefusedBeforeAllocating) {
  BB_REQUIRE_GPU();
#ifdef BB_WITH_CUDA
  const std::string dir = make_tmpdir();
  ModelConfig m = test::small_moe({.layers = 2, .experts = 4, .head_dim = 128});
  std::ofstream(dir + "/config.json") << m.to_hf_json().dump(2);
  const std::string model = dir + "/config.json";
  // The smallest power-of-two micro-batch whose predicted peak exceeds what the GPU has free.
  const int64_t available = cuda::memory_available(0);
  int64_t tokens = 4096;
  while (plan::estimate_memory(config(model, tokens), 1).peak_total <= available) {
    tokens *= 2;
    ASSERT_LT(tokens, int64_t{1} << 31) << "no micro-batch of this model exceeds the GPU";
  }
  const MemoryStats before = allocator_for(Device::cuda(0)).stats();
  try {
    Trainer t(config(model, tokens), nullptr);
    FAIL() << "a run predicted at more than the device's " << format_bytes(available) << " started";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("out of memory predicted"), std::string::npos) << msg;
    EXPECT_NE(msg.find("The nearest setting that fits"), std::string::npos) << msg;
    EXPECT_NE(msg.find("--force"), std::string::npos) << msg;
  }
  // Nothing was allocated on the device for it.
  const MemoryStats after = allocator_for(Device::cuda(0)).stats();
  EXPECT_EQ(after.live_total, before.live_total);
  EXPECT_EQ(after.live_of(MemCategory::params), 0);
  // A micro-batch that fits starts (and runs a step).
  Trainer ok(config(model, 4096), nullptr);
  EXPECT_TRUE(std::isfinite(ok.train_step().loss));
#endif
}

}  // namespace
}  // namespace bb
