// config.cpp — the [backend] knobs: checks and their JSON form (runtime/run_config.h applies them).
#include "backend/config.h"

#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"


namespace bb {

namespace {
void check_one_of(const std::string& where, const char* key, const std::string& v,
                  std::initializer_list<const char*> allowed) {
  std::string list;
  for (const char* a : allowed) {
    if (v == a) return;
    list += (list.empty() ? "" : ", ") + std::string(a);
  }
  BB_FAIL("backend.", key, " = '", v, "'", where.empty() ? "" : " in " + where,
          " is not one of: ", list);
}
}  // namespace

void BackendConfig::validate(const std::string& where) const {
  const std::string in = where.empty() ? "" : " in " + where;
  check_one_of(where, "grouped_gemm_same_dtype", grouped_gemm_same_dtype,
               {"cublas", "multi_stream", "mma"});
  check_one_of(where, "grouped_gemm_widening", grouped_gemm_widening, {"multi_stream", "wmma", "mma"});
  BB_CHECK(grouped_gemm_streams >= 1 && grouped_gemm_streams <= 16,
           "backend.grouped_gemm_streams = ", grouped_gemm_streams, in, " is not in [1, 16]");
  BB_CHECK(grouped_gemm_multi_stream_min_flops >= 0,
           "backend.grouped_gemm_multi_stream_min_flops = ", grouped_gemm_multi_stream_min_flops,
           in, " must be >= 0 (0 = every same-dtype grouped GEMM takes multi_stream)");
  check_one_of(where, "gemm_heuristics", gemm_heuristics, {"bucketed", "exact"});
  check_one_of(where, "master_storage", master_storage, {"split", "f32"});
  check_one_of(where, "grad_reduce_dtype", grad_reduce_dtype, {"f32", "bf16"});
  check_one_of(where, "fsdp_reduce", fsdp_reduce, {"micro_batch", "step"});
  BB_CHECK(max_layers_ahead >= 0 && max_layers_ahead <= 1000, "backend.max_layers_ahead = ", max_layers_ahead, in,
           " is not in [0, 1000] (0 = no limit)");
  BB_CHECK(moe_chunk_tokens >= 0, "backend.moe_chunk_tokens = ", moe_chunk_tokens, in,
           " must be >= 0 (0 = the whole micro-batch at once)");
  BB_CHECK(offload_threads >= 0 && offload_threads <= 1024, "backend.offload_threads = ", offload_threads, in,
           " is not in [0, 1024] (0 = every core but one)");
}

std::string BackendConfig::summary() const {
  std::ostringstream os;
  os << "grouped_gemm_same_dtype=" << grouped_gemm_same_dtype
     << " grouped_gemm_widening=" << grouped_gemm_widening
     << " grouped_gemm_streams=" << grouped_gemm_streams
     << " grouped_gemm_multi_stream_min_flops=" << grouped_gemm_multi_stream_min_flops
     << " grouped_gemm_threaded_enqueue=" << (grouped_gemm_threaded_enqueue ? "true" : "false")
     << " grouped_gemm_tma=" << (grouped_gemm_tma ? "true" : "false")
     << " gemm_heuristics=" << gemm_heuristics
     << " optimizer_in_backward=" << (optimizer_in_backward ? "true" : "false")
     << " master_storage=" << master_storage << " max_layers_ahead=" << max_layers_ahead
     << " expert_wgrad_stream=" << (expert_wgrad_stream ? "true" : "false")
     << " grad_reduce_dtype=" << grad_reduce_dtype << " fsdp_reduce=" << fsdp_reduce
     << " pool_cross_stream_reuse=" << (pool_cross_stream_reuse ? "true" : "false")
     << " moe_chunk_tokens=" << moe_chunk_tokens << " offload_threads=" << offload_threads
     << " cudnn_library=" << (cudnn_library.empty() ? "(default)" : cudnn_library);
  return os.str();
}

void to_json(nlohmann::json& j, const BackendConfig& c) {
  j = nlohmann::json{{"grouped_gemm_same_dtype", c.grouped_gemm_same_dtype},
                     {"grouped_gemm_widening", c.grouped_gemm_widening},
                     {"grouped_gemm_streams", c.grouped_gemm_streams},
                     {"grouped_gemm_multi_stream_min_flops", c.grouped_gemm_multi_stream_min_flops},
                     {"grouped_gemm_threaded_enqueue", c.grouped_gemm_threaded_enqueue},
                     {"grouped_gemm_tma", c.grouped_gemm_tma},
                     {"gemm_heuristics", c.gemm_heuristics},
                     {"optimizer_in_backward", c.optimizer_in_backward},
                     {"master_storage", c.master_storage},
                     {"max_layers_ahead", c.max_layers_ahead},
                     {"expert_wgrad_stream", c.expert_wgrad_stream},
                     {"grad_reduce_dtype", c.grad_reduce_dtype},
                     {"fsdp_reduce", c.fsdp_reduce},
                     {"pool_cross_stream_reuse", c.pool_cross_stream_reuse},
                     {"moe_chunk_tokens", c.moe_chunk_tokens},
                     {"offload_threads", c.offload_threads},
                     {"cudnn_library", c.cudnn_library}};
}

void from_json(const nlohmann::json& j, BackendConfig& c) {
  BB_CHECK(j.is_object(), "backend settings must be a JSON object, got ", j.dump());
  c = BackendConfig{};
  try {
    for (auto it = j.begin(); it != j.end(); ++it) {
      const std::string& k = it.key();
      if (k == "grouped_gemm_same_dtype") c.grouped_gemm_same_dtype = it->get<std::string>();
      else if (k == "grouped_gemm_widening") c.grouped_gemm_widening = it->get<std::string>();
      else if (k == "grouped_gemm_streams") c.grouped_gemm_streams = it->get<int64_t>();
      else if (k == "grouped_gemm_multi_stream_min_flops")
        c.grouped_gemm_multi_stream_min_flops = it->get<double>();
      else if (k == "grouped_gemm_threaded_enqueue") c.grouped_gemm_threaded_enqueue = it->get<bool>();
      else if (k == "grouped_gemm_tma") c.grouped_gemm_tma = it->get<bool>();
      else if (k == "gemm_heuristics") c.gemm_heuristics = it->get<std::string>();
      else if (k == "optimizer_in_backward") c.optimizer_in_backward = it->get<bool>();
      else if (k == "master_storage") c.master_storage = it->get<std::string>();
      else if (k == "max_layers_ahead") c.max_layers_ahead = it->get<int64_t>();
      else if (k == "expert_wgrad_stream") c.expert_wgrad_stream = it->get<bool>();
      else if (k == "grad_reduce_dtype") c.grad_reduce_dtype = it->get<std::string>();
      else if (k == "fsdp_reduce") c.fsdp_reduce = it->get<std::string>();
      else if (k == "pool_cross_stream_reuse") c.pool_cross_stream_reuse = it->get<bool>();
      else if (k == "moe_chunk_tokens") c.moe_chunk_tokens = it->get<int64_t>();
      else if (k == "offload_threads") c.offload_threads = it->get<int64_t>();
      else if (k == "cudnn_library") c.cudnn_library = it->get<std::string>();
      else BB_FAIL("unknown backend setting '", k, "'");
    }
  } catch (const nlohmann::json::exception& e) {
    BB_FAIL("backend settings: ", e.what());
  }
  c.validate("");
}

}  // namespace bb
