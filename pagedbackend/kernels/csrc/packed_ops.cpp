// The packed linear layers as ATen operators with C++ CPU kernels:
// pagedbackend::packed_linear_native and pagedbackend::packed_linear_int8_native
// do what packed_linear and packed_linear_int8 (models/packed_linear.py) do,
// with the same checks and messages, but are called from the dispatcher
// without entering Python. A compiled step calls them once per linear layer
// (121 times a step for SmolLM2); each Python call costs the GIL, argument
// boxing and a ctypes call.
//
// The GEMMs themselves are those of packed_gemm.c, loaded by Python, whose
// addresses are handed over with packed_ops_set_kernels before first use.
// Fake (meta) kernels are registered from Python.
//
// pagedbackend::w8a8_linear_native is the matmul of quantization=w8a8
// (models/quant.py's W8A8Linear): int8 rows of x with their scales, times an
// int8 [N, K] weight with its scales. Steps of up to w8a8_max_rows rows go to
// w8a8_gemm.c's VNNI kernel (handed over with packed_ops_set_w8a8), larger
// ones (or all, without that kernel) to torch._int_mm, scaled by
// w8a8_gemm.c's w8a8_rescale; both sum in int32, exactly, and scale in the
// same order, so they give the same bits.
//
// Steps past kernel_max_rows rows multiply the weight unpacked for the call
// through oneDNN's inner product (mkldnn::_linear_pointwise, looked up in the
// dispatcher) where Python found it working (packed_ops_set_prefill), else
// through at::linear: kernels/onednn_linear.py's dense_linear.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <vector>

namespace {

using gemm_f32 = void (*)(const float *, const float *, float *, int, int, int, int);
using gemm_bf16 = void (*)(const float *, const uint16_t *, float *, int, int, int, int);
using gemm_i8 = int (*)(const float *, const signed char *, const float *, float *, int, int, int, int);

using gemm_w8a8 = int (*)(const int8_t *, const float *, const int8_t *, const int32_t *, const float *,
                          float *, int, int, int, int);

gemm_f32 kernel_f32 = nullptr;
gemm_bf16 kernel_bf16 = nullptr;
gemm_i8 kernel_i8 = nullptr;
using rescale_w8a8 = void (*)(const int32_t *, const float *, const float *, float *, int, int, int);
gemm_w8a8 kernel_w8a8 = nullptr;
rescale_w8a8 kernel_rescale = nullptr;
int64_t w8a8_max_rows = 0;
int64_t kernel_max_rows = 768;   // above this, prefill_linear on the unpacked weight
bool prefill_onednn = false;

// x @ weight^T for a plain [N, K] weight: oneDNN's inner product, or at::linear.
at::Tensor prefill_linear(const at::Tensor &x, const at::Tensor &weight) {
    static const std::optional<c10::OperatorHandle> onednn =
        c10::Dispatcher::singleton().findSchema({"mkldnn::_linear_pointwise", ""});
    if (!prefill_onednn || !onednn.has_value()) return at::linear(x, weight);
    std::vector<c10::IValue> stack{x.contiguous(), weight.contiguous(), c10::IValue(), std::string("none"),
                                   c10::List<std::optional<at::Scalar>>(), std::string("")};
    onednn->callBoxed(&stack);
    return stack[0].toTensor();
}

std::string shape_of(const at::Tensor &t) {
    std::string s = "(";
    for (int64_t i = 0; i < t.dim(); i++) s += (i ? ", " : "") + std::to_string(t.size(i));
    return s + (t.dim() == 1 ? ",)" : ")");
}

// The [N, K] weight held in packed [blocks, K, cols] (models/packed_linear.py's unpack).
at::Tensor unpack(const at::Tensor &packed, int64_t out_features) {
    return packed.transpose(1, 2).reshape({packed.size(0) * packed.size(2), packed.size(1)})
        .slice(0, 0, out_features);
}

at::Tensor packed_linear(const at::Tensor &x_in, const at::Tensor &packed, int64_t out_features) {
    bool bf16 = packed.scalar_type() == at::kBFloat16;
    TORCH_CHECK_VALUE(x_in.dim() == 2 && packed.dim() == 3 && x_in.scalar_type() == at::kFloat &&
                      (packed.scalar_type() == at::kFloat || bf16) && packed.size(1) == x_in.size(1),
                      "packed_linear takes float32 [rows, ", packed.dim() == 3 ? packed.size(1) : -1,
                      "] inputs for this weight; got ", x_in.scalar_type(), " ", shape_of(x_in));
    TORCH_CHECK(kernel_f32 != nullptr && kernel_bf16 != nullptr,
                "packed_linear_native: the GEMM kernels were not handed over");
    int64_t rows = x_in.size(0), k = x_in.size(1);
    if (rows > kernel_max_rows) return prefill_linear(x_in, unpack(packed, out_features).to(at::kFloat));
    at::Tensor x = x_in.contiguous();
    at::Tensor y = at::empty({rows, out_features}, x.options());
    if (rows && bf16)
        kernel_bf16(x.data_ptr<float>(), reinterpret_cast<const uint16_t *>(packed.data_ptr()),
                    y.data_ptr<float>(), (int)rows, (int)k, (int)out_features, at::get_num_threads());
    else if (rows)
        kernel_f32(x.data_ptr<float>(), packed.data_ptr<float>(), y.data_ptr<float>(), (int)rows,
                   (int)k, (int)out_features, at::get_num_threads());
    return y;
}

at::Tensor packed_linear_int8(const at::Tensor &x_in, const at::Tensor &qpacked, const at::Tensor &scales,
                              int64_t out_features) {
    TORCH_CHECK_VALUE(x_in.dim() == 2 && qpacked.dim() == 3 && x_in.scalar_type() == at::kFloat &&
                      qpacked.scalar_type() == at::kChar && qpacked.size(1) == x_in.size(1) &&
                      scales.scalar_type() == at::kFloat &&
                      scales.numel() == qpacked.size(0) * qpacked.size(2),
                      "packed_linear_int8 takes float32 [rows, ", qpacked.dim() == 3 ? qpacked.size(1) : -1,
                      "] inputs for this weight; got ", x_in.scalar_type(), " ", shape_of(x_in));
    TORCH_CHECK(kernel_i8 != nullptr, "packed_linear_int8_native: the GEMM kernel was not handed over");
    int64_t rows = x_in.size(0), k = x_in.size(1);
    if (rows > kernel_max_rows) {
        at::Tensor weight = unpack(qpacked, out_features).to(at::kFloat) *
                            scales.slice(0, 0, out_features).unsqueeze(1);
        return prefill_linear(x_in, weight);
    }
    at::Tensor x = x_in.contiguous();
    at::Tensor s = scales.contiguous();
    at::Tensor y = at::empty({rows, out_features}, x.options());
    if (rows && kernel_i8(x.data_ptr<float>(), qpacked.data_ptr<int8_t>(), s.data_ptr<float>(),
                          y.data_ptr<float>(), (int)rows, (int)k, (int)out_features, at::get_num_threads()))
        throw std::bad_alloc();   // a thread's float copy of a block could not be allocated
    return y;
}

at::Tensor w8a8_linear(const at::Tensor &a_in, const at::Tensor &t_in, const at::Tensor &q,
                       const at::Tensor &colsum, const at::Tensor &s) {
    TORCH_CHECK_VALUE(a_in.dim() == 2 && q.dim() == 2 && a_in.scalar_type() == at::kChar &&
                      q.scalar_type() == at::kChar && q.size(1) == a_in.size(1) && q.is_contiguous() &&
                      t_in.scalar_type() == at::kFloat && t_in.numel() == a_in.size(0) &&
                      colsum.scalar_type() == at::kInt && colsum.numel() == q.size(0) &&
                      s.scalar_type() == at::kFloat && s.numel() == q.size(0),
                      "w8a8_linear takes int8 [rows, ", q.dim() == 2 ? q.size(1) : -1,
                      "] inputs with one float32 scale per row for this weight; got ",
                      a_in.scalar_type(), " ", shape_of(a_in), " and scales ", shape_of(t_in));
    int64_t rows = a_in.size(0), k = a_in.size(1), n = q.size(0);
    at::Tensor a = a_in.contiguous(), t = t_in.contiguous(), sc = s.contiguous();
    at::Tensor y = at::empty({rows, n}, a.options().dtype(at::kFloat));
    if (rows == 0) return y;
    if (kernel_w8a8 != nullptr && rows <= w8a8_max_rows) {
        int rc = kernel_w8a8(a.data_ptr<int8_t>(), t.data_ptr<float>(), q.data_ptr<int8_t>(),
                             colsum.data_ptr<int32_t>(), sc.data_ptr<float>(), y.data_ptr<float>(),
                             (int)rows, (int)k, (int)n, at::get_num_threads());
        if (rc == -1) throw std::bad_alloc();   // a thread's copy of the rows could not be allocated
        if (rc == 0) return y;
    }
    at::Tensor acc = at::_int_mm(a, q.t());
    if (kernel_rescale == nullptr)   // (acc * t) * s, in torch's ops
        return acc.to(at::kFloat).mul_(t.view({rows, 1})).mul_(sc);
    kernel_rescale(acc.data_ptr<int32_t>(), t.data_ptr<float>(), sc.data_ptr<float>(), y.data_ptr<float>(),
                   (int)rows, (int)n, at::get_num_threads());
    return y;
}

}  // namespace

extern "C" void packed_ops_set_w8a8(void *kernel, void *rescale, long long max_rows) {
    kernel_w8a8 = reinterpret_cast<gemm_w8a8>(kernel);
    kernel_rescale = reinterpret_cast<rescale_w8a8>(rescale);
    w8a8_max_rows = max_rows;
}

extern "C" void packed_ops_set_prefill(int onednn) { prefill_onednn = onednn != 0; }

extern "C" void packed_ops_set_kernels(void *f32, void *bf16, void *i8, long long max_rows) {
    kernel_f32 = reinterpret_cast<gemm_f32>(f32);
    kernel_bf16 = reinterpret_cast<gemm_bf16>(bf16);
    kernel_i8 = reinterpret_cast<gemm_i8>(i8);
    kernel_max_rows = max_rows;
}

TORCH_LIBRARY_FRAGMENT(pagedbackend, m) {
    m.def("packed_linear_native(Tensor x, Tensor packed, int out_features) -> Tensor");
    m.def("packed_linear_int8_native(Tensor x, Tensor qpacked, Tensor scales, int out_features) -> Tensor");
    m.def("w8a8_linear_native(Tensor a, Tensor row_scales, Tensor qweight, Tensor colsum, Tensor scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedbackend, CPU, m) {
    m.impl("packed_linear_native", &packed_linear);
    m.impl("packed_linear_int8_native", &packed_linear_int8);
    m.impl("w8a8_linear_native", &w8a8_linear);
}
