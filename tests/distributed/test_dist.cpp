// Data parallelism over MPI, run by ctest as `mpirun -np 2` and `-np 3` (tests/distributed/
// mpirun.sh): the communicator's collectives against scalar references, and the
// data-parallel Trainer against a one-process run of the same global batch
// (docs/distributed.md). Every rank runs every test; a test fails on a rank when any
// rank's check failed there, and the program fails when any rank saw a failure.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "mixprec/checkpoint/safetensors.hpp"
#include "mixprec/distributed/mpi.hpp"
#include "mixprec/train/trainer.hpp"

namespace mixprec {
namespace {

dist::MpiCommunicator* g_world = nullptr;
dist::Communicator& world() { return *g_world; }

// Rank r's test data: n floats spanning many binades and both signs, reproducible on
// every rank (so each rank can compute the reference of all of them).
std::vector<float> data_of(int r, std::size_t n, std::uint32_t salt) {
  std::mt19937 g(static_cast<std::uint32_t>(r) * 7919u + salt);
  std::uniform_real_distribution<float> mant(-1.0f, 1.0f);
  std::uniform_int_distribution<int> ex(-20, 20);
  std::vector<float> v(n);
  for (float& x : v) x = std::ldexp(mant(g), ex(g));
  return v;
}

TEST(Communicator, RankAndSize) {
  EXPECT_GE(world().size(), 2);
  EXPECT_LT(world().rank(), world().size());
}

TEST(Communicator, ShardsCoverTheBufferInRankOrder) {
  for (const std::size_t n : {0u, 1u, 2u, 7u, 10u, 1001u}) {
    for (int size = 1; size <= 4; ++size) {
      std::size_t next = 0;
      for (int r = 0; r < size; ++r) {
        const dist::ShardRange s = dist::shard_range(n, size, r);
        EXPECT_EQ(s.begin, next) << n << " " << size << " " << r;
        EXPECT_LE(s.size(), n / static_cast<std::size_t>(size) + 1);
        EXPECT_GE(s.size(), n / static_cast<std::size_t>(size));
        next = s.end;
      }
      EXPECT_EQ(next, n);
    }
  }
}

// The fp32 sum is ((x_0 + x_1) + x_2) ... in rank order, bit for bit, on every rank,
// for sizes that do not divide by the rank count (and an empty buffer).
TEST(Communicator, Fp32SumIsTheRankOrderSequentialSum) {
  for (const std::size_t n : {0u, 1u, 2u, 7u, 1001u}) {
    std::vector<float> mine = data_of(world().rank(), n, 1);
    world().allreduce_sum(std::span<float>(mine));
    std::vector<float> want = data_of(0, n, 1);
    for (int r = 1; r < world().size(); ++r) {
      const std::vector<float> x = data_of(r, n, 1);
      for (std::size_t i = 0; i < n; ++i) want[i] += x[i];
    }
    for (std::size_t i = 0; i < n; ++i)
      ASSERT_EQ(std::bit_cast<std::uint32_t>(mine[i]), std::bit_cast<std::uint32_t>(want[i])) << "n " << n << " i " << i;
  }
}

// f16 / bf16: each element widened, summed in fp32 in rank order, rounded once; an
// overflow the sum creates becomes inf.
template <class T>
void low_sum_case() {
  const std::size_t n = 1001;
  auto low_of = [&](int r) {
    std::vector<float> f = data_of(r, n, 2);
    f[0] = 40000.0f;  // 40000 * ranks overflows f16 (max 65504)
    std::vector<T> v;
    for (float x : f) v.push_back(T(x));
    return v;
  };
  std::vector<T> mine = low_of(world().rank());
  world().allreduce_sum(std::span<T>(mine));
  std::vector<float> acc(n);
  for (int r = 0; r < world().size(); ++r) {
    const std::vector<T> x = low_of(r);
    for (std::size_t i = 0; i < n; ++i) acc[i] = r == 0 ? static_cast<float>(x[i]) : acc[i] + static_cast<float>(x[i]);
  }
  for (std::size_t i = 0; i < n; ++i) ASSERT_EQ(mine[i].bits(), T(acc[i]).bits()) << "i " << i;
  if constexpr (std::is_same_v<T, f16>) {
    EXPECT_TRUE(std::isinf(static_cast<float>(mine[0])));
  }
}

TEST(Communicator, F16SumIsTheFp32SumRoundedOnce) { low_sum_case<f16>(); }
TEST(Communicator, Bf16SumIsTheFp32SumRoundedOnce) { low_sum_case<bf16>(); }

TEST(Communicator, MaxTakesTheLargestAndNaNWins) {
  const int r = world().rank(), last = world().size() - 1;
  std::vector<float> v = {static_cast<float>(r), -static_cast<float>(r), r == last ? INFINITY : 0.0f,
                          r == 1 ? std::numeric_limits<float>::quiet_NaN() : 1.0f, 0.0f};
  if (r == 0) v[4] = 1.0f;  // found_inf on rank 0 only
  world().allreduce_max(v);
  EXPECT_EQ(v[0], static_cast<float>(last));
  EXPECT_EQ(v[1], 0.0f);
  EXPECT_EQ(v[2], INFINITY);
  EXPECT_TRUE(std::isnan(v[3]));
  EXPECT_EQ(v[4], 1.0f);
}

TEST(Communicator, DoubleAndIntegerSums) {
  double d[2] = {0.1 * (world().rank() + 1), 1e16};
  world().allreduce_sum(std::span<double>(d));
  double want = 0.1;
  for (int r = 1; r < world().size(); ++r) want += 0.1 * (r + 1);
  EXPECT_EQ(d[0], want);
  std::uint64_t u[2] = {static_cast<std::uint64_t>(world().rank()), std::uint64_t{1} << 60};
  world().allreduce_sum(std::span<std::uint64_t>(u));
  const auto n = static_cast<std::uint64_t>(world().size());
  EXPECT_EQ(u[0], n * (n - 1) / 2);
  EXPECT_EQ(u[1], n << 60);
}

TEST(Communicator, BroadcastFromEveryRoot) {
  for (int root = 0; root < world().size(); ++root) {
    std::vector<std::byte> b(13, std::byte{static_cast<unsigned char>(world().rank())});
    world().broadcast(b, root);
    for (std::byte x : b) EXPECT_EQ(std::to_integer<int>(x), root);
    const std::string s = world().broadcast_string(world().rank() == root ? std::string(root + 3, 'x') : "", root);
    EXPECT_EQ(s, std::string(static_cast<std::size_t>(root + 3), 'x'));
  }
}

TEST(Communicator, ReduceScatterAndAllGatherOfUnevenShards) {
  for (const std::size_t n : {2u, 10u, 1001u}) {  // 2 < 3 ranks: a rank with an empty shard
    const std::vector<float> in = data_of(world().rank(), n, 3);
    const dist::ShardRange mine = dist::shard_range(n, world().size(), world().rank());
    std::vector<float> out(mine.size());
    world().reduce_scatter_sum(in, out);
    for (std::size_t i = 0; i < mine.size(); ++i) {
      float want = data_of(0, n, 3)[mine.begin + i];
      for (int r = 1; r < world().size(); ++r) want += data_of(r, n, 3)[mine.begin + i];
      ASSERT_EQ(std::bit_cast<std::uint32_t>(out[i]), std::bit_cast<std::uint32_t>(want)) << n << " " << i;
    }
    // all_gather: every rank's shard lands in place.
    std::vector<std::uint16_t> full(n, 0xffff), shard(mine.size());
    for (std::size_t i = 0; i < mine.size(); ++i) shard[i] = static_cast<std::uint16_t>(mine.begin + i);
    world().all_gather(std::as_bytes(std::span<const std::uint16_t>(shard)), std::as_writable_bytes(std::span(full)),
                       2);
    for (std::size_t i = 0; i < n; ++i) ASSERT_EQ(full[i], static_cast<std::uint16_t>(i)) << n;
  }
  std::vector<float> wrong(1);
  if (dist::shard_range(10, world().size(), world().rank()).size() != 1) {
    EXPECT_THROW(world().reduce_scatter_sum(std::vector<float>(10), wrong), std::invalid_argument);
  }
}

TEST(Communicator, StatisticsCountCallsAndBytes) {
  world().reset_stats();
  std::vector<float> v(100, 1.0f);
  world().allreduce_sum(std::span<float>(v));
  const dist::CollectiveStats& s = world().stats()[static_cast<std::size_t>(dist::Collective::allreduce_sum_f32)];
  EXPECT_EQ(s.calls, 1u);
  // Direct algorithm: the other ranks' shards of the buffer, then this rank's shard to each other rank.
  const auto n = static_cast<std::size_t>(world().size());
  const std::size_t mine = dist::shard_range(100, world().size(), world().rank()).size();
  EXPECT_EQ(s.bytes_sent, ((100 - mine) + mine * (n - 1)) * 4);
  EXPECT_GT(s.seconds, 0.0);
}

// ---- the data-parallel Trainer -----------------------------------------------------------

train::TrainConfig tiny(nn::Precision p) {
  train::TrainConfig c;
  c.precision = p;
  c.model.layers = 1;
  c.model.heads = 2;
  c.model.channels = 16;
  c.model.context = 16;
  c.model.batch = 4;
  c.accum = 1;
  c.steps = 6;
  c.warmup = 2;
  c.corpus_tokens = 20000;
  c.vocab = "word:256";
  c.eval_every = 0;
  c.eval_windows = 4;
  c.histogram_every = 0;
  c.threads = 1;
  c.distributed = true;
  return c;
}

std::vector<std::byte> state_bytes(train::Trainer& t) {
  ParamStore& s = t.model().params();
  std::vector<std::byte> out;
  auto add = [&](const void* p, std::size_t n) {
    const auto* b = static_cast<const std::byte*>(p);
    out.insert(out.end(), b, b + n);
  };
  if (s.has_master()) add(s.master_data(), s.flat_size() * 4);
  add(s.model_data(), s.flat_size() * dtype_size(s.model_dtype()));
  for (unsigned k = 0; k < s.state_slots(); ++k) add(s.state_data(k), s.flat_size() * 4);
  const std::int64_t step = t.optimizer().step_count();
  add(&step, sizeof step);
  // The loss scale's state (the scaler's JSON also holds the accumulation window, which
  // differs between a run and its one-process reference by design).
  const std::string scale = t.scaler().loss_scale().to_json();
  add(scale.data(), scale.size());
  return out;
}

std::uint64_t fnv1a(const std::vector<std::byte>& b) {
  std::uint64_t h = 1469598103934665603ull;
  for (std::byte x : b) h = (h ^ std::to_integer<std::uint64_t>(x)) * 1099511628211ull;
  return h;
}

// Every rank holds the same bytes: the hashes of all ranks, compared on every rank.
void expect_same_on_all_ranks(const std::vector<std::byte>& state, const std::string& what) {
  const std::uint64_t h = fnv1a(state);
  std::vector<std::uint64_t> all(static_cast<std::size_t>(world().size()), 0);
  all[static_cast<std::size_t>(world().rank())] = h;
  world().allreduce_sum(std::span<std::uint64_t>(all));
  for (std::size_t r = 0; r < all.size(); ++r) EXPECT_EQ(all[r], h) << what << ": rank " << r << " differs";
}

struct RunOut {
  std::vector<train::StepRecord> log;
  std::vector<std::byte> state;
};

RunOut run(const train::TrainConfig& c, dist::Communicator* comm) {
  std::unique_ptr<train::Trainer> t =
      comm != nullptr ? std::make_unique<train::Trainer>(c, *comm) : std::make_unique<train::Trainer>(c);
  RunOut r;
  while (!t->done()) r.log.push_back(t->train_step());
  r.state = state_bytes(*t);
  return r;
}

// N ranks with accum a == one process with accum a * N over the same sequences, bitwise,
// with the fp32 reduction (accum 1 per rank: the reduction order is the micro-batch order).
TEST(DataParallel, NRanksEqualOneRankOfTheSameGlobalBatchBitwise) {
  for (const nn::Precision p : {nn::Precision::fp16, nn::Precision::bf16, nn::Precision::fp32}) {
    train::TrainConfig c = tiny(p);
    if (p == nn::Precision::fp32) c.loss_scale = "none";
    const RunOut many = run(c, &world());
    train::TrainConfig one = c;
    one.accum = c.accum * static_cast<std::size_t>(world().size());
    const RunOut ref = run(one, nullptr);  // SingleProcess, --distributed on 1 rank
    const std::string name(nn::precision_name(p));
    EXPECT_TRUE(many.state == ref.state) << name << ": weights, optimizer or scaler state differ from 1 rank";
    ASSERT_EQ(many.log.size(), ref.log.size());
    for (std::size_t i = 0; i < many.log.size(); ++i) {
      EXPECT_EQ(std::bit_cast<std::uint64_t>(many.log[i].loss), std::bit_cast<std::uint64_t>(ref.log[i].loss))
          << name << " step " << i + 1;
      EXPECT_EQ(std::bit_cast<std::uint64_t>(many.log[i].grad_norm), std::bit_cast<std::uint64_t>(ref.log[i].grad_norm))
          << name << " step " << i + 1;
      EXPECT_EQ(many.log[i].tokens, ref.log[i].tokens);
    }
    EXPECT_LT(many.log.back().loss, many.log.front().loss) << name;
    expect_same_on_all_ranks(many.state, name);
  }
}

// fp8-delayed: each rank records the amaxes of its own micro-batches; they are MAX-reduced
// before the once-per-step update, so every replica keeps the same amax histories and
// scales, equal to one process folding the same micro-batches (record_amax keeps the max).
TEST(DataParallel, Fp8DelayedScalingStateAgreesAcrossRanksAndEqualsOneRank) {
  train::TrainConfig c = tiny(nn::Precision::fp8_delayed);
  c.fp8_amax_history = 3;
  auto fp8_state = [](const train::TrainConfig& cfg, dist::Communicator* comm) {
    std::unique_ptr<train::Trainer> t =
        comm != nullptr ? std::make_unique<train::Trainer>(cfg, *comm) : std::make_unique<train::Trainer>(cfg);
    while (!t->done()) t->train_step();
    std::vector<std::byte> b = state_bytes(*t);
    const std::string j = t->model().fp8_delayed()->to_json();
    for (char ch : j) b.push_back(static_cast<std::byte>(ch));
    return std::make_pair(b, j);
  };
  const auto [many, many_json] = fp8_state(c, &world());
  train::TrainConfig one = c;
  one.accum = c.accum * static_cast<std::size_t>(world().size());
  const auto [ref, ref_json] = fp8_state(one, nullptr);
  EXPECT_EQ(many_json, ref_json) << "delayed-scaling state differs from one process";
  EXPECT_TRUE(many == ref) << "weights, optimizer, scaler or fp8 state differ from one process";
  expect_same_on_all_ranks(many, "fp8-delayed");
}

// An overflow on the last rank only: every rank skips that step and backs off the same
// scale; weights, moments, counters and scaler states stay identical everywhere, and
// equal to a one-process run where that step overflowed.
TEST(DataParallel, OverflowOnOneRankSkipsTheStepOnEveryRank) {
  train::TrainConfig c = tiny(nn::Precision::fp16);
  c.inject_overflow_at = {3};
  c.inject_overflow_rank = world().size() - 1;
  const RunOut many = run(c, &world());
  for (const train::StepRecord& r : many.log) {
    EXPECT_EQ(r.skipped, r.step == 3) << "step " << r.step;
    EXPECT_EQ(r.found_inf, r.step == 3) << "step " << r.step;
    EXPECT_EQ(r.injected, r.step == 3 && world().rank() == world().size() - 1) << "step " << r.step;
    EXPECT_EQ(r.next_scale, r.step == 3 ? r.scale / 2 : r.scale) << "step " << r.step;
  }
  expect_same_on_all_ranks(many.state, "after an overflow on one rank");
  train::TrainConfig one = c;
  one.accum = static_cast<std::size_t>(world().size());
  one.inject_overflow_rank = -1;
  const RunOut ref = run(one, nullptr);
  EXPECT_TRUE(many.state == ref.state);
}

// f16 all-reduce of the scaled gradients: not bitwise (each rank's accum-2 sum is
// rounded to f16 before the reduction), but close; identical on every rank.
TEST(DataParallel, LowPrecisionReduceIsWithinToleranceOfFp32) {
  train::TrainConfig c = tiny(nn::Precision::fp16);
  c.accum = 2;
  c.grad_reduce = "low";
  train::Trainer low(c, world());
  while (!low.done()) low.train_step();
  expect_same_on_all_ranks(state_bytes(low), "grad-reduce low");
  train::TrainConfig one = c;
  one.grad_reduce = "fp32";
  one.accum = c.accum * static_cast<std::size_t>(world().size());
  train::Trainer ref(one);
  while (!ref.done()) ref.train_step();
  const ParamStore& a = low.model().params();
  const ParamStore& b = ref.model().params();
  double max_diff = 0, max_abs = 0;
  for (std::size_t i = 0; i < a.flat_size(); ++i) {
    max_diff = std::max(max_diff, std::fabs(static_cast<double>(a.master_data()[i]) - static_cast<double>(b.master_data()[i])));
    max_abs = std::max(max_abs, std::fabs(static_cast<double>(b.master_data()[i])));
  }
  // 6 AdamW steps of lr <= 3e-3 move a weight by at most ~0.02; the f16 rounding of the
  // partial sums changes the step of a few weights, by far less than that.
  EXPECT_LT(max_diff, 5e-3) << "largest |weight| " << max_abs;
  EXPECT_GT(max_abs, 0.0);
}

// ---- ZeRO stage 1 --------------------------------------------------------------------------

// Every tensor of a checkpoint (weights of record, optimizer state), and the metadata
// that must agree (scaler, optimizer counters, sampler, schedule, step).
std::string checkpoint_state(const std::string& path) {
  const ckpt::SafetensorsFile f = ckpt::SafetensorsFile::open(path);
  std::string out;
  for (const ckpt::TensorInfo& t : f.tensors()) {
    const std::span<const std::byte> b = f.bytes(t.name);
    out.append(t.name).push_back(':');
    out.append(reinterpret_cast<const char*>(b.data()), b.size());
  }
  for (const char* k : {"mixprec.optimizer", "mixprec.sampler", "mixprec.schedule_position", "mixprec.step"})
    out.append(k).append(f.require_metadata(k));
  return out;
}

std::string temp_path(const std::string& name) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / "mixprec-test-dist";
  std::filesystem::create_directories(dir);
  return (dir / (name + "-np" + std::to_string(world().size()) + ".safetensors")).string();
}

struct Trained {
  std::vector<train::StepRecord> log;
  std::string checkpoint;  // checkpoint_state of the final checkpoint (rank 0; empty elsewhere)
  std::vector<std::byte> model_copy;
  std::size_t parameter_bytes = 0;
};

// Trains c on the world to `steps`, from `resume` when given; saves at the end
// (a collective under ZeRO; rank 0 writes).
Trained train_world(const train::TrainConfig& c, const std::string& name, std::size_t steps,
                    const std::string& resume = "") {
  train::Trainer t(c, world());
  if (!resume.empty()) t.load_checkpoint(resume);
  Trained out;
  while (t.steps_done() < steps) out.log.push_back(t.train_step());
  const std::string path = temp_path(name);
  t.save_checkpoint(path);
  world().barrier();
  if (world().rank() == 0) out.checkpoint = checkpoint_state(path);
  const ParamStore& s = t.model().params();
  const auto* m = static_cast<const std::byte*>(s.model_data());
  out.model_copy.assign(m, m + s.flat_size() * dtype_size(s.model_dtype()));
  out.parameter_bytes = t.summary().memory.parameter_bytes;
  world().barrier();
  return out;
}

// ZeRO-1 == the unsharded data-parallel run, bitwise: checkpoints (gathered master
// weights and moments), model copies, losses and norms, with an overflow on one rank
// (all slices skip together) and clipping active; and its parameter memory is smaller.
TEST(Zero, EqualsTheUnshardedRunBitwise) {
  for (const nn::Precision p : {nn::Precision::fp16, nn::Precision::bf16, nn::Precision::fp16_pure}) {
    train::TrainConfig c = tiny(p);
    c.inject_overflow_at = {3};
    c.inject_overflow_rank = 0;
    c.clip = 0.05;  // small: the global norm decides the clip coefficient every step
    const std::string name(nn::precision_name(p));
    const Trained plain = train_world(c, "plain-" + name, c.steps);
    train::TrainConfig z = c;
    z.zero = 1;
    const Trained sharded = train_world(z, "zero-" + name, c.steps);
    EXPECT_TRUE(sharded.checkpoint == plain.checkpoint) << name << ": the gathered state differs";
    EXPECT_TRUE(sharded.model_copy == plain.model_copy) << name;
    expect_same_on_all_ranks(sharded.model_copy, "zero model copy " + name);
    ASSERT_EQ(sharded.log.size(), plain.log.size());
    for (std::size_t i = 0; i < plain.log.size(); ++i) {
      const train::StepRecord &a = sharded.log[i], &b = plain.log[i];
      EXPECT_EQ(a.skipped, b.skipped) << name << " step " << i + 1;
      EXPECT_EQ(a.skipped, i + 1 == 3) << name << " step " << i + 1;
      EXPECT_EQ(a.next_scale, b.next_scale) << name << " step " << i + 1;
      EXPECT_EQ(std::bit_cast<std::uint64_t>(a.loss), std::bit_cast<std::uint64_t>(b.loss)) << name << " step " << i + 1;
      if (!a.skipped) {
        EXPECT_EQ(std::bit_cast<std::uint64_t>(a.grad_norm), std::bit_cast<std::uint64_t>(b.grad_norm))
            << name << " step " << i + 1;
        EXPECT_EQ(a.clip_coef, b.clip_coef) << name << " step " << i + 1;
        EXPECT_LT(a.clip_coef, 1.0f) << name << " step " << i + 1;
      }
    }
    EXPECT_LT(sharded.parameter_bytes, plain.parameter_bytes) << name;
    if (world().rank() == 0)
      std::printf("zero %s: parameter bytes per rank %zu (unsharded %zu)\n", name.c_str(), sharded.parameter_bytes,
                  plain.parameter_bytes);
  }
}

// A ZeRO checkpoint is one ordinary file: a ZeRO run on these ranks and an unsharded
// run both continue from it exactly as the uninterrupted ZeRO run did, and one process
// loads the same weights. (Another rank count changes the global batch, accum * ranks:
// tests/distributed/cli_dist.sh resumes 2 -> 3 ranks -> 1 process.)
TEST(Zero, CheckpointsReshardOnLoad) {
  train::TrainConfig z = tiny(nn::Precision::fp16);
  z.zero = 1;
  const Trained full = train_world(z, "reshard-full", z.steps);
  const Trained half = train_world(z, "reshard-half", 3);
  const std::string mid = temp_path("reshard-half");
  const Trained resumed = train_world(z, "reshard-resumed", z.steps, mid);
  EXPECT_TRUE(resumed.checkpoint == full.checkpoint);
  train::TrainConfig plain = z;
  plain.zero = 0;
  const Trained unsharded = train_world(plain, "reshard-unsharded", z.steps, mid);
  EXPECT_TRUE(unsharded.checkpoint == full.checkpoint);
  EXPECT_TRUE(unsharded.model_copy == full.model_copy);
  if (world().rank() == 0) {  // one process (SingleProcess) loads the same file: the same weights
    train::Trainer t(plain);
    t.load_checkpoint(mid);
    const ParamStore& s = t.model().params();
    const auto* m = static_cast<const std::byte*>(s.model_data());
    EXPECT_TRUE(std::vector<std::byte>(m, m + s.flat_size() * dtype_size(s.model_dtype())) == half.model_copy);
    EXPECT_EQ(t.steps_done(), 3u);
  }
  world().barrier();
}

TEST(DataParallel, RejectsAnOverflowRankOutsideTheCommunicator) {
  train::TrainConfig c = tiny(nn::Precision::fp16);
  c.inject_overflow_at = {2};
  c.inject_overflow_rank = world().size();
  EXPECT_THROW(train::Trainer(c, world()), std::invalid_argument);
  train::TrainConfig single = tiny(nn::Precision::fp16);
  single.distributed = false;
  EXPECT_THROW(train::Trainer(single, world()), std::invalid_argument);
}

}  // namespace
}  // namespace mixprec

int main(int argc, char** argv) {
  mixprec::dist::MpiCommunicator world(60.0);
  mixprec::g_world = &world;
  ::testing::InitGoogleTest(&argc, argv);
  int failed = RUN_ALL_TESTS() != 0 ? 1 : 0;
  std::uint64_t any = static_cast<std::uint64_t>(failed);
  world.allreduce_sum(std::span<std::uint64_t>(&any, 1));
  if (any != 0 && world.rank() == 0) std::fprintf(stderr, "test_dist: %llu rank(s) failed\n", static_cast<unsigned long long>(any));
  return any != 0 ? 1 : 0;
}
