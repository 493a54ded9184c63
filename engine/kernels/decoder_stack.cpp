// Registers the DecoderStack of decoder_stack.h, whose comment says what it is.
#include <torch/custom_class.h>
#include <torch/library.h>

#include "decoder_stack.h"

using specserve_kernels::DecoderStack;

TORCH_LIBRARY_FRAGMENT(specserve, m) {
  m.class_<DecoderStack>("DecoderStack")
      .def(torch::init<int64_t, int64_t, double>())
      .def("add_layer", &DecoderStack::add_layer)
      .def("add_part", &DecoderStack::add_part)
      .def("supports", &DecoderStack::supports)
      .def("forward", &DecoderStack::forward);
}
