// params.h — a model's parameters in flat units (DESIGN.md sec. 11).
//
// Every parameter belongs to one unit, and a unit keeps all its values in one flat buffer and all
// its gradients in one flat f32 buffer; a Param's value and grad are views into them. Units are
// what the optimizer steps (as flat buckets, split by weight decay), what the global grad norm
// sums over (one sum of squares per unit), and what state sharding will gather, shard and
// reduce-scatter. The units of a decoder:
//   embed             the token embedding (and the LM head when the embeddings are tied)
//   layers.L.dense    attention, norms, router, shared expert, dense MLP of layer L
//   layers.L.experts  the routed experts of MoE layer L (E_l local experts from first_expert)
//   head              the final norm and the untied LM head
//   layers.L.dense_f32  parameters of layer L whose values stay f32 whatever the model's parameter
//                    dtype (the Gated DeltaNet A_log and dt_bias, kept fp32 as in the reference)
// Layout inside a unit: the weight-decayed parameters first, then the others, each starting at a
// multiple of kAlign elements (256 bytes in bf16: the alignment cuBLASLt's fastest kernels want);
// the padding between them stays zero (zero gradient, zero value, decay keeps it zero).
// Building is two-phase: declare units and parameters (add_unit, add), then allocate() lays out
// and allocates every unit and points the views at it.
#pragma once

#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace bb {

enum class UnitKind : uint8_t { embedding, dense, experts, head };
const char* unit_kind_name(UnitKind k);

// How a parameter maps onto Hugging Face tensor names (models/decoder.h hf_tensors).
enum class HfSplit : uint8_t {
  none,             // one tensor, the parameter's name
  gate_up,          // [2I, H]: rows [0, I) are `<prefix>gate_proj.weight`, [I, 2I) `up_proj`
  experts_gate_up,  // [E_l, 2F, H]: per expert `<prefix>{e}.gate_proj.weight` / `up_proj`
  experts_down,     // [E_l, H, F]: per expert `<prefix>{e}.down_proj.weight`
};

// How DecoderModel initialises a parameter (each from its own counter-based stream).
enum class ParamInit : uint8_t {
  normal,     // N(0, init_std): matrices, embeddings, the router, conv filters
  zeros,      // biases, zero-centred RMSNorm weights (the scale is 1 + w)
  ones,       // RMSNorm weights (the scale is w), the Gated DeltaNet dt_bias
  gdn_a_log,  // log(U(0.01, 16)): the Gated DeltaNet A_log (transformers' _init_weights)
};

struct ParamUnit;

struct Param {
  std::string name;  // Hugging Face name (fused tensors carry the fused name)
  Shape shape;
  bool decay = true;  // weight decay applies (matrices yes; norms and biases no)
  HfSplit hf = HfSplit::none;
  ParamInit init = ParamInit::normal;
  ParamUnit* unit = nullptr;
  int64_t offset = 0;  // first element in the unit's flat buffers
  Tensor value;        // view of unit->value: the model's parameter dtype, category params
  Tensor grad;         // view of unit->grad: f32, category grads
  // Lazily zeroed gradient (the routed experts' weights, whose backward can write instead of
  // add): ParamStore::zero_grad marks it stale instead of clearing it. While `grad_stale`, the
  // gradient is logically zero and its memory holds anything (NaN on the CPU, so that a read
  // that forgets it fails in tests); the block's backward writes it on its first touch of a
  // step (accumulate = false) and clears the flag. Readers of whole gradients call
  // ParamStore::materialize_grads first.
  bool lazy_zero_grad = false;
  bool grad_stale = false;
  int64_t numel() const { return shape_numel(shape); }
};

struct ParamUnit {
  int64_t index = 0;  // position among the store's units
  std::string name;
  UnitKind kind = UnitKind::dense;
  int64_t layer = -1;  // decoder layer, -1 for embed and head
  // Expert units: the global expert id of local expert 0 (Hugging Face names use it) and the
  // number of experts held. Set where experts are placed (the dispatcher); 0 and E on one rank.
  int64_t first_expert = 0, num_experts = 0;
  // The values are f32 even when the model's parameter dtype is bf16 (allocate()).
  bool f32_values = false;
  std::vector<Param*> params;  // in layout order (weight-decayed first)
  int64_t numel = 0;           // elements including the alignment padding (what sharding splits)
  int64_t decay_numel = 0;     // elements [0, decay_numel) are weight-decayed, the rest are not
  Tensor value;                // [numel] in the parameter dtype, category params
  Tensor grad;                 // [numel] f32, category grads
};

// The elements of `flat` that `p` (or the `shape` at `offset` elements into p) occupies in its
// unit, where `flat` is any [unit.numel] buffer laid out like the unit: its values, its
// gradients, the optimizer's state of the unit.
Tensor unit_slice(const Tensor& flat, const Param& p, int64_t offset, const Shape& shape);
inline Tensor unit_slice(const Tensor& flat, const Param& p) { return unit_slice(flat, p, 0, p.shape); }

// Where the parameters of a unit go in its flat buffers, given each parameter's element count
// and decay flag in declaration order: weight-decayed ones first (in order), then the others,
// each at a multiple of ParamStore::kAlign. offsets[i] is parameter i's (declaration index).
struct UnitLayout {
  std::vector<int64_t> offsets;
  int64_t numel = 0, decay_numel = 0;
};
UnitLayout lay_out_unit(const std::vector<int64_t>& numels, const std::vector<bool>& decay);

class ParamStore {
 public:
  static constexpr int64_t kAlign = 128;

  ParamStore() = default;
  ParamStore(const ParamStore&) = delete;
  ParamStore& operator=(const ParamStore&) = delete;

  ParamUnit& add_unit(const std::string& name, UnitKind kind, int64_t layer = -1,
                      bool f32_values = false);
  Param& add(ParamUnit& unit, const std::string& name, const Shape& shape, bool decay,
             HfSplit hf = HfSplit::none, ParamInit init = ParamInit::normal);
  // Lays out, allocates (zeros) and makes the views. Once; parameters cannot be added after.
  // Values are in param_dtype, except in units marked f32_values (always f32). With
  // materialize = false it only lays the units out (offsets, numel): no buffer is allocated and
  // every unit stays without values and gradients until rebind() gives it some (a sharded
  // start: the state family allocates what each rank holds, runtime/state.h).
  void allocate(Device dev, DType param_dtype, bool materialize = true);
  bool allocated() const { return allocated_; }
  // Where and in which dtype allocate() puts (or would put) unit u's values.
  Device device() const { return device_; }
  DType value_dtype(const ParamUnit& u) const { return u.f32_values ? DType::f32 : param_dtype_; }

  // Parameters in the order they were added (the checkpoint's and the initialiser's order).
  std::vector<Param*> params();
  std::vector<ParamUnit*> units();
  Param* find(const std::string& name);
  // Parameter elements, without padding.
  int64_t num_params() const;
  // Points unit `u`'s values and gradients, and its parameters' views, at other flat buffers
  // (their first u.numel elements; state sharding keeps padded or gathered buffers). An
  // undefined tensor leaves the unit without values or gradients until the next rebind: using
  // a parameter then is an error, not a read of stale memory. The old buffers are released when
  // nothing else holds them.
  void rebind(ParamUnit& u, const Tensor& value, const Tensor& grad);
  // Zeroes every unit's gradient (one memset per unit; units without gradients are skipped),
  // except units whose parameters all have lazy_zero_grad: those are marked grad_stale.
  void zero_grad();
  // Zeroes the gradients still marked stale (of unit `u`, or of every unit) and clears the flag:
  // before anything reads gradients as a whole (reductions, the norm, the optimizer, exports).
  void materialize_grads(ParamUnit* u = nullptr);

 private:
  std::deque<Param> params_;  // deque: pointers stay valid as parameters are added
  std::deque<ParamUnit> units_;
  bool allocated_ = false;
  Device device_ = Device::cpu();
  DType param_dtype_ = DType::f32;
};

}  // namespace bb
