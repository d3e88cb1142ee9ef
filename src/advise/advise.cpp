// The precision advisor: measurement, cost model and choice (docs/advisor.md).
#include "mixprec/advise/advise.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <deque>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>
#include <string>

#include "mixprec/core/io.hpp"
#include "mixprec/formats/bulk.hpp"
#include "mixprec/lowp/assignment.hpp"
#include "mixprec/lowp/scaling.hpp"
#include "mixprec/core/json_read.hpp"
#include "mixprec/inspect/npy.hpp"

namespace mixprec::monitor::advisor {
namespace {

using ojson = nlohmann::ordered_json;

constexpr std::array<std::string_view, kRoles> kRoleNames = {"x", "w", "dy", "dw"};
constexpr std::array<std::string_view, kGemms> kGemmNames = {"fprop", "dgrad", "wgrad"};
constexpr std::array<std::string_view, 4> kWhenNames = {"fp4", "always", "never", "budget_share"};

// Default cost rows: dense GEMM rates and storage of a B200-class GPU (docs/advisor.md,
// "Cost model": NVIDIA's B200 datasheet, dense: BF16 2.25, FP8 4.5, FP4 9 PFLOP/s; 8 TB/s).
//   {tflops, element_bits, scale_bits (1-D), weight_scale_bits, amax_pass, quantized}
constexpr CostRow kBf16Cost{2250, 16, 0, 0, false, false};
constexpr CostRow kFp8TensorCost{4500, 8, 0, 0, false, true};
constexpr CostRow kFp8CurrentCost{4500, 8, 0, 0, true, true};
constexpr CostRow kMxfp8Cost{4500, 8, 8.0 / 32, 8.0 / 32, false, true};
constexpr CostRow kFp8BlockCost{4500, 8, 32.0 / 128, 32.0 / (128 * 128), false, true};
constexpr CostRow kNvfp4Cost{9000, 4, 8.0 / 16, 8.0 / (16 * 16), true, true};
constexpr CostRow kMxfp4Cost{9000, 4, 8.0 / 32, 8.0 / 32, false, true};

constexpr CandidateInfo kTable[] = {
    {Candidate::bf16, "bf16", std::nullopt, kBf16Cost, "bfloat16, round to nearest (not quantized)"},
    {Candidate::fp16, "fp16", std::nullopt, kBf16Cost, "float16 at the run's loss scale (gradients scaled, then unscaled)"},
    {Candidate::fp8_delayed, "fp8-delayed", lowp::Recipe::fp8_delayed, kFp8TensorCost,
     "FP8 per tensor, scale from the amax history (HYBRID: dy in E5M2)"},
    {Candidate::fp8_current, "fp8-current", lowp::Recipe::fp8_current, kFp8CurrentCost,
     "FP8 per tensor, scale from this tensor's amax (HYBRID: dy in E5M2)"},
    {Candidate::mxfp8, "mxfp8", lowp::Recipe::mxfp8, kMxfp8Cost, "E4M3 with an E8M0 scale per 32"},
    {Candidate::fp8_block, "fp8-block", lowp::Recipe::fp8_block, kFp8BlockCost,
     "E4M3 with an fp32 scale per 1x128 (weights 128x128)"},
    {Candidate::nvfp4, "nvfp4", lowp::Recipe::nvfp4, kNvfp4Cost,
     "E2M1 with an E4M3 scale per 16 (weights 16x16) and an fp32 tensor scale"},
    {Candidate::mxfp4, "mxfp4", lowp::Recipe::mxfp4, kMxfp4Cost, "E2M1 with an E8M0 scale per 32"},
};
static_assert(std::size(kTable) == kCandidates);

std::size_t idx(Candidate c) { return static_cast<std::size_t>(c); }
std::size_t idx(Role r) { return static_cast<std::size_t>(r); }
std::size_t idx(Gemm g) { return static_cast<std::size_t>(g); }

[[noreturn]] void invalid(const std::string& s) { throw std::invalid_argument(s); }

std::string fmt_g(double v, int digits = 3) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  std::ostringstream o;
  o.precision(digits);
  o << v;
  return o.str();
}

std::string percent(double f) { return fmt_g(100.0 * f) + "%"; }
// A share of `whole` with its sign: "+1.87%", "-0.3%".
std::string signed_share(double part, double whole) {
  const double v = whole > 0 ? 100.0 * part / whole : 0.0;
  std::string s(v >= 0 ? "+" : "");
  s += fmt_g(v);
  s += '%';
  return s;
}

// The amax of a sample's finite values (inf / NaN are not measured: they set no scale).
float amax_of(std::span<const float> v) {
  float m = 0.0f;
  for (float x : v) {
    const float a = std::fabs(x);
    if (a > m && std::isfinite(a)) m = a;
  }
  return m;
}

bool any_finite(std::span<const float> v) {
  return std::any_of(v.begin(), v.end(), [](float x) { return std::isfinite(x); });
}

// The pooled error from the sums: NaN when no value was finite (nothing was measured, which
// must not read as no error), inf when a finite value became inf, 0 for all-zero values.
double rel_error(const Measurement& m) {
  if (m.elements == m.nonfinite) return std::numeric_limits<double>::quiet_NaN();
  if (m.ref_sq > 0) return std::sqrt(m.err_sq / m.ref_sq);
  return m.err_sq > 0 ? std::numeric_limits<double>::infinity() : 0.0;
}

double saturated_fraction(const Measurement& m) {
  const std::uint64_t finite = m.elements - m.nonfinite;
  return finite ? static_cast<double>(m.saturated_count) / static_cast<double>(finite) : 0.0;
}

}  // namespace

std::string_view role_name(Role r) noexcept { return kRoleNames[idx(r)]; }
std::optional<Role> parse_role(std::string_view s) noexcept {
  for (std::size_t i = 0; i < kRoles; ++i)
    if (kRoleNames[i] == s) return static_cast<Role>(i);
  return std::nullopt;
}

std::string_view gemm_name(Gemm g) noexcept { return kGemmNames[idx(g)]; }

std::string_view late_switch_when_name(LateSwitchWhen w) noexcept { return kWhenNames[static_cast<std::size_t>(w)]; }
std::optional<LateSwitchWhen> parse_late_switch_when(std::string_view s) noexcept {
  for (std::size_t i = 0; i < kWhenNames.size(); ++i)
    if (kWhenNames[i] == s) return static_cast<LateSwitchWhen>(i);
  return std::nullopt;
}
std::string late_switch_when_names() { return "fp4, always, never or budget_share"; }

std::span<const CandidateInfo> candidate_table() noexcept { return kTable; }
const CandidateInfo& candidate_info(Candidate c) noexcept { return kTable[idx(c)]; }
std::string_view candidate_name(Candidate c) noexcept { return kTable[idx(c)].name; }
std::optional<Candidate> parse_candidate(std::string_view s) noexcept {
  for (const CandidateInfo& i : kTable)
    if (i.name == s) return i.candidate;
  return std::nullopt;
}
std::string candidate_names() {
  std::string s;
  for (const CandidateInfo& i : kTable) s.append(s.empty() ? "" : ", ").append(i.name);
  return s;
}

CostModel::CostModel() {
  for (const CandidateInfo& i : kTable) rows[idx(i.candidate)] = i.cost;
}

std::optional<lowp::QuantizeConfig> role_config(Candidate c, Role r) {
  const auto& info = candidate_info(c);
  if (!info.recipe) return std::nullopt;
  lowp::QuantizeConfig q;
  q.recipe = *info.recipe;
  q.element = lowp::recipe_info(q.recipe).element;
  // TE's HYBRID format (the default of DelayedScaling and Float8CurrentScaling): gradients
  // in E5M2. The block recipes' defaults are E4M3 everywhere.
  const bool gradient = r == Role::dy || r == Role::dw;
  if (gradient && (c == Candidate::fp8_delayed || c == Candidate::fp8_current)) q.element = lowp::Element::e5m2;
  q.tile_2d = r == Role::w && (c == Candidate::fp8_block || c == Candidate::nvfp4);
  return q;
}

Measurement measure(std::span<const float> values, std::size_t rows, std::size_t cols, Candidate c, Role r,
                    float loss_scale, float delayed_scale) {
  if (values.size() != rows * cols)
    invalid("measure: expected rows * cols = " + std::to_string(rows * cols) + " values, found " +
            std::to_string(values.size()));
  if (!(loss_scale > 0.0f) || !std::isfinite(loss_scale))
    invalid("loss_scale: expected a finite positive number, found " + fmt_g(loss_scale));
  Measurement m;
  m.samples = 1;
  m.elements = values.size();
  // Only the finite values are measured: an inf / NaN is quantized as a zero, so that it sets
  // no scale (a block's, the tensor's) and no amax, and is counted apart.
  std::vector<float> q(values.begin(), values.end());
  for (float& x : q)
    if (!std::isfinite(x)) x = 0.0f, ++m.nonfinite;
  m.amax = amax_of(q);
  double max_at_scale = std::numeric_limits<double>::quiet_NaN();  // the format's largest finite at the scale used
  if (c == Candidate::bf16 || c == Candidate::fp16) {
    ConvertOptions o;
    o.overflow = Overflow::ieee;
    o.subnormals = Subnormals::keep;
    RoundedStats s;
    if (c == Candidate::bf16) {
      std::vector<bf16> codes(q.size());
      s = encode_and_round_counted<bf16>(q, codes, o);
      max_at_scale = static_cast<double>(format_traits<bf16>::max_finite);
    } else {
      o.scale = loss_scale;  // fp16 holds the scaled values; q comes back divided by the scale
      std::vector<f16> codes(q.size());
      s = encode_and_round_counted<f16>(q, codes, o);
      max_at_scale = static_cast<double>(format_traits<f16>::max_finite) / static_cast<double>(loss_scale);
    }
    m.saturated_count = s.stats.overflow;
  } else {
    lowp::QuantizeConfig cfg = *role_config(c, r);
    if (c == Candidate::fp8_delayed) cfg.scale = delayed_scale;
    const lowp::Quantized qq = lowp::quantize(q, rows, cols, cfg);
    lowp::dequantize(qq, q);
    m.saturated_count = qq.counts.saturated;
    const double elem_max = lowp::max_finite(cfg.element);
    if (c == Candidate::fp8_delayed || c == Candidate::fp8_current) max_at_scale = elem_max / static_cast<double>(qq.tensor_scale);
    if (c == Candidate::nvfp4) max_at_scale = 6.0 * 448.0 / static_cast<double>(qq.tensor_scale);
  }
  for (std::size_t i = 0; i < values.size(); ++i) {
    const float x = values[i];
    if (!std::isfinite(x)) continue;  // counted above
    const double xd = x, d = static_cast<double>(q[i]) - xd;
    m.ref_sq += xd * xd;
    m.err_sq += std::isfinite(d) ? d * d : std::numeric_limits<double>::infinity();
    if (x != 0.0f) {
      ++m.nonzero;
      if (q[i] == 0.0f) ++m.flushed_count;
    }
  }
  m.rel_rms_error = rel_error(m);
  m.worst_rel_rms_error = m.rel_rms_error;
  m.saturated = saturated_fraction(m);
  m.flushed = m.nonzero ? static_cast<double>(m.flushed_count) / static_cast<double>(m.nonzero) : 0.0;
  const double amax = m.amax;  // finite
  m.headroom_log2 = std::isnan(max_at_scale) ? max_at_scale
                    : !(amax > 0)            ? std::numeric_limits<double>::infinity()
                                             : std::log2(max_at_scale / amax);
  return m;
}

namespace {

void pool(Measurement& into, const Measurement& m) {
  if (into.samples == 0) {
    into = m;
    return;
  }
  into.samples += m.samples;
  into.elements += m.elements;
  into.nonzero += m.nonzero;
  into.nonfinite += m.nonfinite;
  into.err_sq += m.err_sq;
  into.ref_sq += m.ref_sq;
  into.saturated_count += m.saturated_count;
  into.flushed_count += m.flushed_count;
  into.amax = std::max(into.amax, m.amax);
  into.worst_rel_rms_error = std::max(into.worst_rel_rms_error, m.worst_rel_rms_error);
  if (std::isnan(m.rel_rms_error)) into.worst_rel_rms_error = m.rel_rms_error;
  into.headroom_log2 = std::isnan(into.headroom_log2) ? into.headroom_log2 : std::min(into.headroom_log2, m.headroom_log2);
  into.rel_rms_error = rel_error(into);
  into.saturated = saturated_fraction(into);
  into.flushed = into.nonzero ? static_cast<double>(into.flushed_count) / static_cast<double>(into.nonzero) : 0.0;
}

// Bytes moved by one use of an operand of n elements (each operand has two: x by fprop and
// wgrad, w by fprop and dgrad, dy by dgrad and wgrad). Over a step the operand's producer
// writes it once (bf16: one copy; a quantized candidate: the rowwise and columnwise copies,
// the cast fused into the producer as Transformer Engine's cast-transpose does), an amax pass
// writes and reads the high-precision values once more, and each use reads it: a use is
// charged its read and half of the write and of the amax pass, so that the three GEMMs of a
// layer add up to the whole step and a GEMM can be costed in a candidate of its own.
double use_bytes(const CostRow& c, double n, double act_bytes, bool weight) {
  const double stored = n * (c.element_bits + (weight ? c.weight_scale_bits : c.scale_bits)) / 8.0;
  const double written = c.quantized ? 2.0 * stored : stored;
  const double amax = c.amax_pass ? 2.0 * n * act_bytes : 0.0;
  return 0.5 * (written + amax) + stored;
}

}  // namespace

double gemm_cost(const CostModel& m, Candidate c, Gemm g, std::size_t tokens, std::size_t in, std::size_t out) {
  const CostRow& row = m.rows[idx(c)];
  const double T = static_cast<double>(tokens), K = static_cast<double>(in), N = static_cast<double>(out);
  const double act = m.activation_bits / 8.0;
  // 2 T K N FLOPs at the candidate's rate, plus at the bandwidth the bytes of the GEMM's two
  // operand uses (x [T, K], w [N, K], dy [T, N]) and of its output (y, dx in the activation
  // format; dW in fp32).
  double bytes = 0;
  switch (g) {
    case Gemm::fprop: bytes = use_bytes(row, T * K, act, false) + use_bytes(row, N * K, act, true) + T * N * act; break;
    case Gemm::dgrad: bytes = use_bytes(row, T * N, act, false) + use_bytes(row, N * K, act, true) + T * K * act; break;
    case Gemm::wgrad: bytes = use_bytes(row, T * K, act, false) + use_bytes(row, T * N, act, false) + N * K * 4.0; break;
  }
  return 2.0 * T * K * N / (row.tflops * 1e12) + bytes / (m.bandwidth_gbs * 1e9);
}

double layer_cost(const CostModel& m, Candidate c, std::size_t tokens, std::size_t in, std::size_t out) {
  // Forward plus backward, summed as the directional proposal sums a pair, so that the pair
  // of one candidate costs exactly its layer_cost.
  return gemm_cost(m, c, Gemm::fprop, tokens, in, out) +
         (gemm_cost(m, c, Gemm::dgrad, tokens, in, out) + gemm_cost(m, c, Gemm::wgrad, tokens, in, out));
}

// ---- advise -------------------------------------------------------------------------------

namespace {

bool within(const Budget& b, Role r, const Measurement& m, std::string& why) {
  const double bound = b.max_rel_rms_error[idx(r)];
  const std::string name(role_name(r));
  if (!(m.rel_rms_error <= bound)) {
    why = name + " error " + fmt_g(m.rel_rms_error) + " > " + fmt_g(bound);
    return false;
  }
  if (!(m.saturated <= b.max_saturated)) {
    why = name + " saturated " + percent(m.saturated) + " > " + percent(b.max_saturated);
    return false;
  }
  if (!(m.flushed <= b.max_flushed)) {
    why = name + " flushed " + percent(m.flushed) + " > " + percent(b.max_flushed);
    return false;
  }
  return true;
}

std::vector<Candidate> configured(const AdviseConfig& c) {
  std::vector<Candidate> out;
  for (const CandidateInfo& i : kTable)
    if (c.candidates.empty() || std::find(c.candidates.begin(), c.candidates.end(), i.candidate) != c.candidates.end())
      out.push_back(i.candidate);
  return out;
}

void choose(LayerAdvice& L, const Advice& a) {
  const Budget& b = a.config.budget;
  std::vector<Candidate> order = a.candidates;
  std::stable_sort(order.begin(), order.end(), [&](Candidate p, Candidate q) { return L.cost[idx(p)] < L.cost[idx(q)]; });
  std::string missing, unmeasured;
  for (std::size_t r = 0; r < kRoles; ++r) {
    if (!b.roles[r] || L.sampled[r]) continue;
    if (L.unmeasured[r] == 0) {
      missing.append(missing.empty() ? "" : ", ").append(kRoleNames[r]);
    } else {
      unmeasured.append(unmeasured.empty() ? "" : ", ")
          .append(kRoleNames[r])
          .append(" (")
          .append(std::to_string(L.unmeasured[r]))
          .append(L.unmeasured[r] == 1 ? " sample" : " samples")
          .append(", every value inf or NaN)");
    }
  }
  if (!unmeasured.empty() || !missing.empty()) {
    L.reason = "no recommendation:";
    if (!unmeasured.empty())
      L.reason += " not measured: " + unmeasured + "; a sampled step with finite values measures it";
    if (!missing.empty())
      L.reason += std::string(unmeasured.empty() ? "" : ";") + " the budget requires " + missing + ", which had no samples";
    return;
  }
  // Values left out of a measurement are said: the choice rests on the finite ones.
  std::string left_out;
  for (std::size_t r = 0; r < kRoles; ++r) {
    if (!L.sampled[r] || a.candidates.empty()) continue;
    const Measurement& m = L.measurements[idx(a.candidates.front())][r];
    if (m.nonfinite == 0) continue;
    left_out.append("; ")
        .append(kRoleNames[r])
        .append(": ")
        .append(std::to_string(m.nonfinite))
        .append(" inf/NaN of ")
        .append(std::to_string(m.elements))
        .append(" values left out");
  }
  const double bf16_cost = L.cost[idx(Candidate::bf16)];
  for (Candidate c : order) {
    std::string why, all;
    bool ok = true;
    for (std::size_t r = 0; r < kRoles && ok; ++r)
      if (b.roles[r]) ok = within(b, static_cast<Role>(r), L.measurements[idx(c)][r], why);
    if (!ok) {
      L.rejected.push_back(std::string(candidate_name(c)) + ": " + why);
      continue;
    }
    L.chosen = c;
    std::string errs;
    for (std::size_t r = 0; r < kRoles; ++r)
      if (b.roles[r])
        errs.append(errs.empty() ? "" : ", ")
            .append(kRoleNames[r])
            .append(" ")
            .append(fmt_g(L.measurements[idx(c)][r].rel_rms_error))
            .append(" <= ")
            .append(fmt_g(b.max_rel_rms_error[r]));
    L.reason = std::string(candidate_name(c)) + ": the cheapest candidate within the budget (error " + errs +
               "), modeled cost " + fmt_g(bf16_cost > 0 ? L.cost[idx(c)] / bf16_cost : 1.0) + "x bf16's" +
               (L.rejected.empty() ? "" : "; " + std::to_string(L.rejected.size()) + " cheaper rejected") + left_out;
    return;
  }
  L.reason = "no candidate within the budget: kept unquantized (\"bf16\" in the recipe file)" + left_out;
}

// ---- per GEMM direction and in time -------------------------------------------------------

bool forward_role(std::size_t r) { return r == idx(Role::x) || r == idx(Role::w); }

// Within the budget for one direction: the forward on its required roles among x and w (what
// fprop reads), the backward on every required role (dy, and the x and w that dgrad and wgrad
// read: the same measurements as the forward's).
bool within_direction(const Budget& b, const LayerAdvice& L, Candidate c, bool forward, std::string& why) {
  for (std::size_t r = 0; r < kRoles; ++r) {
    if (!b.roles[r] || (forward && !forward_role(r))) continue;
    if (!within(b, static_cast<Role>(r), L.measurements[idx(c)][r], why)) return false;
  }
  return true;
}

// "x 0.095 <= 0.1, w 0.11 <= 0.125": the candidate's errors on the required roles of a direction.
std::string direction_errors(const Budget& b, const LayerAdvice& L, Candidate c, bool forward) {
  std::string errs;
  for (std::size_t r = 0; r < kRoles; ++r)
    if (b.roles[r] && (!forward || forward_role(r)))
      errs.append(errs.empty() ? "" : ", ")
          .append(kRoleNames[r])
          .append(" ")
          .append(fmt_g(L.measurements[idx(c)][r].rel_rms_error))
          .append(" <= ")
          .append(fmt_g(b.max_rel_rms_error[r]));
  return errs;
}

double forward_cost(const LayerAdvice& L, Candidate c) { return L.gemm_cost[idx(c)][idx(Gemm::fprop)]; }
double backward_cost(const LayerAdvice& L, Candidate c) {
  return L.gemm_cost[idx(c)][idx(Gemm::dgrad)] + L.gemm_cost[idx(c)][idx(Gemm::wgrad)];
}

// The recipe-file entry of a pair: fprop in the forward's recipe, dgrad and wgrad (all four
// of their operands) in the backward's; bf16 and fp16 are high precision. One candidate: its
// plain entry. Both wgrad operands share the backward's recipe, so RHT is on both or neither.
lowp::RecipeChoice pair_choice(Candidate f, Candidate b) {
  const std::optional<lowp::Recipe> rf = candidate_info(f).recipe, rb = candidate_info(b).recipe;
  lowp::RecipeChoice c = lowp::RecipeChoice::of(rf);
  if (rf == rb) return c;
  for (const lowp::Operand o : {lowp::Operand::dgrad_dy, lowp::Operand::dgrad_w, lowp::Operand::wgrad_x, lowp::Operand::wgrad_dy}) {
    c.operand_ids.push_back(o);
    c.operand_choices.push_back(lowp::RecipeChoice::of(rb));
  }
  return c;
}

void set_pair(DirectionAdvice& D, const LayerAdvice& L, Candidate f, Candidate b) {
  D.forward = f;
  D.backward = b;
  D.cost_forward = forward_cost(L, f);
  D.cost_backward = backward_cost(L, b);
  D.saving = L.chosen ? L.cost[idx(*L.chosen)] - D.cost() : 0.0;
}

// The directional proposal (docs/advisor.md, "Per GEMM direction and in time"): among the
// pairs (forward within the forward's budget, backward within the backward's), the cheapest
// that lowp::plan accepts; on equal costs the single choice's pair first, then table order.
void choose_directions(LayerAdvice& L, const Advice& a) {
  DirectionAdvice& D = L.directions;
  D = DirectionAdvice{};
  if (!L.chosen) {
    // The backward's budget is the single choice's: nothing within it (or a required role not
    // measured) leaves no pair either.
    D.reason = "no proposal: " + L.reason;
    return;
  }
  const Candidate single = *L.chosen;
  const double bf16_cost = L.cost[idx(Candidate::bf16)];
  if (!a.config.directions) {
    set_pair(D, L, single, single);
    D.reason = std::string(candidate_name(single)) + " in both directions (directions: false)";
    return;
  }
  const Budget& b = a.config.budget;
  std::vector<Candidate> fwd, bwd;
  std::array<std::string, kCandidates> why_fwd, why_bwd;
  for (Candidate c : a.candidates) {
    if (within_direction(b, L, c, true, why_fwd[idx(c)])) fwd.push_back(c);
    if (within_direction(b, L, c, false, why_bwd[idx(c)])) bwd.push_back(c);
  }
  struct Pair {
    Candidate f, b;
    double cost;
  };
  std::vector<Pair> pairs;
  for (Candidate f : fwd)
    for (Candidate k : bwd) pairs.push_back({f, k, forward_cost(L, f) + backward_cost(L, k)});
  std::stable_sort(pairs.begin(), pairs.end(), [](const Pair& p, const Pair& q) {
    if (p.cost != q.cost) return p.cost < q.cost;
    return (p.f == p.b) > (q.f == q.b);
  });
  std::vector<std::string> refused;
  for (const Pair& p : pairs) {
    try {
      (void)lowp::plan(pair_choice(p.f, p.b));
    } catch (const std::invalid_argument& e) {
      refused.push_back(std::string(candidate_name(p.f)) + " / " + std::string(candidate_name(p.b)) + ": " + e.what());
      continue;
    }
    set_pair(D, L, p.f, p.b);
    break;
  }
  if (!D.proposed()) {  // not reached: the single choice's pair is within both budgets and valid
    D.reason = "no proposal: every pair within the budget was refused by the plan rules";
    D.rejected = refused;
    return;
  }
  // What was cheaper and why not: per direction beyond the budget, then the refused pairs.
  auto cheaper = [&](bool forward) {
    std::vector<Candidate> v;
    const double have = forward ? D.cost_forward : D.cost_backward;
    for (Candidate c : a.candidates) {
      const double cost = forward ? forward_cost(L, c) : backward_cost(L, c);
      if (!(forward ? why_fwd : why_bwd)[idx(c)].empty() && cost < have) v.push_back(c);
    }
    std::stable_sort(v.begin(), v.end(), [&](Candidate p, Candidate q) {
      return forward ? forward_cost(L, p) < forward_cost(L, q) : backward_cost(L, p) < backward_cost(L, q);
    });
    for (Candidate c : v)
      D.rejected.push_back(std::string(forward ? "forward " : "backward ") + std::string(candidate_name(c)) + ": " +
                           (forward ? why_fwd : why_bwd)[idx(c)]);
  };
  cheaper(true);
  cheaper(false);
  D.rejected.insert(D.rejected.end(), refused.begin(), refused.end());
  const std::string refused_note =
      refused.empty() ? "" : "; " + std::to_string(refused.size()) + " cheaper pair" + (refused.size() == 1 ? "" : "s") +
                                 " refused by the plan rules";
  if (*D.forward == single && *D.backward == single) {
    D.reason = std::string(candidate_name(single)) + " in both directions: no cheaper split within the budget" + refused_note;
    return;
  }
  const double single_cost = L.cost[idx(single)];
  D.reason = "forward " + std::string(candidate_name(*D.forward)) + " (" + direction_errors(b, L, *D.forward, true) +
             "), backward " + std::string(candidate_name(*D.backward)) + " (" + direction_errors(b, L, *D.backward, false) +
             "): modeled cost " + fmt_g(single_cost > 0 ? D.cost() / single_cost : 1.0) + "x the single choice " +
             std::string(candidate_name(single)) + "'s, " + fmt_g(bf16_cost > 0 ? D.cost() / bf16_cost : 1.0) +
             "x bf16's" + refused_note;
}

// The late forward switch of a layer with a proposal, where the rule asks for it; the reason
// is completed with the run's share once every layer is costed.
std::optional<LateSwitchAdvice> late_switch_of(const LayerAdvice& L, const AdviseConfig& config) {
  const DirectionAdvice& D = L.directions;
  const LateForwardSwitch& s = config.late_forward_switch;
  if (!D.proposed() || !candidate_info(*D.forward).recipe || s.when == LateSwitchWhen::never) return std::nullopt;
  const Candidate f = *D.forward;
  const Budget& b = config.budget;
  std::string rule;
  if (s.when == LateSwitchWhen::fp4) {
    if (f != Candidate::nvfp4 && f != Candidate::mxfp4) return std::nullopt;
    rule = "when fp4: an fp4 forward";
  } else if (s.when == LateSwitchWhen::always) {
    rule = "when always: a quantized forward";
  } else {
    bool over = false;
    for (std::size_t r = 0; r < kRoles; ++r)
      if (b.roles[r] && forward_role(r) && L.measurements[idx(f)][r].rel_rms_error > s.budget_share * b.max_rel_rms_error[r])
        over = true;
    if (!over) return std::nullopt;
    rule = "when budget_share: a forward error above " + percent(s.budget_share) + " of its bound";
  }
  LateSwitchAdvice out;
  out.from_fraction = s.from_fraction;
  const double bf16_fprop = gemm_cost(config.cost, Candidate::bf16, Gemm::fprop, L.tokens, L.in, L.out);
  out.extra_cost = (1.0 - s.from_fraction) * (bf16_fprop - D.cost_forward);
  std::string evidence;
  for (std::size_t r = 0; r < kRoles; ++r) {
    if (!b.roles[r] || !forward_role(r)) continue;
    const double e = L.measurements[idx(f)][r].rel_rms_error, bound = b.max_rel_rms_error[r];
    evidence.append(evidence.empty() ? "" : ", ").append(kRoleNames[r]).append(" error ").append(fmt_g(e));
    evidence.append(bound > 0 ? " (" + percent(e / bound) + " of its bound " + fmt_g(bound) + ")" : " (bound 0)");
  }
  out.reason = "fprop " + std::string(candidate_name(f)) + " to bf16 from " + percent(s.from_fraction) + " of the run (" +
               rule + "; " + (evidence.empty() ? std::string("no forward role required") : evidence) + ")";
  return out;
}

}  // namespace

Advice advise(std::span<const SampleView> samples, const AdviseConfig& config) {
  Advice a;
  a.config = config;
  a.candidates = configured(config);
  if (config.amax_history_len == 0) invalid("amax_history_len: expected >= 1, found 0");
  if (config.margin < -64 || config.margin > 64) invalid("margin: expected an integer in [-64, 64], found " + std::to_string(config.margin));
  const LateForwardSwitch& ls = config.late_forward_switch;
  if (!(ls.from_fraction >= 0 && ls.from_fraction < 1))
    invalid("late_forward_switch.from_fraction: expected a number in [0, 1), found " + fmt_g(ls.from_fraction));
  if (!(ls.budget_share >= 0 && ls.budget_share <= 1))
    invalid("late_forward_switch.budget_share: expected a number in [0, 1], found " + fmt_g(ls.budget_share));
  if (static_cast<std::size_t>(ls.when) >= kWhenNames.size())
    invalid("late_forward_switch.when: expected " + late_switch_when_names() + ", found enum value " +
            std::to_string(static_cast<int>(ls.when)));
  // Group by layer (first-seen order) and role, in step order.
  std::map<std::string, std::size_t, std::less<>> index;
  std::vector<std::array<std::vector<const SampleView*>, kRoles>> groups;
  std::vector<std::uint64_t> steps;
  for (const SampleView& s : samples) {
    if (s.values.size() != s.rows * s.cols)
      invalid("sample " + std::string(s.layer) + "." + std::string(role_name(s.role)) + " at step " + std::to_string(s.step) +
              ": expected rows * cols = " + std::to_string(s.rows * s.cols) + " values, found " + std::to_string(s.values.size()));
    if (s.layer.empty()) invalid("sample at step " + std::to_string(s.step) + ": expected a layer name, found an empty one");
    auto it = index.find(s.layer);
    if (it == index.end()) {
      it = index.emplace(std::string(s.layer), groups.size()).first;
      groups.emplace_back();
      a.layers.emplace_back();
      a.layers.back().layer = std::string(s.layer);
    }
    groups[it->second][idx(s.role)].push_back(&s);
    steps.push_back(s.step);
  }
  std::sort(steps.begin(), steps.end());
  steps.erase(std::unique(steps.begin(), steps.end()), steps.end());
  a.steps = steps.size();
  if (!steps.empty()) a.first_step = steps.front(), a.last_step = steps.back();

  for (std::size_t l = 0; l < a.layers.size(); ++l) {
    LayerAdvice& L = a.layers[l];
    auto& g = groups[l];
    auto where = [&](Role r) { return "layer " + L.layer + ", " + std::string(role_name(r)); };
    for (auto& v : g) std::stable_sort(v.begin(), v.end(), [](auto* p, auto* q) { return p->step < q->step; });
    // Shapes: w is [out, in]; x [tokens, in]; dy [tokens, out]; dW [out, in].
    if (g[idx(Role::w)].empty()) invalid(where(Role::w) + ": expected samples of the weight (its shape), found none");
    if (g[idx(Role::x)].empty()) invalid(where(Role::x) + ": expected samples of the input (its tokens), found none");
    L.out = g[idx(Role::w)].front()->rows;
    L.in = g[idx(Role::w)].front()->cols;
    for (std::size_t r = 0; r < kRoles; ++r) {
      const auto role = static_cast<Role>(r);
      const std::size_t want = role == Role::dy ? L.out : L.in;
      for (const SampleView* s : g[r]) {
        if (s->cols != want)
          invalid(where(role) + " at step " + std::to_string(s->step) + ": expected " + std::to_string(want) +
                  " columns, found " + std::to_string(s->cols));
        if ((role == Role::w || role == Role::dw) && s->rows != L.out)
          invalid(where(role) + " at step " + std::to_string(s->step) + ": expected " + std::to_string(L.out) +
                  " rows, found " + std::to_string(s->rows));
        if (role == Role::x) L.tokens = std::max(L.tokens, s->rows_total ? s->rows_total : s->rows);
      }
    }
    // A sample without a finite value is not a measurement (every dy of a step whose gradients
    // overflowed, a diverged weight): left out, counted; its shape still counts above.
    for (std::size_t r = 0; r < kRoles; ++r) {
      const auto kept = std::remove_if(g[r].begin(), g[r].end(), [](const SampleView* s) { return !any_finite(s->values); });
      L.unmeasured[r] = static_cast<std::uint64_t>(g[r].end() - kept);
      g[r].erase(kept, g[r].end());
      L.sampled[r] = !g[r].empty();
    }
    for (Candidate c : a.candidates) {
      L.cost[idx(c)] = layer_cost(config.cost, c, L.tokens, L.in, L.out);
      for (std::size_t k = 0; k < kGemms; ++k) L.gemm_cost[idx(c)][k] = gemm_cost(config.cost, c, static_cast<Gemm>(k), L.tokens, L.in, L.out);
      for (std::size_t r = 0; r < kRoles; ++r) {
        const auto role = static_cast<Role>(r);
        std::deque<float> history;  // fp8-delayed: the earlier samples' amaxes, newest first
        float scale = 1.0f;
        const float fp8_max = c == Candidate::fp8_delayed ? lowp::max_finite(role_config(c, role)->element) : 0.0f;
        Measurement pooled;
        for (const SampleView* s : g[r]) {
          if (c == Candidate::fp8_delayed) {
            float amax = history.empty() ? amax_of(s->values) : 0.0f;
            for (float h : history) amax = std::max(amax, h);
            scale = lowp::delayed_scale(amax, scale, fp8_max, config.margin);
          }
          const Measurement m = measure(s->values, s->rows, s->cols, c, role, s->loss_scale, scale);
          pool(pooled, m);
          if (c == Candidate::fp8_delayed) {
            history.push_front(m.amax);
            if (history.size() > config.amax_history_len) history.pop_back();
          }
        }
        L.measurements[idx(c)][r] = pooled;
      }
    }
    choose(L, a);
    choose_directions(L, a);
    const double bf16 = layer_cost(config.cost, Candidate::bf16, L.tokens, L.in, L.out);
    a.cost_bf16 += bf16;
    a.cost_chosen += L.chosen ? L.cost[idx(*L.chosen)] : bf16;
    a.cost_directional += L.directions.proposed() ? L.directions.cost() : bf16;
  }
  // The late forward switch, its extra cost against the run's (the directional proposal's).
  for (LayerAdvice& L : a.layers) {
    L.late_switch = late_switch_of(L, config);
    if (!L.late_switch) continue;
    a.cost_late_switch += L.late_switch->extra_cost;
    L.late_switch->reason += ": extra modeled cost " + signed_share(L.late_switch->extra_cost, a.cost_directional) +
                             " of the run's (fprop in bf16 for the last " + percent(1.0 - config.late_forward_switch.from_fraction) + ")";
  }
  return a;
}

// ---- configuration ------------------------------------------------------------------------

namespace {

double number(const ojson& j, const std::string& where, double lo, double hi) {
  if (!j.is_number()) invalid(where + ": expected a number, found " + j.dump());
  const double v = j.get<double>();
  if (!(v >= lo && v <= hi)) invalid(where + ": expected a number in [" + fmt_g(lo, 6) + ", " + fmt_g(hi, 6) + "], found " + j.dump());
  return v;
}

void only_keys(const ojson& j, const std::string& where, std::initializer_list<std::string_view> keys) {
  if (!j.is_object()) invalid(where + ": expected an object, found " + j.dump());
  for (const auto& [k, v] : j.items()) {
    if (std::find(keys.begin(), keys.end(), k) == keys.end()) {
      std::string allowed;
      for (auto key : keys) allowed.append(allowed.empty() ? "" : ", ").append(key);
      invalid(where + ": unknown key '" + k + "'; expected one of " + allowed);
    }
  }
}

Candidate candidate_of(const ojson& j, const std::string& where) {
  if (!j.is_string()) invalid(where + ": expected a candidate name, found " + j.dump());
  const auto c = parse_candidate(j.get<std::string>());
  if (!c) invalid(where + ": expected one of " + candidate_names() + ", found '" + j.get<std::string>() + "'");
  return *c;
}

}  // namespace

AdviseConfig parse_config(std::string_view text, std::string_view source) {
  const ojson j = io::parse_ordered_json(text, source);
  const std::string src(source);
  only_keys(j, src, {"candidates", "budget", "cost", "amax_history_len", "margin", "directions", "late_forward_switch"});
  AdviseConfig c;
  if (j.contains("candidates")) {
    const ojson& l = j["candidates"];
    if (!l.is_array() || l.empty()) invalid(src + ": candidates: expected a non-empty list of names, found " + l.dump());
    for (std::size_t i = 0; i < l.size(); ++i) {
      const Candidate k = candidate_of(l[i], src + ": candidates[" + std::to_string(i) + "]");
      if (std::find(c.candidates.begin(), c.candidates.end(), k) != c.candidates.end())
        invalid(src + ": candidates: '" + std::string(candidate_name(k)) + "' given twice");
      c.candidates.push_back(k);
    }
  }
  if (j.contains("budget")) {
    const ojson& b = j["budget"];
    const std::string w = src + ": budget";
    if (b.is_number()) {
      c.budget.max_rel_rms_error.fill(number(b, w, 0, 1e300));
    } else {
      only_keys(b, w, {"max_rel_rms_error", "x", "w", "dy", "dw", "max_saturated", "max_flushed", "roles"});
      if (b.contains("max_rel_rms_error")) c.budget.max_rel_rms_error.fill(number(b["max_rel_rms_error"], w + ".max_rel_rms_error", 0, 1e300));
      for (std::size_t r = 0; r < kRoles; ++r) {
        const std::string k(kRoleNames[r]);
        if (b.contains(k)) c.budget.max_rel_rms_error[r] = number(b[k], w + "." + k, 0, 1e300);
      }
      if (b.contains("max_saturated")) c.budget.max_saturated = number(b["max_saturated"], w + ".max_saturated", 0, 1);
      if (b.contains("max_flushed")) c.budget.max_flushed = number(b["max_flushed"], w + ".max_flushed", 0, 1);
      if (b.contains("roles")) {
        const ojson& rl = b["roles"];
        if (!rl.is_array() || rl.empty()) invalid(w + ".roles: expected a non-empty list of x, w, dy, dw, found " + rl.dump());
        c.budget.roles.fill(false);
        for (const ojson& e : rl) {
          const auto r = e.is_string() ? parse_role(e.get<std::string>()) : std::nullopt;
          if (!r) invalid(w + ".roles: expected x, w, dy or dw, found " + e.dump());
          c.budget.roles[idx(*r)] = true;
        }
      }
    }
  }
  if (j.contains("cost")) {
    const ojson& m = j["cost"];
    const std::string w = src + ": cost";
    only_keys(m, w, {"bandwidth_gbs", "activation_bits", "candidates"});
    if (m.contains("bandwidth_gbs")) c.cost.bandwidth_gbs = number(m["bandwidth_gbs"], w + ".bandwidth_gbs", 1e-9, 1e12);
    if (m.contains("activation_bits")) c.cost.activation_bits = number(m["activation_bits"], w + ".activation_bits", 1, 64);
    if (m.contains("candidates")) {
      const ojson& cs = m["candidates"];
      if (!cs.is_object()) invalid(w + ".candidates: expected an object {name: {tflops, ...}}, found " + cs.dump());
      for (const auto& [name, row] : cs.items()) {
        const std::string rw = w + ".candidates." + name;
        const Candidate k = candidate_of(ojson(name), w + ".candidates");
        only_keys(row, rw, {"tflops", "element_bits", "scale_bits", "weight_scale_bits", "amax_pass", "quantized"});
        CostRow& cr = c.cost.rows[idx(k)];
        if (row.contains("tflops")) cr.tflops = number(row["tflops"], rw + ".tflops", 1e-9, 1e12);
        if (row.contains("element_bits")) cr.element_bits = number(row["element_bits"], rw + ".element_bits", 0, 64);
        if (row.contains("scale_bits")) cr.scale_bits = number(row["scale_bits"], rw + ".scale_bits", 0, 64);
        if (row.contains("weight_scale_bits")) cr.weight_scale_bits = number(row["weight_scale_bits"], rw + ".weight_scale_bits", 0, 64);
        for (const char* flag : {"amax_pass", "quantized"}) {
          if (!row.contains(flag)) continue;
          if (!row[flag].is_boolean()) invalid(rw + "." + flag + ": expected true or false, found " + row[flag].dump());
          (std::string_view(flag) == "amax_pass" ? cr.amax_pass : cr.quantized) = row[flag].get<bool>();
        }
      }
    }
  }
  if (j.contains("amax_history_len")) c.amax_history_len = static_cast<std::size_t>(number(j["amax_history_len"], src + ": amax_history_len", 1, 1 << 20));
  if (j.contains("amax_history_len") && !j["amax_history_len"].is_number_integer())
    invalid(src + ": amax_history_len: expected an integer, found " + j["amax_history_len"].dump());
  if (j.contains("margin")) {
    if (!j["margin"].is_number_integer()) invalid(src + ": margin: expected an integer in [-64, 64], found " + j["margin"].dump());
    c.margin = static_cast<int>(number(j["margin"], src + ": margin", -64, 64));
  }
  if (j.contains("directions")) {
    if (!j["directions"].is_boolean()) invalid(src + ": directions: expected true or false, found " + j["directions"].dump());
    c.directions = j["directions"].get<bool>();
  }
  if (j.contains("late_forward_switch")) {
    const ojson& l = j["late_forward_switch"];
    const std::string w = src + ": late_forward_switch";
    only_keys(l, w, {"from_fraction", "when", "budget_share"});
    LateForwardSwitch& s = c.late_forward_switch;
    if (l.contains("from_fraction")) {
      // The recipe file's phase covers the last (1 - f) of the run: f = 1 covers nothing.
      const ojson& v = l["from_fraction"];
      if (!v.is_number() || !(v.get<double>() >= 0 && v.get<double>() < 1))
        invalid(w + ".from_fraction: expected a number in [0, 1), found " + v.dump());
      s.from_fraction = v.get<double>();
    }
    if (l.contains("when")) {
      const ojson& v = l["when"];
      const auto when = v.is_string() ? parse_late_switch_when(v.get<std::string>()) : std::nullopt;
      if (!when) invalid(w + ".when: expected " + late_switch_when_names() + ", found " + v.dump());
      s.when = *when;
    }
    if (l.contains("budget_share")) {
      if (s.when != LateSwitchWhen::budget_share)
        invalid(w + ".budget_share: applies only with when \"budget_share\", found when \"" +
                std::string(late_switch_when_name(s.when)) + "\"");
      s.budget_share = number(l["budget_share"], w + ".budget_share", 0, 1);
    }
  }
  return c;
}

namespace {

ojson cost_row_json(const CostRow& r) {
  return ojson{{"tflops", r.tflops}, {"element_bits", r.element_bits}, {"scale_bits", r.scale_bits},
               {"weight_scale_bits", r.weight_scale_bits}, {"amax_pass", r.amax_pass}, {"quantized", r.quantized}};
}

ojson config_obj(const AdviseConfig& c) {
  ojson j;
  ojson cands = ojson::array();
  for (Candidate k : configured(c)) cands.push_back(std::string(candidate_name(k)));
  j["candidates"] = cands;
  ojson b;
  for (std::size_t r = 0; r < kRoles; ++r) b[std::string(kRoleNames[r])] = c.budget.max_rel_rms_error[r];
  b["max_saturated"] = c.budget.max_saturated;
  b["max_flushed"] = c.budget.max_flushed;
  ojson roles = ojson::array();
  for (std::size_t r = 0; r < kRoles; ++r)
    if (c.budget.roles[r]) roles.push_back(std::string(kRoleNames[r]));
  b["roles"] = roles;
  j["budget"] = b;
  ojson m;
  m["bandwidth_gbs"] = c.cost.bandwidth_gbs;
  m["activation_bits"] = c.cost.activation_bits;
  ojson rows;
  for (const CandidateInfo& i : kTable) rows[std::string(i.name)] = cost_row_json(c.cost.rows[idx(i.candidate)]);
  m["candidates"] = rows;
  j["cost"] = m;
  j["amax_history_len"] = c.amax_history_len;
  j["margin"] = c.margin;
  j["directions"] = c.directions;
  ojson ls;
  ls["from_fraction"] = c.late_forward_switch.from_fraction;
  ls["when"] = std::string(late_switch_when_name(c.late_forward_switch.when));
  if (c.late_forward_switch.when == LateSwitchWhen::budget_share) ls["budget_share"] = c.late_forward_switch.budget_share;
  j["late_forward_switch"] = ls;
  return j;
}

// Non-finite numbers as strings (JSON has none): "inf", "-inf", "nan".
ojson num(double v) {
  if (std::isfinite(v)) return v;
  return fmt_g(v);
}
double num_of(const ojson& j, const std::string& where) {
  if (j.is_number()) return j.get<double>();
  if (j.is_string()) {
    const std::string s = j.get<std::string>();
    if (s == "inf") return std::numeric_limits<double>::infinity();
    if (s == "-inf") return -std::numeric_limits<double>::infinity();
    if (s == "nan") return std::numeric_limits<double>::quiet_NaN();
  }
  invalid(where + ": expected a number, \"inf\", \"-inf\" or \"nan\", found " + j.dump());
}
std::uint64_t count_of(const ojson& j, const std::string& where) {
  if (!j.is_number_unsigned()) invalid(where + ": expected an integer >= 0, found " + j.dump());
  return j.get<std::uint64_t>();
}
const ojson& field(const ojson& j, const char* key, const std::string& where) {
  if (!j.is_object() || !j.contains(key)) invalid(where + ": expected a field '" + key + "'");
  return j[key];
}

}  // namespace

std::string config_json(const AdviseConfig& c) { return config_obj(c).dump(2) + "\n"; }

inline constexpr std::string_view kAdviceFormat = "mixprec.advice";

std::string advice_json(const Advice& a) {
  ojson j;
  j["format"] = std::string(kAdviceFormat);
  j["version"] = 1;
  j["steps"] = {{"first", a.first_step}, {"last", a.last_step}, {"sampled", a.steps}};
  j["config"] = config_obj(a.config);
  j["cost_chosen"] = a.cost_chosen;
  j["cost_bf16"] = a.cost_bf16;
  j["cost_directional"] = a.cost_directional;
  j["cost_late_switch"] = a.cost_late_switch;
  ojson layers = ojson::array();
  for (const LayerAdvice& L : a.layers) {
    ojson l;
    l["layer"] = L.layer;
    l["tokens"] = L.tokens;
    l["in"] = L.in;
    l["out"] = L.out;
    l["chosen"] = L.chosen ? ojson(std::string(candidate_name(*L.chosen))) : ojson(nullptr);
    l["reason"] = L.reason;
    l["rejected"] = L.rejected;
    // Samples without a finite value, left out; roles with samples of which none was measured.
    ojson unmeasured = ojson::object();
    ojson not_measured = ojson::array();
    for (std::size_t r = 0; r < kRoles; ++r) {
      if (L.unmeasured[r] == 0) continue;
      unmeasured[std::string(kRoleNames[r])] = L.unmeasured[r];
      if (!L.sampled[r]) not_measured.push_back(std::string(kRoleNames[r]));
    }
    l["not_measured"] = not_measured;
    l["unmeasured_samples"] = unmeasured;
    const DirectionAdvice& D = L.directions;
    auto name_or_null = [](const std::optional<Candidate>& c) { return c ? ojson(std::string(candidate_name(*c))) : ojson(nullptr); };
    l["directions"] = {{"forward", name_or_null(D.forward)}, {"backward", name_or_null(D.backward)},
                       {"cost_forward", D.cost_forward}, {"cost_backward", D.cost_backward}, {"saving", D.saving},
                       {"reason", D.reason}, {"rejected", D.rejected}};
    l["late_forward_switch"] = L.late_switch ? ojson{{"from_fraction", L.late_switch->from_fraction},
                                                     {"extra_cost", L.late_switch->extra_cost},
                                                     {"reason", L.late_switch->reason}}
                                             : ojson(nullptr);
    // Per candidate, its three GEMMs (beside "candidates", whose entries are a cost and roles).
    ojson gemms = ojson::object();
    for (Candidate c : a.candidates) {
      ojson g;
      for (std::size_t k = 0; k < kGemms; ++k) g[std::string(kGemmNames[k])] = L.gemm_cost[idx(c)][k];
      gemms[std::string(candidate_name(c))] = g;
    }
    l["gemm_cost"] = gemms;
    ojson cands;
    for (Candidate c : a.candidates) {
      ojson e;
      e["cost"] = L.cost[idx(c)];
      for (std::size_t r = 0; r < kRoles; ++r) {
        if (!L.sampled[r]) continue;
        const Measurement& m = L.measurements[idx(c)][r];
        e[std::string(kRoleNames[r])] = {
            {"rel_rms_error", num(m.rel_rms_error)}, {"worst_rel_rms_error", num(m.worst_rel_rms_error)},
            {"saturated", num(m.saturated)}, {"flushed", num(m.flushed)}, {"headroom_log2", num(m.headroom_log2)},
            {"amax", num(m.amax)}, {"elements", m.elements}, {"nonzero", m.nonzero}, {"nonfinite", m.nonfinite},
            {"samples", m.samples}};
      }
      cands[std::string(candidate_name(c))] = e;
    }
    l["candidates"] = cands;
    layers.push_back(l);
  }
  j["layers"] = layers;
  return j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
}

Advice parse_advice_json(std::string_view text, std::string_view source) {
  const ojson j = io::parse_ordered_json(text, source);
  const std::string src(source);
  if (!j.is_object() || !j.contains("format") || j["format"] != std::string(kAdviceFormat))
    invalid(src + ": format: expected \"" + std::string(kAdviceFormat) + "\", found " +
            (j.is_object() && j.contains("format") ? j["format"].dump() : std::string("none")));
  if (field(j, "version", src) != 1) invalid(src + ": version: expected 1, found " + j["version"].dump());
  Advice a;
  a.config = parse_config(field(j, "config", src).dump(), src + ": config");
  a.candidates = configured(a.config);
  const ojson& st = field(j, "steps", src);
  a.first_step = count_of(field(st, "first", src + ": steps"), src + ": steps.first");
  a.last_step = count_of(field(st, "last", src + ": steps"), src + ": steps.last");
  a.steps = count_of(field(st, "sampled", src + ": steps"), src + ": steps.sampled");
  a.cost_chosen = num_of(field(j, "cost_chosen", src), src + ": cost_chosen");
  a.cost_bf16 = num_of(field(j, "cost_bf16", src), src + ": cost_bf16");
  // Optional (evidence written before the directional proposal existed).
  if (j.contains("cost_directional")) a.cost_directional = num_of(j["cost_directional"], src + ": cost_directional");
  if (j.contains("cost_late_switch")) a.cost_late_switch = num_of(j["cost_late_switch"], src + ": cost_late_switch");
  const ojson& layers = field(j, "layers", src);
  if (!layers.is_array()) invalid(src + ": layers: expected a list");
  for (std::size_t i = 0; i < layers.size(); ++i) {
    const ojson& l = layers[i];
    const std::string w = src + ": layers[" + std::to_string(i) + "]";
    LayerAdvice L;
    const ojson& name = field(l, "layer", w);
    if (!name.is_string()) invalid(w + ".layer: expected a string");
    L.layer = name.get<std::string>();
    L.tokens = count_of(field(l, "tokens", w), w + ".tokens");
    L.in = count_of(field(l, "in", w), w + ".in");
    L.out = count_of(field(l, "out", w), w + ".out");
    const ojson& ch = field(l, "chosen", w);
    if (!ch.is_null()) L.chosen = candidate_of(ch, w + ".chosen");
    const ojson& reason = field(l, "reason", w);
    if (!reason.is_string()) invalid(w + ".reason: expected a string");
    L.reason = reason.get<std::string>();
    const ojson& rej = field(l, "rejected", w);
    if (!rej.is_array()) invalid(w + ".rejected: expected a list of strings");
    for (const ojson& r : rej) {
      if (!r.is_string()) invalid(w + ".rejected: expected a list of strings");
      L.rejected.push_back(r.get<std::string>());
    }
    // Optional (evidence written before they existed): not_measured follows from them.
    if (l.contains("unmeasured_samples")) {
      const ojson& u = l["unmeasured_samples"];
      if (!u.is_object()) invalid(w + ".unmeasured_samples: expected an object {role: count}, found " + u.dump());
      for (const auto& [k, v] : u.items()) {
        const auto r = parse_role(k);
        if (!r) invalid(w + ".unmeasured_samples: expected roles x, w, dy, dw, found '" + k + "'");
        L.unmeasured[idx(*r)] = count_of(v, w + ".unmeasured_samples." + k);
      }
    }
    auto strings = [](const ojson& v, const std::string& where, std::vector<std::string>& into) {
      if (!v.is_array()) invalid(where + ": expected a list of strings, found " + v.dump());
      for (const ojson& r : v) {
        if (!r.is_string()) invalid(where + ": expected a list of strings, found " + r.dump());
        into.push_back(r.get<std::string>());
      }
    };
    // Optional (evidence written before they existed).
    if (l.contains("directions")) {
      const ojson& d = l["directions"];
      const std::string dw = w + ".directions";
      if (!d.is_object()) invalid(dw + ": expected an object, found " + d.dump());
      DirectionAdvice& D = L.directions;
      const ojson& f = field(d, "forward", dw);
      const ojson& k = field(d, "backward", dw);
      if (f.is_null() != k.is_null()) invalid(dw + ": expected forward and backward both candidates or both null");
      if (!f.is_null()) D.forward = candidate_of(f, dw + ".forward"), D.backward = candidate_of(k, dw + ".backward");
      D.cost_forward = num_of(field(d, "cost_forward", dw), dw + ".cost_forward");
      D.cost_backward = num_of(field(d, "cost_backward", dw), dw + ".cost_backward");
      D.saving = num_of(field(d, "saving", dw), dw + ".saving");
      const ojson& dr = field(d, "reason", dw);
      if (!dr.is_string()) invalid(dw + ".reason: expected a string, found " + dr.dump());
      D.reason = dr.get<std::string>();
      strings(field(d, "rejected", dw), dw + ".rejected", D.rejected);
    }
    if (l.contains("late_forward_switch") && !l["late_forward_switch"].is_null()) {
      const ojson& s = l["late_forward_switch"];
      const std::string sw = w + ".late_forward_switch";
      if (!s.is_object()) invalid(sw + ": expected an object or null, found " + s.dump());
      LateSwitchAdvice ls;
      ls.from_fraction = num_of(field(s, "from_fraction", sw), sw + ".from_fraction");
      ls.extra_cost = num_of(field(s, "extra_cost", sw), sw + ".extra_cost");
      const ojson& sr = field(s, "reason", sw);
      if (!sr.is_string()) invalid(sw + ".reason: expected a string, found " + sr.dump());
      ls.reason = sr.get<std::string>();
      L.late_switch = ls;
    }
    const ojson& cands = field(l, "candidates", w);
    for (Candidate c : a.candidates) {
      const std::string cw = w + ".candidates." + std::string(candidate_name(c));
      const ojson& e = field(cands, std::string(candidate_name(c)).c_str(), w + ".candidates");
      L.cost[idx(c)] = num_of(field(e, "cost", cw), cw + ".cost");
      for (std::size_t k = 0; k < kGemms; ++k) {
        // Absent in older evidence: the cost model of its configuration gives it.
        const std::string key(kGemmNames[k]), gw = w + ".gemm_cost." + std::string(candidate_name(c));
        L.gemm_cost[idx(c)][k] =
            l.contains("gemm_cost")
                ? num_of(field(field(l["gemm_cost"], std::string(candidate_name(c)).c_str(), w + ".gemm_cost"), key.c_str(), gw),
                         gw + "." + key)
                : gemm_cost(a.config.cost, c, static_cast<Gemm>(k), L.tokens, L.in, L.out);
      }
      for (std::size_t r = 0; r < kRoles; ++r) {
        const std::string key(kRoleNames[r]);
        if (!e.contains(key)) continue;
        L.sampled[r] = true;
        const ojson& mj = e[key];
        const std::string mw = cw + "." + key;
        Measurement& m = L.measurements[idx(c)][r];
        m.rel_rms_error = num_of(field(mj, "rel_rms_error", mw), mw + ".rel_rms_error");
        m.worst_rel_rms_error = num_of(field(mj, "worst_rel_rms_error", mw), mw + ".worst_rel_rms_error");
        m.saturated = num_of(field(mj, "saturated", mw), mw + ".saturated");
        m.flushed = num_of(field(mj, "flushed", mw), mw + ".flushed");
        m.headroom_log2 = num_of(field(mj, "headroom_log2", mw), mw + ".headroom_log2");
        m.amax = static_cast<float>(num_of(field(mj, "amax", mw), mw + ".amax"));
        m.elements = count_of(field(mj, "elements", mw), mw + ".elements");
        m.nonzero = count_of(field(mj, "nonzero", mw), mw + ".nonzero");
        m.nonfinite = count_of(field(mj, "nonfinite", mw), mw + ".nonfinite");
        m.samples = count_of(field(mj, "samples", mw), mw + ".samples");
      }
    }
    a.layers.push_back(std::move(L));
  }
  return a;
}

std::string recipe_file_json(const Advice& a) {
  ojson j;
  j["format"] = std::string(kRecipeFileFormat);
  j["version"] = kRecipeFileVersion;
  j["default"] = "bf16";
  ojson modules = ojson::object();
  std::vector<std::string> kept;
  for (const LayerAdvice& L : a.layers) {
    const bool quantized = L.chosen && candidate_info(*L.chosen).recipe;
    modules[L.layer] = quantized ? std::string(candidate_name(*L.chosen)) : std::string("bf16");
    if (L.chosen == Candidate::fp16) kept.push_back(L.layer + " (fp16)");
    if (!L.chosen) {
      const char* why = " (none within the budget)";
      for (std::size_t r = 0; r < kRoles; ++r)
        if (a.config.budget.roles[r] && !L.sampled[r]) why = L.unmeasured[r] ? " (not measured)" : " (no samples)";
      kept.push_back(L.layer + why);
    }
  }
  j["modules"] = modules;
  std::string notes = "written by the mixprec precision advisor from " + std::to_string(a.steps) +
                      " sampled steps; modeled cost " + fmt_g(a.cost_bf16 > 0 ? a.cost_chosen / a.cost_bf16 : 1.0) +
                      "x all-bf16 (docs/advisor.md)";
  if (!kept.empty()) {
    notes += "; written \"bf16\" (not quantized):";
    for (const auto& k : kept) notes += " " + k;
  }
  j["notes"] = notes;
  return j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
}

namespace {
// The name a recipe file writes for a candidate: its recipe's, else "bf16" (high precision).
std::string file_name(Candidate c) {
  return candidate_info(c).recipe ? std::string(candidate_name(c)) : std::string("bf16");
}
}  // namespace

std::string directional_recipe_file_json(const Advice& a) {
  ojson j;
  j["format"] = std::string(kRecipeFileFormat);
  j["version"] = kRecipeFileVersion;
  j["default"] = "bf16";
  ojson modules = ojson::object();
  std::vector<std::string> kept, switched;
  for (const LayerAdvice& L : a.layers) {
    const DirectionAdvice& D = L.directions;
    if (!D.proposed()) {
      modules[L.layer] = "bf16";
      const char* why = " (none within the budget)";
      for (std::size_t r = 0; r < kRoles; ++r)
        if (a.config.budget.roles[r] && !L.sampled[r]) why = L.unmeasured[r] ? " (not measured)" : " (no samples)";
      kept.push_back(L.layer + why);
      continue;
    }
    const std::string f = file_name(*D.forward), b = file_name(*D.backward);
    // The entry lowp::plan checked (pair_choice): fprop's recipe and dgrad's and wgrad's.
    modules[L.layer] = f == b ? ojson(f) : ojson{{"recipe", f}, {"dgrad", b}, {"wgrad", b}};
    if (L.late_switch) switched.push_back(L.layer);
  }
  j["modules"] = modules;
  if (!switched.empty()) {
    // One phase per from_fraction (the configuration gives every layer the same one).
    std::vector<double> fractions;
    for (const LayerAdvice& L : a.layers)
      if (L.late_switch && std::find(fractions.begin(), fractions.end(), L.late_switch->from_fraction) == fractions.end())
        fractions.push_back(L.late_switch->from_fraction);
    ojson schedule = ojson::array();
    for (double f : fractions) {
      ojson names = ojson::array();
      for (const LayerAdvice& L : a.layers)
        if (L.late_switch && L.late_switch->from_fraction == f) names.push_back(L.layer);
      schedule.push_back(ojson{{"from_fraction", f}, {"modules", names}, {"fprop", "bf16"}, {"label", std::string(kLateSwitchLabel)}});
    }
    j["schedule"] = schedule;
  }
  const double bf = a.cost_bf16 > 0 ? a.cost_bf16 : 1.0;
  std::string notes = "written by the mixprec precision advisor, a recipe per GEMM direction, from " + std::to_string(a.steps) +
                      " sampled steps; modeled cost " + fmt_g(a.cost_bf16 > 0 ? a.cost_directional / bf : 1.0) +
                      "x all-bf16 (the single choice " + fmt_g(a.cost_bf16 > 0 ? a.cost_chosen / bf : 1.0) + "x)";
  if (!switched.empty())
    notes += "; forward to bf16 late in the run for " + std::to_string(switched.size()) + " layer" +
             (switched.size() == 1 ? "" : "s") + ": " + signed_share(a.cost_late_switch, a.cost_directional) +
             " of the run's cost";
  notes += " (docs/advisor.md)";
  if (!kept.empty()) {
    notes += "; written \"bf16\" (not quantized):";
    for (const auto& k : kept) notes += " " + k;
  }
  j["notes"] = notes;
  return j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
}

std::string advice_table(const Advice& a) {
  std::ostringstream o;
  std::size_t w = 5;
  for (const LayerAdvice& L : a.layers) w = std::max(w, L.layer.size());
  auto pad = [](std::string s, std::size_t n) { return s.size() < n ? s + std::string(n - s.size(), ' ') : s; };
  o << pad("layer", w) << "  " << pad("tokens x in -> out", 22) << "  " << pad("choice", 12) << "  "
    << pad("cost/bf16", 9) << "  error x / w / dy / dW\n";
  std::vector<std::string> notes;  // roles not measured, values left out
  for (const LayerAdvice& L : a.layers) {
    const Candidate c = L.chosen.value_or(Candidate::bf16);
    const double bf = L.cost[idx(Candidate::bf16)];
    std::string errs;
    bool required_unmeasured = false;
    for (std::size_t r = 0; r < kRoles; ++r) {
      const bool not_measured = !L.sampled[r] && L.unmeasured[r] > 0;
      required_unmeasured = required_unmeasured || (not_measured && a.config.budget.roles[r]);
      errs.append(r ? " / " : "").append(L.sampled[r] ? fmt_g(L.measurements[idx(c)][r].rel_rms_error) : not_measured ? "n/m" : "-");
      const std::string who = L.layer + "." + std::string(kRoleNames[r]);
      if (not_measured)
        notes.push_back("not measured: " + who + " (" + std::to_string(L.unmeasured[r]) +
                        (L.unmeasured[r] == 1 ? " sample" : " samples") + ", every value inf or NaN)");
      else if (L.sampled[r] && L.unmeasured[r] > 0)
        notes.push_back("left out: " + who + ", " + std::to_string(L.unmeasured[r]) +
                        (L.unmeasured[r] == 1 ? " sample" : " samples") + " with every value inf or NaN");
      if (L.sampled[r] && !a.candidates.empty()) {
        const Measurement& m = L.measurements[idx(a.candidates.front())][r];
        if (m.nonfinite > 0)
          notes.push_back("left out: " + who + ", " + std::to_string(m.nonfinite) + " inf/NaN of " +
                          std::to_string(m.elements) + " values");
      }
    }
    o << pad(L.layer, w) << "  "
      << pad(std::to_string(L.tokens) + " x " + std::to_string(L.in) + " -> " + std::to_string(L.out), 22) << "  "
      << pad(L.chosen ? std::string(candidate_name(*L.chosen)) : required_unmeasured ? "not measured" : "none", 12) << "  "
      << pad(bf > 0 && L.chosen ? fmt_g(L.cost[idx(c)] / bf) : "-", 9) << "  " << errs << "\n";
  }
  o << "modeled cost: " << fmt_g(a.cost_bf16 > 0 ? a.cost_chosen / a.cost_bf16 : 1.0) << "x all-bf16 ("
    << a.layers.size() << " layers, " << a.steps << " sampled steps)\n";
  for (const std::string& n : notes) o << n << "\n";
  // The directional proposal and the late forward switch, one line per layer.
  const bool any_switch = std::any_of(a.layers.begin(), a.layers.end(), [](const LayerAdvice& L) { return L.late_switch.has_value(); });
  if (a.layers.empty() || (!a.config.directions && !any_switch)) return o.str();
  o << "\n" << pad("layer", w) << "  " << pad("forward", 12) << "  " << pad("backward", 12) << "  " << pad("cost/single", 11)
    << "  late forward switch\n";
  for (const LayerAdvice& L : a.layers) {
    const DirectionAdvice& D = L.directions;
    const double single = L.chosen ? L.cost[idx(*L.chosen)] : 0.0;
    std::string late = "-";
    if (L.late_switch)
      late = "bf16 from " + percent(L.late_switch->from_fraction) + " of the run: " +
             signed_share(L.late_switch->extra_cost, a.cost_directional) + " of the run's cost";
    o << pad(L.layer, w) << "  " << pad(D.forward ? std::string(candidate_name(*D.forward)) : "-", 12) << "  "
      << pad(D.backward ? std::string(candidate_name(*D.backward)) : "-", 12) << "  "
      << pad(D.proposed() && single > 0 ? fmt_g(D.cost() / single) : "-", 11) << "  " << late << "\n";
  }
  const double bf = a.cost_bf16 > 0 ? a.cost_bf16 : 1.0;
  o << "modeled cost per direction: " << fmt_g(a.cost_bf16 > 0 ? a.cost_directional / bf : 1.0) << "x all-bf16";
  if (any_switch)
    o << "; with the late forward switch " << fmt_g(a.cost_bf16 > 0 ? (a.cost_directional + a.cost_late_switch) / bf : 1.0)
      << "x (" << signed_share(a.cost_late_switch, a.cost_directional) << ")";
  o << "\n";
  return o.str();
}

// ---- samples in a run folder --------------------------------------------------------------

namespace {
constexpr std::string_view kSamplesFormat = "mixprec.advisor_samples";

std::string step_dir_name(std::uint64_t step) {
  std::string s = std::to_string(step);
  if (s.size() < 8) s.insert(0, 8 - s.size(), '0');
  return "step-" + s;
}
}  // namespace

std::filesystem::path samples_dir(const std::filesystem::path& run_dir) { return run_dir / "samples"; }

SampleView OwnedSample::view() const {
  return SampleView{layer, role, step, loss_scale, rows, cols, rows_total, values};
}

void write_step_samples(const std::filesystem::path& run_dir, std::uint64_t step, float loss_scale,
                        std::span<const SampleView> samples) {
  if (!(loss_scale > 0.0f) || !std::isfinite(loss_scale))
    invalid("loss_scale: expected a finite positive number, found " + fmt_g(loss_scale));
  for (const SampleView& s : samples) {
    if (s.step != step) invalid("write_step_samples: a sample of step " + std::to_string(s.step) + " in step " + std::to_string(step));
    if (s.values.size() != s.rows * s.cols)
      invalid("write_step_samples: " + std::string(s.layer) + "." + std::string(role_name(s.role)) +
              ": expected rows * cols values, found " + std::to_string(s.values.size()));
    if (s.layer.empty()) invalid("write_step_samples: expected a layer name, found an empty one");
  }
  const auto dir = samples_dir(run_dir) / step_dir_name(step);
  std::filesystem::create_directories(dir);
  ojson tensors = ojson::array();
  for (std::size_t i = 0; i < samples.size(); ++i) {
    const SampleView& s = samples[i];
    std::string file = std::to_string(i);
    if (file.size() < 3) file.insert(0, 3 - file.size(), '0');
    file = "t" + file + ".npy";
    const std::size_t shape[2] = {s.rows, s.cols};
    io::write_file_atomic(dir / file, npy_f32_image(shape, s.values));
    tensors.push_back({{"layer", std::string(s.layer)}, {"role", std::string(role_name(s.role))}, {"file", file},
                       {"rows_total", s.rows_total ? s.rows_total : s.rows}});
  }
  ojson idx_json{{"format", std::string(kSamplesFormat)}, {"version", 1}, {"step", step}, {"loss_scale", loss_scale},
                 {"tensors", tensors}};
  io::write_file_atomic(dir / "index.json", idx_json.dump(2) + "\n");
}

std::vector<OwnedSample> read_samples(const std::filesystem::path& run_dir) {
  const auto root = samples_dir(run_dir);
  std::vector<OwnedSample> out;
  if (!std::filesystem::is_directory(root))
    throw std::runtime_error(root.string() + ": no advisor samples (expected a folder samples/ with step-NNNNNNNN/index.json; "
                             "docs/run_folder.md says how a run writes them)");
  std::vector<std::filesystem::path> steps;
  for (const auto& e : std::filesystem::directory_iterator(root))
    if (e.is_directory() && e.path().filename().string().rfind("step-", 0) == 0 && std::filesystem::exists(e.path() / "index.json"))
      steps.push_back(e.path());
  std::sort(steps.begin(), steps.end());
  for (const auto& dir : steps) {
    const auto index = dir / "index.json";
    const std::string src = index.string();
    const std::string text = io::read_json_text(index);  // a FIFO or a device is refused, not waited on
    ojson j;
    try {
      j = io::parse_ordered_json(text, src);
    } catch (const std::invalid_argument& e) {
      throw std::runtime_error(e.what());
    }
    try {
      if (!j.is_object() || !j.contains("format") || j["format"] != std::string(kSamplesFormat))
        invalid(src + ": format: expected \"" + std::string(kSamplesFormat) + "\"");
      if (field(j, "version", src) != 1) invalid(src + ": version: expected 1, found " + j["version"].dump());
      const std::uint64_t step = count_of(field(j, "step", src), src + ": step");
      const double ls = num_of(field(j, "loss_scale", src), src + ": loss_scale");
      if (!(ls > 0) || !std::isfinite(ls))
        invalid(src + ": loss_scale: expected a finite number > 0, found " + j["loss_scale"].dump());
      const ojson& ts = field(j, "tensors", src);
      if (!ts.is_array()) invalid(src + ": tensors: expected a list");
      for (std::size_t i = 0; i < ts.size(); ++i) {
        const std::string w = src + ": tensors[" + std::to_string(i) + "]";
        const ojson& t = ts[i];
        OwnedSample s;
        s.step = step;
        s.loss_scale = static_cast<float>(ls);
        const ojson& layer = field(t, "layer", w);
        const ojson& role = field(t, "role", w);
        const ojson& file = field(t, "file", w);
        if (!layer.is_string() || layer.get<std::string>().empty()) invalid(w + ".layer: expected a layer name");
        s.layer = layer.get<std::string>();
        const auto r = role.is_string() ? parse_role(role.get<std::string>()) : std::nullopt;
        if (!r) invalid(w + ".role: expected x, w, dy or dw, found " + role.dump());
        s.role = *r;
        if (!file.is_string() || file.get<std::string>().find('/') != std::string::npos || file.get<std::string>().empty() ||
            file.get<std::string>()[0] == '.')
          invalid(w + ".file: expected a file name in the step's folder, found " + file.dump());
        NpyArray arr = read_npy(dir / file.get<std::string>());
        if (arr.shape.size() != 2 || arr.fortran_order)
          invalid((dir / file.get<std::string>()).string() + ": expected a 2-D C-order array, found shape " + shape_text(arr.shape));
        s.rows = arr.shape[0];
        s.cols = arr.shape[1];
        s.rows_total = static_cast<std::size_t>(count_of(field(t, "rows_total", w), w + ".rows_total"));
        if (s.rows_total < s.rows) invalid(w + ".rows_total: expected at least the sampled rows (" + std::to_string(s.rows) + ")");
        s.values = std::move(arr.values);
        out.push_back(std::move(s));
      }
    } catch (const std::invalid_argument& e) {
      throw std::runtime_error(e.what());
    }
  }
  if (out.empty()) throw std::runtime_error(root.string() + ": no sampled step (no step-NNNNNNNN/index.json)");
  return out;
}

}  // namespace mixprec::monitor::advisor
