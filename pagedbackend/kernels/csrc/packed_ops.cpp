// The packed linear layers as ATen operators with C++ CPU kernels:
// pagedbackend::packed_linear_native and pagedbackend::packed_linear_int8_native
// do what packed_linear and packed_linear_int8 (kernels/packed_linear.py) do,
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
// through at::linear: kernels/onednn_linear.py's dense_linear. So does a GGUF
// layer's call of widen_rows rows or more, on its blocks widened for the call.
//
// The GGUF linear layers, the same way:
// pagedbackend::gguf_linear_native and pagedbackend::gguf_linear_q8_native do
// what gguf_linear and gguf_linear_q8 (models/gguf_linear.py) do, with the
// same checks and messages, but are called from the dispatcher without
// entering Python. A one-stream step of a 1 B model calls them 65 times; the
// Python operators cost 15-40 us a call in checks, argument lists and ctypes,
// a millisecond or more of a 25 ms step.
//
// The GEMMs are those of gguf_gemm.c, loaded by Python, whose addresses (and
// the block sizes of the types it takes) are handed over with
// gguf_ops_set_kernels before first use. Fake (meta) kernels are registered
// from Python.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cstdint>
#include <new>
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

// ---------------------------------------------------------------- GGUF layers

using parts_fn = int (*)(const float *, int64_t, int64_t, int, const uint8_t *const *, const int64_t *const *,
                         const int *, const int64_t *, float *, int);
using panels_fn = int (*)(const float *, int64_t, int64_t, int, const uint8_t *const *, const int64_t *const *,
                          const uint8_t *const *, const int *, const int64_t *, float *, int);
using rows_fn = int (*)(const uint8_t *, const int64_t *, float *, int64_t, int64_t, int64_t, int64_t, int);
using panel_bytes_fn = int64_t (*)(int, int64_t, int64_t);

parts_fn kernel_parts = nullptr;
panels_fn kernel_panels = nullptr;
rows_fn kernel_rows = nullptr;
panel_bytes_fn kernel_panel_bytes = nullptr;
int64_t widen_rows = 256;   // from this many rows: widen the blocks once, then one float32 GEMM

constexpr int MAX_TYPE = 32;
int64_t block_values[MAX_TYPE] = {0};   // 0: a type the kernels do not take
int64_t block_bytes[MAX_TYPE] = {0};
std::string type_names[MAX_TYPE];
std::string known_types;


// The dtype as torch names it in Python (the Python operator's messages print torch.dtype).
std::string dtype_name(const at::Tensor &t) {
    switch (t.scalar_type()) {
        case at::kByte: return "torch.uint8";
        case at::kChar: return "torch.int8";
        case at::kShort: return "torch.int16";
        case at::kInt: return "torch.int32";
        case at::kLong: return "torch.int64";
        case at::kHalf: return "torch.float16";
        case at::kBFloat16: return "torch.bfloat16";
        case at::kFloat: return "torch.float32";
        case at::kDouble: return "torch.float64";
        default: return std::string("torch.") + c10::toString(t.scalar_type());
    }
}

void check_weight(const at::Tensor &w, int64_t type, int64_t cols) {
    TORCH_CHECK_VALUE(type >= 0 && type < MAX_TYPE && block_values[type] > 0, "ggml type ", type,
                      " is not one the GGUF kernels take (", known_types, ")");
    const std::string &name = type_names[type];
    int64_t row = cols / block_values[type] * block_bytes[type];
    TORCH_CHECK_VALUE(w.scalar_type() == at::kByte && w.dim() == 2 && cols % block_values[type] == 0 &&
                      w.size(1) == row && w.stride(1) == 1 && w.stride(0) == w.size(1),
                      "a ", name, " weight of ", cols, " columns is uint8 [rows, ", row, "] contiguous; got ",
                      dtype_name(w), " ", shape_of(w));
}

// Each part's row count, after checking the parts against x (gguf_linear.py's _check_parts).
std::vector<int64_t> check_parts(const at::Tensor &x, at::TensorList weights, at::TensorList row_maps,
                                 at::IntArrayRef types, int64_t out_features) {
    TORCH_CHECK_VALUE(x.dim() == 2, "gguf_linear takes 2-D x; got ", shape_of(x));
    size_t parts = weights.size();
    TORCH_CHECK_VALUE(parts == row_maps.size() && parts == types.size() && parts > 0,
                      "gguf_linear takes one row map and type per weight");
    std::vector<int64_t> sizes;
    int64_t total = 0;
    for (size_t i = 0; i < parts; i++) {
        check_weight(weights[i], types[i], x.size(1));
        const at::Tensor &m = row_maps[i];
        TORCH_CHECK_VALUE(m.numel() == 0 || (m.scalar_type() == at::kLong && m.numel() == weights[i].size(0) &&
                                             m.is_contiguous()),
                          "a row map has one int64 index per weight row");
        sizes.push_back(weights[i].size(0));
        total += weights[i].size(0);
    }
    TORCH_CHECK_VALUE(total == out_features, "gguf_linear weights have ", total, " rows, not ", out_features);
    return sizes;
}

at::Tensor finish(const at::Tensor &y, const at::Tensor &x) {
    return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

void raise_for(int code) {
    TORCH_CHECK_VALUE(code != -2, "the int8-activation GGUF products need a CPU with AVX-512 VNNI");
    if (code == -3) throw std::bad_alloc();   // no memory for the int8 activations
    TORCH_CHECK_VALUE(code == 0, "gguf_gemm refused the weights (type or shape)");
}

struct Pointers {
    std::vector<const uint8_t *> weights;
    std::vector<const int64_t *> maps;
    std::vector<int> types;
};

Pointers pointers(at::TensorList weights, at::TensorList row_maps, at::IntArrayRef types) {
    Pointers p;
    for (size_t i = 0; i < weights.size(); i++) {
        p.weights.push_back(weights[i].data_ptr<uint8_t>());
        p.maps.push_back(row_maps[i].numel() ? row_maps[i].data_ptr<int64_t>() : nullptr);
        p.types.push_back(static_cast<int>(types[i]));
    }
    return p;
}

at::Tensor gguf_linear(const at::Tensor &x, at::TensorList weights, at::TensorList row_maps, at::IntArrayRef types,
                       int64_t out_features) {
    TORCH_CHECK(kernel_parts != nullptr && kernel_rows != nullptr,
                "gguf_linear_native: the GGUF kernels were not handed over");
    std::vector<int64_t> sizes = check_parts(x, weights, row_maps, types, out_features);
    at::Tensor xf = x.to(at::kFloat).contiguous();
    int64_t rows = xf.size(0), cols = xf.size(1);
    if (rows >= widen_rows) {   // a long prefill chunk: widen each block once, then one float32 GEMM
        std::vector<at::Tensor> widened;
        for (size_t i = 0; i < weights.size(); i++) {
            at::Tensor ids = row_maps[i].numel() ? row_maps[i] : at::arange(weights[i].size(0), at::kLong);
            at::Tensor w = at::empty({ids.numel(), cols}, xf.options());
            if (kernel_rows(weights[i].data_ptr<uint8_t>(), ids.data_ptr<int64_t>(), w.data_ptr<float>(),
                            ids.numel(), cols, weights[i].size(0), weights[i].size(1), (int)types[i]))
                TORCH_CHECK_INDEX(false, "token id outside the vocabulary of ", weights[i].size(0));
            widened.push_back(w);
        }
        return finish(prefill_linear(xf, at::cat(widened)), x);
    }
    at::Tensor y = at::empty({rows, out_features}, xf.options());
    if (rows) {
        Pointers p = pointers(weights, row_maps, types);
        raise_for(kernel_parts(xf.data_ptr<float>(), rows, cols, (int)weights.size(), p.weights.data(),
                               p.maps.data(), p.types.data(), sizes.data(), y.data_ptr<float>(),
                               at::get_num_threads()));
    }
    return finish(y, x);
}

at::Tensor gguf_linear_q8(const at::Tensor &x, at::TensorList weights, at::TensorList row_maps,
                          at::TensorList panels, at::IntArrayRef types, int64_t out_features) {
    TORCH_CHECK(kernel_panels != nullptr && kernel_panel_bytes != nullptr,
                "gguf_linear_q8_native: the GGUF kernels were not handed over");
    std::vector<int64_t> sizes = check_parts(x, weights, row_maps, types, out_features);
    TORCH_CHECK_VALUE(panels.size() == weights.size(),
                      "gguf_linear_q8 takes one panel tensor (or an empty one) per weight");
    std::vector<const uint8_t *> panel_ptrs;
    for (size_t i = 0; i < panels.size(); i++) {
        const at::Tensor &q = panels[i];
        TORCH_CHECK_VALUE(q.numel() == 0 || (q.scalar_type() == at::kByte && q.is_contiguous() &&
                                             q.numel() == kernel_panel_bytes((int)types[i], sizes[i], x.size(1))),
                          "a panel tensor is the contiguous uint8 panel copy of its weight");
        panel_ptrs.push_back(q.numel() ? q.data_ptr<uint8_t>() : nullptr);
    }
    at::Tensor xf = x.to(at::kFloat).contiguous();
    int64_t rows = xf.size(0);
    at::Tensor y = at::empty({rows, out_features}, xf.options());
    if (rows) {
        Pointers p = pointers(weights, row_maps, types);
        raise_for(kernel_panels(xf.data_ptr<float>(), rows, xf.size(1), (int)weights.size(), p.weights.data(),
                                p.maps.data(), panel_ptrs.data(), p.types.data(), sizes.data(),
                                y.data_ptr<float>(), at::get_num_threads()));
    }
    return finish(y, x);
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

// The kernels of gguf_gemm.c, the rows from which a float call widens, and
// the types the kernels take: count ids with their block values and bytes, and
// their names, comma-separated in the same order.
extern "C" void gguf_ops_set_kernels(void *parts, void *panels, void *rows, void *panel_bytes, long long widen,
                                     int count, const int *ids, const long long *values, const long long *bytes,
                                     const char *names) {
    kernel_parts = reinterpret_cast<parts_fn>(parts);
    kernel_panels = reinterpret_cast<panels_fn>(panels);
    kernel_rows = reinterpret_cast<rows_fn>(rows);
    kernel_panel_bytes = reinterpret_cast<panel_bytes_fn>(panel_bytes);
    widen_rows = widen;
    std::string all(names), name;
    known_types = "";
    size_t start = 0;
    for (int i = 0; i < count; i++) {
        size_t end = all.find(',', start);
        name = all.substr(start, end == std::string::npos ? std::string::npos : end - start);
        start = end == std::string::npos ? all.size() : end + 1;
        if (ids[i] < 0 || ids[i] >= MAX_TYPE) continue;
        block_values[ids[i]] = values[i];
        block_bytes[ids[i]] = bytes[i];
        type_names[ids[i]] = name;
        known_types += (i ? ", " : "") + name;
    }
}

TORCH_LIBRARY_FRAGMENT(pagedbackend, m) {
    m.def("packed_linear_native(Tensor x, Tensor packed, int out_features) -> Tensor");
    m.def("packed_linear_int8_native(Tensor x, Tensor qpacked, Tensor scales, int out_features) -> Tensor");
    m.def("w8a8_linear_native(Tensor a, Tensor row_scales, Tensor qweight, Tensor colsum, Tensor scales) -> Tensor");
    m.def("gguf_linear_native(Tensor x, Tensor[] weights, Tensor[] row_maps, int[] types, int out_features) "
          "-> Tensor");
    m.def("gguf_linear_q8_native(Tensor x, Tensor[] weights, Tensor[] row_maps, Tensor[] panels, int[] types, "
          "int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedbackend, CPU, m) {
    m.impl("packed_linear_native", &packed_linear);
    m.impl("packed_linear_int8_native", &packed_linear_int8);
    m.impl("w8a8_linear_native", &w8a8_linear);
    m.impl("gguf_linear_native", &gguf_linear);
    m.impl("gguf_linear_q8_native", &gguf_linear_q8);
}
