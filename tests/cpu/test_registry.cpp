// The primitive registry: every family parses its members into typed values, unknown names are
// errors that list the registered members, and the run config reads every family through it.
#include <gtest/gtest.h>

#include <algorithm>

#include "common/testing.h"
#include "primitives/registry.h"

namespace bb {
namespace {

template <class T>
void check_family(const Family<T>& f) {
  SCOPED_TRACE(f.key());
  ASSERT_FALSE(f.members().empty());
  for (const auto& m : f.members()) {
    // A member that takes a count is written "<name>:N".
    const std::string written = m.max_count > 0 ? m.name + ":2" : m.name;
    const Choice<T> c = f.parse(written, "test");
    EXPECT_EQ(c.name, written);
    EXPECT_EQ(c.count, m.max_count > 0 ? 2 : 0);
    EXPECT_FALSE(m.what.empty()) << m.name << " has no description";
  }
  try {
    f.parse("no_such_member", "run.toml");
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("primitives." + f.key() + " = 'no_such_member' in run.toml is not registered"),
              std::string::npos) << msg;
    for (const auto& m : f.members())
      EXPECT_NE(msg.find(m.name), std::string::npos) << "the error does not list " << m.name << ": " << msg;
  }
}

TEST(Registry, EveryFamilyParsesItsMembersAndListsThemOnError) {
  check_family(loss_family());
  check_family(recompute_family());
  check_family(router_family());
  check_family(experts_family());
  check_family(permute_family());
  check_family(attention_family());
  check_family(moe_dispatch_family());
  check_family(state_family());
  check_family(optimizer_family());
}

TEST(Registry, SelectiveRecomputeTakesNamedParts) {
  const Choice<RecomputePolicy> bare = recompute_family().parse("selective", "");
  EXPECT_EQ(bare.value, RecomputePolicy::selective);
  EXPECT_EQ(bare.parts, recompute_default_parts());
  const Choice<RecomputePolicy> c = recompute_family().parse("selective:attention, norms", "");
  EXPECT_EQ(c.name, "selective:attention, norms");
  EXPECT_EQ(c.parts, (std::vector<std::string>{"attention", "norms"}));
  const RecomputeParts p = recompute_parts(c);
  EXPECT_TRUE(p.has(RecomputePart::attention));
  EXPECT_TRUE(p.has(RecomputePart::norms));
  EXPECT_FALSE(p.has(RecomputePart::moe_experts));
  EXPECT_TRUE(recompute_parts(recompute_family().parse("full", "")).empty());
  EXPECT_TRUE(recompute_parts(recompute_family().parse("none", "")).empty());
  auto error_of = [](const std::string& name) {
    try {
      recompute_family().parse(name, "run.toml");
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const std::string bad = error_of("selective:attention,norm");
  EXPECT_NE(
      bad.find(
          "primitives.recompute = 'selective:attention,norm' in run.toml: unknown part 'norm'"),
      std::string::npos)
      << bad;
  for (const std::string& part : recompute_part_names())
    EXPECT_NE(bad.find(part), std::string::npos)
        << "the error does not list " << part << ": " << bad;
  EXPECT_NE(error_of("selective:norms,norms").find("listed twice"), std::string::npos);
  EXPECT_NE(error_of("selective:").find("an empty part name"), std::string::npos);
  EXPECT_NE(error_of("selective:norms,").find("an empty part name"), std::string::npos);
  EXPECT_NE(error_of("full:norms").find("is not registered"), std::string::npos);
  PrimitiveSet s;
  s.set("recompute", "selective:moe_experts", "test");
  EXPECT_EQ(s.name_of("recompute"), "selective:moe_experts");
  EXPECT_NE(s.summary().find("recompute=selective:moe_experts"), std::string::npos) << s.summary();
}

TEST(Registry, MembersCarryTypedValues) {
  EXPECT_EQ(router_family().parse("sigmoid_topk", "").value, RouterScore::sigmoid);
  EXPECT_EQ(experts_family().parse("grouped", "").value, ExpertsImpl::grouped);
  EXPECT_EQ(permute_family().parse("memory_efficient", "").value, PermuteMode::memory_efficient);
  EXPECT_EQ(recompute_family().parse("full", "").value, RecomputePolicy::full);
  EXPECT_EQ(loss_family().parse("full_ce", "").value, &make_full_ce_head);
  // The factories build working members.
  auto head = loss_family().parse("linear_ce", "").value(LossHeadConfig{});
  ASSERT_TRUE(head);
  DispatcherConfig dc;
  dc.num_experts = 8;
  for (const char* name : {"allgather", "alltoall", "chunked_alltoall:3"}) {
    const Choice<DispatcherFactory> c = moe_dispatch_family().parse(name, "");
    dc.num_chunks = std::max<int64_t>(1, c.count);
    auto d = c.value(dc);  // one rank: every expert local
    ASSERT_TRUE(d) << name;
    EXPECT_EQ(d->num_local_experts(8), 8);
    EXPECT_EQ(d->first_local_expert(8), 0);
  }
}

TEST(Registry, CountedMembersNeedAValidCount) {
  const auto& f = moe_dispatch_family();
  EXPECT_EQ(f.parse("chunked_alltoall:4", "").count, 4);
  EXPECT_EQ(f.parse("chunked_alltoall:64", "").count, 64);
  EXPECT_NE(f.names().find("chunked_alltoall:N"), std::string::npos) << f.names();
  test::expect_error_contains([&] { f.parse("chunked_alltoall", "run.toml"); },
                              "primitives.moe_dispatch = 'chunked_alltoall' in run.toml needs a count: write "
                              "chunked_alltoall:N with N in [1, 64]");
  for (const char* bad : {"chunked_alltoall:0", "chunked_alltoall:65", "chunked_alltoall:x", "chunked_alltoall:",
                          "chunked_alltoall:-1", "chunked_alltoall:2.5"})
    test::expect_error_contains([&] { f.parse(bad, ""); }, "the count must be chunked_alltoall:N with N in [1, 64]");
  test::expect_error_contains([&] { f.parse("alltoall:2", ""); }, "is not registered");
}

TEST(Registry, PrimitiveSetDefaultsKeysAndSummary) {
  PrimitiveSet s;
  EXPECT_EQ(s.loss.name, "linear_ce");
  EXPECT_EQ(s.recompute.name, "none");
  EXPECT_EQ(s.experts.name, "sequential");
  EXPECT_EQ(PrimitiveSet::keys().size(), 10u);
  EXPECT_EQ(s.gdn_cp.value, GdnCpMode::automatic);
  for (const std::string& k : PrimitiveSet::keys()) EXPECT_FALSE(s.name_of(k).empty()) << k;
  s.set("experts", "grouped", "test");
  s.set("recompute", "full", "test");
  EXPECT_EQ(s.experts.value, ExpertsImpl::grouped);
  EXPECT_EQ(s.summary(),
            "loss=linear_ce recompute=full router=softmax_topk experts=grouped permute=standard "
            "attention=sdpa gdn_cp=auto moe_dispatch=allgather state=replicated optimizer=adamw");
  test::expect_error_contains([&] { s.set("losses", "full_ce", "test"); },
                              "unknown primitive family 'losses'");
  test::expect_error_contains([&] { s.set("router", "topk", "cfg.toml"); },
                              "registered members: softmax_topk, sigmoid_topk");
}

}  // namespace
}  // namespace bb
