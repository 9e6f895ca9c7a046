// registry.h — one typed choice per primitive family (DESIGN.md sec. 3), parsed once from the
// run config's [primitives] table into a PrimitiveSet that the model, the schedule and the
// trainer read; nothing downstream compares names.
//
// A family is a named list of members; each member is a name and the family's typed value: an
// enum for the families whose members are variants of one primitive (router, experts, permute,
// recompute, ...), a factory for the families with an interface (loss: LossHead; moe_dispatch:
// Dispatcher; attention: SelfAttention). Adding a member is its folder plus one line in registry.cpp; an unknown name is
// an error that lists the registered ones.
#pragma once

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "core/error.h"
#include "primitives/attention/context_parallel.h"
#include "primitives/gdn/gdn_context_parallel.h"
#include "primitives/loss/loss_head.h"
#include "primitives/moe/dispatcher.h"
#include "primitives/moe/experts.h"
#include "primitives/moe/permute.h"
#include "primitives/moe/router.h"
#include "primitives/recompute/recompute.h"

namespace bb {

enum class RecomputePolicy { none, selective, full };
enum class StateKind { replicated, zero1, fsdp };
enum class OptimizerKind { adamw, adamw_bf16_moments, adamw_offload };

// One family's member as chosen: the name (for logs and checkpoints, as written:
// "chunked_alltoall:2"), its typed value, and the count of a member that takes one.
template <class T>
struct Choice {
  std::string name;
  T value{};
  int64_t count = 0;  // N of a member named "<member>:N" (e.g. chunked_alltoall:N), else 0
  // The parts of a member written "<member>[:part,part,...]" (selective recompute), in the
  // order written; the member's default parts when written bare; else empty.
  std::vector<std::string> parts;
};

template <class T>
class Family {
 public:
  struct Member {
    std::string name;
    T value;
    std::string what;        // one line for docs and errors
    int64_t max_count = 0;   // > 0: the member is written "<name>:N" with N in [1, max_count]
  };
  // A member that takes a list of named parts: "<member>" (the default parts) or
  // "<member>:a,b,c" (each one of `valid`, no repeats).
  struct PartList {
    std::string member;
    std::vector<std::string> valid, defaults;
  };
  Family(std::string key, std::string default_name, std::vector<Member> members,
         PartList parts = {})
      : key_(std::move(key)),
        default_(std::move(default_name)),
        members_(std::move(members)),
        parts_(std::move(parts)) {}

  const std::string& key() const { return key_; }
  const std::vector<Member>& members() const { return members_; }
  // The member called `name` ("<member>:N" for one that takes a count); otherwise throws naming
  // the key (`primitives.<key>`), `where` and every registered name.
  Choice<T> parse(const std::string& name, const std::string& where) const {
    const std::string in = where.empty() ? "" : " in " + where;
    for (const Member& m : members_) {
      if (!parts_.member.empty() && m.name == parts_.member) {
        if (name == m.name) return {m.name, m.value, 0, parts_.defaults};
        if (name.rfind(m.name + ":", 0) == 0) return {name, m.value, 0, parse_parts(name, in)};
        continue;
      }
      if (m.max_count == 0) {
        if (m.name == name) return {m.name, m.value, 0, {}};
        continue;
      }
      const std::string usage = m.name + ":N with N in [1, " + std::to_string(m.max_count) + "]";
      if (name == m.name)
        BB_FAIL("primitives.", key_, " = '", name, "'", in, " needs a count: write ", usage, " (e.g. ", m.name, ":2)");
      if (name.rfind(m.name + ":", 0) != 0) continue;
      const std::string digits = name.substr(m.name.size() + 1);
      int64_t n = 0;
      bool ok = !digits.empty() && digits.size() <= 9;
      for (char ch : digits) {
        ok = ok && ch >= '0' && ch <= '9';
        if (ok) n = n * 10 + (ch - '0');
      }
      BB_CHECK(ok && n >= 1 && n <= m.max_count, "primitives.", key_, " = '", name, "'", in, ": the count must be ",
               usage);
      return {name, m.value, n, {}};
    }
    BB_FAIL("primitives.", key_, " = '", name, "'", in, " is not registered; registered members: ", names());
  }
  Choice<T> default_choice() const { return parse(default_, "the registry"); }
  std::string names() const {  // "full_ce, linear_ce"; a member with a count as "<name>:N"
    std::string s;
    for (const Member& m : members_) {
      s += (s.empty() ? "" : ", ") + m.name + (m.max_count > 0 ? ":N" : "");
      if (!parts_.member.empty() && m.name == parts_.member) s += "[:part,...]";
    }
    return s;
  }

 private:
  // The comma-separated list after "<member>:"; spaces around a name are ignored.
  std::vector<std::string> parse_parts(const std::string& name, const std::string& in) const {
    std::string valid;
    for (const std::string& v : parts_.valid) valid += (valid.empty() ? "" : ", ") + v;
    const std::string head = "primitives." + key_ + " = '" + name + "'" + in;
    std::vector<std::string> out;
    const std::string list = name.substr(parts_.member.size() + 1);
    size_t at = 0;
    while (true) {
      const size_t comma = list.find(',', at);
      std::string part =
          list.substr(at, comma == std::string::npos ? std::string::npos : comma - at);
      const size_t b = part.find_first_not_of(' '), e = part.find_last_not_of(' ');
      part = b == std::string::npos ? std::string() : part.substr(b, e - b + 1);
      BB_CHECK(!part.empty(), head, ": an empty part name; write ", parts_.member,
               ":part,part,... with parts among: ", valid);
      bool known = false;
      for (const std::string& v : parts_.valid) known = known || v == part;
      BB_CHECK(known, head, ": unknown part '", part, "'; valid parts: ", valid);
      for (const std::string& o : out)
        BB_CHECK(o != part, head, ": part '", part, "' is listed twice");
      out.push_back(part);
      if (comma == std::string::npos) break;
      at = comma + 1;
    }
    return out;
  }

  std::string key_, default_;
  std::vector<Member> members_;
  PartList parts_;
};

const Family<LossHeadFactory>& loss_family();
const Family<RecomputePolicy>& recompute_family();
const Family<RouterScore>& router_family();
const Family<ExpertsImpl>& experts_family();
const Family<PermuteMode>& permute_family();
const Family<SelfAttentionFactory>& attention_family();
const Family<GdnCpMode>& gdn_cp_family();
const Family<DispatcherFactory>& moe_dispatch_family();
const Family<StateKind>& state_family();
const Family<OptimizerKind>& optimizer_family();

// The parts selective recompute drops (empty unless the choice is `selective`).
RecomputeParts recompute_parts(const Choice<RecomputePolicy>& c);

// Every family's choice, and the loss chunk sizes. Defaults: the registry defaults and
// LossHeadConfig's chunks (the one place they are written down).
struct PrimitiveSet {
  Choice<LossHeadFactory> loss = loss_family().default_choice();
  Choice<RecomputePolicy> recompute = recompute_family().default_choice();
  Choice<RouterScore> router = router_family().default_choice();
  Choice<ExpertsImpl> experts = experts_family().default_choice();
  Choice<PermuteMode> permute = permute_family().default_choice();
  Choice<SelfAttentionFactory> attention = attention_family().default_choice();
  Choice<GdnCpMode> gdn_cp = gdn_cp_family().default_choice();
  Choice<DispatcherFactory> moe_dispatch = moe_dispatch_family().default_choice();
  Choice<StateKind> state = state_family().default_choice();
  Choice<OptimizerKind> optimizer = optimizer_family().default_choice();
  LossHeadConfig loss_chunks;
  // Router replay (RL): the MoE layers route each token to the experts the data gives
  // (MicroBatch::routing, from the rollout engine or an earlier logprobs pass) instead of their
  // own top-k; the probabilities still come from this model's router logits (skills/router-replay.md).
  bool router_replay = false;

  // Sets family `key` ("loss", "router", ...) to member `name`; throws for an unknown key or
  // name (listing the registered ones). `where` names the source in the message.
  void set(const std::string& key, const std::string& name, const std::string& where);
  // The family keys in the order of the [primitives] table.
  static const std::vector<std::string>& keys();
  // The chosen member's name of family `key`.
  const std::string& name_of(const std::string& key) const;
  // Checks the chunk sizes (> 0).
  void validate(const std::string& where) const;
  // "loss=linear_ce recompute=none ..." for logs and checkpoints.
  std::string summary() const;
};

}  // namespace bb
