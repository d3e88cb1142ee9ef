// The GradScaler conformance suite's C++ runner (cases.json beside this file): one list of
// protocol cases, run against mixprec::GradScaler (tests/scaler/test_conformance.cpp) and
// mixprec::torch::GradScaler (tests/torch/test_conformance.cpp) through the Door interface;
// tests/python/test_conformance.py runs the same list against mixprec.torch.GradScaler.
#pragma once

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <bit>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "mixprec/formats/dtype.hpp"
#include "mixprec/formats/types.hpp"
#include "mixprec/scaler/loss_scale.hpp"
#include "mixprec/scaler/protocol.hpp"

namespace mixprec::conformance {

using json = nlohmann::json;

// A gradient tensor's values as the case writes them; nullopt: the parameter has no gradient.
using Values = std::vector<std::optional<std::vector<double>>>;

struct Outcome {
  bool applied = false;
  bool found_inf = false;
  std::int64_t first_overflow = -1;
};

// What a case builds: one optimizer (SGD, lr 1/16) per entry, with one parameter of 4
// elements per dtype named in it.
struct CaseSetup {
  LossScaleConfig config;
  bool enabled = true;
  std::vector<std::vector<DType>> optimizers;
};

// Thrown by a door's optimizer when the case asked it to (throw_next_step).
struct OptimizerRaised : std::runtime_error {
  OptimizerRaised() : std::runtime_error("the optimizer raised (as the case asked)") {}
};

class Door {
 public:
  virtual ~Door() = default;
  virtual void set_grads(std::size_t opt, const Values& values) = 0;
  virtual std::vector<std::vector<double>> grads(std::size_t opt) = 0;  // defined gradients, as doubles
  virtual std::vector<std::uint64_t> weight_bits(std::size_t opt) = 0;
  virtual void unscale(std::size_t opt) = 0;
  virtual Outcome step(std::size_t opt) = 0;
  virtual void update() = 0;
  virtual double scale() = 0;
  virtual double next_scale() = 0;
  virtual void backward_done() = 0;
  virtual void set_accumulation_steps(int k) = 0;
  virtual std::string state_json() = 0;
  virtual void load_state_json(const std::string& text) = 0;
  virtual void reconfigure(const std::string& key, const std::string& value) = 0;
  virtual void fresh_scaler(const LossScaleConfig& config, bool enabled) = 0;  // the optimizers kept
  virtual void throw_next_step(std::size_t opt) = 0;
};

using DoorFactory = std::function<std::unique_ptr<Door>(const CaseSetup&)>;

// The calls both C++ doors take as they are (their ScalerDoor base): a door derives from this
// and adds its parameters, gradients and optimizer.
template <class Scaler>
class ScalerDoorCalls : public Door {
 public:
  ScalerDoorCalls(const LossScaleConfig& config, bool enabled) : scaler_(std::make_unique<Scaler>(config, enabled)) {}
  void update() override { scaler_->update(); }
  double scale() override { return scaler_->get_scale(); }
  double next_scale() override { return scaler_->next_scale(); }
  void backward_done() override { scaler_->backward_done(); }
  void set_accumulation_steps(int k) override { scaler_->set_accumulation_steps(k); }
  std::string state_json() override { return scaler_->state_json(); }
  void load_state_json(const std::string& text) override { scaler_->load_state_json(text); }
  void reconfigure(const std::string& key, const std::string& value) override { scaler_->reconfigure(key, value); }
  void fresh_scaler(const LossScaleConfig& config, bool enabled) override {
    scaler_ = std::make_unique<Scaler>(config, enabled);
  }

 protected:
  std::unique_ptr<Scaler> scaler_;
};

inline double value_of(const json& v) {
  if (v.is_string()) {
    const std::string s = v.get<std::string>();
    if (s == "inf") return std::numeric_limits<double>::infinity();
    if (s == "-inf") return -std::numeric_limits<double>::infinity();
    if (s == "nan") return std::numeric_limits<double>::quiet_NaN();
    throw std::invalid_argument("cases.json: unknown value '" + s + "'");
  }
  return v.get<double>();
}

inline Values values_of(const json& j) {
  Values out;
  for (const json& t : j) {
    if (t.is_null()) {
      out.emplace_back(std::nullopt);
      continue;
    }
    std::vector<double> v;
    for (const json& x : t) v.push_back(value_of(x));
    out.emplace_back(std::move(v));
  }
  return out;
}

// A value as the dtype stores it, back as a double (what a door's grads() returns).
inline double in_dtype(DType t, double v) {
  switch (t) {
    case DType::f32: return static_cast<double>(static_cast<float>(v));
    case DType::f16: return static_cast<double>(static_cast<float>(f16(static_cast<float>(v))));
    case DType::bf16: return static_cast<double>(static_cast<float>(bf16(static_cast<float>(v))));
  }
  return v;
}

inline DType dtype_of(const std::string& s) {
  if (s == "f32") return DType::f32;
  if (s == "f16") return DType::f16;
  if (s == "bf16") return DType::bf16;
  throw std::invalid_argument("cases.json: unknown dtype '" + s + "'");
}

inline LossScaleConfig config_of(const json& c, const std::string& preset) {
  std::vector<std::pair<std::string, std::string>> overrides;
  if (c.contains("overrides"))
    for (const auto& [k, v] : c["overrides"].items()) overrides.emplace_back(k, v.get<std::string>());
  return make_loss_scale_config(preset, overrides);
}

inline json load_cases() {
  std::ifstream f(MIXPREC_CONFORMANCE_CASES);
  if (!f) throw std::runtime_error("cannot open " + std::string(MIXPREC_CONFORMANCE_CASES));
  return json::parse(f);
}

inline std::vector<std::string> case_names(const std::string& door) {
  std::vector<std::string> names;
  const json all = load_cases();  // kept alive: ranging over a temporary's member would dangle
  for (const json& c : all["cases"]) {
    if (c.contains("doors")) {
      bool here = false;
      for (const json& d : c["doors"]) here = here || d == door;
      if (!here) continue;
    }
    names.push_back(c["name"].get<std::string>());
  }
  return names;
}

// The class of an error, as cases.json names it.
inline std::string error_class(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const ScalerMisuse& m) {
    return std::string(misuse_name(m.kind()));
  } catch (const ScaleCollapseError&) {
    return "scale_collapse";
  } catch (const OptimizerRaised&) {
    return "optimizer_raised";
  } catch (const std::invalid_argument&) {
    return "invalid_state";
  } catch (const std::exception& x) {
    return std::string("unexpected: ") + x.what();
  }
}

inline void run_case(const std::string& door_name, const std::string& name, const DoorFactory& make) {
  json c;
  const json all = load_cases();
  for (const json& k : all["cases"])
    if (k["name"] == name) c = k;
  ASSERT_FALSE(c.is_null()) << name;
  CaseSetup setup;
  const std::string preset = c["preset"].get<std::string>();
  setup.config = config_of(c, preset);
  setup.enabled = c.value("enabled", true);
  for (const json& o : c["optimizers"]) {
    std::vector<DType> ds;
    for (const json& d : o) ds.push_back(dtype_of(d.get<std::string>()));
    setup.optimizers.push_back(ds);
  }
  std::unique_ptr<Door> door = make(setup);
  std::vector<std::vector<std::uint64_t>> snapshot(setup.optimizers.size());
  std::string saved;
  int at = 0;
  for (const json& op : c["ops"]) {
    const std::string what = door_name + " " + name + " op " + std::to_string(at++) + " " + op.dump();
    const std::string kind = op["op"].get<std::string>();
    const std::size_t opt = op.value("opt", 0);
    std::exception_ptr error;
    Outcome out;
    try {
      if (kind == "grads") {
        door->set_grads(opt, values_of(op["values"]));
        snapshot[opt] = door->weight_bits(opt);
      } else if (kind == "unscale") {
        door->unscale(opt);
      } else if (kind == "step") {
        out = door->step(opt);
      } else if (kind == "update") {
        door->update();
      } else if (kind == "backward_done") {
        door->backward_done();
      } else if (kind == "set_accumulation_steps") {
        door->set_accumulation_steps(op["k"].get<int>());
      } else if (kind == "save") {
        saved = door->state_json();
      } else if (kind == "load_saved") {
        door->load_state_json(saved);
      } else if (kind == "load_json") {
        door->load_state_json(op["state"].dump());
      } else if (kind == "fresh_scaler") {
        door->fresh_scaler(op.contains("preset") ? config_of(op, op["preset"].get<std::string>()) : setup.config,
                           setup.enabled);
      } else if (kind == "reconfigure") {
        door->reconfigure(op["key"].get<std::string>(), op["value"].get<std::string>());
      } else if (kind == "throw_next_step") {
        door->throw_next_step(opt);
      } else if (kind == "scale" || kind == "next_scale") {
        const double got = kind == "scale" ? door->scale() : door->next_scale();
        const double want = value_of(op["value"]);
        EXPECT_EQ(got, want) << what;
      } else if (kind == "grads_are") {
        const Values want = values_of(op["values"]);
        const auto got = door->grads(opt);
        ASSERT_EQ(got.size(), want.size()) << what;
        for (std::size_t t = 0; t < want.size(); ++t) {
          ASSERT_TRUE(want[t].has_value()) << what;
          ASSERT_EQ(got[t].size(), want[t]->size()) << what;
          for (std::size_t k = 0; k < got[t].size(); ++k)
            EXPECT_EQ(std::bit_cast<std::uint64_t>(got[t][k]),
                      std::bit_cast<std::uint64_t>(in_dtype(setup.optimizers[opt][t], (*want[t])[k])))
                << what << " tensor " << t << " element " << k << ": " << got[t][k];
        }
      } else if (kind == "weights") {
        const bool moved = door->weight_bits(opt) != snapshot[opt];
        EXPECT_EQ(moved, op["moved"].get<bool>()) << what;
      } else if (kind == "state") {
        const json s = json::parse(door->state_json());
        for (const auto& [k, v] : op["fields"].items()) {
          ASSERT_TRUE(s.contains(k)) << what << ": no field " << k << " in " << s.dump();
          EXPECT_EQ(s[k].get<double>(), v.get<double>()) << what << ": field " << k;
        }
      } else {
        FAIL() << what << ": unknown op";
      }
    } catch (...) {
      error = std::current_exception();
    }
    if (op.contains("error")) {
      ASSERT_TRUE(error) << what << ": expected error " << op["error"];
      EXPECT_EQ(error_class(error), op["error"].get<std::string>()) << what;
      continue;
    }
    if (error) {
      ADD_FAILURE() << what << ": unexpected error " << error_class(error);
      return;
    }
    if (kind == "step") {
      if (op.contains("applied")) {
        EXPECT_EQ(out.applied, op["applied"].get<bool>()) << what;
      }
      if (op.contains("found_inf")) {
        EXPECT_EQ(out.found_inf, op["found_inf"].get<bool>()) << what;
      }
      if (op.contains("first_overflow")) {
        EXPECT_EQ(out.first_overflow, op["first_overflow"].get<std::int64_t>()) << what;
      }
    }
  }
}

}  // namespace mixprec::conformance
