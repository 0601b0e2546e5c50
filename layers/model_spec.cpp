#include <dptrain/layers/model_spec.hpp>

#include <dptrain/error.hpp>

namespace dpt::nn {

ModelSpec parse_model_spec(const std::string& text) {
  ModelSpec s;
  s.text = text;
  s.is_gpt = is_gpt_spec(text);
  s.is_cnn = !s.is_gpt && is_cnn_spec(text);
  if (s.is_gpt) s.gpt = parse_gpt_spec(text);
  else if (s.is_cnn) s.cnn = parse_cnn_spec(text);
  else s.widths = parse_mlp_spec(text);
  return s;
}

int64_t ModelSpec::outputs() const {
  if (is_gpt) return gpt.vocab;
  if (is_cnn ? cnn.layers.empty() : widths.size() < 2)
    throw UsageError("ModelSpec: no layers (parse_model_spec makes one)");
  return is_cnn ? cnn.classes : widths.back();
}

Shape ModelSpec::input_shape() const {
  if (is_gpt) return {gpt.context};
  if (is_cnn ? cnn.input.size() != 3 : widths.empty())
    throw UsageError("ModelSpec: no input shape (parse_model_spec makes one)");
  return is_cnn ? cnn.input : Shape{widths.front()};
}

std::shared_ptr<Module> make_model(const ModelSpec& spec, Act act) {
  if (spec.is_gpt) return gpt(spec.gpt);
  if (spec.is_cnn) return cnn(spec.cnn, act);
  return mlp(spec.widths, act);
}

}  // namespace dpt::nn
