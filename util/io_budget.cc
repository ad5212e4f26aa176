#include "util/io_budget.h"

namespace dede {
namespace {
thread_local IoBudget* current_budget = nullptr;
}  // namespace

IoBudget* CurrentIoBudget() { return current_budget; }

ScopedIoBudget::ScopedIoBudget(IoBudget* budget) : prev_(current_budget) {
  current_budget = budget;
}

ScopedIoBudget::~ScopedIoBudget() { current_budget = prev_; }

}  // namespace dede
