// Trainer checkpoints (include/mixprec/train/trainer.hpp, docs/checkpoints.md): a
// safetensors file with the weights of record and the optimizer's state arrays as
// tensors, and every other piece of state as JSON strings in __metadata__.
//
// Tensors: "<param>" (the fp32 master weights, or the weights themselves in a pure
// store, in their dtype), "exp_avg.<param>" / "exp_avg_sq.<param>" (Adam, AdamW) or
// "momentum_buffer.<param>" (SGD with momentum): PyTorch's names; with --ema, "ema.<param>"
// (fp32). The low-precision
// model copy is not saved: it is round-to-nearest-even of the master weights and is
// recomputed bitwise on load.
#include <algorithm>
#include <cmath>
#include <limits>
#include <cstring>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "mixprec/core/json_read.hpp"
#include "mixprec/core/keys.hpp"
#include "mixprec/core/text.hpp"
#include "mixprec/checkpoint/safetensors.hpp"
#include "trainer_impl.hpp"

namespace mixprec::train {
namespace {

using nlohmann::json;
// Format versions: 2 adds the header checksum (every metadata entry is covered) and
// writes non-finite totals as "nan" / "inf" / "-inf"; 1 (read, never written) has
// neither, and stored non-finite totals as null.
constexpr const char* kVersion = "2";
constexpr const char* kVersionWithoutHeaderChecksum = "1";

ckpt::DType ckpt_dtype(DType t) {
  switch (t) {
    case DType::f32: return ckpt::DType::f32;
    case DType::f16: return ckpt::DType::f16;
    case DType::bf16: return ckpt::DType::bf16;
  }
  return ckpt::DType::f32;
}

std::vector<std::string> state_names(OptimizerKind k) {
  if (k == OptimizerKind::adam || k == OptimizerKind::adamw) return {"exp_avg.", "exp_avg_sq."};
  if (k == OptimizerKind::sgd_momentum) return {"momentum_buffer."};
  return {};
}

// A compact moment as checkpoint tensors: "<slot><param>" (fp32 where the layout fell back to
// fp32, else its code bytes as U8) and "<slot>scale.<param>" (its fp32 scales, when it has any).
std::vector<ckpt::TensorRef> moment_tensors(const std::string& slot, const std::string& name,
                                            const std::vector<std::uint64_t>& shape, const MomentView& v) {
  std::vector<ckpt::TensorRef> out;
  const auto* codes = static_cast<const std::byte*>(v.codes);
  if (v.layout.format == MomentFormat::fp32) {
    out.push_back({slot + name, ckpt::DType::f32, shape, {codes, v.layout.code_bytes()}});
  } else {
    out.push_back({slot + name, ckpt::DType::u8, {v.layout.code_bytes()}, {codes, v.layout.code_bytes()}});
  }
  if (v.layout.scale_count() > 0)
    out.push_back({slot + "scale." + name, ckpt::DType::f32, {v.layout.scale_count()},
                   {reinterpret_cast<const std::byte*>(v.scales), 4 * v.layout.scale_count()}});
  return out;
}

json optimizer_json(const OptimizerState& s) {
  return {{"kind", std::string(optimizer_name(s.kind))}, {"step", s.step}, {"lr", s.lr}, {"beta1", s.beta1},
          {"beta2", s.beta2}, {"eps", s.eps}, {"weight_decay", s.weight_decay}, {"momentum", s.momentum},
          {"dampening", s.dampening}, {"nesterov", s.nesterov}, {"flat_size", s.flat_size},
          {"param_count", s.param_count}};
}

// A double of the totals: a JSON number, or "nan", "inf" or "-inf" (JSON has no
// non-finite numbers; a diverged run's losses are NaN or inf and must read back).
json total_value(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  return v;
}

json totals_json(const RunTotals& t) {
  json j{{"steps", t.steps}, {"applied", t.applied}, {"skipped", t.skipped}, {"tokens", t.tokens},
         {"lost_update_sum", total_value(t.lost_update_sum)}, {"seconds", total_value(t.seconds)},
         {"final_loss", total_value(t.final_loss)},
         {"act_grads", {t.act_grads.elements, t.act_grads.nonzero, t.act_grads.nonfinite_input,
                        t.act_grads.underflow, t.act_grads.subnormal, t.act_grads.overflow}}};
  j["val_loss"] = t.val_loss ? total_value(*t.val_loss) : json(nullptr);
  if (t.val_loss_ema) j["val_loss_ema"] = total_value(*t.val_loss_ema);
  json by = json::object();
  for (std::size_t i = 1; i < kSkipReasons; ++i) by[std::string(skip_reason_name(static_cast<SkipReason>(i)))] = t.skipped_by[i];
  j["skipped_by"] = by;
  // fp8 counters per role (forward, backward): [nonzero, saturated, flushed].
  j["fp8"] = {{t.fp8_nonzero[0], t.fp8_saturated[0], t.fp8_flushed[0]},
              {t.fp8_nonzero[1], t.fp8_saturated[1], t.fp8_flushed[1]}};
  // State formats: the optimizer state's sampled steps and per-tensor totals (StateTotals).
  if (t.state_steps > 0) {
    json params = json::array();
    for (const StateTotals& x : t.optimizer_state)
      params.push_back({{"name", x.name}, {"m_steps", x.m_steps}, {"v_steps", x.v_steps},
                        {"m_error_sum", x.m_error_sum}, {"m_error_max", x.m_error_max},
                        {"v_error_sum", x.v_error_sum}, {"v_error_max", x.v_error_max}, {"meant", x.meant},
                        {"lost", x.lost}});
    j["optimizer_state"] = {{"steps", t.state_steps}, {"params", params}};
  }
  return j;
}

[[noreturn]] void bad(const std::string& file, const std::string& what) {
  throw std::runtime_error("checkpoint '" + file + "': " + what);
}

// Reads a JSON metadata entry (an object), naming the file and key on any problem.
json metadata_json(const ckpt::SafetensorsFile& f, const char* key) {
  const std::string text = f.require_metadata(key);
  json j;
  try {
    j = io::parse_json(text, "");
  } catch (const std::invalid_argument& e) {
    bad(f.source(), std::string("metadata '") + key + "': " + e.what());
  }
  if (!j.is_object())
    bad(f.source(), std::string("metadata '") + key + "': expected a JSON object, found " + std::string(j.type_name()));
  return j;
}

// "checkpoint 'P': metadata 'KEY': NAME: expected ALLOWED, found VALUE".
[[noreturn]] void bad_field(const ckpt::SafetensorsFile& f, const char* key, const char* name,
                            std::string_view allowed, const json* found) {
  const std::string value =
      found == nullptr ? std::string("nothing") : found->dump(-1, ' ', false, json::error_handler_t::replace);
  bad(f.source(), std::string("metadata '") + key + "': " + name + ": expected " + std::string(allowed) + ", found " + value);
}

const json& member(const ckpt::SafetensorsFile& f, const json& j, const char* key, const char* name,
                   std::string_view allowed) {
  const auto it = j.find(name);
  if (it == j.end()) bad_field(f, key, name, allowed, nullptr);
  return *it;
}

// A count: a JSON integer >= 0 (or a number whose value is one, as keys::integer_of reads it).
std::uint64_t count_of(const ckpt::SafetensorsFile& f, const json& v, const char* key, const char* name) {
  constexpr std::string_view allowed = "an integer >= 0";
  if (v.is_number_unsigned()) return v.get<std::uint64_t>();
  if (v.is_number_float())
    if (const auto i = keys::integer_of(v.get<double>()); i && !i->negative) return i->magnitude;
  bad_field(f, key, name, allowed, &v);
}

std::uint64_t count_field(const ckpt::SafetensorsFile& f, const json& j, const char* key, const char* name) {
  return count_of(f, member(f, j, key, name, "an integer >= 0"), key, name);
}

double number_field(const ckpt::SafetensorsFile& f, const json& j, const char* key, const char* name) {
  const json& v = member(f, j, key, name, "a number");
  if (!v.is_number()) bad_field(f, key, name, "a number", &v);
  return v.get<double>();  // finite: the reader refuses what a double cannot hold
}

bool bool_field(const ckpt::SafetensorsFile& f, const json& j, const char* key, const char* name) {
  const json& v = member(f, j, key, name, "true or false");
  if (!v.is_boolean()) bad_field(f, key, name, "true or false", &v);
  return v.get<bool>();
}

std::string string_field(const ckpt::SafetensorsFile& f, const json& j, const char* key, const char* name) {
  const json& v = member(f, j, key, name, "a string");
  if (!v.is_string()) bad_field(f, key, name, "a string", &v);
  return v.get<std::string>();
}

// A list of `n` counts.
std::vector<std::uint64_t> counts_of(const ckpt::SafetensorsFile& f, const json& v, const char* key, const char* name,
                                     std::size_t n) {
  const std::string allowed = "a list of " + std::to_string(n) + " integers >= 0";
  if (!v.is_array() || v.size() != n) bad_field(f, key, name, allowed, &v);
  std::vector<std::uint64_t> out;
  for (const json& e : v) out.push_back(count_of(f, e, key, name));
  return out;
}

// What total_value writes: a number, "nan", "inf" or "-inf"; null (how checkpoints of
// format version 1 stored a non-finite value) reads as NaN.
double total_field(const ckpt::SafetensorsFile& f, const json& j, const char* name) {
  const auto it = j.find(name);
  if (it != j.end()) {
    if (it->is_number()) return it->get<double>();
    if (it->is_null()) return std::numeric_limits<double>::quiet_NaN();
    if (it->is_string()) {
      const std::string& v = it->get_ref<const std::string&>();
      if (v == "nan") return std::numeric_limits<double>::quiet_NaN();
      if (v == "inf") return std::numeric_limits<double>::infinity();
      if (v == "-inf") return -std::numeric_limits<double>::infinity();
    }
  }
  bad_field(f, "mixprec.totals", name, "a number, \"nan\", \"inf\", \"-inf\" or null", it == j.end() ? nullptr : &*it);
}

// The settings a resumed run must share with the run that wrote the checkpoint
// (everything but how long to train and where to write).
json trajectory_settings(const TrainConfig& c) {
  json j = json::parse(to_json(c));
  // "data": the data fingerprint identifies the data, by whatever path it was given.
  // "recipe-file": the recipes themselves are compared (metadata mixprec.recipes), wherever the file is.
  for (const char* k : {"steps", "data", "recipe-file", "out", "resume", "checkpoint-every", "keep-checkpoints", "eval-every",
                        "eval-windows", "histogram-every", "threads", "inject-overflow-at", "inject-overflow-tensor",
                        // a run may resume on another number of ranks, or another reduction (docs/distributed.md)
                        "distributed", "zero", "grad-reduce", "dist-timeout", "inject-overflow-rank",
                        "inject-bad-batch-at", "inject-bad-batch", "inject-fault-at", "inject-fault"}) {
    j.erase(k);
  }
  return j;
}

}  // namespace

void Trainer::save_checkpoint(const std::string& path) const {
  const Impl& m = *impl_;
  // ZeRO: the slices gathered first (every rank takes part); rank 0 writes one
  // ordinary checkpoint of the full state, which any number of ranks can load. Slices of
  // whole tensors (state formats) gather into a store of the full layout, written as an
  // unsharded run's store is; flat slices into fp32 arrays.
  std::unique_ptr<ParamStore> gathered;
  std::vector<float> zero_weights;
  std::vector<std::vector<float>> zero_states;
  if (m.zero) {
    if (m.zero->whole_tensors) gathered = zero_gather_store(*m.zero, *m.comm, m.model->params());
    else zero_gather(*m.zero, *m.comm, m.model->params().flat_size(), zero_weights, zero_states);
    if (m.comm->rank() != 0) return;
  }
  const ParamStore& s = gathered ? *gathered : m.model->params();
  const bool flat_zero = m.zero && !gathered;
  auto state_of = [&](unsigned k) -> const float* { return flat_zero ? zero_states[k].data() : s.state_data(k); };
  std::vector<ckpt::TensorRef> tensors;
  const bool master = flat_zero ? m.zero->store->has_master() : s.has_master();
  const DType wt = master ? DType::f32 : s.model_dtype();
  std::vector<float> joined;  // remainder masters: the fp32 weights of record, rebuilt
  if (s.master_format() == MasterFormat::remainder) {
    joined.resize(s.flat_size());
    s.weights_of_record(joined);
  }
  const auto* weights = master ? reinterpret_cast<const std::byte*>(flat_zero        ? zero_weights.data()
                                                                    : joined.empty() ? s.master_data()
                                                                                     : joined.data())
                               : static_cast<const std::byte*>(s.model_data());
  const std::vector<std::string> slots = state_names(m.optimizer->kind());
  for (std::size_t i = 0; i < s.tensor_count(); ++i) {
    const ParamSpec& spec = s.spec(i);
    const std::vector<std::uint64_t> shape(spec.shape.begin(), spec.shape.end());
    const std::size_t n = s.numel(i);
    tensors.push_back({spec.name, ckpt_dtype(wt), shape, {weights + s.offset(i) * dtype_size(wt), n * dtype_size(wt)}});
    for (unsigned k = 0; k < slots.size(); ++k) {
      if (s.compact_moments()) {  // the codes and scales as stored (resume is bitwise)
        const MomentView v = const_cast<ParamStore&>(s).moment(k, i);
        for (const ckpt::TensorRef& t : moment_tensors(slots[k], spec.name, shape, v)) tensors.push_back(t);
        continue;
      }
      const auto* st = reinterpret_cast<const std::byte*>(state_of(k) + s.offset(i));
      tensors.push_back({slots[k] + spec.name, ckpt::DType::f32, shape, {st, n * 4}});
    }
    if (!m.ema.empty()) {
      const auto* e = reinterpret_cast<const std::byte*>(m.ema.data() + s.offset(i));
      tensors.push_back({"ema." + spec.name, ckpt::DType::f32, shape, {e, n * 4}});
    }
  }
  OptimizerState os = m.optimizer->state();
  os.flat_size = s.flat_size();  // the full layout (under ZeRO the optimizer holds a slice)
  os.param_count = s.param_count();
  std::map<std::string, std::string> meta{
      {"mixprec.version", kVersion},
      {"mixprec.config", to_json(m.config)},
      {"mixprec.scaler", m.scaler->state_json()},
      {"mixprec.optimizer", optimizer_json(os).dump()},
      {"mixprec.schedule_position", std::to_string(m.schedule.position())},
      {"mixprec.sampler", json{{"seed", m.sampler.state().seed}, {"counter", m.sampler.state().counter}}.dump()},
      {"mixprec.totals", totals_json(m.totals).dump()},
      {"mixprec.data_fingerprint", std::to_string(m.data.fingerprint())},
      {"mixprec.step", std::to_string(m.totals.steps)},
  };
  // fp8-delayed: the amax histories and scales (the only fp8 state that carries over steps).
  if (const lowp::DelayedScaling* d = m.model->fp8_delayed()) meta["mixprec.fp8"] = d->to_json();
  // --recipe-file: the recipes the run trains with (the file as read, in lowp::to_json's form).
  if (m.recipes) meta["mixprec.recipes"] = lowp::to_json(*m.recipes);
  ckpt::WriteOptions options;
  options.header_checksum = true;  // every metadata entry is covered (format version 2)
  ckpt::write_file(path, tensors, meta, options);
}

void Trainer::load_checkpoint(const std::string& path) {
  Impl& m = *impl_;
  const ckpt::SafetensorsFile f = ckpt::SafetensorsFile::open(path);
  const std::string& src = f.source();

  // 1. Validate everything into temporaries.
  const std::string version = f.require_metadata("mixprec.version");
  if (version != kVersion && version != kVersionWithoutHeaderChecksum)
    bad(src, "format version: expected " + std::string(kVersionWithoutHeaderChecksum) + " or " + kVersion + ", found " +
                 version);
  if (version == kVersion && !f.header_checked())
    bad(src, "format version " + version + ": expected metadata '" + std::string(ckpt::kHeaderChecksumKey) +
                 "' (the header checksum), found none (the file is damaged or was edited)");
  TrainConfig saved;
  try {
    saved = apply_json(TrainConfig{}, f.require_metadata("mixprec.config"), "checkpoint config");
  } catch (const std::exception& e) {
    bad(src, std::string("config: ") + e.what());
  }
  const json want = trajectory_settings(m.config), have = trajectory_settings(saved);
  for (const auto& [key, value] : want.items()) {
    if (!have.contains(key) || have[key] != value) {
      bad(src, "written by a run with " + key + " = " + (have.contains(key) ? have[key].dump() : "(absent)") +
                   "; this run has " + value.dump() + " (resume with the run's own configuration)");
    }
  }
  if (f.require_metadata("mixprec.data_fingerprint") != std::to_string(m.data.fingerprint())) {
    bad(src, "data fingerprint differs: the checkpoint was written for other training data or vocabulary");
  }
  // The recipes of a recipe file: the run's own, by whatever path the file is given.
  const std::optional<std::string_view> saved_recipes = f.metadata_value("mixprec.recipes");
  if (m.recipes && !saved_recipes)
    bad(src, "recipes: expected metadata 'mixprec.recipes' (this run has --recipe-file " +
                 text::squote(m.config.recipe_file) + "), found none: the run was started without a recipe file");
  if (!m.recipes && saved_recipes)
    bad(src, "recipes: expected none (this run has no --recipe-file), found metadata 'mixprec.recipes': resume with "
             "the run's recipe file");
  if (m.recipes && *saved_recipes != lowp::to_json(*m.recipes))
    bad(src, "recipes: the recipe file " + text::squote(m.config.recipe_file) + " differs from the recipes the run was "
             "started with (metadata 'mixprec.recipes'); a resumed run keeps its recipes");
  if (m.recipes && saved.steps != m.config.steps) {
    // A fraction of the run's steps would move with them: the schedule would change under the run.
    for (std::size_t i = 0; i < m.recipes->schedule.size(); ++i)
      if (m.recipes->schedule[i].from_fraction)
        bad(src, "steps: the recipe file places schedule[" + std::to_string(i) +
                     "] at a fraction of the run's steps (from_fraction); expected the run's " +
                     std::to_string(saved.steps) + " steps, found " + std::to_string(m.config.steps));
  }
  const ParamStore& s = m.model->params();
  const bool master = m.zero ? m.zero->store->has_master() : s.has_master();
  const DType wt = master ? DType::f32 : s.model_dtype();
  const std::vector<std::string> slots = state_names(m.optimizer->kind());
  // The run's moment layouts (an unsharded store's and every ZeRO slice's alike).
  const StateFormats formats = state_formats(m.config);
  const bool compact = formats.m != MomentFormat::fp32 || formats.v != MomentFormat::fp32;
  std::vector<std::span<const std::byte>> weights, states, emas;  // emas: --ema's "ema.<param>"
  for (std::size_t i = 0; i < s.tensor_count(); ++i) {
    const ParamSpec& spec = s.spec(i);
    const std::vector<std::uint64_t> shape(spec.shape.begin(), spec.shape.end());
    weights.push_back(f.expect(spec.name, ckpt_dtype(wt), shape));
    for (unsigned k = 0; k < slots.size(); ++k) {
      const std::string& slot = slots[k];
      if (!compact) {
        states.push_back(f.expect(slot + spec.name, ckpt::DType::f32, shape));
        continue;
      }
      const MomentLayout l = moment_layout(k == 0 ? formats.m : formats.v, k == 0, s.numel(i), formats);
      states.push_back(l.format == MomentFormat::fp32 ? f.expect(slot + spec.name, ckpt::DType::f32, shape)
                                                      : f.expect(slot + spec.name, ckpt::DType::u8, {l.code_bytes()}));
      if (l.scale_count() > 0) states.push_back(f.expect(slot + "scale." + spec.name, ckpt::DType::f32, {l.scale_count()}));
    }
    if (!m.ema.empty()) emas.push_back(f.expect("ema." + spec.name, ckpt::DType::f32, shape));
  }
  std::unique_ptr<GradScaler> scaler = make_scaler(m.config, m.config.distributed ? m.comm : nullptr);
  try {
    scaler->load_state_json(f.require_metadata("mixprec.scaler"));
  } catch (const std::exception& e) {
    bad(src, std::string("scaler state: ") + e.what());
  }
  const json oj = metadata_json(f, "mixprec.optimizer");
  OptimizerState os = m.optimizer->state();
  const std::string kind = string_field(f, oj, "mixprec.optimizer", "kind");
  if (kind != optimizer_name(os.kind)) bad(src, "optimizer: expected " + std::string(optimizer_name(os.kind)) + ", found " + kind);
  const std::uint64_t step = count_field(f, oj, "mixprec.optimizer", "step");
  if (step > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
    bad_field(f, "mixprec.optimizer", "step", "an integer in [0, 2^63 - 1]", &oj["step"]);
  os.step = static_cast<std::int64_t>(step);
  os.lr = number_field(f, oj, "mixprec.optimizer", "lr");
  os.beta1 = number_field(f, oj, "mixprec.optimizer", "beta1");
  os.beta2 = number_field(f, oj, "mixprec.optimizer", "beta2");
  os.eps = number_field(f, oj, "mixprec.optimizer", "eps");
  os.weight_decay = number_field(f, oj, "mixprec.optimizer", "weight_decay");
  os.momentum = number_field(f, oj, "mixprec.optimizer", "momentum");
  os.dampening = number_field(f, oj, "mixprec.optimizer", "dampening");
  os.nesterov = bool_field(f, oj, "mixprec.optimizer", "nesterov");
  os.flat_size = count_field(f, oj, "mixprec.optimizer", "flat_size");
  os.param_count = count_field(f, oj, "mixprec.optimizer", "param_count");
  if (m.zero) {  // a checkpoint holds the full layout; this rank's optimizer steps its slice
    if (os.flat_size != s.flat_size() || os.param_count != s.param_count())
      bad(src, "optimizer: expected the layout of " + std::to_string(s.param_count()) + " parameters (" +
                   std::to_string(s.flat_size()) + " padded), found " + std::to_string(os.param_count) + " (" +
                   std::to_string(os.flat_size) + ")");
    os.flat_size = m.optimizer->state().flat_size;
    os.param_count = m.optimizer->state().param_count;
  }
  std::int64_t position = 0;
  {
    const std::string p = f.require_metadata("mixprec.schedule_position");
    const std::optional<keys::Integer> i = keys::parse_integer(p);  // the number grammar of every key
    if (!i || i->negative || i->magnitude > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
      bad(src, "metadata 'mixprec.schedule_position': expected an integer in [0, 2^63 - 1], found " + text::squote(p));
    position = static_cast<std::int64_t>(i->magnitude);
  }
  const json sj = metadata_json(f, "mixprec.sampler");
  const nn::SamplerState sampler{count_field(f, sj, "mixprec.sampler", "seed"),
                                 count_field(f, sj, "mixprec.sampler", "counter")};
  const json tj = metadata_json(f, "mixprec.totals");
  RunTotals t;
  t.steps = count_field(f, tj, "mixprec.totals", "steps");
  t.applied = count_field(f, tj, "mixprec.totals", "applied");
  t.skipped = count_field(f, tj, "mixprec.totals", "skipped");
  t.tokens = count_field(f, tj, "mixprec.totals", "tokens");
  t.lost_update_sum = total_field(f, tj, "lost_update_sum");
  t.seconds = total_field(f, tj, "seconds");
  t.final_loss = total_field(f, tj, "final_loss");
  t.final_loss_finite = std::isfinite(t.final_loss);
  t.lost_update_steps = t.applied;  // the Trainer's fractions are always finite
  const auto ag = counts_of(f, member(f, tj, "mixprec.totals", "act_grads", "a list of 6 integers >= 0"),
                            "mixprec.totals", "act_grads", 6);
  t.act_grads = {ag[0], ag[1], ag[2], ag[3], ag[4], ag[5]};
  if (tj.contains("val_loss") && !tj["val_loss"].is_null()) t.val_loss = total_field(f, tj, "val_loss");
  if (tj.contains("val_loss_ema")) t.val_loss_ema = total_field(f, tj, "val_loss_ema");
  if (tj.contains("skipped_by")) {  // absent in checkpoints written before the step guards
    const json& by = tj["skipped_by"];
    if (!by.is_object()) bad(src, "metadata 'mixprec.totals': field 'skipped_by' must be an object of counts");
    std::uint64_t sum = 0;
    for (const auto& item : by.items()) {
      const std::optional<SkipReason> reason = parse_skip_reason(item.key());
      if (!reason || *reason == SkipReason::none || !item.value().is_number_unsigned())
        bad(src, "metadata 'mixprec.totals': skipped_by: expected counts of the skip reasons, found '" + item.key() +
                     "': " + item.value().dump());
      t.skipped_by[static_cast<std::size_t>(*reason)] = item.value().get<std::uint64_t>();
      sum += item.value().get<std::uint64_t>();
    }
    if (sum != t.skipped)
      bad(src, "metadata 'mixprec.totals': skipped_by sums to " + std::to_string(sum) + ", skipped is " +
                   std::to_string(t.skipped));
  } else {
    t.skipped_by[static_cast<std::size_t>(SkipReason::nonfinite_grad)] = t.skipped;  // the only reason there was
  }
  if (tj.contains("fp8")) {  // absent in checkpoints written before the fp8 presets
    const json& f8 = tj["fp8"];
    if (!f8.is_array() || f8.size() != 2) bad_field(f, "mixprec.totals", "fp8", "2 rows of 3 integers >= 0", &f8);
    for (std::size_t role = 0; role < 2; ++role) {
      const auto row = counts_of(f, f8[role], "mixprec.totals", "fp8", 3);
      t.fp8_nonzero[role] = row[0];
      t.fp8_saturated[role] = row[1];
      t.fp8_flushed[role] = row[2];
    }
  }
  if (tj.contains("optimizer_state")) {  // runs with state formats that measured them
    const json& o = tj["optimizer_state"];
    const char* k = "mixprec.totals";
    const std::string allowed = "{\"steps\", \"params\": [{name, m_steps, v_steps, m_error_sum, m_error_max, "
                                "v_error_sum, v_error_max, meant, lost}]}";
    if (!o.is_object() || !o.contains("params") || !o["params"].is_array())
      bad_field(f, k, "optimizer_state", allowed, &o);
    t.state_steps = count_field(f, o, k, "steps");
    for (const json& p : o["params"]) {
      if (!p.is_object()) bad_field(f, k, "optimizer_state", allowed, &p);
      StateTotals x;
      x.name = string_field(f, p, k, "name");
      x.m_steps = count_field(f, p, k, "m_steps");
      x.v_steps = count_field(f, p, k, "v_steps");
      x.m_error_sum = number_field(f, p, k, "m_error_sum");
      x.m_error_max = number_field(f, p, k, "m_error_max");
      x.v_error_sum = number_field(f, p, k, "v_error_sum");
      x.v_error_max = number_field(f, p, k, "v_error_max");
      x.meant = count_field(f, p, k, "meant");
      x.lost = count_field(f, p, k, "lost");
      if (x.lost > x.meant) bad_field(f, k, "optimizer_state.lost", "at most meant", &p);
      t.optimizer_state.push_back(std::move(x));
    }
  }
  // fp8-delayed state: present exactly when this run uses delayed scaling, and matching
  // its tensors (checked here, loaded with the rest after every check).
  std::optional<lowp::DelayedScalingState> fp8_state;
  const lowp::DelayedScaling* delayed = m.model->fp8_delayed();
  const bool has_fp8 = f.metadata_value("mixprec.fp8").has_value();
  if (delayed != nullptr && !has_fp8) bad(src, "fp8 delayed-scaling state: expected metadata 'mixprec.fp8', found none");
  if (delayed == nullptr && has_fp8) {
    bad(src, "fp8 delayed-scaling state: expected none (precision " +
                 std::string(nn::precision_name(m.config.precision)) + "), found metadata 'mixprec.fp8'");
  }
  if (delayed != nullptr) {
    try {
      fp8_state = lowp::DelayedScalingState::from_json(f.require_metadata("mixprec.fp8"));
      m.model->check_fp8_delayed(*fp8_state);
    } catch (const std::invalid_argument& e) {
      bad(src, std::string("metadata 'mixprec.fp8': ") + e.what());
    }
  }
  if (t.applied + t.skipped != t.steps || static_cast<std::uint64_t>(os.step) != t.applied) {
    bad(src, "inconsistent counters: steps " + std::to_string(t.steps) + ", applied " + std::to_string(t.applied) +
                 ", skipped " + std::to_string(t.skipped) + ", optimizer steps " + std::to_string(os.step));
  }
  if (t.steps > m.config.steps) {
    bad(src, "holds " + std::to_string(t.steps) + " steps, more than this run's --steps " +
                 std::to_string(m.config.steps));
  }

  // 2. Commit: the optimizer first (it re-checks and may still refuse, before anything
  // else changed), then the rest, which cannot fail.
  m.optimizer->load_state(os);
  ParamStore& st = m.model->params();
  if (m.zero && m.zero->whole_tensors) {
    // Whole tensors: the model copy of every tensor (the bf16 half of a remainder master, as
    // split_master rounds it), this rank's tensors' weights and state as stored.
    ZeroShard& z = *m.zero;
    ParamStore& zs = *z.store;
    std::vector<std::int16_t> rem;
    for (std::size_t i = 0, k = 0; i < st.tensor_count(); ++i) {
      const std::size_t n = st.numel(i);
      const bool mine = i >= z.first_tensor && i < z.first_tensor + zs.tensor_count();
      const std::size_t j = i - z.first_tensor;
      const auto* w = reinterpret_cast<const float*>(weights[i].data());
      if (!master) {  // the model weights are the weights of record
        const std::size_t ds = dtype_size(st.model_dtype());
        std::memcpy(static_cast<std::byte*>(st.model_data()) + st.offset(i) * ds, weights[i].data(), n * ds);
        if (mine) std::memcpy(static_cast<std::byte*>(zs.model_data()) + zs.offset(j) * ds, weights[i].data(), n * ds);
      } else if (zs.master_format() == MasterFormat::remainder) {
        rem.resize(n);
        split_master(w, static_cast<std::uint16_t*>(st.model_data()) + st.offset(i), rem.data(), n);
        if (mine) split_master(w, static_cast<std::uint16_t*>(zs.model_data()) + zs.offset(j),
                               zs.remainder_data() + zs.offset(j), n);
      } else {
        std::span<const float> wv(w, n);
        std::byte* model = static_cast<std::byte*>(st.model_data()) + st.offset(i) * dtype_size(st.model_dtype());
        switch (st.model_dtype()) {
          case DType::f32: std::memcpy(model, w, n * 4); break;
          case DType::f16: convert(wv, std::span<f16>(reinterpret_cast<f16*>(model), n)); break;
          case DType::bf16: convert(wv, std::span<bf16>(reinterpret_cast<bf16*>(model), n)); break;
        }
        if (mine) std::memcpy(zs.master_data() + zs.offset(j), w, n * 4);
      }
      for (unsigned slot = 0; slot < slots.size(); ++slot, ++k) {
        const bool scaled = compact && moment_layout(slot == 0 ? formats.m : formats.v, slot == 0, n, formats)
                                               .scale_count() > 0;
        if (mine) {
          const MomentView v = zs.moment(slot, j);
          std::memcpy(v.codes, states[k].data(), states[k].size());
          if (scaled) std::memcpy(v.scales, states[k + 1].data(), states[k + 1].size());
        }
        if (scaled) ++k;
      }
    }
    if (master && zs.master_format() != MasterFormat::remainder) zs.refresh_model();
    zs.zero_grads();
  } else if (m.zero) {
    // Resharded on load: this rank's slice of every tensor, whatever wrote the file.
    ZeroShard& z = *m.zero;
    ParamStore& zs = *z.store;
    const std::size_t ds = dtype_size(st.model_dtype());
    for (std::size_t i = 0, k = 0; i < st.tensor_count(); ++i) {
      const std::size_t off = st.offset(i), n = st.numel(i);
      const std::size_t lo = std::max(off, z.begin), hi = std::min(off + n, z.end);
      auto* model = static_cast<std::byte*>(st.model_data()) + off * ds;
      if (master) {
        const std::span<const float> w(reinterpret_cast<const float*>(weights[i].data()), n);
        switch (st.model_dtype()) {
          case DType::f32: std::memcpy(model, w.data(), n * 4); break;
          case DType::f16: convert(w, std::span<f16>(reinterpret_cast<f16*>(model), n)); break;
          case DType::bf16: convert(w, std::span<bf16>(reinterpret_cast<bf16*>(model), n)); break;
        }
        if (lo < hi) std::memcpy(zs.master_data() + (lo - z.begin), w.data() + (lo - off), (hi - lo) * 4);
      } else {
        std::memcpy(model, weights[i].data(), weights[i].size());
      }
      for (unsigned slot = 0; slot < slots.size(); ++slot, ++k) {
        const auto* sv = reinterpret_cast<const float*>(states[k].data());
        if (lo < hi) std::memcpy(zs.state_data(slot) + (lo - z.begin), sv + (lo - off), (hi - lo) * 4);
      }
    }
    if (master) {
      zs.refresh_model();
    } else {
      std::memcpy(zs.model_data(), static_cast<const std::byte*>(st.model_data()) + z.begin * ds,
                  (z.end - z.begin) * ds);
    }
    zs.zero_grads();
  } else {
    const bool remainder = st.master_format() == MasterFormat::remainder;
    auto* w = remainder ? nullptr
              : master  ? reinterpret_cast<std::byte*>(st.master_data())
                        : static_cast<std::byte*>(st.model_data());
    for (std::size_t i = 0, k = 0; i < st.tensor_count(); ++i) {
      if (remainder) {  // the fp32 master split into the bf16 weights and their remainders
        split_master(reinterpret_cast<const float*>(weights[i].data()),
                     static_cast<std::uint16_t*>(st.model_data()) + st.offset(i), st.remainder_data() + st.offset(i),
                     st.numel(i));
      } else {
        std::memcpy(w + st.offset(i) * dtype_size(wt), weights[i].data(), weights[i].size());
      }
      for (unsigned slot = 0; slot < slots.size(); ++slot, ++k) {
        if (!st.compact_moments()) {
          std::memcpy(st.state_data(slot) + st.offset(i), states[k].data(), states[k].size());
          continue;
        }
        const MomentView v = st.moment(slot, i);
        std::memcpy(v.codes, states[k].data(), states[k].size());
        if (v.layout.scale_count() > 0) {
          ++k;
          std::memcpy(v.scales, states[k].data(), states[k].size());
        }
      }
    }
  }
  for (std::size_t i = 0; i < emas.size(); ++i) std::memcpy(m.ema.data() + st.offset(i), emas[i].data(), emas[i].size());
  st.refresh_model();
  st.zero_grads();
  m.model->weights_updated();
  if (fp8_state) m.model->load_fp8_delayed(*fp8_state);
  m.scaler = std::move(scaler);
  m.schedule.set_position(position);
  m.sampler.restore(sampler);
  m.totals = t;  // the step times (the median) restart: this process's steps
  m.model->set_recipe_step(m.totals.steps);  // the schedule where the run left it
}

}  // namespace mixprec::train
