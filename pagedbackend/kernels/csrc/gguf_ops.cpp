// The GGUF linear layers as ATen operators with C++ CPU kernels:
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
#include <torch/library.h>

#include <cstdint>
#include <new>
#include <string>
#include <vector>

namespace {

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

std::string shape_of(const at::Tensor &t) {
    std::string s = "(";
    for (int64_t i = 0; i < t.dim(); i++) s += (i ? ", " : "") + std::to_string(t.size(i));
    return s + (t.dim() == 1 ? ",)" : ")");
}

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
        return finish(at::matmul(xf, at::cat(widened).t()), x);
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
    m.def("gguf_linear_native(Tensor x, Tensor[] weights, Tensor[] row_maps, int[] types, int out_features) "
          "-> Tensor");
    m.def("gguf_linear_q8_native(Tensor x, Tensor[] weights, Tensor[] row_maps, Tensor[] panels, int[] types, "
          "int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedbackend, CPU, m) {
    m.impl("gguf_linear_native", &gguf_linear);
    m.impl("gguf_linear_q8_native", &gguf_linear_q8);
}
