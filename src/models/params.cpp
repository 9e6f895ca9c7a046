// params.cpp — flat parameter units: layout, allocation and the views (models/params.h).
#include "models/params.h"

#include <algorithm>
#include <limits>

#include "core/error.h"

namespace bb {

const char* unit_kind_name(UnitKind k) {
  switch (k) {
    case UnitKind::embedding: return "embedding";
    case UnitKind::dense: return "dense";
    case UnitKind::experts: return "experts";
    case UnitKind::head: return "head";
  }
  return "?";
}

Tensor unit_slice(const Tensor& flat, const Param& p, int64_t offset, const Shape& shape) {
  return flat.narrow(p.offset + offset, shape_numel(shape)).view(shape);
}

ParamUnit& ParamStore::add_unit(const std::string& name, UnitKind kind, int64_t layer,
                                bool f32_values) {
  BB_CHECK(!allocated_, "ParamStore: unit '", name, "' added after allocate()");
  for (const ParamUnit& u : units_)
    BB_CHECK(u.name != name, "ParamStore: unit '", name, "' added twice");
  units_.emplace_back();
  ParamUnit& u = units_.back();
  u.index = static_cast<int64_t>(units_.size()) - 1;
  u.name = name;
  u.kind = kind;
  u.layer = layer;
  u.f32_values = f32_values;
  return u;
}

Param& ParamStore::add(ParamUnit& unit, const std::string& name, const Shape& shape, bool decay,
                       HfSplit hf, ParamInit init) {
  BB_CHECK(!allocated_, "ParamStore: parameter '", name, "' added after allocate()");
  for (int64_t d : shape)
    BB_CHECK(d > 0, "ParamStore: parameter '", name, "' has shape ", shape_str(shape));
  BB_CHECK(find(name) == nullptr, "ParamStore: parameter '", name, "' added twice");
  params_.emplace_back();
  Param& p = params_.back();
  p.name = name;
  p.shape = shape;
  p.decay = decay;
  p.hf = hf;
  p.init = init;
  p.unit = &unit;
  unit.params.push_back(&p);
  return p;
}

UnitLayout lay_out_unit(const std::vector<int64_t>& numels, const std::vector<bool>& decay) {
  BB_CHECK(numels.size() == decay.size(), "lay_out_unit: one decay flag per parameter");
  auto align = [](int64_t n) { return (n + ParamStore::kAlign - 1) / ParamStore::kAlign * ParamStore::kAlign; };
  UnitLayout l;
  l.offsets.assign(numels.size(), 0);
  int64_t off = 0;
  bool seen_plain = false;
  for (int pass = 0; pass < 2; ++pass)  // the weight-decayed parameters, then the others
    for (size_t i = 0; i < numels.size(); ++i) {
      if (decay[i] != (pass == 0)) continue;
      off = align(off);
      if (pass == 1 && !seen_plain) {  // the no-decay bucket starts here
        l.decay_numel = off;
        seen_plain = true;
      }
      l.offsets[i] = off;
      off += numels[i];
    }
  l.numel = align(off);
  if (!seen_plain) l.decay_numel = l.numel;
  return l;
}

void ParamStore::allocate(Device dev, DType param_dtype, bool materialize) {
  BB_CHECK(!allocated_, "ParamStore: allocate() called twice");
  device_ = dev;
  param_dtype_ = param_dtype;
  for (ParamUnit& u : units_) {
    std::vector<int64_t> numels;
    std::vector<bool> decay;
    for (Param* p : u.params) {
      numels.push_back(p->numel());
      decay.push_back(p->decay);
    }
    const UnitLayout l = lay_out_unit(numels, decay);
    for (size_t i = 0; i < u.params.size(); ++i) u.params[i]->offset = l.offsets[i];
    u.numel = l.numel;
    u.decay_numel = l.decay_numel;
    std::vector<Param*> ordered;  // layout order
    for (Param* p : u.params)
      if (p->decay) ordered.push_back(p);
    for (Param* p : u.params)
      if (!p->decay) ordered.push_back(p);
    u.params = ordered;
    if (!materialize) continue;
    u.value = Tensor::zeros({u.numel}, u.f32_values ? DType::f32 : param_dtype, dev, MemCategory::params);
    u.grad = Tensor::zeros({u.numel}, DType::f32, dev, MemCategory::grads);
    for (Param* p : ordered) {
      p->value = unit_slice(u.value, *p);
      p->grad = unit_slice(u.grad, *p);
    }
  }
  allocated_ = true;
}

std::vector<Param*> ParamStore::params() {
  std::vector<Param*> out;
  for (Param& p : params_) out.push_back(&p);
  return out;
}

std::vector<ParamUnit*> ParamStore::units() {
  std::vector<ParamUnit*> out;
  for (ParamUnit& u : units_) out.push_back(&u);
  return out;
}

Param* ParamStore::find(const std::string& name) {
  for (Param& p : params_)
    if (p.name == name) return &p;
  return nullptr;
}

int64_t ParamStore::num_params() const {
  int64_t n = 0;
  for (const Param& p : params_) n += p.numel();
  return n;
}

void ParamStore::rebind(ParamUnit& u, const Tensor& value, const Tensor& grad) {
  BB_CHECK(allocated_, "ParamStore::rebind before allocate()");
  for (const Tensor* t : {&value, &grad})
    BB_CHECK(!t->defined() || (t->dim() == 1 && t->numel() >= u.numel), "ParamStore::rebind: unit ",
             u.name, " needs flat buffers of at least ", u.numel, " elements, got ", t->str());
  BB_CHECK(!value.defined() || u.value.dtype() == value.dtype() || !u.value.defined(),
           "ParamStore::rebind: unit ", u.name, " values must stay ", dtype_name(u.value.dtype()));
  BB_CHECK(!grad.defined() || grad.dtype() == DType::f32, "ParamStore::rebind: gradients are f32");
  u.value = value.defined() ? value.narrow(0, u.numel) : Tensor();
  u.grad = grad.defined() ? grad.narrow(0, u.numel) : Tensor();
  for (Param* p : u.params) {
    p->grad_stale = false;  // new gradient buffers hold what they were given
    p->value = u.value.defined() ? unit_slice(u.value, *p) : Tensor();
    p->grad = u.grad.defined() ? unit_slice(u.grad, *p) : Tensor();
  }
}

void ParamStore::zero_grad() {
  for (ParamUnit& u : units_) {
    if (!u.grad.defined()) continue;
    const bool lazy = !u.params.empty() &&
                      std::all_of(u.params.begin(), u.params.end(), [](const Param* p) { return p->lazy_zero_grad; });
    if (!lazy) {
      u.grad.zero_();
      for (Param* p : u.params) p->grad_stale = false;
      continue;
    }
    // The padding between the parameters is never written and stays zero.
    for (Param* p : u.params) {
      p->grad_stale = true;
      if (p->grad.device().is_cpu()) p->grad.fill_(std::numeric_limits<float>::quiet_NaN());
    }
  }
}

void ParamStore::materialize_grads(ParamUnit* only) {
  for (ParamUnit& u : units_) {
    if (only && &u != only) continue;
    for (Param* p : u.params)
      if (p->grad_stale) {
        if (p->grad.defined()) p->grad.zero_();
        p->grad_stale = false;
      }
  }
}

}  // namespace bb
