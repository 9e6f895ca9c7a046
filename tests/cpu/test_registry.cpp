// The primitive registry: every family parses its members into typed values, unknown names are
// errors that list the registered members, and the run config reads every family through it.
#include <gtest/gtest.h>

#include "common/testing.h"
#include "primitives/registry.h"

namespace bb {
namespace {

template <class T>
void check_family(const Family<T>& f) {
  SCOPED_TRACE(f.key());
  ASSERT_FALSE(f.members().empty());
  for (const auto& m : f.members()) {
    const Choice<T> c = f.parse(m.name, "test");
    EXPECT_EQ(c.name, m.name);
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

TEST(Registry, MembersCarryTypedValues) {
  EXPECT_EQ(router_family().parse("sigmoid_topk", "").value, RouterScore::sigmoid);
  EXPECT_EQ(experts_family().parse("grouped", "").value, ExpertsImpl::grouped);
  EXPECT_EQ(permute_family().parse("memory_efficient", "").value, PermuteMode::memory_efficient);
  EXPECT_EQ(recompute_family().parse("full", "").value, RecomputePolicy::full);
  EXPECT_EQ(loss_family().parse("full_ce", "").value, &make_full_ce_head);
  // The factories build working members.
  auto head = loss_family().parse("linear_ce", "").value(LossHeadConfig{});
  ASSERT_TRUE(head);
  auto d = moe_dispatch_family().parse("allgather", "").value(8);
  EXPECT_EQ(d->num_local_experts(8), 8);
  EXPECT_EQ(d->first_local_expert(8), 0);
}

TEST(Registry, PrimitiveSetDefaultsKeysAndSummary) {
  PrimitiveSet s;
  EXPECT_EQ(s.loss.name, "linear_ce");
  EXPECT_EQ(s.recompute.name, "none");
  EXPECT_EQ(s.experts.name, "sequential");
  EXPECT_EQ(PrimitiveSet::keys().size(), 9u);
  for (const std::string& k : PrimitiveSet::keys()) EXPECT_FALSE(s.name_of(k).empty()) << k;
  s.set("experts", "grouped", "test");
  s.set("recompute", "full", "test");
  EXPECT_EQ(s.experts.value, ExpertsImpl::grouped);
  EXPECT_EQ(s.summary(),
            "loss=linear_ce recompute=full router=softmax_topk experts=grouped permute=standard "
            "attention=sdpa moe_dispatch=allgather state=replicated optimizer=adamw");
  test::expect_error_contains([&] { s.set("losses", "full_ce", "test"); },
                              "unknown primitive family 'losses'");
  test::expect_error_contains([&] { s.set("router", "topk", "cfg.toml"); },
                              "registered members: softmax_topk, sigmoid_topk");
}

}  // namespace
}  // namespace bb
