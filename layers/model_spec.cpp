#include <dptrain/layers/model_spec.hpp>

namespace dpt::nn {

ModelSpec parse_model_spec(const std::string& text) {
  ModelSpec s;
  s.text = text;
  s.is_cnn = is_cnn_spec(text);
  if (s.is_cnn) s.cnn = parse_cnn_spec(text);
  else s.widths = parse_mlp_spec(text);
  return s;
}

std::shared_ptr<Sequential> make_model(const ModelSpec& spec, Act act) {
  return spec.is_cnn ? cnn(spec.cnn, act) : mlp(spec.widths, act);
}

}  // namespace dpt::nn
