// The training loop (include/mixprec/train/trainer.hpp).
#include "mixprec/train/trainer.hpp"

#include <algorithm>
#include <cmath>
#include <bit>
#include <cstring>
#include <limits>
#include <stdexcept>

#include <omp.h>

#include "mixprec/core/parallel.hpp"
#include "mixprec/scaler/loss_scale.hpp"
#include "trainer_impl.hpp"

namespace mixprec::train {
namespace {

// Below these sizes the step's own passes stay on the calling thread (waking the pool
// costs more than it saves).
constexpr std::size_t kParallelBytes = std::size_t{1} << 20;
constexpr std::size_t kParallelElements = std::size_t{1} << 16;

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

nn::Dataset load_data(const TrainConfig& c) {
  nn::DataOptions o;
  o.vocab = nn::parse_vocab_spec(c.vocab);
  o.validation_fraction = c.val_fraction;
  o.context = c.model.context;
  if (!c.data.empty()) return nn::Dataset::from_file(c.data, o);
  nn::CorpusOptions corpus;
  corpus.seed = c.seed;
  corpus.tokens = c.corpus_tokens;
  return nn::Dataset::from_corpus(corpus, o);
}

nn::ModelConfig model_config(const TrainConfig& c, const nn::Dataset& d) {
  nn::ModelConfig m = c.model;
  m.vocab = d.vocab().size();
  m.seed = c.seed;
  return m;
}

std::unique_ptr<Optimizer> make_optimizer(const TrainConfig& c, ParamStore& store) {
  const OptimizerKind kind = *parse_optimizer(c.optimizer);
  if (kind == OptimizerKind::sgd || kind == OptimizerKind::sgd_momentum) {
    SgdConfig s;
    s.lr = c.lr;
    s.momentum = kind == OptimizerKind::sgd_momentum ? c.beta1 : 0.0;
    s.weight_decay = c.weight_decay;
    return std::make_unique<SGD>(store, s);
  }
  AdamConfig a;
  a.lr = c.lr;
  a.beta1 = c.beta1;
  a.beta2 = c.beta2;
  a.eps = c.eps;
  a.weight_decay = c.weight_decay;
  if (kind == OptimizerKind::adam) return std::make_unique<Adam>(store, a);
  return std::make_unique<AdamW>(store, a);
}

// The weights the optimizer keeps: the fp32 master copy (rebuilt into `joined` from remainder
// masters), or the model weights.
std::span<const std::byte> weights_of_record(const ParamStore& s, std::vector<float>& joined) {
  if (s.master_format() == MasterFormat::remainder) {
    joined.resize(s.flat_size());  // allocated once
    s.weights_of_record(joined);
    return {reinterpret_cast<const std::byte*>(joined.data()), joined.size() * 4};
  }
  if (s.has_master()) return {reinterpret_cast<const std::byte*>(s.master_data()), s.flat_size() * 4};
  return {static_cast<const std::byte*>(s.model_data()), s.flat_size() * dtype_size(s.model_dtype())};
}

// Whether two stored values of w bytes differ: fixed-size loads for the 4- and 2-byte
// formats (a memcmp call per parameter was 2% of a small model's step).
inline bool differs(const std::byte* a, const std::byte* b, std::size_t w) noexcept {
  if (w == 4) {
    std::uint32_t x = 0, y = 0;
    std::memcpy(&x, a, 4);
    std::memcpy(&y, b, 4);
    return x != y;
  }
  if (w == 2) {
    std::uint16_t x = 0, y = 0;
    std::memcpy(&x, a, 2);
    std::memcpy(&y, b, 2);
    return x != y;
  }
  return std::memcmp(a, b, w) != 0;
}

// The Adam family's count over one tensor of w-byte weights (Word = uint32_t for the
// fp32 master, uint16_t for a 16-bit model copy): branch-free, so the compiler
// vectorizes it (the per-parameter branches were ~3% of the 3.45M model's bf16 step).
template <class Word>
void count_adam_lost(const std::byte* before, const std::byte* after, const float* first_moment, std::size_t off,
                     std::size_t end, bool decay, std::uint64_t& meant, std::uint64_t& lost) noexcept {
  constexpr Word kMagnitude = static_cast<Word>(~Word{0} >> 1);  // all but the sign bit
  std::uint64_t m = 0, l = 0;
  for (std::size_t i = off; i < end; ++i) {
    Word b = 0, a = 0;
    std::memcpy(&b, before + i * sizeof(Word), sizeof(Word));
    std::memcpy(&a, after + i * sizeof(Word), sizeof(Word));
    const bool moves = (first_moment[i] != 0.0f) | (decay & ((b & kMagnitude) != 0));
    m += moves;
    l += moves & (a == b);
  }
  meant += m;
  lost += l;
}

// Of the parameters the optimizer meant to move, the fraction whose stored value did
// not change (the update rounded away). Adam-family: meant to move when the first
// moment is nonzero, or decoupled/L2 decay acts on a nonzero weight. SGD: when the
// gradient is nonzero or decay acts. Weights of record are 4 bytes (fp32) or 2 (f16/bf16).
double lost_update_fraction(ParamStore& s, std::span<const std::byte> before, OptimizerKind kind,
                            double weight_decay, ThreadPool& pool, std::vector<float>& joined,
                            std::vector<float>& decoded_m) {
  const std::span<const std::byte> after = weights_of_record(s, joined);
  const std::size_t w = after.size() / s.flat_size();
  std::uint64_t meant = 0, lost = 0;
  const bool adam_family = kind == OptimizerKind::adam || kind == OptimizerKind::adamw;
  // Looked up once, not per parameter (out-of-line, checked accessors). Compact moments are
  // decoded (the count needs only whether m is nonzero; padding stays zero).
  const float* first_moment = nullptr;
  if (adam_family && s.compact_moments()) {
    decoded_m.resize(s.flat_size(), 0.0f);  // allocated once
    for (std::size_t i = 0; i < s.tensor_count(); ++i) dequantize_moment(s.moment(0, i), decoded_m.data() + s.offset(i));
    first_moment = decoded_m.data();
  } else if (adam_family) {
    first_moment = s.state_data(0);
  }
  if (adam_family) {
    // The rule is the same for every tensor: one flat range, split over the pool's threads
    // (integer counts: the sum does not depend on the split).
    std::vector<std::uint64_t> counts(2 * pool.size(), 0);
    pool.parallel_for(s.flat_size(), 64, kParallelElements, [&](std::size_t b, std::size_t e, unsigned k) {
      if (w == 4) count_adam_lost<std::uint32_t>(before.data(), after.data(), first_moment, b, e, weight_decay > 0,
                                                 counts[2 * k], counts[2 * k + 1]);
      else count_adam_lost<std::uint16_t>(before.data(), after.data(), first_moment, b, e, weight_decay > 0,
                                          counts[2 * k], counts[2 * k + 1]);
    });
    for (std::size_t k = 0; k < pool.size(); ++k) {
      meant += counts[2 * k];
      lost += counts[2 * k + 1];
    }
    return meant == 0 ? 0.0 : static_cast<double>(lost) / static_cast<double>(meant);
  }
  for (std::size_t t = 0; t < s.tensor_count(); ++t) {
    const std::size_t off = s.offset(t);
    const std::size_t end = off + s.numel(t);
    for (std::size_t i = off; i < end; ++i) {
      const bool changed = differs(&before[i * w], &after[i * w], w);
      float g = 0;
      if (s.grad_dtype() == DType::f32) g = static_cast<const float*>(s.grad_data())[i];
      else g = s.grad_dtype() == DType::f16 ? decode(static_cast<const f16*>(s.grad_data())[i])
                                            : decode(static_cast<const bf16*>(s.grad_data())[i]);
      bool moves = g != 0.0f;
      if (!moves && weight_decay > 0) {  // decay moves any nonzero weight (sign bit ignored)
        const std::byte* b = &before[i * w];
        bool nonzero = (b[w - 1] & std::byte{0x7f}) != std::byte{0};
        for (std::size_t k = 0; k + 1 < w; ++k) nonzero = nonzero || b[k] != std::byte{0};
        moves = nonzero;
      }
      if (moves) {
        ++meant;
        if (!changed) ++lost;
      }
    }
  }
  return meant == 0 ? 0.0 : static_cast<double>(lost) / static_cast<double>(meant);
}

// Writes +inf into the first element of gradient tensor t, as an overflowing backward would.
void inject_inf(ParamStore& s, std::size_t t) {
  const std::size_t off = s.offset(t);
  switch (s.grad_dtype()) {
    case DType::f32: static_cast<float*>(s.grad_data())[off] = INFINITY; break;
    case DType::f16: static_cast<f16*>(s.grad_data())[off] = f16::from_bits(0x7C00); break;
    case DType::bf16: static_cast<bf16*>(s.grad_data())[off] = bf16::from_bits(0x7F80); break;
  }
}

float format_max(DType t) { return format_row(format_of(t)).max_finite; }

}  // namespace

void to_f32(const void* src, DType t, std::span<float> out) {
  switch (t) {
    case DType::f32: std::memcpy(out.data(), src, out.size() * 4); return;
    case DType::f16: convert(std::span<const f16>(static_cast<const f16*>(src), out.size()), out); return;
    case DType::bf16: convert(std::span<const bf16>(static_cast<const bf16*>(src), out.size()), out); return;
  }
}

std::unique_ptr<GradScaler> make_scaler(const TrainConfig& config, dist::Communicator* comm) {
  const std::string& spec = config.loss_scale;
  const std::optional<LossScaleConfig> c = loss_scale_config(spec);
  auto scaler = c ? std::make_unique<GradScaler>(*c, true, spec == "layerwise" ? spec : std::string())
                  : std::make_unique<GradScaler>(LossScaleConfig{}, false);
  if (config.skip_loss_z > 0 || config.skip_grad_z > 0) {
    GuardConfig g;
    g.nonfinite = true;  // the mixprec dialect skips inf/NaN without a scale anyway
    g.loss_z = config.skip_loss_z;
    g.grad_z = config.skip_grad_z;
    g.window = static_cast<int>(config.skip_window);
    scaler->set_guard(g);
  }
  if (comm != nullptr && comm->size() > 1) {
    scaler->set_rank_agreement([comm](RankFlags f) {
      float flags[2] = {f.found_inf ? 1.0f : 0.0f, f.checked ? 1.0f : 0.0f};
      comm->allreduce_max(flags);
      return RankFlags{flags[0] != 0.0f, flags[1] != 0.0f};
    });
  }
  return scaler;
}

Trainer::Impl::Impl(const TrainConfig& c, nn::Dataset d)
    : config(c),
      data(std::move(d)),
      schedule(WarmupCosine{c.lr, static_cast<std::int64_t>(c.warmup), static_cast<std::int64_t>(c.steps), c.min_lr}),
      sampler(data.train(), c.seed) {}

Trainer::Trainer(const TrainConfig& config) { init(config, nullptr); }

Trainer::Trainer(const TrainConfig& config, dist::Communicator& comm) { init(config, &comm); }

void Trainer::init(const TrainConfig& config, dist::Communicator* comm) {
  validate(config);
  check_layerwise(config);
  std::unique_ptr<dist::SingleProcess> own;
  if (comm == nullptr) {
    own = std::make_unique<dist::SingleProcess>();
    comm = own.get();
  }
  if (!config.distributed && comm->size() > 1)
    throw std::invalid_argument("distributed: expected true on a communicator of " + std::to_string(comm->size()) +
                                " ranks, found false");
  if (config.inject_overflow_rank >= comm->size())
    throw std::invalid_argument("inject-overflow-rank: expected -1 (every rank) or a rank in [0, " +
                                std::to_string(comm->size()) + "), found " +
                                std::to_string(config.inject_overflow_rank));
  // The layers and oneDNN share OpenMP's thread team; --threads sizes it for the process.
  // --threads 0: MIXPREC_THREADS when set (refused, as by every command, when it is not
  // a thread count), else OpenMP's default (OMP_NUM_THREADS, or every core).
  unsigned threads = config.threads;
  if (threads == 0) {
    try {
      threads = ThreadPool::environment_threads();
    } catch (const std::invalid_argument& e) {
      throw std::runtime_error(e.what());  // the environment, not the configuration: exit 1
    }
  }
  if (threads > 0) omp_set_num_threads(static_cast<int>(threads));
  std::unique_ptr<GradScaler> scaler = make_scaler(config, config.distributed ? comm : nullptr);
  nn::Dataset data = load_data(config);
  impl_ = std::make_unique<Impl>(config, std::move(data));
  Impl& m = *impl_;
  m.pool = std::make_unique<ThreadPool>(static_cast<unsigned>(std::max(1, omp_get_max_threads())));
  const OptimizerKind kind = *parse_optimizer(config.optimizer);
  m.recipes = recipe_assignment(config);
  if (m.recipes) m.phase_starts = m.recipes->phase_starts(config.steps);
  if (config.zero == 1) {
    // ZeRO-1: the model keeps its model copy and gradients, full size; master weights
    // and optimizer state live in this rank's slice only.
    const nn::ModelConfig mc = model_config(config, m.data);
    m.model = nn::make_model(mc, config.precision,
                             {.fp8 = fp8_config(config), .master_weights = false, .recipes = m.recipes,
                              .recipe_steps = config.steps});
    m.zero = make_zero_shard(config, mc, m.model->params(), nn::policy_of(config.precision).master, *comm);
    m.optimizer = make_optimizer(config, *m.zero->store);
  } else {
    m.model = nn::make_model(model_config(config, m.data), config.precision,
                             {.state_slots = optimizer_state_slots(kind), .fp8 = fp8_config(config),
                              .formats = state_formats(config), .recipes = m.recipes,
                              .recipe_steps = config.steps});
    m.optimizer = make_optimizer(config, m.model->params());
  }
  if (!config.inject_fault.empty()) {  // the name checked now, against the model built
    const bool backward = config.inject_fault.starts_with("backward:");
    try {
      m.model->set_fault(config.inject_fault.substr(backward ? 9 : 8), backward);
      m.model->set_fault("", false);
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument("inject-fault: " + std::string(e.what()));
    }
  }
  if (!config.inject_overflow_tensor.empty()) {
    const ParamStore& store = m.model->params();
    bool known = false;
    std::string names;
    for (std::size_t i = 0; i < store.tensor_count(); ++i) {
      known = known || store.spec(i).name == config.inject_overflow_tensor;
      names += (i ? ", " : "") + store.spec(i).name;
    }
    if (!known)
      throw std::invalid_argument("inject-overflow-tensor: expected a parameter of the model (" + names + "), found '" +
                                  config.inject_overflow_tensor + "'");
  }
  m.scaler = std::move(scaler);
  m.layerwise = m.scaler->layerwise();
  m.scaler->set_accumulation_steps(static_cast<int>(config.accum));
  m.inputs.assign(m.model->tokens_per_batch(), 0);
  m.targets.assign(m.model->tokens_per_batch(), 0);
  m.snapshot.resize(weights_of_record(m.model->params(), m.joined).size());
  if (config.ema > 0) {
    m.ema.resize(m.model->params().flat_size());
    m.model->params().weights_of_record(m.ema);
  }
  m.scratch.assign(m.model->params().flat_size(), 0.0f);
  m.amax.assign(m.model->params().tensor_count(), 0.0f);
  m.totals.step_ms.reserve(config.steps);
  m.comm = comm;
  m.own_comm = std::move(own);
  if (config.distributed) {
    m.acc.assign(m.model->params().flat_size(), 0.0f);
    if (config.grad_reduce == "low" && m.model->params().grad_dtype() == DType::f32)
      m.low.assign(m.model->params().flat_size(), 0);
    // Rank 0's weights of record and scaler state on every rank (the same seed builds
    // the same model everywhere; the broadcast makes it so whatever the build).
    if (comm->size() > 1) {
      ParamStore& s = m.model->params();
      if (s.master_format() == MasterFormat::remainder) {  // the bf16 halves and their remainders
        comm->broadcast({static_cast<std::byte*>(s.model_data()), s.flat_size() * 2}, 0);
        comm->broadcast({reinterpret_cast<std::byte*>(s.remainder_data()), s.flat_size() * 2}, 0);
      } else if (s.has_master()) {
        comm->broadcast({reinterpret_cast<std::byte*>(s.master_data()), s.flat_size() * 4}, 0);
        s.refresh_model();
      } else {
        comm->broadcast({static_cast<std::byte*>(s.model_data()), s.flat_size() * dtype_size(s.model_dtype())}, 0);
      }
      m.model->weights_updated();
      const std::string scaler_state = comm->broadcast_string(m.scaler->state_json(), 0);
      if (comm->rank() != 0) m.scaler->load_state_json(scaler_state);
    }
  }
}

Trainer::~Trainer() = default;

const TrainConfig& Trainer::config() const noexcept { return impl_->config; }
const nn::Dataset& Trainer::data() const noexcept { return impl_->data; }
nn::Model& Trainer::model() noexcept { return *impl_->model; }
const GradScaler& Trainer::scaler() const noexcept { return *impl_->scaler; }
const Optimizer& Trainer::optimizer() const noexcept { return *impl_->optimizer; }
dist::Communicator& Trainer::communicator() noexcept { return *impl_->comm; }
std::uint64_t Trainer::steps_done() const noexcept { return impl_->totals.steps; }
std::span<const float> Trainer::ema() const noexcept { return impl_->ema; }
bool Trainer::done() const noexcept { return impl_->totals.steps >= impl_->config.steps; }

StepRecord Trainer::train_step() {
  Impl& m = *impl_;
  if (done()) throw std::logic_error("Trainer::train_step: all " + std::to_string(m.config.steps) + " steps are done");
  const auto t0 = Clock::now();
  StepRecord r = m.begin_step();
  StepLoss loss = m.forward_backward(r);
  m.end_fp8_step(r);
  m.inject_overflow(r);
  if (m.layerwise) m.finish_layers(r);
  // Data parallel: every rank skips, or steps on the reduced gradients, together.
  bool found_inf_elsewhere = false;
  std::optional<double> global_norm;  // ZeRO: combined from every rank's slice
  if (m.config.distributed) {
    found_inf_elsewhere = m.agree_across_ranks(r, loss.sum);
    global_norm = m.reduce_gradients(r.scale);
  }
  r.loss = loss.mean();
  m.record_gradient_telemetry(r);

  m.snapshot_weights();
  // State formats: the optimizer state measured inside the fused step at histogram steps (not
  // under ZeRO, whose other tensors step on other ranks).
  const bool measure_state = m.optimizer->steps_per_tensor() && !m.zero &&
                             histogram_step(r.step, m.config.histogram_every, m.config.steps);
  m.optimizer->measure_state(measure_state);
  const auto ts = Clock::now();
  const StepOutcome out = m.step_or_skip(r, found_inf_elsewhere, global_norm);
  if (m.layerwise) m.restore_skipped();
  m.update_loss_scale(r);
  r.scaler_seconds = seconds_since(ts);
  m.schedule.on_step(out.applied);
  if (out.applied) {
    ParamStore& store = m.model->params();
    if (m.zero) zero_share_weights(*m.zero, *m.comm, store);  // the updated slices, everywhere
    m.model->weights_updated();
    if (!m.ema.empty()) m.update_ema();
    // Not measured under ZeRO (the optimizer state of the other slices is elsewhere).
    if (!m.zero)
      r.lost_update_fraction =
          lost_update_fraction(store, m.snapshot, m.optimizer->kind(), m.config.weight_decay, *m.pool, m.joined,
                               m.first_moment);
    if (measure_state) {
      const std::span<const AdamStepStats> st = m.optimizer->state_stats();
      for (std::size_t i = 0; i < st.size(); ++i)
        r.optimizer_state.push_back({store.spec(i).name, st[i].m_relative_error(), st[i].v_relative_error(),
                                     st[i].meant, st[i].lost});
    }
  }
  m.record_weight_telemetry(r);
  r.seconds = seconds_since(t0);
  m.totals.add(r);
  if ((m.config.eval_every > 0 && r.step % m.config.eval_every == 0) || done()) {
    r.val_loss = evaluate();
    if (!m.ema.empty()) {
      const double raw = m.totals.val_loss.value_or(std::numeric_limits<double>::quiet_NaN());
      m.load_ema();
      r.val_loss_ema = evaluate();
      m.restore_weights();
      m.totals.val_loss = raw;  // the run's validation loss stays the trained weights'
      m.totals.val_loss_ema = r.val_loss_ema;
    }
  }
  return r;
}

void Trainer::Impl::update_ema() {
  const ParamStore& s = model->params();
  const float rate = 1.0f - static_cast<float>(config.ema);
  const float* w = s.master_data();
  if (w == nullptr) {  // 16-bit (or fp32) weights of record, decoded; or remainder masters, rebuilt
    s.weights_of_record(scratch);
    w = scratch.data();
  }
  pool->parallel_for(ema.size(), 64, kParallelElements, [&](std::size_t b, std::size_t e, unsigned) {
    for (std::size_t i = b; i < e; ++i) ema[i] += rate * (w[i] - ema[i]);
  });
}

void Trainer::Impl::load_ema() {
  // The weights of record kept bytewise in the snapshot buffer (free between steps), the EMA
  // written in their place (rounded to the model's dtype without a master copy).
  const std::span<const std::byte> w = weights_of_record(model->params(), joined);
  std::memcpy(snapshot.data(), w.data(), w.size());
  model->params().set_weights_of_record(ema);
  model->weights_updated();
}

void Trainer::Impl::restore_weights() {
  ParamStore& s = model->params();
  if (s.master_format() == MasterFormat::remainder) {
    s.set_weights_of_record({reinterpret_cast<const float*>(snapshot.data()), s.flat_size()});
  } else if (s.has_master()) {
    std::memcpy(s.master_data(), snapshot.data(), s.flat_size() * 4);
    s.refresh_model();
  } else {
    std::memcpy(s.model_data(), snapshot.data(), s.flat_size() * dtype_size(s.model_dtype()));
  }
  model->weights_updated();
}

StepRecord Trainer::Impl::begin_step() {
  StepRecord r;
  r.step = totals.steps + 1;
  r.lr = schedule.lr();
  r.scale = scaler->get_scale();
  model->reset_stats();
  model->params().zero_grads();
  model->set_histograms(histogram_step(r.step, config.histogram_every, config.steps));
  comm->set_step(r.step);
  if (recipes) {
    // The recipe file's schedule: the Linears switch plans where a phase begins, and the log
    // marks the step with the phases' labels.
    for (std::size_t i = 0; i < phase_starts.size(); ++i)
      if (phase_starts[i] == totals.steps)
        r.recipe_phase += (r.recipe_phase.empty() ? "" : ", ") + recipes->schedule[i].label;
    if (!r.recipe_phase.empty()) model->set_recipe_step(totals.steps);
  }
  return r;
}

StepLoss Trainer::Impl::forward_backward(StepRecord& r) {
  // The loss is the mean over every token of the effective batch, so each token's
  // loss gradient is scale / (accum * losses per micro-batch). Distributed: the
  // effective batch is accum * ranks micro-batches; every rank draws all of them (the
  // sampler stays the same everywhere) and runs its own accum, rank after rank.
  ParamStore& store = model->params();
  const bool dp = config.distributed;
  const std::size_t micro = config.accum * (dp ? static_cast<std::size_t>(comm->size()) : 1);
  StepLoss loss;
  loss.count = micro * model->losses_per_batch();
  float dloss = static_cast<float>(static_cast<double>(r.scale) / static_cast<double>(loss.count));
  const std::vector<std::size_t>& bad_at = config.inject_bad_batch_at;
  const auto hit = std::find(bad_at.begin(), bad_at.end(), r.step);
  const bool bad = hit != bad_at.end();
  std::string kind;
  if (bad) {
    const std::vector<std::string> kinds = bad_batch_kinds(config.inject_bad_batch);
    kind = kinds.size() == 1 ? kinds[0] : kinds[static_cast<std::size_t>(hit - bad_at.begin())];
  }
  if (kind == "scaled") dloss *= 1000.0f;
  const std::vector<std::size_t>& fault_at = config.inject_fault_at;
  const bool fault = std::find(fault_at.begin(), fault_at.end(), r.step) != fault_at.end();
  if (fault) {
    const bool backward = config.inject_fault.starts_with("backward:");
    model->set_fault(config.inject_fault.substr(backward ? 9 : 8), backward);
  }
  std::uint64_t noise = config.seed ^ (0x9E3779B97F4A7C15ull * r.step);  // this step's random labels
  for (std::size_t k = 0; k < micro; ++k) {
    sampler.next_batch(config.model.batch, config.model.context, inputs, targets);
    if (kind == "labels") {
      const std::uint64_t vocab = model->config().vocab;
      for (nn::TokenId& t : targets) {
        noise = noise * 6364136223846793005ull + 1442695040888963407ull;  // PCG's LCG step
        t = static_cast<nn::TokenId>((noise >> 33) % vocab);
      }
    }
    if (dp && k / config.accum != static_cast<std::size_t>(comm->rank())) continue;
    const nn::ForwardResult f = model->forward(inputs, targets);
    loss.sum += f.loss_sum;
    if (!f.finite && r.loss_finite) {
      r.loss_finite = false;
      r.forward_nonfinite = f.first_nonfinite;
    }
    if (dp) {
      // Each micro-batch's gradient on its own, added in fp32 in micro-batch order:
      // oneDNN's accumulating GEMMs (beta = 1) would round differently from the
      // rank-order sum of the all-reduce (docs/distributed.md, "Bitwise equality").
      const bool first = k % config.accum == 0;
      if (!first) store.zero_grads();
      model->backward(dloss);
      accumulate_grads(store, acc, first, scratch);
    } else {
      if (layerwise) model->set_layer_scales(layerwise, k == 0);  // factors decided on the window's first pass
      model->backward(dloss);
    }
    scaler->backward_done();
  }
  if (fault) model->set_fault("", false);
  r.tokens = micro * model->tokens_per_batch();
  r.injected = r.injected || bad || fault;
  r.act_grads = model->stats().activation_grads;
  return loss;
}

void Trainer::Impl::end_fp8_step(StepRecord& r) {
  // This step's per-tensor counts (this rank's), then the recipe's once-per-step
  // update (delayed scaling: new scales from the amax histories, the amaxes MAX-reduced
  // over the ranks first), skipped optimizer step or not.
  const std::span<const nn::Fp8TensorStats> fp8 = model->fp8_stats();
  if (recipes) {  // the tensors the plans quantize (a tensor none of whose operands is quantized has no counts)
    for (const nn::Fp8TensorStats& s : fp8)
      if (s.elements > 0) r.fp8.push_back(s);
  } else {
    r.fp8.assign(fp8.begin(), fp8.end());
  }
  if (config.distributed) model->fp8_step_done([this](std::span<float> amaxes) { comm->allreduce_max(amaxes); });
  else model->fp8_step_done();
}

void Trainer::Impl::inject_overflow(StepRecord& r) {
  const bool here = config.inject_overflow_rank < 0 || config.inject_overflow_rank == comm->rank();
  const std::vector<std::size_t>& at = config.inject_overflow_at;
  if (std::find(at.begin(), at.end(), r.step) == at.end() || !here) return;
  ParamStore& store = model->params();
  const std::size_t t = config.inject_overflow_tensor.empty() ? 0 : store.index_of(config.inject_overflow_tensor);
  if (config.distributed) acc[store.offset(t)] = INFINITY;
  else inject_inf(store, t);
  r.injected = true;
}

void Trainer::Impl::record_gradient_telemetry(StepRecord& r) {
  const nn::BackwardStats& bs = model->stats();
  const ParamStore& store = model->params();
  r.overflow_activation = bs.first_overflow;
  r.act_grad_amax = bs.amax;
  r.act_grad_tensors = bs.tensors;
  r.headroom_log2 = bs.amax > 0 ? std::log2(static_cast<double>(format_max(model->policy().activations)) /
                                            static_cast<double>(bs.amax))
                                : std::numeric_limits<double>::infinity();
  // Per-parameter gradient amax, unscaled (the scaled gradients are what the scaler
  // checks); +inf for a tensor with a non-finite unscaled value.
  r.params.resize(store.tensor_count());
  for (std::size_t i = 0; i < store.tensor_count(); ++i) r.params[i].name = store.spec(i).name;
  const float inv_scale = 1.0f / r.scale;
  const bool histograms = histogram_step(r.step, config.histogram_every, config.steps);
  if (!zero && !histograms && can_unscale(inv_scale)) {
    // One read-only threaded pass over the stored gradients, no fp32 copy: the kernel's
    // amax is max |fl(g * inv_scale)| (= fl(max |g| * inv_scale): rounding is monotonic),
    // NaN or inf when a product is not finite.
    measure_amax(store.grad_tensors(), inv_scale, amax, pool.get());
    for (std::size_t i = 0; i < store.tensor_count(); ++i) r.params[i].grad_amax = amax[i];
    return;
  }
  std::span<float> flat(scratch);
  // Under ZeRO the reduced gradients exist only slice by slice: no per-tensor amax.
  if (zero) std::fill(flat.begin(), flat.end(), 0.0f);
  else to_f32(store.grad_data(), store.grad_dtype(), flat);
  for (float& x : flat) x *= inv_scale;
  for (std::size_t i = 0; i < store.tensor_count(); ++i) {
    bool finite = true;
    for (float x : flat.subspan(store.offset(i), store.numel(i))) finite = finite && std::isfinite(x);
    r.params[i].grad_amax = finite ? nn::amax_of(flat.subspan(store.offset(i), store.numel(i)))
                                   : std::numeric_limits<float>::infinity();
  }
  if (histograms) {
    r.histograms.emplace();
    r.histograms->activations = model->histograms().activations;
    r.histograms->activation_grads = model->histograms().activation_grads;
    for (std::size_t i = 0; i < store.tensor_count(); ++i) {
      r.histograms->weight_grads.add(flat.subspan(store.offset(i), store.numel(i)));
    }
    model->set_histograms(false);
  }
}

void Trainer::Impl::snapshot_weights() {
  const std::span<const std::byte> w = weights_of_record(model->params(), joined);
  pool->parallel_for(w.size(), 64, kParallelBytes,
                     [&](std::size_t b, std::size_t e, unsigned) { std::memcpy(&snapshot[b], &w[b], e - b); });
}

StepOutcome Trainer::Impl::step_or_skip(StepRecord& r, bool found_inf_elsewhere, std::optional<double> global_norm) {
  StepOptions so;
  if (config.clip > 0) so.max_grad_norm = static_cast<float>(config.clip);
  so.lr = r.lr;
  so.pool = pool.get();
  so.found_inf_elsewhere = found_inf_elsewhere;
  so.global_grad_norm = global_norm;
  so.loss = r.loss;  // the guards' (a non-finite loss is skipped even when the gradients are finite)
  const StepOutcome out = scaler->step(*optimizer, so);
  r.found_inf = out.found_inf;
  r.skipped = !out.applied;
  r.skip_reason = out.reason;
  r.loss_z = out.guard.loss_z;
  r.grad_z = out.guard.grad_z;
  r.grad_norm = out.grad_norm;
  r.clip_coef = out.clip_coef;
  r.overflow_param = out.first_overflow_name;
  return out;
}

void Trainer::Impl::update_loss_scale(StepRecord& r) {
  scaler->update();
  r.next_scale = scaler->get_scale();
}

void Trainer::Impl::record_weight_telemetry(StepRecord& r) {
  const ParamStore& store = model->params();
  if (!r.histograms) {
    // One read-only threaded pass over the weights of record (max |w|: scale 1), no
    // fp32 copy. measure_amax says inf for a tensor holding inf or NaN, where amax_of
    // skips NaNs: that tensor is decoded and measured as on histogram steps.
    // Views of the weights of record, taken now (the store's buffers are the truth).
    const std::span<const std::byte> record = weights_of_record(store, joined);
    const std::size_t width = record.size() / store.flat_size();
    const DType dtype = width == 4 ? DType::f32 : store.model_dtype();
    weights.clear();
    for (std::size_t i = 0; i < store.tensor_count(); ++i) {
      weights.push_back({const_cast<std::byte*>(record.data()) + store.offset(i) * width, store.numel(i), dtype});
    }
    measure_amax(weights, 1.0f, amax, pool.get());
    for (std::size_t i = 0; i < store.tensor_count(); ++i) {
      if (std::isfinite(amax[i])) {
        r.params[i].weight_amax = amax[i];
        continue;
      }
      const std::span<float> w = std::span<float>(scratch).subspan(store.offset(i), store.numel(i));
      to_f32(weights[i].data, weights[i].dtype, w);
      r.params[i].weight_amax = nn::amax_of(w);
    }
    return;
  }
  std::span<float> flat(scratch);
  store.weights_of_record(flat);
  for (std::size_t i = 0; i < store.tensor_count(); ++i) {
    r.params[i].weight_amax = nn::amax_of(flat.subspan(store.offset(i), store.numel(i)));
  }
  for (std::size_t i = 0; r.histograms && i < store.tensor_count(); ++i) {
    r.histograms->weights.add(flat.subspan(store.offset(i), store.numel(i)));
  }
}

double Trainer::evaluate() {
  Impl& m = *impl_;
  const nn::ModelConfig& mc = m.config.model;
  nn::ValidationWindows windows(m.data.validation(), mc.context);
  const std::size_t limit = m.config.eval_windows == 0 ? windows.window_count()
                                                       : std::min(m.config.eval_windows, windows.window_count());
  double sum = 0;
  std::size_t count = 0, used = 0;
  // A recipe file's evaluation plan for these forwards (none: the training plans).
  struct Evaluating {
    nn::Model& model;
    explicit Evaluating(nn::Model& x) : model(x) { model.set_evaluation(true); }
    ~Evaluating() { model.set_evaluation(false); }
  } evaluating(*m.model);
  while (used < limit) {
    std::size_t rows = windows.next(mc.batch, m.inputs, m.targets);
    if (rows == 0) break;
    rows = std::min(rows, limit - used);
    const nn::ForwardResult f = m.model->forward(m.inputs, m.targets, rows);
    sum += f.loss_sum;
    count += f.count;
    used += rows;
  }
  const double v = count == 0 ? std::numeric_limits<double>::quiet_NaN() : sum / static_cast<double>(count);
  m.totals.val_loss = v;
  return v;
}

namespace {

// summary.json's "optimizer_state" of a run with state formats: the store's formats and bytes
// (this rank's slice under ZeRO), the sampled steps' totals per tensor.
OptimizerStateSummary optimizer_state_summary(OptimizerKind kind, const RunTotals& totals, const ParamStore& st) {
  const StateFormats f = st.options().formats;
  OptimizerStateSummary o;
  o.optimizer = std::string(optimizer_name(kind));
  o.master = std::string(master_format_name(st.master_format()));
  o.m = std::string(moment_format_name(f.m));
  o.v = std::string(moment_format_name(f.v));
  o.rule = std::string(adam_rule_name(f.rule));
  o.block = f.block;
  o.fp8_per_tensor = f.fp8_per_tensor;
  o.elements = st.param_count();
  const auto per_param = [&](std::size_t bytes) {
    return st.param_count() > 0 ? static_cast<double>(bytes) / static_cast<double>(st.param_count()) : 0.0;
  };
  o.params_bytes = static_cast<double>(dtype_size(st.model_dtype()));
  o.master_bytes = per_param(st.master_bytes());
  o.m_bytes = per_param(st.state_slot_bytes(0));
  o.v_bytes = per_param(st.state_slot_bytes(1));
  o.sampled_steps = totals.state_steps;
  for (std::size_t i = 0; i < st.tensor_count(); ++i) {
    OptimizerStateSummary::Tensor t;
    t.elements = st.numel(i);
    t.master = o.master;
    ParamStore& ms = const_cast<ParamStore&>(st);  // moment() gives a writable view; only its layout is read
    t.m = std::string(moment_format_name(ms.moment(0, i).layout.format));
    t.v = std::string(moment_format_name(ms.moment(1, i).layout.format));
    t.totals.name = st.spec(i).name;
    for (const StateTotals& x : totals.optimizer_state)
      if (x.name == t.totals.name) t.totals = x;
    o.params.push_back(std::move(t));
  }
  return o;
}

}  // namespace

TrainSummary Trainer::summary() const {
  const Impl& m = *impl_;
  TrainSummary s = m.totals.summary();
  s.final_scale = m.scaler->get_scale();  // also before the first step, and after a resume
  s.memory = m.model->memory();
  if (m.zero) {  // this rank's slice
    const ParamStore& z = *m.zero->store;
    s.memory.parameter_bytes += z.bytes();
    s.memory.master_bytes += z.master_bytes();
    for (unsigned k = 0; k < z.state_slots(); ++k) s.memory.optimizer_state_bytes += z.state_slot_bytes(k);
  }
  s.param_count = m.model->params().param_count();
  s.ranks = m.comm->size();
  const ParamStore& st = m.zero ? *m.zero->store : m.model->params();
  if (m.optimizer->steps_per_tensor()) s.optimizer_state = optimizer_state_summary(m.optimizer->kind(), m.totals, st);
  return s;
}

}  // namespace mixprec::train
