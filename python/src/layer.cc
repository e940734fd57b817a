// The layer as Python sees it (docs/python.md): ModelConfig, KvPool, IndexPool, Batch, Plan,
// LayerOptions, DsaAttention with plan / prepare / forward. Pools and the layer are the C++
// objects; the binding adds device choice, keep-alive of the caller's memory, use-after-free
// checks and the caller's stream.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <chrono>
#include <optional>

#include "dsakit/error.h"
#include "dsakit/layer.h"
#include "python/src/backends.h"
#include "python/src/bindings.h"

namespace dsakit::py {

namespace {

using namespace nb::literals;

// Host int32 values of a Python sequence or a 1-D int32 CPU array (the batch is built on the
// host: a device tensor is refused rather than copied behind the caller's back).
std::vector<int32_t> int_values(nb::handle obj, const char* name) {
  if (nb::hasattr(obj, "__dlpack__") || PyObject_CheckBuffer(obj.ptr())) {
    const Arg a = arg(obj, name);
    check_tensor(a.view, name, DType::kI32, Device::kCpu, {-1});
    const int32_t* p = a.view.ptr<const int32_t>();
    return std::vector<int32_t>(p, p + a.view.numel());
  }
  try {
    return nb::cast<std::vector<int32_t>>(obj);
  } catch (const nb::cast_error&) {
    throw nb::type_error((std::string(name) + ": expected a sequence of ints or a 1-D int32 "
                                              "CPU tensor")
                             .c_str());
  }
}

// Page tables: a list of per-request lists, or a 2-D int32 CPU tensor [B, max_pages] whose row
// r holds request r's pages first (with page_size, only ceil(L_r / page_size) of them are read;
// without it, the whole row).
std::vector<std::vector<int32_t>> page_table_values(nb::handle obj, const Batch& b,
                                                    std::optional<int> page_size) {
  if (nb::hasattr(obj, "__dlpack__") || PyObject_CheckBuffer(obj.ptr())) {
    const Arg a = arg(obj, "page_tables");
    check_tensor(a.view, "page_tables", DType::kI32, Device::kCpu, {b.num_requests(), -1});
    DSAKIT_CHECK_ARG(!page_size || *page_size >= 1, "page_size: expected >= 1, got ",
                     page_size.value_or(0));
    const int64_t width = a.view.shape[1];
    std::vector<std::vector<int32_t>> tables(size_t(b.num_requests()));
    for (int r = 0; r < b.num_requests(); ++r) {
      int64_t n = width;
      if (page_size) {
        const int64_t len = int64_t(b.prefix_lens[size_t(r)]) + b.extend_lens[size_t(r)];
        n = (len + *page_size - 1) / *page_size;
        DSAKIT_CHECK_ARG(len >= 0 && n <= width, "page_tables: request ", r, " needs ", n,
                         " pages for ", len, " positions, the table has ", width, " columns");
      }
      const int32_t* row = a.view.ptr<const int32_t>() + r * a.view.stride[0];
      tables[size_t(r)].assign(row, row + n);
    }
    return tables;
  }
  try {
    return nb::cast<std::vector<std::vector<int32_t>>>(obj);
  } catch (const nb::cast_error&) {
    throw nb::type_error(
        "page_tables: expected a list of per-request page lists or a 2-D int32 CPU tensor");
  }
}

std::string path_name(AttentionPath p) {
  return to_string(p);
}

AttentionPath parse_path(const std::string& s) {
  if (s == "dense_mha") return AttentionPath::kDenseMha;
  if (s == "sparse_mla") return AttentionPath::kSparseMla;
  DSAKIT_FAIL(kInvalidArgument, "path: expected dense_mha or sparse_mla, got '", s, "'");
}

}  // namespace

// ---- pools ------------------------------------------------------------------------------------

PyKvPool::PyKvPool(const KvPoolDesc& d, const DeviceRef& dev) : device(dev) {
  BackendSlot& slot = backend_for(dev);
  {
    nb::gil_scoped_release nogil;
    Call call(slot, std::nullopt);
    pool = call.be.make_kv_pool(d);
    call.be.synchronize();  // zero-filled before any stream of the caller's reads it
  }
}

const PagedKvPool& PyKvPool::get(const char* who) const {
  DSAKIT_CHECK_ARG(pool.has_value(), who, ": the kv pool was freed (KvPool.free())");
  return *pool;
}
PagedKvPool& PyKvPool::get(const char* who) {
  DSAKIT_CHECK_ARG(pool.has_value(), who, ": the kv pool was freed (KvPool.free())");
  return *pool;
}

const IndexKeyPool& PyIndexPool::get(const char* who) const {
  DSAKIT_CHECK_ARG(pool.has_value(), who, ": the index pool was freed (IndexPool.free())");
  return *pool;
}
IndexKeyPool& PyIndexPool::get(const char* who) {
  DSAKIT_CHECK_ARG(pool.has_value(), who, ": the index pool was freed (IndexPool.free())");
  return *pool;
}

// A KvPool over the caller's memory: any contiguous tensor whose last dim holds one token row
// (bytes_per_token bytes: u8 / float8_e4m3fn rows, or bf16 [.., 576] for the bf16 layout), rows
// a multiple of page_size. The pool reads and writes that memory in place.
PyKvPool wrap_kv_storage(nb::handle storage, const KvPoolDesc& base) {
  PyKvPool p;
  p.owner = arg(storage, "storage", /*writable=*/true);
  p.owner_obj = nb::borrow(storage);
  const TensorView& v = p.owner.view;
  DSAKIT_CHECK_ARG(v.is_contiguous(), "storage: expected a contiguous tensor, got shape ",
                   v.shape_str());
  DSAKIT_CHECK_ARG(v.dtype == DType::kU8 || v.dtype == DType::kBF16,
                   "storage: expected dtype u8 (or float8_e4m3fn bytes) or bf16, got ",
                   to_string(v.dtype));
  const int64_t row_bytes = v.shape[size_t(v.ndim - 1)] * int64_t(dtype_size(v.dtype));
  const int64_t rows = row_bytes > 0 ? int64_t(v.nbytes()) / row_bytes : 0;
  KvPoolDesc d = base;
  d.num_pages = 1;
  d.validate();  // page_size, d_c, d_rope and k_scale first
  DSAKIT_CHECK_ARG(rows % d.page_size == 0, "storage: ", rows,
                   " token rows are not a whole number of pages of ", d.page_size);
  d.num_pages = rows / d.page_size;
  p.device = p.owner.device;
  p.pool = PagedKvPool(d, borrowed(make_view(v.data, DType::kU8, v.device, {rows, row_bytes})));
  return p;
}

PyIndexPool wrap_index_storage(nb::handle storage, const IndexKeyPoolDesc& base) {
  PyIndexPool p;
  p.owner = arg(storage, "storage", /*writable=*/true);
  p.owner_obj = nb::borrow(storage);
  const TensorView& v = p.owner.view;
  DSAKIT_CHECK_ARG(v.is_contiguous() && v.dtype == DType::kU8,
                   "storage: expected a contiguous u8 tensor, got ", to_string(v.dtype), " ",
                   v.shape_str());
  IndexKeyPoolDesc d = base;
  d.num_pages = 1;
  d.validate();  // page_size and d_i first
  const int64_t page = d.page_bytes();
  DSAKIT_CHECK_ARG(page > 0 && int64_t(v.nbytes()) % page == 0, "storage: ", v.nbytes(),
                   " bytes are not a whole number of pages of ", page, " bytes (page_size ",
                   d.page_size, " x (d_i ", d.d_i, " + 4))");
  d.num_pages = int64_t(v.nbytes()) / page;
  p.device = p.owner.device;
  p.pool = IndexKeyPool(d, borrowed(make_view(v.data, DType::kU8, v.device, {d.num_pages, page})));
  return p;
}

// Frees a pool's storage under its backend's lock, so that no call using it is in flight (calls
// check for a freed pool under the same lock). The GIL stays held: no thread holding a backend's
// lock waits for the GIL (calls take the lock with the GIL released and drop it first).
template <typename Pool>
void release_pool(Pool& p) {
  if (!p.pool) return;
  BackendSlot& slot = backend_for(p.device);
  std::lock_guard<std::mutex> lock(slot.mutex);
  p.pool.reset();
}

// ---- the layer ---------------------------------------------------------------------------------

PyLayer::PyLayer(const ModelConfig& config, nb::object kv_obj, nb::object ix_obj,
                 nb::handle kv_b_proj, const LayerOptions& options, nb::handle fp8_codes_obj,
                 nb::handle fp8_scales_obj)
    : kv_ref(std::move(kv_obj)), ix_ref(std::move(ix_obj)) {
  if (!nb::isinstance<PyKvPool>(kv_ref)) throw nb::type_error("kv_pool: expected a dsakit.KvPool");
  if (!nb::isinstance<PyIndexPool>(ix_ref))
    throw nb::type_error("index_pool: expected a dsakit.IndexPool");
  kv = nb::inst_ptr<PyKvPool>(kv_ref);
  ix = nb::inst_ptr<PyIndexPool>(ix_ref);
  DSAKIT_CHECK_ARG(kv->device == ix->device, "index_pool: on ", ix->device.str(),
                   ", the kv pool on ", kv->device.str());
  weights = arg(kv_b_proj, "kv_b_proj");
  fp8_codes = arg(fp8_codes_obj, "kv_b_proj_fp8 codes", false, true);
  fp8_scales = arg(fp8_scales_obj, "kv_b_proj_fp8 scales", false, true);
  check_same_device(kv->device, {&weights, &fp8_codes, &fp8_scales});
  slot = &backend_for(kv->device);
  LayerOptions o = options;
  o.kv_b_proj_fp8 = {fp8_codes.view, fp8_scales.view};
  layer = std::make_unique<DsaAttention>(config, *slot->backend, kv->get("DsaAttention"),
                                         ix->get("DsaAttention"), weights.view, o);
}

void PyLayer::check_pools(const char* who) const {
  kv->get(who);
  ix->get(who);
}

namespace {

struct CallArgs {
  Arg in[7], o, lse, topk;
  LayerInputs inputs() const {
    return {in[0].view, in[1].view, in[2].view, in[3].view, in[4].view, in[5].view, in[6].view};
  }
  LayerOutputs outputs() const { return {o.view, lse.view, topk.view}; }
};

CallArgs import_call(const LayerCallArgs& a, const DeviceRef& dev) {
  CallArgs c{
      {arg(a.q_nope, "q_nope"), arg(a.q_pe, "q_pe"), arg(a.c_kv, "c_kv"), arg(a.k_pe, "k_pe"),
       arg(a.idx_q, "idx_q"), arg(a.idx_k, "idx_k"), arg(a.idx_w, "idx_w")},
      arg(a.o, "o", true, true),
      arg(a.lse, "lse", true, true),
      arg(a.topk, "topk", true, true)};
  check_same_device(dev, {&c.in[0], &c.in[1], &c.in[2], &c.in[3], &c.in[4], &c.in[5], &c.in[6],
                          &c.o, &c.lse, &c.topk});
  return c;
}

}  // namespace

nb::tuple PyLayer::forward(nb::handle batch, const LayerCallArgs& a,
                           std::optional<uint64_t> stream) {
  check_pools("forward");
  const DeviceRef dev = kv->device;
  const CallArgs c = import_call(a, dev);
  const bool is_prepared = nb::isinstance<PyPrepared>(batch);
  if (!is_prepared && !nb::isinstance<Batch>(batch))
    throw nb::type_error("batch: expected a dsakit.Batch or a dsakit.PreparedBatch");
  const PyPrepared* prepared = is_prepared ? &nb::cast<const PyPrepared&>(batch) : nullptr;
  const Batch* plain = is_prepared ? nullptr : &nb::cast<const Batch&>(batch);
  LayerResult res;
  {
    nb::gil_scoped_release nogil;
    Call call(*slot, stream);
    check_pools("forward");  // again under the backend's lock: free() takes it too
    res = prepared ? layer->forward(prepared->batch, c.inputs(), c.outputs())
                   : layer->forward(*plain, c.inputs(), c.outputs());
  }
  // A given output that was written comes back as given; topk is undefined (None) when no
  // request took the sparse path.
  const auto out = [&](const Arg& given, nb::handle obj, const Tensor& t) -> nb::object {
    if (!t.defined()) return nb::none();
    if (given.given()) return nb::borrow(obj);
    return export_tensor(t, dev);
  };
  std::vector<std::pair<std::string, double>> stages;
  for (const StageTime& s : res.stages) stages.emplace_back(s.stage, s.ms);
  return nb::make_tuple(out(c.o, a.o, res.o), out(c.lse, a.lse, res.lse),
                        out(c.topk, a.topk, res.topk), res.plan, stages);
}

double PyLayer::time_forward(const Batch& batch, const LayerCallArgs& a, int repeats) {
  check_pools("time_forward");
  DSAKIT_CHECK_ARG(repeats >= 1, "repeats: expected >= 1, got ", repeats);
  const CallArgs c = import_call(a, kv->device);
  nb::gil_scoped_release nogil;
  Call call(*slot, std::nullopt);
  check_pools("time_forward");
  const LayerInputs li = c.inputs();
  const LayerOutputs lo = c.outputs();
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < repeats; ++i) layer->forward(batch, li, lo);
  call.be.synchronize();
  const auto t1 = std::chrono::steady_clock::now();
  return std::chrono::duration<double, std::micro>(t1 - t0).count() / repeats;
}

// ---- registration ------------------------------------------------------------------------------

void bind_layer(nb::module_& m) {
  nb::class_<ModelConfig>(m, "ModelConfig",
                          "Model configuration of one DSA attention layer (docs/config.md).")
      .def_static("load", &ModelConfig::load, "preset_or_path"_a,
                  "A preset name ('deepseek-v3.2', 'glm-5') or a path to a Hugging Face "
                  "config.json.")
      .def_static("preset", &ModelConfig::preset, "name"_a)
      .def_static("from_json", &ModelConfig::from_json, "json_text"_a, "origin"_a = "json")
      .def_static("preset_names", &ModelConfig::preset_names)
      .def("with_tp", &ModelConfig::with_tp, "tp"_a, "A copy with the heads sharded over tp ranks.")
      .def("softmax_scale", &ModelConfig::softmax_scale)
      .def("validate", &ModelConfig::validate)
      .def("summary", &ModelConfig::summary)
      .def("to_json", &ModelConfig::to_json)
      .def_rw("name", &ModelConfig::name)
      .def_rw("num_heads", &ModelConfig::num_heads)
      .def_rw("num_heads_total", &ModelConfig::num_heads_total)
      .def_rw("tp_size", &ModelConfig::tp_size)
      .def_rw("kv_lora_rank", &ModelConfig::kv_lora_rank)
      .def_rw("qk_nope_head_dim", &ModelConfig::qk_nope_head_dim)
      .def_rw("qk_rope_head_dim", &ModelConfig::qk_rope_head_dim)
      .def_rw("v_head_dim", &ModelConfig::v_head_dim)
      .def_rw("q_lora_rank", &ModelConfig::q_lora_rank)
      .def_rw("index_n_heads", &ModelConfig::index_n_heads)
      .def_rw("index_head_dim", &ModelConfig::index_head_dim)
      .def_rw("index_topk", &ModelConfig::index_topk)
      .def_rw("hidden_size", &ModelConfig::hidden_size)
      .def_prop_ro("rope_type", [](const ModelConfig& c) { return c.rope.type; })
      .def_prop_ro("rope_factor", [](const ModelConfig& c) { return c.rope.factor; })
      .def_prop_ro("rope_mscale_all_dim",
                   [](const ModelConfig& c) { return c.rope.mscale_all_dim; })
      .def("__repr__", [](const ModelConfig& c) { return "ModelConfig(" + c.summary() + ")"; });

  nb::class_<PyKvPool>(m, "KvPool",
                       "The paged latent KV pool (docs/formats.md): layout bf16 (1152 B/token), "
                       "fp8 (656 B) or fp8-raw (576 B).")
      .def(
          "__init__",
          [](PyKvPool* self, const std::string& layout, int page_size, int64_t num_pages,
             const std::string& device, int d_c, int d_rope, const std::string& scale_policy,
             float k_scale) {
            KvPoolDesc d;
            d.layout = parse_kv_layout(layout);
            d.page_size = page_size;
            d.num_pages = num_pages;
            d.d_c = d_c;
            d.d_rope = d_rope;
            d.scale_policy = parse_scale_policy(scale_policy);
            d.k_scale = k_scale;
            d.validate();
            new (self) PyKvPool(d, parse_device(device));
          },
          "layout"_a, "page_size"_a, "num_pages"_a, "device"_a = "cpu", nb::kw_only(),
          "d_c"_a = 512, "d_rope"_a = 64, "scale_policy"_a = "pow2", "k_scale"_a = 1.0f)
      .def_static(
          "wrap",
          [](nb::handle storage, const std::string& layout, int page_size, int d_c, int d_rope,
             const std::string& scale_policy, float k_scale) {
            KvPoolDesc d;
            d.layout = parse_kv_layout(layout);
            d.page_size = page_size;
            d.d_c = d_c;
            d.d_rope = d_rope;
            d.scale_policy = parse_scale_policy(scale_policy);
            d.k_scale = k_scale;
            return wrap_kv_storage(storage, d);
          },
          "storage"_a.none(), "layout"_a, "page_size"_a, nb::kw_only(), "d_c"_a = 512,
          "d_rope"_a = 64, "scale_policy"_a = "amax", "k_scale"_a = 1.0f,
          "A pool over the caller's memory (zero-copy): a contiguous tensor of token rows.")
      .def_prop_ro(
          "layout",
          [](const PyKvPool& p) { return std::string(to_string(p.get("layout").layout())); })
      .def_prop_ro("page_size",
                   [](const PyKvPool& p) { return p.get("page_size").desc().page_size; })
      .def_prop_ro("num_pages",
                   [](const PyKvPool& p) { return p.get("num_pages").desc().num_pages; })
      .def_prop_ro("num_locations",
                   [](const PyKvPool& p) { return p.get("num_locations").desc().num_locations(); })
      .def_prop_ro(
          "bytes_per_token",
          [](const PyKvPool& p) { return p.get("bytes_per_token").desc().bytes_per_token(); })
      .def_prop_ro("d_c", [](const PyKvPool& p) { return p.get("d_c").desc().d_c; })
      .def_prop_ro("d_rope", [](const PyKvPool& p) { return p.get("d_rope").desc().d_rope; })
      .def_prop_ro("scale_policy",
                   [](const PyKvPool& p) {
                     return std::string(to_string(p.get("scale_policy").desc().scale_policy));
                   })
      .def_prop_ro("k_scale", [](const PyKvPool& p) { return p.get("k_scale").desc().k_scale; })
      .def_prop_ro("device", [](const PyKvPool& p) { return p.device.str(); })
      .def_prop_ro("freed", [](const PyKvPool& p) { return !p.pool.has_value(); })
      .def_prop_ro("wrapped", [](const PyKvPool& p) { return p.owner.given(); })
      .def("summary", [](const PyKvPool& p) { return p.get("summary").desc().summary(); })
      .def(
          "_storage",
          [](const PyKvPool& p) -> nb::object {
            const PagedKvPool& pool = p.get("storage");
            if (p.owner.given()) return nb::none();  // the Python side returns the wrapped object
            return export_tensor(pool.storage_tensor(), p.device);
          },
          "The pool's bytes u8 [num_locations, bytes_per_token], zero-copy.")
      .def_prop_ro("_owner", [](const PyKvPool& p) { return p.owner_obj; })
      .def(
          "free",
          [](PyKvPool& p) {
            release_pool(p);
            p.owner = Arg{};
            p.owner_obj = nb::object();
          },
          "Releases the pool's memory (views of it taken earlier stay valid); later use raises.");

  nb::class_<PyIndexPool>(m, "IndexPool",
                          "The indexer-key pool: per page, page_size·d_i e4m3 bytes then "
                          "page_size fp32 scales.")
      .def(
          "__init__",
          [](PyIndexPool* self, int page_size, int64_t num_pages, const std::string& device,
             int d_i) {
            IndexKeyPoolDesc d{page_size, num_pages, d_i};
            d.validate();
            new (self) PyIndexPool();
            self->device = parse_device(device);
            BackendSlot& slot = backend_for(self->device);
            nb::gil_scoped_release nogil;
            Call call(slot, std::nullopt);
            self->pool = call.be.make_index_pool(d);
            call.be.synchronize();
          },
          "page_size"_a, "num_pages"_a, "device"_a = "cpu", nb::kw_only(), "d_i"_a = 128)
      .def_static(
          "wrap",
          [](nb::handle storage, int page_size, int d_i) {
            return wrap_index_storage(storage, IndexKeyPoolDesc{page_size, 1, d_i});
          },
          "storage"_a.none(), "page_size"_a, nb::kw_only(), "d_i"_a = 128)
      .def_prop_ro("page_size",
                   [](const PyIndexPool& p) { return p.get("page_size").desc().page_size; })
      .def_prop_ro("num_pages",
                   [](const PyIndexPool& p) { return p.get("num_pages").desc().num_pages; })
      .def_prop_ro("d_i", [](const PyIndexPool& p) { return p.get("d_i").desc().d_i; })
      .def_prop_ro("device", [](const PyIndexPool& p) { return p.device.str(); })
      .def_prop_ro("freed", [](const PyIndexPool& p) { return !p.pool.has_value(); })
      .def_prop_ro("wrapped", [](const PyIndexPool& p) { return p.owner.given(); })
      .def("_storage",
           [](const PyIndexPool& p) -> nb::object {
             const IndexKeyPool& pool = p.get("storage");
             if (p.owner.given()) return nb::none();
             return export_tensor(pool.storage_tensor(), p.device);
           })
      .def_prop_ro("_owner", [](const PyIndexPool& p) { return p.owner_obj; })
      .def("free", [](PyIndexPool& p) {
        release_pool(p);
        p.owner = Arg{};
        p.owner_obj = nb::object();
      });

  nb::class_<Batch>(m, "Batch",
                    "A batch of requests: per-request cached prefix and new-token counts and page "
                    "tables (docs/design.md#paged-pool).")
      .def(
          "__init__",
          [](Batch* self, nb::handle prefix_lens, nb::handle extend_lens, nb::handle page_tables,
             std::optional<int> page_size, const std::string& mode, bool shared_prefix_pages,
             bool cuda_graph, bool speculative, bool context_parallel,
             bool hierarchical_sparse_cache) {
            Batch b;
            b.mode = parse_forward_mode(mode);
            b.prefix_lens = int_values(prefix_lens, "prefix_lens");
            b.extend_lens = int_values(extend_lens, "extend_lens");
            DSAKIT_CHECK_ARG(b.prefix_lens.size() == b.extend_lens.size(),
                             "extend_lens: ", b.extend_lens.size(), " values for ",
                             b.prefix_lens.size(), " requests (prefix_lens)");
            b.page_tables = page_table_values(page_tables, b, page_size);
            DSAKIT_CHECK_ARG(b.page_tables.size() == b.prefix_lens.size(),
                             "page_tables: ", b.page_tables.size(), " tables for ",
                             b.prefix_lens.size(), " requests");
            b.shared_prefix_pages = shared_prefix_pages;
            b.cuda_graph = cuda_graph;
            b.speculative = speculative;
            b.context_parallel = context_parallel;
            b.hierarchical_sparse_cache = hierarchical_sparse_cache;
            new (self) Batch(std::move(b));
          },
          "prefix_lens"_a, "extend_lens"_a, "page_tables"_a, nb::kw_only(),
          "page_size"_a = nb::none(), "mode"_a = "extend", "shared_prefix_pages"_a = false,
          "cuda_graph"_a = false, "speculative"_a = false, "context_parallel"_a = false,
          "hierarchical_sparse_cache"_a = false)
      .def_prop_ro("mode", [](const Batch& b) { return std::string(to_string(b.mode)); })
      .def_ro("prefix_lens", &Batch::prefix_lens)
      .def_ro("extend_lens", &Batch::extend_lens)
      .def_ro("page_tables", &Batch::page_tables)
      .def_ro("shared_prefix_pages", &Batch::shared_prefix_pages)
      .def_ro("cuda_graph", &Batch::cuda_graph)
      .def_ro("speculative", &Batch::speculative)
      .def_ro("context_parallel", &Batch::context_parallel)
      .def_ro("hierarchical_sparse_cache", &Batch::hierarchical_sparse_cache)
      .def_prop_ro("num_requests", &Batch::num_requests)
      .def_prop_ro("num_new_tokens", &Batch::num_new_tokens)
      .def_prop_ro("total_kv_len", &Batch::total_kv_len)
      .def_prop_ro("max_kv_len", &Batch::max_kv_len)
      .def("validate", &Batch::validate, "page_size"_a, "num_pages"_a)
      .def("slice", &Batch::slice, "first"_a, "count"_a)
      .def("__repr__", [](const Batch& b) {
        std::string s = "Batch(" + std::string(to_string(b.mode)) + ", " +
                        std::to_string(b.num_requests()) + " requests, " +
                        std::to_string(b.num_new_tokens()) + " new tokens, " +
                        std::to_string(b.total_kv_len()) + " positions)";
        return s;
      });

  nb::class_<Plan>(m, "Plan", "The dispatcher's decision and its reason (docs/dispatch.md).")
      .def_prop_ro("path", [](const Plan& p) { return path_name(p.path); })
      .def_prop_ro("mode", [](const Plan& p) { return std::string(to_string(p.mode)); })
      .def_ro("rule", &Plan::rule)
      .def_ro("approximate", &Plan::approximate)
      .def_ro("reason", &Plan::reason)
      .def_prop_ro(
          "segments",
          [](const Plan& p) {
            std::vector<std::tuple<int, int, std::string>> s;
            for (const PlanSegment& x : p.segments)
              s.emplace_back(x.first_request, x.num_requests, path_name(x.path));
            return s;
          },
          "(first_request, num_requests, path) per run of requests")
      .def_ro("predicted_dense_ms", &Plan::predicted_dense_ms)
      .def_ro("predicted_sparse_ms", &Plan::predicted_sparse_ms)
      .def_ro("predicted_masked_ms", &Plan::predicted_masked_ms)
      .def_prop_ro(
          "sparse_form", [](const Plan& p) { return std::string(to_string(p.sparse_form)); },
          "the form the plan's sparse segments take: 'mla' or 'masked-mha'")
      .def_ro("predicted_ms", &Plan::predicted_ms)
      .def(
          "path_of", [](const Plan& p, int r) { return path_name(p.path_of(r)); }, "request"_a)
      .def("__repr__",
           [](const Plan& p) { return "Plan(" + path_name(p.path) + ": " + p.reason + ")"; });

  nb::class_<LayerOptions>(m, "LayerOptions", "Options of a DsaAttention layer.")
      .def(
          "__init__",
          [](LayerOptions* self, double sm_scale, const std::string& output_dtype,
             const std::string& dispatch, int64_t threshold, bool allow_approximation,
             int64_t chunk_capacity, bool allow_split, double min_split_gain,
             std::optional<std::string> profile, bool time_stages, int64_t max_workspace_bytes,
             const std::string& sparse_rows, const std::string& sparse_form) {
            LayerOptions o;
            o.sm_scale = sm_scale;
            o.output_dtype = parse_dtype(output_dtype);
            o.policy.mode = parse_dispatch_mode(dispatch);
            o.policy.threshold = threshold;
            o.policy.allow_approximation = allow_approximation;
            o.policy.chunk_capacity = chunk_capacity;
            o.policy.allow_split = allow_split;
            o.policy.min_split_gain = min_split_gain;
            if (profile) o.policy = o.policy.with_profile(*profile);
            o.time_stages = time_stages;
            o.max_workspace_bytes = max_workspace_bytes;
            o.sparse_rows = parse_sparse_rows(sparse_rows);
            o.sparse_form = parse_sparse_form(sparse_form);
            new (self) LayerOptions(std::move(o));
          },
          nb::kw_only(), "sm_scale"_a = 0.0, "output_dtype"_a = "bf16", "dispatch"_a = "rule",
          "threshold"_a = -1, "allow_approximation"_a = false, "chunk_capacity"_a = 131072,
          "allow_split"_a = true, "min_split_gain"_a = 0.05, "profile"_a = nb::none(),
          "time_stages"_a = false, "max_workspace_bytes"_a = 0, "sparse_rows"_a = "auto",
          "sparse_form"_a = "auto")
      .def_rw("sm_scale", &LayerOptions::sm_scale)
      .def_prop_ro("output_dtype",
                   [](const LayerOptions& o) { return std::string(to_string(o.output_dtype)); })
      .def_prop_ro("dispatch",
                   [](const LayerOptions& o) { return std::string(to_string(o.policy.mode)); })
      .def_prop_ro("threshold", [](const LayerOptions& o) { return o.policy.threshold; })
      .def_prop_ro("profile", [](const LayerOptions& o) { return o.policy.profile_path; })
      .def_rw("time_stages", &LayerOptions::time_stages)
      .def_rw("max_workspace_bytes", &LayerOptions::max_workspace_bytes)
      .def_prop_ro("sparse_rows",
                   [](const LayerOptions& o) { return std::string(to_string(o.sparse_rows)); })
      .def_prop_ro("sparse_form",
                   [](const LayerOptions& o) { return std::string(to_string(o.sparse_form)); });

  nb::class_<PyPrepared>(m, "PreparedBatch",
                         "A batch planned by one layer with its index arrays on the device "
                         "(DsaAttention.prepare): forward() over it plans and uploads nothing, "
                         "so it can run inside CUDA-graph capture.")
      .def_prop_ro("plan", [](const PyPrepared& p) { return p.batch.plan(); })
      .def_prop_ro("batch", [](const PyPrepared& p) { return p.batch.batch(); });

  nb::class_<PyLayer>(m, "_DsaAttention")
      .def(nb::init<const ModelConfig&, nb::object, nb::object, nb::handle, const LayerOptions&,
                    nb::handle, nb::handle>(),
           "config"_a, "kv_pool"_a.none(), "index_pool"_a.none(), "kv_b_proj"_a.none(), "options"_a,
           "kv_b_proj_fp8_codes"_a.none(), "kv_b_proj_fp8_scales"_a.none())
      .def_prop_ro("config", [](const PyLayer& l) { return l.layer->config(); })
      .def_prop_ro("sm_scale", [](const PyLayer& l) { return l.layer->sm_scale(); })
      .def_prop_ro("options", [](const PyLayer& l) { return l.layer->options(); })
      .def_prop_ro("device", [](const PyLayer& l) { return l.kv->device.str(); })
      .def_prop_ro("kv_pool", [](const PyLayer& l) { return l.kv_ref; })
      .def_prop_ro("index_pool", [](const PyLayer& l) { return l.ix_ref; })
      .def(
          "plan",
          [](const PyLayer& l, const Batch& b) {
            l.check_pools("plan");
            return l.layer->plan(b);
          },
          "batch"_a)
      .def(
          "prepare",
          [](nb::object self, const Batch& b, std::optional<uint64_t> stream) {
            PyLayer& l = nb::cast<PyLayer&>(self);
            l.check_pools("prepare");
            PyPrepared p;
            p.layer_ref = self;
            {
              nb::gil_scoped_release nogil;
              Call call(*l.slot, stream);
              l.check_pools("prepare");
              p.batch = l.layer->prepare(b);
            }
            return p;
          },
          "batch"_a, "stream"_a.none() = nb::none())
      .def(
          "workspace_bytes",
          [](const PyLayer& l, const Batch& b, const std::string& path) {
            if (path == "plan") return l.layer->workspace_bytes(b, l.layer->plan(b));
            return l.layer->workspace_bytes(b, parse_path(path));
          },
          "batch"_a, "path"_a = "plan")
      .def(
          "set_dispatch",
          [](PyLayer& l, const std::string& mode) {
            DispatchPolicy p = l.layer->options().policy;
            p.mode = parse_dispatch_mode(mode);
            l.layer->set_policy(p);
          },
          "mode"_a)
      .def(
          "forward",
          [](PyLayer& l, nb::handle batch, nb::handle q_nope, nb::handle q_pe, nb::handle c_kv,
             nb::handle k_pe, nb::handle idx_q, nb::handle idx_k, nb::handle idx_w, nb::handle o,
             nb::handle lse, nb::handle topk, std::optional<uint64_t> stream) {
            return l.forward(batch, {q_nope, q_pe, c_kv, k_pe, idx_q, idx_k, idx_w, o, lse, topk},
                             stream);
          },
          "batch"_a.none(), "q_nope"_a.none(), "q_pe"_a.none(), "c_kv"_a.none(), "k_pe"_a.none(),
          "idx_q"_a.none(), "idx_k"_a.none(), "idx_w"_a.none(), "o"_a.none(), "lse"_a.none(),
          "topk"_a.none(), "stream"_a.none())
      .def(
          "_time_forward",
          [](PyLayer& l, const Batch& batch, nb::handle q_nope, nb::handle q_pe, nb::handle c_kv,
             nb::handle k_pe, nb::handle idx_q, nb::handle idx_k, nb::handle idx_w, nb::handle o,
             nb::handle lse, nb::handle topk, int repeats) {
            return l.time_forward(
                batch, {q_nope, q_pe, c_kv, k_pe, idx_q, idx_k, idx_w, o, lse, topk}, repeats);
          },
          "batch"_a, "q_nope"_a.none(), "q_pe"_a.none(), "c_kv"_a.none(), "k_pe"_a.none(),
          "idx_q"_a.none(), "idx_k"_a.none(), "idx_w"_a.none(), "o"_a.none(), "lse"_a.none(),
          "topk"_a.none(), "repeats"_a,
          "Microseconds per call of the C++ forward alone, in a C++ loop (the binding's "
          "overhead benchmark).");
}

}  // namespace dsakit::py
