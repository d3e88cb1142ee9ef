// mixprec::torch::AdamW: every step equal bit for bit to the core's adam_tensor_step called
// directly on the same data (weights, masters, moment codes and scales), over the master and
// moment formats; the remainder master equal to the fp32 master; a skipped step writes nothing;
// state_dict() resumes bit for bit and load_state_dict() refuses other formats; bad options and
// parameters refused with their messages.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "mixprec/torch/optim.hpp"
#include "support.hpp"

namespace mixprec::torch {
namespace {

using mixprec::test::error_of;

std::vector<std::byte> bytes_of(const at::Tensor& t) {
  const at::Tensor c = t.detach().contiguous();
  std::vector<std::byte> out(static_cast<std::size_t>(c.numel()) * c.element_size());
  if (!out.empty()) std::memcpy(out.data(), c.data_ptr(), out.size());
  return out;
}
template <class T>
std::vector<std::byte> bytes_of(const std::vector<T>& v) {
  std::vector<std::byte> out(v.size() * sizeof(T));
  if (!out.empty()) std::memcpy(out.data(), v.data(), out.size());
  return out;
}
bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  return a.scalar_type() == b.scalar_type() && bytes_of(a) == bytes_of(b);
}

// One tensor stepped by the core directly: its weights and its state in plain vectors.
struct CoreTensor {
  at::Tensor w;
  MasterFormat kind = MasterFormat::fp32;
  std::vector<float> master;
  std::vector<std::int16_t> remainder;
  MomentLayout ml, vl;
  std::vector<std::byte> mc, vc;
  std::vector<float> ms, vs;
  std::int64_t step = 0;
};

struct Core {
  AdamWOptions o;
  std::vector<CoreTensor> ts;

  Core(const std::vector<at::Tensor>& init, const AdamWOptions& options) : o(options) {
    for (const at::Tensor& x : init) {
      CoreTensor c;
      c.w = x.clone();
      const auto n = static_cast<std::size_t>(x.numel());
      c.kind = x.scalar_type() == at::kFloat ? MasterFormat::fp32 : o.master;
      if (c.kind == MasterFormat::fp32 && x.scalar_type() != at::kFloat) {
        const at::Tensor f = x.to(at::kFloat).contiguous();
        c.master.assign(f.data_ptr<float>(), f.data_ptr<float>() + n);
      }
      if (c.kind == MasterFormat::remainder) c.remainder.assign(n, 0);
      c.ml = moment_layout(o.m, true, n, o.formats());
      c.vl = moment_layout(o.v, false, n, o.formats());
      c.mc.assign(c.ml.code_bytes(), std::byte{0});
      c.vc.assign(c.vl.code_bytes(), std::byte{0});
      c.ms.assign(c.ml.scale_count(), 0.0f);
      c.vs.assign(c.vl.scale_count(), 0.0f);
      ts.push_back(std::move(c));
    }
  }

  // grads[k] undefined: tensor k is left alone (its elements still count for stochastic rounding).
  void step(const std::vector<at::Tensor>& grads, float inv_scale) {
    std::uint64_t first = 0;
    for (std::size_t k = 0; k < ts.size(); ++k) {
      CoreTensor& c = ts[k];
      const auto n = static_cast<std::size_t>(c.w.numel());
      if (grads[k].defined()) {
        const at::Tensor g = grads[k].contiguous();
        AdamTensor t;
        t.n = n;
        t.grad_dtype = g.scalar_type() == at::kFloat ? DType::f32 : g.scalar_type() == at::kHalf ? DType::f16 : DType::bf16;
        t.grad = g.data_ptr();
        t.weight_dtype = c.w.scalar_type() == at::kFloat ? DType::f32 : c.w.scalar_type() == at::kHalf ? DType::f16 : DType::bf16;
        t.weight = c.w.data_ptr();
        t.master = c.kind;
        t.master_f32 = c.master.empty() ? nullptr : c.master.data();
        t.remainder = c.remainder.empty() ? nullptr : c.remainder.data();
        t.m = MomentView{c.ml, c.mc.data(), c.ms.empty() ? nullptr : c.ms.data()};
        t.v = MomentView{c.vl, c.vc.data(), c.vs.empty() ? nullptr : c.vs.data()};
        t.first_index = first;
        AdamStepArgs a;
        a.hyper = AdamHyper{o.lr, o.betas.first, o.betas.second, o.eps, o.weight_decay, o.decoupled};
        a.step = ++c.step;
        a.inv_scale = inv_scale;
        a.rule = o.rule;
        a.stochastic = o.stochastic_rounding;
        a.seed = o.seed;
        validate(t, a);
        adam_tensor_step(t, a);
      }
      first += n;
    }
  }
};

std::vector<at::Tensor> leaves(const std::vector<at::Tensor>& init) {
  std::vector<at::Tensor> out;
  for (const at::Tensor& x : init) out.push_back(x.clone().set_requires_grad(true));
  return out;
}

// Every state tensor of the adapter equal to the core's vectors, and the weights too.
void expect_same_state(const AdamW& opt, const Core& core, const std::string& where) {
  for (std::size_t k = 0; k < core.ts.size(); ++k) {
    const CoreTensor& c = core.ts[k];
    const std::string at = where + " tensor " + std::to_string(k);
    EXPECT_TRUE(same_bits(opt.parameters()[k], c.w)) << at << ": weights";
    const auto& st = opt.state(k);
    if (c.step == 0) {
      EXPECT_TRUE(st.empty()) << at;
      continue;
    }
    EXPECT_EQ(st.at("step").item<float>(), static_cast<float>(c.step)) << at;
    EXPECT_EQ(bytes_of(st.at("exp_avg")), c.mc) << at << ": exp_avg";
    EXPECT_EQ(bytes_of(st.at("exp_avg_scale")), bytes_of(c.ms)) << at << ": exp_avg_scale";
    EXPECT_EQ(bytes_of(st.at("exp_avg_sq")), c.vc) << at << ": exp_avg_sq";
    EXPECT_EQ(bytes_of(st.at("exp_avg_sq_scale")), bytes_of(c.vs)) << at << ": exp_avg_sq_scale";
    EXPECT_EQ(st.count("master"), c.master.empty() ? 0u : 1u) << at;
    if (!c.master.empty()) {
      EXPECT_EQ(bytes_of(st.at("master")), bytes_of(c.master)) << at << ": master";
    }
    EXPECT_EQ(st.count("master_remainder"), c.remainder.empty() ? 0u : 1u) << at;
    if (!c.remainder.empty()) {
      EXPECT_EQ(bytes_of(st.at("master_remainder")), bytes_of(c.remainder)) << at << ": master_remainder";
    }
  }
}

struct Case {
  const char* name;
  AdamWOptions o;
  std::vector<at::ScalarType> dtypes;  // of the parameters: 8192, 100 (blocked formats fall back) and 4096 elements
};

std::vector<Case> cases() {
  std::vector<Case> out;
  auto add = [&](const char* name, auto set, std::vector<at::ScalarType> dtypes) {
    AdamWOptions o;
    o.lr = 1e-2;
    o.weight_decay = 0.1;
    set(o);
    out.push_back({name, o, std::move(dtypes)});
  };
  add("fp32", [](AdamWOptions&) {}, {at::kBFloat16, at::kHalf, at::kFloat});
  add("remainder_fp8", [](AdamWOptions& o) {
    o.master = MasterFormat::remainder;
    o.m = o.v = MomentFormat::fp8;
  }, {at::kBFloat16, at::kBFloat16, at::kFloat});
  add("none_sr_8bit_4bit", [](AdamWOptions& o) {
    o.master = MasterFormat::none;
    o.m = MomentFormat::q8;
    o.v = MomentFormat::q4;
    o.stochastic_rounding = true;
    o.seed = 7;
  }, {at::kBFloat16, at::kHalf, at::kBFloat16});
  add("bf16_fp16_te", [](AdamWOptions& o) {
    o.m = MomentFormat::bf16;
    o.v = MomentFormat::fp16;
    o.rule = AdamRule::te;
  }, {at::kHalf, at::kBFloat16, at::kFloat});
  add("fp8_per_tensor_torchao_adam", [](AdamWOptions& o) {
    o.m = MomentFormat::fp8;
    o.v = MomentFormat::q8;
    o.fp8_per_tensor = true;
    o.rule = AdamRule::torchao;
    o.decoupled = false;
    o.block = 128;
  }, {at::kBFloat16, at::kFloat, at::kHalf});
  return out;
}

// Tensor 0 spans four pieces of the fused step, which the door splits over 2 of ATen's threads:
// the core's bits on one thread all the same.
TEST(TorchAdamW, EqualsTheCoreBitForBit) {
  const int threads = at::get_num_threads();
  at::set_num_threads(2);
  for (const Case& cs : cases()) {
    ::torch::manual_seed(11);
    const std::vector<std::int64_t> sizes = {3 * 65536 + 4096, 100, 4096};
    std::vector<at::Tensor> init;
    for (std::size_t k = 0; k < sizes.size(); ++k) init.push_back(::torch::randn({sizes[k]}).to(cs.dtypes[k]));
    init[0] = init[0].view({196, 1024});
    std::vector<at::Tensor> params = leaves(init);
    AdamW opt(params, cs.o);
    Core core(init, cs.o);
    for (int s = 0; s < 6; ++s) {
      const float scale = s % 2 ? 1024.0f : 1.0f;
      std::vector<at::Tensor> grads;
      for (std::size_t k = 0; k < params.size(); ++k) {
        // Tensor 1 takes no part in step 1 (and its first step comes later); tensor 2's gradient is fp32.
        if (k == 1 && s <= 1) {
          grads.emplace_back();
          params[k].mutable_grad() = at::Tensor();
          continue;
        }
        const at::Tensor g = (::torch::randn(params[k].sizes()) * scale).to(k == 2 ? at::kFloat : params[k].scalar_type());
        grads.push_back(g);
        params[k].mutable_grad() = g.clone();
      }
      opt.step(1.0f / scale);
      core.step(grads, 1.0f / scale);
      expect_same_state(opt, core, std::string(cs.name) + " step " + std::to_string(s));
    }
    // The weights of record: the fp32 master, rebuilt from the remainder, or the parameter.
    for (std::size_t k = 0; k < params.size(); ++k) {
      const CoreTensor& c = core.ts[k];
      at::Tensor want = c.w.to(at::kFloat);
      if (!c.master.empty()) want = ::torch::from_blob(const_cast<float*>(c.master.data()), c.w.sizes(), at::kFloat).clone();
      if (!c.remainder.empty()) {
        join_master(static_cast<const std::uint16_t*>(c.w.data_ptr()), c.remainder.data(), want.data_ptr<float>(),
                    static_cast<std::size_t>(c.w.numel()));
      }
      EXPECT_TRUE(same_bits(opt.master_weights(k), want)) << cs.name << " tensor " << k;
      EXPECT_EQ(opt.master_weights(k).sizes(), params[k].sizes()) << cs.name;
    }
    // Something was quantized where the case asks for it (the checks above compared codes, not fp32
    // copies); per-tensor scales (TE) keep no fallback.
    if ((cs.o.m == MomentFormat::fp8 && !cs.o.fp8_per_tensor) || cs.o.m == MomentFormat::q8) {
      EXPECT_EQ(opt.state(0).at("exp_avg").scalar_type(), at::kByte) << cs.name;
      EXPECT_EQ(opt.state(1).at("exp_avg").scalar_type(), at::kFloat) << cs.name << ": 100 elements fall back";
    }
  }
  at::set_num_threads(threads);
}

TEST(TorchAdamW, RemainderMasterEqualsFp32MasterOver100Steps) {
  ::torch::manual_seed(4);
  const at::Tensor w = ::torch::randn({4096}).to(at::kBFloat16);
  at::Tensor a = w.clone().set_requires_grad(true), b = w.clone().set_requires_grad(true);
  AdamWOptions o;
  o.lr = 3e-4;
  o.m = o.v = MomentFormat::bf16;
  AdamW oa({a}, o);
  o.master = MasterFormat::remainder;
  AdamW ob({b}, o);
  for (int s = 0; s < 100; ++s) {
    const at::Tensor g = ::torch::randn({4096}).to(at::kBFloat16);
    a.mutable_grad() = g.clone();
    b.mutable_grad() = g.clone();
    oa.step();
    ob.step();
  }
  EXPECT_TRUE(same_bits(oa.master_weights(0), ob.master_weights(0)));
  EXPECT_FALSE(same_bits(oa.master_weights(0), w.to(at::kFloat))) << "the weights moved";
  // The bf16 weights: equal except where the master lies exactly halfway (TE rounds half away from zero).
  const at::Tensor bits = oa.master_weights(0).view(at::kInt).bitwise_and(0xFFFF);
  const at::Tensor not_tie = bits.ne(0x8000);
  EXPECT_TRUE(::torch::equal(a.detach().index({not_tie}), b.detach().index({not_tie})));
  EXPECT_EQ(ob.state(0).at("master_remainder").scalar_type(), at::kShort);
  EXPECT_EQ(oa.state_bytes().master, 4096u * 4);
  EXPECT_EQ(ob.state_bytes().master, 4096u * 2);
  EXPECT_EQ(ob.state_bytes().m, 4096u * 2);
  EXPECT_EQ(ob.state_bytes().params, 4096u * 2);
}

std::vector<std::vector<std::byte>> snapshot(const AdamW& opt) {
  std::vector<std::vector<std::byte>> out;
  for (std::size_t k = 0; k < opt.parameters().size(); ++k) {
    out.push_back(bytes_of(opt.parameters()[k]));
    for (const auto& [name, x] : opt.state(k)) out.push_back(bytes_of(x));
  }
  return out;
}

TEST(TorchAdamW, ASkippedStepWritesNothing) {
  for (MomentFormat f : {MomentFormat::fp32, MomentFormat::fp8, MomentFormat::q8}) {
    ::torch::manual_seed(5);
    at::Tensor p = ::torch::randn({64, 128}).to(at::kBFloat16).set_requires_grad(true);
    AdamWOptions o;
    o.master = MasterFormat::remainder;
    o.m = o.v = f;
    AdamW opt({p}, o);
    p.mutable_grad() = ::torch::randn({64, 128}).to(at::kBFloat16);
    opt.step(1.0f, true);
    EXPECT_TRUE(opt.state(0).empty()) << "a skipped first step creates no state";
    opt.step();
    const auto before = snapshot(opt);
    p.mutable_grad() = ::torch::randn({64, 128}).to(at::kBFloat16);
    p.mutable_grad()[3][5] = std::numeric_limits<float>::infinity();
    opt.step(0.5f, true);
    EXPECT_EQ(snapshot(opt), before) << moment_format_name(f);
    EXPECT_EQ(opt.state(0).at("step").item<float>(), 1.0f);
    p.mutable_grad()[3][5] = 0.0f;
    opt.step(0.5f);
    EXPECT_NE(snapshot(opt), before) << moment_format_name(f);
    EXPECT_EQ(opt.state(0).at("step").item<float>(), 2.0f);
  }
}

TEST(TorchAdamW, StateDictResumesBitForBitAndRefusesOtherFormats) {
  ::torch::manual_seed(6);
  const std::vector<std::vector<std::int64_t>> shapes = {{64, 64}, {300}, {128, 32}};
  std::vector<at::Tensor> init;
  for (const auto& s : shapes) init.push_back(::torch::randn(s).to(at::kBFloat16));
  std::vector<std::vector<at::Tensor>> grads(6);
  for (auto& g : grads)
    for (const auto& s : shapes) g.push_back(::torch::randn(s).to(at::kBFloat16));
  AdamWOptions o;
  o.lr = 1e-2;
  o.master = MasterFormat::remainder;
  o.m = MomentFormat::fp8;
  o.v = MomentFormat::q8;
  auto run = [&](AdamW& opt, std::vector<at::Tensor>& ps, std::size_t from, std::size_t to) {
    for (std::size_t s = from; s < to; ++s) {
      for (std::size_t k = 0; k < ps.size(); ++k) ps[k].mutable_grad() = grads[s][k].clone();
      opt.step();
    }
  };
  std::vector<at::Tensor> full = leaves(init), half = leaves(init);
  AdamW of(full, o), oh(half, o);
  run(of, full, 0, 6);
  run(oh, half, 0, 3);
  // Through a torch archive, as a checkpoint would go.
  std::stringstream buf;
  {
    ::torch::serialize::OutputArchive ar;
    for (const auto& [k, x] : oh.state_dict()) ar.write(k, x);
    ar.save_to(buf);
  }
  const AdamW::StateDict saved = oh.state_dict();
  AdamW::StateDict loaded;
  {
    ::torch::serialize::InputArchive ar;
    ar.load_from(buf);
    for (const auto& [k, _] : saved) {
      at::Tensor x;
      ar.read(k, x);
      loaded[k] = x;
    }
  }
  EXPECT_EQ(saved.at("state.0.exp_avg").scalar_type(), at::kByte);
  EXPECT_EQ(saved.at("state.1.exp_avg").scalar_type(), at::kFloat);  // 300 elements: fp32
  EXPECT_EQ(saved.count("state.0.master_remainder"), 1u);
  std::vector<at::Tensor> resumed;
  for (const at::Tensor& x : half) resumed.push_back(x.detach().clone().set_requires_grad(true));
  AdamW orr(resumed, o);
  orr.load_state_dict(loaded);
  const AdamW::StateDict at_load = orr.state_dict();
  run(orr, resumed, 3, 6);
  for (std::size_t k = 0; k < full.size(); ++k) {
    EXPECT_TRUE(same_bits(full[k], resumed[k])) << k;
    EXPECT_TRUE(same_bits(of.master_weights(k), orr.master_weights(k))) << k;
  }
  // load_state_dict() copies in and state_dict() copies out: stepping on changes neither.
  EXPECT_TRUE(same_bits(at_load.at("state.0.exp_avg"), saved.at("state.0.exp_avg")));
  EXPECT_FALSE(same_bits(orr.state_dict().at("state.0.exp_avg"), saved.at("state.0.exp_avg")));
  EXPECT_TRUE(same_bits(loaded.at("state.0.exp_avg"), saved.at("state.0.exp_avg")));

  // Other formats, keys, dtypes and sizes: refused, and the state stays as it was.
  const auto before = snapshot(orr);
  auto refused = [&](const AdamW::StateDict& sd) {
    return error_of<std::invalid_argument>([&] { orr.load_state_dict(sd); });
  };
  AdamWOptions bf = o;
  bf.m = bf.v = MomentFormat::bf16;
  std::vector<at::Tensor> other_params = leaves(init);
  AdamW other(other_params, bf);
  EXPECT_EQ(error_of<std::invalid_argument>([&] { other.load_state_dict(saved); }),
            "AdamW: load_state_dict: param_groups.0.moments: expected 'bf16,bf16' (this optimizer's formats), found "
            "'fp8,8bit'");
  AdamW::StateDict sd = saved;
  sd.erase("param_groups.0.seed");
  EXPECT_EQ(refused(sd), "AdamW: load_state_dict: param_groups.0.seed: expected 0 (this optimizer's formats), found nothing");
  sd = saved;
  sd["state.3.step"] = at::ones({});
  EXPECT_EQ(refused(sd), "AdamW: load_state_dict: key 'state.3.step': expected state.<i>.<name> with i below 3, or "
                         "param_groups.0.<master|moments|block|fp8_per_tensor|rule|stochastic_rounding|seed>");
  sd = saved;
  sd["state.1.exp_avg"] = at::zeros({300}, at::kBFloat16);
  EXPECT_EQ(refused(sd), "AdamW: load_state_dict: state.1.exp_avg: expected a float32 tensor of 300 elements, found a "
                         "bfloat16 tensor of 300 elements");
  sd = saved;
  sd.erase("state.2.exp_avg_sq_scale");
  EXPECT_EQ(refused(sd), "AdamW: load_state_dict: state.2.exp_avg_sq_scale: expected a float32 tensor of 16 elements, "
                         "found nothing");
  sd = saved;
  sd["state.0.master"] = at::zeros({64, 64});
  EXPECT_EQ(refused(sd), "AdamW: load_state_dict: state.0.master: expected no such tensor (parameter 0 stores "
                         "exp_avg, exp_avg_scale, exp_avg_sq, exp_avg_sq_scale, master_remainder, step), found a "
                         "float32 tensor of 4096 elements");
  sd = saved;
  sd["state.0.step"] = at::full({}, 2.5f);
  EXPECT_EQ(refused(sd), "AdamW: load_state_dict: state.0.step: expected a whole number >= 0, found 2.5");
  EXPECT_EQ(snapshot(orr), before);
}

TEST(TorchAdamW, RefusesBadOptionsAndParameters) {
  const at::Tensor p = ::torch::zeros({8}, at::kBFloat16);
  auto refused = [](std::vector<at::Tensor> ps, const AdamWOptions& o) {
    return error_of<std::invalid_argument>([&] { AdamW opt(std::move(ps), o); });
  };
  AdamWOptions o;
  o.lr = std::nan("");
  EXPECT_EQ(refused({p}, o), "AdamW: lr: expected a finite number >= 0, found nan");
  o = {};
  o.eps = -1;
  EXPECT_EQ(refused({p}, o), "AdamW: eps: expected a finite number >= 0, found -1");
  o = {};
  o.weight_decay = INFINITY;
  EXPECT_EQ(refused({p}, o), "AdamW: weight_decay: expected a finite number >= 0, found inf");
  o = {};
  o.betas.second = 1.0;
  EXPECT_EQ(refused({p}, o), "AdamW: betas.second: expected a number in [0, 1), found 1");
  o = {};
  o.betas.first = -0.1;
  EXPECT_EQ(refused({p}, o), "AdamW: betas.first: expected a number in [0, 1), found -0.1");
  o = {};
  o.m = static_cast<MomentFormat>(9);
  EXPECT_EQ(refused({p}, o), "AdamW: m: expected one of fp32, bf16, fp16, fp8, 8bit, 4bit, found 9");
  o = {};
  o.block = 48;
  EXPECT_EQ(refused({p}, o),
            "AdamW: state formats: block: expected 0 (the format's default) or a power of two in [32, 1024], found 48");
  o = {};
  o.fp8_per_tensor = true;
  EXPECT_EQ(refused({p}, o), "AdamW: state formats: fp8_per_tensor: expected an fp8 moment, found m fp32 and v fp32");
  o = {};
  o.stochastic_rounding = true;
  EXPECT_EQ(refused({p}, o), "AdamW: stochastic_rounding: expected master none (the 16-bit weights are the only copy), "
                             "found master fp32");
  o = {};
  EXPECT_EQ(refused({p, ::torch::zeros({4}, at::kDouble)}, o),
            "AdamW: params[1]: expected a float32, float16 or bfloat16 parameter, found float64");
  EXPECT_EQ(refused({::torch::zeros({4, 4}).t()}, o),
            "AdamW: params[0]: expected a contiguous parameter (the step writes it in place), found a non-contiguous one");
  EXPECT_EQ(refused({p, at::Tensor()}, o), "AdamW: params[1]: expected a defined tensor, found an undefined one");
  EXPECT_EQ(refused({p, p}, o), "AdamW: params[1]: expected distinct parameters, found the memory of params[0] again");
  o.master = MasterFormat::remainder;
  EXPECT_EQ(refused({::torch::zeros({4}, at::kHalf)}, o),
            "AdamW: params[0]: master remainder expected bfloat16 (or float32) parameters, found float16");
  o = {};
  o.master = MasterFormat::none;
  o.stochastic_rounding = true;
  EXPECT_EQ(refused({::torch::zeros({4})}, o), "AdamW: params[0]: stochastic_rounding expected 16-bit parameters, found float32");

  // Step-time refusals: checked before anything is written.
  at::Tensor a = p.clone().set_requires_grad(true), b = p.clone().set_requires_grad(true);
  AdamW opt({a, b}, AdamWOptions{});
  a.mutable_grad() = ::torch::ones({8}, at::kBFloat16);
  b.mutable_grad() = ::torch::ones({8}, at::kInt);
  EXPECT_EQ(error_of<std::invalid_argument>([&] { opt.step(); }),
            "AdamW: params[1].grad(): expected float32, float16 or bfloat16, found int32");
  b.mutable_grad() = ::torch::ones({8}, at::kBFloat16);
  EXPECT_EQ(error_of<std::invalid_argument>([&] { opt.step(0.0f); }),
            "AdamW: params[0]: adam_tensor_step: inv_scale: expected finite and > 0, found 0");
  EXPECT_TRUE(opt.state(0).empty() && opt.state(1).empty());
  EXPECT_TRUE(::torch::equal(a, p));
  EXPECT_EQ(error_of<std::invalid_argument>([&] { opt.master_weights(2); }),
            "AdamW: master_weights: i: expected an index below 2, found 2");
  EXPECT_EQ(error_of<std::invalid_argument>([&] { opt.set_lr(-1); }),
            "AdamW: lr: expected a finite number >= 0, found -1");
}

}  // namespace
}  // namespace mixprec::torch
